//! gRPC as the mesh's own answers speak it: which requests are gRPC, the
//! trailers-only response that stands for a local reply (a filter's denial, the
//! mesh's own error), and the `grpc-timeout` a call carries. A gRPC client reads an
//! HTTP 401 as an opaque transport error; the same denial as `grpc-status: 16` is
//! UNAUTHENTICATED with its message, as Envoy answers.

use std::time::Duration;

use http::{HeaderMap, HeaderValue};

use crate::wire::ResponseHead;

/// Whether a request with these headers is a gRPC call: `content-type:
/// application/grpc` or `application/grpc+<codec>` (gRPC-Web is not gRPC here: its
/// status travels in the body).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            let ct = ct.trim_start();
            let Some(rest) = ct
                .get(..16)
                .filter(|p| p.eq_ignore_ascii_case("application/grpc"))
                .map(|_| &ct[16..])
            else {
                return false;
            };
            rest.is_empty() || rest.starts_with('+') || rest.starts_with(';')
        })
}

/// Whether a request says it takes trailers (`te: trailers`), as gRPC requires of
/// every call: a gRPC status travels in trailers, and a client that cannot read them
/// would read every answer as a failure.
pub fn takes_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(http::header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            t.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .eq_ignore_ascii_case("trailers")
        })
}

/// The gRPC status that stands for an HTTP status the mesh answers with: the ones
/// the mesh's filters and errors use (401→16 UNAUTHENTICATED, 403→7
/// PERMISSION_DENIED, 429→8 RESOURCE_EXHAUSTED, 503→14 UNAVAILABLE, 504→4
/// DEADLINE_EXCEEDED), then gRPC's own HTTP mapping, else 2 UNKNOWN.
pub fn status_for_http(status: u16) -> u32 {
    match status {
        200 => 0,
        400 => 13,
        401 => 16,
        403 => 7,
        404 => 12,
        408 | 504 => 4,
        413 | 429 | 431 => 8,
        501 => 12,
        502 | 503 => 14,
        _ => 2,
    }
}

/// The status codes' names, by code (0–16), as gRPC's spec and Envoy's `retry_on`
/// spell them in lowercase with dashes.
pub const STATUS_NAMES: [&str; 17] = [
    "ok",
    "cancelled",
    "unknown",
    "invalid-argument",
    "deadline-exceeded",
    "not-found",
    "already-exists",
    "permission-denied",
    "resource-exhausted",
    "failed-precondition",
    "aborted",
    "out-of-range",
    "unimplemented",
    "internal",
    "unavailable",
    "data-loss",
    "unauthenticated",
];

/// The gRPC status of an answer to a gRPC call: `grpc-status` from its trailers, or
/// from its headers (a trailers-only answer); without one, what its HTTP status
/// stands for ([`status_for_http`]: an answer that never reached a gRPC server, a
/// proxy's 503). A status that is not a number 0–16 is 2 UNKNOWN, as clients read it.
pub fn status_of(head: &ResponseHead) -> u32 {
    let field = head
        .trailers
        .get("grpc-status")
        .or_else(|| head.headers.get("grpc-status"));
    match field {
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.parse::<u32>().ok())
            .filter(|c| *c <= 16)
            .unwrap_or(2),
        None if head.status == 200 => 2,
        None => status_for_http(head.status),
    }
}

/// `grpc-message` as the spec writes it: bytes outside printable ASCII, and `%`,
/// percent-encoded.
pub fn encode_message(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The trailers-only answer that stands for the local reply `head` with `body`:
/// HTTP 200, `content-type: application/grpc`, `grpc-status` from the HTTP status,
/// `grpc-message` from the body (its first line, trimmed), and the reply's other
/// headers (a `www-authenticate`, rate-limit headers) kept. An answer that is
/// already gRPC (it has a `grpc-status`) is returned as it is.
pub fn local_reply(head: &ResponseHead, body: &[u8]) -> ResponseHead {
    if head.headers.contains_key("grpc-status") {
        return head.clone();
    }
    let mut headers = HeaderMap::with_capacity(head.headers.len() + 3);
    for (name, value) in &head.headers {
        if name == http::header::CONTENT_TYPE || name == http::header::CONTENT_LENGTH {
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert(
        "grpc-status",
        HeaderValue::from(status_for_http(head.status)),
    );
    let text = String::from_utf8_lossy(body);
    let line = text.lines().next().unwrap_or("").trim();
    let message = if line.is_empty() {
        format!("HTTP status {}", head.status)
    } else {
        line.to_owned()
    };
    if let Ok(v) = HeaderValue::from_str(&encode_message(&message)) {
        headers.insert("grpc-message", v);
    }
    ResponseHead {
        status: 200,
        headers,
        ..Default::default()
    }
}

/// Why a `grpc-timeout` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("grpc-timeout {0:?} is not 1 to 8 digits and a unit (H, M, S, m, u, n)")]
pub struct BadTimeout(pub String);

/// A `grpc-timeout` value: 1 to 8 ASCII digits and a unit, `H`ours, `M`inutes,
/// `S`econds, `m`illiseconds, `u`microseconds, `n`anoseconds.
pub fn parse_timeout(value: &str) -> Result<Duration, BadTimeout> {
    let bad = || BadTimeout(value.to_owned());
    let unit = value.chars().last().ok_or_else(bad)?;
    let digits = &value[..value.len() - unit.len_utf8()];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    Ok(match unit {
        'H' => Duration::from_secs(n * 3600),
        'M' => Duration::from_secs(n * 60),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return Err(bad()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn te_trailers_is_found_among_other_codings() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(http::header::TE, HeaderValue::from_str(v).unwrap());
            takes_trailers(&h)
        };
        assert!(with("trailers"));
        assert!(with("gzip, Trailers"));
        assert!(!with("gzip"));
        assert!(!with("trailersx"));
        assert!(!takes_trailers(&HeaderMap::new()));
    }

    #[test]
    fn the_status_comes_from_trailers_then_headers_then_the_http_status() {
        let mut head = ResponseHead {
            status: 200,
            ..Default::default()
        };
        assert_eq!(status_of(&head), 2, "a 200 without grpc-status is UNKNOWN");
        head.headers
            .insert("grpc-status", HeaderValue::from_static("7"));
        assert_eq!(status_of(&head), 7);
        head.trailers
            .insert("grpc-status", HeaderValue::from_static("14"));
        assert_eq!(status_of(&head), 14);
        head.trailers
            .insert("grpc-status", HeaderValue::from_static("99"));
        assert_eq!(status_of(&head), 2);
        let proxy = ResponseHead {
            status: 503,
            ..Default::default()
        };
        assert_eq!(status_of(&proxy), 14);
        assert_eq!(STATUS_NAMES[14], "unavailable");
    }

    fn headers(ct: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_str(ct).unwrap(),
        );
        h
    }

    #[test]
    fn grpc_is_told_by_its_content_type() {
        for (ct, want) in [
            ("application/grpc", true),
            ("application/grpc+proto", true),
            ("Application/GRPC+json", true),
            ("application/grpc;charset=utf-8", true),
            ("application/grpc-web", false),
            ("application/grpc-web+proto", false),
            ("application/json", false),
            ("application/grp", false),
        ] {
            assert_eq!(is_grpc(&headers(ct)), want, "{ct}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn http_statuses_map_as_envoy_and_the_issue_say() {
        for (http, grpc) in [
            (401, 16),
            (403, 7),
            (429, 8),
            (503, 14),
            (504, 4),
            (404, 12),
            (500, 2),
            (200, 0),
        ] {
            assert_eq!(status_for_http(http), grpc, "{http}");
        }
    }

    #[test]
    fn a_denial_becomes_a_trailers_only_answer_that_keeps_its_headers() {
        let mut h = headers("text/plain");
        h.insert("www-authenticate", HeaderValue::from_static("Bearer"));
        h.insert(http::header::CONTENT_LENGTH, HeaderValue::from_static("20"));
        let reply = local_reply(
            &ResponseHead {
                status: 401,
                headers: h,
                ..Default::default()
            },
            "dpumesh: no token, 100% sure\nmore".as_bytes(),
        );
        assert_eq!(reply.status, 200);
        assert_eq!(reply.headers["content-type"], "application/grpc");
        assert_eq!(reply.headers["grpc-status"], "16");
        assert_eq!(
            reply.headers["grpc-message"],
            "dpumesh: no token, 100%25 sure"
        );
        assert_eq!(reply.headers["www-authenticate"], "Bearer");
        assert!(!reply.headers.contains_key("content-length"));
        // Already gRPC: untouched.
        let mut g = headers("application/grpc");
        g.insert("grpc-status", HeaderValue::from_static("5"));
        let same = ResponseHead {
            status: 200,
            headers: g,
            ..Default::default()
        };
        assert_eq!(local_reply(&same, b"").headers["grpc-status"], "5");
        assert_eq!(encode_message("é"), "%C3%A9");
    }

    #[test]
    fn grpc_timeouts_parse_and_bad_ones_are_refused() {
        assert_eq!(parse_timeout("1S"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_timeout("250m"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_timeout("2H"), Ok(Duration::from_secs(7200)));
        assert_eq!(
            parse_timeout("99999999n"),
            Ok(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "S", "123456789S", "10x", "-1S", "1.5S", "1é"] {
            assert!(parse_timeout(bad).is_err(), "{bad}");
        }
    }
}

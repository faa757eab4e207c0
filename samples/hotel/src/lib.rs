//! The hotel-reservation sample: `frontend` calls `user` and
//! `reservation` in parallel, then merges their answers in an internal step. In the
//! sample mesh `user` runs on the frontend's node (the intra-node path, case 3) and
//! `reservation` on another node (the inter-node path, case 1).
//!
//! Endpoints (what the end-to-end tests and the benchmark use):
//! - frontend `GET /hotels?user=ID`: the merged JSON of both services.
//! - frontend `GET /ping`: a fixed 200 (the benchmark's tiny service).
//! - frontend `POST /echo`: the body reversed, with `x-crc32` and `x-len` of what arrived.
//! - frontend `GET /flaky?fail=1`: 500 while asked to fail (circuit breaker tests).
//! - frontend `GET /headers`: the request as the service received it (its path, its
//!   headers, and the caller as the mesh says it), as JSON: what the trust tests read.
//! - frontend `GET /catalog?mode=M`: a cacheable page (the DPU's response cache
//!   tests; `public`: the mesh's requests carry credentials): `fresh` (max-age=60,
//!   an ETag), `nostore`, `private`, `revalidate`
//!   (max-age=0 with an ETag and Last-Modified: every use asks the service, which
//!   answers 304 while it still holds), `vary` (varies on `accept-language`). Each
//!   answer says in `x-served` how many `/catalog` requests this process served;
//!   `GET /catalog-count` tells that count alone.
//! - user `GET /user?id=ID`, reservation `GET /reservations?user=ID`.

pub mod stream;

use dpumesh_host::{ExecutionContext, HttpResponse, Inputs};

/// The query parameter `key` of a URL.
fn param(url: &str, key: &str) -> Option<String> {
    let query = url.split_once('?')?.1;
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == key).then(|| v.to_owned())
    })
}

fn path(url: &str) -> &str {
    url.split_once('?').map_or(url, |(p, _)| p)
}

fn json(status: u16, value: &serde_json::Value) -> HttpResponse {
    HttpResponse::new(status, value.to_string()).header("content-type", "application/json")
}

/// What a service received: path, headers (every value, in order) and the caller.
fn received(request: &dpumesh_host::HttpRequest) -> serde_json::Value {
    let mut headers = serde_json::Map::new();
    for (name, value) in &request.headers {
        let values = headers
            .entry(name.as_str())
            .or_insert_with(|| serde_json::Value::Array(Vec::new()));
        if let serde_json::Value::Array(values) = values {
            values.push(String::from_utf8_lossy(value.as_bytes()).into());
        }
    }
    let caller = request.caller.as_ref().map(|c| {
        serde_json::json!({
            "addr": c.addr.to_string(),
            "identity": c.identity,
            "scheme": c.scheme,
        })
    });
    serde_json::json!({"url": request.url, "headers": headers, "caller": caller})
}

/// An echo of the request body: reversed, with what arrived in headers.
fn echo(ctx: &mut ExecutionContext) {
    let body = ctx.request().body.clone();
    ctx.respond(move |_| {
        let crc = crc32fast::hash(&body);
        let mut reversed = body.to_vec();
        reversed.reverse();
        Ok::<_, String>(
            HttpResponse::ok(reversed)
                .header("x-crc32", &crc.to_string())
                .header("x-len", &body.len().to_string()),
        )
    });
}

pub fn frontend(ctx: &mut ExecutionContext) {
    let url = ctx.request().url.clone();
    match path(&url) {
        "/ping" | "/limited" => {
            ctx.respond(|_| Ok::<_, String>(HttpResponse::ok("pong\n")));
        }
        "/echo" => echo(ctx),
        "/echo-stream" => stream::echo_stream(ctx),
        p if p.starts_with("/upload") => {
            let checksum = param(&url, "crc").is_none_or(|v| v != "0");
            stream::upload(ctx, checksum)
        }
        "/download" => {
            let len = param(&url, "bytes")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            ctx.respond(move |_| Ok::<_, String>(stream::download(len)));
        }
        "/events" => {
            let count = param(&url, "count")
                .and_then(|v| v.parse().ok())
                .unwrap_or(3);
            let every = param(&url, "every_ms")
                .and_then(|v| v.parse().ok())
                .unwrap_or(10);
            ctx.respond(move |_| {
                Ok::<_, String>(stream::events(
                    count,
                    std::time::Duration::from_millis(every),
                ))
            });
        }
        "/headers" => {
            let seen = received(ctx.request());
            ctx.respond(move |_| Ok::<_, String>(json(200, &seen)));
        }
        "/flaky" => {
            let fail = param(&url, "fail").is_some_and(|v| v == "1");
            ctx.respond(move |_| {
                Ok::<_, String>(if fail {
                    HttpResponse::new(500, "asked to fail\n")
                } else {
                    HttpResponse::ok("fine\n")
                })
            });
        }
        "/catalog" => catalog(ctx),
        "/catalog-count" => {
            let n = CATALOG_SERVED.load(std::sync::atomic::Ordering::Relaxed);
            ctx.respond(move |_| Ok::<_, String>(HttpResponse::ok(format!("{n}\n"))));
        }
        "/hotels" => {
            let user = param(&url, "user").unwrap_or_else(|| "0".into());
            ctx.parallel(|ctx| {
                ctx.get(&format!("http://user/user?id={user}")).id("user");
                ctx.get(&format!("http://reservation/reservations?user={user}"))
                    .id("reservation");
            });
            ctx.respond(|inputs: &Inputs| {
                let part = |id: &str| -> Result<serde_json::Value, String> {
                    let r = inputs.get(id).ok_or(format!("no {id} result"))?;
                    serde_json::from_slice(&r.body).map_err(|e| format!("{id}: {e}"))
                };
                let merged = serde_json::json!({
                    "user": part("user")?,
                    "reservations": part("reservation")?["reservations"],
                });
                Ok::<_, String>(json(200, &merged))
            })
            .inputs(["user", "reservation"]);
        }
        other => {
            let other = other.to_owned();
            ctx.respond(move |_| {
                Ok::<_, String>(HttpResponse::new(404, format!("frontend has no {other}\n")))
            });
        }
    }
}

/// `/catalog` requests this process answered.
static CATALOG_SERVED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A page whose caching the query chooses (see the module doc).
fn catalog(ctx: &mut ExecutionContext) {
    let request = ctx.request();
    let mode = param(&request.url, "mode").unwrap_or_else(|| "fresh".into());
    let language = request
        .header_str("accept-language")
        .unwrap_or("en")
        .to_owned();
    let if_none_match = request.header_str("if-none-match").map(str::to_owned);
    let n = CATALOG_SERVED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    ctx.respond(move |_| {
        const ETAG: &str = "\"catalog-v1\"";
        const MODIFIED: &str = "Sun, 01 Nov 2026 10:00:00 GMT";
        if mode == "revalidate" && if_none_match.as_deref() == Some(ETAG) {
            return Ok::<_, String>(
                HttpResponse::new(304, "")
                    .header("etag", ETAG)
                    .header("cache-control", "public, max-age=0")
                    .header("x-served", &n.to_string()),
            );
        }
        let body = format!("catalog ({mode}, {language}) served as #{n}\n");
        let response = HttpResponse::ok(body).header("x-served", &n.to_string());
        Ok(match mode.as_str() {
            "nostore" => response.header("cache-control", "no-store"),
            "private" => response.header("cache-control", "private, max-age=60"),
            "revalidate" => response
                .header("cache-control", "public, max-age=0")
                .header("etag", ETAG)
                .header("last-modified", MODIFIED),
            "vary" => response
                .header("cache-control", "public, max-age=60")
                .header("vary", "accept-language"),
            _ => response
                .header("cache-control", "public, max-age=60")
                .header("etag", ETAG),
        })
    });
}

/// The user service.
pub fn user(ctx: &mut ExecutionContext) {
    let id = param(&ctx.request().url, "id").unwrap_or_else(|| "0".into());
    ctx.respond(move |_| {
        Ok::<_, String>(json(
            200,
            &serde_json::json!({"id": id, "name": format!("guest-{id}")}),
        ))
    });
}

/// The reservation service.
pub fn reservation(ctx: &mut ExecutionContext) {
    let url = ctx.request().url.clone();
    if path(&url) == "/echo" {
        echo(ctx);
        return;
    }
    let user = param(&url, "user").unwrap_or_else(|| "0".into());
    ctx.respond(move |_| {
        Ok::<_, String>(json(
            200,
            &serde_json::json!({"user": user, "reservations": [
                {"hotel": "harbour-view", "nights": 2},
                {"hotel": "old-town", "nights": 1},
            ]}),
        ))
    });
}

/// The handler of a service by name.
/// The requests whose bodies the frontend reads as they arrive (the others come
/// whole).
pub fn streams_request(request: &dpumesh_host::HttpRequest) -> bool {
    let p = path(&request.url);
    p.starts_with("/upload") || p == "/echo-stream"
}

pub fn handler(service: &str) -> Option<fn(&mut ExecutionContext)> {
    Some(match service {
        "frontend" => frontend,
        "user" => user,
        "reservation" => reservation,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use dpumesh_host::memory::{InMemoryTransport, Reply};
    use dpumesh_host::{EventLoop, HttpRequest, LoopConfig};

    use super::*;

    #[test]
    fn the_frontend_merges_user_and_reservations() {
        let transport = InMemoryTransport::new()
            .service("user", |r| {
                Reply::ok_after(
                    5,
                    format!("{{\"id\":\"{}\"}}", param(&r.url, "id").unwrap()),
                )
            })
            .service("reservation", |_| {
                Reply::ok_after(5, r#"{"reservations":[{"hotel":"x"}]}"#)
            });
        let mut service = EventLoop::new(transport, frontend, LoopConfig::default()).unwrap();
        let id = service
            .transport()
            .inject(HttpRequest::get("/hotels?user=7"));
        service.run_until_idle().unwrap();
        let (_, response) = service.transport().response(id).unwrap();
        assert_eq!(response.status, 200, "{}", response.text());
        let v: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
        assert_eq!(v["user"]["id"], "7");
        assert_eq!(v["reservations"][0]["hotel"], "x");
    }
}

//! What a TLS client and a gRPC caller hand the ingress, as it reads them: any DER a
//! client certificate carries (`principal_of`), any `grpc-timeout`, any
//! `content-type`, and any local reply turned into a gRPC answer. Never a panic; a
//! timeout that parses is digits and a unit; an answer is always a well-formed
//! trailers-only response.
#![no_main]

use dpumesh_head::grpc::{is_grpc, local_reply, parse_timeout};
use dpumesh_head::wire::ResponseHead;
use dpumesh_ingress::tls::{in_mesh_domain, principal_of};
use libfuzzer_sys::fuzz_target;
use rustls::pki_types::CertificateDer;

fuzz_target!(|data: &[u8]| {
    if let Some(p) = principal_of(&CertificateDer::from(data)) {
        let _ = in_mesh_domain(&p, "dpumesh.local");
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if parse_timeout(text).is_ok() {
        let (digits, unit) = text.split_at(text.len() - 1);
        assert!(!digits.is_empty() && digits.len() <= 8);
        assert!(digits.bytes().all(|b| b.is_ascii_digit()));
        assert!("HMSmun".contains(unit));
    }
    let mut headers = http::HeaderMap::new();
    if let Ok(v) = http::HeaderValue::from_str(text) {
        headers.insert(http::header::CONTENT_TYPE, v);
        let _ = is_grpc(&headers);
    }
    let status = u16::from_le_bytes([
        data.first().copied().unwrap_or(0),
        data.get(1).copied().unwrap_or(0),
    ]);
    let reply = local_reply(
        &ResponseHead {
            status,
            headers,
            ..Default::default()
        },
        data,
    );
    if reply.headers.get("grpc-status").is_some() {
        let code = reply.headers["grpc-status"].to_str().unwrap();
        assert!(code.parse::<u32>().is_ok(), "{code}");
    }
});

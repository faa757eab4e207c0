//! HTTP/1 bytes from a client, through what the ingress runs before the fabric:
//! hyper's server with the ingress's limits, the framing tracker watching the same
//! bytes, the head as the mesh carries it, path normalization and the head's wire
//! form. Never a panic or a hang; every head hyper accepts encodes, and a head whose
//! path normalizes carries a canonical path.
#![no_main]

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use dpumesh_head::path::{PathConfig, normalize};
use dpumesh_head::{RequestHead, wire};
use dpumesh_ingress::framing::{Ambiguous, Sniff, Tracker};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

thread_local! {
    static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
}

async fn serve(data: &[u8]) {
    let (client, server) = tokio::io::duplex(64 << 10);
    let found = Arc::new(parking_lot::Mutex::new(Ambiguous::default()));
    let io = Sniff::new(server, Tracker::new(32 << 10, found.clone()));
    let service =
        hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
            let peer = "192.0.2.7:1234".parse().unwrap();
            if let Ok(mut head) = RequestHead::from_request(&req, peer) {
                head.remove_hop_by_hop();
                if head.normalize_path(&PathConfig::default()).is_ok() {
                    let path = head.path.clone();
                    assert_eq!(normalize(&path, &PathConfig::default()).unwrap(), path);
                }
                let _ = wire::encode_request(&head);
            }
            let _ = req.into_body().collect().await;
            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::new())))
        });
    let conn = hyper::server::conn::http1::Builder::new()
        .max_buf_size(32 << 10)
        .max_headers(100)
        .serve_connection(TokioIo::new(io), service);
    let (mut read, mut write) = tokio::io::split(client);
    let talk = async {
        let _ = write.write_all(data).await;
        let _ = write.shutdown().await;
    };
    let listen = async {
        let mut sink = Vec::new();
        let _ = read.read_to_end(&mut sink).await;
    };
    let _ = tokio::join!(conn, talk, listen);
}

fuzz_target!(|data: &[u8]| {
    RT.with(|rt| rt.block_on(serve(data)));
});

//! Streamed answers end to end: the hotel frontend's `/download` (bytes made as the
//! client reads them) and `/events` (server-sent events), through the ingress and
//! the DPU proxy, read by curl over HTTP/1.1 and h2c, by a client that stops reading
//! for a while, and by clients that leave mid-stream.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

mod common;
use common::mesh::*;
use common::token;

/// curl's output for `path` with `args`, and its exit status.
fn curl(mesh: &Mesh, token: &str, path: &str, args: &[&str]) -> (bool, Vec<u8>) {
    let out = Command::new("curl")
        .args(["-s", "--fail-with-body", "--max-time", "60", "-H"])
        .arg(format!("authorization: Bearer {token}"))
        .args(args)
        .arg(format!("http://{}{path}", mesh.ingress))
        .output()
        .expect("curl runs");
    (out.status.success(), out.stdout)
}

fn check_download(body: &[u8], len: usize) {
    assert_eq!(body.len(), len, "the whole download arrives");
    // The frontend's pattern (`samples/hotel/src/stream.rs`).
    if let Some(i) = (0..len).find(|&i| body[i] != (i % 251) as u8) {
        panic!("byte {i} of the download is wrong");
    }
}

/// Opens `/download?bytes=len` on a raw connection (closed after the answer) and
/// reads `take` bytes of it: the stream and those bytes.
fn start_download(mesh: &Mesh, token: &str, len: u64, take: usize) -> (TcpStream, Vec<u8>) {
    let mut s = TcpStream::connect(mesh.ingress).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET /download?bytes={len} HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {token}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut got = vec![0u8; take];
    s.read_exact(&mut got).unwrap();
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got[..64])
    );
    (s, got)
}

#[test]
fn streamed_answers_flow_part_by_part_and_stop_when_their_client_leaves() {
    // Events sit idle at most a second on their route.
    let mesh = Mesh::up_edited(
        |m| m,
        |p| {
            let catch_all = "  - {path_prefix: /, service: frontend}";
            assert!(p.contains(catch_all), "the sample's catch-all route");
            p.replace(
                catch_all,
                &format!(
                    "  - {{path_prefix: /events, service: frontend, stream_idle_timeout: 1s}}\n{catch_all}"
                ),
            )
        },
    );
    let alice = token("alice", &["user"]);

    // A body eight times the ingress's buffers (max_body 8 MiB), over HTTP/1.1
    // (chunked) and h2c.
    let len = 64 << 20;
    let (ok, body) = curl(&mesh, &alice, &format!("/download?bytes={len}"), &[]);
    assert!(
        ok,
        "the download succeeds: {}",
        String::from_utf8_lossy(&body[..body.len().min(300)])
    );
    check_download(&body, len);
    let (ok, body) = curl(
        &mesh,
        &alice,
        &format!("/download?bytes={len}"),
        &["--http2-prior-knowledge"],
    );
    assert!(ok, "the download succeeds over h2c");
    check_download(&body, len);

    // A plain HTTP/1.1 client that closes after the answer reads it whole too.
    let (status, _, body) = mesh.get("/download?bytes=100000", Some(&alice));
    assert_eq!(status, 200);
    check_download(&body, 100_000);

    // Server-sent events arrive as the service makes them.
    let (ok, body) = curl(&mesh, &alice, "/events?count=5&every_ms=20", &["-N"]);
    assert!(ok);
    let text = String::from_utf8(body).unwrap();
    for i in 0..5 {
        assert!(
            text.contains(&format!("id: {i}\ndata: event {i}\n\n")),
            "{text}"
        );
    }

    // A stream with nothing moving past its route's idle limit is aborted: the client
    // has what came, and the body is not ended as if it were whole.
    let (ok, body) = curl(&mesh, &alice, "/events?count=3&every_ms=4000", &["-N"]);
    let text = String::from_utf8(body).unwrap();
    assert!(!ok, "an aborted stream is not a complete answer: {text}");
    assert!(text.contains("data: event 0\n"), "{text}");
    assert!(!text.contains("data: event 1\n"), "{text}");

    // A client that stops reading holds the stream (back-pressure) and gets it
    // whole when it reads again.
    let (mut slow, mut got) = start_download(&mesh, &alice, 32 << 20, 4096);
    std::thread::sleep(Duration::from_secs(2));
    slow.read_to_end(&mut got).unwrap();
    let head_end = got.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let body = dechunk(&got[head_end..]).expect("the whole chunked body after the pause");
    check_download(&body, 32 << 20);

    // Clients that leave mid-stream cancel it: the service's slots come back, so
    // many more such streams than a pod has slots (32 bodies) leave it serving. (A
    // stream holds its client's share of the ingress's slots until its body is done
    // with, so a start may be refused with 429 while the client's earlier ones are
    // still being noticed gone: the share doing its work.)
    let mut started = 0;
    for _ in 0..40 {
        let mut s = TcpStream::connect(mesh.ingress).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "GET /download?bytes={} HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\nconnection: close\r\n\r\n",
            1u64 << 30
        )
        .unwrap();
        let mut got = vec![0u8; 256 << 10];
        if s.read_exact(&mut got).is_ok() && got.starts_with(b"HTTP/1.1 200") {
            started += 1;
        }
    }
    assert!(started >= 32, "{started} of 40 downloads started");
    let mut last = (false, Vec::new());
    for _ in 0..60 {
        last = curl(&mesh, &alice, "/download?bytes=1000000", &[]);
        if last.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        last.0,
        "the service still streams after 40 cancelled downloads"
    );
    check_download(&last.1, 1_000_000);
    let (status, _, _) = mesh.get("/ping", Some(&alice));
    assert_eq!(status, 200);
}

//! Streamed request bodies end to end: the hotel frontend's `/upload` (the body read
//! as it arrives, answered with its length and CRC-32) and `/echo-stream` (the body
//! sent back as it arrives), through the ingress and the DPU proxy, sent by curl over
//! HTTP/1.1 and h2c, by a raw client with trailers, and by clients that leave
//! mid-body; and a route that buffers bodies, where `max_body` still applies.

use std::io::Write;
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

mod common;
use common::mesh::*;
use common::token;

/// curl's output for a POST of `file` to `path` with `args`, and its exit status.
fn curl_post(
    mesh: &Mesh,
    token: &str,
    path: &str,
    file: &std::path::Path,
    args: &[&str],
) -> (bool, Vec<u8>) {
    let out = Command::new("curl")
        .args(["-s", "--fail-with-body", "--max-time", "120", "-H"])
        .arg(format!("authorization: Bearer {token}"))
        .arg("--data-binary")
        .arg(format!("@{}", file.display()))
        .args(args)
        .arg(format!("http://{}{path}", mesh.ingress))
        .output()
        .expect("curl runs");
    (out.status.success(), out.stdout)
}

/// `len` bytes that are not one repeated pattern (a part in the wrong place shows).
fn payload(len: usize) -> Vec<u8> {
    let mut x: u32 = 0x9e37_79b9;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

fn expected(body: &[u8]) -> String {
    format!("bytes={} crc32={:08x}\n", body.len(), crc32fast::hash(body))
}

/// Starts a chunked POST to `path` and sends `send` bytes of its body: the stream,
/// or why a write failed (the mesh answered and closed first: a refusal).
fn try_upload(mesh: &Mesh, token: &str, path: &str, send: usize) -> std::io::Result<TcpStream> {
    let mut s = TcpStream::connect(mesh.ingress)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {token}\r\ntransfer-encoding: chunked\r\n\r\n"
    )?;
    let part = payload(64 << 10);
    let mut sent = 0;
    while sent < send {
        write!(s, "{:x}\r\n", part.len())?;
        s.write_all(&part)?;
        s.write_all(b"\r\n")?;
        sent += part.len();
    }
    Ok(s)
}

/// [`try_upload`] that must get its bytes out.
fn start_upload(mesh: &Mesh, token: &str, path: &str, send: usize) -> TcpStream {
    try_upload(mesh, token, path, send).expect("the upload's bytes are sent")
}

#[test]
fn streamed_uploads_arrive_whole_both_ways_and_clients_that_leave_free_their_slots() {
    // A body with nothing moving for a second is cut off.
    let mesh = Mesh::up_edited(
        |m| {
            assert!(m.contains("body_timeout: 10s"), "the sample's body timeout");
            m.replace("body_timeout: 10s", "body_timeout: 1s")
        },
        |p| {
            let catch_all = "  - {path_prefix: /, service: frontend}";
            assert!(p.contains(catch_all), "the sample's catch-all route");
            p.replace(
                catch_all,
                &format!(
                    "  - {{path_prefix: /upload/buffered, service: frontend, buffer_body: true}}\n{catch_all}"
                ),
            )
        },
    );
    let alice = token("alice", &["user"]);
    let dir = tempfile::tempdir().unwrap();

    // A body eight times the ingress's buffers (max_body 8 MiB), sent with its
    // length over h2c and chunked over HTTP/1.1: the service reads it as it comes.
    let body = payload(64 << 20);
    let file = dir.path().join("upload");
    std::fs::write(&file, &body).unwrap();
    let (ok, answer) = curl_post(
        &mesh,
        &alice,
        "/upload",
        &file,
        &["--http2-prior-knowledge"],
    );
    assert!(
        ok,
        "the upload succeeds over h2c: {}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(String::from_utf8_lossy(&answer), expected(&body));
    let (ok, answer) = curl_post(
        &mesh,
        &alice,
        "/upload",
        &file,
        &["-H", "transfer-encoding: chunked"],
    );
    assert!(
        ok,
        "the chunked upload succeeds: {}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(String::from_utf8_lossy(&answer), expected(&body));

    // Both ways at once: the body comes back as it goes.
    let small = payload(3 << 20);
    let echo_file = dir.path().join("echo");
    std::fs::write(&echo_file, &small).unwrap();
    let (ok, answer) = curl_post(
        &mesh,
        &alice,
        "/echo-stream",
        &echo_file,
        &["--http2-prior-knowledge"],
    );
    assert!(ok, "the echo succeeds");
    assert!(answer == small, "the echo is the body, byte for byte");

    // A raw client's chunked body with a trailer: the trailer reaches the service
    // after the body.
    let mut s = start_upload(&mesh, &alice, "/upload", 256 << 10);
    s.write_all(b"0\r\nx-checksum: abc123\r\n\r\n").unwrap();
    let reply = read_response(&mut s).expect("an answer");
    assert_eq!(reply.0, 200, "{}", String::from_utf8_lossy(&reply.2));
    assert_eq!(
        String::from_utf8_lossy(&reply.2),
        expected(&payload(64 << 10).repeat(4))
    );
    assert_eq!(header(&reply.1, "x-trailer-checksum"), Some("abc123"));

    // Clients that leave mid-body end their uploads: the slots come back, so many
    // more of them than the ingress and the pod have slots leave the mesh serving.
    // (Some may be refused while the client's earlier ones still count against
    // its share: that is the share doing its work.)
    for _ in 0..40 {
        drop(try_upload(&mesh, &alice, "/upload", 1 << 20));
    }
    // The ingress notices each client leaving as its connection's task runs: on a
    // busy machine that may be after the next request comes, so the slots are
    // waited for (a leak would never give them back).
    let mut last = (false, Vec::new());
    for _ in 0..60 {
        last = curl_post(
            &mesh,
            &alice,
            "/upload",
            &echo_file,
            &["-H", "transfer-encoding: chunked"],
        );
        if last.0 {
            break;
        }
        eprintln!(
            "an upload right after the abandoned ones: {}",
            String::from_utf8_lossy(&last.1)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let (ok, answer) = last;
    assert!(
        ok,
        "the service takes uploads again after 40 abandoned ones: {}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(String::from_utf8_lossy(&answer), expected(&small));

    // A client that stops sending its body mid-way is cut off after the body
    // timeout (1 s here): an error answer saying why (not a wait for the request
    // timeout), and the mesh serves on.
    let mut s = start_upload(&mesh, &alice, "/upload", 128 << 10);
    let started = std::time::Instant::now();
    let reply = read_response(&mut s).expect("an answer to a stalled upload");
    assert_eq!(reply.0, 502, "{}", String::from_utf8_lossy(&reply.2));
    assert!(
        String::from_utf8_lossy(&reply.2).contains("sent nothing"),
        "{}",
        String::from_utf8_lossy(&reply.2)
    );
    eprintln!("a stalled upload was cut off after {:?}", started.elapsed());

    // A small body with its length comes whole (the handler sees it all).
    let reply = mesh.post("/upload", &alice, b"hello");
    assert_eq!(reply.0, 200);
    assert_eq!(String::from_utf8_lossy(&reply.2), expected(b"hello"));

    // A route that buffers bodies keeps the ingress's limit: past 8 MiB, 413 before
    // a byte is read; below it, the body arrives whole.
    let big = dir.path().join("big");
    std::fs::write(&big, payload(9 << 20)).unwrap();
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-H"])
        .arg(format!("authorization: Bearer {alice}"))
        .arg("--data-binary")
        .arg(format!("@{}", big.display()))
        .arg(format!("http://{}/upload/buffered", mesh.ingress))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "413");
    let (ok, answer) = curl_post(&mesh, &alice, "/upload/buffered", &echo_file, &[]);
    assert!(ok);
    assert_eq!(String::from_utf8_lossy(&answer), expected(&small));
}

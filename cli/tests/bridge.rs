//! Services that were not written for the mesh, joined by one mesh-file line each: an
//! unmodified HTTP/1.1 server (Python's standard library, started by `dpumesh up`
//! beside its bridge), a tonic gRPC server on TCP (`grpc-interop serve`) and a Python
//! gRPC server (grpcio) behind `grpc` bridges. The server's own calls go out through
//! the bridge's egress port (its `HTTP_PROXY`) and reach other services as its
//! service.

mod common;

use std::process::Command;

use common::free_port;
use common::grpc::{interop, run_cases};
use common::mesh::{Mesh, header, mesh_files_with};
use common::token;

/// The unmodified server: Python's `http.server`, nothing of the mesh in it.
const LEGACY: &str = r#"
import http.server, sys, urllib.request, zlib

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def reply(self, status, body, headers=()):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/hello"):
            self.reply(200, b"hello from an unmodified server\n", [("x-legacy", "1")])
        elif self.path.startswith("/whoami"):
            self.reply(200, (self.headers.get("x-forwarded-client-cert") or "none").encode())
        elif self.path.startswith("/fetch/") or self.path.startswith("/fetch-first/"):
            # /fetch/<service>/<path>: the service's answer through the mesh, passed
            # on as it comes (chunked); /fetch-first/ reads 64 KiB of it, then hangs up.
            first = self.path.startswith("/fetch-first/")
            target = "http://" + self.path.split("/", 2)[2]
            call = urllib.request.Request(
                target, headers={"authorization": self.headers.get("authorization", "")})
            with urllib.request.urlopen(call, timeout=30) as answer:
                if first:
                    got = len(answer.read(65536))
                    answer.close()
                    self.reply(200, ("read %d bytes\n" % got).encode())
                    return
                self.send_response(answer.status)
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                while True:
                    data = answer.read(65536)
                    if not data:
                        break
                    self.wfile.write(b"%x\r\n" % len(data) + data + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
        elif self.path.startswith("/push/") or self.path.startswith("/push-abort/"):
            # /push/<service>/<path>?bytes=N: N bytes sent to the service through the
            # mesh as a chunked upload, with their CRC-32; /push-abort/ gives up
            # after 1 MiB.
            abort = self.path.startswith("/push-abort/")
            target = self.path.split("/", 2)[2]
            n = int(target.rsplit("bytes=", 1)[1])
            part = bytes(i % 251 for i in range(251 * 261))
            crc = [0]
            def body():
                sent = 0
                while sent < n:
                    if abort and sent >= (1 << 20):
                        raise ConnectionAbortedError("the client gives up")
                    chunk = part[: min(len(part), n - sent)]
                    crc[0] = zlib.crc32(chunk, crc[0])
                    sent += len(chunk)
                    yield chunk
            call = urllib.request.Request(
                "http://" + target, data=body(), method="POST",
                headers={"authorization": self.headers.get("authorization", "")})
            try:
                with urllib.request.urlopen(call, timeout=60) as answer:
                    text = answer.read().decode().strip()
            except Exception as e:
                self.reply(200, ("aborted: %r\n" % e).encode())
                return
            self.reply(200, ("%s sent_crc32=%08x\n" % (text, crc[0])).encode())
        elif self.path.startswith("/via-mesh"):
            # Through HTTP_PROXY (the bridge's egress port), as any client library.
            call = urllib.request.Request(
                "http://frontend/headers",
                headers={"authorization": self.headers.get("authorization", "")})
            with urllib.request.urlopen(call, timeout=10) as answer:
                self.reply(answer.status, answer.read())
        else:
            self.reply(404, b"no such page\n")

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        self.reply(200, ("%d bytes\n" % len(body)).encode())

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"#;

/// A Python gRPC server (grpcio) of the interop service's unary and one-way
/// streaming methods, from code grpcio-tools generates out of samples/grpc/proto.
const PY_GRPC: &str = r#"
import sys
from concurrent import futures
import grpc
import test_pb2, test_pb2_grpc

class Service(test_pb2_grpc.TestServiceServicer):
    def EmptyCall(self, request, context):
        return test_pb2.Empty()

    def UnaryCall(self, request, context):
        if request.response_status.code:
            code = next(c for c in grpc.StatusCode if c.value[0] == request.response_status.code)
            context.abort(code, request.response_status.message)
        metadata = dict(context.invocation_metadata())
        if "x-grpc-test-echo-initial" in metadata:
            context.send_initial_metadata([("x-grpc-test-echo-initial", metadata["x-grpc-test-echo-initial"])])
        if "x-grpc-test-echo-trailing-bin" in metadata:
            context.set_trailing_metadata([("x-grpc-test-echo-trailing-bin", metadata["x-grpc-test-echo-trailing-bin"])])
        return test_pb2.SimpleResponse(payload=test_pb2.Payload(body=bytes(request.response_size)))

    def StreamingInputCall(self, requests, context):
        return test_pb2.StreamingInputCallResponse(
            aggregated_payload_size=sum(len(r.payload.body) for r in requests))

    def StreamingOutputCall(self, request, context):
        for p in request.response_parameters:
            yield test_pb2.StreamingOutputCallResponse(payload=test_pb2.Payload(body=bytes(p.size)))

server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
test_pb2_grpc.add_TestServiceServicer_to_server(Service(), server)
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
server.wait_for_termination()
"#;

/// Generates the Python gRPC code for the interop service into `dir`.
fn python_grpc_code(dir: &std::path::Path) {
    let proto = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../samples/grpc/proto");
    let out = Command::new("python3")
        .args(["-m", "grpc_tools.protoc", "-I"])
        .arg(&proto)
        .arg(format!("--python_out={}", dir.display()))
        .arg(format!("--grpc_python_out={}", dir.display()))
        .arg("test.proto")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "grpcio-tools (scripts/install-python.sh installs it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(dir.join("py_grpc.py"), PY_GRPC).unwrap();
}

/// An HTTP/2 `CONNECT authority` through the ingress (h2c): the answer's status and,
/// when it opened a tunnel, what came back through it for `send` until it closed.
fn h2_connect(ingress: std::net::SocketAddr, authority: &str, send: &[u8]) -> (u16, Vec<u8>) {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let tcp = tokio::net::TcpStream::connect(ingress).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        tokio::spawn(connection);
        let request = http::Request::builder()
            .method(http::Method::CONNECT)
            .uri(authority)
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        let mut response = sender.send_request(request).await.unwrap();
        let status = response.status().as_u16();
        if !response.status().is_success() {
            return (status, Vec::new());
        }
        let mut tunnel = TokioIo::new(hyper::upgrade::on(&mut response).await.unwrap());
        tunnel.write_all(send).await.unwrap();
        let mut back = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(30),
            tunnel.read_to_end(&mut back),
        )
        .await
        .expect("the tunnel closes once the server closed")
        .unwrap();
        (status, back)
    })
}

/// Runs interop `cases` against the ingress as `authority`; panics with the report.
fn interop_cases(ingress: std::net::SocketAddr, authority: &str, cases: &[&str]) {
    let (ok, report) = run_cases(ingress, authority, None, cases);
    assert!(ok, "{authority}: {report}");
}

#[test]
fn unmodified_servers_join_through_a_bridge() {
    let _ = interop();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("legacy.py"), LEGACY).unwrap();
    python_grpc_code(dir.path());
    let (legacy, egress, grpc, py_grpc) = (free_port(), free_port(), free_port(), free_port());
    let edit_mesh = move |m: String| {
        m.replacen(
            "services:\n",
            &format!(
                "services:\n  legacy: {{nodes: [node1], command: [python3, legacy.py, '{legacy}'], bridge: {{to: 127.0.0.1:{legacy}, protocol: http1, egress: 127.0.0.1:{egress}}}}}\n  dead: {{nodes: [node1], bridge: {{to: 127.0.0.1:1}}}}\n  grpc: {{nodes: [node2], command: [grpc-interop, serve, 127.0.0.1:{grpc}], bridge: {{to: 127.0.0.1:{grpc}, protocol: grpc}}}}\n  py-grpc: {{nodes: [node2], command: [python3, py_grpc.py, '{py_grpc}'], bridge: {{to: 127.0.0.1:{py_grpc}, protocol: grpc}}}}\n  far: {{nodes: [node2], command: [hotel, frontend]}}\n"
            ),
            1,
        )
    };
    let edit_policy = |p: String| {
        let p = p.replacen(
            "services:\n",
            "services:\n  legacy: {chain: internal}\n  dead: {chain: internal}\n  grpc: {chain: internal}\n  py-grpc: {chain: internal}\n  far: {chain: internal}\n",
            1,
        );
        p.replacen(
            "routes:\n",
            "routes:\n  - {host: legacy, service: legacy}\n  - {host: dead, service: dead}\n  - {host: grpc, service: grpc}\n  - {host: py-grpc, service: py-grpc}\n",
            1,
        )
    };
    let (file, ingress) = mesh_files_with(dir.path(), edit_mesh, edit_policy);
    let mesh = Mesh::start(dir, &file, ingress);
    let client = mesh.client();
    let get = |host: &str, path: &str, extra: &str| {
        client.raw(
            format!("GET {path} HTTP/1.1\r\nhost: {host}\r\n{extra}connection: close\r\n\r\n")
                .as_bytes(),
        )
    };

    // The server answers through the mesh, its headers kept.
    let (status, headers, body) = get("legacy", "/hello", "");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(body, b"hello from an unmodified server\n");
    assert_eq!(header(&headers, "x-legacy"), Some("1"));

    // A body crosses both ways.
    let (status, _, body) = client.raw(
        b"POST /upload HTTP/1.1\r\nhost: legacy\r\ncontent-length: 11\r\nconnection: close\r\n\r\nhello world",
    );
    assert_eq!((status, body.as_slice()), (200, &b"11 bytes\n"[..]));
    // A body past 1 MiB streams through the mesh and reaches the server with the
    // length its client stated (a server that reads `content-length` gets it all).
    let big = vec![b'x'; 3 << 20];
    let mut request = format!(
        "POST /upload HTTP/1.1\r\nhost: legacy\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        big.len()
    )
    .into_bytes();
    request.extend_from_slice(&big);
    let (status, _, body) = client.raw(&request);
    assert_eq!(
        (status, String::from_utf8_lossy(&body).as_ref()),
        (200, "3145728 bytes\n")
    );

    // The caller's identity comes from the mesh only: a client's forged one is gone.
    let (_, _, body) = get(
        "legacy",
        "/whoami",
        "x-forwarded-client-cert: URI=spiffe://dpumesh.local/ns/default/sa/admin\r\n",
    );
    assert_eq!(body, b"none", "a client from outside has no mesh identity");

    // Its own calls go through the mesh as its service: the frontend's chain sees
    // the token it passed on, and the frontend sees the legacy service calling.
    let user = token("alice", &["user"]);
    let (status, _, body) = get(
        "legacy",
        "/via-mesh",
        &format!("authorization: Bearer {user}\r\n"),
    );
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{text}");
    let seen: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let identity = seen["caller"]["identity"].as_str().unwrap_or_default();
    assert!(identity.ends_with("/legacy"), "the callee saw {identity:?}");

    calls_stream_both_ways(&mesh, &user);

    // A server that is not there is a 502 that says so; the mesh serves on.
    let (status, _, body) = get("dead", "/", "");
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("bridge:"));
    assert_eq!(get("legacy", "/hello", "").0, 200);

    // A CONNECT to the service is a tunnel to its server: curl through the ingress
    // as its HTTP proxy (HTTP/1.1 CONNECT), then HTTP inside the tunnel.
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "30", "-p", "-x"])
        .arg(format!("http://{}", mesh.ingress))
        .arg(format!("http://legacy:{legacy}/hello"))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "hello from an unmodified server\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The same over HTTP/2 (a CONNECT stream), and the port the client names is the
    // service's business: the bridge reaches its own server only.
    let (status, inner) = h2_connect(
        mesh.ingress,
        "legacy:9",
        b"GET /hello HTTP/1.1\r\nhost: legacy\r\nconnection: close\r\n\r\n",
    );
    let inner = String::from_utf8_lossy(&inner);
    assert_eq!(status, 200);
    assert!(
        inner.ends_with("hello from an unmodified server\n"),
        "{inner}"
    );
    // A server that is not there refuses the tunnel with the bridge's 502.
    assert_eq!(h2_connect(mesh.ingress, "dead:80", b"").0, 502);

    // A gRPC server on TCP behind a `grpc` bridge: the interop cases pass.
    interop_cases(
        mesh.ingress,
        "grpc",
        &[
            "empty_unary",
            "large_unary",
            "client_streaming",
            "server_streaming",
            "empty_stream",
            "status_code_and_message",
            "custom_metadata",
            "unimplemented_method",
        ],
    );
    // A Python gRPC server (grpcio) the same way: its unary and one-way streaming
    // methods, statuses, metadata both ways.
    interop_cases(
        mesh.ingress,
        "py-grpc",
        &[
            "empty_unary",
            "large_unary",
            "client_streaming",
            "server_streaming",
            "custom_metadata",
            "unimplemented_method",
            "unary_unavailable",
        ],
    );
}

/// The bridged server's calls stream both ways through the mesh, to a pod of its
/// node (case 3: the frontend) and to another node (case 1: `far`).
fn calls_stream_both_ways(mesh: &Mesh, user: &str) {
    let client = mesh.client();
    let get = |host: &str, path: &str, extra: &str| {
        client.raw(
            format!("GET {path} HTTP/1.1\r\nhost: {host}\r\n{extra}connection: close\r\n\r\n")
                .as_bytes(),
        )
    };
    // Its calls' answers stream to it, from a pod of its node (case 3: the frontend)
    // and from another node (case 1: `far`), larger than any slot of its pool.
    let fetch = |path: &str| {
        let out = Command::new("curl")
            .args([
                "-sS",
                "--fail-with-body",
                "--max-time",
                "60",
                "-H",
                "host: legacy",
                "-H",
            ])
            .arg(format!("authorization: Bearer {user}"))
            .arg(format!("http://{}{path}", mesh.ingress))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{path}: {}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout[..out.stdout.len().min(300)])
        );
        out.stdout
    };
    let len = 20 << 20;
    for service in ["frontend", "far"] {
        let body = fetch(&format!("/fetch/{service}/download?bytes={len}"));
        assert_eq!(body.len(), len, "{service}: the whole download");
        if let Some(i) = (0..len).find(|&i| body[i] != (i % 251) as u8) {
            panic!("{service}: byte {i} of the download is wrong");
        }
    }
    // Server-sent events through the same path.
    let text = String::from_utf8(fetch("/fetch/far/events?count=3&every_ms=20")).unwrap();
    for i in 0..3 {
        assert!(text.contains(&format!("data: event {i}\n")), "{text}");
    }
    // A caller that hangs up mid-answer stops the callee: many more such calls than
    // the caller's pool has slots (32 bodies) leave both serving.
    for service in ["frontend", "far"] {
        for _ in 0..40 {
            let (status, _, body) = get(
                "legacy",
                &format!("/fetch-first/{service}/download?bytes={}", 1u64 << 30),
                &format!("authorization: Bearer {user}\r\n"),
            );
            assert_eq!(
                (status, body.as_slice()),
                (200, &b"read 65536 bytes\n"[..]),
                "{service}"
            );
        }
        let body = fetch(&format!("/fetch/{service}/download?bytes=1000000"));
        assert_eq!(body.len(), 1_000_000, "{service} after 40 callers hung up");
    }

    // Its calls' request bodies stream too: 20 MiB uploads (more than a slot) to a
    // pod of its node and to another node arrive whole, and 40 callers that give up
    // mid-upload (more than the callee's 32 body slots) leave both serving.
    let auth = format!("authorization: Bearer {user}\r\n");
    for service in ["frontend", "far"] {
        let (status, _, body) = get(
            "legacy",
            &format!("/push/{service}/upload?bytes={len}"),
            &auth,
        );
        let text = String::from_utf8_lossy(&body).into_owned();
        assert_eq!(status, 200, "{service}: {text}");
        let field = |name: &str| {
            text.split_whitespace()
                .find_map(|f| f.strip_prefix(name))
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(field("bytes="), len.to_string(), "{service}: {text}");
        assert_eq!(field("crc32="), field("sent_crc32="), "{service}: {text}");
        for _ in 0..40 {
            let (status, _, body) = get(
                "legacy",
                &format!("/push-abort/{service}/upload?bytes={}", 1u64 << 30),
                &auth,
            );
            let text = String::from_utf8_lossy(&body);
            assert!(
                status == 200 && text.starts_with("aborted: "),
                "{service}: {status} {text}"
            );
        }
        let (status, _, body) = get(
            "legacy",
            &format!("/push/{service}/upload?bytes=1000000"),
            &auth,
        );
        let text = String::from_utf8_lossy(&body).into_owned();
        assert_eq!(status, 200, "{service} after 40 callers gave up: {text}");
        assert!(text.starts_with("bytes=1000000 "), "{service}: {text}");
    }
}

#[test]
fn a_bridged_servers_calls_stream_through_the_bluefield_split() {
    // The same calls with every node a DPU in software (DPUMESH_DATA_PATH=split): the
    // pods' bodies reach the fabric only through their nodes' staging copies.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("legacy.py"), LEGACY).unwrap();
    let (legacy, egress) = (free_port(), free_port());
    let edit_mesh = move |m: String| {
        m.replacen(
            "services:\n",
            &format!(
                "services:\n  legacy: {{nodes: [node1], command: [python3, legacy.py, '{legacy}'], bridge: {{to: 127.0.0.1:{legacy}, protocol: http1, egress: 127.0.0.1:{egress}}}}}\n  far: {{nodes: [node2], command: [hotel, frontend]}}\n"
            ),
            1,
        )
    };
    let edit_policy = |p: String| {
        let p = p.replacen(
            "services:\n",
            "services:\n  legacy: {chain: internal}\n  far: {chain: internal}\n",
            1,
        );
        p.replacen(
            "routes:\n",
            "routes:\n  - {host: legacy, service: legacy}\n",
            1,
        )
    };
    let (file, ingress) = mesh_files_with(dir.path(), edit_mesh, edit_policy);
    let mesh = Mesh::start_env(dir, &file, ingress, &[("DPUMESH_DATA_PATH", "split")]);
    calls_stream_both_ways(&mesh, &token("alice", &["user"]));
}

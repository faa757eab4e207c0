//! WebSocket through the mesh, with real peers: an unmodified WebSocket echo server
//! (Python's `websockets`, nothing of the mesh in it) joined by a one-line bridge,
//! and a `websockets` client through the ingress. The upgrade meets the route's
//! chain (no token: 401, nothing upgraded); then 10 000 messages echo both ways, a
//! 16 MiB message crosses in windows, and a connection with nothing moving is closed
//! at its route's idle limit.

mod common;

use std::process::Command;

use common::free_port;
use common::mesh::{Mesh, mesh_files_with, metric_sum};
use common::token;

/// The unmodified server: an echo of every message.
const SERVER: &str = r#"
import asyncio, sys
from websockets.asyncio.server import serve

async def echo(ws):
    async for message in ws:
        await ws.send(message)

async def main():
    async with serve(echo, "127.0.0.1", int(sys.argv[1]), max_size=None):
        await asyncio.get_running_loop().create_future()

asyncio.run(main())
"#;

/// The client: `python3 client.py URL CASE [TOKEN]`; prints what it saw, exits 0 when
/// the case went as it should.
const CLIENT: &str = r#"
import sys, time
from websockets.sync.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

url, case = sys.argv[1], sys.argv[2]
headers = {"authorization": "Bearer " + sys.argv[3]} if len(sys.argv) > 3 else {}

if case == "refused":
    try:
        connect(url, additional_headers=headers, open_timeout=10)
    except InvalidStatus as e:
        print("status", e.response.status_code)
        sys.exit(0 if e.response.status_code == 401 else 1)
    print("upgraded without a token")
    sys.exit(1)

# No compression: the bytes on the wire are the messages' own (a 16 MiB message is
# 16 MiB through the mesh).
with connect(url, additional_headers=headers, max_size=None, open_timeout=10, compression=None) as ws:
    if case == "echo":
        started = time.monotonic()
        for i in range(10000):
            message = ("message %d " % i) * (1 + i % 7)
            ws.send(message)
            if ws.recv(timeout=10) != message:
                print("echo", i, "differs")
                sys.exit(1)
        binary = bytes(range(256)) * 4096
        ws.send(binary)
        if ws.recv(timeout=10) != binary:
            print("binary echo differs")
            sys.exit(1)
        print("echoed 10000 messages in %.2f s" % (time.monotonic() - started))
        huge = bytes((i * 7) % 251 for i in range(16 << 20))
        ws.send(huge)
        if ws.recv(timeout=60) != huge:
            print("the 16 MiB message differs")
            sys.exit(1)
        print("echoed a 16 MiB message")
    elif case == "idle":
        ws.send("hello")
        assert ws.recv(timeout=10) == "hello"
        started = time.monotonic()
        try:
            ws.recv(timeout=20)
            print("a message came from nowhere")
            sys.exit(1)
        except ConnectionClosed:
            print("closed after %.1f s idle" % (time.monotonic() - started))
        except TimeoutError:
            print("still open after 20 s idle")
            sys.exit(1)
"#;

fn run(dir: &std::path::Path, args: &[&str]) -> (bool, String) {
    let out = Command::new("python3")
        .arg(dir.join("client.py"))
        .args(args)
        .output()
        .expect("python3 runs (scripts/install-python.sh installs websockets)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn websockets_cross_the_mesh_after_the_chain_lets_them() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ws_echo.py"), SERVER).unwrap();
    let port = free_port();
    let edit_mesh = move |m: String| {
        m.replacen(
            "services:\n",
            &format!(
                "services:\n  ws: {{nodes: [node1], command: [python3, ws_echo.py, '{port}'], bridge: {{to: 127.0.0.1:{port}, protocol: http1}}}}\n"
            ),
            1,
        )
    };
    let edit_policy = |p: String| {
        let p = p.replacen("chains:\n", "chains:\n  ws: [jwt]\n", 1);
        let p = p.replacen("services:\n", "services:\n  ws: {chain: ws}\n", 1);
        p.replacen(
            "routes:\n",
            "routes:\n  - {path_prefix: /ws-idle, service: ws, stream_idle_timeout: 1s}\n  - {path_prefix: /ws, service: ws}\n",
            1,
        )
    };
    let (file, ingress) = mesh_files_with(dir.path(), edit_mesh, edit_policy);
    let client_dir = tempfile::tempdir().unwrap();
    std::fs::write(client_dir.path().join("client.py"), CLIENT).unwrap();
    let mesh = Mesh::start(dir, &file, ingress);
    let url = format!("ws://{ingress}/ws");
    let user = token("alice", &["user"]);

    // No token: the chain refuses the upgrade (401), nothing is upgraded.
    let (ok, report) = run(client_dir.path(), &[&url, "refused"]);
    assert!(ok, "{report}");

    // With one: 10 000 messages echo, then a 16 MiB one crosses in windows.
    let (ok, report) = run(client_dir.path(), &[&url, "echo", &user]);
    assert!(ok, "{report}");
    eprintln!("{report}");

    // A connection with nothing moving is closed at its route's idle limit (1 s).
    let idle_url = format!("ws://{ingress}/ws-idle");
    let (ok, report) = run(client_dir.path(), &[&idle_url, "idle", &user]);
    assert!(ok, "{report}");

    // The mesh serves on, and counted what it carried.
    let (ok, report) = run(client_dir.path(), &[&url, "refused"]);
    assert!(ok, "{report}");
    let admin = mesh
        .ingress_admin
        .expect("the sample's ingress has an admin API");
    assert!(metric_sum(admin, "dpumesh_ingress_websockets_total") >= 2.0);
    let to_service = metric_sum(
        admin,
        "dpumesh_ingress_websocket_bytes_total{direction=\"to_service\"}",
    );
    let to_client = metric_sum(
        admin,
        "dpumesh_ingress_websocket_bytes_total{direction=\"to_client\"}",
    );
    // Counted when a connection ends: the echo's 16 MiB message each way, at least.
    assert!(
        to_service > (16 << 20) as f64 && to_client > (16 << 20) as f64,
        "both ways counted: {to_service} to the service, {to_client} to the client"
    );
}

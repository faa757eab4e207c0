//! gRPC's interop cases between this sample's client and its server on TCP (tonic to
//! tonic, no mesh): the baseline the mesh's runs of the same cases are read against
//! (`cli/tests/grpc.rs`, `cli/tests/bridge.rs`), and what builds `grpc-interop` for
//! them.

use std::net::TcpListener;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn every_interop_case_passes_against_the_server_on_tcp() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let _server = Server(
        Command::new(env!("CARGO_BIN_EXE_grpc-interop"))
            .args(["serve", &addr])
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(Instant::now() < deadline, "the server did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_grpc-interop"))
        .args(["client", "--server", &format!("http://{addr}"), "all"])
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        report.lines().filter(|l| l.ends_with(": ok")).count(),
        12,
        "{report}"
    );
}

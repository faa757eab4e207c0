//! gRPC's interop client (`grpc-interop client`, samples/grpc) run against a mesh's
//! ingress, as the gRPC and bridge tests drive it.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;

/// `grpc-interop`, built beside `dpumesh` (samples/grpc's own test builds it).
pub fn interop() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_BIN_EXE_dpumesh")).with_file_name("grpc-interop");
    assert!(
        path.is_file(),
        "{} is missing: cargo build -p dpumesh-sample-grpc",
        path.display()
    );
    path
}

/// Runs interop `cases` against `ingress` naming `authority`, with `token` if any:
/// (all passed, the client's report).
pub fn run_cases(
    ingress: SocketAddr,
    authority: &str,
    token: Option<&str>,
    cases: &[&str],
) -> (bool, String) {
    let mut cmd = Command::new(interop());
    cmd.args(["client", "--server", &format!("http://{ingress}")])
        .args(["--authority", authority]);
    if let Some(token) = token {
        cmd.args(["--token", token]);
    }
    let out = cmd.args(cases).output().unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), report)
}

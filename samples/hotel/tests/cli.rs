//! The `hotel` program outside a mesh: it says what it needs. (Also makes `cargo test`
//! build the binary that `dpumesh up` starts in the mesh tests.)

use std::process::Command;

#[test]
fn without_a_node_it_says_how_to_start_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_hotel"))
        .arg("frontend")
        .env_remove("DPUMESH_CONTROL")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("DPUMESH_CONTROL"), "{err}");
    assert!(err.contains("dpumesh up"), "{err}");
}

#[test]
fn an_unknown_service_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_hotel"))
        .arg("casino")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown service \"casino\""), "{err}");
}

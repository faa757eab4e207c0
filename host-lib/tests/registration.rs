//! A pod that starts before its node waits for it (`DPUMESH_REGISTER_PATIENCE`):
//! on a cluster a host pod may start minutes before its DPU's proxy is Ready, and
//! the proxy's readiness does not wait for the pods. A node that is there and
//! refuses the pod is not waited on for ever.

use std::time::{Duration, Instant};

use dpumesh_dpa::control::ControlError;
use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_dpa::{Dpu, DpuConfig, HostError};
use dpumesh_host::datapath::{DataPathTransport, REGISTER_PATIENCE, parse_patience};
use dpumesh_identity::registration::RegistrationKey;

fn node(control: &Endpoint, registration: Option<RegistrationKey>) -> Dpu {
    let mut config = DpuConfig::new(format!("reg-{}", std::process::id()));
    config.pod.body_slots = 8;
    config.shards = 1;
    config.registration = registration;
    Dpu::start(config, control).unwrap()
}

#[test]
fn a_pod_started_before_its_node_registers_once_the_node_comes() {
    let dir = tempfile::tempdir().unwrap();
    let control = Endpoint::Unix(dir.path().join("control.sock"));
    let pod = {
        let control = control.clone();
        std::thread::spawn(move || {
            DataPathTransport::connect_patiently(&control, "early-0", "early", None)
        })
    };
    // Longer than the default patience would allow a starting pod.
    std::thread::sleep(REGISTER_PATIENCE + Duration::from_millis(500));
    assert!(!pod.is_finished(), "the pod gave up waiting");
    let node = node(&control, None);
    let transport = pod.join().unwrap().expect("registered once the node came");
    assert!(node.pods().iter().any(|p| p.name == "early-0"));
    drop(transport);
}

#[test]
fn a_bounded_patience_ends_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let control = Endpoint::Unix(dir.path().join("nobody.sock"));
    let start = Instant::now();
    let e = DataPathTransport::connect_patiently(
        &control,
        "late-0",
        "late",
        Some(Duration::from_millis(300)),
    )
    .map(|_| ())
    .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert!(
        matches!(e, HostError::Control(ControlError::Io(_))),
        "the error says the node is not there: {e}"
    );
}

#[test]
fn a_node_that_refuses_the_pod_is_not_waited_on_for_ever() {
    let dir = tempfile::tempdir().unwrap();
    let control = Endpoint::Unix(dir.path().join("control.sock"));
    let key = RegistrationKey::load_or_create(dir.path()).unwrap();
    let _node = node(&control, Some(key));
    // No DPUMESH_TOKEN in this test's environment: the node refuses.
    assert!(std::env::var_os("DPUMESH_TOKEN").is_none());
    let start = Instant::now();
    let e = DataPathTransport::connect_patiently(&control, "anon-0", "anon", None)
        .map(|_| ())
        .unwrap_err();
    assert!(
        start.elapsed() < REGISTER_PATIENCE + Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert!(e.to_string().contains("token"), "{e}");
}

#[test]
fn patience_is_written_forever_or_as_a_duration() {
    assert_eq!(parse_patience("forever"), Ok(None));
    assert_eq!(
        parse_patience("750ms"),
        Ok(Some(Duration::from_millis(750)))
    );
    assert_eq!(parse_patience("30s"), Ok(Some(Duration::from_secs(30))));
    assert_eq!(parse_patience(" 10m "), Ok(Some(Duration::from_secs(600))));
    for bad in ["", "s", "10", "10h", "-1s", "always"] {
        let e = parse_patience(bad).unwrap_err();
        assert!(
            e.contains(bad.trim()) || bad.trim().is_empty(),
            "{bad}: {e}"
        );
    }
}

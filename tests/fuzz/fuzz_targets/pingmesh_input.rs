//! Everything Pingmesh takes from the network: UD datagram headers (the software
//! fabric's BTH/DETH), probe messages, and the controller's and analyzer's gRPC
//! requests (protobuf bytes as tonic hands them over, then the checks). The first
//! byte picks which; any bytes give a value or a typed error, never a panic.
#![no_main]

use std::sync::Arc;
use std::time::Duration;

use dpumesh_pingmesh::analyzer::{Analyzer, AnalyzerPolicy};
use dpumesh_pingmesh::controller::Controller;
use dpumesh_pingmesh::pinglist::{ListKind, PinglistPolicy};
use dpumesh_pingmesh::probe::Message;
use dpumesh_pingmesh::proto;
use dpumesh_pingmesh::registry::memory::MemoryStore;
use libfuzzer_sys::fuzz_target;
use prost::Message as _;

/// A fresh controller and analyzer per input: what one input registers or uploads
/// does not pile up under the next (a time-stopped window would never empty).
fn parts() -> (Controller, Analyzer) {
    let store = Arc::new(MemoryStore::new());
    let clock = dpumesh_clock::ManualClock::at_unix_secs(1_700_000_000);
    (
        Controller::new(
            store.clone(),
            clock.clone(),
            PinglistPolicy::default(),
            Duration::from_secs(30),
        ),
        Analyzer::new(AnalyzerPolicy::default(), clock, store),
    )
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let (controller, analyzer) = &parts();
    match which % 5 {
        0 => assert!(dpumesh_dpa::fabric::soft::check_ud_header(rest)),
        1 => {
            if let Ok(m) = Message::decode(rest) {
                assert_eq!(Message::decode(&m.encode()), Ok(m));
            }
        }
        2 => {
            if let Ok(req) = proto::AgentRegistrationRequest::decode(rest) {
                let _ = controller.register(&req);
            }
        }
        3 => {
            if let Ok(req) = proto::PinglistRequest::decode(rest) {
                let _ = controller.pinglist(&req.gid, ListKind::InterTor);
                let _ = controller.target(&proto::TargetRnicInfoRequest {
                    gid: req.gid.clone(),
                    ip: req.gid,
                });
            }
        }
        _ => {
            if let Ok(req) = proto::UploadDataRequest::decode(rest) {
                let _ = analyzer.upload(&req);
                let _ = analyzer.report();
            }
        }
    }
});

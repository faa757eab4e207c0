//! The analyzer on a fake clock: 2 ToRs × 3 hosts, rounds of uploads in which a
//! chosen fault shapes each probe's outcome.

use std::sync::Arc;

use dpumesh_clock::ManualClock;

use super::*;
use crate::registry::memory::MemoryStore;

const NODES: [(&str, &str, &str); 6] = [
    ("a1", "tor-a", "10.0.1.1"),
    ("a2", "tor-a", "10.0.1.2"),
    ("a3", "tor-a", "10.0.1.3"),
    ("b1", "tor-b", "10.0.2.1"),
    ("b2", "tor-b", "10.0.2.2"),
    ("b3", "tor-b", "10.0.2.3"),
];

fn gid(ip: &str) -> Gid {
    Gid::from_ip(ip.parse().unwrap())
}

fn setup() -> (Analyzer, Arc<ManualClock>, Arc<MemoryStore>) {
    let clock = ManualClock::at_unix_secs(1_700_000_000);
    let store = Arc::new(MemoryStore::new());
    for (i, (node, tor, ip)) in NODES.iter().enumerate() {
        store
            .upsert(&Rnic {
                gid: gid(ip),
                qpn: 100 + i as u32,
                qkey: 1,
                agent_id: node.to_string(),
                agent_ip: "127.0.0.1".into(),
                rnic_ip: ip.parse().unwrap(),
                tor_id: tor.to_string(),
                udp_port: 4791,
                last_updated_ms: 0,
            })
            .unwrap();
    }
    let a = Analyzer::new(AnalyzerPolicy::default(), clock.clone(), store.clone());
    (a, clock, store)
}

/// What happens to a probe from `src` to `dst` (node names): `None` lost, else RTT µs.
type Fate<'a> = &'a dyn Fn(&str, &str, usize) -> Option<i64>;

fn result(
    src: usize,
    dst: usize,
    fate: Option<i64>,
    services: &[&str],
    dst_qpn: Option<u32>,
) -> proto::ProbeResult {
    let (s, d) = (NODES[src], NODES[dst]);
    let kind = if !services.is_empty() {
        proto::ProbeKind::Service
    } else if s.1 == d.1 {
        proto::ProbeKind::TorMesh
    } else {
        proto::ProbeKind::InterTor
    };
    let mut r = proto::ProbeResult {
        tuple: Some(proto::FiveTuple {
            src_gid: gid(s.2).to_string(),
            dst_gid: gid(d.2).to_string(),
            src_qpn: 100 + src as u32,
            dst_qpn: dst_qpn.unwrap_or(100 + dst as u32),
            src_port: 50_000,
            dst_port: 4791,
            flow_label: 7,
        }),
        kind: kind as i32,
        target_agent: d.0.to_string(),
        services: services.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    match fate {
        Some(us) => {
            r.status = proto::ProbeStatus::Ok as i32;
            r.network_rtt_ns = us * 1_000;
            r.prober_delay_ns = 20_000;
            r.responder_delay_ns = 10_000;
        }
        None => r.status = proto::ProbeStatus::Timeout as i32,
    }
    r
}

/// A fate: `us` µs between the two ToRs, 80 µs within one.
fn cross_tor(us: i64) -> impl Fn(&str, &str, usize) -> Option<i64> {
    move |s, d, _| {
        Some(if s.as_bytes()[0] != d.as_bytes()[0] {
            us
        } else {
            80
        })
    }
}

/// `rounds` rounds: each (uploading) node probes every other node once per round.
fn rounds(a: &Analyzer, clock: &ManualClock, rounds: usize, fate: Fate<'_>, skip_upload: &[&str]) {
    for round in 0..rounds {
        for (i, (node, ..)) in NODES.iter().enumerate() {
            if skip_upload.contains(node) {
                continue;
            }
            let results = (0..NODES.len())
                .filter(|j| *j != i)
                .map(|j| result(i, j, fate(node, NODES[j].0, round), &[], None))
                .collect();
            a.upload(&proto::UploadDataRequest {
                agent_id: node.to_string(),
                results,
                ..Default::default()
            })
            .unwrap();
        }
        clock.advance_ms(200);
    }
}

fn kinds(r: &Report) -> Vec<(ProblemKind, String)> {
    r.problems
        .iter()
        .map(|p| (p.kind, p.element.clone()))
        .collect()
}

#[test]
fn a_healthy_topology_raises_no_alarm() {
    let (a, clock, _) = setup();
    rounds(&a, &clock, 20, &|_, _, _| Some(80), &[]);
    let r = a.report();
    assert!(r.problems.is_empty(), "{:?}", kinds(&r));
    assert!(r.unreachable.is_empty());
    assert_eq!(r.cluster.probes, 20 * 30);
    assert_eq!(r.cluster.rtt_p50_us, 80.0);
    assert_eq!(r.heatmap.nodes.len(), 6);
    let cell = r.heatmap.cells[0][1].as_ref().unwrap();
    assert_eq!((cell.probes, cell.drop_rate), (20, 0.0));
    assert!(r.heatmap.cells[0][0].is_none());
    assert_eq!(r.host_delays["a1"].prober_p50_us, 20.0);
    assert_eq!(r.host_delays["b3"].responder_p50_us, 10.0);
}

#[test]
fn loss_on_one_hosts_link_makes_its_rnic_anomalous_and_its_link_blamed() {
    let (a, clock, _) = setup();
    // a2's link drops every third probe in either direction.
    rounds(
        &a,
        &clock,
        20,
        &|s, d, n| {
            ((s == "a2" || d == "a2") && n % 3 == 0)
                .then_some(())
                .map_or(Some(80), |_| None)
        },
        &[],
    );
    let r = a.report();
    let anomalous: Vec<_> = r
        .problems
        .iter()
        .filter(|p| p.kind == ProblemKind::AnomalousRnic)
        .collect();
    assert_eq!(anomalous.len(), 1, "{:?}", kinds(&r));
    assert_eq!(anomalous[0].nodes, vec!["a2"]);
    assert!(anomalous[0].network);
    let blamed: Vec<_> = r
        .problems
        .iter()
        .filter(|p| p.kind == ProblemKind::FaultyElement)
        .map(|p| p.at.clone().unwrap())
        .collect();
    assert_eq!(
        blamed,
        vec![Element::HostLink {
            node: "a2".into(),
            tor: "tor-a".into()
        }]
    );
    assert!(r.unreachable.is_empty(), "a third lost is not unreachable");
    assert!(r.cluster.drop_rate > 0.0);
}

#[test]
fn delay_on_the_inter_tor_link_is_localized_to_it() {
    let (a, clock, _) = setup();
    rounds(&a, &clock, 20, &cross_tor(2_080), &[]);
    let r = a.report();
    assert_eq!(
        kinds(&r),
        vec![(ProblemKind::FaultyElement, "link tor-a–tor-b".to_owned())]
    );
    let cross = r.heatmap.cells[0][3].as_ref().unwrap();
    assert_eq!(cross.rtt_p50_us, 2_080.0);
}

#[test]
fn a_stopped_responder_is_a_host_fault_not_the_network() {
    let (a, clock, _) = setup();
    rounds(&a, &clock, 10, &|_, _, _| Some(80), &[]);
    // b3's process stops: it uploads nothing and answers nothing.
    rounds(
        &a,
        &clock,
        40,
        &|_, d, _| (d != "b3").then_some(80),
        &["b3"],
    );
    let r = a.report();
    assert_eq!(
        kinds(&r),
        vec![(ProblemKind::HostDown, "host b3".to_owned())],
        "no anomalous RNIC, no link blamed"
    );
    assert!(!r.problems[0].network);
    assert_eq!(r.unreachable, vec!["b3"]);
    assert_eq!(
        r.cluster.timeouts, 0,
        "its timeouts are not the network's drops"
    );
}

#[test]
fn probes_to_a_queue_pair_the_target_no_longer_has_are_not_network_timeouts() {
    let (a, clock, _) = setup();
    let results = (0..10).map(|_| result(0, 1, None, &[], Some(55))).collect();
    a.upload(&proto::UploadDataRequest {
        agent_id: "a1".into(),
        results,
        ..Default::default()
    })
    .unwrap();
    rounds(&a, &clock, 1, &|_, _, _| Some(80), &[]);
    let r = a.report();
    assert_eq!(
        kinds(&r),
        vec![(ProblemKind::QpnChanged, "host a2".to_owned())]
    );
    assert_eq!(r.cluster.timeouts, 0);
}

#[test]
fn services_crossing_a_faulty_element_get_an_impact_class() {
    let (a, clock, _) = setup();
    for _ in 0..10 {
        let results = vec![
            // checkout: a1 → b1 across the (slow) inter-ToR link.
            result(0, 3, Some(3_000), &["checkout"], None),
            // search: a1 → a2, same ToR, untouched.
            result(0, 1, Some(80), &["search"], None),
        ];
        a.upload(&proto::UploadDataRequest {
            agent_id: "a1".into(),
            results,
            ..Default::default()
        })
        .unwrap();
    }
    rounds(&a, &clock, 20, &cross_tor(3_000), &[]);
    let r = a.report();
    let link = r
        .problems
        .iter()
        .find(|p| p.kind == ProblemKind::FaultyElement)
        .unwrap();
    assert_eq!(
        link.impact,
        vec![Impact {
            service: "checkout".into(),
            class: ImpactClass::P1
        }]
    );
    assert_eq!(link.class, Some(ImpactClass::P1));
    assert_eq!(r.services["checkout"].rtt_p50_us, 3_000.0);
    assert_eq!(r.services["search"].probes, 10);
}

#[test]
fn lost_service_probes_are_p0() {
    let (a, clock, _) = setup();
    rounds(
        &a,
        &clock,
        20,
        &|_, d, n| (d != "b2" || n % 2 == 0).then_some(80),
        &[],
    );
    a.upload(&proto::UploadDataRequest {
        agent_id: "a1".into(),
        results: vec![result(0, 4, None, &["orders"], None); 5],
        ..Default::default()
    })
    .unwrap();
    let r = a.report();
    let rnic = r
        .problems
        .iter()
        .find(|p| p.kind == ProblemKind::AnomalousRnic)
        .unwrap();
    assert_eq!(rnic.nodes, vec!["b2"]);
    assert_eq!(rnic.class, Some(ImpactClass::P0));
}

#[test]
fn the_window_forgets_old_results() {
    let (a, clock, _) = setup();
    rounds(&a, &clock, 10, &|_, d, _| (d != "a2").then_some(80), &[]);
    assert!(!a.report().problems.is_empty());
    clock.advance_secs(31);
    rounds(&a, &clock, 10, &|_, _, _| Some(80), &[]);
    assert!(a.report().problems.is_empty());
}

#[test]
fn a_restarted_analyzer_takes_up_its_window_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pm.db");
    let (a, clock, store) = setup();
    let (a, resumed) = a.with_log(log::ResultLog::open(&path).unwrap()).unwrap();
    assert_eq!(resumed, 0);
    rounds(&a, &clock, 20, &cross_tor(2_080), &[]);
    let before = a.report();
    drop(a);
    // The same moment, a new process: the same judgement, every agent heard from.
    let fresh = Analyzer::new(AnalyzerPolicy::default(), clock.clone(), store.clone());
    let (b, resumed) = fresh
        .with_log(log::ResultLog::open(&path).unwrap())
        .unwrap();
    assert_eq!(resumed, before.probes);
    let after = b.report();
    assert_eq!(kinds(&after), kinds(&before));
    assert_eq!(after.heatmap.cells[0][3], before.heatmap.cells[0][3]);
    assert!(after.agents.iter().all(|a| !a.silent), "{:?}", after.agents);
    // Past the window, nothing is taken up, and the file forgets it too.
    clock.advance_secs(31);
    let late = Analyzer::new(AnalyzerPolicy::default(), clock.clone(), store);
    let (_, resumed) = late.with_log(log::ResultLog::open(&path).unwrap()).unwrap();
    assert_eq!(resumed, 0);
    assert_eq!(
        log::ResultLog::open(&path)
            .unwrap()
            .load(0)
            .unwrap()
            .0
            .len(),
        0
    );
}

#[test]
fn an_agent_uploads_for_its_own_rnic_only() {
    let (a, _, _) = setup();
    let forged = proto::UploadDataRequest {
        agent_id: NODES[1].0.to_string(),
        results: vec![result(0, 3, None, &[], None)],
        ..Default::default()
    };
    let err = a.upload(&forged).unwrap_err();
    assert_eq!(err.field, "results[].tuple.src_gid");
    assert!(err.detail.contains(NODES[0].0), "{}", err.detail);
    assert_eq!(a.report().probes, 0, "nothing of it kept");
}

#[test]
fn a_malformed_upload_is_refused_naming_the_field() {
    let (a, _, _) = setup();
    let mut bad = result(0, 1, Some(80), &[], None);
    bad.tuple.as_mut().unwrap().dst_gid = "nonsense".into();
    let err = a
        .upload(&proto::UploadDataRequest {
            agent_id: "a1".into(),
            results: vec![result(0, 2, Some(80), &[], None), bad],
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(err.field, "results[1].tuple.dst_gid");
    let mut negative = result(0, 1, Some(80), &[], None);
    negative.network_rtt_ns = -5;
    let err = a
        .upload(&proto::UploadDataRequest {
            agent_id: "a1".into(),
            results: vec![negative],
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(err.field, "results[0].network_rtt_ns");
    assert_eq!(a.report().probes, 0, "nothing of a refused upload is kept");
}

#[test]
fn the_json_api_answers_each_endpoint() {
    let (a, clock, _) = setup();
    rounds(&a, &clock, 3, &|_, _, _| Some(80), &[]);
    for path in [
        "/v1/report",
        "/v1/problems",
        "/v1/heatmap",
        "/v1/sla",
        "/v1/unreachable",
        "/v1/agents",
    ] {
        let resp = service::answer(&a, &hyper::Method::GET, path);
        assert_eq!(resp.status(), 200, "{path}");
    }
    assert_eq!(
        service::answer(&a, &hyper::Method::GET, "/nope").status(),
        404
    );
    assert_eq!(
        service::answer(&a, &hyper::Method::POST, "/v1/report").status(),
        405
    );
}

/// Traces through a spine (one address, as a router ID would be): probes are voted
/// along the traced hops, so a slow spine is blamed, not the registry's inter-ToR link.
#[test]
fn traced_paths_replace_the_topology_in_the_vote() {
    let (a, clock, _) = setup();
    let trace = |src: usize, dst: usize| {
        let (s, d) = (NODES[src], NODES[dst]);
        let hops = if s.1 == d.1 {
            vec![format!("10.0.{}.254", if s.1 == "tor-a" { 1 } else { 2 })]
        } else {
            vec![
                format!("10.0.{}.254", if s.1 == "tor-a" { 1 } else { 2 }),
                "10.9.0.1".to_owned(),
                "10.0.0.9".to_owned(),
            ]
        };
        proto::PathInfo {
            tuple: Some(proto::FiveTuple {
                src_gid: gid(s.2).to_string(),
                dst_gid: gid(d.2).to_string(),
                ..Default::default()
            }),
            hops: hops
                .into_iter()
                .enumerate()
                .map(|(i, ip)| proto::Hop {
                    ttl: i as u32 + 1,
                    ip,
                    rtt_ns: 0,
                })
                .collect(),
            reached: true,
            traced_at_ms: 0,
        }
    };
    for (i, (node, ..)) in NODES.iter().enumerate() {
        a.upload(&proto::UploadDataRequest {
            agent_id: node.to_string(),
            paths: (0..NODES.len())
                .filter(|j| *j != i)
                .map(|j| trace(i, j))
                .collect(),
            ..Default::default()
        })
        .unwrap();
    }
    rounds(&a, &clock, 20, &cross_tor(3_000), &[]);
    let r = a.report();
    let blamed: Vec<_> = problems_of(&r, ProblemKind::FaultyElement);
    assert!(!blamed.is_empty(), "{:?}", kinds(&r));
    assert!(
        blamed
            .iter()
            .all(|p| p.element.contains("10.9.0.1")
                && !matches!(p.at, Some(Element::InterTor { .. }))),
        "the spine, from the traces: {:?}",
        kinds(&r)
    );
    let view = r
        .paths
        .iter()
        .find(|p| p.src == "a1" && p.dst == "b1")
        .unwrap();
    assert_eq!(view.names, ["tor-a", "10.9.0.1", "tor-b"]);
    assert_eq!(view.hops, ["10.0.1.254", "10.9.0.1", "10.0.0.9"]);
}

fn problems_of(r: &Report, kind: ProblemKind) -> Vec<Problem> {
    r.problems
        .iter()
        .filter(|p| p.kind == kind)
        .cloned()
        .collect()
}

#[test]
fn problem_kinds_are_named_in_the_metrics_as_in_the_json_api() {
    for kind in ProblemKind::ALL {
        assert_eq!(serde_json::to_value(kind).unwrap(), kind.name());
    }
}

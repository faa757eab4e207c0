//! Table tests of the exchange state machine: retries, per-try timeouts, orphaned and
//! stray answers, link loss and pod death, driven on a made-up clock.

use std::time::{Duration, Instant};

use dpumesh_config::RoutePolicy;
use dpumesh_dpa::frame::RemoteBuf;
use dpumesh_dpa::{BufAddr, Buffer, Case, Descriptor, Destination};
use test_case::test_case;

use super::*;

const MS: Duration = Duration::from_millis(1);
const INGRESS: u32 = 7;
const PEER: u32 = 9;
/// A failure a new try may cure: whether it is tried again is the exchange's to say.
const CURABLE: retry::Failure = retry::Failure::Status(503);

fn policy(retries: u32, per_try_ms: Option<u32>) -> RoutePolicy {
    RoutePolicy {
        timeout: Some(1000 * MS),
        retries,
        per_try_timeout: per_try_ms.map(|ms| ms * MS),
        cache: None,
        grpc_retry_on: Default::default(),
        stream_idle: None,
        buffer_body: false,
    }
}

fn body(len: u32) -> Buffer {
    Buffer::new(BufAddr::new(1, 4096).expect("valid"), len)
}

/// A request from the ingress over link `INGRESS`.
fn from_link(method: &str, with_body: bool, policy: RoutePolicy) -> Opening {
    Opening {
        origin: Origin::Link {
            qp: INGRESS,
            xid: 1,
            reply: RemoteBuf::default(),
        },
        service: "hotel".into(),
        traits: RequestTraits::of(&RequestHead::new(method, "/")),
        body: with_body.then(|| RemoteBuf {
            len: 10,
            ..RemoteBuf::default()
        }),
        policy,
        default_timeout: 5000 * MS,
        limit: None,
        head: None,
        route: None,
        trace_parent: None,
    }
}

/// A call from pod 3 on this node.
fn from_pod(method: &str, with_body: bool, policy: RoutePolicy) -> Opening {
    let mut d = Descriptor::request(Case::PodToPod, 40, 1, 3, Destination::Pod(0));
    if with_body {
        d = d.with_body(body(10));
    }
    Opening {
        origin: Origin::Pod { d },
        service: "rates".into(),
        traits: RequestTraits::of(&RequestHead::new(method, "/")),
        body: None,
        policy,
        default_timeout: 5000 * MS,
        limit: None,
        head: None,
        route: None,
        trace_parent: None,
    }
}

/// A gRPC call (a POST with a body) from the ingress on a route with one retry,
/// retrying gRPC calls on `grpc_on`.
fn grpc_call(grpc_on: &[&str]) -> Opening {
    let mut head = RequestHead::new("POST", "/grpc.testing.TestService/UnaryCall");
    head.set_header("content-type", "application/grpc").unwrap();
    let mut o = from_link("POST", true, policy(1, None));
    o.traits = RequestTraits::of(&head);
    o.policy.grpc_retry_on =
        dpumesh_config::GrpcCodes::from_names(grpc_on.iter().copied()).unwrap();
    o
}

#[test_case(&["unavailable"], retry::Failure::GrpcRetryable, true; "a listed gRPC status")]
#[test_case(&["unavailable"], CURABLE, true; "a 503 on a route that retries gRPC calls")]
#[test_case(&[], CURABLE, false; "a POST on a route that names no gRPC status")]
fn grpc_calls_are_retried_where_the_route_says(
    grpc_on: &[&str],
    failure: retry::Failure,
    retried: bool,
) {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let xid = at_pod_five(&mut table, grpc_call(grpc_on), t0);
    assert_eq!(table.grpc_retry_on(xid).is_some(), !grpc_on.is_empty());
    assert_eq!(table.tries_again(xid, failure, t0), retried);
}

/// Opens `o` at `t0` and sends its first try to pod 5.
fn at_pod_five(table: &mut ExchangeTable, o: Opening, t0: Instant) -> u32 {
    let xid = table.open(o, t0);
    table.start_try(xid, t0);
    table.at_pod(xid, (0, xid, 1), 5);
    xid
}

#[test_case("GET", false, 1, true; "an idempotent request with a try left")]
#[test_case("GET", false, 0, false; "no retries configured")]
#[test_case("POST", false, 3, false; "POST is not retried")]
#[test_case("PUT", true, 1, true; "a body at the ingress can be read again")]
fn retries_from_the_ingress(method: &str, with_body: bool, retries: u32, retried: bool) {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let xid = at_pod_five(
        &mut table,
        from_link(method, with_body, policy(retries, None)),
        t0,
    );
    assert_eq!(table.tries_again(xid, CURABLE, t0 + MS), retried);
}

#[test_case(false, true; "a pod's call without a body")]
#[test_case(true, false; "a pod's body was handed on by the first try")]
fn retries_of_a_pods_call(with_body: bool, retried: bool) {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let xid = at_pod_five(&mut table, from_pod("GET", with_body, policy(2, None)), t0);
    assert_eq!(table.tries_again(xid, CURABLE, t0 + MS), retried);
}

#[test]
fn tries_run_out_and_time_runs_out() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let xid = at_pod_five(&mut table, from_link("GET", false, policy(1, None)), t0);
    assert!(table.tries_again(xid, CURABLE, t0));
    assert!(
        !table.tries_again(xid, CURABLE, t0 + 1000 * MS),
        "past the deadline"
    );
    table.begin_retry(xid);
    table.start_try(xid, t0);
    table.at_pod(xid, (0, xid, 2), 6);
    assert!(!table.tries_again(xid, CURABLE, t0), "both tries used");
}

#[test]
fn a_try_at_a_peer_is_not_retried() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let xid = table.open(from_pod("GET", false, policy(3, None)), t0);
    table.start_try(xid, t0);
    table.get_mut(xid).expect("open").stage = Stage::Peer {
        qp: PEER,
        reply_slot: body(64),
    };
    assert!(
        !table.tries_again(xid, CURABLE, t0),
        "the peer may still write its reply"
    );
}

#[test]
fn per_try_timeouts_fire_for_the_current_try_only() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let xid = at_pod_five(
        &mut table,
        from_link("GET", false, policy(1, Some(100))),
        t0,
    );
    assert_eq!(table.next_timer(), Some(t0 + 100 * MS));
    assert_eq!(table.due(t0 + 99 * MS), None);
    assert_eq!(table.due(t0 + 100 * MS), Some(Due::TryTimeout(xid)));
    // The retry's try starts later; the first try's timer is spent, the second's is
    // its own.
    table.begin_retry(xid);
    table.start_try(xid, t0 + 100 * MS);
    table.at_pod(xid, (0, xid, 2), 6);
    assert_eq!(table.due(t0 + 150 * MS), None);
    assert_eq!(table.due(t0 + 200 * MS), Some(Due::TryTimeout(xid)));
    assert_eq!(table.due(t0 + 999 * MS), None);
    assert_eq!(table.due(t0 + 1000 * MS), Some(Due::Timeout(xid)));
}

#[test]
fn a_try_timer_means_nothing_once_the_request_left_the_pod() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let xid = at_pod_five(
        &mut table,
        from_link("GET", false, policy(1, Some(100))),
        t0,
    );
    table.begin_retry(xid); // back to filtering: no pod to time out
    assert_eq!(table.due(t0 + 100 * MS), None);
}

#[test]
fn the_route_timeout_is_capped_by_what_the_sender_waits() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let mut o = from_link("GET", false, policy(0, None));
    o.limit = Some(300 * MS);
    let xid = table.open(o, t0);
    assert_eq!(table.get(xid).expect("open").deadline, t0 + 300 * MS);
    let mut o = from_link("GET", false, RoutePolicy::default());
    o.limit = None;
    let other = table.open(o, t0);
    assert_eq!(
        table.get(other).expect("open").deadline,
        t0 + 5000 * MS,
        "the mesh's default"
    );
    assert_eq!(table.due(t0 + 300 * MS), Some(Due::Timeout(xid)));
}

#[test]
fn a_per_try_timer_never_outlives_the_deadline() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let mut p = policy(1, Some(800));
    p.timeout = Some(500 * MS);
    let xid = at_pod_five(&mut table, from_link("GET", false, p), t0);
    assert_eq!(
        table.get(xid).expect("open").try_deadline,
        Some(t0 + 500 * MS)
    );
    assert_eq!(table.due(t0 + 500 * MS), Some(Due::Timeout(xid)));
}

#[test]
fn timers_of_ended_exchanges_are_skipped() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let xid = at_pod_five(&mut table, from_link("GET", false, policy(0, Some(10))), t0);
    assert!(table.close(xid).is_some());
    assert_eq!(table.due(t0 + 2000 * MS), None);
    assert_eq!(table.len(), 0);
}

#[test]
fn ended_exchanges_do_not_pile_up_timers_and_live_ones_still_fire() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    // One exchange stays open at a pod (per-try timer 10 ms, deadline 1 s), with a
    // replaced try of its own, while 100k others come and go.
    let live = at_pod_five(&mut table, from_link("GET", false, policy(1, Some(10))), t0);
    table.start_try(live, t0 + MS);
    table.at_pod(live, (0, live, 2), 5);
    for i in 0..100_000u32 {
        let xid = at_pod_five(&mut table, from_link("GET", false, policy(1, Some(10))), t0);
        assert!(table.close(xid).is_some(), "exchange {i}");
    }
    assert_eq!(table.len(), 1);
    // Bounded by the live exchanges, not by the requests seen within a timeout.
    assert!(
        table.timers.len() <= 2 + TIMER_SLACK,
        "{} timers",
        table.timers.len()
    );
    // The live exchange's current try still times out, then its deadline.
    assert_eq!(table.due(t0 + 11 * MS), Some(Due::TryTimeout(live)));
    assert!(table.begin_retry(live).is_some());
    assert_eq!(table.due(t0 + 500 * MS), None);
    assert_eq!(table.due(t0 + 1000 * MS), Some(Due::Timeout(live)));
}

#[derive(Debug, Clone, Copy)]
enum Late {
    Current,
    FromAnotherPod,
    AfterTheTimeout,
    ToAnAbandonedTry,
    Undelivered,
}

#[test_case(Late::Current, PodAnswer::Current(1); "the current try's answer")]
#[test_case(Late::FromAnotherPod, PodAnswer::Impostor; "a pod answering for another")]
#[test_case(Late::AfterTheTimeout, PodAnswer::Stale; "an answer after the exchange timed out")]
#[test_case(Late::ToAnAbandonedTry, PodAnswer::Stale; "an answer to a try given up on")]
#[test_case(Late::Undelivered, PodAnswer::Stale; "an answer to a try the data path could not deliver")]
fn answers_from_pods(case: Late, expected: PodAnswer) {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let xid = at_pod_five(&mut table, from_link("GET", false, policy(1, None)), t0);
    assert_eq!(xid, 1);
    let key = (0, xid, 1);
    let answer = match case {
        Late::Current => table.pod_answer(key, 5),
        Late::FromAnotherPod => table.pod_answer(key, 6),
        Late::AfterTheTimeout => {
            assert_eq!(table.due(t0 + 1000 * MS), Some(Due::Timeout(xid)));
            table.close(xid);
            table.pod_answer(key, 5)
        }
        Late::ToAnAbandonedTry => {
            table.begin_retry(xid);
            table.start_try(xid, t0);
            table.at_pod(xid, (0, xid, 2), 5);
            table.pod_answer(key, 5)
        }
        Late::Undelivered => {
            assert_eq!(table.undelivered(key), Some(xid));
            table.pod_answer(key, 5)
        }
    };
    assert_eq!(answer, expected);
    // An answer is taken once.
    if expected == PodAnswer::Current(xid) {
        assert_eq!(table.pod_answer(key, 5), PodAnswer::Stale);
    }
}

#[test]
fn a_late_peer_answer_returns_what_was_lent() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let xid = table.open(from_pod("GET", true, policy(0, None)), t0);
    table.start_try(xid, t0);
    let reply_slot = body(64);
    table.get_mut(xid).expect("open").stage = Stage::Peer {
        qp: PEER,
        reply_slot,
    };
    // Another link cannot answer it.
    assert!(matches!(
        table.peer_answer(INGRESS, xid),
        PeerAnswer::Unknown
    ));
    // Timed out: answered locally, the peer keeps the body and the reply slot.
    assert_eq!(table.due(t0 + 1000 * MS), Some(Due::Timeout(xid)));
    let e = table.close(xid).expect("open");
    let Origin::Pod { d } = e.origin else {
        panic!("a pod's call")
    };
    table.orphan(
        xid,
        Orphan {
            qp: PEER,
            d,
            reply_slot,
        },
    );
    match table.peer_answer(PEER, xid) {
        PeerAnswer::Orphan(o) => assert_eq!((o.d.body, o.reply_slot), (body(10), reply_slot)),
        other => panic!("expected the orphan, got {other:?}"),
    }
    assert!(matches!(table.peer_answer(PEER, xid), PeerAnswer::Unknown));
}

#[test]
fn a_peer_answer_in_time_ends_the_exchange() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let xid = table.open(from_pod("GET", false, policy(0, None)), t0);
    table.get_mut(xid).expect("open").stage = Stage::Peer {
        qp: PEER,
        reply_slot: body(64),
    };
    assert!(
        matches!(table.peer_answer(PEER, xid), PeerAnswer::Current { exchange, reply_slot } if exchange.attempt == 0 && reply_slot == body(64))
    );
    assert_eq!(table.len(), 0);
}

#[test]
fn a_lost_link_drops_what_came_over_it_and_fails_what_went_out() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    // From the ingress, at a pod: nobody is left to answer.
    let came = at_pod_five(&mut table, from_link("GET", false, policy(0, None)), t0);
    // From the ingress, its body being read: the read is given back.
    let reading = table.open(from_link("PUT", true, policy(0, None)), t0);
    table.get_mut(reading).expect("open").stage = Stage::Reading;
    let slot = body(10);
    let token = table.next_token();
    table.track(
        token,
        Transfer::Read {
            qp: INGRESS,
            xid: reading,
            pod: 5,
            slot,
            header: body(1),
        },
    );
    // A pod's call out to the peer over the same kind of link, and one over another.
    let went = table.open(from_pod("GET", false, policy(0, None)), t0);
    table.get_mut(went).expect("open").stage = Stage::Peer {
        qp: INGRESS,
        reply_slot: body(64),
    };
    let elsewhere = table.open(from_pod("GET", false, policy(0, None)), t0);
    table.get_mut(elsewhere).expect("open").stage = Stage::Peer {
        qp: PEER,
        reply_slot: body(64),
    };
    // A call already answered whose peer was on this link.
    let orphan = Orphan {
        qp: INGRESS,
        d: Descriptor::request(Case::PodToPod, 1, 1, 3, Destination::Pod(0)),
        reply_slot: body(64),
    };
    table.orphan(999, orphan);

    let loss = table.link_down(INGRESS);
    let dropped: Vec<u32> = loss
        .dropped
        .iter()
        .map(|e| match e.origin {
            Origin::Link { .. } => e.attempt,
            Origin::Pod { .. } => u32::MAX,
        })
        .collect();
    assert_eq!(dropped, vec![1, 0], "both exchanges from the link");
    assert_eq!(loss.failed, vec![went]);
    assert_eq!(loss.orphans, vec![orphan]);
    assert!(matches!(loss.transfers.as_slice(), [Transfer::Read { slot: s, .. }] if *s == slot));
    assert!(table.get(came).is_none() && table.get(reading).is_none());
    assert!(table.get(went).is_some(), "the shard fails it with a 503");
    assert!(table.get(elsewhere).is_some());
    assert_eq!(
        table.transfer_done(token),
        None,
        "the read will never complete"
    );
    // What the link's pod answers later is stale.
    assert_eq!(table.pod_answer((0, came, 1), 5), PodAnswer::Stale);
}

#[test]
fn exchanges_at_a_pod_that_died_are_found() {
    let t0 = Instant::now();
    let mut table = ExchangeTable::default();
    let at_five = at_pod_five(&mut table, from_link("GET", false, policy(1, None)), t0);
    let at_six = table.open(from_link("GET", false, policy(1, None)), t0);
    table.start_try(at_six, t0);
    table.at_pod(at_six, (0, at_six, 1), 6);
    let filtering = table.open(from_link("GET", false, policy(1, None)), t0);
    assert_eq!(table.at_departed_pods(|pod| pod != 5), vec![at_five]);
    assert!(table.at_departed_pods(|_| true).is_empty());
    assert_eq!(table.at_departed_pods(|_| false), vec![at_five, at_six]);
    // The dead pod's try can be retried elsewhere.
    assert!(table.tries_again(at_five, CURABLE, t0));
    assert!(table.get(filtering).is_some());
}

#[test]
fn exchange_ids_skip_those_in_use() {
    let t0 = Instant::now();
    let mut table = ExchangeTable {
        next_xid: u32::MAX,
        ..ExchangeTable::default()
    };
    let last = table.open(from_link("GET", false, policy(0, None)), t0);
    let wrapped = table.open(from_link("GET", false, policy(0, None)), t0);
    assert_eq!((last, wrapped), (u32::MAX, 1), "0 is never an exchange id");
    table.next_xid = u32::MAX;
    let next = table.open(from_link("GET", false, policy(0, None)), t0);
    assert_eq!(next, 2, "ids in use are skipped");
}

#[test]
fn a_try_of_an_exchange_that_ended_is_not_started() {
    let mut table = ExchangeTable::default();
    let t0 = Instant::now();
    let xid = table.open(from_link("GET", false, policy(1, Some(100))), t0);
    assert_eq!(table.start_try(xid, t0).map(|e| e.attempt), Some(1));
    table.close(xid);
    assert!(table.start_try(xid, t0).is_none());
    assert_eq!(table.due(t0 + 100 * MS), None, "no timer armed for it");
}

#[test]
fn a_policed_request_opens_with_its_head_and_a_body_read_marks_it_reading() {
    let mut table = ExchangeTable::default();
    let t0 = Instant::now();
    let head = RequestHead::new("PUT", "/upload");
    let opening = Opening {
        head: Some(head),
        ..from_link("PUT", true, policy(0, None))
    };
    let xid = table.open(opening, t0);
    let exchange = table.start_try(xid, t0).expect("open");
    assert_eq!(
        exchange.head.as_ref().map(|h| h.method.as_str()),
        Some("PUT")
    );
    let token = table.next_token();
    table.track(
        token,
        Transfer::Read {
            qp: INGRESS,
            xid,
            pod: 5,
            slot: body(10),
            header: body(1),
        },
    );
    assert_eq!(table.get(xid).map(|e| e.stage), Some(Stage::Reading));
}

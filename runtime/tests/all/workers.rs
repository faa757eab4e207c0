//! Worker threads: node-wide shared state and per-worker instances.

use std::sync::Arc;

use dpumesh_runtime::{Decision, Generation, WorkerPool};
use serde_json::json;

use crate::support::{chain, get, runtime, settings};

#[test]
fn shared_state_counters_are_consistent_across_workers() {
    let rt = runtime();
    let counting = chain(
        &rt,
        vec![settings(
            "count",
            json!({"request": [{"increment": "hits"}]}),
        )],
    );
    let pool = Arc::new(WorkerPool::start(Generation::new(1, vec![counting]), 4).unwrap());
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                for _ in 0..250 {
                    let done = pool.on_request(0, get("/")).unwrap();
                    assert_eq!(done.outcome.decision, Decision::Continue);
                }
            })
        })
        .collect();
    for client in clients {
        dpumesh_test_support::joined(client);
    }
    let hits = rt.shared_state().namespace("test").get("hits").unwrap();
    assert_eq!(hits, Some(2000));
}

#[test]
fn requests_spread_over_workers_and_responses_return_to_them() {
    let rt = runtime();
    let c = chain(
        &rt,
        vec![settings(
            "r",
            json!({"tag": "r", "response": [{"record_order": "resp"}]}),
        )],
    );
    let pool = WorkerPool::start(Generation::new(1, vec![c]), 3).unwrap();
    let mut workers = std::collections::HashSet::new();
    for _ in 0..6 {
        let done = pool.on_request(0, get("/")).unwrap();
        workers.insert(done.ticket.worker);
        let info = dpumesh_runtime::ResponseInfo {
            status: 200,
            latency_ns: 5,
            upstream: None,
            failure: dpumesh_runtime::FailureKind::None,
        };
        let (_, faults) = pool
            .on_response(done.ticket, done.outcome.head, info)
            .unwrap();
        assert!(faults.is_empty());
    }
    assert_eq!(workers.len(), 3);
    assert_eq!(
        rt.shared_state().namespace("test").get("seq").unwrap(),
        Some(6)
    );
    assert!(matches!(
        pool.on_request(7, get("/")),
        Err(dpumesh_runtime::PoolError::UnknownChain(7))
    ));
}

#[test]
fn a_node_wide_rate_limit_is_exact_under_16_workers() {
    use std::sync::Barrier;

    use dpumesh_clock::ManualClock;
    use dpumesh_runtime::{FilterChain, FilterSettings, Runtime, RuntimeConfig};

    let clock = ManualClock::at_unix_secs(1_700_000_000);
    let rt = Runtime::new(RuntimeConfig {
        cache_dir: Some(crate::support::cache_dir()),
        max_instances: 48,
        clock: clock.clone(),
        ..RuntimeConfig::default()
    })
    .unwrap();
    let config = json!({"default_bucket": {"max_tokens": 100, "fill_interval_ms": 1000}});
    let filter = rt
        .load_filter(
            FilterSettings::new("rl", config.to_string())
                .deadline(std::time::Duration::from_secs(2)),
            &dpumesh_test_artifacts::read(dpumesh_test_artifacts::FILTER_RATELIMIT),
        )
        .unwrap();
    let pool = Arc::new(
        WorkerPool::start(
            Generation::new(1, vec![Arc::new(FilterChain::new("rl", vec![filter]))]),
            16,
        )
        .unwrap(),
    );
    const CLIENTS: usize = 16;
    const ROUNDS: usize = 10;
    let barrier = Arc::new(Barrier::new(CLIENTS + 1));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (pool, barrier) = (pool.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut admitted = 0;
                for _ in 0..ROUNDS {
                    barrier.wait();
                    for _ in 0..20 {
                        let done = pool.on_request(0, get("/")).unwrap();
                        if done.outcome.decision == Decision::Continue {
                            admitted += 1;
                        }
                    }
                    barrier.wait();
                }
                admitted
            })
        })
        .collect();
    for _ in 0..ROUNDS {
        barrier.wait(); // round starts
        barrier.wait(); // round done: 320 offered against 100 tokens
        clock.advance_ms(1000);
    }
    let admitted: usize = clients.into_iter().map(dpumesh_test_support::joined).sum();
    // 100 per one-second interval, node-wide, however the 16 workers interleave.
    assert_eq!(admitted, ROUNDS * 100);
}

#[test]
fn a_published_generation_takes_over_while_open_requests_finish_on_theirs() {
    let rt = runtime();
    let tagged = |tag: &str| {
        chain(
            &rt,
            vec![settings(
                "t",
                json!({"tag": tag, "request": [{"set_header": ["x-gen", tag]}],
                       "response": [{"record_order": "resp"}]}),
            )],
        )
    };
    let pool = WorkerPool::start(Generation::new(1, vec![tagged("g1")]), 2).unwrap();
    let first = pool.on_request(0, get("/")).unwrap();
    assert_eq!(first.outcome.head.header("x-gen").as_deref(), Some("g1"));

    pool.publish(Generation::new(2, vec![tagged("g2")]))
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while pool.worker_generations() != [2, 2] {
        assert!(
            std::time::Instant::now() < deadline,
            "workers never switched"
        );
        std::thread::yield_now();
    }
    let second = pool.on_request(0, get("/")).unwrap();
    assert_eq!(second.outcome.head.header("x-gen").as_deref(), Some("g2"));

    // The request that started on generation 1 finishes there.
    let info = dpumesh_runtime::ResponseInfo {
        status: 200,
        latency_ns: 5,
        upstream: None,
        failure: dpumesh_runtime::FailureKind::None,
    };
    pool.on_response(first.ticket, first.outcome.head, info.clone())
        .unwrap();
    pool.on_response(second.ticket, second.outcome.head, info)
        .unwrap();
    let ns = rt.shared_state().namespace("test");
    assert_eq!(ns.get("resp-g1").unwrap(), Some(1));
    assert_eq!(ns.get("resp-g2").unwrap(), Some(2));

    assert!(matches!(
        pool.publish(Generation::new(2, vec![tagged("again")])),
        Err(dpumesh_runtime::PoolError::StaleGeneration {
            published: 2,
            current: 2
        })
    ));
}

/// `workers` workers running one chain that tags requests `x-tag: t`.
fn tagging_pool(workers: usize) -> WorkerPool {
    let rt = runtime();
    let c = chain(
        &rt,
        vec![settings(
            "t",
            json!({"request": [{"set_header": ["x-tag", "t"]}]}),
        )],
    );
    WorkerPool::start(Generation::new(1, vec![c]), workers).unwrap()
}

#[test]
fn a_worker_that_panics_answers_its_request_and_is_rebuilt() {
    let pool = tagging_pool(1);
    // Requests queued behind the panicking job, from other threads.
    let pool = Arc::new(pool);
    let lost = pool.inject_panic(0);
    assert!(
        matches!(lost, Err(dpumesh_runtime::PoolError::WorkerLost)),
        "the held request is answered, not left waiting: {lost:?}"
    );
    // The worker runs again on fresh instances, and so does a callback request.
    let done = pool.on_request(0, get("/")).unwrap();
    assert_eq!(done.outcome.decision, Decision::Continue);
    assert_eq!(done.outcome.head.header("x-tag").as_deref(), Some("t"));
    let (tx, rx) = std::sync::mpsc::channel();
    pool.request_with(pool.current(), 0, get("/"), move |r| {
        tx.send(r.is_ok()).unwrap()
    })
    .unwrap();
    assert!(rx.recv().unwrap());
    let worker = &pool.supervisor().threads()[0];
    assert_eq!(worker.panics(), 1);
    assert!(worker.running());
    assert!(
        worker
            .last_panic()
            .unwrap()
            .contains("injected worker panic"),
        "{:?}",
        worker.last_panic()
    );
    assert_eq!(pool.supervisor().ready(), Ok(()));
}

#[test]
fn a_response_for_a_chain_the_generation_lacks_is_refused_not_a_worker_panic() {
    let rt = runtime();
    let c = chain(&rt, vec![settings("t", json!({}))]);
    let pool = WorkerPool::start(Generation::new(1, vec![c]), 1).unwrap();
    let done = pool.on_request(0, get("/")).unwrap();
    let mut ticket = done.ticket;
    ticket.chain = 5;
    let info = dpumesh_runtime::ResponseInfo {
        status: 200,
        latency_ns: 1,
        upstream: None,
        failure: dpumesh_runtime::FailureKind::None,
    };
    assert!(matches!(
        pool.on_response(ticket, done.outcome.head, info),
        Err(dpumesh_runtime::PoolError::UnknownChain(5))
    ));
    assert_eq!(pool.supervisor().threads()[0].panics(), 0);
}

#[test]
fn a_worker_left_down_takes_no_more_requests_and_with_none_left_requests_hear_worker_lost() {
    let pool = tagging_pool(2);
    let before_death = pool.on_request(0, get("/")).unwrap().ticket;
    // Worker 0 keeps panicking until supervision leaves it down.
    let kill = |worker: usize| {
        let thread = pool.supervisor().threads()[worker].clone();
        while !thread.dead() {
            let _ = pool.inject_panic(worker);
        }
    };
    kill(0);
    // Every request is served (by worker 1): none is answered for the dead one.
    for _ in 0..6 {
        let done = pool.on_request(0, get("/")).unwrap();
        assert_eq!(done.ticket.worker, 1);
        assert_eq!(done.outcome.head.header("x-tag").as_deref(), Some("t"));
    }
    // A response phase owed to the dead worker hears that its thread was lost.
    let mut ticket = before_death;
    ticket.worker = 0;
    let info = dpumesh_runtime::ResponseInfo {
        status: 200,
        latency_ns: 1,
        upstream: None,
        failure: dpumesh_runtime::FailureKind::None,
    };
    assert!(matches!(
        pool.on_response(ticket, get("/"), info),
        Err(dpumesh_runtime::PoolError::WorkerLost)
    ));
    // With no worker left, a request is answered once, with the loss.
    kill(1);
    let (tx, rx) = std::sync::mpsc::channel();
    pool.request_with(pool.current(), 0, get("/"), move |r| {
        tx.send(r.map(|_| ())).unwrap()
    })
    .unwrap();
    assert_eq!(
        rx.recv().unwrap(),
        Err(dpumesh_runtime::PoolError::WorkerLost)
    );
    assert!(rx.try_recv().is_err(), "answered once");
    assert!(pool.supervisor().ready().is_err());
}

//! proxy-wasm shared queues, node-wide: an item enqueued by one instance reaches the
//! instance that registered the queue, on the thread that owns it (woken for it), in
//! `proxy_on_queue_ready`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dpumesh_runtime::queues::WakeSlot;
use dpumesh_runtime::{ChainRunner, FilterChain, Generation, LoadedFilter, Runtime, WorkerPool};
use dpumesh_test_artifacts as artifacts;
use serde_json::json;

use crate::support::{get, runtime};

fn queue_plugin(rt: &Runtime) -> Arc<LoadedFilter> {
    rt.load_filter(
        dpumesh_runtime::FilterSettings::new("pw-queue", json!({"queue": "jobs"}).to_string())
            .namespace("pw-queues")
            .deadline(Duration::from_millis(500)),
        &artifacts::read(artifacts::PROXY_WASM_TEST),
    )
    .expect("the plugin loads")
}

fn shared(rt: &Runtime, key: &str) -> Option<String> {
    rt.services()
        .state
        .namespace("pw-queues")
        .get_bytes(key)
        .unwrap()
        .map(|(v, _)| String::from_utf8(v.to_vec()).unwrap())
}

fn enqueue(runner: &mut ChainRunner, item: &str) {
    let mut head = get("/");
    head.append_received("x-enqueue", item).unwrap();
    let outcome = runner.on_request(head);
    assert!(outcome.faults.is_empty(), "{:?}", outcome.faults);
}

#[test]
fn an_item_reaches_the_registrant_woken_on_its_own_thread() {
    let rt = runtime();
    let filter = queue_plugin(&rt);
    let chain = Arc::new(FilterChain::new("queues", vec![filter]));
    let mut producer = ChainRunner::new(chain.clone());
    // Registered last, so the queue's news go to it.
    let wakes = Arc::new(AtomicUsize::new(0));
    let slot = Arc::new(WakeSlot::default());
    let counted = wakes.clone();
    slot.set(Arc::new(move || {
        counted.fetch_add(1, Ordering::Relaxed);
    }));
    let mut owner = ChainRunner::with_wake(chain, slot);

    enqueue(&mut producer, "first");
    enqueue(&mut producer, "second");
    // Woken once for both; nothing is delivered until the owner's thread looks.
    assert_eq!(wakes.load(Ordering::Relaxed), 1);
    assert_eq!(shared(&rt, "queue-items"), None);
    owner.tick(Instant::now());
    assert_eq!(shared(&rt, "queue-items").as_deref(), Some("2"));
    assert_eq!(shared(&rt, "queue-last").as_deref(), Some("second"));
    // Every instance sees the count (the queue and the data are the node's).
    let outcome = producer.on_request(get("/"));
    assert_eq!(outcome.head.header("x-queue-items").as_deref(), Some("2"));
    // Told once: another look finds nothing new.
    owner.tick(Instant::now());
    assert_eq!(shared(&rt, "queue-items").as_deref(), Some("2"));
    enqueue(&mut producer, "third");
    assert_eq!(wakes.load(Ordering::Relaxed), 2);
}

#[test]
fn an_idle_pool_worker_is_woken_for_its_queue() {
    let rt = runtime();
    let filter = queue_plugin(&rt);
    let chain = Arc::new(FilterChain::new("queues", vec![filter]));
    let mut producer = ChainRunner::new(chain.clone());
    // The pool's instance registers after the producer's: the worker is told.
    let pool = WorkerPool::start(Generation::new(1, vec![chain]), 1).unwrap();
    enqueue(&mut producer, "job-1");
    let deadline = Instant::now() + Duration::from_secs(20);
    while shared(&rt, "queue-items").is_none() {
        assert!(Instant::now() < deadline, "the worker was never told");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(shared(&rt, "queue-last").as_deref(), Some("job-1"));
    drop(pool);
}

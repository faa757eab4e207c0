//! Deadlines are CPU time: a call preempted on a busy machine is not the filter's
//! fault, an endless loop is still stopped soon after its CPU budget.
//!
//! A binary of its own, its tests one at a time: the load on the machine is mostly the
//! burners each test starts (cargo runs test binaries one after another), not other
//! tests of this suite running at the same moment.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dpumesh_runtime::{ChainRunner, Decision, DenyCause, FaultKind};
use serde_json::json;

#[path = "all/support.rs"]
#[allow(dead_code)]
mod support;
use support::{chain, get, runtime, settings};

/// One test at a time (see the module doc).
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

const DEADLINE: Duration = Duration::from_millis(5);

/// Threads that burn CPU until dropped: on this 2-core machine, with the test's own
/// thread, three want the two cores and each is preempted now and then for several
/// milliseconds.
struct Burners {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

fn burners(n: usize) -> Burners {
    let stop = Arc::new(AtomicBool::new(false));
    let threads = (0..n)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            })
        })
        .collect();
    Burners { stop, threads }
}

impl Drop for Burners {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn worker(rt: &dpumesh_runtime::Runtime, iterations: u64) -> ChainRunner {
    let work = settings("work", json!({"request": [{"work": iterations}]})).deadline(DEADLINE);
    let mark = settings(
        "mark",
        json!({"request": [{"set_header": ["x-after", "ran"]}]}),
    )
    .deadline(DEADLINE);
    ChainRunner::new(chain(rt, vec![work, mark]))
}

#[test]
fn preempted_calls_under_two_burning_threads_never_fault() {
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    // Size the work so that each call needs about 1 ms of CPU (a fifth of its budget:
    // a core shared with a burner's hyperthread makes the same work cost more CPU
    // time, and a third once measured past the budget in the whole suite); preempted
    // for a few ms, such a call passes a 5 ms wall clock.
    let probe = 1_000_000;
    let mut runner = worker(&rt, probe);
    runner.on_request(get("/"));
    let start = thread_cpu();
    for _ in 0..10 {
        runner.on_request(get("/"));
    }
    let per_call = (thread_cpu() - start) / 10;
    let iterations = (probe as f64 * 1.0e-3 / per_call.as_secs_f64()) as u64;
    let mut runner = worker(&rt, iterations.max(1000));

    let _burn = burners(2);
    let (mut faults, mut past_wall_deadline, mut slowest) = (0, 0, Duration::ZERO);
    let mut first_fault = None;
    let requests = 400;
    for _ in 0..requests {
        let started = Instant::now();
        let outcome = runner.on_request(get("/"));
        let took = started.elapsed();
        slowest = slowest.max(took);
        if took > DEADLINE {
            past_wall_deadline += 1;
        }
        if !outcome.faults.is_empty() || outcome.decision != Decision::Continue {
            faults += 1;
            first_fault.get_or_insert(format!(
                "after {took:?}: {:?} {:?}",
                outcome.faults, outcome.decision
            ));
            continue;
        }
        assert_eq!(outcome.head.header("x-after").as_deref(), Some("ran"));
    }
    eprintln!(
        "{requests} requests of ~1 ms CPU under two burners: {past_wall_deadline} took longer \
         than the 5 ms deadline in wall time (slowest {slowest:?}), {faults} faulted"
    );
    // On a virtual machine, the thread's CPU clock also runs while the hypervisor
    // slows or takes the vCPU: a plain 1 ms loop measured 5–12 ms of thread CPU time
    // (its wall time) once in a few hundred runs here, with or without burners. Such a
    // call cannot be told from a busy one by its CPU time, so a rare fault remains
    // (runtime/src/budget.rs). What a wall-clock deadline would do is far more: every
    // call past 5 ms of wall time, dozens of the 400 here.
    assert!(
        faults <= requests / 100,
        "{faults} spurious deadline faults in {requests} calls: {first_fault:?}"
    );
    assert!(
        past_wall_deadline < 8 || faults * 2 < past_wall_deadline,
        "{faults} faults for {past_wall_deadline} calls past the wall-clock deadline: {first_fault:?}"
    );
}

#[test]
fn an_endless_loop_is_stopped_within_twice_its_cpu_budget_even_under_burners() {
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    let spin = settings(
        "spinner",
        json!({"request": [{"spin_if_header": "x-spin"}]}),
    )
    .deadline(DEADLINE);
    let mut runner = ChainRunner::new(chain(&rt, vec![spin]));
    for burning in [0, 2] {
        // A call that does not spin first: it makes the instance (the faulted one is
        // replaced), so the measured call is the loop alone.
        assert_eq!(runner.on_request(get("/")).decision, Decision::Continue);
        let _burn = burners(burning);
        let mut head = get("/");
        head.set_header("x-spin", "1").unwrap();
        let start = thread_cpu();
        let outcome = runner.on_request(head);
        let used = thread_cpu() - start;
        eprintln!(
            "an endless loop with a 5 ms budget, {burning} burners: stopped after {used:?} of CPU"
        );
        match &outcome.decision {
            Decision::Deny {
                cause: DenyCause::Fault(f),
                ..
            } => assert_eq!(f.kind, FaultKind::Deadline(DEADLINE)),
            other => panic!("expected a deadline fault, got {other:?}"),
        }
        assert!(used >= DEADLINE, "stopped before its budget: {used:?}");
        // On a quiet machine within ~2x the budget (the figure printed above).
        // The epoch ticker that triggers the looks is a thread of its own: when it is
        // preempted — by the burners, or by whatever else shares CI's two cores (a run
        // with no burners once saw 2.9x) — each of its delays adds to the overshoot.
        // The test asserts the loop is stopped and bounded, not the quiet figure.
        let bound = 4 * DEADLINE;
        assert!(
            used < bound,
            "with {burning} burners the loop used {used:?} of CPU"
        );
    }
}

#[test]
fn an_endless_loop_under_a_deadline_longer_than_the_tickers_idle_time_is_stopped() {
    // The epoch ticker parks after 100 ticks (100 ms) without a new call; a single
    // call running longer must keep it awake (it did not: a loop under a 200 ms budget
    // ran for two minutes).
    const LONG: Duration = Duration::from_millis(400);
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    let spin = settings(
        "spinner",
        json!({"request": [{"spin_if_header": "x-spin"}]}),
    )
    .deadline(LONG);
    let mut runner = ChainRunner::new(chain(&rt, vec![spin]));
    assert_eq!(runner.on_request(get("/")).decision, Decision::Continue);
    // Let the ticker park first, as on an idle proxy.
    std::thread::sleep(Duration::from_millis(300));
    let mut head = get("/");
    head.set_header("x-spin", "1").unwrap();
    let start = thread_cpu();
    let outcome = runner.on_request(head);
    let used = thread_cpu() - start;
    match &outcome.decision {
        Decision::Deny {
            cause: DenyCause::Fault(f),
            ..
        } => assert_eq!(f.kind, FaultKind::Deadline(LONG)),
        other => panic!("expected a deadline fault, got {other:?}"),
    }
    assert!(used >= LONG, "stopped before its budget: {used:?}");
    assert!(used < 4 * LONG, "the loop used {used:?} of CPU");
}

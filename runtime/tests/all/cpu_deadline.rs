//! Deadlines are CPU time: a call preempted on a busy machine is not the filter's
//! fault, an endless loop is still stopped soon after its CPU budget.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dpumesh_runtime::{ChainRunner, Decision, DenyCause, FaultKind};
use serde_json::json;

use crate::support::{chain, get, runtime, settings};

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
    let rt = runtime();
    // Size the work so that each call needs about 1.5 ms of CPU (a third of its
    // budget): preempted for a few ms, such a call passes a 5 ms wall clock.
    let probe = 1_000_000;
    let mut runner = worker(&rt, probe);
    runner.on_request(get("/"));
    let start = thread_cpu();
    for _ in 0..10 {
        runner.on_request(get("/"));
    }
    let per_call = (thread_cpu() - start) / 10;
    let iterations = (probe as f64 * 1.5e-3 / per_call.as_secs_f64()) as u64;
    let mut runner = worker(&rt, iterations.max(1000));

    let _burn = burners(2);
    let (mut faults, mut past_wall_deadline, mut slowest) = (0, 0, Duration::ZERO);
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
        }
        assert_eq!(outcome.head.header("x-after").as_deref(), Some("ran"));
    }
    eprintln!(
        "{requests} requests of ~1.5 ms CPU under two burners: {past_wall_deadline} took longer \
         than the 5 ms deadline in wall time (slowest {slowest:?}), {faults} faulted"
    );
    assert_eq!(faults, 0, "no spurious deadline fault");
}

#[test]
fn an_endless_loop_is_stopped_within_twice_its_cpu_budget_even_under_burners() {
    let rt = runtime();
    let spin = settings("spinner", json!({"request": ["spin"]})).deadline(DEADLINE);
    let mut runner = ChainRunner::new(chain(&rt, vec![spin]));
    for burning in [0, 2] {
        let _burn = burners(burning);
        let start = thread_cpu();
        let outcome = runner.on_request(get("/"));
        let used = thread_cpu() - start;
        match &outcome.decision {
            Decision::Deny {
                cause: DenyCause::Fault(f),
                ..
            } => assert_eq!(f.kind, FaultKind::Deadline(DEADLINE)),
            other => panic!("expected a deadline fault, got {other:?}"),
        }
        assert!(
            used >= DEADLINE && used < 2 * DEADLINE,
            "with {burning} burners the loop used {used:?} of CPU"
        );
    }
}

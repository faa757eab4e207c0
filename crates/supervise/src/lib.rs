//! Supervised threads: no thread of the proxy or the ingress dies silently.
//!
//! A service thread (a filter worker, the data plane's reactor, the ingress shard's fabric pump)
//! runs its loop under [`Supervisor::spawn`]. When the loop panics, the panic is
//! caught, logged with its message and counted (`dpumesh_thread_panics_total`), the
//! thread's `recover` step answers or drops what the dead loop held and resets its
//! state, and the loop runs again. A thread that keeps panicking (more than
//! [`RestartPolicy::max_restarts`] within [`RestartPolicy::window`]) is left down, and
//! [`Supervisor::ready`] then names it, so `/readyz` stops sending traffic to a
//! process that cannot serve it.

#![forbid(unsafe_code)]

pub mod parent;

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How often a panicking thread is given another chance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Panics tolerated within `window`; one more and the thread stays down.
    pub max_restarts: u32,
    /// The window the panics are counted in.
    pub window: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            max_restarts: 5,
            window: Duration::from_secs(60),
        }
    }
}

const RUNNING: u8 = 0;
const STOPPED: u8 = 1;
const DEAD: u8 = 2;

/// One supervised thread as readiness and the admin API see it.
#[derive(Debug)]
pub struct ThreadHealth {
    name: String,
    state: AtomicU8,
    panics: AtomicU32,
    last_panic: Mutex<Option<String>>,
}

impl ThreadHealth {
    /// The thread's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether its loop is running (or being recovered).
    pub fn running(&self) -> bool {
        self.state.load(Ordering::Acquire) == RUNNING
    }

    /// Whether it stopped for good after too many panics.
    pub fn dead(&self) -> bool {
        self.state.load(Ordering::Acquire) == DEAD
    }

    /// Panics caught so far.
    pub fn panics(&self) -> u32 {
        self.panics.load(Ordering::Relaxed)
    }

    /// The message of the last panic.
    pub fn last_panic(&self) -> Option<String> {
        self.last_panic.lock().clone()
    }
}

/// The supervised threads of one process part (a node, an ingress, a worker pool).
#[derive(Debug, Default)]
pub struct Supervisor {
    threads: Mutex<Vec<Arc<ThreadHealth>>>,
}

impl Supervisor {
    /// An empty supervisor.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Spawns thread `name` running `run(&mut state)` until it returns. When `run`
    /// panics, `recover(&mut state)` cleans up after it (answer what the dead loop
    /// held, drop what may be inconsistent) and `run` starts again, up to `policy`'s
    /// limit; a panic in `recover` itself leaves the thread down.
    pub fn spawn<S: Send + 'static>(
        &self,
        name: impl Into<String>,
        policy: RestartPolicy,
        mut state: S,
        mut run: impl FnMut(&mut S) + Send + 'static,
        mut recover: impl FnMut(&mut S) + Send + 'static,
    ) -> std::io::Result<JoinHandle<()>> {
        let name = name.into();
        let mut tracked = self.track(name.clone(), policy);
        std::thread::Builder::new().name(name).spawn(move || {
            loop {
                let outcome = catch_unwind(AssertUnwindSafe(|| run(&mut state)));
                let Err(panic) = outcome else {
                    tracked.stopped();
                    return;
                };
                let again = tracked.panicked(&panic_message(panic.as_ref()));
                if catch_unwind(AssertUnwindSafe(|| recover(&mut state))).is_err() {
                    tracing::error!(thread = %tracked.health.name, "recovering after a panic panicked too: left down");
                    tracked.health.state.store(DEAD, Ordering::Release);
                    return;
                }
                if !again {
                    return;
                }
            }
        })
    }

    /// Supervision for a loop that is not a thread of its own (an async task): its
    /// driver catches the panic, reports it to the returned [`Tracked`] and restarts
    /// the loop while that says so. Readiness sees it like a thread.
    pub fn track(&self, name: impl Into<String>, policy: RestartPolicy) -> Tracked {
        let health = Arc::new(ThreadHealth {
            name: name.into(),
            state: AtomicU8::new(RUNNING),
            panics: AtomicU32::new(0),
            last_panic: Mutex::new(None),
        });
        self.threads.lock().push(health.clone());
        Tracked {
            health,
            policy,
            recent: Vec::new(),
        }
    }

    /// Every supervised thread.
    pub fn threads(&self) -> Vec<Arc<ThreadHealth>> {
        self.threads.lock().clone()
    }

    /// `Ok` while no supervised thread is dead; otherwise why not, naming each dead
    /// thread and its last panic.
    pub fn ready(&self) -> Result<(), String> {
        let dead: Vec<String> = self
            .threads
            .lock()
            .iter()
            .filter(|t| t.dead())
            .map(|t| {
                format!(
                    "thread {} is down after {} panics (last: {})",
                    t.name,
                    t.panics(),
                    t.last_panic().unwrap_or_default()
                )
            })
            .collect();
        if dead.is_empty() {
            Ok(())
        } else {
            Err(dead.join("; "))
        }
    }
}

/// A supervised loop's record: what its driver reports panics to.
#[derive(Debug)]
pub struct Tracked {
    health: Arc<ThreadHealth>,
    policy: RestartPolicy,
    recent: Vec<Instant>,
}

impl Tracked {
    /// The loop panicked with `message`: logged and counted. Returns whether it may
    /// run again; false leaves it down (too many panics within the policy's window),
    /// and readiness then names it.
    pub fn panicked(&mut self, message: &str) -> bool {
        let health = &self.health;
        health.panics.fetch_add(1, Ordering::Relaxed);
        *health.last_panic.lock() = Some(message.to_owned());
        metrics::counter!("dpumesh_thread_panics_total", "thread" => health.name.clone())
            .increment(1);
        let now = Instant::now();
        self.recent
            .retain(|at| now.duration_since(*at) < self.policy.window);
        self.recent.push(now);
        if self.recent.len() as u32 > self.policy.max_restarts {
            tracing::error!(
                thread = %health.name,
                panic = %message,
                "panicked {} times within {:?}: left down",
                self.recent.len(),
                self.policy.window
            );
            health.state.store(DEAD, Ordering::Release);
            return false;
        }
        tracing::error!(thread = %health.name, panic = %message, "panicked; recovering and restarting it");
        true
    }

    /// The loop ended on its own (not a failure).
    pub fn stopped(&self) {
        self.health.state.store(STOPPED, Ordering::Release);
    }

    /// Its health, as readiness sees it.
    pub fn health(&self) -> &Arc<ThreadHealth> {
        &self.health
    }
}

/// The text of a panic payload.
pub fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    /// A loop that takes commands: `Some(true)` panics, `Some(false)` echoes, `None`
    /// (the channel closed) ends it.
    fn worker(
        supervisor: &Supervisor,
        policy: RestartPolicy,
    ) -> (
        mpsc::Sender<bool>,
        mpsc::Receiver<&'static str>,
        JoinHandle<()>,
    ) {
        let (cmd_tx, cmd_rx) = mpsc::channel::<bool>();
        let (out_tx, out_rx) = mpsc::channel();
        let recover_tx = out_tx.clone();
        let handle = supervisor
            .spawn(
                "test-worker",
                policy,
                (cmd_rx, out_tx),
                |(cmds, out)| {
                    while let Ok(panic) = cmds.recv() {
                        assert!(!panic, "told to panic");
                        out.send("echo").unwrap();
                    }
                },
                move |_| recover_tx.send("recovered").unwrap(),
            )
            .unwrap();
        (cmd_tx, out_rx, handle)
    }

    #[test]
    fn a_panicking_loop_is_recovered_and_runs_again() {
        let supervisor = Supervisor::new();
        let (cmds, out, handle) = worker(&supervisor, RestartPolicy::default());
        cmds.send(true).unwrap();
        assert_eq!(out.recv().unwrap(), "recovered");
        cmds.send(false).unwrap();
        assert_eq!(out.recv().unwrap(), "echo", "the loop serves again");
        let health = &supervisor.threads()[0];
        assert_eq!(health.panics(), 1);
        assert!(health.running());
        assert!(health.last_panic().unwrap().contains("told to panic"));
        assert_eq!(supervisor.ready(), Ok(()));
        drop(cmds);
        dpumesh_test_support::joined(handle);
        assert!(
            !health.running() && !health.dead(),
            "a loop that returns stopped"
        );
        assert_eq!(
            supervisor.ready(),
            Ok(()),
            "a stopped thread is not a dead one"
        );
    }

    #[test]
    fn a_crash_loop_leaves_the_thread_down_and_readiness_names_it() {
        let supervisor = Supervisor::new();
        let policy = RestartPolicy {
            max_restarts: 2,
            window: Duration::from_secs(3600),
        };
        let (cmds, out, handle) = worker(&supervisor, policy);
        for _ in 0..3 {
            cmds.send(true).unwrap();
            assert_eq!(out.recv().unwrap(), "recovered");
        }
        dpumesh_test_support::joined(handle);
        let health = &supervisor.threads()[0];
        assert!(health.dead());
        let why = supervisor.ready().unwrap_err();
        assert!(
            why.contains("test-worker") && why.contains("3 panics"),
            "{why}"
        );
        assert!(why.contains("told to panic"), "{why}");
    }
}

//! One process `dpumesh up` runs: how to start it, its output (passed through with its
//! name in front, the last lines kept for the report when it is given up on), the line
//! it prints once it serves, and what became of it (running, waiting to start again,
//! given up on).

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use std::sync::Mutex;
use std::thread::JoinHandle;

use super::restart::{RestartPolicy, Restarts, Verdict};

/// The line a role prints on stdout once it serves (what `up` waits for).
pub const READY: &str = "dpumesh-ready";

/// Output lines kept per process for the report.
const TAIL: usize = 20;

/// How to start a process.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Its name in `up`'s output ("node node1", "ingress", "pod frontend-node1-0").
    pub name: String,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub env: Vec<(String, OsString)>,
    /// Its working directory (`up`'s own when `None`).
    pub dir: Option<PathBuf>,
}

impl Spec {
    /// A process running `program`.
    pub fn new(name: impl Into<String>, program: impl Into<PathBuf>) -> Self {
        Self {
            name: name.into(),
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            dir: None,
        }
    }

    /// Adds arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Runs it in `dir`.
    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }

    /// Adds an environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }
}

/// What became of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Running,
    /// Dead; started again at this time.
    Waiting(Instant),
    /// Dead for good (it kept dying right after each start).
    GaveUp,
}

/// Something worth telling the user.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// It died and will be started again after `delay`.
    Died { status: String, delay: Duration },
    /// It was started again.
    Restarted { count: u32 },
    /// It said it serves again, this long after it died.
    Serving { after: Duration },
    /// It kept dying; the last lines it printed.
    GaveUp {
        status: String,
        quick_deaths: u32,
        tail: Vec<String>,
    },
    /// It could not even be started.
    SpawnFailed(String),
}

/// A supervised process.
pub struct Process {
    spec: Spec,
    child: Option<Child>,
    tail: Arc<Mutex<VecDeque<String>>>,
    /// The threads passing its output through (they end when it exits).
    readers: Vec<JoinHandle<()>>,
    ready_tx: Sender<String>,
    ready: Receiver<String>,
    restarts: Restarts,
    state: State,
    /// When it last died (for "serving again after").
    died_at: Option<Instant>,
}

impl std::fmt::Debug for Process {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Process")
            .field("name", &self.spec.name)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Process {
    /// Starts `spec`.
    pub fn start(spec: Spec, policy: RestartPolicy) -> Result<Self> {
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let mut process = Self {
            spec,
            child: None,
            tail: Arc::new(Mutex::new(VecDeque::with_capacity(TAIL))),
            readers: Vec::new(),
            ready_tx,
            ready,
            restarts: Restarts::new(policy, Instant::now()),
            state: State::Running,
            died_at: None,
        };
        process.spawn()?;
        Ok(process)
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// What became of it.
    pub fn state(&self) -> State {
        self.state
    }

    /// Times it was started again.
    pub fn restarts(&self) -> u32 {
        self.restarts.count()
    }

    fn spawn(&mut self) -> Result<()> {
        let mut cmd = Command::new(&self.spec.program);
        cmd.args(&self.spec.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &self.spec.env {
            cmd.env(k, v);
        }
        // Nothing `up` started outlives it, even when it is killed.
        cmd.env(
            dpumesh_supervise::parent::PARENT_ENV,
            std::process::id().to_string(),
        );
        if let Some(dir) = &self.spec.dir {
            cmd.current_dir(dir);
        }
        let mut child = cmd.spawn().with_context(|| {
            format!(
                "cannot start {}: {}",
                self.spec.name,
                self.spec.program.display()
            )
        })?;
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        self.readers = vec![
            self.pass_through(stdout, false),
            self.pass_through(stderr, true),
        ];
        self.child = Some(child);
        self.state = State::Running;
        Ok(())
    }

    /// Prints the child's lines with its name in front and keeps the last ones; the
    /// ready line goes to whoever waits for it.
    fn pass_through(&self, stream: impl Read + Send + 'static, err: bool) -> JoinHandle<()> {
        let label = self.spec.name.clone();
        let tail = self.tail.clone();
        let ready = self.ready_tx.clone();
        std::thread::spawn(move || {
            // A backtrace (RUST_BACKTRACE) is passed through but not kept: it would push
            // the error it follows out of the report.
            let mut backtrace = false;
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if !err && line.starts_with(READY) {
                    let _ = ready.send(line);
                    continue;
                }
                if err {
                    say_err!("[{label}] {line}");
                } else {
                    say!("[{label}] {line}");
                }
                backtrace |= line.trim_start().starts_with("Stack backtrace:")
                    || line.contains("stack backtrace:");
                if backtrace {
                    continue;
                }
                let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                if tail.len() == TAIL {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        })
    }

    /// Waits up to `timeout` for its ready line; an error if it exits first or stays
    /// silent (its death is then the supervisor's to notice).
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.ready.recv_timeout(Duration::from_millis(50)) {
                Ok(line) => return Ok(line),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                anyhow::bail!("{} exited as it started ({status})", self.spec.name);
            }
            if Instant::now() >= deadline {
                anyhow::bail!(
                    "{} did not become ready within {} s (see its output above)",
                    self.spec.name,
                    timeout.as_secs()
                );
            }
        }
    }

    /// One look: a death is noticed (and its restart scheduled or given up on), a
    /// due restart happens, a ready line after a restart is reported.
    pub fn supervise(&mut self, now: Instant) -> Vec<Event> {
        let mut events = Vec::new();
        match self.state {
            State::Running => {
                let status = match self.child.as_mut().map(Child::try_wait) {
                    Some(Ok(Some(status))) => Some(status.to_string()),
                    Some(Ok(None)) => None,
                    Some(Err(e)) => Some(format!("cannot be waited for: {e}")),
                    None => Some("not running".to_owned()),
                };
                if let Some(status) = status {
                    self.child = None;
                    self.died(now, status, &mut events);
                }
            }
            State::Waiting(at) if now >= at => {
                self.restarts.restarted(now);
                match self.spawn() {
                    Ok(()) => events.push(Event::Restarted {
                        count: self.restarts.count(),
                    }),
                    Err(e) => {
                        events.push(Event::SpawnFailed(format!("{e:#}")));
                        self.died(now, "could not start".to_owned(), &mut events);
                    }
                }
            }
            State::Waiting(_) | State::GaveUp => {}
        }
        while self.ready.try_recv().is_ok() {
            if let Some(died) = self.died_at.take() {
                events.push(Event::Serving {
                    after: now.saturating_duration_since(died),
                });
            }
        }
        events
    }

    fn died(&mut self, now: Instant, status: String, events: &mut Vec<Event>) {
        self.died_at.get_or_insert(now);
        // Its last words are still in the pipes: let the readers get to the end (a
        // child of its that kept the pipe open is not waited for long).
        let until = Instant::now() + Duration::from_millis(200);
        while self.readers.iter().any(|r| !r.is_finished()) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(2));
        }
        self.readers.clear();
        match self.restarts.died(now) {
            Verdict::RestartAt(at) => {
                self.state = State::Waiting(at);
                events.push(Event::Died {
                    status,
                    delay: at.saturating_duration_since(now),
                });
            }
            Verdict::GiveUp { quick_deaths } => {
                self.state = State::GaveUp;
                events.push(Event::GaveUp {
                    status,
                    quick_deaths,
                    tail: self
                        .tail
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .iter()
                        .cloned()
                        .collect(),
                });
            }
        }
    }

    /// Asks it to stop (SIGTERM).
    pub fn terminate(&self) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }

    /// Waits until `deadline` for it to exit, then kills it.
    pub fn reap(&mut self, deadline: Instant) {
        let Some(child) = self.child.as_mut() else {
            return;
        };
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    tracing::warn!(name = %self.spec.name, "did not stop: killed");
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
            }
        }
        self.child = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn supervise_until(p: &mut Process, what: impl Fn(&Event) -> bool) -> Vec<Event> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            let events = p.supervise(Instant::now());
            let done = events.iter().any(&what);
            seen.extend(events);
            if done {
                return seen;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("never saw the event; saw {seen:?}");
    }

    #[test]
    fn a_dead_process_is_started_again_and_reports_serving() {
        let spec = Spec::new("sh", "sh").args([
            "-c",
            &format!("echo {READY} up; sleep 0.05; echo bye; exit 3"),
        ]);
        let mut p = Process::start(spec, RestartPolicy::default()).unwrap();
        p.wait_ready(Duration::from_secs(5)).unwrap();
        let mut quiet =
            Process::start(Spec::new("quiet", "true"), RestartPolicy::default()).unwrap();
        let e = quiet.wait_ready(Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("exited as it started"), "{e}");
        let seen = supervise_until(&mut p, |e| matches!(e, Event::Serving { .. }));
        assert!(
            seen.iter()
                .any(|e| matches!(e, Event::Died { status, .. } if status.contains('3'))),
            "{seen:?}"
        );
        assert!(seen.contains(&Event::Restarted { count: 1 }), "{seen:?}");
        assert_eq!(p.restarts(), 1);
    }

    #[test]
    fn a_crash_loop_is_given_up_on_with_its_last_lines() {
        let policy = RestartPolicy {
            first: Duration::from_millis(1),
            cap: Duration::from_millis(5),
            stable: Duration::from_secs(10),
            max_quick_deaths: 2,
        };
        let spec =
            Spec::new("crash", "sh").args(["-c", "echo cannot bind 127.0.0.1:1 >&2; exit 1"]);
        let mut p = Process::start(spec, policy).unwrap();
        let seen = supervise_until(&mut p, |e| matches!(e, Event::GaveUp { .. }));
        let Some(Event::GaveUp {
            quick_deaths, tail, ..
        }) = seen.last()
        else {
            panic!("{seen:?}")
        };
        assert_eq!(*quick_deaths, 2);
        assert!(tail.iter().any(|l| l.contains("cannot bind")), "{tail:?}");
        assert_eq!(p.state(), State::GaveUp);
        assert_eq!(p.restarts(), 2);
    }

    #[test]
    fn a_program_that_cannot_start_is_an_error() {
        let spec = Spec::new("missing", "/nonexistent/dpumesh-test-program");
        let e = Process::start(spec, RestartPolicy::default()).unwrap_err();
        assert!(format!("{e:#}").contains("cannot start missing"), "{e:#}");
    }
}

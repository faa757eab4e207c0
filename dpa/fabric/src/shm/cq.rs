//! Completion queues of the shared-memory fabric.
//!
//! Completions of work this process carried out (its sends, writes, reads) are queued
//! here as they happen; completions the peers produced for its receives sit in each
//! queue pair's ring until a poll moves them here. The queue's bell is what peers
//! ring after publishing, and its epoll set holds the bell and each queue pair's
//! handshake socket (which closes when the peer goes away), so one wait covers both.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use rustix::event::epoll;

use super::qp::QpInner;
use crate::{FabricError, Interrupter, WorkCompletion};
use dpumesh_rings::bell::Bell;

const BELL_TOKEN: u64 = u64::MAX;
/// How often a poll that never sleeps looks at the peers' sockets (a peer that went
/// away is noticed within this even on a busy queue).
const LIVENESS_EVERY: Duration = Duration::from_millis(10);

/// A completion queue's shared state.
pub(super) struct CqInner {
    pub(super) bell: Bell,
    epoll: OwnedFd,
    local: Mutex<VecDeque<WorkCompletion>>,
    queued: AtomicUsize,
    depth: usize,
    qps: RwLock<HashMap<u32, Weak<QpInner>>>,
    interrupted: AtomicBool,
    overflowed: AtomicBool,
    started: Instant,
    /// Nanoseconds since `started` of the last look at the sockets.
    checked: AtomicU64,
}

impl std::fmt::Debug for CqInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmCq")
            .field("depth", &self.depth)
            .field("queued", &self.queued.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl CqInner {
    pub(super) fn new(depth: u32) -> Result<Self, FabricError> {
        let bell = Bell::create("dpumesh-shmf-cq")
            .map_err(|e| FabricError::Io(std::io::Error::other(e.to_string())))?;
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(std::io::Error::from)?;
        epoll::add(
            &epoll,
            bell.fd(),
            epoll::EventData::new_u64(BELL_TOKEN),
            epoll::EventFlags::IN,
        )
        .map_err(std::io::Error::from)?;
        Ok(Self {
            bell,
            epoll,
            local: Mutex::new(VecDeque::new()),
            queued: AtomicUsize::new(0),
            depth: depth.max(1) as usize,
            qps: RwLock::new(HashMap::new()),
            interrupted: AtomicBool::new(false),
            overflowed: AtomicBool::new(false),
            started: Instant::now(),
            checked: AtomicU64::new(0),
        })
    }

    /// Queues a completion of this process's own work (a send, a write, a read, a
    /// flush). It rings no bell: such work is posted by the thread that owns the
    /// queue pair and polls this queue (a shard), which looks at `local` before it
    /// sleeps. Completions a peer causes come through the shared rings and ring.
    pub(super) fn push(&self, wc: WorkCompletion) {
        let mut local = self.local.lock();
        if local.len() >= self.depth {
            // Verbs treats an overrun as a fatal queue error; keep the oldest and say so
            // loudly (the depth is the caller's to size).
            if !self.overflowed.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    depth = self.depth,
                    "completion queue overrun: completions lost"
                );
            }
            return;
        }
        local.push_back(wc);
        self.queued.store(local.len(), Ordering::Release);
    }

    /// Puts queue pair `qp` on this queue: its completions are polled here and its
    /// peer's departure wakes a wait.
    pub(super) fn attach(&self, qp: &Arc<QpInner>) -> Result<(), FabricError> {
        epoll::add(
            &self.epoll,
            qp.sock.as_fd(),
            epoll::EventData::new_u64(u64::from(qp.num)),
            epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
        )
        .map_err(std::io::Error::from)?;
        self.qps.write().insert(qp.num, Arc::downgrade(qp));
        Ok(())
    }

    fn each_qp(&self, mut f: impl FnMut(&QpInner) -> bool) -> bool {
        let mut dead = false;
        let mut any = false;
        for qp in self.qps.read().values() {
            match qp.upgrade() {
                Some(qp) => any |= f(&qp),
                None => dead = true,
            }
        }
        if dead {
            self.qps.write().retain(|_, qp| qp.strong_count() > 0);
        }
        any
    }

    /// Whether a poll would find completions (or work that makes some).
    pub(super) fn has_work(&self) -> bool {
        self.queued.load(Ordering::Acquire) > 0 || self.each_qp(QpInner::has_work)
    }

    /// Waits up to `timeout` on the bell and the peers' sockets; a socket that closed
    /// or broke fails its queue pair.
    fn check_sockets(&self, timeout: Option<Duration>) -> Result<(), FabricError> {
        self.checked
            .store(self.started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let mut events = Vec::with_capacity(16);
        let ts = timeout.map(|t| rustix::fs::Timespec {
            tv_sec: t.as_secs() as i64,
            tv_nsec: t.subsec_nanos() as i64,
        });
        match epoll::wait(
            &self.epoll,
            rustix::buffer::spare_capacity(&mut events),
            ts.as_ref(),
        ) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(FabricError::Io(e.into())),
        }
        for event in &events {
            let token = event.data.u64();
            if token == BELL_TOKEN {
                self.bell.drain();
                continue;
            }
            let Some(qp) = self.qps.read().get(&(token as u32)).and_then(Weak::upgrade) else {
                continue;
            };
            // Nothing is ever sent on the socket after the handshake: readable means
            // closed (or broken).
            let mut byte = [0u8; 1];
            match rustix::net::recv(&qp.sock, &mut byte, rustix::net::RecvFlags::DONTWAIT) {
                Err(rustix::io::Errno::AGAIN) => {}
                _ => {
                    let _ = epoll::delete(&self.epoll, qp.sock.as_fd());
                    qp.peer_gone();
                }
            }
        }
        Ok(())
    }

    pub(super) fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let now = self.started.elapsed().as_nanos() as u64;
        if now.saturating_sub(self.checked.load(Ordering::Relaxed))
            > LIVENESS_EVERY.as_nanos() as u64
        {
            let _ = self.check_sockets(Some(Duration::ZERO));
        }
        self.each_qp(|qp| {
            if qp.has_work() {
                qp.progress();
            }
            false
        });
        let mut local = self.local.lock();
        let n = local.len().min(max);
        out.extend(local.drain(..n));
        self.queued.store(local.len(), Ordering::Release);
        n
    }

    pub(super) fn wait(&self, timeout: Duration) -> Result<bool, FabricError> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.has_work() {
                return Ok(true);
            }
            if self.interrupted.swap(false, Ordering::SeqCst) {
                return Ok(false);
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Ok(false);
            };
            self.bell.sleep_begins();
            if self.has_work() {
                self.bell.sleep_ends();
                return Ok(true);
            }
            let waited = self.check_sockets(Some(left));
            self.bell.sleep_ends();
            waited?;
            if Instant::now() >= deadline {
                return Ok(self.has_work());
            }
        }
    }

    pub(super) fn interrupter(self: &Arc<Self>) -> Interrupter {
        let me = self.clone();
        Interrupter::new(move || {
            me.interrupted.store(true, Ordering::SeqCst);
            me.bell.interrupt();
        })
    }

    pub(super) fn wait_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }

    pub(super) fn prepare_sleep(&self) -> bool {
        // Withdrawn by `finish_sleep`, which the caller calls either way.
        self.bell.sleep_begins();
        !self.has_work()
    }

    pub(super) fn end_sleep(&self) {
        self.bell.sleep_ends();
    }

    pub(super) fn finish_sleep(&self) {
        self.bell.sleep_ends();
        // Consumes the bell's wake-up and any socket event, so the epoll descriptor
        // is quiet again until the next ring.
        let _ = self.check_sockets(Some(Duration::ZERO));
    }
}

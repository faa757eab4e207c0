//! A bell: how producers in any thread or process wake a consumer that sleeps in
//! `epoll` — an eventfd the consumer watches, and a `waiting` word in shared memory
//! that says whether it sleeps.
//!
//! A producer publishes its work (a ring entry, a completion), then rings: a fence and
//! a load of `waiting`, and only when the consumer announced it is going to sleep, one
//! `write` to the eventfd. A busy consumer therefore costs producers no system call at
//! all. The consumer raises `waiting`, fences, looks at its queues once more, then
//! sleeps; so either it sees the work or the producer sees it waiting (the same
//! store–fence–load handshake as a ring's own wake word). Because the wake-up is an
//! eventfd, one `epoll_wait` covers a consumer's bells, sockets and timers: one wait
//! set for everything it serves.
//!
//! Another process gets the bell as its region's path plus the eventfd passed over a
//! Unix socket ([`crate::fdpass`]).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering, fence};

use rustix::event::{EventfdFlags, eventfd};

use crate::shm::{SharedRegion, ShmError};

/// Bytes a bell's region needs.
pub const BELL_LEN: usize = 64;

/// Why a bell could not be made or opened.
#[derive(Debug, thiserror::Error)]
pub enum BellError {
    /// Its shared word.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// Its eventfd.
    #[error("cannot create an eventfd: {0}")]
    Eventfd(#[from] std::io::Error),
}

/// A bell, at the consumer's end or a producer's.
#[derive(Debug, Clone)]
pub struct Bell {
    region: Arc<SharedRegion>,
    fd: Arc<OwnedFd>,
}

impl Bell {
    /// A new bell (the consumer's).
    pub fn create(prefix: &str) -> Result<Self, BellError> {
        let region = Arc::new(SharedRegion::create_unique(prefix, BELL_LEN)?);
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(std::io::Error::from)?;
        Self::from_parts(region, fd)
    }

    /// A new bell in a sealed region (shared by its descriptor, see
    /// [`SharedRegion::create_sealed`]).
    pub fn create_sealed(name: &str) -> Result<Self, BellError> {
        let region = Arc::new(SharedRegion::create_sealed(name, BELL_LEN)?);
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(std::io::Error::from)?;
        Self::from_parts(region, fd)
    }

    /// The region (its descriptor is what another process maps).
    pub fn region(&self) -> &Arc<SharedRegion> {
        &self.region
    }

    /// Another process's bell: its region and its eventfd.
    pub fn from_parts(region: Arc<SharedRegion>, fd: OwnedFd) -> Result<Self, BellError> {
        region.atomic_u32s(0, 1)?;
        Ok(Self {
            region,
            fd: Arc::new(fd),
        })
    }

    /// Opens another process's bell from its region's path and its eventfd.
    pub fn open(path: &Path, fd: OwnedFd) -> Result<Self, BellError> {
        Self::from_parts(Arc::new(SharedRegion::open(path)?), fd)
    }

    /// The region's path (what another process opens).
    pub fn path(&self) -> &Path {
        self.region.path()
    }

    /// The eventfd: readable after a ring; what the consumer puts in its wait set and
    /// what is passed to producers in other processes.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn waiting(&self) -> &AtomicU32 {
        &self.region.atomic_u32s(0, 1).expect("checked when made")[0]
    }

    /// Wakes the consumer if it sleeps (or is about to). Call after publishing.
    pub fn ring(&self) {
        // Pairs with the consumer's fence between raising `waiting` and its last look
        // at its queues: either it sees what we published, or we see it waiting.
        fence(Ordering::SeqCst);
        if self.waiting().load(Ordering::Relaxed) != 0 {
            self.interrupt();
        }
    }

    /// Wakes the consumer whether it sleeps or not (its next wait returns at once):
    /// for shutdown and out-of-band events.
    pub fn interrupt(&self) {
        let _ = rustix::io::write(&*self.fd, &1u64.to_ne_bytes());
    }

    /// The consumer is about to sleep: after this it must look at its queues once more
    /// before it waits. Sleepers are counted, so several threads may wait on one bell.
    pub fn sleep_begins(&self) {
        self.waiting().fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// The consumer is awake again.
    pub fn sleep_ends(&self) {
        self.waiting().fetch_sub(1, Ordering::Relaxed);
    }

    /// Consumes pending rings (the eventfd is non-blocking); true if there were any.
    pub fn drain(&self) -> bool {
        let mut buf = [0u8; 8];
        matches!(rustix::io::read(&*self.fd, &mut buf), Ok(8))
    }

    /// Sleeps until rung or `timeout` (`None`: no limit), unless `ready()` holds once
    /// the sleep is announced. Returns whether it was rung or found ready.
    pub fn wait(
        &self,
        timeout: Option<std::time::Duration>,
        mut ready: impl FnMut() -> bool,
    ) -> bool {
        self.sleep_begins();
        let woke = if ready() {
            true
        } else {
            let mut fds = [rustix::event::PollFd::new(
                &*self.fd,
                rustix::event::PollFlags::IN,
            )];
            let ts = timeout.map(|t| rustix::fs::Timespec {
                tv_sec: t.as_secs() as i64,
                tv_nsec: t.subsec_nanos() as i64,
            });
            matches!(rustix::event::poll(&mut fds, ts.as_ref()), Ok(n) if n > 0)
        };
        self.sleep_ends();
        self.drain() || woke
    }
}

/// One wait set for everything a consumer serves: bells, completion queues,
/// sockets — whatever has a descriptor that turns readable (an epoll set).
pub struct WaitSet {
    epoll: OwnedFd,
}

impl std::fmt::Debug for WaitSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitSet").finish_non_exhaustive()
    }
}

impl WaitSet {
    /// An empty set.
    pub fn new() -> std::io::Result<Self> {
        let epoll = rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)?;
        Ok(Self { epoll })
    }

    /// Watches `fd` for readability.
    pub fn add(&mut self, fd: BorrowedFd<'_>, token: u64) -> std::io::Result<()> {
        rustix::event::epoll::add(
            &self.epoll,
            fd,
            rustix::event::epoll::EventData::new_u64(token),
            rustix::event::epoll::EventFlags::IN,
        )?;
        Ok(())
    }

    /// Sleeps until something in the set is readable, or `timeout`; returns how many
    /// are (their state is the caller's to consume).
    pub fn wait(&mut self, timeout: std::time::Duration) -> std::io::Result<usize> {
        let mut events = [std::mem::MaybeUninit::<rustix::event::epoll::Event>::uninit(); 16];
        let ts = rustix::fs::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: timeout.subsec_nanos() as i64,
        };
        match rustix::event::epoll::wait(&self.epoll, &mut events, Some(&ts)) {
            Ok((ready, _)) => Ok(ready.len()),
            Err(rustix::io::Errno::INTR) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }
}

/// Makes a waiting completion queue's `wait` (or a ring's reader) return early, from
/// any thread: one thread can then sleep on its queues and still be woken for other
/// work (a channel, a ring).
#[derive(Clone)]
pub struct Interrupter(Arc<dyn Fn() + Send + Sync>);

impl Interrupter {
    /// Wraps the function that wakes the waiter.
    pub fn new(f: impl Fn() + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// Wakes the waiter (or makes its next wait return at once).
    pub fn interrupt(&self) {
        (self.0)()
    }
}

impl std::fmt::Debug for Interrupter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Interrupter")
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_ring_wakes_a_sleeper_and_costs_nothing_when_nobody_sleeps() {
        let bell = Bell::create("dpumesh-test-bell").unwrap();
        // Nobody waits: the ring does not touch the eventfd.
        bell.ring();
        assert!(!bell.drain(), "no write while the consumer is awake");
        // A sleeper is woken by a ring from another "process" (its own mapping and a
        // duplicated eventfd).
        let other = Bell::open(
            bell.path(),
            rustix::io::fcntl_dupfd_cloexec(bell.fd(), 0).unwrap(),
        )
        .unwrap();
        let flag = Arc::new(AtomicBool::new(false));
        let ringer = {
            let flag = flag.clone();
            std::thread::spawn(move || {
                // Ring only once the consumer is really waiting.
                while other.waiting().load(Ordering::SeqCst) == 0 {
                    std::thread::yield_now();
                }
                flag.store(true, Ordering::SeqCst);
                other.ring();
            })
        };
        let started = Instant::now();
        assert!(bell.wait(Some(Duration::from_secs(30)), || {
            flag.load(Ordering::SeqCst)
        }));
        assert!(started.elapsed() < Duration::from_secs(30));
        dpumesh_test_support::joined(ringer);
        // A quiet bell times out.
        assert!(!bell.wait(Some(Duration::from_millis(10)), || false));
    }

    #[test]
    fn work_published_before_the_sleep_is_seen_without_a_ring() {
        let bell = Bell::create("dpumesh-test-bell").unwrap();
        assert!(bell.wait(Some(Duration::from_secs(30)), || true));
        bell.interrupt();
        assert!(
            bell.wait(Some(Duration::from_secs(30)), || false),
            "an interrupt makes the next wait return"
        );
    }
}

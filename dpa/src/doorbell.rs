//! A doorbell: one futex word in shared memory that a consumer of many rings (the DMA
//! manager polls every pod's TX SQ and every sidecar RX SQ) sleeps on, and that every
//! producer of those rings rings after publishing. One sleeper per doorbell: its
//! `waiting` flag is a single word. The same store–fence–load handshake
//! as a ring's own wake word, so no ring is missed and producers pay a futex call only
//! while the consumer sleeps.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

use crate::shm::{SharedRegion, ShmError};

/// Bytes a doorbell region needs.
pub const DOORBELL_LEN: usize = 64;

/// A doorbell mapped in this process.
#[derive(Debug, Clone)]
pub struct Doorbell {
    region: Arc<SharedRegion>,
}

impl Doorbell {
    /// Over a region (fresh or another process's).
    pub fn new(region: Arc<SharedRegion>) -> Result<Self, ShmError> {
        region.atomic_u32s(0, 2)?;
        Ok(Self { region })
    }

    /// Creates a region for a doorbell.
    pub fn create_in_shm(prefix: &str) -> Result<Self, ShmError> {
        Self::new(Arc::new(SharedRegion::create_unique(prefix, DOORBELL_LEN)?))
    }

    /// The shared region.
    pub fn region(&self) -> &Arc<SharedRegion> {
        &self.region
    }

    fn words(&self) -> &[AtomicU32] {
        self.region.atomic_u32s(0, 2).expect("checked at creation")
    }

    /// Wakes the sleeper, if any. Call after publishing.
    pub fn ring(&self) {
        let [waiting, seq] = self.words() else {
            unreachable!()
        };
        fence(Ordering::SeqCst);
        if waiting.load(Ordering::Relaxed) != 0 {
            seq.fetch_add(1, Ordering::Release);
            let _ =
                rustix::thread::futex::wake(seq, rustix::thread::futex::Flags::empty(), u32::MAX);
        }
    }

    /// Sleeps up to `timeout` unless `ready()` says there is work, checked after
    /// announcing the sleep so that a ring in between is never lost. Returns whether
    /// `ready()` held at the end.
    pub fn sleep_unless(&self, timeout: Duration, mut ready: impl FnMut() -> bool) -> bool {
        let [waiting, seq] = self.words() else {
            unreachable!()
        };
        let deadline = Instant::now() + timeout;
        loop {
            let seen = seq.load(Ordering::Acquire);
            waiting.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if ready() {
                waiting.store(0, Ordering::Relaxed);
                return true;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                waiting.store(0, Ordering::Relaxed);
                return false;
            };
            let ts = rustix::fs::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as i64,
            };
            let _ = rustix::thread::futex::wait(
                seq,
                rustix::thread::futex::Flags::empty(),
                seen,
                Some(&ts),
            );
            waiting.store(0, Ordering::Relaxed);
            if seq.load(Ordering::Acquire) != seen || ready() {
                return ready();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    #[test]
    fn a_ring_wakes_the_sleeper_and_a_quiet_bell_times_out() {
        let bell = Doorbell::create_in_shm("dpumesh-test-bell").unwrap();
        let flag = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        assert!(!bell.sleep_unless(Duration::from_millis(20), || flag.load(Ordering::SeqCst)));
        assert!(started.elapsed() >= Duration::from_millis(20));

        let other =
            Doorbell::new(Arc::new(SharedRegion::open(bell.region().path()).unwrap())).unwrap();
        let setter = {
            let flag = flag.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                flag.store(true, Ordering::SeqCst);
                other.ring();
            })
        };
        let started = Instant::now();
        assert!(bell.sleep_unless(Duration::from_secs(10), || flag.load(Ordering::SeqCst)));
        assert!(started.elapsed() < Duration::from_secs(5));
        setter.join().unwrap();
    }
}

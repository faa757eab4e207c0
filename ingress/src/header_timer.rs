//! The client connections' head and idle clocks (`idle`) on one deadline list per
//! ingress thread.
//!
//! A connection moves its clock about once per request (a head's limit, then the
//! idle limit after its answer). With `TokioTimer` each arming is a new timer in
//! tokio's wheel, and one due earlier than the deadline the runtime last parked for
//! makes tokio wake its own driver: an eventfd write, a system call on the request
//! path. Under `bench/mesh.sh`'s load that was about one request in five with hyper's
//! own header timer (the ingress's only `write` besides the fabric's doorbells).
//!
//! Here each such sleep is an entry in a list the thread keeps, and one tokio timer,
//! armed for the earliest entry, fires them. Deadlines of one timeout only move later,
//! so an entry is added or moved without touching tokio; the timer is armed again
//! when it fires (finding most of the entries it was armed for moved on) or when an
//! entry comes due before it (the first one after an idle spell, a head's limit below
//! an idle one). An idle thread has no entry and no timer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

/// A [`hyper::rt::Timer`] whose sleeps share one tokio timer per thread. Clones share
/// the list; [`HeaderTimer::start`] spawns what fires it on the current local task set.
#[derive(Clone)]
pub struct HeaderTimer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for HeaderTimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = self.inner.list.lock();
        f.debug_struct("HeaderTimer")
            .field("sleeps", &list.live)
            .field("armed", &list.armed)
            .finish()
    }
}

struct Inner {
    list: Mutex<List>,
    /// Rung when an entry is due before the armed timer (or none is armed).
    rearm: Notify,
}

#[derive(Default)]
struct List {
    /// Sleeps by key; `None` is a free key (in `free`).
    entries: Vec<Option<Entry>>,
    free: Vec<usize>,
    live: usize,
    /// When the tokio timer fires, if one is armed.
    armed: Option<Instant>,
    /// How many times a tokio timer was armed (what the list saves is this staying
    /// small).
    arms: u64,
}

struct Entry {
    deadline: Instant,
    fired: bool,
    waker: Option<Waker>,
}

impl List {
    fn insert(&mut self, deadline: Instant) -> usize {
        let entry = Some(Entry {
            deadline,
            fired: false,
            waker: None,
        });
        self.live += 1;
        match self.free.pop() {
            Some(key) => {
                self.entries[key] = entry;
                key
            }
            None => {
                self.entries.push(entry);
                self.entries.len() - 1
            }
        }
    }

    fn remove(&mut self, key: usize) {
        if let Some(slot) = self.entries.get_mut(key)
            && slot.take().is_some()
        {
            self.live -= 1;
            self.free.push(key);
        }
    }

    /// Marks every entry due at `now` fired and returns their wakers.
    fn fire(&mut self, now: Instant) -> Vec<Waker> {
        let mut woken = Vec::new();
        for e in self.entries.iter_mut().flatten() {
            if !e.fired && e.deadline <= now {
                e.fired = true;
                woken.extend(e.waker.take());
            }
        }
        woken
    }

    /// The earliest deadline not yet fired.
    fn earliest(&self) -> Option<Instant> {
        self.entries
            .iter()
            .flatten()
            .filter(|e| !e.fired)
            .map(|e| e.deadline)
            .min()
    }

    /// Whether a new deadline needs the timer armed earlier.
    fn needs_rearm(&self, deadline: Instant) -> bool {
        self.armed.is_none_or(|armed| deadline < armed)
    }
}

/// The time as tokio sees it (tokio's clock can be paused in tests).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl HeaderTimer {
    /// A timer whose firing runs on the current thread's local task set (call within
    /// one), for as long as the set runs.
    pub fn start() -> Self {
        let inner = Arc::new(Inner {
            list: Mutex::new(List::default()),
            rearm: Notify::new(),
        });
        tokio::task::spawn_local(drive(inner.clone()));
        Self { inner }
    }

    fn add(&self, deadline: Instant) -> HeaderSleep {
        let mut list = self.inner.list.lock();
        let key = list.insert(deadline);
        if list.needs_rearm(deadline) {
            self.inner.rearm.notify_waiters();
        }
        HeaderSleep {
            inner: self.inner.clone(),
            key,
        }
    }

    /// Sleeps not yet dropped.
    #[cfg(test)]
    fn sleeps(&self) -> usize {
        self.inner.list.lock().live
    }

    /// How many times the shared tokio timer was armed so far.
    #[cfg(test)]
    fn arms(&self) -> u64 {
        self.inner.list.lock().arms
    }
}

/// Fires due entries and keeps one tokio timer armed for the earliest of the rest.
async fn drive(inner: Arc<Inner>) {
    loop {
        // Listening before looking at the list: an entry added after the look rings
        // this; one added before it is in the look (`notify_waiters` keeps no permit,
        // so no stale ring from before arms the timer twice).
        let rearmed = inner.rearm.notified();
        tokio::pin!(rearmed);
        rearmed.as_mut().enable();
        let (woken, next) = {
            let mut list = inner.list.lock();
            let woken = list.fire(now());
            list.armed = list.earliest();
            if list.armed.is_some() {
                list.arms += 1;
            }
            (woken, list.armed)
        };
        woken.into_iter().for_each(Waker::wake);
        match next {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at.into()) => {}
                    () = &mut rearmed => {}
                }
            }
            None => rearmed.await,
        }
    }
}

impl hyper::rt::Timer for HeaderTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(self.add(now() + duration))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(self.add(deadline))
    }

    fn now(&self) -> Instant {
        now()
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: Instant) {
        let Some(mine) = sleep.as_mut().downcast_mut_pin::<HeaderSleep>() else {
            *sleep = self.sleep_until(new_deadline);
            return;
        };
        let mut list = self.inner.list.lock();
        if let Some(Some(e)) = list.entries.get_mut(mine.key) {
            e.deadline = new_deadline;
            e.fired = false;
        }
        if list.needs_rearm(new_deadline) {
            self.inner.rearm.notify_waiters();
        }
    }
}

/// One sleep of a [`HeaderTimer`]: ready once the timer fired its entry.
struct HeaderSleep {
    inner: Arc<Inner>,
    key: usize,
}

impl Future for HeaderSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut list = self.inner.list.lock();
        let Some(Some(e)) = list.entries.get_mut(self.key) else {
            // Cannot happen: the entry lives as long as this sleep.
            return Poll::Ready(());
        };
        if e.fired {
            return Poll::Ready(());
        }
        match &mut e.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl hyper::rt::Sleep for HeaderSleep {}

impl Drop for HeaderSleep {
    fn drop(&mut self) {
        self.inner.list.lock().remove(self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Timer;

    /// Runs `test` on a paused clock in a local task set (time moves only when told,
    /// or when every task waits on a timer).
    fn paused(test: impl Future<Output = ()>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        tokio::task::LocalSet::new().block_on(&rt, test);
    }

    /// Polls `sleep` once without waiting.
    fn ready(sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        sleep.as_mut().poll(&mut cx).is_ready()
    }

    #[test]
    fn a_sleep_ends_at_its_deadline_and_not_before() {
        paused(async {
            let timer = HeaderTimer::start();
            let started = tokio::time::Instant::now();
            timer.sleep(Duration::from_secs(10)).await;
            assert_eq!(started.elapsed(), Duration::from_secs(10));
            let mut early = timer.sleep(Duration::from_secs(10));
            tokio::time::sleep(Duration::from_millis(9_999)).await;
            assert!(!ready(&mut early), "fired early");
            tokio::time::sleep(Duration::from_millis(2)).await;
            assert!(ready(&mut early), "did not fire at its deadline");
        });
    }

    #[test]
    fn an_earlier_sleep_after_a_later_one_still_fires_first() {
        paused(async {
            let timer = HeaderTimer::start();
            let mut late = timer.sleep(Duration::from_secs(30));
            tokio::task::yield_now().await;
            let started = tokio::time::Instant::now();
            timer.sleep(Duration::from_secs(1)).await;
            assert_eq!(started.elapsed(), Duration::from_secs(1));
            assert!(!ready(&mut late));
        });
    }

    #[test]
    fn a_reset_sleep_fires_at_its_new_deadline() {
        paused(async {
            let timer = HeaderTimer::start();
            let mut sleep = timer.sleep(Duration::from_secs(1));
            tokio::time::sleep(Duration::from_secs(2)).await;
            assert!(ready(&mut sleep));
            timer.reset(&mut sleep, timer.now() + Duration::from_secs(5));
            assert!(!ready(&mut sleep), "a reset sleep is pending again");
            tokio::time::sleep(Duration::from_secs(4)).await;
            assert!(!ready(&mut sleep));
            tokio::time::sleep(Duration::from_secs(2)).await;
            assert!(ready(&mut sleep));
        });
    }

    #[test]
    fn dropped_sleeps_leave_nothing_behind() {
        paused(async {
            let timer = HeaderTimer::start();
            let sleeps: Vec<_> = (0..100)
                .map(|i| timer.sleep(Duration::from_secs(1 + i)))
                .collect();
            assert_eq!(timer.sleeps(), 100);
            drop(sleeps);
            assert_eq!(timer.sleeps(), 0);
            // The timer armed for the first of them finds nothing and disarms.
            tokio::time::sleep(Duration::from_secs(5)).await;
            assert_eq!(timer.inner.list.lock().armed, None);
        });
    }

    /// What the list is for: a connection's next sleep, due later than the one before,
    /// never arms tokio's timer again.
    #[test]
    fn request_after_request_arms_the_tokio_timer_once() {
        paused(async {
            let timer = HeaderTimer::start();
            for _ in 0..1_000 {
                let mut sleep = timer.sleep(Duration::from_secs(10));
                assert!(!ready(&mut sleep));
                tokio::task::yield_now().await;
                tokio::time::advance(Duration::from_millis(1)).await;
                drop(sleep);
            }
            assert_eq!(timer.arms(), 1);
        });
    }
}

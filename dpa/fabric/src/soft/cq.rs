//! Completion queues: completions in order, the epoll set of their queue pairs' sockets,
//! sleeping and waking, and sends held until the owner flushes them.

use super::*;

impl CqInner {
    pub(super) fn push(&self, wc: WorkCompletion) {
        {
            let mut entries = self.entries.lock();
            if entries.len() >= self.depth {
                // Verbs treats an overrun as a fatal CQ error; keep the oldest and say
                // so loudly (the depth is the caller's to size).
                if !self.overflowed.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        depth = self.depth,
                        "completion queue overrun: completions lost"
                    );
                }
                return;
            }
            entries.push_back(wc);
        }
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
        }
    }

    /// Waits up to `timeout` for socket activity, then progresses every ready queue
    /// pair.
    pub(super) fn progress(&self, timeout: Option<Duration>) -> Result<(), FabricError> {
        thread_local! {
            // One epoll buffer per polling thread, not one per wait.
            static EVENTS: std::cell::RefCell<Vec<epoll::Event>> = std::cell::RefCell::new(Vec::with_capacity(64));
        }
        let mut events = EVENTS.with(|e| std::mem::take(&mut *e.borrow_mut()));
        events.clear();
        events.reserve(64);
        let result = self.progress_with(timeout, &mut events);
        EVENTS.with(|e| *e.borrow_mut() = events);
        result
    }

    pub(super) fn progress_with(
        &self,
        timeout: Option<Duration>,
        events: &mut Vec<epoll::Event>,
    ) -> Result<(), FabricError> {
        let ts = timeout.map(|t| rustix::fs::Timespec {
            tv_sec: t.as_secs() as i64,
            tv_nsec: t.subsec_nanos() as i64,
        });
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        // A completion pushed by another thread between our last look and this wait
        // rings the eventfd, so the wait returns.
        let waited = if timeout.is_some_and(|t| !t.is_zero()) && !self.entries.lock().is_empty() {
            Ok(())
        } else {
            epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(events),
                ts.as_ref(),
            )
            .map(|_| ())
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        match waited {
            Ok(()) => {}
            Err(rustix::io::Errno::INTR) => return Ok(()),
            Err(e) => return Err(FabricError::Io(e.into())),
        }
        for event in events.iter() {
            let token = event.data.u64();
            if token == WAKE_TOKEN {
                let mut buf = [0u8; 8];
                let _ = rustix::io::read(&self.wake, &mut buf);
                continue;
            }
            let qp = self.qps.read().get(&(token as u32)).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                qp.progress();
            }
        }
        Ok(())
    }
}

impl CompletionQueue for SoftCq {
    fn interrupter(&self) -> crate::Interrupter {
        let inner = self.inner.clone();
        // Always written: a waiter about to sleep must find it. The next progress
        // pass drains it.
        crate::Interrupter::new(move || {
            inner.interrupted.store(true, Ordering::SeqCst);
            let _ = rustix::io::write(&inner.wake, &1u64.to_ne_bytes());
        })
    }

    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        if self.inner.entries.lock().is_empty() {
            let _ = self.inner.progress(Some(Duration::ZERO));
        }
        let mut entries = self.inner.entries.lock();
        let n = entries.len().min(max);
        out.extend(entries.drain(..n));
        n
    }

    fn wait_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        // Readable when a socket of its queue pairs is, or on an interrupt or a
        // completion pushed while someone sleeps.
        Some(self.inner.epoll.as_fd())
    }

    fn prepare_sleep(&self) -> bool {
        // Withdrawn by `finish_sleep`, which the caller calls either way.
        self.inner.sleepers.fetch_add(1, Ordering::SeqCst);
        self.inner.entries.lock().is_empty()
    }

    fn hold_sends(&self, on: bool) {
        self.inner.holding.store(on, Ordering::Relaxed);
        if !on {
            self.flush_sends();
        }
    }

    fn flush_sends(&self) {
        let held = std::mem::take(&mut *self.inner.held.lock());
        for num in held {
            let qp = self.inner.qps.read().get(&num).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                let mut tx = qp.tx.lock();
                tx.held = false;
                qp.flush(&mut tx);
            }
        }
    }

    fn end_sleep(&self) {
        self.inner.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    fn finish_sleep(&self) {
        self.inner.sleepers.fetch_sub(1, Ordering::SeqCst);
        // Reads what the sockets have and drains the wake-up, so the epoll descriptor
        // is quiet until something new arrives.
        let _ = self.inner.progress(Some(Duration::ZERO));
    }

    fn wait(&self, timeout: Duration) -> Result<bool, FabricError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let spin = self.inner.spin.min(timeout);
        loop {
            if !self.inner.entries.lock().is_empty() {
                return Ok(true);
            }
            if self.inner.interrupted.swap(false, Ordering::SeqCst) {
                return Ok(false);
            }
            let now = Instant::now();
            let Some(left) = deadline.checked_duration_since(now) else {
                return Ok(false);
            };
            // Poll the sockets for a short while before sleeping: the next frame of a
            // conversation usually comes within microseconds, and a sleep costs a
            // wake-up (tens of microseconds on a loaded VM).
            if now - started < spin {
                self.inner.progress(Some(Duration::ZERO))?;
                std::hint::spin_loop();
            } else {
                self.inner.progress(Some(left))?;
            }
        }
    }
}

//! The shard's loop: drain everything that arrived, flush one batch of sends and
//! wake-ups, poll for a while, then sleep on one wait set; and its recovery after a panic.

use super::*;

/// Housekeeping period with exchanges in flight.
const BUSY_TICK: Duration = Duration::from_millis(20);
/// Housekeeping period of an idle shard.
const IDLE_TICK: Duration = Duration::from_millis(250);

impl<F: Fabric> Reactor<F> {
    /// After a panic in [`Reactor::run`]: the exchanges' state cannot be trusted, so
    /// every link goes (the ingress and peer nodes fail what they sent over them at
    /// once, and reconnect on their next request), and every exchange still open is
    /// answered with a 503. Descriptors owed to the DMA manager are kept.
    pub(super) fn recover(&mut self) {
        let qps: Vec<u32> = self.links.by_qp.keys().copied().collect();
        for qp in qps {
            self.link_down(
                qp,
                "the data plane thread restarted after a panic".to_owned(),
            );
        }
        for xid in self.table.open_exchanges() {
            let e = ProxyError::new(
                ErrorKind::ThreadLost,
                "the data plane thread restarted after a panic",
            );
            self.fail(xid, e);
        }
        self.table.clear_waits();
        self.pods.regions.clear();
        self.meter.report_in_flight(self.table.len());
    }

    /// How often the loop does its housekeeping (pods that left, occupancy, the
    /// generation to follow): often while requests are in flight (a try at a pod that
    /// left is ended within it), rarely when idle, so an idle node sleeps.
    fn tick_period(&self) -> Duration {
        if self.table.len() == 0 {
            IDLE_TICK
        } else {
            BUSY_TICK
        }
    }

    pub(super) fn run(&mut self) {
        let mut last_tick = Instant::now() - Duration::from_secs(1);
        // Since when the loop has found nothing to do (it polls until the spin's
        // budget is spent, then sleeps).
        let mut idle_since: Option<Instant> = None;
        // What a pass posts on its links leaves together at the pass's end (one write
        // per link on the TCP fabric instead of one per frame).
        self.links.cq.hold_sends(true);
        while !self.stop.load(Ordering::Relaxed) {
            let mut work = 0;
            work += self.drain_sidecar();
            work += self.drain_completions();
            work += self.drain_inbox();
            work += self.flush_deferred();
            self.expire();
            if !self.links.accepted.is_empty() {
                self.links.accept();
            }
            // proxy-wasm ticks run here, between requests: looked for at housekeeping
            // (a plugin that asked for a period is found then), then run when due (the
            // wait below is bounded by the next one). Nothing per pass otherwise.
            let housekeeping = last_tick.elapsed() >= self.tick_period();
            if housekeeping {
                last_tick = Instant::now();
                self.forget_departed_pods();
                self.publish_occupancy();
                self.filters.follow_generation();
            }
            let queue_news = self.filters.queue_ready.swap(false, Ordering::AcqRel);
            if housekeeping
                || queue_news
                || self
                    .filters
                    .plugin_tick
                    .is_some_and(|due| Instant::now() >= due)
            {
                self.filters.plugin_tick = self.filters.chains.tick(Instant::now());
                self.root_calls();
            }
            // One wake-up per pod, one send per link, for everything this pass did.
            self.pods.port.wake_pods();
            self.links.cq.flush_sends();
            self.meter.report_in_flight(self.table.len());
            if work > 0 {
                if idle_since.take().is_some() {
                    self.spin.record(Waited::WhilePolling);
                }
                continue;
            }
            let now = Instant::now();
            let since = *idle_since.get_or_insert(now);
            match self.spin.budget() {
                None => {
                    std::hint::spin_loop();
                    continue;
                }
                Some(budget) if now - since < budget => {
                    std::hint::spin_loop();
                    continue;
                }
                Some(_) => {}
            }
            let (slept, woken) = self.sleep();
            idle_since = None;
            self.spin.record(if woken {
                Waited::Slept(slept)
            } else {
                Waited::Nothing
            });
        }
        self.links.cq.hold_sends(false);
    }

    /// Sleeps on the wait set until something arrives (the shard's bell: a pod sent, a
    /// chain finished on the pool, a link was accepted; the completion queue) or the
    /// next timer is due.
    /// Returns how long it slept and whether something woke it (rather than the
    /// timeout).
    pub(super) fn sleep(&mut self) -> (Duration, bool) {
        let mut timeout = self
            .table
            .next_timer()
            .map(|t| t.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::MAX)
            .min(self.tick_period());
        if let Some(due) = self.filters.plugin_tick {
            timeout = timeout.min(due.saturating_duration_since(Instant::now()));
        }
        if self.pods.port.holding() || !self.pods.deferred.is_empty() {
            // Pods do not say when they make room in their rings: look again soon.
            timeout = timeout.min(Duration::from_micros(200));
        }
        let started = Instant::now();
        let mut woken = true;
        self.bell.sleep_begins();
        let sleep = self.links.cq.prepare_sleep();
        if sleep
            && !self.pods.port.has_work()
            && self.filters.inbox.is_empty()
            && self.links.accepted.is_empty()
        {
            woken = self.waits.wait(timeout).is_ok_and(|n| n > 0);
        }
        self.links.cq.finish_sleep();
        self.bell.sleep_ends();
        self.bell.drain();
        (started.elapsed(), woken)
    }
}

impl Meter {
    /// Adds this shard's change in open exchanges (now `open`) to the node's count
    /// (shards share it: each adds its own difference, none overwrites another's).
    fn report_in_flight(&mut self, open: usize) {
        let now = open as u64;
        if now != self.in_flight_reported {
            // A wrapping difference: adding it subtracts when the count fell.
            self.stats
                .in_flight
                .fetch_add(now.wrapping_sub(self.in_flight_reported), Ordering::Relaxed);
            self.in_flight_reported = now;
        }
    }
}

impl Filters {
    /// Builds the instances of a newly published generation between requests, so the
    /// next request does not wait for them.
    fn follow_generation(&mut self) {
        let published = self.policy.snapshot().generation.clone();
        if published.number() != self.chains.generation() {
            self.chains.switch(&published);
        }
        self.generation
            .store(self.chains.generation(), Ordering::Release);
    }
}

//! The agent's probing thread: one UD queue pair, prober and responder on it, its
//! buffers in one registered region. Everything it does is driven by the queue
//! pair's completions and the prober's schedule; it sleeps in the queue pair's wait
//! until the next probe is due.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use dpumesh_dpa::fabric::ud::{
    AddressVector, DatagramFabric, GRH_LEN, UdCompletion, UdQueuePair, UdSendWr, now_ns,
};
use dpumesh_dpa::fabric::{Access, MemoryRegion, RecvWr, WcOpcode, WcStatus};
use dpumesh_dpa::shm::SharedRegion;

use super::Shared;
use super::prober::{Outgoing, Prober, Reply, Responder};
use crate::probe::{Kind, Message, PROBE_LEN};

/// Receive buffers posted (each a GRH and one probe message, rounded up).
pub(super) const RECV_SLOTS: usize = 256;
const RECV_SLOT: usize = 128;
/// Messages in flight on the send queue.
pub(super) const SEND_SLOTS: usize = 256;
const SEND_SLOT: usize = 64;
/// Region: receive slots, then send slots.
pub(super) const REGION_LEN: usize = RECV_SLOTS * RECV_SLOT + SEND_SLOTS * SEND_SLOT;
/// The probing thread's period: a busy agent wakes once per period, reads everything
/// that arrived, answers, and sends the probes due within the next period, so it costs
/// one wake-up per period instead of one per datagram (measured: 3.4 % of a core for
/// 500 probes/s when it woke per datagram). Arrival times come from the kernel's
/// timestamps, so the network RTT does not grow with it; the host delays (T6 − T5 on
/// the prober, T4 − T3 on the responder) do, by up to a period, and are reported as
/// what they are. A quiet agent — a sparse schedule (less than a probe per period),
/// datagrams a period or more apart (or none in the last pass), no work overdue —
/// sleeps on the queue pair instead, until a datagram arrives or its next probe or
/// timeout is due: an agent with a few targets wakes about as often as
/// datagrams come and go, not a hundred times a second (an idle two-node mesh: 0.47 →
/// 0.22–0.24 % of a core for this thread). On loopback the kernel charges waking a
/// receiver to the sender's `sendto`, so there a prober pays for its quiet
/// responders' wake-ups (docs/pingmesh.md).
const PERIOD: Duration = Duration::from_millis(10);
/// Longest quiet sleep: how long a stop may wait to be seen.
const MAX_QUIET: Duration = Duration::from_millis(250);
/// Address handles kept (targets × tuples, and the probers answered).
const MAX_AHS: usize = 8192;

#[derive(Debug, Clone, Copy)]
enum SendUse {
    Probe(u64),
    /// An ACK1 whose completion gives T4 for the ACK2 that follows.
    Ack1(u64),
    /// The last ACK of a probe (ACK2, or an ACK1 that carries the delay).
    LastAck,
}

pub(super) struct Io<F: DatagramFabric> {
    pub fabric: F,
    pub pd: F::Pd,
    pub qp: F::UdQp,
    pub mr: F::Mr,
    pub _region: Arc<SharedRegion>,
    pub region_view: Arc<SharedRegion>,
    pub shared: Arc<Shared>,
    pub prober: Prober,
    pub responder: Responder,
    ahs: HashMap<AddressVector, F::Ah>,
    sends: Vec<Option<SendUse>>,
    free_sends: Vec<usize>,
    /// ACK1 carries the responder's delay (sends are stamped when posted).
    one_ack: bool,
}

/// Sets up the queue pair's buffers: every receive slot posted.
pub(super) fn setup<F: DatagramFabric>(
    fabric: F,
    pd: F::Pd,
    qp: F::UdQp,
    region: Arc<SharedRegion>,
    shared: Arc<Shared>,
    prober: Prober,
    one_ack: bool,
) -> Result<Io<F>, dpumesh_dpa::fabric::FabricError> {
    let mr = fabric.register(&pd, &region, 0, REGION_LEN as u64, Access::LOCAL_WRITE)?;
    for slot in 0..RECV_SLOTS {
        qp.post_recv(RecvWr {
            wr_id: slot as u64,
            sge: mr.sge((slot * RECV_SLOT) as u64, RECV_SLOT as u32),
        })?;
    }
    Ok(Io {
        fabric,
        pd,
        qp,
        mr,
        region_view: region.clone(),
        _region: region,
        shared,
        prober,
        responder: Responder::default(),
        ahs: HashMap::new(),
        sends: vec![None; SEND_SLOTS],
        free_sends: (0..SEND_SLOTS).rev().collect(),
        one_ack,
    })
}

impl<F: DatagramFabric> Io<F> {
    fn post(&mut self, to: AddressVector, qpn: u32, qkey: u32, m: &Message, used: SendUse) -> bool {
        let Some(slot) = self.free_sends.pop() else {
            return false;
        };
        if !self.ensure_ah(to) {
            self.free_sends.push(slot);
            return false;
        }
        let offset = (RECV_SLOTS * RECV_SLOT + slot * SEND_SLOT) as u64;
        if self.region_view.write(offset, &m.encode()).is_err() {
            self.free_sends.push(slot);
            return false;
        }
        let wr = UdSendWr {
            wr_id: slot as u64,
            sge: self.mr.sge(offset, PROBE_LEN as u32),
            ah: &self.ahs[&to],
            remote_qpn: qpn,
            remote_qkey: qkey,
            imm: None,
            // Always: the completion's time is T2 (probes) or T4 (ACK1s).
            signaled: true,
        };
        match self.qp.post_send(wr) {
            Ok(()) => {
                self.sends[slot] = Some(used);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "UD post_send failed");
                self.free_sends.push(slot);
                false
            }
        }
    }

    /// Makes sure an address handle for `to` exists; false if none can be made.
    fn ensure_ah(&mut self, to: AddressVector) -> bool {
        if self.ahs.contains_key(&to) {
            return true;
        }
        if self.ahs.len() >= MAX_AHS {
            self.ahs.clear();
        }
        match self.fabric.create_ah(&self.pd, to) {
            Ok(ah) => {
                self.ahs.insert(to, ah);
                true
            }
            Err(e) => {
                tracing::warn!(to = %to.socket_addr(), error = %e, "no address handle");
                false
            }
        }
    }

    fn reply(&mut self, r: Reply, used: SendUse) {
        self.post(r.to, r.qpn, r.qkey, &r.message, used);
    }

    fn on_completion(&mut self, wc: &UdCompletion, t6: u64) {
        match wc.opcode {
            WcOpcode::Recv => self.on_receive(wc, t6),
            _ => self.on_send(wc),
        }
    }

    fn on_send(&mut self, wc: &UdCompletion) {
        let slot = wc.wr_id as usize;
        let Some(used) = self.sends.get_mut(slot).and_then(Option::take) else {
            return;
        };
        self.free_sends.push(slot);
        let ok = wc.status == WcStatus::Success;
        match used {
            SendUse::Probe(seq) => self.prober.sent(seq, ok, wc.timestamp_ns, wc.udp_src_port),
            SendUse::Ack1(id) => {
                if let Some(ack2) = self.responder.ack1_sent(id, ok, wc.timestamp_ns) {
                    self.reply(ack2, SendUse::LastAck);
                }
            }
            SendUse::LastAck => {}
        }
    }

    fn on_receive(&mut self, wc: &UdCompletion, t6: u64) {
        let slot = wc.wr_id as usize;
        let offset = (slot * RECV_SLOT) as u64;
        let message = if wc.status == WcStatus::Success {
            let len = (wc.byte_len as usize)
                .saturating_sub(GRH_LEN)
                .min(RECV_SLOT - GRH_LEN);
            // Only a message of a probe's length can be one: read just that (no
            // zeroed slot per receive); any other length is refused as decode would.
            let mut buf = [0u8; PROBE_LEN];
            if len != PROBE_LEN {
                Some(Err(crate::probe::ProbeError::Length(len)))
            } else if self
                .region_view
                .read(offset + GRH_LEN as u64, &mut buf)
                .is_ok()
            {
                Some(Message::decode(&buf))
            } else {
                None
            }
        } else {
            None
        };
        // The slot goes back before anything else: receives must stay posted.
        if let Err(e) = self.qp.post_recv(RecvWr {
            wr_id: slot as u64,
            sge: self.mr.sge(offset, RECV_SLOT as u32),
        }) {
            tracing::error!(error = %e, "cannot repost a UD receive");
        }
        match message {
            Some(Ok(m)) => match m.kind {
                Kind::Probe => {
                    let Some(from) = wc.src else { return };
                    let my_qpn = self.qp.qp_num();
                    let qkey = self.qp.qkey();
                    // T4 as ACK1 is posted, where the fabric stamps sends so (its
                    // own stamp, inside the posting call, is the same clock a few
                    // hundred ns later): then one ACK carries the delay.
                    // The address handle first, so T4 is read just before posting.
                    let t4 = (self.one_ack && self.ensure_ah(from)).then(now_ns);
                    if let Some(ack1) =
                        self.responder
                            .probe(&m, from, wc.src_qp, qkey, my_qpn, wc.timestamp_ns, t4)
                    {
                        let used = if ack1.message.delay_in_ack1 {
                            SendUse::LastAck
                        } else {
                            SendUse::Ack1(ack1.id)
                        };
                        self.reply(ack1, used);
                    }
                }
                Kind::Ack1 | Kind::Ack2 => self.prober.ack(&m, wc.timestamp_ns, t6),
            },
            Some(Err(e)) => {
                self.shared.stats.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "not a probe message");
            }
            None => {}
        }
    }

    fn send_due(&mut self, now: u64) {
        let mut out: Vec<Outgoing> = Vec::new();
        let room = self.free_sends.len().saturating_sub(SEND_SLOTS / 4);
        self.prober.due(
            now,
            PERIOD.as_nanos() as u64,
            self.shared.wall_ms(),
            room,
            &mut out,
        );
        for o in out {
            let seq = o.seq;
            if !self.post(o.to, o.qpn, o.qkey, &o.message, SendUse::Probe(seq)) {
                self.prober.sent(seq, false, now, 0);
            }
        }
    }

    /// How long to sleep on the queue pair when the agent is quiet (see [`PERIOD`]):
    /// `None` when it is busy and sleeps a period. `handled` completions came in the
    /// last pass, `gap` after the pass before it.
    fn quiet(&self, handled: usize, gap: Duration) -> Option<Duration> {
        let sparse_arrivals = handled == 0 || gap >= PERIOD;
        if !sparse_arrivals || self.prober.dense(PERIOD.as_nanos() as u64) {
            return None;
        }
        let now = now_ns();
        let quiet = self.prober.next_deadline().map_or(MAX_QUIET, |at| {
            Duration::from_nanos(at.saturating_sub(now)).min(MAX_QUIET)
        });
        // Overdue work (a full send queue holds probes back) sleeps a period: no spin.
        (!quiet.is_zero()).then_some(quiet)
    }

    /// Runs until the agent stops.
    pub fn run(&mut self) {
        let mut completions = Vec::with_capacity(64);
        let mut handled = 0usize;
        // When the last pass began, and how long after the one before.
        let mut pass = std::time::Instant::now();
        let mut gap = MAX_QUIET;
        while !self.shared.stop.is_set() {
            if let Some((targets, interval, timeout)) = self.shared.targets.lock().take() {
                self.prober
                    .set_targets(targets, interval, timeout, now_ns());
            }
            let now = now_ns();
            self.send_due(now);
            self.prober.expire(now);
            let results = self.prober.take_results();
            if !results.is_empty() {
                self.shared
                    .stats
                    .probes
                    .fetch_add(results.len() as u64, Ordering::Relaxed);
                self.shared.push_results(results);
            }
            match self.quiet(handled, gap) {
                Some(quiet) => {
                    let _ = self.qp.wait(quiet);
                }
                None => std::thread::sleep(PERIOD),
            }
            let started = std::time::Instant::now();
            gap = started - pass;
            pass = started;
            // Until nothing is left: answering a probe completes a send, which
            // sends the second ACK in the same pass.
            handled = 0;
            loop {
                completions.clear();
                let n = self.qp.poll(&mut completions, 64);
                let t6 = now_ns();
                for wc in &completions {
                    self.on_completion(wc, t6);
                }
                handled += n;
                if n == 0 {
                    break;
                }
            }
            self.shared
                .stats
                .wrong_qpn
                .store(self.responder.wrong_qpn, Ordering::Relaxed);
        }
    }
}

//! The prober and the responder as state machines: they are told what completed
//! and when, and say what to send; the agent's loop does the I/O.

use std::collections::HashMap;

use dpumesh_dpa::fabric::ud::{AddressVector, Gid};

use crate::pinglist::{ListKind, Target};
use crate::probe::{Kind, Message, Timestamps};
use crate::proto;

/// What to probe, with the services a service-tracing target carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTarget {
    pub target: Target,
    /// Non-empty: a service-tracing probe along one of the mesh's connections.
    pub services: Vec<String>,
}

/// A probe to post now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub seq: u64,
    pub to: AddressVector,
    pub qpn: u32,
    pub qkey: u32,
    pub message: Message,
}

#[derive(Debug)]
struct Pending {
    /// The target as it was when sent (the list may change meanwhile).
    rnic_gid: Gid,
    agent: String,
    qpn: u32,
    udp_port: u16,
    flow_label: u32,
    kind: ListKind,
    services: Vec<String>,
    sent_at_ms: u64,
    t1: u64,
    t2: Option<u64>,
    src_port: u16,
    /// T5 and T6.
    ack1: Option<(u64, u64)>,
    responder_delay: Option<u64>,
    send_failed: bool,
}

/// The prober: a schedule over its targets and the probes in flight.
#[derive(Debug)]
pub struct Prober {
    local: Gid,
    local_qpn: u32,
    session: u64,
    next_seq: u64,
    targets: Vec<ProbeTarget>,
    /// Next time each target is due (ns, the completions' clock).
    due: Vec<u64>,
    interval_ns: u64,
    timeout_ns: u64,
    pending: HashMap<u64, Pending>,
    done: Vec<proto::ProbeResult>,
}

impl Prober {
    pub fn new(local: Gid, local_qpn: u32, session: u64) -> Self {
        Self {
            local,
            local_qpn,
            session,
            next_seq: 1,
            targets: Vec::new(),
            due: Vec::new(),
            interval_ns: 100_000_000,
            timeout_ns: 500_000_000,
            pending: HashMap::new(),
            done: Vec::new(),
        }
    }

    /// Replaces the targets; their first probes are spread over one interval so
    /// they do not leave in a burst.
    pub fn set_targets(
        &mut self,
        targets: Vec<ProbeTarget>,
        interval_ns: u64,
        timeout_ns: u64,
        now: u64,
    ) {
        self.interval_ns = interval_ns.max(1_000_000);
        self.timeout_ns = timeout_ns.max(1_000_000);
        let n = targets.len().max(1) as u64;
        self.due = (0..targets.len() as u64)
            .map(|i| now + self.interval_ns * i / n)
            .collect();
        self.targets = targets;
    }

    pub fn targets(&self) -> &[ProbeTarget] {
        &self.targets
    }

    /// The probes due by `now + horizon` (sent now: T1 = `now`), at most `max`.
    pub fn due(
        &mut self,
        now: u64,
        horizon: u64,
        wall_ms: u64,
        max: usize,
        out: &mut Vec<Outgoing>,
    ) {
        for i in 0..self.targets.len() {
            if out.len() >= max {
                break;
            }
            if self.due[i] > now.saturating_add(horizon) {
                continue;
            }
            // Keep the cadence; after a stall, do not send the missed ones in a burst.
            self.due[i] = (self.due[i] + self.interval_ns).max(now + self.interval_ns / 2);
            let seq = self.next_seq;
            self.next_seq += 1;
            let t = &self.targets[i];
            let r = &t.target.rnic;
            self.pending.insert(
                seq,
                Pending {
                    rnic_gid: r.gid,
                    agent: r.agent_id.clone(),
                    qpn: r.qpn,
                    udp_port: r.udp_port,
                    flow_label: t.target.flow_label,
                    kind: t.target.kind,
                    services: t.services.clone(),
                    sent_at_ms: wall_ms,
                    t1: now,
                    t2: None,
                    src_port: 0,
                    ack1: None,
                    responder_delay: None,
                    send_failed: false,
                },
            );
            out.push(Outgoing {
                seq,
                to: AddressVector {
                    gid: r.gid,
                    flow_label: t.target.flow_label,
                    hop_limit: 64,
                    udp_port: r.udp_port,
                },
                qpn: r.qpn,
                qkey: r.qkey,
                message: Message {
                    kind: Kind::Probe,
                    session: self.session,
                    seq,
                    responder_delay_ns: 0,
                    // This prober finishes a probe on an ACK1 with the delay.
                    delay_in_ack1: true,
                    target_qpn: r.qpn,
                },
            });
        }
    }

    /// The probe's send completed at `t2` from UDP port `src_port` (or failed).
    pub fn sent(&mut self, seq: u64, ok: bool, t2: u64, src_port: u16) {
        if let Some(p) = self.pending.get_mut(&seq) {
            if ok {
                p.t2 = Some(t2);
                p.src_port = src_port;
            } else {
                p.send_failed = true;
            }
        }
        self.finish_if_complete(seq);
    }

    /// An ACK arrived: ACK1's receive completed at `t5` and was polled at `t6`.
    pub fn ack(&mut self, m: &Message, t5: u64, t6: u64) {
        if m.session != self.session {
            return;
        }
        if let Some(p) = self.pending.get_mut(&m.seq) {
            match m.kind {
                Kind::Ack1 => {
                    p.ack1 = Some((t5, t6));
                    if m.delay_in_ack1 {
                        p.responder_delay = Some(m.responder_delay_ns);
                    }
                }
                Kind::Ack2 => p.responder_delay = Some(m.responder_delay_ns),
                Kind::Probe => {}
            }
        }
        self.finish_if_complete(m.seq);
    }

    fn finish_if_complete(&mut self, seq: u64) {
        let complete = self.pending.get(&seq).is_some_and(|p| {
            p.send_failed || (p.t2.is_some() && p.ack1.is_some() && p.responder_delay.is_some())
        });
        if complete {
            let p = self.pending.remove(&seq).expect("checked above");
            let r = self.result(p);
            self.done.push(r);
        }
    }

    /// Probes past their timeout at `now` end: answered by ACK1 alone is still an
    /// answer (the responder's delay unknown), nothing at all is a timeout.
    pub fn expire(&mut self, now: u64) {
        let timeout = self.timeout_ns;
        let old: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| now.saturating_sub(p.t1) >= timeout)
            .map(|(s, _)| *s)
            .collect();
        for seq in old {
            let p = self.pending.remove(&seq).expect("listed above");
            let r = self.result(p);
            self.done.push(r);
        }
    }

    /// When the prober next has something to do on its own — a probe due, a probe in
    /// flight timing out — in the completions' clock; `None` with nothing scheduled.
    /// The probing thread sleeps until then when nothing arrives.
    pub fn next_deadline(&self) -> Option<u64> {
        let due = self.due.iter().copied().min();
        let expiry = self
            .pending
            .values()
            .map(|p| p.t1.saturating_add(self.timeout_ns))
            .min();
        due.into_iter().chain(expiry).min()
    }

    /// Whether the schedule sends at least one probe per `period` on average: the
    /// probing thread then wakes once per period rather than per datagram.
    pub fn dense(&self, period_ns: u64) -> bool {
        (self.targets.len() as u64).saturating_mul(period_ns) >= self.interval_ns
    }

    /// Results finished since the last call.
    pub fn take_results(&mut self) -> Vec<proto::ProbeResult> {
        std::mem::take(&mut self.done)
    }

    /// Probes in flight.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    fn result(&self, p: Pending) -> proto::ProbeResult {
        let kind = if !p.services.is_empty() {
            proto::ProbeKind::Service
        } else {
            match p.kind {
                ListKind::TorMesh => proto::ProbeKind::TorMesh,
                ListKind::InterTor => proto::ProbeKind::InterTor,
            }
        };
        let mut r = proto::ProbeResult {
            tuple: Some(proto::FiveTuple {
                src_gid: self.local.to_string(),
                dst_gid: p.rnic_gid.to_string(),
                src_qpn: self.local_qpn,
                dst_qpn: p.qpn,
                src_port: u32::from(p.src_port),
                dst_port: u32::from(p.udp_port),
                flow_label: p.flow_label,
            }),
            kind: kind as i32,
            target_agent: p.agent,
            sent_at_ms: p.sent_at_ms as i64,
            t1: p.t1,
            t2: p.t2.unwrap_or(0),
            services: p.services,
            ..Default::default()
        };
        if p.send_failed {
            r.status = proto::ProbeStatus::SendFailed as i32;
            return r;
        }
        let (Some(t2), Some((t5, t6))) = (p.t2, p.ack1) else {
            r.status = proto::ProbeStatus::Timeout as i32;
            return r;
        };
        let responder = p.responder_delay.unwrap_or(0);
        let ts = Timestamps {
            t1: p.t1,
            t2,
            t3: 0,
            t4: responder,
            t5,
            t6,
        };
        r.t5 = t5;
        r.t6 = t6;
        r.t4 = responder;
        match ts.delays() {
            Some(d) => {
                r.status = proto::ProbeStatus::Ok as i32;
                r.network_rtt_ns = d.network_rtt_ns;
                r.prober_delay_ns = d.prober_delay_ns;
                r.responder_delay_ns = d.responder_delay_ns;
            }
            None => r.status = proto::ProbeStatus::Timeout as i32,
        }
        r
    }
}

/// The responder: answers probes with ACK1 at once and ACK2 once ACK1's send
/// completion gives T4 — or, where sends are stamped when posted, with one ACK1 that
/// carries T4 − T3.
#[derive(Debug, Default)]
pub struct Responder {
    /// ACK1s in flight: T3 and where ACK2 goes.
    ack1: HashMap<u64, Ack1Sent>,
    next_id: u64,
    /// Probes for a queue pair number that is not ours any more.
    pub wrong_qpn: u64,
}

#[derive(Debug, Clone)]
struct Ack1Sent {
    t3: u64,
    to: AddressVector,
    qpn: u32,
    qkey: u32,
    session: u64,
    seq: u64,
}

/// A reply to post: `id` comes back with its send completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub id: u64,
    pub to: AddressVector,
    pub qpn: u32,
    pub qkey: u32,
    pub message: Message,
}

impl Responder {
    /// A probe's receive completed at `t3` from `from` (queue pair `src_qp`). The
    /// ACK1 to post; `None` if the probe was for another queue pair of ours (a
    /// restarted agent: the prober learns it from the silence and the registry).
    /// `t4`: ACK1's send time when the fabric stamps sends as they are posted (then,
    /// for a prober that takes it, ACK1 carries the delay and no ACK2 follows).
    #[allow(clippy::too_many_arguments)]
    pub fn probe(
        &mut self,
        m: &Message,
        from: AddressVector,
        src_qp: u32,
        qkey: u32,
        my_qpn: u32,
        t3: u64,
        t4: Option<u64>,
    ) -> Option<Reply> {
        if m.target_qpn != my_qpn {
            self.wrong_qpn += 1;
            return None;
        }
        self.next_id += 1;
        let id = self.next_id;
        let single = t4.filter(|_| m.delay_in_ack1);
        if single.is_none() {
            self.ack1.insert(
                id,
                Ack1Sent {
                    t3,
                    to: from,
                    qpn: src_qp,
                    qkey,
                    session: m.session,
                    seq: m.seq,
                },
            );
            // Bounded: ACK1s whose completion never comes (a failed send) are
            // dropped oldest first.
            if self.ack1.len() > 4096 {
                let oldest = *self.ack1.keys().min().expect("not empty");
                self.ack1.remove(&oldest);
            }
        }
        Some(Reply {
            id,
            to: from,
            qpn: src_qp,
            qkey,
            message: Message {
                kind: Kind::Ack1,
                session: m.session,
                seq: m.seq,
                responder_delay_ns: single.map_or(0, |t4| t4.saturating_sub(t3)),
                delay_in_ack1: single.is_some(),
                target_qpn: src_qp,
            },
        })
    }

    /// ACK1 `id`'s send completed at `t4`: the ACK2 to post.
    pub fn ack1_sent(&mut self, id: u64, ok: bool, t4: u64) -> Option<Reply> {
        let a = self.ack1.remove(&id)?;
        if !ok {
            return None;
        }
        self.next_id += 1;
        Some(Reply {
            id: self.next_id,
            to: a.to,
            qpn: a.qpn,
            qkey: a.qkey,
            message: Message {
                kind: Kind::Ack2,
                session: a.session,
                seq: a.seq,
                responder_delay_ns: t4.saturating_sub(a.t3),
                delay_in_ack1: false,
                target_qpn: a.qpn,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::contract::rnic;

    fn prober_with(n: usize) -> Prober {
        let mut p = Prober::new(Gid::from_ip("10.0.0.1".parse().unwrap()), 5, 77);
        let targets = (0..n)
            .map(|i| ProbeTarget {
                target: Target {
                    rnic: rnic(2 + i as u8, "a", 0),
                    flow_label: 9,
                    kind: ListKind::TorMesh,
                },
                services: vec![],
            })
            .collect();
        p.set_targets(targets, 100_000_000, 500_000_000, 0);
        p
    }

    fn ack(kind: Kind, seq: u64, delay: u64) -> Message {
        Message {
            kind,
            session: 77,
            seq,
            responder_delay_ns: delay,
            delay_in_ack1: false,
            target_qpn: 5,
        }
    }

    #[test]
    fn an_answered_probe_yields_the_three_delays() {
        let mut p = prober_with(1);
        let mut out = Vec::new();
        p.due(1_000, 0, 0, 16, &mut out);
        assert_eq!(out.len(), 1);
        let seq = out[0].seq;
        assert_eq!(out[0].message.target_qpn, 102);
        p.sent(seq, true, 1_200, 40_000);
        p.ack(&ack(Kind::Ack1, seq, 0), 3_200, 3_500);
        assert!(p.take_results().is_empty(), "waits for ACK2");
        p.ack(&ack(Kind::Ack2, seq, 300), 3_300, 3_600);
        let r = p.take_results().pop().unwrap();
        assert_eq!(r.status, proto::ProbeStatus::Ok as i32);
        assert_eq!(
            (r.network_rtt_ns, r.prober_delay_ns, r.responder_delay_ns),
            (1_700, 500, 300)
        );
        assert_eq!(r.tuple.unwrap().src_port, 40_000);
    }

    #[test]
    fn silence_is_a_timeout_and_ack1_alone_is_an_answer() {
        let mut p = prober_with(2);
        let mut out = Vec::new();
        p.due(1_000_000_000, 0, 0, 16, &mut out);
        let (a, b) = (out[0].seq, out[1].seq);
        p.sent(a, true, 1_000_000_100, 1);
        p.sent(b, true, 1_000_000_100, 1);
        p.ack(&ack(Kind::Ack1, b, 0), 1_000_002_000, 1_000_002_100);
        p.expire(1_400_000_000);
        assert!(p.take_results().is_empty(), "not timed out yet");
        p.expire(1_600_000_000);
        let mut results = p.take_results();
        results.sort_by_key(|r| r.status);
        assert_eq!(results[0].status, proto::ProbeStatus::Ok as i32);
        assert_eq!(results[0].responder_delay_ns, 0);
        assert_eq!(results[1].status, proto::ProbeStatus::Timeout as i32);
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn answers_to_another_session_are_ignored() {
        let mut p = prober_with(1);
        let mut out = Vec::new();
        p.due(0, 0, 0, 16, &mut out);
        let mut stale = ack(Kind::Ack1, out[0].seq, 0);
        stale.session = 1;
        p.ack(&stale, 1, 2);
        p.expire(10_000_000_000);
        assert_eq!(
            p.take_results()[0].status,
            proto::ProbeStatus::Timeout as i32
        );
    }

    #[test]
    fn probes_keep_their_cadence_without_bursting_after_a_stall() {
        let mut p = prober_with(1);
        p.set_targets(p.targets().to_vec(), 100_000_000, 500_000_000, 0);
        let mut out = Vec::new();
        p.due(0, 0, 0, 16, &mut out);
        p.due(50_000_000, 0, 0, 16, &mut out);
        assert_eq!(out.len(), 1, "not due before the interval");
        p.due(100_000_000, 0, 0, 16, &mut out);
        assert_eq!(out.len(), 2);
        // A 1 s stall: one probe, not ten.
        p.due(1_100_000_000, 0, 0, 16, &mut out);
        p.due(1_100_000_001, 0, 0, 16, &mut out);
        assert_eq!(out.len(), 3);
        // Due within the horizon: sent in this pass.
        p.due(1_190_000_000, 20_000_000, 0, 16, &mut out);
        assert_eq!(out.len(), 4);
    }

    #[test]
    fn a_failed_send_is_reported_as_such_at_once() {
        let mut p = prober_with(1);
        let mut out = Vec::new();
        p.due(0, 0, 0, 16, &mut out);
        p.sent(out[0].seq, false, 1, 0);
        assert_eq!(
            p.take_results()[0].status,
            proto::ProbeStatus::SendFailed as i32
        );
    }

    #[test]
    fn the_responder_answers_twice_with_its_delay() {
        let mut r = Responder::default();
        let from = AddressVector::to("10.0.0.1:4791".parse().unwrap());
        let probe = Message {
            kind: Kind::Probe,
            session: 3,
            seq: 4,
            responder_delay_ns: 0,
            delay_in_ack1: false,
            target_qpn: 9,
        };
        let a1 = r.probe(&probe, from, 5, 1, 9, 1_000, None).unwrap();
        assert_eq!((a1.message.kind, a1.qpn, a1.to), (Kind::Ack1, 5, from));
        let a2 = r.ack1_sent(a1.id, true, 1_250).unwrap();
        assert_eq!(a2.message.kind, Kind::Ack2);
        assert_eq!(a2.message.responder_delay_ns, 250);
        assert_eq!((a2.message.session, a2.message.seq), (3, 4));
        assert!(r.ack1_sent(a1.id, true, 2_000).is_none(), "once");
        // A probe for the queue pair we had before a restart is not answered.
        assert!(r.probe(&probe, from, 5, 1, 10, 0, None).is_none());
        assert_eq!(r.wrong_qpn, 1);
    }

    #[test]
    fn where_sends_are_stamped_when_posted_one_ack_carries_the_delay() {
        let mut r = Responder::default();
        let from = AddressVector::to("10.0.0.1:4791".parse().unwrap());
        let mut probe = ack(Kind::Probe, 4, 0);
        // A prober of before does not say it takes one ACK: it gets both.
        let old = r.probe(&probe, from, 5, 1, 5, 1_000, Some(1_180)).unwrap();
        assert!(!old.message.delay_in_ack1);
        let ack2 = r.ack1_sent(old.id, true, 1_200).expect("an ACK2 for it");
        assert_eq!(ack2.message.responder_delay_ns, 200);
        probe.delay_in_ack1 = true;
        let a1 = r.probe(&probe, from, 5, 1, 5, 1_000, Some(1_180)).unwrap();
        assert_eq!(a1.message.kind, Kind::Ack1);
        assert!(a1.message.delay_in_ack1);
        assert_eq!(a1.message.responder_delay_ns, 180);
        assert!(r.ack1_sent(a1.id, true, 1_200).is_none(), "no ACK2");
        // The prober finishes the probe on that one ACK.
        let mut p = prober_with(1);
        let mut out = Vec::new();
        p.due(1_000, 0, 0, 16, &mut out);
        let seq = out[0].seq;
        p.sent(seq, true, 1_200, 40_000);
        let mut single = ack(Kind::Ack1, seq, 180);
        single.delay_in_ack1 = true;
        p.ack(&single, 3_200, 3_500);
        let done = p.take_results().pop().expect("finished on ACK1");
        // (3200 − 1200) − 180 = 1820.
        assert_eq!(done.network_rtt_ns, 1_820);
        assert_eq!(done.responder_delay_ns, 180);
    }
}

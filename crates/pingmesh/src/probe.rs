//! Probes on the wire and the arithmetic of their six timestamps.
//!
//! A probe and its two ACKs are UD messages (the paper's two-ACK scheme): the prober
//! posts a PROBE at T1, its send completes at T2; the responder's receive completes
//! at T3, it answers at once with ACK1, whose send completes at T4, then sends ACK2
//! carrying T4 − T3; ACK1's receive completes at the prober at T5 and is polled at T6.
//! Then
//!
//! - network RTT = (T5 − T2) − (T4 − T3): the wire both ways, no host in it;
//! - prober delay = (T6 − T1) − (T5 − T2): the prober's own posting and polling;
//! - responder delay = T4 − T3.
//!
//! The responder's clock never meets the prober's: each side only subtracts its own.
//!
//! Where the fabric stamps a send when it is posted (the software fabric), the
//! responder knows T4 as it posts ACK1 and puts T4 − T3 into it
//! ([`Message::delay_in_ack1`]): no ACK2, one datagram less per probe — for probers
//! that say they take it (the same flag on the PROBE), so an agent of before still
//! gets both. A NIC stamps the CQE when the message left, so with verbs the second
//! ACK stays.

/// Bytes of every probe message.
pub const PROBE_LEN: usize = 40;
const MAGIC: [u8; 4] = *b"RPMP";
const VERSION: u8 = 1;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The prober's probe.
    Probe,
    /// The responder's immediate answer.
    Ack1,
    /// The responder's second answer, with its delay.
    Ack2,
}

/// A probe message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    pub kind: Kind,
    /// The prober's incarnation: answers to an earlier run of the agent are ignored.
    pub session: u64,
    /// The probe's number in its session.
    pub seq: u64,
    /// ACK2 (or ACK1 with `delay_in_ack1`): T4 − T3 in nanoseconds.
    pub responder_delay_ns: u64,
    /// A PROBE: its prober takes an ACK1 that carries the delay (an agent of before
    /// does not say so and gets both ACKs). An ACK1: it carries the responder's
    /// delay itself, no ACK2 follows.
    pub delay_in_ack1: bool,
    /// The queue pair number the prober meant to reach (a responder that restarted
    /// with another one tells the prober so: a non-network failure).
    pub target_qpn: u32,
}

/// Why bytes are not a probe message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    #[error("probe message of {0} bytes (a probe message is {PROBE_LEN})")]
    Length(usize),
    #[error("not a probe message (magic {0:02x?})")]
    Magic([u8; 4]),
    #[error("probe message version {0} (this agent speaks {VERSION})")]
    Version(u8),
    #[error("unknown probe message kind {0}")]
    Kind(u8),
}

impl Message {
    pub fn encode(&self) -> [u8; PROBE_LEN] {
        let mut b = [0u8; PROBE_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = match self.kind {
            Kind::Probe => 1,
            Kind::Ack1 => 2,
            Kind::Ack2 => 3,
        };
        // Flags (byte 6, zero from an agent of before): a probe says its prober
        // takes one ACK; an ACK1 says it carries the delay. A responder answers with
        // one ACK only a probe that said so.
        b[6] = u8::from(self.kind != Kind::Ack2 && self.delay_in_ack1);
        b[8..16].copy_from_slice(&self.session.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.responder_delay_ns.to_le_bytes());
        b[32..36].copy_from_slice(&self.target_qpn.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, ProbeError> {
        if b.len() != PROBE_LEN {
            return Err(ProbeError::Length(b.len()));
        }
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(ProbeError::Magic(magic));
        }
        if b[4] != VERSION {
            return Err(ProbeError::Version(b[4]));
        }
        let kind = match b[5] {
            1 => Kind::Probe,
            2 => Kind::Ack1,
            3 => Kind::Ack2,
            k => return Err(ProbeError::Kind(k)),
        };
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Ok(Self {
            kind,
            session: u64_at(8),
            seq: u64_at(16),
            responder_delay_ns: u64_at(24),
            delay_in_ack1: kind != Kind::Ack2 && b[6] & 1 != 0,
            target_qpn: u32::from_le_bytes([b[32], b[33], b[34], b[35]]),
        })
    }
}

/// The six timestamps of one answered probe, in nanoseconds (T3 and T4 on the
/// responder's clock, only their difference known to the prober).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timestamps {
    pub t1: u64,
    pub t2: u64,
    pub t3: u64,
    pub t4: u64,
    pub t5: u64,
    pub t6: u64,
}

/// What the timestamps say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delays {
    pub network_rtt_ns: i64,
    pub prober_delay_ns: i64,
    pub responder_delay_ns: i64,
}

impl Timestamps {
    /// The three delays; `None` if the prober's clock ran backwards (T6 before T1).
    ///
    /// Completion times from two sources may cross by a little (a send stamped just
    /// before its system call, an answer stamped by the kernel on arrival): a
    /// difference that comes out negative counts as zero, it does not void the probe.
    pub fn delays(&self) -> Option<Delays> {
        let d = |a: u64, b: u64| i64::try_from(b.saturating_sub(a)).unwrap_or(i64::MAX);
        if self.t6 < self.t1 {
            return None;
        }
        let responder = d(self.t3, self.t4);
        let between_completions = d(self.t2, self.t5);
        let prober_total = d(self.t1, self.t6);
        Some(Delays {
            // The responder's delay is measured on another clock: if it claims more
            // than the whole round trip the network part is at least zero.
            network_rtt_ns: (between_completions - responder).max(0),
            prober_delay_ns: (prober_total - between_completions).max(0),
            responder_delay_ns: responder,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_three_delays_follow_the_paper() {
        let t = Timestamps {
            t1: 1_000,
            t2: 1_200,
            t3: 50_000,
            t4: 50_300,
            t5: 3_200,
            t6: 3_500,
        };
        let d = t.delays().unwrap();
        // (3200 − 1200) − 300 = 1700; (3500 − 1000) − 2000 = 500.
        assert_eq!(d.network_rtt_ns, 1_700);
        assert_eq!(d.prober_delay_ns, 500);
        assert_eq!(d.responder_delay_ns, 300);
    }

    #[test]
    fn a_prober_clock_that_ran_backwards_gives_no_delays() {
        let t = Timestamps {
            t1: 10,
            t2: 12,
            t3: 0,
            t4: 0,
            t5: 20,
            t6: 5,
        };
        assert_eq!(t.delays(), None);
    }

    #[test]
    fn an_answer_stamped_before_its_probes_send_completion_is_zero_network_time() {
        // The kernel stamped the ACK on arrival before the prober's stamp of its
        // own send: an answer all the same.
        let t = Timestamps {
            t1: 0,
            t2: 100,
            t3: 0,
            t4: 10,
            t5: 90,
            t6: 150,
        };
        let d = t.delays().unwrap();
        assert_eq!((d.network_rtt_ns, d.prober_delay_ns), (0, 150));
    }

    #[test]
    fn a_responder_slower_than_the_round_trip_leaves_no_negative_network_time() {
        let t = Timestamps {
            t1: 0,
            t2: 10,
            t3: 0,
            t4: 500,
            t5: 100,
            t6: 110,
        };
        assert_eq!(t.delays().unwrap().network_rtt_ns, 0);
    }

    #[test]
    fn malformed_messages_are_named() {
        let good = Message {
            kind: Kind::Ack2,
            session: 7,
            seq: 9,
            responder_delay_ns: 11,
            delay_in_ack1: false,
            target_qpn: 13,
        }
        .encode();
        assert_eq!(Message::decode(&good[..39]), Err(ProbeError::Length(39)));
        let mut bad = good;
        bad[0] = b'X';
        assert!(matches!(Message::decode(&bad), Err(ProbeError::Magic(_))));
        let mut bad = good;
        bad[4] = 2;
        assert_eq!(Message::decode(&bad), Err(ProbeError::Version(2)));
        let mut bad = good;
        bad[5] = 9;
        assert_eq!(Message::decode(&bad), Err(ProbeError::Kind(9)));
    }

    proptest! {
        #[test]
        fn messages_round_trip(kind in 0u8..3, session: u64, seq: u64, delay: u64, qpn: u32, single: bool) {
            let kind = [Kind::Probe, Kind::Ack1, Kind::Ack2][kind as usize];
            // An ACK2 carries no flag.
            let delay_in_ack1 = single && kind != Kind::Ack2;
            let m = Message { kind, session, seq, responder_delay_ns: delay, delay_in_ack1, target_qpn: qpn };
            prop_assert_eq!(Message::decode(&m.encode()), Ok(m));
        }

        #[test]
        fn any_bytes_decode_or_fail_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Message::decode(&bytes);
        }
    }
}

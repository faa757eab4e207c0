//! A probe result as the analyzer keeps it: checked on the way in, every field a
//! type.

use dpumesh_dpa::fabric::ud::Gid;

use crate::convert::{self, FieldError};
use crate::proto;

/// How a probe ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Ok,
    Timeout,
    SendFailed,
}

/// Which list the probe came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    TorMesh,
    InterTor,
    Service,
}

/// One probe.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// When it was received by the analyzer (Unix ms): the window's clock.
    pub at_ms: u64,
    /// The uploading agent.
    pub prober: String,
    pub target_agent: String,
    pub src: Gid,
    pub dst: Gid,
    pub src_qpn: u32,
    pub dst_qpn: u32,
    pub flow_label: u32,
    pub src_port: u16,
    pub kind: Kind,
    pub outcome: Outcome,
    pub rtt_ns: i64,
    pub prober_delay_ns: i64,
    pub responder_delay_ns: i64,
    pub services: Vec<String>,
}

/// The longest RTT or delay believed (anything longer is a broken clock).
const MAX_DELAY_NS: i64 = 60_000_000_000;

impl Record {
    pub fn from_proto(
        r: &proto::ProbeResult,
        prober: &str,
        at_ms: u64,
        at: &str,
    ) -> Result<Self, FieldError> {
        let field = |f: &str| format!("{at}.{f}");
        let bad = |f: &str, d: String| FieldError {
            field: field(f),
            detail: d,
        };
        let t = r
            .tuple
            .as_ref()
            .ok_or_else(|| bad("tuple", "missing".into()))?;
        let outcome = match proto::ProbeStatus::try_from(r.status) {
            Ok(proto::ProbeStatus::Ok) => Outcome::Ok,
            Ok(proto::ProbeStatus::Timeout) => Outcome::Timeout,
            Ok(proto::ProbeStatus::SendFailed) => Outcome::SendFailed,
            _ => return Err(bad("status", format!("{} is not a probe status", r.status))),
        };
        let kind = match proto::ProbeKind::try_from(r.kind) {
            Ok(proto::ProbeKind::TorMesh) => Kind::TorMesh,
            Ok(proto::ProbeKind::InterTor) => Kind::InterTor,
            Ok(proto::ProbeKind::Service) => Kind::Service,
            _ => return Err(bad("kind", format!("{} is not a probe kind", r.kind))),
        };
        for (name, v) in [
            ("network_rtt_ns", r.network_rtt_ns),
            ("prober_delay_ns", r.prober_delay_ns),
            ("responder_delay_ns", r.responder_delay_ns),
        ] {
            if !(0..=MAX_DELAY_NS).contains(&v) {
                return Err(bad(name, format!("{v} ns is not a delay")));
            }
        }
        if kind == Kind::Service && r.services.is_empty() {
            return Err(bad("services", "a service probe names its services".into()));
        }
        Ok(Self {
            at_ms,
            prober: prober.to_owned(),
            target_agent: r.target_agent.clone(),
            src: convert::gid(&field("tuple.src_gid"), &t.src_gid)?,
            dst: convert::gid(&field("tuple.dst_gid"), &t.dst_gid)?,
            src_qpn: t.src_qpn,
            dst_qpn: t.dst_qpn,
            flow_label: t.flow_label & 0xF_FFFF,
            src_port: u16::try_from(t.src_port).map_err(|_| {
                bad(
                    "tuple.src_port",
                    format!("{} is not a UDP port", t.src_port),
                )
            })?,
            kind,
            outcome,
            rtt_ns: r.network_rtt_ns,
            prober_delay_ns: r.prober_delay_ns,
            responder_delay_ns: r.responder_delay_ns,
            services: r.services.clone(),
        })
    }
}

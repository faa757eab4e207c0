//! Between the wire's messages and the checked types the logic works on: every
//! field a peer sends is checked here, with an error naming it.

use std::net::IpAddr;

use dpumesh_dpa::fabric::ud::Gid;

use crate::pinglist::{ListKind, Target};
use crate::proto;
use crate::registry::Rnic;

/// What is wrong with a message's field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {detail}")]
pub struct FieldError {
    pub field: String,
    pub detail: String,
}

fn bad(field: impl Into<String>, detail: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        detail: detail.into(),
    }
}

pub fn gid(field: &str, s: &str) -> Result<Gid, FieldError> {
    s.parse()
        .map_err(|e: dpumesh_dpa::fabric::ud::GidParseError| bad(field, e.to_string()))
}

pub fn ip(field: &str, s: &str) -> Result<IpAddr, FieldError> {
    s.parse()
        .map_err(|_| bad(field, format!("{s:?} is not an IP address")))
}

/// A registration's RNIC, stamped `now_ms`.
pub fn rnic_from(info: &proto::RnicInfo, at: &str, now_ms: u64) -> Result<Rnic, FieldError> {
    let field = |f: &str| format!("{at}.{f}");
    if info.qpn == 0 || info.qpn > 0xFF_FFFF {
        return Err(bad(
            field("qpn"),
            format!("{} is not a queue pair number (1..2^24)", info.qpn),
        ));
    }
    if info.agent_id.is_empty() || info.agent_id.len() > 253 {
        return Err(bad(field("agent_id"), "must be 1 to 253 characters"));
    }
    if info.tor_id.is_empty() || info.tor_id.len() > 253 {
        return Err(bad(field("tor_id"), "must be 1 to 253 characters"));
    }
    let udp_port = u16::try_from(info.udp_port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| {
            bad(
                field("udp_port"),
                format!("{} is not a UDP port", info.udp_port),
            )
        })?;
    let gid = gid(&field("gid"), &info.gid)?;
    let rnic_ip = if info.rnic_ip.is_empty() {
        gid.ip()
    } else {
        ip(&field("rnic_ip"), &info.rnic_ip)?
    };
    // RoCEv2: the GID is the port's IP address.
    if rnic_ip != gid.ip() {
        return Err(bad(
            field("rnic_ip"),
            format!("{rnic_ip} is not the GID's address {}", gid.ip()),
        ));
    }
    Ok(Rnic {
        gid,
        qpn: info.qpn,
        qkey: info.qkey,
        agent_id: info.agent_id.clone(),
        agent_ip: info.agent_ip.clone(),
        rnic_ip,
        tor_id: info.tor_id.clone(),
        udp_port,
        last_updated_ms: now_ms,
    })
}

pub fn rnic_to(r: &Rnic) -> proto::RnicInfo {
    proto::RnicInfo {
        gid: r.gid.to_string(),
        qpn: r.qpn,
        qkey: r.qkey,
        agent_id: r.agent_id.clone(),
        agent_ip: r.agent_ip.clone(),
        rnic_ip: r.rnic_ip.to_string(),
        tor_id: r.tor_id.clone(),
        udp_port: u32::from(r.udp_port),
        last_updated_ms: r.last_updated_ms as i64,
    }
}

pub fn kind_to(k: ListKind) -> proto::PinglistKind {
    match k {
        ListKind::TorMesh => proto::PinglistKind::TorMesh,
        ListKind::InterTor => proto::PinglistKind::InterTor,
    }
}

pub fn target_to(t: &Target) -> proto::PingTarget {
    proto::PingTarget {
        rnic: Some(rnic_to(&t.rnic)),
        flow_label: t.flow_label,
        kind: kind_to(t.kind) as i32,
    }
}

/// A pinglist target as the agent gets it.
pub fn target_from(t: &proto::PingTarget, at: &str) -> Result<Target, FieldError> {
    let info = t
        .rnic
        .as_ref()
        .ok_or_else(|| bad(format!("{at}.rnic"), "missing"))?;
    let rnic = rnic_from(
        info,
        &format!("{at}.rnic"),
        info.last_updated_ms.max(0) as u64,
    )?;
    let kind = match proto::PinglistKind::try_from(t.kind) {
        Ok(proto::PinglistKind::TorMesh) => ListKind::TorMesh,
        Ok(proto::PinglistKind::InterTor) => ListKind::InterTor,
        _ => {
            return Err(bad(
                format!("{at}.kind"),
                format!("{} is not a pinglist kind", t.kind),
            ));
        }
    };
    Ok(Target {
        rnic,
        flow_label: t.flow_label & 0xF_FFFF,
        kind,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> proto::RnicInfo {
        proto::RnicInfo {
            gid: "10.0.0.1".into(),
            qpn: 17,
            qkey: 1,
            agent_id: "node-1".into(),
            agent_ip: "127.0.0.1".into(),
            rnic_ip: String::new(),
            tor_id: "tor-a".into(),
            udp_port: 4791,
            last_updated_ms: 0,
        }
    }

    #[test]
    fn a_good_registration_is_checked_and_stamped() {
        let r = rnic_from(&info(), "rnics[0]", 42).unwrap();
        assert_eq!(
            r.rnic_ip.to_string(),
            "10.0.0.1",
            "the IP comes from the GID"
        );
        assert_eq!(r.last_updated_ms, 42);
        let back = rnic_from(&rnic_to(&r), "x", 42).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn each_bad_field_is_named() {
        type Break = fn(&mut proto::RnicInfo);
        let cases: Vec<(Break, &str)> = vec![
            (|i| i.qpn = 0, "rnics[0].qpn"),
            (|i| i.qpn = 1 << 24, "rnics[0].qpn"),
            (|i| i.agent_id.clear(), "rnics[0].agent_id"),
            (|i| i.tor_id.clear(), "rnics[0].tor_id"),
            (|i| i.udp_port = 70_000, "rnics[0].udp_port"),
            (|i| i.gid = "nope".into(), "rnics[0].gid"),
            (|i| i.rnic_ip = "nope".into(), "rnics[0].rnic_ip"),
        ];
        for (break_it, field) in cases {
            let mut i = info();
            break_it(&mut i);
            assert_eq!(rnic_from(&i, "rnics[0]", 0).unwrap_err().field, field);
        }
    }
}

//! Path tracing: every `trace_every`, traceroute-style probes towards
//! each target — UDP datagrams with IP TTL 1..=`MAX_HOPS` to a closed port, sent at
//! once — and the ICMP errors they draw: time exceeded from each router, port
//! unreachable from the target. The hops go to the analyzer with the results, where
//! they replace the registry's topology as the probes' paths.
//!
//! A target answered at TTL `t` last round is sent TTLs 1..=`t` only (all of them
//! again once a round does not reach it): hosts rate-limit their port-unreachable
//! errors per peer (Linux: one a second after a burst of six), so the five extra
//! datagrams past the target would spend the tokens its real answer needs, and a
//! trace would read `…, *` with the target "reached" one hop too far.
//!
//! The trace leaves from a UDP port of its own, not the probe's: on a fabric with
//! ECMP a trace may take another of the equal-cost paths than the probes it stands for
//! (the seed names this limit of traceroute; Paris-traceroute's fixed 5-tuple over the
//! UD queue pair's own port is the step after).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dpumesh_dpa::fabric::ud::Gid;
use dpumesh_dpa::traceroute::{IcmpKind, IcmpReport, TraceSocket};

use super::Shared;
use crate::proto;

/// The most hops traced.
pub const MAX_HOPS: u8 = 8;
/// Traceroute's first destination port; TTL `t` goes to `BASE_PORT + t`.
pub const BASE_PORT: u16 = 33434;
/// How long a round waits for ICMP errors.
const LISTEN: Duration = Duration::from_millis(400);
/// Targets traced per round.
const MAX_TARGETS: usize = 64;

/// One round's traces, from what the socket heard: per target, hops by TTL and the
/// TTL at which the target itself answered.
pub fn paths(
    local: Gid,
    src_port: u16,
    targets: &[Gid],
    reports: &[IcmpReport],
    started: Instant,
    wall_ms: u64,
) -> Vec<proto::PathInfo> {
    targets
        .iter()
        .map(|target| {
            let ip = target.ip();
            let mut hops: BTreeMap<u8, (IpAddr, Duration)> = BTreeMap::new();
            let mut reached: Option<u8> = None;
            for r in reports.iter().filter(|r| r.to.ip() == ip) {
                let Some(ttl) =
                    r.to.port()
                        .checked_sub(BASE_PORT)
                        .and_then(|t| u8::try_from(t).ok())
                        .filter(|t| (1..=MAX_HOPS).contains(t))
                else {
                    continue;
                };
                match r.kind {
                    IcmpKind::TimeExceeded => {
                        hops.insert(ttl, (r.from, r.at.saturating_duration_since(started)));
                    }
                    IcmpKind::Unreachable(_) if r.from == ip => {
                        reached = Some(reached.map_or(ttl, |t| t.min(ttl)));
                    }
                    _ => {}
                }
            }
            let last = reached.map_or(MAX_HOPS, |t| t - 1);
            proto::PathInfo {
                tuple: Some(proto::FiveTuple {
                    src_gid: local.to_string(),
                    dst_gid: target.to_string(),
                    src_port: u32::from(src_port),
                    dst_port: u32::from(BASE_PORT),
                    ..Default::default()
                }),
                hops: (1..=last)
                    .map(|ttl| {
                        let hop = hops.get(&ttl);
                        proto::Hop {
                            ttl: u32::from(ttl),
                            ip: hop.map(|h| h.0.to_string()).unwrap_or_default(),
                            rtt_ns: hop.map_or(0, |h| h.1.as_nanos() as u64),
                        }
                    })
                    .collect(),
                reached: reached.is_some(),
                traced_at_ms: wall_ms as i64,
            }
        })
        .collect()
}

/// The TTLs a round sends to a target last reached at `reached` (None: not reached
/// last round, or never traced).
pub fn ttls(reached: Option<u8>) -> std::ops::RangeInclusive<u8> {
    1..=reached.map_or(MAX_HOPS, |t| t.clamp(1, MAX_HOPS))
}

/// The TTL at which a trace reached its target (its hops and one more).
fn reached_at(path: &proto::PathInfo) -> Option<u8> {
    path.reached
        .then(|| u8::try_from(path.hops.len() + 1).ok())
        .flatten()
}

/// The tracing thread: a round every `every` until the agent stops.
pub(super) fn run(shared: Arc<Shared>, local: Gid, every: Duration) {
    let IpAddr::V4(ip) = local.ip() else {
        tracing::warn!("path tracing is IPv4 only: not traced");
        return;
    };
    let sock = match TraceSocket::bind(ip) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "path tracing: no socket; not traced");
            return;
        }
    };
    let src_port = sock.local_addr().map_or(0, |a| a.port());
    let mut next = Instant::now() + Duration::from_millis(500);
    let mut reports = Vec::new();
    let mut reach: BTreeMap<Gid, u8> = BTreeMap::new();
    // Asleep until the next round (a stop wakes it).
    while !shared.stop.sleep_until(next) {
        next = Instant::now() + every;
        let targets: Vec<Gid> = shared
            .trace_targets
            .lock()
            .iter()
            .take(MAX_TARGETS)
            .copied()
            .collect();
        if targets.is_empty() {
            continue;
        }
        reports.clear();
        // What a previous round's late answers left.
        let _ = sock.errors(&mut reports);
        reports.clear();
        let started = Instant::now();
        for t in &targets {
            for ttl in ttls(reach.get(t).copied()) {
                let to = SocketAddr::new(t.ip(), BASE_PORT + u16::from(ttl));
                if let Err(e) = sock.send(to, ttl, b"dpumesh-trace") {
                    tracing::debug!(error = %e, %to, "path tracing: send failed");
                }
            }
        }
        while started.elapsed() < LISTEN {
            std::thread::sleep(Duration::from_millis(10));
            if let Err(e) = sock.errors(&mut reports) {
                tracing::debug!(error = %e, "path tracing: error queue");
                break;
            }
        }
        let traced = paths(
            local,
            src_port,
            &targets,
            &reports,
            started,
            shared.wall_ms(),
        );
        reach.clear();
        for (t, p) in targets.iter().zip(&traced) {
            if let Some(at) = reached_at(p) {
                reach.insert(*t, at);
            }
        }
        shared.push_paths(traced);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn report(from: [u8; 4], to: [u8; 4], ttl: u8, kind: IcmpKind, at: Instant) -> IcmpReport {
        IcmpReport {
            from: IpAddr::V4(Ipv4Addr::from(from)),
            to: SocketAddr::new(IpAddr::V4(Ipv4Addr::from(to)), BASE_PORT + u16::from(ttl)),
            kind,
            at,
        }
    }

    #[test]
    fn hops_stop_where_the_target_answers() {
        let t0 = Instant::now();
        let target = Gid::from_ip("10.0.2.1".parse().unwrap());
        let reports = vec![
            report(
                [10, 0, 1, 254],
                [10, 0, 2, 1],
                1,
                IcmpKind::TimeExceeded,
                t0,
            ),
            report([10, 0, 0, 2], [10, 0, 2, 1], 2, IcmpKind::TimeExceeded, t0),
            report(
                [10, 0, 2, 1],
                [10, 0, 2, 1],
                3,
                IcmpKind::Unreachable(3),
                t0,
            ),
            report(
                [10, 0, 2, 1],
                [10, 0, 2, 1],
                4,
                IcmpKind::Unreachable(3),
                t0,
            ),
            // Another target's, and a port outside the trace's.
            report(
                [10, 0, 1, 254],
                [10, 0, 2, 2],
                1,
                IcmpKind::TimeExceeded,
                t0,
            ),
        ];
        let local = Gid::from_ip("10.0.1.1".parse().unwrap());
        let p = paths(local, 5000, &[target], &reports, t0, 7)
            .pop()
            .unwrap();
        assert!(p.reached);
        let ips: Vec<&str> = p.hops.iter().map(|h| h.ip.as_str()).collect();
        assert_eq!(ips, ["10.0.1.254", "10.0.0.2"]);
        // The next round sends no datagram past the target (whose port-unreachable
        // errors are rate-limited).
        assert_eq!(ttls(reached_at(&p)), 1..=3);
        assert_eq!(p.tuple.unwrap().src_port, 5000);
    }

    #[test]
    fn a_silent_hop_is_kept_as_unknown_and_an_unreached_target_says_so() {
        let t0 = Instant::now();
        let target = Gid::from_ip("10.0.2.1".parse().unwrap());
        let reports = vec![report(
            [10, 0, 0, 2],
            [10, 0, 2, 1],
            2,
            IcmpKind::TimeExceeded,
            t0,
        )];
        let local = Gid::from_ip("10.0.1.1".parse().unwrap());
        let p = paths(local, 1, &[target], &reports, t0, 0).pop().unwrap();
        assert!(!p.reached);
        assert_eq!(ttls(reached_at(&p)), 1..=MAX_HOPS);
        assert_eq!(p.hops.len(), MAX_HOPS as usize);
        assert_eq!(p.hops[0].ip, "");
        assert_eq!(p.hops[1].ip, "10.0.0.2");
    }
}

//! One analysis of a window of probe records: which pairs break their SLA, and which
//! element (a link, a switch, a host) the failures point at.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use dpumesh_dpa::fabric::ud::Gid;

use super::stats::{self, Sla};
use super::vote::{PathProbe, localize};
use super::{
    AgentSeen, AnalyzerPolicy, Cell, Element, Heatmap, HostDelay, Impact, ImpactClass, Kind,
    Outcome, Problem, ProblemKind, Record, Report, paths,
};
use crate::registry::Rnic;

/// One analysis of a window.
pub(super) struct Analysis<'a> {
    policy: &'a AnalyzerPolicy,
    now: u64,
    records: &'a [Record],
    agents: &'a BTreeMap<String, (u64, u32)>,
    by_gid: HashMap<Gid, &'a Rnic>,
    /// Agents silent for longer than the policy allows.
    silent: BTreeSet<&'a str>,
    /// Each pair's traced path, as elements (complete traces only).
    traced: HashMap<(Gid, Gid), Vec<Element>>,
    views: Vec<paths::PathView>,
}

/// Why a timeout is not the network's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum NotNetwork {
    HostDown,
    QpnChanged,
    ProberHost,
}

impl<'a> Analysis<'a> {
    pub(super) fn new(
        policy: &'a AnalyzerPolicy,
        now: u64,
        records: &'a [Record],
        agents: &'a BTreeMap<String, (u64, u32)>,
        registry: &'a [Rnic],
        traced: &HashMap<(Gid, Gid), paths::Traced>,
    ) -> Self {
        let silence = policy.silence.as_millis() as u64;
        let silent = agents
            .iter()
            .filter(|(_, (last, _))| now.saturating_sub(*last) >= silence)
            .map(|(a, _)| a.as_str())
            .collect();
        let by_gid: HashMap<Gid, &Rnic> = registry.iter().map(|r| (r.gid, r)).collect();
        let tors: BTreeSet<&str> = registry.iter().map(|r| r.tor_id.as_str()).collect();
        let is_tor = |n: &str| tors.contains(n);
        let mut elements = HashMap::new();
        let mut views = Vec::new();
        for ((s, d), t) in traced {
            let (Some(src), Some(dst)) = (by_gid.get(s), by_gid.get(d)) else {
                continue;
            };
            let names = paths::names(src, dst, t);
            if let Some(n) = &names {
                elements.insert((*s, *d), paths::elements(src, dst, n, &is_tor));
            }
            views.push(paths::PathView {
                src: src.agent_id.clone(),
                dst: dst.agent_id.clone(),
                hops: t
                    .hops
                    .iter()
                    .map(|h| h.map_or_else(|| "*".to_owned(), |ip| ip.to_string()))
                    .collect(),
                names: names.unwrap_or_default(),
                reached: t.reached,
                age_ms: now.saturating_sub(t.at_ms),
            });
        }
        views.sort_by(|a, b| (&a.src, &a.dst).cmp(&(&b.src, &b.dst)));
        Self {
            policy,
            now,
            records,
            agents,
            by_gid,
            silent,
            traced: elements,
            views,
        }
    }

    fn node_of(&self, gid: &Gid) -> String {
        self.by_gid
            .get(gid)
            .map_or_else(|| gid.ip().to_string(), |r| r.agent_id.clone())
    }

    /// Why a failed probe is not the network's fault, if it is not.
    fn not_network(&self, r: &Record) -> Option<NotNetwork> {
        match r.outcome {
            Outcome::Ok => None,
            Outcome::SendFailed => Some(NotNetwork::ProberHost),
            Outcome::Timeout => {
                if self.silent.contains(r.target_agent.as_str()) {
                    return Some(NotNetwork::HostDown);
                }
                // The target's current queue pair: the registry's, else what its own
                // uploads show.
                let current = self
                    .by_gid
                    .get(&r.dst)
                    .map(|x| x.qpn)
                    .or_else(|| self.agents.get(&r.target_agent).map(|a| a.1))
                    .filter(|q| *q != 0);
                if current.is_some_and(|q| q != r.dst_qpn) {
                    return Some(NotNetwork::QpnChanged);
                }
                None
            }
        }
    }

    fn network_timeout(&self, r: &Record) -> bool {
        r.outcome == Outcome::Timeout && self.not_network(r).is_none()
    }

    fn abnormal(&self, r: &Record) -> bool {
        self.network_timeout(r)
            || (r.outcome == Outcome::Ok && r.rtt_ns > self.policy.slow_rtt.as_nanos() as i64)
    }

    /// The elements a probe crossed: its pair's traced path when there is a complete
    /// one, else the registry's topology.
    fn path(&self, r: &Record) -> Option<Vec<Element>> {
        if let Some(p) = self.traced.get(&(r.src, r.dst)) {
            return Some(p.clone());
        }
        let (s, d) = (self.by_gid.get(&r.src)?, self.by_gid.get(&r.dst)?);
        let mut p = vec![
            Element::HostLink {
                node: s.agent_id.clone(),
                tor: s.tor_id.clone(),
            },
            Element::Switch {
                tor: s.tor_id.clone(),
            },
        ];
        if s.tor_id != d.tor_id {
            let (a, b) = if s.tor_id < d.tor_id {
                (&s.tor_id, &d.tor_id)
            } else {
                (&d.tor_id, &s.tor_id)
            };
            p.push(Element::InterTor {
                a: a.clone(),
                b: b.clone(),
            });
            p.push(Element::Switch {
                tor: d.tor_id.clone(),
            });
        }
        p.push(Element::HostLink {
            node: d.agent_id.clone(),
            tor: d.tor_id.clone(),
        });
        Some(p)
    }

    pub(super) fn report(&self) -> Report {
        let mut problems = self.host_problems();
        let anomalous = self.anomalous_rnics();
        problems.extend(anomalous.iter().map(|(p, _)| p.clone()));
        problems.extend(self.faulty_elements());
        for p in &mut problems {
            p.impact = self.impact(p);
            p.class = p.impact.iter().map(|i| i.class).min();
        }
        let mut unreachable: BTreeSet<String> = self.silent.iter().map(|s| s.to_string()).collect();
        for (p, rate) in &anomalous {
            if *rate >= self.policy.unreachable_rate {
                unreachable.extend(p.nodes.iter().cloned());
            }
        }
        Report {
            at_ms: self.now,
            window_ms: self.policy.window.as_millis() as u64,
            probes: self.records.len(),
            problems,
            cluster: self.sla(|r| r.kind != Kind::Service),
            services: self.service_slas(),
            heatmap: self.heatmap(),
            unreachable: unreachable.into_iter().collect(),
            agents: self
                .agents
                .iter()
                .map(|(a, (last, qpn))| AgentSeen {
                    agent: a.clone(),
                    last_upload_ms: *last,
                    silent: self.silent.contains(a.as_str()),
                    qpn: *qpn,
                })
                .collect(),
            host_delays: self.host_delays(),
            paths: self.views.clone(),
        }
    }

    fn sla(&self, pick: impl Fn(&Record) -> bool) -> Sla {
        let mut rtts = Vec::new();
        let mut timeouts = 0;
        for r in self.records.iter().filter(|r| pick(r)) {
            match r.outcome {
                Outcome::Ok => rtts.push(r.rtt_ns),
                _ if self.network_timeout(r) => timeouts += 1,
                _ => {}
            }
        }
        Sla::of(rtts, timeouts)
    }

    fn service_slas(&self) -> BTreeMap<String, Sla> {
        let names: BTreeSet<&str> = self
            .records
            .iter()
            .flat_map(|r| r.services.iter().map(String::as_str))
            .collect();
        names
            .into_iter()
            .map(|s| {
                (
                    s.to_owned(),
                    self.sla(|r| r.kind == Kind::Service && r.services.iter().any(|x| x == s)),
                )
            })
            .collect()
    }

    fn host_problems(&self) -> Vec<Problem> {
        let mut counts: BTreeMap<(NotNetwork, String), usize> = BTreeMap::new();
        for r in self.records {
            if let Some(why) = self.not_network(r) {
                let node = match why {
                    NotNetwork::ProberHost => r.prober.clone(),
                    _ => r.target_agent.clone(),
                };
                *counts.entry((why, node)).or_default() += 1;
            }
        }
        // A silent agent is down even if nobody probed it in the window.
        for s in &self.silent {
            counts
                .entry((NotNetwork::HostDown, s.to_string()))
                .or_default();
        }
        counts
            .into_iter()
            .map(|((why, node), n)| {
                let (kind, evidence) = match why {
                    NotNetwork::HostDown => {
                        let last = self.agents.get(&node).map_or(0, |a| a.0);
                        (
                            ProblemKind::HostDown,
                            format!(
                                "agent silent for {} ms; {n} probes to it unanswered (not counted against the network)",
                                self.now.saturating_sub(last)
                            ),
                        )
                    }
                    NotNetwork::QpnChanged => (
                        ProblemKind::QpnChanged,
                        format!("{n} probes went to a queue pair it no longer has (agent restarted)"),
                    ),
                    NotNetwork::ProberHost => (
                        ProblemKind::ProberHost,
                        format!("{n} probes could not be sent by its host"),
                    ),
                };
                Problem {
                    kind,
                    network: false,
                    element: format!("host {node}"),
                    at: None,
                    nodes: vec![node],
                    evidence,
                    score: 1.0,
                    impact: Vec::new(),
                    class: None,
                }
            })
            .collect()
    }

    /// RNICs many probers lose probes to, with the share of probes lost.
    fn anomalous_rnics(&self) -> Vec<(Problem, f64)> {
        // (target, prober) → (probes, network timeouts)
        let mut pairs: BTreeMap<(Gid, Gid), (usize, usize)> = BTreeMap::new();
        for r in self.records.iter().filter(|r| r.kind != Kind::Service) {
            if r.outcome != Outcome::Ok && !self.network_timeout(r) {
                continue;
            }
            let e = pairs.entry((r.dst, r.src)).or_default();
            e.0 += 1;
            if self.network_timeout(r) {
                e.1 += 1;
            }
        }
        let mut by_target: BTreeMap<Gid, Vec<(usize, usize)>> = BTreeMap::new();
        for ((t, _), v) in pairs {
            if v.0 >= self.policy.min_probes {
                by_target.entry(t).or_default().push(v);
            }
        }
        let mut out = Vec::new();
        for (target, probers) in by_target {
            let bad = probers
                .iter()
                .filter(|(n, t)| *t as f64 / *n as f64 >= self.policy.bad_rate)
                .count();
            if bad < self.policy.min_bad_probers || bad * 2 < probers.len() {
                continue;
            }
            let (n, t) = probers
                .iter()
                .fold((0, 0), |acc, v| (acc.0 + v.0, acc.1 + v.1));
            let rate = t as f64 / n as f64;
            let node = self.node_of(&target);
            out.push((
                Problem {
                    kind: ProblemKind::AnomalousRnic,
                    network: true,
                    element: format!("RNIC {node} ({})", target.ip()),
                    at: None,
                    nodes: vec![node],
                    evidence: format!(
                        "{bad} of {} probers lose probes to it: {t} of {n} ({:.0} %)",
                        probers.len(),
                        rate * 100.0
                    ),
                    score: rate,
                    impact: Vec::new(),
                    class: None,
                },
                rate,
            ));
        }
        out
    }

    fn faulty_elements(&self) -> Vec<Problem> {
        let probes: Vec<PathProbe<Element>> = self
            .records
            .iter()
            .filter(|r| r.outcome == Outcome::Ok || self.network_timeout(r))
            .filter_map(|r| {
                Some(PathProbe {
                    path: self.path(r)?,
                    abnormal: self.abnormal(r),
                })
            })
            .collect();
        localize(&probes, self.policy.min_votes, self.policy.min_score)
            .into_iter()
            .map(|b| {
                let nodes = match &b.element {
                    Element::HostLink { node, .. } => vec![node.clone()],
                    _ => Vec::new(),
                };
                let (slow, lost) = self.kinds_through(&b.element);
                Problem {
                    kind: ProblemKind::FaultyElement,
                    network: true,
                    element: b.element.to_string(),
                    at: Some(b.element.clone()),
                    nodes,
                    evidence: format!(
                        "{} of {} probes across it abnormal ({lost} lost, {slow} slower than {} µs)",
                        b.votes,
                        b.probes,
                        self.policy.slow_rtt.as_micros()
                    ),
                    score: b.score,
                    impact: Vec::new(),
                    class: None,
                }
            })
            .collect()
    }

    /// Slow and lost probes across an element.
    fn kinds_through(&self, e: &Element) -> (usize, usize) {
        let mut slow = 0;
        let mut lost = 0;
        for r in self.records {
            if self.path(r).is_some_and(|p| p.contains(e)) {
                if self.network_timeout(r) {
                    lost += 1;
                } else if self.abnormal(r) {
                    slow += 1;
                }
            }
        }
        (slow, lost)
    }

    /// Whether a record is concerned by a problem.
    fn concerns(&self, p: &Problem, r: &Record) -> bool {
        match (&p.at, p.kind) {
            (Some(e), _) => self.path(r).is_some_and(|path| path.contains(e)),
            (None, ProblemKind::AnomalousRnic) => {
                let node = &p.nodes[0];
                self.node_of(&r.dst) == *node || self.node_of(&r.src) == *node
            }
            (None, _) => p
                .nodes
                .iter()
                .any(|n| *n == r.target_agent || *n == r.prober),
        }
    }

    fn impact(&self, p: &Problem) -> Vec<Impact> {
        let mut worst: BTreeMap<&str, ImpactClass> = BTreeMap::new();
        for r in self.records.iter().filter(|r| r.kind == Kind::Service) {
            if !self.concerns(p, r) {
                continue;
            }
            // A lost probe is P0 whether the network lost it or the peer is down.
            let lost = self.network_timeout(r) || (!p.network && r.outcome == Outcome::Timeout);
            let class = if lost {
                ImpactClass::P0
            } else if self.abnormal(r) {
                ImpactClass::P1
            } else {
                ImpactClass::P2
            };
            for s in &r.services {
                let e = worst.entry(s).or_insert(class);
                *e = (*e).min(class);
            }
        }
        worst
            .into_iter()
            .map(|(s, class)| Impact {
                service: s.to_owned(),
                class,
            })
            .collect()
    }

    fn heatmap(&self) -> Heatmap {
        let mut nodes: BTreeSet<String> =
            self.by_gid.values().map(|r| r.agent_id.clone()).collect();
        nodes.extend(self.agents.keys().cloned());
        let nodes: Vec<String> = nodes.into_iter().collect();
        let index: HashMap<&str, usize> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        let mut acc: HashMap<(usize, usize), (Vec<i64>, usize)> = HashMap::new();
        for r in self.records.iter().filter(|r| r.kind != Kind::Service) {
            let (Some(&i), Some(&j)) = (
                index.get(r.prober.as_str()),
                index.get(self.node_of(&r.dst).as_str()),
            ) else {
                continue;
            };
            let e = acc.entry((i, j)).or_default();
            match r.outcome {
                Outcome::Ok => e.0.push(r.rtt_ns),
                _ if self.network_timeout(r) => e.1 += 1,
                _ => {}
            }
        }
        let mut cells = vec![vec![None; nodes.len()]; nodes.len()];
        for ((i, j), (rtts, timeouts)) in acc {
            let s = Sla::of(rtts, timeouts);
            if s.probes > 0 {
                cells[i][j] = Some(Cell {
                    probes: s.probes,
                    rtt_p50_us: s.rtt_p50_us,
                    rtt_p99_us: s.rtt_p99_us,
                    drop_rate: s.drop_rate,
                });
            }
        }
        Heatmap { nodes, cells }
    }

    fn host_delays(&self) -> BTreeMap<String, HostDelay> {
        let mut prober: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        let mut responder: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for r in self.records.iter().filter(|r| r.outcome == Outcome::Ok) {
            prober
                .entry(r.prober.clone())
                .or_default()
                .push(r.prober_delay_ns);
            if r.responder_delay_ns > 0 {
                responder
                    .entry(self.node_of(&r.dst))
                    .or_default()
                    .push(r.responder_delay_ns);
            }
        }
        let p50 = |mut v: Vec<i64>| {
            v.sort_unstable();
            stats::percentile(&v, 0.5) / 1_000.0
        };
        let mut out: BTreeMap<String, HostDelay> = BTreeMap::new();
        for (n, v) in prober {
            out.entry(n).or_default().prober_p50_us = p50(v);
        }
        for (n, v) in responder {
            out.entry(n).or_default().responder_p50_us = p50(v);
        }
        out
    }
}

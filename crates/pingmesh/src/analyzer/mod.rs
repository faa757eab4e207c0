//! The analyzer: it keeps the agents' uploads over a window and says
//! what they mean.
//!
//! - Non-network timeouts are set apart first: probes towards a host whose agent
//!   stopped uploading (host down) or towards a queue pair the target no longer has
//!   (its agent restarted: QPN changed), and sends the prober's own host failed.
//! - Anomalous RNICs: one that many probers lose probes to.
//! - Faulty links and switches: voting over the paths of abnormal probes ([`vote`]).
//!   Paths come from the topology the registry knows (host link, ToR, inter-ToR
//!   link, ToR, host link).
//! - SLAs: RTT percentiles and drop rate for the cluster and for each service.
//! - Impact: P0/P1/P2 for services whose connections cross a faulty element.
//!
//! Time is injected: the window and silences are judged on the given clock.

pub mod log;
pub mod paths;
mod record;
pub mod service;
pub mod stats;
pub mod vote;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use dpumesh_clock::SharedClock;
use dpumesh_dpa::fabric::ud::Gid;
use parking_lot::Mutex;
use serde::Serialize;

use crate::convert::FieldError;
use crate::proto;
use crate::registry::{Rnic, RnicStore};
pub use record::{Kind, Outcome, Record};
use stats::Sla;
use vote::{PathProbe, localize};

/// How the analyzer judges.
#[derive(Debug, Clone, PartialEq)]
pub struct AnalyzerPolicy {
    /// Results older than this are forgotten.
    pub window: Duration,
    /// An agent silent this long is down (its host, not the network).
    pub silence: Duration,
    /// A network RTT above this is abnormal.
    pub slow_rtt: Duration,
    /// Probes a prober must have sent to a target before its rate counts.
    pub min_probes: usize,
    /// A prober's timeout rate to a target at or above this is bad.
    pub bad_rate: f64,
    /// Bad probers needed to call an RNIC anomalous (and at least half of them).
    pub min_bad_probers: usize,
    /// Votes and score an element needs to be blamed.
    pub min_votes: usize,
    pub min_score: f64,
    /// A node whose RNIC loses at least this share of probes is unreachable.
    pub unreachable_rate: f64,
}

impl Default for AnalyzerPolicy {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(30),
            silence: Duration::from_secs(5),
            slow_rtt: Duration::from_millis(1),
            min_probes: 5,
            bad_rate: 0.1,
            min_bad_probers: 2,
            min_votes: 5,
            min_score: 0.3,
            unreachable_rate: 0.9,
        }
    }
}

/// A network element of the topology.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Element {
    /// The link between a host's RNIC and its ToR.
    HostLink { node: String, tor: String },
    /// A ToR switch.
    Switch { tor: String },
    /// The link (or fabric) between two ToRs, names in order.
    InterTor { a: String, b: String },
    /// A link a traced path crossed (a router's name or address at each end, in
    /// order).
    Link { a: String, b: String },
}

impl std::fmt::Display for Element {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Element::HostLink { node, tor } => write!(f, "link {node}–{tor}"),
            Element::Switch { tor } => write!(f, "switch {tor}"),
            Element::InterTor { a, b } | Element::Link { a, b } => write!(f, "link {a}–{b}"),
        }
    }
}

/// What kind of problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProblemKind {
    /// Many probers lose probes to this RNIC (its NIC or its link).
    AnomalousRnic,
    /// Abnormal probes' paths vote for this link or switch.
    FaultyElement,
    /// Not the network: the node's agent stopped uploading.
    HostDown,
    /// Not the network: probes went to a queue pair the target no longer has.
    QpnChanged,
    /// Not the network: the prober's host could not send.
    ProberHost,
}

impl ProblemKind {
    pub const ALL: [ProblemKind; 5] = [
        ProblemKind::AnomalousRnic,
        ProblemKind::FaultyElement,
        ProblemKind::HostDown,
        ProblemKind::QpnChanged,
        ProblemKind::ProberHost,
    ];

    /// Its name in the JSON API and the metrics' `kind` label.
    pub fn name(self) -> &'static str {
        match self {
            ProblemKind::AnomalousRnic => "anomalous_rnic",
            ProblemKind::FaultyElement => "faulty_element",
            ProblemKind::HostDown => "host_down",
            ProblemKind::QpnChanged => "qpn_changed",
            ProblemKind::ProberHost => "prober_host",
        }
    }
}

/// How badly a service is hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum ImpactClass {
    /// Its own probes across the element are lost (or its peer is down).
    P0,
    /// Its own probes across the element are slow.
    P1,
    /// Its connections cross the element; its probes are not hit (yet).
    P2,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Impact {
    pub service: String,
    pub class: ImpactClass,
}

/// One detected problem.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Problem {
    pub kind: ProblemKind,
    /// Whether it is the network's fault.
    pub network: bool,
    /// What is at fault, in words.
    pub element: String,
    /// The structured element (faulty elements).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<Element>,
    /// The nodes involved.
    pub nodes: Vec<String>,
    /// Why, in numbers.
    pub evidence: String,
    pub score: f64,
    pub impact: Vec<Impact>,
    /// The worst class among the impacts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub class: Option<ImpactClass>,
}

/// One cell of the node × node heatmap.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Cell {
    pub probes: usize,
    pub rtt_p50_us: f64,
    pub rtt_p99_us: f64,
    pub drop_rate: f64,
}

/// Network RTT and drops between every two nodes.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Heatmap {
    pub nodes: Vec<String>,
    /// `cells[i][j]`: probes from `nodes[i]` to `nodes[j]` (None: none in the window).
    pub cells: Vec<Vec<Option<Cell>>>,
}

/// Everything the analyzer says.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub at_ms: u64,
    pub window_ms: u64,
    pub probes: usize,
    pub problems: Vec<Problem>,
    pub cluster: Sla,
    pub services: BTreeMap<String, Sla>,
    pub heatmap: Heatmap,
    /// Nodes the circuit breaker should route around.
    pub unreachable: Vec<String>,
    pub agents: Vec<AgentSeen>,
    /// Delays of the hosts themselves (not the network), per node: median prober
    /// and responder delay in microseconds.
    pub host_delays: BTreeMap<String, HostDelay>,
    /// The latest traced path of each pair.
    pub paths: Vec<paths::PathView>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct HostDelay {
    pub prober_p50_us: f64,
    pub responder_p50_us: f64,
}

/// An agent as its uploads show it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AgentSeen {
    pub agent: String,
    pub last_upload_ms: u64,
    pub silent: bool,
    /// The queue pair its probes come from (its responder's).
    pub qpn: u32,
}

#[derive(Debug, Default)]
struct State {
    records: VecDeque<Record>,
    agents: BTreeMap<String, (u64, u32)>,
    paths: HashMap<(Gid, Gid), paths::Traced>,
}

/// The analyzer.
pub struct Analyzer {
    policy: AnalyzerPolicy,
    clock: SharedClock,
    registry: Arc<dyn RnicStore>,
    state: Mutex<State>,
    /// Most records kept, whatever the window.
    max_records: usize,
    /// The last report and when (Unix ms): the dashboard, the JSON API and every
    /// ingress ask often; one analysis serves them until an upload comes or it is
    /// `REPORT_FRESH` old (silences depend on time alone).
    last: Mutex<Option<(u64, Report)>>,
    /// The window on disk, if kept there, and when it was last pruned (Unix ms).
    log: Option<(log::ResultLog, std::sync::atomic::AtomicU64)>,
}

/// How long a report is reused when no upload came.
const REPORT_FRESH_MS: u64 = 500;

impl std::fmt::Debug for Analyzer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Analyzer")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

fn now_ms(clock: &SharedClock) -> u64 {
    clock.wall_ns() / 1_000_000
}

impl Analyzer {
    /// `registry`: where nodes' ToRs and current queue pairs are known (the
    /// controller's).
    pub fn new(policy: AnalyzerPolicy, clock: SharedClock, registry: Arc<dyn RnicStore>) -> Self {
        Self {
            policy,
            clock,
            registry,
            state: Mutex::new(State::default()),
            max_records: 2_000_000,
            last: Mutex::new(None),
            log: None,
        }
    }

    /// Keeps the window's results in `log` too, and takes up the window it holds (a
    /// restarted analyzer judges what it judged before; an agent that uploaded in the
    /// window counts as heard from when it last did). Returns how many results were
    /// taken up.
    pub fn with_log(mut self, log: log::ResultLog) -> Result<(Self, usize), log::LogError> {
        let now = now_ms(&self.clock);
        let cutoff = now.saturating_sub(self.policy.window.as_millis() as u64);
        log.prune(cutoff)?;
        let (records, damaged) = log.load(cutoff)?;
        if damaged > 0 {
            tracing::warn!(damaged, "skipped analyzer results that do not read back");
        }
        let n = records.len();
        let mut st = std::mem::take(self.state.get_mut());
        for r in &records {
            st.agents.insert(r.prober.clone(), (r.at_ms, r.src_qpn));
        }
        st.records.extend(records);
        // The same bounds as uploads meet (`max_records`).
        self.prune(&mut st, now);
        *self.state.get_mut() = st;
        self.log = Some((log, std::sync::atomic::AtomicU64::new(now)));
        Ok((self, n))
    }

    pub fn policy(&self) -> &AnalyzerPolicy {
        &self.policy
    }

    /// Takes an agent's upload; how many results were accepted. A malformed result
    /// fails the whole upload with the field named (the agent is broken, not the
    /// network).
    pub fn upload(&self, req: &proto::UploadDataRequest) -> Result<u32, FieldError> {
        if req.agent_id.is_empty() {
            return Err(FieldError {
                field: "agent_id".into(),
                detail: "missing".into(),
            });
        }
        let now = now_ms(&self.clock);
        let mut records = Vec::with_capacity(req.results.len());
        for (i, r) in req.results.iter().enumerate() {
            records.push(Record::from_proto(
                r,
                &req.agent_id,
                now,
                &format!("results[{i}]"),
            )?);
        }
        let traced = req
            .paths
            .iter()
            .enumerate()
            .map(|(i, p)| paths::from_proto(p, now, &format!("paths[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        // An agent speaks for its own RNICs only: results or traces from a GID the
        // registry gives to another agent are refused (with TLS the agent's name is
        // proven, and the controller lets a node register its own RNIC only).
        let mut seen: Vec<Gid> = Vec::new();
        for src in records
            .iter()
            .map(|r| r.src)
            .chain(traced.iter().map(|((src, _), _)| *src))
        {
            if seen.contains(&src) {
                continue;
            }
            seen.push(src);
            if let Ok(Some(owner)) = self.registry.get(&src)
                && owner.agent_id != req.agent_id
            {
                return Err(FieldError {
                    field: "results[].tuple.src_gid".into(),
                    detail: format!(
                        "{src} is agent {:?}'s RNIC, not {:?}'s",
                        owner.agent_id, req.agent_id
                    ),
                });
            }
        }
        for r in &records {
            let status = match r.outcome {
                Outcome::Ok => "ok",
                Outcome::Timeout => "timeout",
                Outcome::SendFailed => "send_failed",
            };
            metrics::counter!("pingmesh_probes_total", "status" => status).increment(1);
            if r.outcome == Outcome::Ok {
                metrics::histogram!("pingmesh_network_rtt_seconds").record(r.rtt_ns as f64 / 1e9);
            }
        }
        let n = records.len() as u32;
        if let Some((log, _)) = &self.log
            && let Err(e) = log.append(&records)
        {
            // The analysis goes on from memory; only a restart would miss these.
            metrics::counter!("pingmesh_analyzer_log_errors_total").increment(1);
            tracing::warn!(error = %e, "analyzer results not written to disk");
        }
        let mut st = self.state.lock();
        let qpn = records.first().map_or_else(
            || st.agents.get(&req.agent_id).map_or(0, |a| a.1),
            |r| r.src_qpn,
        );
        st.agents.insert(req.agent_id.clone(), (now, qpn));
        st.records.extend(records);
        st.paths.extend(traced);
        self.prune(&mut st, now);
        drop(st);
        *self.last.lock() = None;
        self.prune_disk(now);
        Ok(n)
    }

    /// Removes what left the window from disk, once a second at most (a delete per
    /// upload would cost more than the rows it removes); never under the state lock.
    fn prune_disk(&self, now: u64) {
        let cutoff = now.saturating_sub(self.policy.window.as_millis() as u64);
        if let Some((log, pruned)) = &self.log
            && now.saturating_sub(pruned.load(std::sync::atomic::Ordering::Relaxed)) >= 1_000
        {
            pruned.store(now, std::sync::atomic::Ordering::Relaxed);
            if let Err(e) = log.prune(cutoff) {
                tracing::warn!(error = %e, "old analyzer results not removed from disk");
            }
        }
    }

    fn prune(&self, st: &mut State, now: u64) {
        let cutoff = now.saturating_sub(self.policy.window.as_millis() as u64);
        st.paths.retain(|_, t| t.at_ms >= cutoff);
        while st
            .records
            .front()
            .is_some_and(|r| r.at_ms < cutoff || st.records.len() > self.max_records)
        {
            st.records.pop_front();
        }
    }

    /// What the window says now.
    pub fn report(&self) -> Report {
        let now = now_ms(&self.clock);
        if let Some((at, report)) = &*self.last.lock()
            && now.saturating_sub(*at) < REPORT_FRESH_MS
        {
            return report.clone();
        }
        let report = self.analyze(now);
        export(&report);
        *self.last.lock() = Some((now, report.clone()));
        report
    }

    fn analyze(&self, now: u64) -> Report {
        let (records, agents, traced) = {
            let mut st = self.state.lock();
            self.prune(&mut st, now);
            (
                st.records.iter().cloned().collect::<Vec<_>>(),
                st.agents.clone(),
                st.paths.clone(),
            )
        };
        let registry: Vec<Rnic> = self.registry.all().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "analyzer: registry unreadable; no topology");
            Vec::new()
        });
        Analysis::new(&self.policy, now, &records, &agents, &registry, &traced).report()
    }
}

/// The analysis as gauges, for a real TSDB: the cluster's SLA, problems by kind,
/// unreachable nodes, and every probed pair's median RTT and drop rate.
fn export(r: &Report) {
    metrics::gauge!("pingmesh_cluster_rtt_p50_seconds").set(r.cluster.rtt_p50_us / 1e6);
    metrics::gauge!("pingmesh_cluster_rtt_p99_seconds").set(r.cluster.rtt_p99_us / 1e6);
    metrics::gauge!("pingmesh_cluster_drop_rate").set(r.cluster.drop_rate);
    metrics::gauge!("pingmesh_unreachable_nodes").set(r.unreachable.len() as f64);
    for kind in ProblemKind::ALL {
        let n = r.problems.iter().filter(|p| p.kind == kind).count();
        metrics::gauge!("pingmesh_problems", "kind" => kind.name()).set(n as f64);
    }
    for (i, src) in r.heatmap.nodes.iter().enumerate() {
        for (j, dst) in r.heatmap.nodes.iter().enumerate() {
            if let Some(c) = &r.heatmap.cells[i][j] {
                let labels = [("src", src.clone()), ("dst", dst.clone())];
                metrics::gauge!("pingmesh_pair_rtt_p50_seconds", &labels).set(c.rtt_p50_us / 1e6);
                metrics::gauge!("pingmesh_pair_drop_rate", &labels).set(c.drop_rate);
            }
        }
    }
}

/// One analysis of a window.
struct Analysis<'a> {
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
    fn new(
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

    fn report(&self) -> Report {
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

#[cfg(test)]
mod tests;

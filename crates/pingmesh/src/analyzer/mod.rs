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

mod analysis;
pub mod log;
pub mod paths;
mod record;
pub mod service;
pub mod stats;
pub mod vote;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use dpumesh_clock::SharedClock;
use dpumesh_dpa::fabric::ud::Gid;
use parking_lot::Mutex;
use serde::Serialize;

use crate::convert::FieldError;
use crate::proto;
use crate::registry::{Rnic, RnicStore};
use analysis::Analysis;
pub use record::{Kind, Outcome, Record};
use stats::Sla;

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

#[cfg(test)]
mod tests;

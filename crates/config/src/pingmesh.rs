//! The mesh file's `pingmesh` section: R-Pingmesh (`dpumesh-pingmesh`). Every node
//! runs an agent when it is present; `dpumesh up` runs the controller and analyzer
//! (`dpumesh pingmesh`) unless `controller` names one elsewhere.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::units::Span;

/// The `pingmesh` section.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PingmeshConfig {
    /// Where the controller and analyzer serve gRPC (what `dpumesh pingmesh` binds
    /// and the agents dial).
    pub listen: SocketAddr,
    /// The analyzer's JSON API and the dashboard.
    pub http: SocketAddr,
    /// `http://HOST:PORT` (`https://` with `tls`) of a controller/analyzer run
    /// elsewhere (then `dpumesh up` runs none and agents dial this).
    pub controller: Option<String>,
    /// Mutual TLS on the gRPC APIs with the mesh CA's certificates: agents prove
    /// their node's identity, the server the Pingmesh identity (default: on when
    /// `identity.mtls` is; resolved when the file is read).
    pub tls: Option<bool>,
    /// The registry's SQLite file, relative to the mesh file (default
    /// `.dpumesh/pingmesh.db`).
    pub registry: Option<PathBuf>,
    /// One probe per target this often (default 100ms).
    pub interval: Option<Span>,
    /// A probe unanswered this long is a timeout (default 500ms).
    pub timeout: Option<Span>,
    /// RNICs probed under each other ToR (default 2).
    pub inter_tor_targets: Option<u32>,
    /// RNICs of a ToR that probe each other ToR (default 2): a ToR's RNICs share the
    /// other ToRs out.
    pub inter_tor_probers: Option<u32>,
    /// Other ToRs one RNIC probes in a rotation, at most (default 16): past it the
    /// ToRs take turns over rotations.
    pub inter_tor_tors: Option<u32>,
    /// Equal-cost paths between two ToRs (default 4).
    pub ecmp_paths: Option<u32>,
    /// Probability that an inter-ToR target's 5-tuples cover every path (default 0.99).
    pub coverage: Option<f64>,
    /// New 5-tuples this often (default 5m).
    pub rotate_every: Option<Span>,
    /// Registrations not renewed this long expire (default 30s).
    pub ttl: Option<Span>,
    /// The analyzer's window (default 60s).
    pub window: Option<Span>,
    /// An agent silent this long is a host fault (default 5s).
    pub silence: Option<Span>,
    /// A network RTT above this is abnormal (default 1ms).
    pub slow_rtt: Option<Span>,
    /// Agents upload this often (default 1s).
    pub upload_every: Option<Span>,
    /// Agents trace the paths to their targets this often (default 30s).
    pub trace_every: Option<Span>,
}

impl PingmeshConfig {
    pub fn interval(&self) -> Duration {
        self.interval.map_or(Duration::from_millis(100), |s| s.0)
    }
    pub fn timeout(&self) -> Duration {
        self.timeout.map_or(Duration::from_millis(500), |s| s.0)
    }
    pub fn inter_tor_targets(&self) -> usize {
        self.inter_tor_targets.unwrap_or(2) as usize
    }
    pub fn inter_tor_probers(&self) -> usize {
        self.inter_tor_probers.unwrap_or(2) as usize
    }
    pub fn inter_tor_tors(&self) -> usize {
        self.inter_tor_tors.unwrap_or(16) as usize
    }
    pub fn ecmp_paths(&self) -> u32 {
        self.ecmp_paths.unwrap_or(4)
    }
    pub fn coverage(&self) -> f64 {
        self.coverage.unwrap_or(0.99)
    }
    pub fn rotate_every(&self) -> Duration {
        self.rotate_every.map_or(Duration::from_secs(300), |s| s.0)
    }
    pub fn ttl(&self) -> Duration {
        self.ttl.map_or(Duration::from_secs(30), |s| s.0)
    }
    pub fn window(&self) -> Duration {
        self.window.map_or(Duration::from_secs(60), |s| s.0)
    }
    pub fn silence(&self) -> Duration {
        self.silence.map_or(Duration::from_secs(5), |s| s.0)
    }
    pub fn slow_rtt(&self) -> Duration {
        self.slow_rtt.map_or(Duration::from_millis(1), |s| s.0)
    }
    pub fn upload_every(&self) -> Duration {
        self.upload_every.map_or(Duration::from_secs(1), |s| s.0)
    }
    pub fn trace_every(&self) -> Duration {
        self.trace_every.map_or(Duration::from_secs(30), |s| s.0)
    }
    /// Whether the gRPC APIs run over mutual TLS.
    pub fn tls(&self) -> bool {
        self.tls.unwrap_or(false)
    }

    /// The URL agents dial.
    pub fn controller_url(&self) -> String {
        let scheme = if self.tls() { "https" } else { "http" };
        self.controller
            .clone()
            .unwrap_or_else(|| format!("{scheme}://{}", self.listen))
    }

    /// Checks the bounds; the key and a message.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let ms = Duration::from_millis;
        if !(ms(1)..=Duration::from_secs(60)).contains(&self.interval()) {
            return Err(("pingmesh.interval", "must be 1ms to 60s".into()));
        }
        if !(ms(1)..=Duration::from_secs(60)).contains(&self.timeout()) {
            return Err(("pingmesh.timeout", "must be 1ms to 60s".into()));
        }
        if self.trace_every() < ms(500) {
            return Err((
                "pingmesh.trace_every",
                "at least 500ms (a round listens 400ms)".into(),
            ));
        }
        if !(1..=256).contains(&self.ecmp_paths()) {
            return Err(("pingmesh.ecmp_paths", "must be 1 to 256".into()));
        }
        if !(0.0..1.0).contains(&self.coverage()) {
            return Err(("pingmesh.coverage", "must be at least 0 and below 1".into()));
        }
        if self.inter_tor_targets() > 1024 {
            return Err(("pingmesh.inter_tor_targets", "at most 1024".into()));
        }
        if !(1..=1024).contains(&self.inter_tor_probers()) {
            return Err(("pingmesh.inter_tor_probers", "must be 1 to 1024".into()));
        }
        if !(1..=4096).contains(&self.inter_tor_tors()) {
            return Err(("pingmesh.inter_tor_tors", "must be 1 to 4096".into()));
        }
        if self.ttl() < self.upload_every() * 2 || self.ttl() < ms(300) {
            return Err((
                "pingmesh.ttl",
                "must be at least 300ms and twice upload_every".into(),
            ));
        }
        if self.silence() < self.upload_every() * 2 {
            return Err((
                "pingmesh.silence",
                "must be at least twice upload_every (or every agent looks down)".into(),
            ));
        }
        if let Some(c) = &self.controller {
            let want = if self.tls() { "https://" } else { "http://" };
            if !c.starts_with(want) {
                return Err((
                    "pingmesh.controller",
                    format!(
                        "{c:?} is not an {want} URL (the gRPC APIs run {} TLS)",
                        if self.tls() { "over" } else { "without" }
                    ),
                ));
            }
        }
        Ok(())
    }
}

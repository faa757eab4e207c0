//! The controller: the RNIC registry, pinglists, target lookups —
//! [`Controller`] is the logic with time injected, [`ControllerService`] its gRPC
//! face.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use dpumesh_dpa::fabric::ud::Gid;
use parking_lot::Mutex;

use dpumesh_clock::SharedClock;
use tonic::{Request, Response, Status};

use crate::convert;
use crate::pinglist::{self, ListKind, PinglistPolicy, Target};
use crate::proto;
use crate::registry::{RnicStore, StoreError};

/// Why a controller call failed.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("invalid request: {0}")]
    Invalid(#[from] convert::FieldError),
    #[error("no RNIC {0} is registered (or its registration expired)")]
    NotFound(String),
    #[error(
        "RNIC {gid} is agent {owner:?}'s (registered {age_ms} ms ago): another agent may take it once that expires"
    )]
    Taken {
        gid: String,
        owner: String,
        age_ms: u64,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<ControllerError> for Status {
    fn from(e: ControllerError) -> Self {
        match &e {
            ControllerError::Invalid(_) => Status::invalid_argument(e.to_string()),
            ControllerError::NotFound(_) => Status::not_found(e.to_string()),
            ControllerError::Taken { .. } => Status::already_exists(e.to_string()),
            ControllerError::Store(_) => Status::internal(e.to_string()),
        }
    }
}

/// A pinglist as the controller hands it out.
#[derive(Debug, Clone, PartialEq)]
pub struct Pinglist {
    pub targets: Vec<Target>,
    pub interval: Duration,
    pub timeout: Duration,
    pub generation: u64,
}

/// The registry as pinglists read it: grouped by ToR, indexed by GID. Rebuilt from
/// the store only when an RNIC appears, changes or expires — a refresh that only
/// renews a registration leaves it as it is — so pinglists do not read the database.
#[derive(Debug, Default)]
struct Topology {
    by_tor: BTreeMap<String, Vec<crate::registry::Rnic>>,
    by_gid: HashMap<Gid, (String, usize)>,
}

impl Topology {
    fn build(all: Vec<crate::registry::Rnic>) -> Self {
        let mut t = Topology::default();
        for r in all {
            t.by_tor.entry(r.tor_id.clone()).or_default().push(r);
        }
        for (tor, rnics) in &t.by_tor {
            for (i, r) in rnics.iter().enumerate() {
                t.by_gid.insert(r.gid, (tor.clone(), i));
            }
        }
        t
    }

    fn get(&self, gid: &Gid) -> Option<&crate::registry::Rnic> {
        let (tor, i) = self.by_gid.get(gid)?;
        self.by_tor.get(tor)?.get(*i)
    }

    /// Whether `r` is already known exactly so (its timestamp aside).
    fn knows(&self, r: &crate::registry::Rnic) -> bool {
        self.get(&r.gid).is_some_and(|k| {
            (
                k.qpn,
                k.qkey,
                k.udp_port,
                k.rnic_ip,
                &k.agent_id,
                &k.agent_ip,
                &k.tor_id,
            ) == (
                r.qpn,
                r.qkey,
                r.udp_port,
                r.rnic_ip,
                &r.agent_id,
                &r.agent_ip,
                &r.tor_id,
            )
        })
    }
}

/// The controller's logic.
pub struct Controller {
    store: Arc<dyn RnicStore>,
    clock: SharedClock,
    policy: PinglistPolicy,
    /// Registrations older than this expire.
    ttl: Duration,
    topology: Mutex<Arc<Topology>>,
    /// The store changed in a way the topology does not show yet.
    stale: AtomicBool,
    /// When expired registrations were last removed (Unix ms).
    expired_at: AtomicU64,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("policy", &self.policy)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl Controller {
    pub fn new(
        store: Arc<dyn RnicStore>,
        clock: SharedClock,
        policy: PinglistPolicy,
        ttl: Duration,
    ) -> Self {
        Self {
            store,
            clock,
            policy,
            ttl,
            topology: Mutex::new(Arc::new(Topology::default())),
            stale: AtomicBool::new(true),
            expired_at: AtomicU64::new(0),
        }
    }

    /// The topology, rebuilt first if the store changed.
    fn topology(&self) -> Result<Arc<Topology>, StoreError> {
        let mut t = self.topology.lock();
        if self.stale.swap(false, Ordering::AcqRel) {
            *t = Arc::new(Topology::build(self.store.all()?));
        }
        Ok(t.clone())
    }

    fn now_ms(&self) -> u64 {
        self.clock.wall_ns() / 1_000_000
    }

    /// Drops what expired, so no list names a host that stopped re-registering:
    /// at most once per twentieth of the TTL (a list may name a host up to that much
    /// past its expiry), not on every request.
    fn expire(&self) -> Result<(), StoreError> {
        let now = self.now_ms();
        let every = (self.ttl.as_millis() as u64 / 20).max(1);
        let last = self.expired_at.load(Ordering::Relaxed);
        if now.saturating_sub(last) < every
            || self
                .expired_at
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return Ok(());
        }
        let cutoff = now.saturating_sub(self.ttl.as_millis() as u64);
        let gone = self.store.expire(cutoff)?;
        if gone > 0 {
            self.stale.store(true, Ordering::Release);
            tracing::info!(gone, "RNIC registrations expired");
        }
        Ok(())
    }

    /// Registers (or refreshes) an agent's RNICs; how many.
    pub fn register(&self, req: &proto::AgentRegistrationRequest) -> Result<u32, ControllerError> {
        let now = self.now_ms();
        let mut rnics = Vec::with_capacity(req.rnics.len());
        for (i, info) in req.rnics.iter().enumerate() {
            let r = convert::rnic_from(info, &format!("rnics[{i}]"), now)?;
            if !req.agent_id.is_empty() && r.agent_id != req.agent_id {
                return Err(convert::FieldError {
                    field: format!("rnics[{i}].agent_id"),
                    detail: format!(
                        "{:?} is not the registering agent {:?}",
                        r.agent_id, req.agent_id
                    ),
                }
                .into());
            }
            // A GID names one RNIC: a live registration is its agent's alone (with
            // TLS the agent's name is proven, so no node takes another's GID).
            if let Some(old) = self.store.get(&r.gid)?
                && old.agent_id != r.agent_id
                && now.saturating_sub(old.last_updated_ms) < self.ttl.as_millis() as u64
            {
                return Err(ControllerError::Taken {
                    gid: r.gid.to_string(),
                    owner: old.agent_id,
                    age_ms: now.saturating_sub(old.last_updated_ms),
                });
            }
            rnics.push(r);
        }
        let known = self.topology.lock().clone();
        for r in &rnics {
            self.store.upsert(r)?;
            if !known.knows(r) {
                self.stale.store(true, Ordering::Release);
            }
        }
        metrics::counter!("pingmesh_controller_registrations_total").increment(1);
        Ok(rnics.len() as u32)
    }

    /// The pinglist of the RNIC `gid`.
    pub fn pinglist(&self, gid: &str, kind: ListKind) -> Result<Pinglist, ControllerError> {
        let gid = convert::gid("gid", gid)?;
        self.expire()?;
        let topology = self.topology()?;
        let prober = topology
            .get(&gid)
            .ok_or_else(|| ControllerError::NotFound(gid.to_string()))?;
        let generation = self.policy.generation(self.now_ms());
        let targets = match kind {
            ListKind::TorMesh => pinglist::tor_mesh(
                prober,
                topology
                    .by_tor
                    .get(&prober.tor_id)
                    .map_or(&[][..], Vec::as_slice),
                generation,
            ),
            ListKind::InterTor => pinglist::inter_tor_grouped(
                prober,
                topology.by_tor.values().map(Vec::as_slice),
                &self.policy,
                generation,
            ),
        };
        Ok(Pinglist {
            targets,
            interval: self.policy.interval,
            timeout: self.policy.timeout,
            generation,
        })
    }

    /// The RNIC with this GID or IP.
    pub fn target(
        &self,
        req: &proto::TargetRnicInfoRequest,
    ) -> Result<proto::RnicInfo, ControllerError> {
        self.expire()?;
        let found = if !req.gid.is_empty() {
            self.topology()?
                .get(&convert::gid("gid", &req.gid)?)
                .cloned()
        } else if !req.ip.is_empty() {
            self.store.by_ip(convert::ip("ip", &req.ip)?)?
        } else {
            return Err(convert::FieldError {
                field: "gid".into(),
                detail: "give a gid or an ip".into(),
            }
            .into());
        };
        let name = if req.gid.is_empty() {
            &req.ip
        } else {
            &req.gid
        };
        found
            .map(|r| convert::rnic_to(&r))
            .ok_or_else(|| ControllerError::NotFound(name.clone()))
    }

    /// How long registrations live.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }
}

/// The RNIC a node of the mesh file has, and its ToR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownRnic {
    pub ip: std::net::IpAddr,
    pub tor: String,
}

/// The controller's gRPC service.
#[derive(Debug, Clone)]
pub struct ControllerService {
    controller: Arc<Controller>,
    /// With TLS, the RNIC each node may register (from the mesh file); empty: any.
    known: Arc<std::collections::BTreeMap<String, KnownRnic>>,
    /// Served over TLS only: a request without a proven caller is refused.
    tls: bool,
}

impl ControllerService {
    pub fn new(controller: Arc<Controller>) -> Self {
        Self {
            controller,
            known: Arc::default(),
            tls: false,
        }
    }

    /// Served over mutual TLS only.
    pub fn with_tls(mut self, tls: bool) -> Self {
        self.tls = tls;
        self
    }

    /// Lets a caller whose certificate names node `n` register `known[n]` only (its
    /// address as the GID, its ToR): a node cannot put RNICs into the registry that
    /// are not its own. Applies to TLS callers (the only proven ones).
    pub fn with_known(mut self, known: std::collections::BTreeMap<String, KnownRnic>) -> Self {
        self.known = Arc::new(known);
        self
    }

    fn check_known(
        &self,
        request: &Request<proto::AgentRegistrationRequest>,
    ) -> Result<(), Status> {
        let Some(caller) = request.extensions().get::<crate::tls::Caller>() else {
            return Ok(());
        };
        if self.known.is_empty() {
            return Ok(());
        }
        let node = caller.node();
        let Some(known) = self.known.get(node) else {
            return Err(Status::permission_denied(format!(
                "node {node:?} is not in the mesh file"
            )));
        };
        for (i, r) in request.get_ref().rnics.iter().enumerate() {
            let ip = convert::gid(&format!("rnics[{i}].gid"), &r.gid)
                .map_err(|e| Status::invalid_argument(e.to_string()))?
                .ip();
            if ip != known.ip || r.tor_id != known.tor {
                return Err(Status::permission_denied(format!(
                    "rnics[{i}]: node {node:?} has RNIC {} under {:?}, not {ip} under {:?}",
                    known.ip, known.tor, r.tor_id
                )));
            }
        }
        Ok(())
    }

    /// The tonic server for it.
    pub fn server(self) -> proto::controller_service_server::ControllerServiceServer<Self> {
        proto::controller_service_server::ControllerServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl proto::controller_service_server::ControllerService for ControllerService {
    async fn register_agent(
        &self,
        request: Request<proto::AgentRegistrationRequest>,
    ) -> Result<Response<proto::AgentRegistrationResponse>, Status> {
        crate::tls::authorize(&request, &request.get_ref().agent_id, self.tls)?;
        self.check_known(&request)?;
        let registered = self.controller.register(request.get_ref())?;
        Ok(Response::new(proto::AgentRegistrationResponse {
            registered,
            ttl_ms: self.controller.ttl().as_millis() as u32,
        }))
    }

    async fn get_pinglist(
        &self,
        request: Request<proto::PinglistRequest>,
    ) -> Result<Response<proto::PinglistResponse>, Status> {
        let req = request.get_ref();
        let kind = match proto::PinglistKind::try_from(req.kind) {
            Ok(proto::PinglistKind::TorMesh) => ListKind::TorMesh,
            Ok(proto::PinglistKind::InterTor) => ListKind::InterTor,
            _ => {
                return Err(Status::invalid_argument(format!(
                    "kind: {} is not a pinglist kind (TOR_MESH or INTER_TOR)",
                    req.kind
                )));
            }
        };
        let list = self.controller.pinglist(&req.gid, kind)?;
        Ok(Response::new(proto::PinglistResponse {
            targets: list.targets.iter().map(convert::target_to).collect(),
            interval_ms: list.interval.as_millis() as u32,
            timeout_ms: list.timeout.as_millis() as u32,
            generation: list.generation,
        }))
    }

    async fn get_target_rnic_info(
        &self,
        request: Request<proto::TargetRnicInfoRequest>,
    ) -> Result<Response<proto::TargetRnicInfoResponse>, Status> {
        let rnic = self.controller.target(request.get_ref())?;
        Ok(Response::new(proto::TargetRnicInfoResponse {
            rnic: Some(rnic),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::contract::rnic;
    use crate::registry::memory::MemoryStore;
    use dpumesh_clock::ManualClock;

    fn registration(n: u8, tor: &str) -> proto::AgentRegistrationRequest {
        let r = rnic(n, tor, 0);
        proto::AgentRegistrationRequest {
            agent_id: r.agent_id.clone(),
            rnics: vec![convert::rnic_to(&r)],
        }
    }

    fn controller() -> (Controller, Arc<ManualClock>) {
        let clock = ManualClock::at_unix_secs(1_700_000_000);
        let c = Controller::new(
            Arc::new(MemoryStore::new()),
            clock.clone(),
            PinglistPolicy::default(),
            Duration::from_secs(30),
        );
        (c, clock)
    }

    #[test]
    fn registered_rnics_get_their_tor_mesh_and_inter_tor_lists() {
        let (c, _) = controller();
        for (n, tor) in [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "b")] {
            assert_eq!(c.register(&registration(n, tor)).unwrap(), 1);
        }
        let me = rnic(1, "a", 0).gid.to_string();
        let mesh = c.pinglist(&me, ListKind::TorMesh).unwrap();
        assert_eq!(mesh.targets.len(), 2);
        assert_eq!(mesh.interval, PinglistPolicy::default().interval);
        // Two of a's three RNICs probe b (`inter_tor_probers`), and both of b's probe a.
        let probing = |tor: &str, range: std::ops::RangeInclusive<u8>| {
            range
                .filter(|&n| {
                    let gid = rnic(n, tor, 0).gid.to_string();
                    let inter = c.pinglist(&gid, ListKind::InterTor).unwrap();
                    assert!(inter.targets.iter().all(|t| t.rnic.tor_id != tor));
                    !inter.targets.is_empty()
                })
                .count()
        };
        assert_eq!(probing("a", 1..=3), 2);
        assert_eq!(probing("b", 4..=5), 2);
    }

    #[test]
    fn a_host_that_stops_registering_leaves_the_lists() {
        let (c, clock) = controller();
        c.register(&registration(1, "a")).unwrap();
        c.register(&registration(2, "a")).unwrap();
        clock.advance_secs(20);
        c.register(&registration(1, "a")).unwrap();
        clock.advance_secs(20);
        let me = rnic(1, "a", 0).gid.to_string();
        assert!(
            c.pinglist(&me, ListKind::TorMesh)
                .unwrap()
                .targets
                .is_empty()
        );
        let gone = proto::TargetRnicInfoRequest {
            gid: rnic(2, "a", 0).gid.to_string(),
            ip: String::new(),
        };
        assert!(matches!(c.target(&gone), Err(ControllerError::NotFound(_))));
    }

    #[test]
    fn targets_are_found_by_gid_or_ip() {
        let (c, _) = controller();
        c.register(&registration(3, "a")).unwrap();
        let by_ip = c
            .target(&proto::TargetRnicInfoRequest {
                gid: String::new(),
                ip: "10.0.0.3".into(),
            })
            .unwrap();
        assert_eq!(by_ip.qpn, 103);
        let err = c
            .target(&proto::TargetRnicInfoRequest::default())
            .unwrap_err();
        assert!(err.to_string().contains("give a gid or an ip"), "{err}");
    }

    #[test]
    fn bad_requests_are_refused_with_the_field() {
        let (c, _) = controller();
        let mut r = registration(1, "a");
        r.rnics[0].qpn = 0;
        let err = Status::from(c.register(&r).unwrap_err());
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("rnics[0].qpn"), "{}", err.message());
        let mut r = registration(1, "a");
        r.agent_id = "someone-else".into();
        assert!(
            c.register(&r)
                .unwrap_err()
                .to_string()
                .contains("registering agent")
        );
        let err = Status::from(c.pinglist("10.0.0.99", ListKind::TorMesh).unwrap_err());
        assert_eq!(err.code(), tonic::Code::NotFound);
    }
    #[test]
    fn a_live_gid_is_its_agents_until_it_expires() {
        let (c, clock) = controller();
        c.register(&registration(1, "a")).unwrap();
        let mut thief = registration(1, "a");
        thief.agent_id = "other".into();
        thief.rnics[0].agent_id = "other".into();
        let err = Status::from(c.register(&thief).unwrap_err());
        assert_eq!(err.code(), tonic::Code::AlreadyExists);
        assert!(err.message().contains("\"node-1\"'s"), "{}", err.message());
        // Its owner refreshes it freely; once it lapses another agent may take it.
        clock.advance_secs(10);
        c.register(&registration(1, "a")).unwrap();
        clock.advance_secs(31);
        assert_eq!(c.register(&thief).unwrap(), 1);
    }
}

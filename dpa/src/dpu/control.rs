//! The node's side of the control channel: hosts register pods, resolve and locate
//! services, use the store; a closed connection reclaims its pods.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::control::transport::{Handler, Peer, StoreReply};
use crate::control::{ErrorCode, Request, Response, Role};

use super::DpuError;
use super::registry::Shared;

pub(super) struct ControlHandler(pub(super) Arc<Shared>);

impl Handler for ControlHandler {
    fn node_name(&self) -> String {
        self.0.config.name.clone()
    }

    fn handle(&self, peer: &Peer, request: Request) -> Response {
        self.answer(peer, request).0
    }

    fn handle_with_fds(&self, peer: &Peer, request: Request) -> (Response, Vec<OwnedFd>) {
        self.answer(peer, request)
    }

    fn handle_with_incoming(
        &self,
        peer: &Peer,
        request: Request,
        incoming: Vec<OwnedFd>,
    ) -> (Response, Vec<OwnedFd>) {
        match request {
            Request::AdoptPod {
                name,
                service,
                pid,
                token,
                regions,
            } => (
                self.adopt(peer, name, service, pid, token, *regions, incoming),
                Vec::new(),
            ),
            other => self.answer(peer, other),
        }
    }

    fn doorbell(&self, peer: &Peer, lane: u32) {
        // Only an agent's pods ring through it; anyone else's doorbell is a no-op
        // (ringing a bell costs a shard at most one look at its pods).
        if peer.role == Role::Host
            && let Some(shard) = self.0.shards.get(lane as usize)
        {
            // Always the eventfd, not `ring` (which writes only to a shard that said it
            // sleeps): the shard judges whether it may sleep by its mirrors, which do
            // not show what the pod published until its next pull, so a doorbell that
            // came between that pull and its `sleep_begins` would otherwise be lost
            // and the shard sleep with work waiting. The eventfd keeps it.
            shard.bell.interrupt();
        }
    }

    fn handle_store(&self, peer: &Peer, message: Vec<u8>, fds: Vec<OwnedFd>, reply: StoreReply) {
        let Some(store) = &self.0.config.store else {
            return reply.refuse(
                ErrorCode::BadRequest,
                "this node runs no BlueCache store (no `store:` in the mesh file)",
            );
        };
        // A service's keys are its own: a client acts for the service it proved.
        match &peer.service {
            Some(service) => store.handle(peer.id, service, message, fds, reply),
            None => reply.refuse(
                ErrorCode::Unauthorized,
                "a store client proves its service first (Authenticate, with the token a pod registers with: DPUMESH_SERVICE, DPUMESH_TOKEN)",
            ),
        }
    }

    fn authenticate(
        &self,
        peer: &Peer,
        service: &str,
        token: Option<&str>,
    ) -> Result<(), Response> {
        self.check_token(peer, "authenticate", service, token)
    }

    fn disconnected(&self, peer: &Peer) {
        if let Some(store) = &self.0.config.store {
            store.disconnected(peer.id);
        }
        let ids: Vec<u32> = self
            .0
            .pods
            .lock()
            .values()
            .filter(|p| p.peer == peer.id)
            .map(|p| p.id)
            .collect();
        for id in ids {
            tracing::info!(pod = id, peer = %peer.name, "control connection closed: reclaiming the pod");
            self.0.remove(id);
        }
    }
}

impl ControlHandler {
    /// A host agent's pod: its token checked as a registration's, then its regions.
    #[allow(clippy::too_many_arguments)]
    fn adopt(
        &self,
        peer: &Peer,
        name: String,
        service: String,
        pid: u32,
        token: Option<String>,
        regions: crate::control::AgentRegions,
        incoming: Vec<OwnedFd>,
    ) -> Response {
        if let Err(refusal) = self.check_token(peer, &name, &service, token.as_deref()) {
            tracing::warn!(pod = name, service, pid, agent = %peer.name, "refused a host agent's pod");
            return refusal;
        }
        let pod = super::adopt::Adoption {
            name,
            service,
            pid,
            regions,
        };
        match self.0.adopt(peer, pod, incoming) {
            Ok((pod_id, pools)) => Response::PodAdopted { pod_id, pools },
            Err(DpuError::Limit(message)) => Response::Error {
                code: if message.contains("registered already") {
                    ErrorCode::AlreadyRegistered
                } else {
                    ErrorCode::Exhausted
                },
                message,
            },
            Err(e @ (DpuError::Adopt(_) | DpuError::Shm(_))) => Response::Error {
                code: ErrorCode::BadRequest,
                message: e.to_string(),
            },
            Err(e) => Response::Error {
                code: ErrorCode::Internal,
                message: e.to_string(),
            },
        }
    }

    /// Ids of the pods serving `service` here, in order.
    fn pods_of(&self, service: &str) -> Vec<u32> {
        let mut pods: Vec<u32> = self
            .0
            .pods
            .lock()
            .values()
            .filter(|p| p.service == service && !p.leaving)
            .map(|p| p.id)
            .collect();
        pods.sort_unstable();
        pods
    }

    /// Whether `peer` (a host) may act for `service`: with a registration key, only
    /// with `service`'s token. `who` names it in the refusal.
    fn check_token(
        &self,
        peer: &Peer,
        who: &str,
        service: &str,
        token: Option<&str>,
    ) -> Result<(), Response> {
        if peer.role != Role::Host {
            return Err(Response::Error {
                code: ErrorCode::BadRequest,
                message: "only hosts act for services".to_owned(),
            });
        }
        // A peer that proved an identity (TCP's mutual TLS) acts for its workload's
        // service only.
        if let Some(id) = &peer.identity {
            let theirs = self
                .0
                .config
                .workload_prefix
                .as_deref()
                .is_some_and(|prefix| id.to_string() == format!("{prefix}{service}"));
            if !theirs {
                return Err(Response::Error {
                    code: ErrorCode::Unauthorized,
                    message: format!("{who} proved {id}, which is not the workload of {service}"),
                });
            }
        }
        if let Some(key) = &self.0.config.registration
            && !token.is_some_and(|t| key.verify(service, t))
        {
            let why = if token.is_none() {
                "no registration token (DPUMESH_TOKEN)"
            } else {
                "a registration token that does not prove the service"
            };
            return Err(Response::Error {
                code: ErrorCode::Unauthorized,
                message: format!("{who} cannot act as {service}: {why}"),
            });
        }
        Ok(())
    }

    /// The answer, and the serving shard's bell eventfd with a registration.
    fn answer(&self, peer: &Peer, request: Request) -> (Response, Vec<OwnedFd>) {
        if matches!(request, Request::AdoptPod { .. }) {
            // Over Comch (no descriptors: the regions come as their exports).
            return self.handle_with_incoming(peer, request, Vec::new());
        }
        if let Request::RegisterPod {
            name,
            service,
            pid,
            token,
        } = request
        {
            if let Err(refusal) = self.check_token(peer, &name, &service, token.as_deref()) {
                tracing::warn!(pod = name, service, pid, "refused a registration");
                return (refusal, Vec::new());
            }
            return match self.0.register(peer, name, service, pid) {
                Ok((exports, regions)) => {
                    // Every shard's bell eventfd, in lane order, then the regions.
                    let bells = self
                        .0
                        .shards
                        .iter()
                        .map(|s| rustix::io::fcntl_dupfd_cloexec(s.bell.fd(), 0))
                        .collect::<Result<Vec<_>, _>>();
                    match bells {
                        Ok(mut fds) => {
                            fds.extend(regions);
                            (Response::PodRegistered(Box::new(exports)), fds)
                        }
                        Err(e) => {
                            self.0.remove(exports.pod_id);
                            (
                                Response::Error {
                                    code: ErrorCode::Internal,
                                    message: format!("cannot pass the pod its bells: {e}"),
                                },
                                Vec::new(),
                            )
                        }
                    }
                }
                Err(DpuError::Limit(message)) => (
                    Response::Error {
                        code: if message.contains("registered already") {
                            ErrorCode::AlreadyRegistered
                        } else {
                            ErrorCode::Exhausted
                        },
                        message,
                    },
                    Vec::new(),
                ),
                Err(e) => (
                    Response::Error {
                        code: ErrorCode::Internal,
                        message: e.to_string(),
                    },
                    Vec::new(),
                ),
            };
        }
        let response = match request {
            Request::Hello { .. } => Response::Ok,
            // Served by `handle_store` and `authenticate`, which the transport calls
            // for them.
            Request::Store(_) | Request::Authenticate { .. } => Response::Error {
                code: ErrorCode::Internal,
                message: "a store message took the wrong path".to_owned(),
            },
            Request::Ping => Response::Pong,
            Request::PodShape => Response::PodShape(self.0.shape()),
            // Answered above (over Comch: with no descriptors, their exports).
            Request::AdoptPod { .. } => Response::Error {
                code: ErrorCode::Internal,
                message: "an adoption took the wrong path".to_owned(),
            },
            // Not answered (the transports route it to `doorbell`).
            Request::Doorbell { lane } => {
                self.doorbell(peer, lane);
                Response::Ok
            }
            Request::Resolve { service } => Response::Resolved {
                pods: self.pods_of(&service),
            },
            Request::Locate { service } => {
                let pods = self.pods_of(&service);
                let remote = if pods.is_empty() {
                    self.0
                        .config
                        .remote_services
                        .get(&service)
                        .map(|a| a.to_string())
                } else {
                    None
                };
                Response::Located { pods, remote }
            }
            // Registrations are answered above, with their descriptors.
            Request::RegisterPod { .. } => Response::Error {
                code: ErrorCode::Internal,
                message: "registration took the wrong path".to_owned(),
            },
            Request::UnregisterPod { pod_id } => {
                let owned = self
                    .0
                    .pods
                    .lock()
                    .get(&pod_id)
                    .is_some_and(|p| p.peer == peer.id);
                if owned && self.0.remove(pod_id) {
                    Response::Ok
                } else {
                    Response::Error {
                        code: ErrorCode::UnknownPod,
                        message: format!("pod {pod_id} is not registered by this connection"),
                    }
                }
            }
        };
        (response, Vec::new())
    }
}

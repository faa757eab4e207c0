//! The pod's side of the control channel: a blocking client that says Hello,
//! registers, exports and asks, over a Unix socket or TCP with mutual TLS.

use super::*;

/// A blocking control-channel client.
#[derive(Debug)]
pub struct ControlClient {
    stream: Stream,
    next_id: u32,
    node: String,
    teardown: Option<String>,
    /// Descriptors that came with answers, not taken yet.
    fds: Vec<OwnedFd>,
}

impl ControlClient {
    /// Connects and says Hello. Over TCP (mutual TLS only), this side proves the
    /// workload whose certificates are in the folder `DPUMESH_CERTS` names (its Secret:
    /// `ca.pem`, `workload.pem`, `workload.key`).
    pub fn connect(endpoint: &Endpoint, role: Role, name: &str) -> Result<Self, ControlError> {
        let tls = match endpoint {
            Endpoint::Unix(_) => None,
            Endpoint::Tcp(_) => {
                let dir = std::env::var_os("DPUMESH_CERTS").ok_or_else(|| {
                    ControlError::Body(format!(
                        "the control channel on {endpoint} runs mutual TLS: set DPUMESH_CERTS to the folder of this workload's certificate (ca.pem, workload.pem, workload.key)"
                    ))
                })?;
                Some(
                    dpumesh_identity::MeshTls::load_workload(std::path::Path::new(&dir))
                        .map_err(|e| ControlError::Body(e.to_string()))?,
                )
            }
        };
        Self::connect_with_tls(endpoint, role, name, tls.as_deref())
    }

    /// [`Self::connect`], over mutual TLS on TCP when `tls` is given (the node must
    /// prove a node identity).
    pub fn connect_with_tls(
        endpoint: &Endpoint,
        role: Role,
        name: &str,
        tls: Option<&dpumesh_identity::MeshTls>,
    ) -> Result<Self, ControlError> {
        let stream = match endpoint {
            Endpoint::Unix(path) => Stream::Unix(UnixStream::connect(path)?),
            Endpoint::Tcp(addr) => {
                let s = TcpStream::connect(addr)?;
                s.set_nodelay(true)?;
                match tls {
                    Some(tls) => over_tls(s, tls, false)?.0,
                    // The node speaks TLS only, on TCP: a plain client cannot reach it.
                    None => Stream::Tcp(s),
                }
            }
        };
        let mut client = Self {
            stream,
            next_id: 1,
            node: String::new(),
            teardown: None,
            fds: Vec::new(),
        };
        match client.request(Request::Hello {
            role,
            name: name.to_owned(),
        })? {
            Response::Hello { node } => client.node = node,
            other => {
                return Err(ControlError::Body(format!(
                    "unexpected answer to Hello: {other:?}"
                )));
            }
        }
        Ok(client)
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// A second handle on the connection, to watch for the node hanging up (poll it
    /// for `POLLRDHUP`; never read from it: the answers are this client's).
    pub fn watch_fd(&self) -> std::io::Result<OwnedFd> {
        Ok(match &self.stream {
            Stream::Unix(s) => s.as_fd().try_clone_to_owned()?,
            Stream::Tcp(s) => s.as_fd().try_clone_to_owned()?,
        })
    }

    /// Why the DPU tore the connection down, if it did.
    pub fn teardown(&self) -> Option<&str> {
        self.teardown.as_deref()
    }

    /// Sends a request and waits for its answer; `Error` answers become
    /// [`ControlError::Refused`].
    pub fn request(&mut self, request: Request) -> Result<Response, ControlError> {
        self.request_with_fds(request, &[])
    }

    /// [`Self::request`], passing `fds` with it (a store buffer's memory): on the
    /// Unix socket only.
    pub fn request_with_fds(
        &mut self,
        request: Request,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Response, ControlError> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let sent = match (&mut self.stream, fds.is_empty()) {
            (_, true) => write_frame(&mut self.stream, &Frame::Request(id, request)),
            (Stream::Unix(s), false) => {
                let bytes = crate::encode(&Frame::Request(id, request));
                send_with_fds(s, &bytes, fds).map_err(ControlError::from)
            }
            (Stream::Tcp(_), false) => {
                return Err(ControlError::Body(
                    "descriptors (shared memory) pass only over the node's Unix control socket"
                        .to_owned(),
                ));
            }
        };
        if let Err(e) = sent {
            // A DPU that went away may have said why before closing.
            if let Ok(Frame::Response(0, Response::Teardown { reason })) =
                read_frame(&mut self.stream)
            {
                self.teardown = Some(reason.clone());
                return Err(ControlError::Refused {
                    code: ErrorCode::Internal,
                    message: format!("torn down: {reason}"),
                });
            }
            return Err(e);
        }
        let frame = match &mut self.stream {
            Stream::Unix(s) => read_frame(&mut FdReader {
                stream: s,
                fds: &mut self.fds,
            })?,
            other => read_frame(other)?,
        };
        match frame {
            Frame::Response(0, Response::Teardown { reason }) => {
                self.teardown = Some(reason.clone());
                Err(ControlError::Refused {
                    code: ErrorCode::Internal,
                    message: format!("torn down: {reason}"),
                })
            }
            Frame::Response(got, _) if got != id => {
                Err(ControlError::Unexpected { expected: id, got })
            }
            Frame::Response(_, Response::Error { code, message }) => {
                Err(ControlError::Refused { code, message })
            }
            Frame::Response(_, response) => Ok(response),
            Frame::Request(..) => Err(ControlError::Body("the DPU sent a request".to_owned())),
        }
    }

    /// Sends a BlueCache store message and waits for the agent's answer.
    pub fn store(&mut self, message: Vec<u8>) -> Result<Vec<u8>, ControlError> {
        self.store_with_fds(message, &[])
    }

    /// [`Self::store`], passing `fds` with it (a buffer's memory).
    pub fn store_with_fds(
        &mut self,
        message: Vec<u8>,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Vec<u8>, ControlError> {
        match self.request_with_fds(Request::Store(message), fds)? {
            Response::Store(answer) => Ok(answer),
            other => Err(ControlError::Body(format!(
                "a store message answered with {other:?}"
            ))),
        }
    }

    /// Descriptors that came with answers (a registration's bell eventfd), taken.
    pub fn take_fds(&mut self) -> Vec<OwnedFd> {
        std::mem::take(&mut self.fds)
    }

    /// Whether the channel is a Unix socket (the only kind that carries descriptors).
    pub fn is_local(&self) -> bool {
        matches!(self.stream, Stream::Unix(_))
    }

    /// Registers a pod (with its service's registration token, if it has one) and
    /// returns what to map.
    pub fn register_pod(
        &mut self,
        name: &str,
        service: &str,
        token: Option<&str>,
    ) -> Result<PodExports, ControlError> {
        match self.request(Request::RegisterPod {
            name: name.to_owned(),
            service: service.to_owned(),
            pid: std::process::id(),
            token: token.map(str::to_owned),
        })? {
            Response::PodRegistered(exports) => Ok(*exports),
            other => Err(ControlError::Body(format!(
                "unexpected answer to RegisterPod: {other:?}"
            ))),
        }
    }

    /// Unregisters a pod.
    pub fn unregister_pod(&mut self, pod_id: u32) -> Result<(), ControlError> {
        match self.request(Request::UnregisterPod { pod_id })? {
            Response::Ok => Ok(()),
            other => Err(ControlError::Body(format!(
                "unexpected answer to UnregisterPod: {other:?}"
            ))),
        }
    }

    /// The pods on the node that serve `service`.
    pub fn locate(
        &mut self,
        service: &str,
    ) -> Result<(Vec<u32>, Option<std::net::SocketAddr>), ControlError> {
        match self.request(Request::Locate {
            service: service.to_owned(),
        })? {
            Response::Located { pods, remote } => {
                let remote = match remote {
                    None => None,
                    Some(text) => Some(text.parse().map_err(|_| {
                        ControlError::Body(format!("Located names a bad address {text:?}"))
                    })?),
                };
                Ok((pods, remote))
            }
            other => Err(ControlError::Body(format!(
                "unexpected answer to Locate: {other:?}"
            ))),
        }
    }

    /// The pods on this node serving `service`.
    pub fn resolve(&mut self, service: &str) -> Result<Vec<u32>, ControlError> {
        match self.request(Request::Resolve {
            service: service.to_owned(),
        })? {
            Response::Resolved { pods } => Ok(pods),
            other => Err(ControlError::Body(format!(
                "unexpected answer to Resolve: {other:?}"
            ))),
        }
    }

    /// Round trip.
    pub fn ping(&mut self) -> Result<(), ControlError> {
        match self.request(Request::Ping)? {
            Response::Pong => Ok(()),
            other => Err(ControlError::Body(format!(
                "unexpected answer to Ping: {other:?}"
            ))),
        }
    }
}

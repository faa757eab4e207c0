//! Connection management through librdmacm: socket addresses, the events a connect
//! or an accept waits for, the queue pair attributes and connection parameters both
//! sides use, and the listener (which admits a connect request only with a valid
//! ticket in its private data, before a queue pair exists).

use super::*;

pub(super) fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            (
                storage,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            (
                storage,
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            )
        }
    }
}

/// A connection-manager event: its id, and the private data of a connect request.
pub(super) struct CmEvent {
    id: *mut sys::rdma_cm_id,
    private_data: Vec<u8>,
}

/// Waits for the next CM event on `channel` of `want` type (others are errors).
pub(super) fn expect_event(
    channel: *mut sys::rdma_event_channel,
    want: sys::rdma_cm_event_type::Type,
    timeout: Duration,
) -> Result<CmEvent, String> {
    // SAFETY: the channel's fd is valid while the channel lives.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw((*channel).fd) };
    let mut fds = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    let ts = rustix::fs::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    match rustix::event::poll(&mut fds, Some(&ts)) {
        Ok(0) => return Err(format!("no connection-manager event within {timeout:?}")),
        Ok(_) => {}
        Err(e) => return Err(e.to_string()),
    }
    let mut event = ptr::null_mut();
    // SAFETY: the channel is readable; the event is acknowledged before returning.
    unsafe {
        if sys::rdma_get_cm_event(channel, &mut event) != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        let kind = (*event).event;
        let id = (*event).id;
        let status = (*event).status;
        // Copied before the ack frees it; a connect request's parameters are `conn`.
        let private_data = if kind == sys::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
            let conn = &(*event).param.conn;
            if conn.private_data.is_null() {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    usize::from(conn.private_data_len),
                )
                .to_vec()
            }
        } else {
            Vec::new()
        };
        sys::rdma_ack_cm_event(event);
        if kind != want {
            let name = CStr::from_ptr(sys::rdma_event_str(kind)).to_string_lossy();
            return Err(format!("connection manager event {name} (status {status})"));
        }
        Ok(CmEvent { id, private_data })
    }
}

/// The IP address of the peer of a connection id.
///
/// # Safety
/// `id` must be a live connection id.
pub(super) unsafe fn peer_ip(id: *mut sys::rdma_cm_id) -> Option<IpAddr> {
    // SAFETY: the caller's promise; rdma_cm keeps the route's addresses in the id.
    let sa = unsafe { sys::rdma_get_peer_addr(&*id) };
    match i32::from(sa.sa_family) {
        libc::AF_INET => {
            // SAFETY: the family says it is a sockaddr_in.
            let sin = unsafe { &*(sa as *const libc::sockaddr).cast::<libc::sockaddr_in>() };
            Some(IpAddr::from(
                u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
            ))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says it is a sockaddr_in6.
            let sin6 = unsafe { &*(sa as *const libc::sockaddr).cast::<libc::sockaddr_in6>() };
            Some(IpAddr::from(sin6.sin6_addr.s6_addr))
        }
        _ => None,
    }
}

pub(super) fn qp_attr(cq: &CqHandle, caps: QpCaps) -> sys::ibv_qp_init_attr {
    // SAFETY: zeroed init attributes with the fields verbs needs set below.
    let mut attr: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    attr.send_cq = cq.cq;
    attr.recv_cq = cq.cq;
    attr.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
    attr.cap.max_send_wr = caps.max_send_wr;
    attr.cap.max_recv_wr = caps.max_recv_wr;
    attr.cap.max_send_sge = 1;
    attr.cap.max_recv_sge = 1;
    attr
}

pub(super) fn conn_param() -> sys::rdma_conn_param {
    // SAFETY: zeroed connection parameters, then the ones that matter.
    let mut p: sys::rdma_conn_param = unsafe { std::mem::zeroed() };
    p.responder_resources = 16;
    p.initiator_depth = 16;
    p.retry_count = 7;
    // Infinite receiver-not-ready retries: a missing receive holds the sender back.
    p.rnr_retry_count = 7;
    p
}

/// A listener through rdma_cm.
#[derive(Debug)]
pub struct VerbsListener {
    pub(super) id: *mut sys::rdma_cm_id,
    pub(super) channel: *mut sys::rdma_event_channel,
    pub(super) pd: Arc<PdHandle>,
    pub(super) cq: Arc<CqHandle>,
    pub(super) caps: QpCaps,
    pub(super) addr: SocketAddr,
    /// Where peers get their tickets (with certificates).
    pub(super) gate: Option<Gate>,
}

// SAFETY: the listener is used from one thread at a time (accept takes &self, but
// rdma_get_cm_event on one channel is thread-safe).
unsafe impl Send for VerbsListener {}
// SAFETY: as above.
unsafe impl Sync for VerbsListener {}

impl Drop for VerbsListener {
    fn drop(&mut self) {
        // SAFETY: ours, once.
        unsafe {
            sys::rdma_destroy_id(self.id);
            sys::rdma_destroy_event_channel(self.channel);
        }
    }
}

impl QpListener for VerbsListener {
    type Qp = VerbsQp;
    type Cq = VerbsCq;

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&self, timeout: Duration) -> Result<Option<VerbsQp>, FabricError> {
        self.accept_cq(&self.cq, timeout)
    }

    fn accept_on(&self, cq: &VerbsCq, timeout: Duration) -> Result<Option<VerbsQp>, FabricError> {
        self.accept_cq(&cq.cq, timeout)
    }
}

impl VerbsListener {
    fn accept_cq(
        &self,
        cq: &Arc<CqHandle>,
        timeout: Duration,
    ) -> Result<Option<VerbsQp>, FabricError> {
        let request = match expect_event(
            self.channel,
            sys::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST,
            timeout,
        ) {
            Ok(request) => request,
            Err(e) if e.starts_with("no connection-manager event") => return Ok(None),
            Err(detail) => {
                return Err(FabricError::Connect {
                    addr: self.addr,
                    detail,
                });
            }
        };
        let id = request.id;
        // Admission before any queue pair exists: a request without a valid ticket
        // is rejected and its id destroyed.
        let peer = match &self.gate {
            None => None,
            // SAFETY: `id` is the live id of the request.
            Some(gate) => match unsafe { peer_ip(id) }
                .ok_or_else(|| admission::AdmissionError::Refused("no peer address".into()))
                .and_then(|ip| gate.redeem(&request.private_data, ip))
            {
                Ok(peer) => Some(peer),
                Err(e) => {
                    tracing::warn!(addr = %self.addr, error = %e, "rejected a verbs connect request");
                    // SAFETY: the request's id, rejected and destroyed once.
                    unsafe {
                        sys::rdma_reject(id, ptr::null(), 0);
                        sys::rdma_destroy_id(id);
                    }
                    return Ok(None);
                }
            },
        };
        let mut attr = qp_attr(cq, self.caps);
        let mut param = conn_param();
        // SAFETY: `id` is the new connection's id; on failure it is destroyed.
        unsafe {
            if sys::rdma_create_qp(id, self.pd.0, &mut attr) != 0 {
                let e = last_os_error("rdma_create_qp");
                sys::rdma_destroy_id(id);
                return Err(e);
            }
            if sys::rdma_accept(id, &mut param) != 0 {
                let e = last_os_error("rdma_accept");
                sys::rdma_destroy_qp(id);
                sys::rdma_destroy_id(id);
                return Err(e);
            }
        }
        expect_event(
            self.channel,
            sys::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
            Duration::from_secs(10),
        )
        .map_err(|detail| FabricError::Connect {
            addr: self.addr,
            detail,
        })?;
        Ok(Some(VerbsQp {
            id,
            channel: ptr::null_mut(),
            peer,
            _pd: self.pd.clone(),
            _cq: cq.clone(),
        }))
    }
}

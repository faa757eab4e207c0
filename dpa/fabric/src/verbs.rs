//! The verbs fabric (`verbs` feature): libibverbs and librdmacm through `rdma-sys`,
//! behind the same [`Fabric`] trait as the software backend.
//!
//! Devices come from `rdma_get_devices`, so protection domains, completion queues and
//! the queue pairs that rdma_cm connects share one verbs context. Completion queues
//! have a completion channel, so [`CompletionQueue::wait`] sleeps in the kernel.
//!
//! With certificates ([`VerbsFabric::with_tls`]) a link is admitted as in
//! [`super::admission`]: the connecting side proves itself with mutual TLS at the
//! listener's gate and puts the ticket it got into the connect request's private
//! data; the listener rejects a request without a valid ticket before a queue pair
//! exists. The gate and the tickets run (and are tested) on any machine; handing the
//! ticket through rdma_cm is the part here.
//!
//! Compiled wherever libibverbs/librdmacm headers exist. These machines have no RDMA
//! device: [`VerbsFabric::open`] says so, and nothing else here has run.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_int, c_void};
use std::net::{IpAddr, SocketAddr};
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as sys;

use super::admission::{self, Gate};
use super::{
    Access, CompletionQueue, Fabric, FabricError, MemoryRegion, QpCaps, QpListener, QpState,
    QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};
use dpumesh_rings::shm::SharedRegion;

mod cm;
mod ud;
pub use cm::VerbsListener;
use cm::{conn_param, expect_event, qp_attr, sockaddr};
pub use ud::{VerbsAh, VerbsUdQp};

fn last_os_error(call: &'static str) -> FabricError {
    FabricError::Device {
        call,
        detail: std::io::Error::last_os_error().to_string(),
    }
}

/// A verbs device context (one of rdma_cm's).
#[derive(Debug)]
struct Context {
    ctx: *mut sys::ibv_context,
    name: String,
}

// SAFETY: verbs contexts are thread-safe per libibverbs' threading rules.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

/// An RDMA device through libibverbs.
#[derive(Debug, Clone)]
pub struct VerbsFabric {
    context: Arc<Context>,
    tls: Option<Arc<dpumesh_identity::MeshTls>>,
}

impl VerbsFabric {
    /// Opens device `name`, or the first one. With no RDMA device, says so.
    pub fn open(name: Option<&str>) -> Result<Self, FabricError> {
        let mut count: c_int = 0;
        // SAFETY: out-pointer to a local; the list is freed below.
        let list = unsafe { sys::rdma_get_devices(&mut count) };
        if list.is_null() || count <= 0 {
            if !list.is_null() {
                // SAFETY: the list came from rdma_get_devices.
                unsafe { sys::rdma_free_devices(list) };
            }
            return Err(FabricError::NoDevice(
                "librdmacm found 0 RDMA devices (no RDMA NIC, or its driver and ibverbs provider are not loaded); \
                 use the software fabric on this machine"
                    .to_owned(),
            ));
        }
        let mut chosen = None;
        let mut names = Vec::new();
        for i in 0..count as usize {
            // SAFETY: the list has `count` contexts.
            let ctx = unsafe { *list.add(i) };
            // SAFETY: a live context's device has a NUL-terminated name.
            let dev_name = unsafe { CStr::from_ptr(sys::ibv_get_device_name((*ctx).device)) }
                .to_string_lossy()
                .into_owned();
            if chosen.is_none() && name.is_none_or(|n| n == dev_name) {
                chosen = Some((ctx, dev_name.clone()));
            }
            names.push(dev_name);
        }
        // The contexts stay open after freeing the list (rdma_cm keeps them).
        // SAFETY: the list came from rdma_get_devices.
        unsafe { sys::rdma_free_devices(list) };
        let Some((ctx, name)) = chosen else {
            return Err(FabricError::NoDevice(format!(
                "no RDMA device named {:?} (found: {})",
                name.unwrap_or_default(),
                names.join(", ")
            )));
        };
        Ok(Self {
            context: Arc::new(Context { ctx, name }),
            tls: None,
        })
    }

    /// Links admitted only for peers that prove a node or ingress identity of the
    /// mesh with these certificates (see the module's documentation).
    pub fn with_tls(mut self, tls: Option<Arc<dpumesh_identity::MeshTls>>) -> Self {
        self.tls = tls;
        self
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        &self.context.name
    }
}

/// A protection domain.
#[derive(Debug, Clone)]
pub struct VerbsPd {
    pd: Arc<PdHandle>,
}

#[derive(Debug)]
struct PdHandle(*mut sys::ibv_pd);
// SAFETY: PDs are thread-safe objects in libibverbs.
unsafe impl Send for PdHandle {}
// SAFETY: as above.
unsafe impl Sync for PdHandle {}

impl Drop for PdHandle {
    fn drop(&mut self) {
        // SAFETY: ours, freed once after every MR and QP using it (they hold the Arc).
        unsafe { sys::ibv_dealloc_pd(self.0) };
    }
}

/// A registered memory region.
#[derive(Debug)]
pub struct VerbsMr {
    mr: *mut sys::ibv_mr,
    _pd: Arc<PdHandle>,
    _region: Arc<SharedRegion>,
}

// SAFETY: an MR is immutable after registration.
unsafe impl Send for VerbsMr {}
// SAFETY: as above.
unsafe impl Sync for VerbsMr {}

impl MemoryRegion for VerbsMr {
    fn lkey(&self) -> u32 {
        // SAFETY: registered and alive while `self` is.
        unsafe { (*self.mr).lkey }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
    fn addr(&self) -> u64 {
        // SAFETY: as above.
        unsafe { (*self.mr).addr as u64 }
    }
    fn len(&self) -> u64 {
        // SAFETY: as above.
        unsafe { (*self.mr).length as u64 }
    }
}

impl Drop for VerbsMr {
    fn drop(&mut self) {
        // SAFETY: ours, deregistered once.
        unsafe { sys::ibv_dereg_mr(self.mr) };
    }
}

#[derive(Debug)]
struct CqHandle {
    cq: *mut sys::ibv_cq,
    channel: *mut sys::ibv_comp_channel,
    /// Completions `wait` took off the CQ to learn one was there; `poll` returns them
    /// first (verbs has no peek).
    taken: parking_lot::Mutex<std::collections::VecDeque<WorkCompletion>>,
    /// Written by interrupters; `wait` watches it beside the channel.
    wake: std::os::fd::OwnedFd,
}
// SAFETY: CQs and channels are thread-safe in libibverbs; one thread polls.
unsafe impl Send for CqHandle {}
// SAFETY: as above.
unsafe impl Sync for CqHandle {}

impl Drop for CqHandle {
    fn drop(&mut self) {
        // SAFETY: ours; QPs using it hold the Arc, so it goes last.
        unsafe {
            sys::ibv_destroy_cq(self.cq);
            sys::ibv_destroy_comp_channel(self.channel);
        }
    }
}

/// A completion queue with a completion channel.
#[derive(Debug, Clone)]
pub struct VerbsCq {
    cq: Arc<CqHandle>,
}

fn wc_status(s: sys::ibv_wc_status::Type) -> WcStatus {
    use sys::ibv_wc_status as st;
    match s {
        st::IBV_WC_SUCCESS => WcStatus::Success,
        st::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
        st::IBV_WC_LOC_PROT_ERR | st::IBV_WC_LOC_ACCESS_ERR => WcStatus::LocalProtection,
        st::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        st::IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequest,
        st::IBV_WC_REM_OP_ERR => WcStatus::RemoteOperation,
        st::IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlush,
        st::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        st::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        _ => WcStatus::General,
    }
}

fn wc_opcode(o: sys::ibv_wc_opcode::Type) -> WcOpcode {
    use sys::ibv_wc_opcode as op;
    match o {
        op::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
        op::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
        op::IBV_WC_RECV => WcOpcode::Recv,
        op::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        _ => WcOpcode::Send,
    }
}

impl CompletionQueue for VerbsCq {
    fn interrupter(&self) -> super::Interrupter {
        let cq = self.cq.clone();
        super::Interrupter::new(move || {
            let _ = rustix::io::write(&cq.wake, &1u64.to_ne_bytes());
        })
    }

    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let mut done = {
            let mut taken = self.cq.taken.lock();
            let n = taken.len().min(max);
            out.extend(taken.drain(..n));
            n
        };
        while done < max {
            // SAFETY: a zeroed ibv_wc is a valid out-parameter.
            let mut wc: sys::ibv_wc = unsafe { std::mem::zeroed() };
            // SAFETY: live CQ, one entry of room.
            let n = unsafe { sys::ibv_poll_cq(self.cq.cq, 1, &mut wc) };
            if n <= 0 {
                break;
            }
            let with_imm = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            out.push(WorkCompletion {
                wr_id: wc.wr_id,
                status: wc_status(wc.status),
                opcode: wc_opcode(wc.opcode),
                byte_len: wc.byte_len,
                // SAFETY: the union holds imm_data when IBV_WC_WITH_IMM is set.
                imm: with_imm
                    .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
                qp_num: wc.qp_num,
            });
            done += 1;
        }
        done
    }

    fn wait(&self, timeout: Duration) -> Result<bool, FabricError> {
        let deadline = Instant::now() + timeout;
        loop {
            // Arm, then check: a completion between the two is still seen.
            // SAFETY: live CQ.
            if unsafe { sys::ibv_req_notify_cq(self.cq.cq, 0) } != 0 {
                return Err(last_os_error("ibv_req_notify_cq"));
            }
            if !self.cq.taken.lock().is_empty() {
                return Ok(true);
            }
            let mut probe = Vec::new();
            if self.poll(&mut probe, 1) == 1 {
                self.cq.taken.lock().push_back(probe[0]);
                return Ok(true);
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Ok(false);
            };
            // SAFETY: the channel's fd is valid while the CQ lives.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw((*self.cq.channel).fd) };
            let mut fds = [
                rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN),
                rustix::event::PollFd::new(&self.cq.wake, rustix::event::PollFlags::IN),
            ];
            let ts = rustix::fs::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as i64,
            };
            let _ = rustix::event::poll(&mut fds, Some(&ts));
            if fds[1].revents().contains(rustix::event::PollFlags::IN) {
                let mut buf = [0u8; 8];
                let _ = rustix::io::read(&self.cq.wake, &mut buf);
                return Ok(!self.cq.taken.lock().is_empty());
            }
            if fds[0].revents().contains(rustix::event::PollFlags::IN) {
                let mut cq = ptr::null_mut();
                let mut ctx: *mut c_void = ptr::null_mut();
                // SAFETY: the channel has an event; acknowledged right away.
                unsafe {
                    if sys::ibv_get_cq_event(self.cq.channel, &mut cq, &mut ctx) == 0 {
                        sys::ibv_ack_cq_events(cq, 1);
                    }
                }
            }
        }
    }
}

/// A connected RC queue pair (owned with its rdma_cm id).
#[derive(Debug)]
pub struct VerbsQp {
    id: *mut sys::rdma_cm_id,
    channel: *mut sys::rdma_event_channel,
    /// Who the peer proved to be (with certificates).
    peer: Option<dpumesh_identity::SpiffeId>,
    _pd: Arc<PdHandle>,
    _cq: Arc<CqHandle>,
}

// SAFETY: posting to a QP is thread-safe in libibverbs.
unsafe impl Send for VerbsQp {}
// SAFETY: as above.
unsafe impl Sync for VerbsQp {}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        // SAFETY: ours, torn down once in order.
        unsafe {
            sys::rdma_disconnect(self.id);
            sys::rdma_destroy_qp(self.id);
            sys::rdma_destroy_id(self.id);
            if !self.channel.is_null() {
                sys::rdma_destroy_event_channel(self.channel);
            }
        }
    }
}

impl QueuePair for VerbsQp {
    fn qp_num(&self) -> u32 {
        // SAFETY: the QP lives as long as `self`.
        unsafe { (*(*self.id).qp).qp_num }
    }

    fn state(&self) -> QpState {
        // SAFETY: as above.
        if unsafe { (*(*self.id).qp).state } == sys::ibv_qp_state::IBV_QPS_ERR {
            QpState::Error
        } else {
            QpState::ReadyToSend
        }
    }

    fn peer_identity(&self) -> Option<&dpumesh_identity::SpiffeId> {
        self.peer.as_ref()
    }

    fn post_send(&self, wr: SendWr) -> Result<(), FabricError> {
        let mut sge = sys::ibv_sge {
            addr: wr.sge.addr,
            length: wr.sge.len,
            lkey: wr.sge.lkey,
        };
        // SAFETY: zeroed is the documented way to build an ibv_send_wr; fields set below.
        let mut w: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        w.wr_id = wr.wr_id;
        w.sg_list = &mut sge;
        w.num_sge = 1;
        w.send_flags = if wr.signaled {
            sys::ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        use sys::ibv_wr_opcode as op;
        let (opcode, remote, imm) = match wr.op {
            SendOp::Send => (op::IBV_WR_SEND, None, None),
            SendOp::SendWithImm(i) => (op::IBV_WR_SEND_WITH_IMM, None, Some(i)),
            SendOp::Write(r) => (op::IBV_WR_RDMA_WRITE, Some(r), None),
            SendOp::WriteWithImm(r, i) => (op::IBV_WR_RDMA_WRITE_WITH_IMM, Some(r), Some(i)),
            SendOp::Read(r) => (op::IBV_WR_RDMA_READ, Some(r), None),
        };
        w.opcode = opcode;
        if let Some(i) = imm {
            w.imm_data_invalidated_rkey_union.imm_data = i.to_be();
        }
        if let Some(r) = remote {
            w.wr.rdma.remote_addr = r.addr;
            w.wr.rdma.rkey = r.rkey;
        }
        let mut bad = ptr::null_mut();
        // SAFETY: `w` and `sge` live across the call; verbs copies them.
        let rc = unsafe { sys::ibv_post_send((*self.id).qp, &mut w, &mut bad) };
        if rc != 0 {
            return Err(FabricError::Device {
                call: "ibv_post_send",
                detail: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }

    fn post_recv(&self, wr: RecvWr) -> Result<(), FabricError> {
        let mut sge = sys::ibv_sge {
            addr: wr.sge.addr,
            length: wr.sge.len,
            lkey: wr.sge.lkey,
        };
        let mut w = sys::ibv_recv_wr {
            wr_id: wr.wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: if wr.sge.len == 0 { 0 } else { 1 },
        };
        let mut bad = ptr::null_mut();
        // SAFETY: as in post_send.
        let rc = unsafe { sys::ibv_post_recv((*self.id).qp, &mut w, &mut bad) };
        if rc != 0 {
            return Err(FabricError::Device {
                call: "ibv_post_recv",
                detail: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }
}

fn access_bits(access: Access) -> c_int {
    use sys::ibv_access_flags as f;
    let mut bits = f(0);
    if access.contains(Access::LOCAL_WRITE) {
        bits |= f::IBV_ACCESS_LOCAL_WRITE;
    }
    if access.contains(Access::REMOTE_WRITE) {
        bits |= f::IBV_ACCESS_REMOTE_WRITE;
    }
    if access.contains(Access::REMOTE_READ) {
        bits |= f::IBV_ACCESS_REMOTE_READ;
    }
    bits.0 as c_int
}

impl Fabric for VerbsFabric {
    type Pd = VerbsPd;
    type Mr = VerbsMr;
    type Cq = VerbsCq;
    type Qp = VerbsQp;
    type Listener = VerbsListener;

    fn name(&self) -> &'static str {
        "verbs"
    }

    fn alloc_pd(&self) -> Result<VerbsPd, FabricError> {
        // SAFETY: live context.
        let pd = unsafe { sys::ibv_alloc_pd(self.context.ctx) };
        if pd.is_null() {
            return Err(last_os_error("ibv_alloc_pd"));
        }
        Ok(VerbsPd {
            pd: Arc::new(PdHandle(pd)),
        })
    }

    fn register(
        &self,
        pd: &VerbsPd,
        region: &Arc<SharedRegion>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<VerbsMr, FabricError> {
        if len == 0
            || offset
                .checked_add(len)
                .is_none_or(|end| end > region.len() as u64)
        {
            return Err(FabricError::Register(format!(
                "{len} bytes at offset {offset} do not fit region {}",
                region.name()
            )));
        }
        let addr = (region.base_addr() + offset) as *mut c_void;
        // SAFETY: the range is inside the mapping, which the MR keeps alive (Arc).
        let mr = unsafe { sys::ibv_reg_mr(pd.pd.0, addr, len as usize, access_bits(access)) };
        if mr.is_null() {
            return Err(last_os_error("ibv_reg_mr"));
        }
        Ok(VerbsMr {
            mr,
            _pd: pd.pd.clone(),
            _region: region.clone(),
        })
    }

    fn create_cq(&self, depth: u32) -> Result<VerbsCq, FabricError> {
        // SAFETY: live context; objects freed by CqHandle's Drop.
        unsafe {
            let channel = sys::ibv_create_comp_channel(self.context.ctx);
            if channel.is_null() {
                return Err(last_os_error("ibv_create_comp_channel"));
            }
            let cq = sys::ibv_create_cq(
                self.context.ctx,
                depth as c_int,
                ptr::null_mut(),
                channel,
                0,
            );
            if cq.is_null() {
                let e = last_os_error("ibv_create_cq");
                sys::ibv_destroy_comp_channel(channel);
                return Err(e);
            }
            let wake = match rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            ) {
                Ok(fd) => fd,
                Err(e) => {
                    sys::ibv_destroy_cq(cq);
                    sys::ibv_destroy_comp_channel(channel);
                    return Err(FabricError::Io(e.into()));
                }
            };
            Ok(VerbsCq {
                cq: Arc::new(CqHandle {
                    cq,
                    channel,
                    taken: parking_lot::Mutex::new(std::collections::VecDeque::new()),
                    wake,
                }),
            })
        }
    }

    fn listen(
        &self,
        pd: &VerbsPd,
        addr: SocketAddr,
        cq: &VerbsCq,
        caps: QpCaps,
    ) -> Result<VerbsListener, FabricError> {
        let (mut sa, _) = sockaddr(addr);
        // SAFETY: channel and id are ours and destroyed by the listener (or here on
        // failure).
        unsafe {
            let channel = sys::rdma_create_event_channel();
            if channel.is_null() {
                return Err(last_os_error("rdma_create_event_channel"));
            }
            let mut id = ptr::null_mut();
            if sys::rdma_create_id(
                channel,
                &mut id,
                ptr::null_mut(),
                sys::rdma_port_space::RDMA_PS_TCP,
            ) != 0
            {
                let e = last_os_error("rdma_create_id");
                sys::rdma_destroy_event_channel(channel);
                return Err(e);
            }
            if sys::rdma_bind_addr(id, (&mut sa as *mut libc::sockaddr_storage).cast()) != 0
                || sys::rdma_listen(id, 64) != 0
            {
                let e = last_os_error("rdma_bind_addr/rdma_listen");
                sys::rdma_destroy_id(id);
                sys::rdma_destroy_event_channel(channel);
                return Err(e);
            }
            // The port rdma_cm bound (the one asked for, or a free one for 0); the
            // gate listens on the same number.
            let addr = SocketAddr::new(addr.ip(), u16::from_be(sys::rdma_get_src_port(id)));
            let gate = match &self.tls {
                None => None,
                Some(tls) => match Gate::start(tls.clone(), addr) {
                    Ok(gate) => Some(gate),
                    Err(e) => {
                        sys::rdma_destroy_id(id);
                        sys::rdma_destroy_event_channel(channel);
                        return Err(FabricError::Io(e));
                    }
                },
            };
            Ok(VerbsListener {
                id,
                channel,
                pd: pd.pd.clone(),
                cq: cq.cq.clone(),
                caps,
                addr,
                gate,
            })
        }
    }

    fn connect(
        &self,
        pd: &VerbsPd,
        addr: SocketAddr,
        cq: &VerbsCq,
        caps: QpCaps,
    ) -> Result<VerbsQp, FabricError> {
        let (mut sa, _) = sockaddr(addr);
        let fail = |detail: String| FabricError::Connect { addr, detail };
        let step = Duration::from_secs(10);
        // Proven at the gate first: the ticket rides in the connect request.
        let admitted = match &self.tls {
            None => None,
            Some(tls) => Some(admission::admit(tls, addr).map_err(|e| fail(e.to_string()))?),
        };
        let private_data = admitted
            .as_ref()
            .map(|(ticket, _)| ticket.to_private_data());
        // SAFETY: channel and id are ours; on failure both are destroyed here,
        // otherwise the returned QP owns them.
        unsafe {
            let channel = sys::rdma_create_event_channel();
            if channel.is_null() {
                return Err(last_os_error("rdma_create_event_channel"));
            }
            let mut id = ptr::null_mut();
            if sys::rdma_create_id(
                channel,
                &mut id,
                ptr::null_mut(),
                sys::rdma_port_space::RDMA_PS_TCP,
            ) != 0
            {
                let e = last_os_error("rdma_create_id");
                sys::rdma_destroy_event_channel(channel);
                return Err(e);
            }
            let cleanup = |id: *mut sys::rdma_cm_id| {
                sys::rdma_destroy_id(id);
                sys::rdma_destroy_event_channel(channel);
            };
            let result = (|| {
                if sys::rdma_resolve_addr(
                    id,
                    ptr::null_mut(),
                    (&mut sa as *mut libc::sockaddr_storage).cast(),
                    5000,
                ) != 0
                {
                    return Err(fail(std::io::Error::last_os_error().to_string()));
                }
                expect_event(
                    channel,
                    sys::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
                    step,
                )
                .map_err(fail)?;
                if sys::rdma_resolve_route(id, 5000) != 0 {
                    return Err(fail(std::io::Error::last_os_error().to_string()));
                }
                expect_event(
                    channel,
                    sys::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED,
                    step,
                )
                .map_err(fail)?;
                let mut attr = qp_attr(&cq.cq, caps);
                if sys::rdma_create_qp(id, pd.pd.0, &mut attr) != 0 {
                    return Err(last_os_error("rdma_create_qp"));
                }
                let mut param = conn_param();
                if let Some(data) = &private_data {
                    param.private_data = data.as_ptr().cast();
                    param.private_data_len = admission::PRIVATE_DATA_LEN as u8;
                }
                if sys::rdma_connect(id, &mut param) != 0 {
                    sys::rdma_destroy_qp(id);
                    return Err(fail(std::io::Error::last_os_error().to_string()));
                }
                if let Err(e) = expect_event(
                    channel,
                    sys::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
                    step,
                ) {
                    sys::rdma_destroy_qp(id);
                    return Err(fail(e));
                }
                Ok(())
            })();
            if let Err(e) = result {
                cleanup(id);
                return Err(e);
            }
            Ok(VerbsQp {
                id,
                channel,
                peer: admitted.map(|(_, listener)| listener),
                _pd: pd.pd.clone(),
                _cq: cq.cq.clone(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_an_rdma_device_opening_says_so() {
        let devices = std::fs::read_dir("/sys/class/infiniband").map_or(0, |d| d.count());
        match VerbsFabric::open(None) {
            Err(FabricError::NoDevice(why)) => {
                assert_eq!(devices, 0, "the kernel lists RDMA devices, yet none opened");
                assert!(why.contains("found 0 RDMA devices"), "{why}");
                assert!(
                    why.contains("software fabric"),
                    "the message says what to use instead: {why}"
                );
            }
            Ok(f) => assert!(
                devices > 0,
                "opened {} without a kernel RDMA device",
                f.device()
            ),
            Err(e) => panic!("unexpected error: {e}"),
        }
        // Asking for a device by a name that does not exist is refused either way.
        assert!(matches!(
            VerbsFabric::open(Some("no-such-rdma-device")),
            Err(FabricError::NoDevice(_))
        ));
    }
}

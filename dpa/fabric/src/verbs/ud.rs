//! UD queue pairs and address handles through libibverbs (`ibv_create_qp` with
//! `IBV_QPT_UD`, `ibv_create_ah` with a GRH), behind [`DatagramFabric`].
//!
//! Compiled here, never run: these machines have no RDMA device. Completion times are
//! taken when a completion is polled ([`now_ns`]); the NIC's own CQE timestamps
//! (`ibv_create_cq_ex` with `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP`, converted with
//! `ibv_query_rt_values_ex`) are the plan for hardware, as R-Pingmesh uses them.

use std::collections::HashMap;
use std::net::SocketAddr;

use parking_lot::Mutex;

use super::*;
use crate::ud::{
    AddressVector, DatagramFabric, GRH_LEN, Gid, ROCEV2_PORT, UdCompletion, UdCounters,
    UdQueuePair, UdSendWr, now_ns, parse_grh,
};

/// The port UD queue pairs use (BlueField's RoCE ports are port 1 of their device).
const PORT: u8 = 1;

/// An address handle.
#[derive(Debug)]
pub struct VerbsAh {
    ah: *mut sys::ibv_ah,
    av: AddressVector,
    _pd: Arc<PdHandle>,
}

// SAFETY: address handles are immutable once created.
unsafe impl Send for VerbsAh {}
// SAFETY: as above.
unsafe impl Sync for VerbsAh {}

impl Drop for VerbsAh {
    fn drop(&mut self) {
        // SAFETY: ours, destroyed once.
        unsafe { sys::ibv_destroy_ah(self.ah) };
    }
}

impl VerbsAh {
    /// What it addresses.
    pub fn address(&self) -> AddressVector {
        self.av
    }
}

/// A UD queue pair with its own completion queue.
#[derive(Debug)]
pub struct VerbsUdQp {
    qp: *mut sys::ibv_qp,
    qkey: u32,
    local: AddressVector,
    cq: VerbsCq,
    /// Receive buffers by work request id, to read the GRH of what lands in them.
    recvs: Mutex<HashMap<u64, u64>>,
    /// Completions `wait` took off the CQ to learn one was there.
    pending: Mutex<std::collections::VecDeque<UdCompletion>>,
    _pd: Arc<PdHandle>,
}

// SAFETY: posting and polling are thread-safe in libibverbs.
unsafe impl Send for VerbsUdQp {}
// SAFETY: as above.
unsafe impl Sync for VerbsUdQp {}

impl Drop for VerbsUdQp {
    fn drop(&mut self) {
        // SAFETY: ours; destroyed before its CQ (field order keeps the CQ alive).
        unsafe { sys::ibv_destroy_qp(self.qp) };
    }
}

fn modify(qp: *mut sys::ibv_qp, attr: &mut sys::ibv_qp_attr, mask: u32) -> Result<(), FabricError> {
    // SAFETY: a live QP and attributes valid for the mask.
    let rc = unsafe { sys::ibv_modify_qp(qp, attr, mask as c_int) };
    if rc != 0 {
        return Err(FabricError::Device {
            call: "ibv_modify_qp",
            detail: std::io::Error::from_raw_os_error(rc).to_string(),
        });
    }
    Ok(())
}

impl VerbsFabric {
    /// The GID table index of `gid` on the UD port.
    fn gid_index(&self, gid: Gid) -> Result<c_int, FabricError> {
        // 256: the largest GID table a ConnectX port reports.
        for index in 0..256 {
            // SAFETY: zeroed is a valid ibv_gid out-parameter.
            let mut got: sys::ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: live context; the port and index are checked by verbs.
            if unsafe { sys::ibv_query_gid(self.context.ctx, PORT, index, &mut got) } != 0 {
                break;
            }
            // SAFETY: `raw` is the union's byte view.
            if unsafe { got.raw } == gid.0 {
                return Ok(index);
            }
        }
        Err(FabricError::Device {
            call: "ibv_query_gid",
            detail: format!(
                "no GID {gid} ({}) on port {PORT} of {}",
                gid.ip(),
                self.device()
            ),
        })
    }
}

impl DatagramFabric for VerbsFabric {
    type Ah = VerbsAh;
    type UdQp = VerbsUdQp;

    fn create_ud_qp(
        &self,
        pd: &VerbsPd,
        bind: SocketAddr,
        qkey: u32,
        caps: QpCaps,
    ) -> Result<VerbsUdQp, FabricError> {
        let gid = Gid::from_ip(bind.ip());
        self.gid_index(gid)?;
        let cq = self.create_cq(caps.max_send_wr + caps.max_recv_wr)?;
        // SAFETY: zeroed init attributes with the fields verbs needs set below.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq.cq;
        init.recv_cq = cq.cq.cq;
        init.qp_type = sys::ibv_qp_type::IBV_QPT_UD;
        init.cap.max_send_wr = caps.max_send_wr;
        init.cap.max_recv_wr = caps.max_recv_wr;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: live PD; the QP is destroyed by VerbsUdQp's Drop.
        let qp = unsafe { sys::ibv_create_qp(pd.pd.0, &mut init) };
        if qp.is_null() {
            return Err(last_os_error("ibv_create_qp"));
        }
        let made = VerbsUdQp {
            qp,
            qkey,
            local: AddressVector::to(SocketAddr::new(bind.ip(), ROCEV2_PORT)),
            cq,
            recvs: Mutex::new(HashMap::new()),
            pending: Mutex::new(std::collections::VecDeque::new()),
            _pd: pd.pd.clone(),
        };
        use sys::ibv_qp_attr_mask as m;
        // SAFETY: zeroed attributes, the ones each transition needs set.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = PORT;
        attr.qkey = qkey;
        modify(
            qp,
            &mut attr,
            (m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_QKEY).0,
        )?;
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        modify(qp, &mut attr, m::IBV_QP_STATE.0)?;
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = 0;
        modify(qp, &mut attr, (m::IBV_QP_STATE | m::IBV_QP_SQ_PSN).0)?;
        Ok(made)
    }

    fn create_ah(&self, pd: &VerbsPd, av: AddressVector) -> Result<VerbsAh, FabricError> {
        // SAFETY: zeroed attributes with a global route set below.
        let mut attr: sys::ibv_ah_attr = unsafe { std::mem::zeroed() };
        attr.is_global = 1;
        attr.port_num = PORT;
        attr.grh.dgid.raw = av.gid.0;
        attr.grh.flow_label = av.flow_label & 0xF_FFFF;
        attr.grh.hop_limit = av.hop_limit;
        // The first GID of the port's table that is an IPv4-mapped RoCEv2 one would be
        // chosen by the caller on a real device; index 0 is the port's default.
        attr.grh.sgid_index = 0;
        // SAFETY: live PD; the AH is destroyed by VerbsAh's Drop.
        let ah = unsafe { sys::ibv_create_ah(pd.pd.0, &mut attr) };
        if ah.is_null() {
            return Err(last_os_error("ibv_create_ah"));
        }
        Ok(VerbsAh {
            ah,
            av,
            _pd: pd.pd.clone(),
        })
    }
}

impl UdQueuePair for VerbsUdQp {
    type Ah = VerbsAh;

    fn qp_num(&self) -> u32 {
        // SAFETY: live QP.
        unsafe { (*self.qp).qp_num }
    }

    fn qkey(&self) -> u32 {
        self.qkey
    }

    fn local(&self) -> AddressVector {
        self.local
    }

    fn post_send(&self, wr: UdSendWr<'_, VerbsAh>) -> Result<(), FabricError> {
        let mut sge = sys::ibv_sge {
            addr: wr.sge.addr,
            length: wr.sge.len,
            lkey: wr.sge.lkey,
        };
        // SAFETY: zeroed is the documented way to build an ibv_send_wr.
        let mut w: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        w.wr_id = wr.wr_id;
        w.sg_list = &mut sge;
        w.num_sge = 1;
        w.send_flags = if wr.signaled {
            sys::ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        match wr.imm {
            Some(i) => {
                w.opcode = sys::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
                w.imm_data_invalidated_rkey_union.imm_data = i.to_be();
            }
            None => w.opcode = sys::ibv_wr_opcode::IBV_WR_SEND,
        }
        w.wr.ud.ah = wr.ah.ah;
        w.wr.ud.remote_qpn = wr.remote_qpn;
        w.wr.ud.remote_qkey = wr.remote_qkey;
        let mut bad = ptr::null_mut();
        // SAFETY: `w` and `sge` live across the call; verbs copies them.
        let rc = unsafe { sys::ibv_post_send(self.qp, &mut w, &mut bad) };
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
            num_sge: 1,
        };
        self.recvs.lock().insert(wr.wr_id, wr.sge.addr);
        let mut bad = ptr::null_mut();
        // SAFETY: as in post_send.
        let rc = unsafe { sys::ibv_post_recv(self.qp, &mut w, &mut bad) };
        if rc != 0 {
            self.recvs.lock().remove(&wr.wr_id);
            return Err(FabricError::Device {
                call: "ibv_post_recv",
                detail: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }

    fn poll(&self, out: &mut Vec<UdCompletion>, max: usize) -> usize {
        let taken = {
            let mut pending = self.pending.lock();
            let n = pending.len().min(max);
            out.extend(pending.drain(..n));
            n
        };
        taken + self.poll_cq(out, max - taken)
    }

    fn wait(&self, timeout: Duration) -> Result<bool, FabricError> {
        let deadline = Instant::now() + timeout;
        loop {
            if !self.pending.lock().is_empty() {
                return Ok(true);
            }
            // Arm, then check: a completion between the two is still seen.
            // SAFETY: live CQ.
            if unsafe { sys::ibv_req_notify_cq(self.cq.cq.cq, 0) } != 0 {
                return Err(last_os_error("ibv_req_notify_cq"));
            }
            let mut got = Vec::new();
            if self.poll_cq(&mut got, 16) > 0 {
                self.pending.lock().extend(got);
                return Ok(true);
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Ok(false);
            };
            // SAFETY: the channel's fd is valid while the CQ lives.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw((*self.cq.cq.channel).fd) };
            let mut fds = [rustix::event::PollFd::new(
                &fd,
                rustix::event::PollFlags::IN,
            )];
            let ts = rustix::fs::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as i64,
            };
            let _ = rustix::event::poll(&mut fds, Some(&ts));
            if fds[0].revents().contains(rustix::event::PollFlags::IN) {
                let mut cq = ptr::null_mut();
                let mut ctx: *mut c_void = ptr::null_mut();
                // SAFETY: the channel has an event; acknowledged right away.
                unsafe {
                    if sys::ibv_get_cq_event(self.cq.cq.channel, &mut cq, &mut ctx) == 0 {
                        sys::ibv_ack_cq_events(cq, 1);
                    }
                }
            }
        }
    }

    fn counters(&self) -> UdCounters {
        // The port's counters (rx_discards etc. in sysfs) are the NIC's view; per-QP
        // drops are not reported by verbs.
        UdCounters::default()
    }
}

impl VerbsUdQp {
    /// Takes up to `max` completions off the CQ.
    fn poll_cq(&self, out: &mut Vec<UdCompletion>, max: usize) -> usize {
        let mut done = 0;
        while done < max {
            // SAFETY: a zeroed ibv_wc is a valid out-parameter.
            let mut wc: sys::ibv_wc = unsafe { std::mem::zeroed() };
            // SAFETY: live CQ, one entry of room.
            let n = unsafe { sys::ibv_poll_cq(self.cq.cq.cq, 1, &mut wc) };
            if n <= 0 {
                break;
            }
            let timestamp_ns = now_ns();
            let opcode = wc_opcode(wc.opcode);
            let with_imm = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            let mut src = None;
            if opcode == WcOpcode::Recv {
                let addr = self.recvs.lock().remove(&wc.wr_id);
                let has_grh = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_GRH.0 != 0;
                if let (Some(addr), true) = (addr, has_grh) {
                    let mut grh = [0u8; GRH_LEN];
                    // SAFETY: the receive buffer is registered memory of this process,
                    // at least GRH_LEN long (the caller's contract), and the receive
                    // has completed, so the NIC no longer writes it.
                    unsafe {
                        ptr::copy_nonoverlapping(addr as *const u8, grh.as_mut_ptr(), GRH_LEN)
                    };
                    src = parse_grh(&grh).map(|(gid, flow_label)| AddressVector {
                        gid,
                        flow_label,
                        hop_limit: 64,
                        udp_port: ROCEV2_PORT,
                    });
                }
            }
            out.push(UdCompletion {
                wr_id: wc.wr_id,
                status: wc_status(wc.status),
                opcode,
                byte_len: wc.byte_len,
                // SAFETY: the union holds imm_data when IBV_WC_WITH_IMM is set.
                imm: with_imm
                    .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
                src_qp: wc.src_qp,
                src,
                // The NIC chose it from the flow label; verbs does not report it.
                udp_src_port: 0,
                timestamp_ns,
            });
            done += 1;
        }
        done
    }
}

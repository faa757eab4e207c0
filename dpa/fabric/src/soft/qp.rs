//! Queue pairs: their local and remote access checks, completions, failure, and the
//! verbs a user posts.

use super::*;

impl QpInner {
    pub(super) fn cqs(&self) -> impl Iterator<Item = &Arc<CqInner>> {
        let same = Arc::ptr_eq(&self.send_cq, &self.recv_cq);
        std::iter::once(&self.send_cq).chain((!same).then_some(&self.recv_cq))
    }

    pub(super) fn local(
        &self,
        addr: u64,
        len: u64,
        lkey: u32,
        need: Access,
    ) -> Option<(Arc<SharedRegion>, u64)> {
        let entry = self.pd.by_lkey.read().get(&lkey).cloned()?;
        if !entry.access.contains(need) {
            return None;
        }
        let offset = entry.locate(addr, len)?;
        Some((entry.region.clone(), offset))
    }

    pub(super) fn remote(
        &self,
        addr: u64,
        len: u64,
        rkey: u32,
        need: Access,
    ) -> Option<(Arc<SharedRegion>, u64)> {
        let entry = self.pd.by_rkey.read().get(&rkey).cloned()?;
        if !entry.access.contains(need) {
            return None;
        }
        let offset = entry.locate(addr, len)?;
        Some((entry.region.clone(), offset))
    }

    pub(super) fn complete_send(&self, o: &Outstanding, status: WcStatus, byte_len: u32) {
        if o.signaled || status != WcStatus::Success {
            self.send_cq.push(WorkCompletion {
                wr_id: o.wr_id,
                status,
                opcode: o.opcode,
                byte_len,
                imm: None,
                qp_num: self.num,
            });
        }
    }

    pub(super) fn complete_recv(
        &self,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
    ) {
        self.recv_cq.push(WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len,
            imm,
            qp_num: self.num,
        });
    }

    /// Moves to the error state: the first outstanding request gets `first` (if
    /// given), everything else posted is flushed.
    pub(super) fn fail(&self, first: Option<(u64, WcStatus)>, tx: &mut Tx, rx: Option<&mut Rx>) {
        let was = self.error.swap(true, Ordering::SeqCst);
        for o in tx.outstanding.drain(..).collect::<Vec<_>>() {
            let status = match first {
                Some((psn, s)) if psn == o.psn => s,
                _ => WcStatus::WrFlush,
            };
            self.complete_send(&o, status, 0);
        }
        // Keep a frame that is half on the wire (cutting it would desync the peer) and
        // NAKs still to say why; the socket is shut once they are out.
        tx.queue.retain(|f| f.sent > 0 || f.head[0] == K_NAK);
        match rx {
            Some(rx) => self.flush_recvs(rx),
            // Called with only the send side locked: take the receive side if free
            // (whoever holds it flushes its receives on its next pass, see `begin`).
            None => {
                if let Some(mut rx) = self.rx.try_lock() {
                    self.flush_recvs(&mut rx);
                }
            }
        }
        if tx.queue.is_empty() {
            let _ = self.sock.shutdown(std::net::Shutdown::Write);
        }
        if !was {
            tracing::debug!(qp = self.num, peer = %self.peer, "queue pair moved to the error state");
        }
    }

    /// Completes every posted receive with a flush error (the queue pair failed).
    pub(super) fn flush_recvs(&self, rx: &mut Rx) {
        for r in rx.recvs.drain(..) {
            self.complete_recv(r.wr_id, WcStatus::WrFlush, WcOpcode::Recv, 0, None);
        }
        rx.held.clear();
        rx.held_bytes = 0;
    }

    /// Reads and handles what arrived, then flushes what is queued.
    pub(super) fn progress(&self) {
        if let Some(mut rx) = self.rx.try_lock() {
            self.read_all(&mut rx);
        }
        if let Some(mut tx) = self.tx.try_lock()
            && (!tx.queue.is_empty() || tx.want_writable)
        {
            self.flush(&mut tx);
        }
    }
}

impl Drop for QpInner {
    fn drop(&mut self) {
        for cq in [&self.send_cq, &self.recv_cq] {
            let _ = epoll::delete(&cq.epoll, &self.sock);
            cq.qps.write().remove(&self.num);
        }
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

impl SoftQp {
    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.inner.peer
    }
}

impl QueuePair for SoftQp {
    fn qp_num(&self) -> u32 {
        self.inner.num
    }

    fn peer_identity(&self) -> Option<&dpumesh_identity::SpiffeId> {
        self.inner.peer_id.as_ref()
    }

    fn state(&self) -> QpState {
        if self.inner.error.load(Ordering::SeqCst) {
            QpState::Error
        } else {
            QpState::ReadyToSend
        }
    }

    fn post_send(&self, wr: SendWr) -> Result<(), FabricError> {
        let qp = &self.inner;
        if qp.error.load(Ordering::SeqCst) {
            return Err(FabricError::QpError(qp.num));
        }
        let mut tx = qp.tx.lock();
        if tx.outstanding.len() >= qp.caps.max_send_wr as usize {
            return Err(FabricError::QueueFull {
                qp: qp.num,
                which: "send",
                limit: qp.caps.max_send_wr,
            });
        }
        let psn = tx.next_psn;
        let len = wr.sge.len as u64;
        let need = match wr.op {
            SendOp::Read(_) => Access::LOCAL_WRITE,
            _ => Access::default(),
        };
        let opcode = match wr.op {
            SendOp::Send | SendOp::SendWithImm(_) => WcOpcode::Send,
            SendOp::Write(_) | SendOp::WriteWithImm(..) => WcOpcode::RdmaWrite,
            SendOp::Read(_) => WcOpcode::RdmaRead,
        };
        let Some((region, offset)) = qp.local(wr.sge.addr, len, wr.sge.lkey, need) else {
            // A local protection error completes the request in error and fails the
            // queue pair, as verbs does.
            let o = Outstanding {
                psn,
                wr_id: wr.wr_id,
                opcode,
                signaled: true,
                read: None,
            };
            tx.next_psn += 1;
            tx.outstanding.push_back(o);
            // Locks are always taken receive side first.
            drop(tx);
            let mut rx = qp.rx.lock();
            let mut tx = qp.tx.lock();
            qp.fail(
                Some((psn, WcStatus::LocalProtection)),
                &mut tx,
                Some(&mut rx),
            );
            return Ok(());
        };
        tx.next_psn += 1;
        let ack = if wr.signaled { F_ACK_REQ } else { 0 };
        let (head, payload, read) = match wr.op {
            SendOp::Send | SendOp::SendWithImm(_) | SendOp::Write(_) | SendOp::WriteWithImm(..) => {
                let (kind, remote, imm) = match wr.op {
                    SendOp::Send => (K_SEND, None, None),
                    SendOp::SendWithImm(i) => (K_SEND, None, Some(i)),
                    SendOp::Write(r) => (K_WRITE, Some(r), None),
                    SendOp::WriteWithImm(r, i) => (K_WRITE, Some(r), Some(i)),
                    SendOp::Read(_) => unreachable!("matched above"),
                };
                let remote = remote.unwrap_or(RemoteAddr { addr: 0, rkey: 0 });
                let head = Header {
                    kind,
                    flags: ack | if imm.is_some() { F_IMM } else { 0 },
                    len: wr.sge.len,
                    psn,
                    addr: remote.addr,
                    rkey: remote.rkey,
                    imm: imm.unwrap_or(0),
                };
                let payload = if len == 0 {
                    Payload::None
                } else if len <= INLINE {
                    let mut v = vec![0u8; len as usize];
                    let _ = region.read(offset, &mut v);
                    Payload::Inline(v)
                } else {
                    Payload::Region(region, offset, len)
                };
                (head, payload, None)
            }
            SendOp::Read(remote) => {
                let head = Header {
                    kind: K_READ_REQ,
                    flags: 0,
                    len: 0,
                    psn,
                    addr: remote.addr,
                    rkey: remote.rkey,
                    imm: wr.sge.len,
                };
                (head, Payload::None, Some((region, offset, wr.sge.len)))
            }
        };
        tx.outstanding.push_back(Outstanding {
            psn,
            wr_id: wr.wr_id,
            opcode,
            signaled: wr.signaled,
            read,
        });
        qp.enqueue(
            &mut tx,
            OutFrame {
                head: head.encode(),
                payload,
                sent: 0,
            },
        );
        Ok(())
    }

    fn post_recv(&self, wr: RecvWr) -> Result<(), FabricError> {
        let qp = &self.inner;
        if qp.error.load(Ordering::SeqCst) {
            return Err(FabricError::QpError(qp.num));
        }
        let mut rx = qp.rx.lock();
        if rx.recvs.len() >= qp.caps.max_recv_wr as usize {
            return Err(FabricError::QueueFull {
                qp: qp.num,
                which: "receive",
                limit: qp.caps.max_recv_wr,
            });
        }
        rx.recvs.push_back(wr);
        if !rx.held.is_empty() {
            qp.drain_held(&mut rx);
        }
        Ok(())
    }
}

//! The receiving side of a queue pair: frames parsed from the socket, checked, landed
//! in registered memory, acknowledged or refused, and held in order.

use super::*;

impl QpInner {
    pub(super) fn read_all(&self, rx: &mut Rx) {
        loop {
            // A large payload bound for registered memory lands there directly once
            // the buffered bytes are used up (no bounce through the receive buffer).
            if rx.start == rx.end
                && self.tls.is_none()
                && let Some(frame) = rx.current.as_mut()
                && let Sink::Region(region, offset) = &frame.sink
                && frame.header.len as u64 - frame.got >= DIRECT_READ
            {
                let want = (frame.header.len as u64 - frame.got) as usize;
                match region.read_from(self.sock.as_fd(), *offset + frame.got, want) {
                    Ok(0) => {
                        self.peer_gone(rx);
                        return;
                    }
                    Ok(n) => {
                        frame.got += n as u64;
                        if frame.got == frame.header.len as u64 {
                            let frame = rx.current.take().expect("matched above");
                            self.finish(frame, rx);
                        }
                        continue;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        self.peer_gone(rx);
                        return;
                    }
                }
            }
            if rx.start == rx.end {
                rx.start = 0;
                rx.end = 0;
            } else if rx.end == rx.buf.len() {
                rx.buf.copy_within(rx.start..rx.end, 0);
                rx.end -= rx.start;
                rx.start = 0;
            }
            let end = rx.end;
            let read = match &self.tls {
                Some(tls) => tls.read(&mut &self.sock, &mut rx.buf[end..]),
                None => (&self.sock).read(&mut rx.buf[end..]),
            };
            match read {
                Ok(0) => {
                    self.peer_gone(rx);
                    return;
                }
                Ok(n) => {
                    rx.end += n;
                    self.parse(rx);
                    if rx.end < rx.buf.len() && self.tls.is_none() {
                        // A short read drained the socket; epoll says when more comes.
                        // (Not so with TLS: a read gives one record's worth while the
                        // session may hold more the socket no longer signals.)
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.peer_gone(rx);
                    return;
                }
            }
        }
    }

    pub(super) fn peer_gone(&self, rx: &mut Rx) {
        // Nothing more will arrive: stop watching the socket (a closed socket stays
        // readable and would wake its pollers forever).
        for cq in self.cqs() {
            let _ = epoll::delete(&cq.epoll, &self.sock);
        }
        if self.error.load(Ordering::SeqCst) {
            return;
        }
        let mut tx = self.tx.lock();
        self.connection_lost(&mut tx, Some(rx));
    }

    pub(super) fn parse(&self, rx: &mut Rx) {
        loop {
            if rx.current.is_none() {
                if rx.end - rx.start < FRAME_HEADER {
                    return;
                }
                let header = Header::decode(&rx.buf[rx.start..rx.start + FRAME_HEADER]);
                rx.start += FRAME_HEADER;
                let frame = self.begin(header, rx);
                rx.current = Some(frame);
            }
            let frame = rx.current.as_mut().expect("set above");
            let want = frame.header.len as u64 - frame.got;
            let n = want.min((rx.end - rx.start) as u64) as usize;
            if n > 0 {
                let bytes = &rx.buf[rx.start..rx.start + n];
                match &mut frame.sink {
                    Sink::Discard => {}
                    Sink::Buffer(v) => v.extend_from_slice(bytes),
                    Sink::Region(region, offset) => {
                        let _ = region.write(*offset + frame.got, bytes);
                    }
                }
                frame.got += n as u64;
                rx.start += n;
            }
            if frame.got < frame.header.len as u64 {
                return;
            }
            let frame = rx.current.take().expect("set above");
            self.finish(frame, rx);
        }
    }

    /// Decides where a frame's payload goes, before any of it arrives.
    pub(super) fn begin(&self, header: Header, rx: &mut Rx) -> InFrame {
        let mut frame = InFrame {
            header,
            got: 0,
            sink: Sink::Discard,
            recv: None,
            nak: None,
            read: None,
        };
        if self.error.load(Ordering::SeqCst) {
            if !rx.recvs.is_empty() {
                self.flush_recvs(rx);
            }
            return frame;
        }
        let len = header.len as u64;
        match header.kind {
            K_SEND => {
                // Land in place when the next receive is posted and fits; otherwise
                // hold the bytes for when one is (receiver not ready).
                if rx.held.is_empty()
                    && let Some(r) = rx.recvs.front().copied()
                {
                    rx.recvs.pop_front();
                    if len > r.sge.len as u64 {
                        frame.nak = Some(WcStatus::RemoteInvalidRequest);
                        frame.recv = Some(r);
                    } else if let Some((region, offset)) =
                        self.local(r.sge.addr, len, r.sge.lkey, Access::LOCAL_WRITE)
                    {
                        frame.sink = Sink::Region(region, offset);
                        frame.recv = Some(r);
                    } else {
                        frame.nak = Some(WcStatus::RemoteOperation);
                        frame.recv = Some(r);
                    }
                } else if rx.held_bytes as u64 + len > MAX_HELD_BYTES as u64 {
                    // Refused before a byte is buffered: one frame may announce 4 GiB.
                    frame.nak = Some(WcStatus::RnrRetryExceeded);
                } else {
                    frame.sink = Sink::Buffer(Vec::with_capacity(len.min(1 << 20) as usize));
                }
            }
            K_WRITE => match self.remote(header.addr, len, header.rkey, Access::REMOTE_WRITE) {
                Some((region, offset)) => frame.sink = Sink::Region(region, offset),
                None => frame.nak = Some(WcStatus::RemoteAccess),
            },
            K_READ_RESP => {
                let mut tx = self.tx.lock();
                // Requests before the read that asked for no ACK are done by now.
                while tx
                    .outstanding
                    .front()
                    .is_some_and(|o| o.psn < header.psn && o.read.is_none())
                {
                    let o = tx.outstanding.pop_front().expect("checked");
                    self.complete_send(&o, WcStatus::Success, 0);
                }
                if let Some(o) = tx.outstanding.pop_front() {
                    if let Some((region, offset, want)) = &o.read
                        && o.psn == header.psn
                        && *want as u64 == len
                    {
                        frame.sink = Sink::Region(region.clone(), *offset);
                    } else {
                        frame.nak = Some(WcStatus::General);
                    }
                    frame.read = Some(o);
                } else {
                    frame.nak = Some(WcStatus::General);
                }
            }
            _ => {}
        }
        frame
    }

    pub(super) fn finish(&self, frame: InFrame, rx: &mut Rx) {
        if self.error.load(Ordering::SeqCst) {
            return;
        }
        let h = frame.header;
        let imm = (h.flags & F_IMM != 0).then_some(h.imm);
        match h.kind {
            K_SEND => match (frame.nak, frame.recv, frame.sink) {
                (Some(status), Some(r), _) => {
                    let local = if status == WcStatus::RemoteInvalidRequest {
                        WcStatus::LocalLength
                    } else {
                        WcStatus::LocalProtection
                    };
                    self.complete_recv(r.wr_id, local, WcOpcode::Recv, h.len, imm);
                    self.nak(h.psn, status, rx);
                }
                (None, Some(r), _) => {
                    self.complete_recv(r.wr_id, WcStatus::Success, WcOpcode::Recv, h.len, imm);
                    self.ack(h);
                }
                (Some(status), None, _) => self.nak(h.psn, status, rx),
                (_, None, Sink::Buffer(payload)) => {
                    rx.held_bytes += payload.len();
                    rx.held.push_back(Held::Send { header: h, payload });
                    self.check_held(rx, h.psn);
                }
                _ => {}
            },
            K_WRITE => {
                if let Some(status) = frame.nak {
                    self.nak(h.psn, status, rx);
                    return;
                }
                if imm.is_some() {
                    rx.held.push_back(Held::Imm { header: h });
                    self.drain_held(rx);
                } else {
                    self.ack(h);
                }
            }
            K_READ_REQ => {
                let len = h.imm as u64;
                match self.remote(h.addr, len, h.rkey, Access::REMOTE_READ) {
                    Some((region, offset)) => {
                        let head = Header {
                            kind: K_READ_RESP,
                            len: len as u32,
                            psn: h.psn,
                            ..Header::default()
                        };
                        let payload = if len <= INLINE {
                            let mut v = vec![0u8; len as usize];
                            let _ = region.read(offset, &mut v);
                            Payload::Inline(v)
                        } else {
                            Payload::Region(region, offset, len)
                        };
                        let mut tx = self.tx.lock();
                        self.enqueue(
                            &mut tx,
                            OutFrame {
                                head: head.encode(),
                                payload,
                                sent: 0,
                            },
                        );
                    }
                    None => self.nak(h.psn, WcStatus::RemoteAccess, rx),
                }
            }
            K_READ_RESP => {
                if let Some(o) = frame.read {
                    match frame.nak {
                        None => self.complete_send(&o, WcStatus::Success, h.len),
                        Some(status) => {
                            let mut tx = self.tx.lock();
                            tx.outstanding.push_front(o);
                            let first = Some((h.psn, status));
                            self.fail(first, &mut tx, Some(rx));
                        }
                    }
                }
            }
            K_ACK => {
                let mut tx = self.tx.lock();
                while tx
                    .outstanding
                    .front()
                    .is_some_and(|o| o.psn <= h.psn && o.read.is_none())
                {
                    let o = tx.outstanding.pop_front().expect("checked");
                    self.complete_send(&o, WcStatus::Success, 0);
                }
            }
            K_NAK => {
                let mut tx = self.tx.lock();
                // Everything before the refused request was carried out.
                while tx
                    .outstanding
                    .front()
                    .is_some_and(|o| o.psn < h.psn && o.read.is_none())
                {
                    let o = tx.outstanding.pop_front().expect("checked");
                    self.complete_send(&o, WcStatus::Success, 0);
                }
                self.fail(Some((h.psn, status_of(h.imm))), &mut tx, Some(rx));
            }
            _ => {
                // Not a frame this version sends: the peer is broken.
                let mut tx = self.tx.lock();
                self.fail(None, &mut tx, Some(rx));
            }
        }
    }

    pub(super) fn ack(&self, h: Header) {
        if h.flags & F_ACK_REQ == 0 {
            return;
        }
        let head = Header {
            kind: K_ACK,
            psn: h.psn,
            ..Header::default()
        };
        let mut tx = self.tx.lock();
        self.enqueue(
            &mut tx,
            OutFrame {
                head: head.encode(),
                payload: Payload::None,
                sent: 0,
            },
        );
    }

    /// Refuses request `psn`: the requester hears why, and this side moves to the
    /// error state too (as a responder does on an access error).
    pub(super) fn nak(&self, psn: u64, status: WcStatus, rx: &mut Rx) {
        let head = Header {
            kind: K_NAK,
            psn,
            imm: status_code(status),
            ..Header::default()
        };
        let mut tx = self.tx.lock();
        // A frame half on the wire is finished first, or the peer would read the NAK
        // as the rest of its payload.
        let keep = usize::from(tx.queue.front().is_some_and(|f| f.sent > 0));
        tx.queue.truncate(keep);
        tx.queue.push_back(OutFrame {
            head: head.encode(),
            payload: Payload::None,
            sent: 0,
        });
        self.fail(None, &mut tx, Some(rx));
        self.flush(&mut tx);
    }

    pub(super) fn check_held(&self, rx: &mut Rx, psn: u64) {
        if rx.held_bytes > MAX_HELD_BYTES {
            tracing::warn!(
                qp = self.num,
                "peer kept no receive posted: receiver-not-ready limit"
            );
            self.nak(psn, WcStatus::RnrRetryExceeded, rx);
            return;
        }
        self.drain_held(rx);
    }

    /// Matches held SENDs and WRITE_WITH_IMMs with posted receives, in order.
    pub(super) fn drain_held(&self, rx: &mut Rx) {
        while !rx.held.is_empty() {
            let Some(r) = rx.recvs.pop_front() else {
                return;
            };
            match rx.held.pop_front().expect("checked") {
                Held::Imm { header } => {
                    self.complete_recv(
                        r.wr_id,
                        WcStatus::Success,
                        WcOpcode::RecvRdmaWithImm,
                        header.len,
                        Some(header.imm),
                    );
                    self.ack(header);
                }
                Held::Send { header, payload } => {
                    rx.held_bytes -= payload.len();
                    let imm = (header.flags & F_IMM != 0).then_some(header.imm);
                    if payload.len() > r.sge.len as usize {
                        self.complete_recv(
                            r.wr_id,
                            WcStatus::LocalLength,
                            WcOpcode::Recv,
                            header.len,
                            imm,
                        );
                        self.nak(header.psn, WcStatus::RemoteInvalidRequest, rx);
                        return;
                    }
                    match self.local(
                        r.sge.addr,
                        payload.len() as u64,
                        r.sge.lkey,
                        Access::LOCAL_WRITE,
                    ) {
                        Some((region, offset)) => {
                            let _ = region.write(offset, &payload);
                            self.complete_recv(
                                r.wr_id,
                                WcStatus::Success,
                                WcOpcode::Recv,
                                header.len,
                                imm,
                            );
                            self.ack(header);
                        }
                        None => {
                            self.complete_recv(
                                r.wr_id,
                                WcStatus::LocalProtection,
                                WcOpcode::Recv,
                                header.len,
                                imm,
                            );
                            self.nak(header.psn, WcStatus::RemoteOperation, rx);
                            return;
                        }
                    }
                }
            }
        }
    }
}

//! The sending side of a queue pair: frames queued, held, gathered into one write and
//! flushed as the socket takes them.

use super::*;

impl QpInner {
    pub(super) fn enqueue(&self, tx: &mut Tx, frame: OutFrame) {
        tx.queue.push_back(frame);
        if self.send_cq.holding.load(Ordering::Relaxed) {
            if !tx.held {
                tx.held = true;
                self.send_cq.held.lock().push(self.num);
            }
            return;
        }
        self.flush(tx);
    }

    /// Writes the queue's leading frames that carry no region payload (heads and
    /// inline payloads, up to [`GATHER`] frames) in one vectored write; returns the
    /// bytes written, or `None` if the first frame is not of that kind.
    pub(super) fn write_gathered(&self, tx: &Tx) -> Option<std::io::Result<usize>> {
        let mut slices: [IoSlice<'_>; 2 * GATHER] = [IoSlice::new(&[]); 2 * GATHER];
        let mut n = 0;
        for frame in tx.queue.iter().take(GATHER) {
            let payload: &[u8] = match &frame.payload {
                Payload::None => &[],
                Payload::Inline(v) => v,
                Payload::Region(..) => break,
            };
            let sent = frame.sent as usize;
            if sent < FRAME_HEADER {
                slices[n] = IoSlice::new(&frame.head[sent..]);
                n += 1;
                if !payload.is_empty() {
                    slices[n] = IoSlice::new(payload);
                    n += 1;
                }
            } else {
                slices[n] = IoSlice::new(&payload[sent - FRAME_HEADER..]);
                n += 1;
            }
        }
        if n < 2 {
            // One slice or none: the frame-by-frame path does as well.
            return None;
        }
        Some(self.write_vectored(&slices[..n]))
    }

    /// Accounts `n` written bytes to the queue's leading frames.
    pub(super) fn advance(&self, tx: &mut Tx, mut n: u64) {
        while n > 0 {
            let Some(frame) = tx.queue.front_mut() else {
                return;
            };
            let step = (frame.total() - frame.sent).min(n);
            frame.sent += step;
            n -= step;
            if frame.sent >= frame.total() {
                tx.queue.pop_front();
            }
        }
    }

    /// Writes queued frames until done or the socket is full: runs of small frames
    /// in one vectored write, region payloads straight from their memory.
    pub(super) fn flush(&self, tx: &mut Tx) {
        // Ciphertext from before goes first: frames behind it must not overtake it.
        if let Some(tls) = &self.tls
            && tls.pending()
        {
            match tls.push(&mut &self.sock) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.set_writable_interest(tx, true);
                    return;
                }
                Err(_) => {
                    self.connection_lost(tx, None);
                    return;
                }
            }
        }
        while !tx.queue.is_empty() {
            if tx.queue.len() > 1
                && let Some(result) = self.write_gathered(tx)
            {
                match result {
                    Ok(0) => {
                        self.fail(None, tx, None);
                        return;
                    }
                    Ok(n) => {
                        self.advance(tx, n as u64);
                        if tx.queue.is_empty() && self.error.load(Ordering::SeqCst) {
                            self.shutdown_write();
                        }
                        continue;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        self.set_writable_interest(tx, true);
                        return;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        self.connection_lost(tx, None);
                        return;
                    }
                }
            }
            let frame = tx.queue.front_mut().expect("not empty");
            let total = frame.total();
            let result = if frame.sent < FRAME_HEADER as u64 {
                let head = &frame.head[frame.sent as usize..];
                match &frame.payload {
                    Payload::Inline(v) => {
                        self.write_vectored(&[IoSlice::new(head), IoSlice::new(v)])
                    }
                    _ => self.write_vectored(&[IoSlice::new(head)]),
                }
            } else {
                let done = frame.sent - FRAME_HEADER as u64;
                match &frame.payload {
                    Payload::None => Ok(0),
                    Payload::Inline(v) => self.write_vectored(&[IoSlice::new(&v[done as usize..])]),
                    Payload::Region(region, offset, len) => {
                        self.write_region(region, offset + done, (len - done).min(4 << 20))
                    }
                }
            };
            match result {
                Ok(0) if total > frame.sent => {
                    self.fail(None, tx, None);
                    return;
                }
                Ok(n) => {
                    let frame = tx.queue.front_mut().expect("present");
                    frame.sent += n as u64;
                    if frame.sent >= total {
                        tx.queue.pop_front();
                        if tx.queue.is_empty() && self.error.load(Ordering::SeqCst) {
                            // The last word of a failed queue pair is out: the peer
                            // learns the connection is over.
                            self.shutdown_write();
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // A large frame is mid-way: wait a little for room rather than
                    // leave it to a poller that must first be woken. Bounded, so two
                    // sides writing to each other at once cannot wait on each other.
                    if total - frame.sent >= DIRECT_READ
                        && self.wait_writable(Duration::from_micros(500))
                    {
                        continue;
                    }
                    self.set_writable_interest(tx, true);
                    return;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.connection_lost(tx, None);
                    return;
                }
            }
        }
        // Encrypted bytes the socket did not take yet keep the write interest.
        let pending = self.tls.as_ref().is_some_and(|t| t.pending());
        self.set_writable_interest(tx, pending);
    }

    /// The connection broke: what is outstanding fails (the first with "retry
    /// exceeded", as a NIC reports a peer that stopped answering).
    pub(super) fn connection_lost(&self, tx: &mut Tx, rx: Option<&mut Rx>) {
        let first = tx
            .outstanding
            .front()
            .map(|o| (o.psn, WcStatus::RetryExceeded));
        self.fail(first, tx, rx);
    }

    /// Writes through TLS when the connection has it.
    fn write_vectored(&self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        match &self.tls {
            Some(tls) => tls.write_vectored(&mut &self.sock, bufs),
            None => (&self.sock).write_vectored(bufs),
        }
    }

    /// Writes up to `len` bytes of a registered region.
    fn write_region(&self, region: &SharedRegion, offset: u64, len: u64) -> std::io::Result<usize> {
        let Some(tls) = &self.tls else {
            // Straight from the registered memory, as a NIC reads it.
            return region.write_to(self.sock.as_fd(), offset, len as usize);
        };
        // TLS encrypts from a copy: a record at a time.
        let mut chunk = [0u8; 16 << 10];
        let n = (len as usize).min(chunk.len());
        region
            .read(offset, &mut chunk[..n])
            .map_err(std::io::Error::other)?;
        tls.write_vectored(&mut &self.sock, &[IoSlice::new(&chunk[..n])])
    }

    /// Ends the sending direction once what is encrypted is out (best effort).
    fn shutdown_write(&self) {
        if let Some(tls) = &self.tls {
            let _ = tls.push(&mut &self.sock);
        }
        let _ = self.sock.shutdown(std::net::Shutdown::Write);
    }

    pub(super) fn wait_writable(&self, timeout: Duration) -> bool {
        let mut fds = [rustix::event::PollFd::new(
            &self.sock,
            rustix::event::PollFlags::OUT,
        )];
        let ts = rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: timeout.as_nanos() as i64,
        };
        matches!(rustix::event::poll(&mut fds, Some(&ts)), Ok(n) if n > 0)
    }

    pub(super) fn set_writable_interest(&self, tx: &mut Tx, on: bool) {
        if tx.want_writable == on {
            return;
        }
        tx.want_writable = on;
        let mut flags = epoll::EventFlags::IN | epoll::EventFlags::RDHUP;
        if on {
            flags |= epoll::EventFlags::OUT;
        }
        for cq in self.cqs() {
            let _ = epoll::modify(
                &cq.epoll,
                &self.sock,
                epoll::EventData::new_u64(self.num as u64),
                flags,
            );
        }
    }
}

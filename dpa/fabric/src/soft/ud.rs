//! UD queue pairs of the software fabric: UDP datagrams, as RoCEv2 carries them.
//!
//! A queue pair binds one UDP socket (its port stands for RoCEv2's 4791) and
//! receives there; a datagram carries a small header in place of the BTH/DETH
//! (destination and source queue pair, Q_Key, immediate data, the flow label and the
//! sender's port for answers). Receives are stamped with the kernel's arrival time
//! (`rxstamp`), as a NIC stamps its CQEs. Sends with a flow label leave from a UDP socket of
//! their own per label, so different labels are different 5-tuples to the network,
//! as a NIC derives the UDP source port from the label. Progress is driven by
//! `poll`/`wait`, like the rest of this fabric.

use std::net::UdpSocket;
use std::sync::atomic::AtomicU64;

use super::*;
use crate::ud::{
    AddressVector, DatagramFabric, GRH_LEN, Gid, UD_MTU, UdCompletion, UdCounters, UdQueuePair,
    UdSendWr, encode_grh, now_ns,
};

const UD_MAGIC: [u8; 4] = *b"DPUD";
const UD_VERSION: u8 = 1;
const UD_HEADER: usize = 28;
const F_UD_IMM: u8 = 1;
/// Entropy sockets kept per queue pair (each one flow label's source port).
const MAX_ENTROPY_SOCKETS: usize = 256;
/// Datagrams read per progress pass.
const RECV_BATCH: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct UdHeader {
    flags: u8,
    src_port: u16,
    dst_qpn: u32,
    src_qpn: u32,
    qkey: u32,
    imm: u32,
    flow_label: u32,
}

impl UdHeader {
    fn encode(&self) -> [u8; UD_HEADER] {
        let mut b = [0u8; UD_HEADER];
        b[0..4].copy_from_slice(&UD_MAGIC);
        b[4] = UD_VERSION;
        b[5] = self.flags;
        b[6..8].copy_from_slice(&self.src_port.to_le_bytes());
        b[8..12].copy_from_slice(&self.dst_qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.src_qpn.to_le_bytes());
        b[16..20].copy_from_slice(&self.qkey.to_le_bytes());
        b[20..24].copy_from_slice(&self.imm.to_le_bytes());
        b[24..28].copy_from_slice(&self.flow_label.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < UD_HEADER || b[0..4] != UD_MAGIC || b[4] != UD_VERSION {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Some(Self {
            flags: b[5],
            src_port: u16::from_le_bytes([b[6], b[7]]),
            dst_qpn: u32_at(8),
            src_qpn: u32_at(12),
            qkey: u32_at(16),
            imm: u32_at(20),
            flow_label: u32_at(24) & 0xF_FFFF,
        })
    }
}

/// For the fuzzer: whether `bytes` decode as a UD datagram's header, and if they do,
/// whether it encodes back to what decodes the same. Never panics.
#[doc(hidden)]
pub fn check_ud_header(bytes: &[u8]) -> bool {
    match UdHeader::decode(bytes) {
        Some(h) => UdHeader::decode(&h.encode()) == Some(h),
        None => true,
    }
}

/// A UDP socket and the IP TTL last set on it.
#[derive(Debug)]
struct SendSocket {
    sock: UdpSocket,
    ttl: u8,
}

#[derive(Debug)]
struct UdInner {
    num: u32,
    qkey: u32,
    local: AddressVector,
    pd: Arc<PdInner>,
    caps: QpCaps,
    sock: UdpSocket,
    main_ttl: Mutex<u8>,
    entropy: Mutex<HashMap<u32, SendSocket>>,
    recvs: Mutex<VecDeque<RecvWr>>,
    /// The receive buffers of `progress` (one reader at a time).
    reader: Mutex<Reader>,
    /// The frame a send is built in.
    send_buf: Mutex<Vec<u8>>,
    completions: Mutex<VecDeque<UdCompletion>>,
    no_receive: AtomicU64,
    rejected: AtomicU64,
}

/// What `progress` reads into, kept across passes.
#[derive(Debug)]
struct Reader {
    batch: super::rxstamp::Batch,
    got: Vec<super::rxstamp::Received>,
}

/// A UD queue pair of the software fabric.
#[derive(Debug)]
pub struct SoftUdQp {
    inner: Arc<UdInner>,
}

/// An address handle of the software fabric.
#[derive(Debug, Clone, Copy)]
pub struct SoftAh {
    av: AddressVector,
}

impl SoftAh {
    /// What it addresses.
    pub fn address(&self) -> AddressVector {
        self.av
    }
}

impl UdInner {
    fn push_completion(&self, wc: UdCompletion) {
        let mut c = self.completions.lock();
        let depth = (self.caps.max_send_wr + self.caps.max_recv_wr) as usize;
        if c.len() >= depth {
            tracing::error!(
                qp = self.num,
                depth,
                "UD completion queue overrun: completion lost"
            );
            return;
        }
        c.push_back(wc);
    }

    fn failed_send(&self, wr_id: u64, status: WcStatus) {
        self.push_completion(UdCompletion {
            wr_id,
            status,
            opcode: WcOpcode::Send,
            byte_len: 0,
            imm: None,
            src_qp: 0,
            src: None,
            udp_src_port: 0,
            timestamp_ns: now_ns(),
        });
    }

    /// Sends `frame` to `to` from the socket of `flow_label` with `ttl`; the UDP
    /// source port it left from.
    fn send_from(
        &self,
        flow_label: u32,
        ttl: u8,
        frame: &[u8],
        to: SocketAddr,
    ) -> std::io::Result<u16> {
        fn send(s: &mut SendSocket, ttl: u8, frame: &[u8], to: SocketAddr) -> std::io::Result<u16> {
            if s.ttl != ttl {
                s.sock.set_ttl(u32::from(ttl))?;
                s.ttl = ttl;
            }
            s.sock.send_to(frame, to)?;
            Ok(s.sock.local_addr()?.port())
        }
        if flow_label == 0 {
            let mut main_ttl = self.main_ttl.lock();
            if *main_ttl != ttl {
                self.sock.set_ttl(u32::from(ttl))?;
                *main_ttl = ttl;
            }
            self.sock.send_to(frame, to)?;
            return Ok(self.local.udp_port);
        }
        let mut entropy = self.entropy.lock();
        if !entropy.contains_key(&flow_label) {
            if entropy.len() >= MAX_ENTROPY_SOCKETS {
                // Any one: labels rotate, and a new socket is only a new source port.
                if let Some(&old) = entropy.keys().next() {
                    entropy.remove(&old);
                }
            }
            let sock = UdpSocket::bind(SocketAddr::new(self.local.gid.ip(), 0))?;
            entropy.insert(flow_label, SendSocket { sock, ttl: 64 });
        }
        let s = entropy.get_mut(&flow_label).expect("inserted above");
        send(s, ttl, frame, to)
    }

    /// Reads what arrived into posted receives: up to [`RECV_BATCH`] datagrams,
    /// [`rxstamp::BATCH`] per system call.
    fn progress(&self) {
        let mut reader = self.reader.lock();
        let Reader { batch, got } = &mut *reader;
        let mut read = 0;
        while read < RECV_BATCH {
            match super::rxstamp::recv_many(&self.sock, batch, got) {
                Ok(n) => read += n.max(1),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                // Interrupted, or an ICMP error reported on the socket (e.g. port
                // unreachable): a NIC sees none of them.
                Err(_) => {
                    read += 1;
                    continue;
                }
            }
            for r in got.iter() {
                self.deliver(r, batch.data(r.index, r.len));
            }
            if got.len() < super::rxstamp::BATCH {
                return;
            }
        }
    }

    /// One datagram into a posted receive, with its completion.
    fn deliver(&self, got: &super::rxstamp::Received, data: &[u8]) {
        let from = got.from;
        // The kernel's arrival time in this process's clock: now, less how long the
        // datagram waited in the socket (a NIC stamps its CQE on arrival too).
        let now = now_ns();
        let timestamp_ns = got
            .at
            .and_then(|at| std::time::SystemTime::now().duration_since(at).ok())
            .map_or(now, |waited| now.saturating_sub(waited.as_nanos() as u64));
        if got.truncated {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let Some(h) = UdHeader::decode(data) else {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let payload = &data[UD_HEADER..];
        if h.dst_qpn != self.num || h.qkey != self.qkey || payload.len() > UD_MTU {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let Some(wr) = self.recvs.lock().pop_front() else {
            self.no_receive.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let total = GRH_LEN + payload.len();
        let src_gid = Gid::from_ip(from.ip());
        let mut wc = UdCompletion {
            wr_id: wr.wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: total as u32,
            imm: (h.flags & F_UD_IMM != 0).then_some(h.imm),
            src_qp: h.src_qpn,
            src: Some(AddressVector {
                gid: src_gid,
                flow_label: h.flow_label,
                hop_limit: 64,
                udp_port: h.src_port,
            }),
            udp_src_port: from.port(),
            timestamp_ns,
        };
        let entry = self.pd.by_lkey.read().get(&wr.sge.lkey).cloned();
        let place = entry.and_then(|e| {
            if !e.access.contains(Access::LOCAL_WRITE) {
                return None;
            }
            e.locate(wr.sge.addr, u64::from(wr.sge.len))
                .map(|off| (e.region.clone(), off))
        });
        match place {
            None => wc.status = WcStatus::LocalProtection,
            Some(_) if total > wr.sge.len as usize => wc.status = WcStatus::LocalLength,
            Some((region, off)) => {
                let grh = encode_grh(
                    src_gid,
                    self.local.gid,
                    h.flow_label,
                    payload.len() as u16,
                    64,
                );
                if region.write(off, &grh).is_err()
                    || region.write(off + GRH_LEN as u64, payload).is_err()
                {
                    wc.status = WcStatus::LocalProtection;
                }
            }
        }
        self.push_completion(wc);
    }
}

impl UdQueuePair for SoftUdQp {
    type Ah = SoftAh;

    fn qp_num(&self) -> u32 {
        self.inner.num
    }

    fn stamps_sends_when_posted(&self) -> bool {
        true
    }

    fn qkey(&self) -> u32 {
        self.inner.qkey
    }

    fn local(&self) -> AddressVector {
        self.inner.local
    }

    fn post_send(&self, wr: UdSendWr<'_, SoftAh>) -> Result<(), FabricError> {
        let inner = &self.inner;
        let len = wr.sge.len as usize;
        if len > UD_MTU {
            inner.failed_send(wr.wr_id, WcStatus::LocalLength);
            return Ok(());
        }
        let entry = inner.pd.by_lkey.read().get(&wr.sge.lkey).cloned();
        let Some((region, off)) = entry.and_then(|e| {
            e.locate(wr.sge.addr, len as u64)
                .map(|off| (e.region.clone(), off))
        }) else {
            inner.failed_send(wr.wr_id, WcStatus::LocalProtection);
            return Ok(());
        };
        let av = wr.ah.av;
        let header = UdHeader {
            flags: if wr.imm.is_some() { F_UD_IMM } else { 0 },
            src_port: inner.local.udp_port,
            dst_qpn: wr.remote_qpn,
            src_qpn: inner.num,
            qkey: wr.remote_qkey,
            imm: wr.imm.unwrap_or(0),
            flow_label: av.flow_label & 0xF_FFFF,
        };
        // The queue pair's own send buffer: no allocation per datagram.
        let mut frame = inner.send_buf.lock();
        frame.clear();
        frame.extend_from_slice(&header.encode());
        frame.resize(UD_HEADER + len, 0);
        if region.read(off, &mut frame[UD_HEADER..]).is_err() {
            inner.failed_send(wr.wr_id, WcStatus::LocalProtection);
            return Ok(());
        }
        // Stamped as the datagram goes: a loopback or veth peer may receive (and
        // answer) it before the system call returns.
        let sent_at = now_ns();
        match inner.send_from(av.flow_label, av.hop_limit, &frame, av.socket_addr()) {
            Ok(port) => {
                if wr.signaled {
                    inner.push_completion(UdCompletion {
                        wr_id: wr.wr_id,
                        status: WcStatus::Success,
                        opcode: WcOpcode::Send,
                        byte_len: len as u32,
                        imm: None,
                        src_qp: 0,
                        src: None,
                        udp_src_port: port,
                        timestamp_ns: sent_at,
                    });
                }
            }
            Err(e) => {
                // The host could not put it on the wire (no route, interface down):
                // the send fails here, not somewhere in the network.
                tracing::debug!(qp = inner.num, to = %av.socket_addr(), error = %e, "UD send failed");
                inner.failed_send(wr.wr_id, WcStatus::General);
            }
        }
        Ok(())
    }

    fn post_recv(&self, wr: RecvWr) -> Result<(), FabricError> {
        let mut recvs = self.inner.recvs.lock();
        if recvs.len() >= self.inner.caps.max_recv_wr as usize {
            return Err(FabricError::QueueFull {
                qp: self.inner.num,
                which: "receive",
                limit: self.inner.caps.max_recv_wr,
            });
        }
        recvs.push_back(wr);
        Ok(())
    }

    fn poll(&self, out: &mut Vec<UdCompletion>, max: usize) -> usize {
        self.inner.progress();
        let mut c = self.inner.completions.lock();
        let n = c.len().min(max);
        out.extend(c.drain(..n));
        n
    }

    fn wait(&self, timeout: Duration) -> Result<bool, FabricError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.inner.progress();
            if !self.inner.completions.lock().is_empty() {
                return Ok(true);
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Ok(false);
            };
            let mut fds = [rustix::event::PollFd::new(
                &self.inner.sock,
                rustix::event::PollFlags::IN,
            )];
            let ts = rustix::fs::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as i64,
            };
            match rustix::event::poll(&mut fds, Some(&ts)) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(FabricError::Io(e.into())),
            }
        }
    }

    fn counters(&self) -> UdCounters {
        UdCounters {
            no_receive: self.inner.no_receive.load(Ordering::Relaxed),
            rejected: self.inner.rejected.load(Ordering::Relaxed),
        }
    }
}

impl DatagramFabric for SoftFabric {
    type Ah = SoftAh;
    type UdQp = SoftUdQp;

    fn create_ud_qp(
        &self,
        pd: &SoftPd,
        bind: SocketAddr,
        qkey: u32,
        caps: QpCaps,
    ) -> Result<SoftUdQp, FabricError> {
        if bind.ip().is_unspecified() {
            return Err(FabricError::Device {
                call: "create_ud_qp",
                detail: format!(
                    "{bind}: a UD queue pair needs the IP address of one interface (it is its GID)"
                ),
            });
        }
        let sock = UdpSocket::bind(bind).map_err(|e| FabricError::Device {
            call: "create_ud_qp",
            detail: format!("cannot bind UDP {bind}: {e}"),
        })?;
        sock.set_nonblocking(true)?;
        // Without the kernel's arrival times (qemu's user-mode emulation has no
        // SO_TIMESTAMPNS), receives are stamped when read: the owner's wake-up then
        // counts as network time, and the log says so once.
        if let Err(e) = super::rxstamp::enable(&sock) {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!(error = %e, "no kernel receive timestamps: UD receives are stamped when read");
            });
        }
        let local = sock.local_addr()?;
        // As a NIC's, a UD queue pair's number differs from one run of its owner to
        // the next (peers tell a restarted responder by it); 24 bits, never 0 or 1
        // (QP0 and QP1 are special in verbs).
        let mut raw = [0u8; 4];
        getrandom::fill(&mut raw).map_err(|e| FabricError::Device {
            call: "create_ud_qp",
            detail: format!("no randomness for the queue pair number: {e}"),
        })?;
        let num = (u32::from_le_bytes(raw) & 0xFF_FFFF).max(2);
        Ok(SoftUdQp {
            inner: Arc::new(UdInner {
                num,
                qkey,
                local: AddressVector::to(local),
                pd: pd.inner.clone(),
                caps,
                sock,
                main_ttl: Mutex::new(64),
                entropy: Mutex::new(HashMap::new()),
                recvs: Mutex::new(VecDeque::new()),
                send_buf: Mutex::new(Vec::with_capacity(UD_HEADER + UD_MTU)),
                reader: Mutex::new(Reader {
                    // One byte more than the largest datagram tells a cut one.
                    batch: super::rxstamp::Batch::new(UD_HEADER + UD_MTU + 1),
                    got: Vec::with_capacity(super::rxstamp::BATCH),
                }),
                completions: Mutex::new(VecDeque::new()),
                no_receive: AtomicU64::new(0),
                rejected: AtomicU64::new(0),
            }),
        })
    }

    fn create_ah(&self, _pd: &SoftPd, av: AddressVector) -> Result<SoftAh, FabricError> {
        if av.gid.ip().is_unspecified() || av.udp_port == 0 {
            return Err(FabricError::Device {
                call: "create_ah",
                detail: format!("{} is not an address to send to", av.socket_addr()),
            });
        }
        Ok(SoftAh { av })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ud::parse_grh;

    struct Side {
        _region: Arc<SharedRegion>,
        mr: SoftMr,
        qp: SoftUdQp,
        fabric: SoftFabric,
        pd: SoftPd,
    }

    fn side(qkey: u32) -> Side {
        let fabric = SoftFabric::new();
        let pd = fabric.alloc_pd().unwrap();
        let region = Arc::new(SharedRegion::create_unique("dpumesh-udtest", 64 << 10).unwrap());
        let mr = fabric
            .register(&pd, &region, 0, 64 << 10, Access::LOCAL_WRITE)
            .unwrap();
        let qp = fabric
            .create_ud_qp(&pd, "127.0.0.1:0".parse().unwrap(), qkey, QpCaps::default())
            .unwrap();
        Side {
            _region: region,
            mr,
            qp,
            fabric,
            pd,
        }
    }

    fn send(from: &Side, to: &Side, payload: &[u8], flow_label: u32, qkey: u32) {
        from.mr.entry.region.write(0, payload).unwrap();
        let mut av = to.qp.local();
        av.flow_label = flow_label;
        let ah = from.fabric.create_ah(&from.pd, av).unwrap();
        from.qp
            .post_send(UdSendWr {
                wr_id: 7,
                sge: from.mr.sge(0, payload.len() as u32),
                ah: &ah,
                remote_qpn: to.qp.qp_num(),
                remote_qkey: qkey,
                imm: Some(99),
                signaled: true,
            })
            .unwrap();
    }

    fn one(qp: &SoftUdQp) -> UdCompletion {
        assert!(qp.wait(Duration::from_secs(5)).unwrap(), "no completion");
        let mut out = Vec::new();
        qp.poll(&mut out, 1);
        out[0]
    }

    #[test]
    fn a_datagram_lands_after_its_grh_with_the_sender_to_answer() {
        let (a, b) = (side(0x1111), side(0x1111));
        b.qp.post_recv(RecvWr {
            wr_id: 3,
            sge: b.mr.sge(1024, 1024),
        })
        .unwrap();
        send(&a, &b, b"probe", 0x777, 0x1111);
        let sent = one(&a.qp);
        assert_eq!((sent.wr_id, sent.status), (7, WcStatus::Success));
        assert_ne!(
            sent.udp_src_port,
            a.qp.local().udp_port,
            "a flow label has its own port"
        );
        let got = one(&b.qp);
        assert_eq!(
            (got.wr_id, got.status, got.opcode),
            (3, WcStatus::Success, WcOpcode::Recv)
        );
        assert_eq!(got.byte_len as usize, GRH_LEN + 5);
        assert_eq!(got.imm, Some(99));
        assert_eq!(got.src_qp, a.qp.qp_num());
        assert_eq!(got.udp_src_port, sent.udp_src_port);
        let src = got.src.unwrap();
        assert_eq!(
            src.udp_port,
            a.qp.local().udp_port,
            "answers go to the sender's port"
        );
        assert_eq!(src.flow_label, 0x777);
        let bytes = b.mr.entry.region.read_vec(1024, GRH_LEN + 5).unwrap();
        assert_eq!(parse_grh(&bytes), Some((a.qp.local().gid, 0x777)));
        assert_eq!(&bytes[GRH_LEN..], b"probe");
    }

    #[test]
    fn a_wrong_qkey_or_no_receive_is_dropped_and_counted() {
        let (a, b) = (side(1), side(2));
        b.qp.post_recv(RecvWr {
            wr_id: 1,
            sge: b.mr.sge(0, 1024),
        })
        .unwrap();
        send(&a, &b, b"x", 0, 1);
        assert!(!b.qp.wait(Duration::from_millis(200)).unwrap());
        assert_eq!(b.qp.counters().rejected, 1);
        send(&a, &b, b"x", 0, 2);
        one(&b.qp);
        send(&a, &b, b"y", 0, 2);
        assert!(!b.qp.wait(Duration::from_millis(200)).unwrap());
        assert_eq!(b.qp.counters().no_receive, 1);
    }

    #[test]
    fn a_receive_too_small_for_grh_and_message_fails_with_local_length() {
        let (a, b) = (side(1), side(1));
        b.qp.post_recv(RecvWr {
            wr_id: 1,
            sge: b.mr.sge(0, GRH_LEN as u32 + 2),
        })
        .unwrap();
        send(&a, &b, b"abc", 0, 1);
        assert_eq!(one(&b.qp).status, WcStatus::LocalLength);
    }

    #[test]
    fn a_message_over_the_mtu_or_outside_its_region_fails_locally() {
        let a = side(1);
        let ah = a.fabric.create_ah(&a.pd, a.qp.local()).unwrap();
        for (sge, status) in [
            (a.mr.sge(0, UD_MTU as u32 + 1), WcStatus::LocalLength),
            (a.mr.sge(64 << 10, 8), WcStatus::LocalProtection),
        ] {
            a.qp.post_send(UdSendWr {
                wr_id: 1,
                sge,
                ah: &ah,
                remote_qpn: 1,
                remote_qkey: 1,
                imm: None,
                signaled: true,
            })
            .unwrap();
            assert_eq!(one(&a.qp).status, status);
        }
    }

    #[test]
    fn garbage_on_the_port_is_rejected_not_delivered() {
        let b = side(1);
        b.qp.post_recv(RecvWr {
            wr_id: 1,
            sge: b.mr.sge(0, 1024),
        })
        .unwrap();
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        for junk in [&b""[..], b"DPUD", &[0xffu8; 40][..]] {
            s.send_to(junk, b.qp.local().socket_addr()).unwrap();
        }
        assert!(!b.qp.wait(Duration::from_millis(200)).unwrap());
        assert_eq!(b.qp.counters().rejected, 3);
    }

    #[test]
    fn an_unspecified_bind_address_is_refused() {
        let f = SoftFabric::new();
        let pd = f.alloc_pd().unwrap();
        let err = f
            .create_ud_qp(&pd, "0.0.0.0:0".parse().unwrap(), 1, QpCaps::default())
            .unwrap_err();
        assert!(err.to_string().contains("needs the IP address"), "{err}");
    }
}

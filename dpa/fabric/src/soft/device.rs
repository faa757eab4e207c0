//! The device: protection domains, registration, queues, connecting and listening
//! (with the hello that pairs queue pair numbers).

use super::*;

impl Default for SoftFabric {
    fn default() -> Self {
        Self::new()
    }
}

impl SoftFabric {
    /// How long a completion queue's `wait` polls before sleeping, by default.
    /// Zero: on few cores a spinning poller takes the CPU the peer needs (measured:
    /// 30 µs of spin made small round trips slower on a 2-core machine).
    pub const DEFAULT_SPIN: Duration = Duration::ZERO;

    /// A device.
    pub fn new() -> Self {
        Self {
            next_qp: Arc::new(AtomicU32::new(1)),
            spin: Self::DEFAULT_SPIN,
            tls: None,
        }
    }

    /// Every connection from now on runs over mutual TLS with these certificates
    /// (`None`: plain TCP): peers must prove a node or ingress identity of the mesh.
    pub fn with_tls(mut self, tls: Option<Arc<dpumesh_identity::MeshTls>>) -> Self {
        self.tls = tls;
        self
    }

    /// Completion queues created from now on poll for `spin` before sleeping (zero:
    /// sleep at once, the low-CPU mode).
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    pub(super) fn key(&self) -> u32 {
        let mut b = [0u8; 4];
        if getrandom::fill(&mut b).is_err() {
            // Keys need not be secret to be checked; unpredictable is a bonus.
            b = (Instant::now().elapsed().subsec_nanos() ^ 0x9e37_79b9).to_le_bytes();
        }
        u32::from_le_bytes(b) | 1
    }

    pub(super) fn make_qp(
        &self,
        pd: &SoftPd,
        sock: TcpStream,
        peer: SocketAddr,
        cq: &SoftCq,
        caps: QpCaps,
        session: Option<(dpumesh_identity::Connection, dpumesh_identity::SpiffeId)>,
    ) -> Result<SoftQp, FabricError> {
        let (tls, peer_id) = match session {
            Some((conn, id)) => (Some(dpumesh_identity::TlsSession::new(conn)), Some(id)),
            None => (None, None),
        };
        sock.set_nodelay(true)?;
        sock.set_nonblocking(true)?;
        let num = self.next_qp.fetch_add(1, Ordering::Relaxed);
        let inner = Arc::new(QpInner {
            num,
            peer,
            pd: pd.inner.clone(),
            send_cq: cq.inner.clone(),
            recv_cq: cq.inner.clone(),
            sock,
            tls,
            peer_id,
            caps,
            error: AtomicBool::new(false),
            tx: Mutex::new(Tx::default()),
            rx: Mutex::new(Rx::new()),
        });
        cq.inner.qps.write().insert(num, Arc::downgrade(&inner));
        epoll::add(
            &cq.inner.epoll,
            &inner.sock,
            epoll::EventData::new_u64(num as u64),
            epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
        )
        .map_err(|e| FabricError::Io(e.into()))?;
        Ok(SoftQp { inner })
    }
}

/// Reads a peer's 16-byte hello: whether it wants mutual TLS, or why it is not a
/// peer of this build. (Public for the fuzz target: it is what a stranger's bytes meet
/// first on a fabric port.)
pub fn parse_hello(got: &[u8]) -> Result<bool, String> {
    hello_prefix(got)?;
    match hello_word(got, 12)? {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(format!("the peer's hello asks for security mode {other}")),
    }
}

fn hello_word(got: &[u8], i: usize) -> Result<u32, String> {
    got.get(i..i + 4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| format!("a hello is 16 bytes, got {}", got.len()))
}

/// Checks a hello's magic and version (its first 8 bytes).
fn hello_prefix(got: &[u8]) -> Result<(), String> {
    let word = |i| hello_word(got, i);
    if word(0)? != HELLO_MAGIC {
        return Err("the peer is not a DPUmesh software fabric endpoint".into());
    }
    let version = word(4)?;
    if version != HELLO_VERSION {
        return Err(format!(
            "software fabric version mismatch: this side speaks {HELLO_VERSION}, the peer {version}"
        ));
    }
    Ok(())
}

/// Exchanges hellos (magic, version, and whether mutual TLS follows), then runs the
/// TLS handshake when this side has certificates. Blocking, with a 10 s limit on
/// each read.
pub(super) fn hello(
    sock: &mut TcpStream,
    tls: Option<&dpumesh_identity::MeshTls>,
    accepting: bool,
) -> std::io::Result<Option<(dpumesh_identity::Connection, dpumesh_identity::SpiffeId)>> {
    let mut out = [0u8; 16];
    out[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&HELLO_VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&u32::from(tls.is_some()).to_le_bytes());
    sock.set_read_timeout(Some(Duration::from_secs(10)))?;
    sock.set_write_timeout(Some(Duration::from_secs(10)))?;
    sock.write_all(&out)?;
    let mut got = [0u8; 16];
    // Magic and version first: a peer of another version may send fewer bytes.
    sock.read_exact(&mut got[..8])?;
    hello_prefix(&got[..8]).map_err(std::io::Error::other)?;
    sock.read_exact(&mut got[8..])?;
    let peer_tls = parse_hello(&got).map_err(std::io::Error::other)?;
    let session = match (tls, peer_tls) {
        (None, false) => None,
        (Some(_), false) => {
            return Err(std::io::Error::other(
                "the peer runs without mutual TLS and this side requires it: give every part of the mesh its certificates",
            ));
        }
        (None, true) => {
            return Err(std::io::Error::other(
                "the peer requires mutual TLS and this side has no certificates",
            ));
        }
        (Some(tls), true) => {
            let done = if accepting {
                tls.accept(sock)
            } else {
                tls.connect(sock)
            };
            Some(done.map_err(std::io::Error::other)?)
        }
    };
    sock.set_read_timeout(None)?;
    sock.set_write_timeout(None)?;
    Ok(session)
}

impl QpListener for SoftListener {
    type Qp = SoftQp;
    type Cq = SoftCq;

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&self, timeout: Duration) -> Result<Option<SoftQp>, FabricError> {
        self.accept_on(&self.cq, timeout)
    }

    fn accept_on(&self, cq: &SoftCq, timeout: Duration) -> Result<Option<SoftQp>, FabricError> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.listener.accept() {
                Ok((mut sock, peer)) => {
                    sock.set_nonblocking(false)?;
                    let session = match hello(&mut sock, self.fabric.tls.as_deref(), true) {
                        Ok(session) => session,
                        Err(e) => {
                            tracing::warn!(%peer, error = %e, "refused a fabric connection");
                            continue;
                        }
                    };
                    return self
                        .fabric
                        .make_qp(&self.pd, sock, peer, cq, self.caps, session)
                        .map(Some);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

impl Fabric for SoftFabric {
    type Pd = SoftPd;
    type Mr = SoftMr;
    type Cq = SoftCq;
    type Qp = SoftQp;
    type Listener = SoftListener;

    fn name(&self) -> &'static str {
        "software (TCP)"
    }

    fn alloc_pd(&self) -> Result<SoftPd, FabricError> {
        Ok(SoftPd::default())
    }

    fn register(
        &self,
        pd: &SoftPd,
        region: &Arc<SharedRegion>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<SoftMr, FabricError> {
        if len == 0
            || offset
                .checked_add(len)
                .is_none_or(|end| end > region.len() as u64)
        {
            return Err(FabricError::Register(format!(
                "{len} bytes at offset {offset} do not fit region {} of {} bytes",
                region.name(),
                region.len()
            )));
        }
        let entry = Arc::new(MrEntry {
            region: region.clone(),
            offset,
            len,
            addr: region.base_addr() + offset,
            access,
        });
        let (mut lkey, mut rkey) = (self.key(), self.key());
        {
            let mut by_lkey = pd.inner.by_lkey.write();
            while by_lkey.contains_key(&lkey) {
                lkey = self.key();
            }
            by_lkey.insert(lkey, entry.clone());
        }
        {
            let mut by_rkey = pd.inner.by_rkey.write();
            while by_rkey.contains_key(&rkey) {
                rkey = self.key();
            }
            by_rkey.insert(rkey, entry.clone());
        }
        Ok(SoftMr {
            pd: pd.inner.clone(),
            entry,
            lkey,
            rkey,
        })
    }

    fn create_cq(&self, depth: u32) -> Result<SoftCq, FabricError> {
        let io = |e: rustix::io::Errno| FabricError::Io(e.into());
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(io)?;
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(io)?;
        epoll::add(
            &epoll,
            wake.as_fd(),
            epoll::EventData::new_u64(WAKE_TOKEN),
            epoll::EventFlags::IN,
        )
        .map_err(io)?;
        Ok(SoftCq {
            inner: Arc::new(CqInner {
                entries: Mutex::new(VecDeque::new()),
                spin: self.spin,
                depth: depth.max(1) as usize,
                epoll,
                wake,
                sleepers: AtomicUsize::new(0),
                interrupted: AtomicBool::new(false),
                qps: RwLock::new(HashMap::new()),
                overflowed: AtomicBool::new(false),
                holding: AtomicBool::new(false),
                held: Mutex::new(Vec::new()),
            }),
        })
    }

    fn listen(
        &self,
        pd: &SoftPd,
        addr: SocketAddr,
        cq: &SoftCq,
        caps: QpCaps,
    ) -> Result<SoftListener, FabricError> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        Ok(SoftListener {
            fabric: self.clone(),
            pd: pd.clone(),
            cq: cq.clone(),
            caps,
            listener,
            addr,
        })
    }

    fn connect(
        &self,
        pd: &SoftPd,
        addr: SocketAddr,
        cq: &SoftCq,
        caps: QpCaps,
    ) -> Result<SoftQp, FabricError> {
        let connect_err = |detail: String| FabricError::Connect { addr, detail };
        let mut sock = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
            .map_err(|e| connect_err(e.to_string()))?;
        let session =
            hello(&mut sock, self.tls.as_deref(), false).map_err(|e| connect_err(e.to_string()))?;
        self.make_qp(pd, sock, addr, cq, caps, session)
    }
}

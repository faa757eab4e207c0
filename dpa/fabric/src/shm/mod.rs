//! The shared-memory fabric: verbs semantics between processes on one host, with no
//! system call on the data path while both ends are busy.
//!
//! - **Memory regions** are shared-memory files; each protection domain publishes
//!   its registrations in a region table ([`mr`]) the peer maps. RDMA WRITE and READ
//!   are copies the initiator makes between the two mappings after checking the key,
//!   the bounds and the access right — the target's CPU takes no part, as with a NIC.
//! - **Queue pairs** ([`qp`]) are a shared segment holding, for each side, the
//!   receives it posted and the completions the other side produced for it. A SEND
//!   lands in the peer's next posted receive.
//! - **Completion queues** ([`cq`]) wake on a bell (an eventfd plus a `waiting` word in
//!   shared memory): a peer writes the eventfd only while the queue's owner sleeps.
//!
//! Peers find each other by the fabric address of the mesh file: a listener holds that
//! TCP address (so it names one node on the host) and accepts on the abstract Unix
//! socket named after it, where the handshake passes each side's bell eventfd and the
//! paths of the segment, the bells and the region tables. The socket stays open: it
//! closing is how a side learns the other is gone. Abstract sockets belong to a network
//! namespace, so both ends must share one; peers on other hosts use the TCP fabric.
//!
//! Any process of the namespace can connect to an abstract socket, so with
//! certificates ([`ShmFabric::with_tls`]) the handshake starts with mutual TLS on
//! the socket: no region table or bell is exported before the peer proved a node or
//! ingress identity. A connected Unix socket cannot be taken over, so the plain
//! exchange after it still comes from the peer that proved itself. With
//! certificates the listener also checks the peer's credentials (`SO_PEERCRED`):
//! the same user, or root.

mod cq;
mod mr;
mod qp;

use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use self::cq::CqInner;
use self::mr::{MrTable, PeerRegions};
use self::qp::{PeerParts, QpInner};
use super::{
    Access, CompletionQueue, Fabric, FabricError, Interrupter, MemoryRegion, QpCaps, QpListener,
    QpState, QueuePair, RecvWr, SendWr, WorkCompletion,
};
use dpumesh_rings::bell::Bell;
use dpumesh_rings::fdpass;
use dpumesh_rings::shm::SharedRegion;

const HELLO_MAGIC: &[u8; 4] = b"DPSF";
const HELLO_VERSION: u8 = 1;
/// How long a handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The abstract socket name of the listener at `addr`.
fn socket_name(addr: SocketAddr) -> String {
    format!("dpumesh-shm-fabric-{addr}")
}

/// A protection domain: its region table.
#[derive(Debug, Clone)]
pub struct ShmPd {
    table: Arc<MrTable>,
}

/// A registered region; withdrawn from the table when dropped.
#[derive(Debug)]
pub struct ShmMr {
    table: Arc<MrTable>,
    key: u32,
    addr: u64,
    len: u64,
}

impl MemoryRegion for ShmMr {
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> u64 {
        self.len
    }
}

impl Drop for ShmMr {
    fn drop(&mut self) {
        self.table.deregister(self.key);
    }
}

/// A completion queue of the shared-memory fabric.
#[derive(Debug, Clone)]
pub struct ShmCq {
    inner: Arc<CqInner>,
}

impl CompletionQueue for ShmCq {
    fn interrupter(&self) -> Interrupter {
        self.inner.interrupter()
    }

    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        self.inner.poll(out, max)
    }

    fn wait(&self, timeout: Duration) -> Result<bool, FabricError> {
        self.inner.wait(timeout)
    }

    fn wait_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        Some(self.inner.wait_fd())
    }

    fn prepare_sleep(&self) -> bool {
        self.inner.prepare_sleep()
    }

    fn finish_sleep(&self) {
        self.inner.finish_sleep()
    }

    fn end_sleep(&self) {
        self.inner.end_sleep()
    }
}

/// A queue pair of the shared-memory fabric.
#[derive(Debug)]
pub struct ShmQp {
    inner: Arc<QpInner>,
    /// Who the peer proved to be (mutual TLS on the handshake socket).
    peer_id: Option<dpumesh_identity::SpiffeId>,
}

impl QueuePair for ShmQp {
    fn qp_num(&self) -> u32 {
        self.inner.num
    }
    fn peer_identity(&self) -> Option<&dpumesh_identity::SpiffeId> {
        self.peer_id.as_ref()
    }
    fn post_send(&self, wr: SendWr) -> Result<(), FabricError> {
        self.inner.post_send(wr)
    }
    fn post_recv(&self, wr: RecvWr) -> Result<(), FabricError> {
        self.inner.post_recv(wr)
    }
    fn state(&self) -> QpState {
        self.inner.state()
    }
}

/// The shared-memory fabric.
#[derive(Debug, Clone, Default)]
pub struct ShmFabric {
    /// Mutual TLS on every handshake (`None`: none).
    tls: Option<Arc<dpumesh_identity::MeshTls>>,
}

impl ShmFabric {
    /// The fabric.
    pub fn new() -> Self {
        Self { tls: None }
    }

    /// Every handshake from now on starts with mutual TLS with these certificates
    /// (`None`: none).
    pub fn with_tls(mut self, tls: Option<Arc<dpumesh_identity::MeshTls>>) -> Self {
        self.tls = tls;
        self
    }

    /// A queue pair number unique in this process (completion queues key their queue
    /// pairs by it, whichever fabric value made them).
    fn qp_num(&self) -> u32 {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }
}

/// Accepts queue pairs at a fabric address.
#[derive(Debug)]
pub struct ShmListener {
    /// Holds the address: one listener per address on the host.
    _tcp: TcpListener,
    unix: UnixListener,
    addr: SocketAddr,
    fabric: ShmFabric,
    pd: ShmPd,
    cq: ShmCq,
    caps: QpCaps,
}

// === handshake ===

/// What each side tells the other.
struct Hello {
    qp_num: u32,
    cap: u64,
    segment: PathBuf,
    bell: PathBuf,
    table: PathBuf,
}

fn put_path(out: &mut Vec<u8>, path: &Path) {
    let bytes = path.as_os_str().as_encoded_bytes();
    out.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn encode_hello(h: &Hello) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(HELLO_MAGIC);
    out.push(HELLO_VERSION);
    out.extend_from_slice(&h.qp_num.to_le_bytes());
    out.extend_from_slice(&h.cap.to_le_bytes());
    put_path(&mut out, &h.segment);
    put_path(&mut out, &h.bell);
    put_path(&mut out, &h.table);
    out
}

fn decode_hello(bytes: &[u8]) -> Result<Hello, String> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let part = bytes
            .get(at..at + n)
            .ok_or_else(|| "the peer's hello is truncated".to_owned())?;
        at += n;
        Ok(part)
    };
    if take(4)? != HELLO_MAGIC {
        return Err("the peer does not speak the shm fabric's handshake".to_owned());
    }
    let version = take(1)?[0];
    if version != HELLO_VERSION {
        return Err(format!(
            "the peer speaks shm fabric version {version}, this build {HELLO_VERSION}: run the same release on both"
        ));
    }
    let qp_num = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes"));
    let cap = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
    let mut path = || -> Result<PathBuf, String> {
        let len = u16::from_le_bytes(take(2)?.try_into().expect("2 bytes")) as usize;
        let raw = take(len)?;
        Ok(PathBuf::from(std::ffi::OsStr::from_bytes(raw)))
    };
    Ok(Hello {
        qp_num,
        cap,
        segment: path()?,
        bell: path()?,
        table: path()?,
    })
}

use std::os::unix::ffi::OsStrExt;

fn connect_error(addr: SocketAddr, detail: impl Into<String>) -> FabricError {
    FabricError::Connect {
        addr,
        detail: detail.into(),
    }
}

/// What a side learns from the other's hello: its bell and its region table.
fn peer_parts(hello: &Hello, fds: Vec<OwnedFd>) -> Result<PeerParts, String> {
    let fd = fds
        .into_iter()
        .next()
        .ok_or_else(|| "the peer sent no bell descriptor".to_owned())?;
    let bell =
        Bell::open(&hello.bell, fd).map_err(|e| format!("cannot open the peer's bell: {e}"))?;
    let regions = PeerRegions::open(&hello.table)?;
    Ok(PeerParts { bell, regions })
}

impl ShmListener {
    fn handshake(&self, mut sock: UnixStream, cq: &ShmCq) -> Result<ShmQp, String> {
        sock.set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .and_then(|()| sock.set_write_timeout(Some(HANDSHAKE_TIMEOUT)))
            .map_err(|e| e.to_string())?;
        let peer_id = match &self.fabric.tls {
            Some(tls) => {
                dpumesh_rings::peercred::check_same_user(&sock)?;
                Some(tls.accept(&mut sock).map_err(|e| e.to_string())?.1)
            }
            None => None,
        };
        let (bytes, fds) = fdpass::recv(&mut sock).map_err(|e| format!("no hello: {e}"))?;
        let hello = decode_hello(&bytes)?;
        let peer = peer_parts(&hello, fds)?;
        let seg = Arc::new(
            SharedRegion::open(&hello.segment)
                .map_err(|e| format!("cannot map the queue pair segment: {e}"))?,
        );
        let cap = qp::check_segment(&seg)?;
        if cap != hello.cap {
            return Err(format!(
                "segment capacity {cap} is not the {} announced",
                hello.cap
            ));
        }
        let num = self.fabric.qp_num();
        let welcome = Hello {
            qp_num: num,
            cap,
            segment: hello.segment.clone(),
            bell: cq.inner.bell.path().to_owned(),
            table: self.pd.table.path().to_owned(),
        };
        fdpass::send(&mut sock, &encode_hello(&welcome), &[cq.inner.bell.fd()])
            .map_err(|e| format!("cannot answer the hello: {e}"))?;
        sock.set_read_timeout(None).map_err(|e| e.to_string())?;
        let inner = Arc::new(QpInner::new(
            num,
            seg,
            cap,
            1,
            peer,
            self.pd.table.clone(),
            cq.inner.clone(),
            sock,
            self.caps,
        ));
        cq.inner.attach(&inner).map_err(|e| e.to_string())?;
        Ok(ShmQp { inner, peer_id })
    }
}

impl QpListener for ShmListener {
    type Qp = ShmQp;
    type Cq = ShmCq;

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&self, timeout: Duration) -> Result<Option<ShmQp>, FabricError> {
        self.accept_on(&self.cq, timeout)
    }

    fn accept_on(&self, cq: &ShmCq, timeout: Duration) -> Result<Option<ShmQp>, FabricError> {
        let mut fds = [rustix::event::PollFd::new(
            &self.unix,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::fs::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: timeout.subsec_nanos() as i64,
        };
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => return Ok(None),
            Ok(_) => {}
            Err(e) => return Err(FabricError::Io(e.into())),
        }
        let sock = match self.unix.accept() {
            Ok((sock, _)) => sock,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(FabricError::Io(e)),
        };
        sock.set_nonblocking(false)?;
        match self.handshake(sock, cq) {
            Ok(qp) => Ok(Some(qp)),
            Err(detail) => {
                tracing::warn!(addr = %self.addr, detail, "shm fabric: a peer's handshake failed");
                Ok(None)
            }
        }
    }
}

impl Fabric for ShmFabric {
    type Pd = ShmPd;
    type Mr = ShmMr;
    type Cq = ShmCq;
    type Qp = ShmQp;
    type Listener = ShmListener;

    fn name(&self) -> &'static str {
        "shm"
    }

    fn alloc_pd(&self) -> Result<ShmPd, FabricError> {
        Ok(ShmPd {
            table: Arc::new(MrTable::create()?),
        })
    }

    fn register(
        &self,
        pd: &ShmPd,
        region: &Arc<SharedRegion>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<ShmMr, FabricError> {
        let key = pd.table.register(region, offset, len, access)?;
        Ok(ShmMr {
            table: pd.table.clone(),
            key,
            addr: region.base_addr() + offset,
            len,
        })
    }

    fn create_cq(&self, depth: u32) -> Result<ShmCq, FabricError> {
        Ok(ShmCq {
            inner: Arc::new(CqInner::new(depth)?),
        })
    }

    fn listen(
        &self,
        pd: &ShmPd,
        addr: SocketAddr,
        cq: &ShmCq,
        caps: QpCaps,
    ) -> Result<ShmListener, FabricError> {
        let tcp = TcpListener::bind(addr)
            .map_err(|e| connect_error(addr, format!("cannot hold the fabric address: {e}")))?;
        let addr = tcp.local_addr()?;
        let name = std::os::unix::net::SocketAddr::from_abstract_name(socket_name(addr))?;
        let unix = UnixListener::bind_addr(&name)
            .map_err(|e| connect_error(addr, format!("cannot listen: {e}")))?;
        unix.set_nonblocking(true)?;
        Ok(ShmListener {
            _tcp: tcp,
            unix,
            addr,
            fabric: self.clone(),
            pd: pd.clone(),
            cq: cq.clone(),
            caps,
        })
    }

    fn connect(
        &self,
        pd: &ShmPd,
        addr: SocketAddr,
        cq: &ShmCq,
        caps: QpCaps,
    ) -> Result<ShmQp, FabricError> {
        let name = std::os::unix::net::SocketAddr::from_abstract_name(socket_name(addr))?;
        let mut sock = UnixStream::connect_addr(&name).map_err(|e| {
            connect_error(
                addr,
                format!(
                    "no shm fabric listener there ({e}); the shm fabric reaches peers on this host and network namespace only (use the TCP fabric across hosts)"
                ),
            )
        })?;
        sock.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        sock.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let peer_id = match &self.tls {
            Some(tls) => Some(
                tls.connect(&mut sock)
                    .map_err(|e| connect_error(addr, e.to_string()))?
                    .1,
            ),
            None => None,
        };
        let cap = qp::capacity(caps);
        let seg = Arc::new(
            SharedRegion::create_unique("dpumesh-shmf-qp", qp::segment_len(cap))
                .map_err(|e| connect_error(addr, e.to_string()))?,
        );
        qp::init_segment(&seg, cap)?;
        let num = self.qp_num();
        let hello = Hello {
            qp_num: num,
            cap,
            segment: seg.path().to_owned(),
            bell: cq.inner.bell.path().to_owned(),
            table: pd.table.path().to_owned(),
        };
        fdpass::send(
            &mut sock,
            &encode_hello(&hello),
            &[cq.inner.bell.fd().as_fd()],
        )
        .map_err(|e| connect_error(addr, format!("handshake: {e}")))?;
        let (bytes, fds) =
            fdpass::recv(&mut sock).map_err(|e| connect_error(addr, format!("handshake: {e}")))?;
        let welcome = decode_hello(&bytes).map_err(|e| connect_error(addr, e))?;
        let peer = peer_parts(&welcome, fds).map_err(|e| connect_error(addr, e))?;
        sock.set_read_timeout(None)?;
        let inner = Arc::new(QpInner::new(
            num,
            seg,
            cap,
            0,
            peer,
            pd.table.clone(),
            cq.inner.clone(),
            sock,
            caps,
        ));
        cq.inner.attach(&inner)?;
        Ok(ShmQp { inner, peer_id })
    }
}

//! Admission for links whose connection setup cannot run TLS: the verbs fabric, where
//! rdma_cm's connect request carries at most 56 bytes of private data and the queue
//! pair itself has no byte stream to handshake on.
//!
//! The connecting side first proves itself with mutual TLS on a TCP connection to the
//! listener's address (the same port number in the kernel's TCP port space; on RoCE
//! and InfiniBand, rdma_cm's ports are a space of their own). The [`Gate`] answers a
//! node or ingress of the trust domain with a one-time [`Ticket`]; the connect request
//! carries it as private data. The listener accepts the queue pair only for a ticket
//! it issued, not yet used, unexpired, and coming from the IP address that proved
//! itself; anything else is rejected before a queue pair exists, so no memory region
//! is reachable by a peer that did not prove a mesh identity.
//!
//! The ticket crosses the wire in the clear inside the connect request; it is worth
//! nothing to an eavesdropper once used, and the connection it was used for is the
//! authenticated one (the listener redeems before accepting).
//!
//! The book of tickets is pure (time is passed in), tested here; [`Gate`] and
//! [`admit`] are the TCP glue, tested here too; only handing the ticket to rdma_cm is
//! hardware code (`verbs.rs`).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dpumesh_identity::{MeshTls, SpiffeId};
use parking_lot::Mutex;

/// How long a ticket may wait for its connect request.
pub const TICKET_LIFETIME: Duration = Duration::from_secs(10);
/// Tickets waiting at most; the oldest goes first beyond it.
pub const MAX_PENDING: usize = 256;
/// How long the TLS exchange at the gate may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(5);
/// Gate exchanges running at once; more are closed at once (a peer that connects
/// and never speaks holds one for [`EXCHANGE_TIMEOUT`] at most).
const MAX_EXCHANGES: usize = 16;

const MAGIC: &[u8; 4] = b"DPVA";
const VERSION: u8 = 1;
/// The private data of a connect request: magic, version, ticket.
pub const PRIVATE_DATA_LEN: usize = 4 + 1 + 16;

/// Why a link was not admitted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdmissionError {
    #[error("the connect request carries no admission ticket ({0})")]
    Malformed(String),
    #[error("the admission ticket was not issued here, or was used already")]
    Unknown,
    #[error("the admission ticket expired {0:?} ago")]
    Expired(Duration),
    #[error("the admission ticket was issued to {issued_to}, not to {from}")]
    WrongAddress { issued_to: IpAddr, from: IpAddr },
    #[error("admission refused: {0}")]
    Refused(String),
}

/// A one-time proof that a peer passed the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket([u8; 16]);

impl Ticket {
    /// A fresh random ticket.
    pub fn random() -> Result<Self, AdmissionError> {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes)
            .map_err(|e| AdmissionError::Refused(format!("no randomness for a ticket: {e}")))?;
        Ok(Self(bytes))
    }

    /// The connect request's private data.
    pub fn to_private_data(self) -> [u8; PRIVATE_DATA_LEN] {
        let mut out = [0u8; PRIVATE_DATA_LEN];
        out[..4].copy_from_slice(MAGIC);
        out[4] = VERSION;
        out[5..].copy_from_slice(&self.0);
        out
    }

    /// Reads a connect request's private data. InfiniBand pads it with zeros to its
    /// full size, so zeros after the ticket are allowed; anything else is not.
    pub fn from_private_data(data: &[u8]) -> Result<Self, AdmissionError> {
        if data.len() < PRIVATE_DATA_LEN {
            return Err(AdmissionError::Malformed(format!(
                "{} bytes of private data, {PRIVATE_DATA_LEN} needed",
                data.len()
            )));
        }
        if &data[..4] != MAGIC {
            return Err(AdmissionError::Malformed("wrong magic".into()));
        }
        if data[4] != VERSION {
            return Err(AdmissionError::Malformed(format!(
                "version {} (this side speaks {VERSION})",
                data[4]
            )));
        }
        if data[PRIVATE_DATA_LEN..].iter().any(|&b| b != 0) {
            return Err(AdmissionError::Malformed(
                "bytes after the ticket are not padding".into(),
            ));
        }
        let mut t = [0u8; 16];
        t.copy_from_slice(&data[5..PRIVATE_DATA_LEN]);
        Ok(Self(t))
    }
}

#[derive(Debug)]
struct Pending {
    peer: SpiffeId,
    from: IpAddr,
    issued: Instant,
}

/// The tickets a listener issued and not yet saw used (pure: the caller says when).
#[derive(Debug, Default)]
pub struct TicketBook {
    pending: HashMap<Ticket, Pending>,
}

impl TicketBook {
    /// Records `ticket` for `peer`, who proved itself from `from` at `now`.
    pub fn issue(&mut self, ticket: Ticket, peer: SpiffeId, from: IpAddr, now: Instant) {
        self.pending
            .retain(|_, p| now.duration_since(p.issued) < TICKET_LIFETIME);
        if self.pending.len() >= MAX_PENDING
            && let Some(oldest) = self
                .pending
                .iter()
                .min_by_key(|(_, p)| p.issued)
                .map(|(t, _)| *t)
        {
            self.pending.remove(&oldest);
        }
        self.pending.insert(
            ticket,
            Pending {
                peer,
                from,
                issued: now,
            },
        );
    }

    /// Uses `ticket`, presented from `from` at `now`: the identity it was issued to.
    /// A ticket is gone after one try, right or wrong.
    pub fn redeem(
        &mut self,
        ticket: Ticket,
        from: IpAddr,
        now: Instant,
    ) -> Result<SpiffeId, AdmissionError> {
        let p = self
            .pending
            .remove(&ticket)
            .ok_or(AdmissionError::Unknown)?;
        let age = now.duration_since(p.issued);
        if age >= TICKET_LIFETIME {
            return Err(AdmissionError::Expired(age - TICKET_LIFETIME));
        }
        if canonical(p.from) != canonical(from) {
            return Err(AdmissionError::WrongAddress {
                issued_to: p.from,
                from,
            });
        }
        Ok(p.peer)
    }

    /// Tickets waiting.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

/// IPv4-mapped IPv6 addresses compare as IPv4 (a dual-stack socket reports them).
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// A listener's gate: the TCP side where peers prove themselves and get tickets.
#[derive(Debug)]
pub struct Gate {
    book: Arc<Mutex<TicketBook>>,
    listener: Arc<TcpListener>,
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
}

impl Gate {
    /// Opens the gate on `addr` (TCP) with this side's certificates.
    pub fn start(tls: Arc<MeshTls>, addr: SocketAddr) -> std::io::Result<Self> {
        let listener = Arc::new(TcpListener::bind(addr)?);
        let addr = listener.local_addr()?;
        let book = Arc::new(Mutex::new(TicketBook::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (l, b, s) = (listener.clone(), book.clone(), stop.clone());
        std::thread::Builder::new()
            .name("dpumesh-admission".into())
            .spawn(move || serve(&l, &tls, &b, &s))?;
        Ok(Self {
            book,
            listener,
            stop,
            addr,
        })
    }

    /// Where peers prove themselves.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Admits a connect request carrying `private_data` from `from`: the peer's
    /// proven identity.
    pub fn redeem(&self, private_data: &[u8], from: IpAddr) -> Result<SpiffeId, AdmissionError> {
        let ticket = Ticket::from_private_data(private_data)?;
        self.book.lock().redeem(ticket, from, Instant::now())
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accept: on Linux, shutting a listening socket down makes a
        // blocked accept return.
        let _ = rustix::net::shutdown(self.listener.as_fd(), rustix::net::Shutdown::Both);
    }
}

fn serve(
    listener: &TcpListener,
    tls: &Arc<MeshTls>,
    book: &Arc<Mutex<TicketBook>>,
    stop: &AtomicBool,
) {
    let running = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(sock) = conn else { continue };
        // One thread per exchange, so a silent peer delays nobody else.
        if running.fetch_add(1, Ordering::AcqRel) >= MAX_EXCHANGES {
            running.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("admission gate busy: closed a connection");
            continue;
        }
        let (tls, book, running) = (tls.clone(), book.clone(), running.clone());
        let spawned = std::thread::Builder::new()
            .name("dpumesh-admit".into())
            .spawn(move || {
                let peer = sock.peer_addr().ok();
                if let Err(e) = exchange(sock, &tls, &book) {
                    tracing::warn!(?peer, error = %e, "refused a fabric link at the admission gate");
                }
                running.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            tracing::warn!("admission gate: no thread for an exchange");
        }
    }
}

/// The gate's side of one exchange: handshake, then a ticket.
fn exchange(
    mut sock: TcpStream,
    tls: &MeshTls,
    book: &Mutex<TicketBook>,
) -> Result<(), AdmissionError> {
    let from = sock
        .peer_addr()
        .map_err(|e| AdmissionError::Refused(e.to_string()))?
        .ip();
    let io = |e: std::io::Error| AdmissionError::Refused(e.to_string());
    sock.set_read_timeout(Some(EXCHANGE_TIMEOUT)).map_err(io)?;
    sock.set_write_timeout(Some(EXCHANGE_TIMEOUT)).map_err(io)?;
    let (mut conn, peer) = tls
        .accept(&mut sock)
        .map_err(|e| AdmissionError::Refused(e.to_string()))?;
    let ticket = Ticket::random()?;
    book.lock().issue(ticket, peer, from, Instant::now());
    conn.writer().write_all(&ticket.0).map_err(io)?;
    while conn.wants_write() {
        conn.write_tls(&mut sock).map_err(io)?;
    }
    Ok(())
}

/// The connecting side: proves this side's identity at the gate of `addr` and
/// returns the ticket for the connect request and who the listener is.
pub fn admit(tls: &MeshTls, addr: SocketAddr) -> Result<(Ticket, SpiffeId), AdmissionError> {
    let io = |e: std::io::Error| AdmissionError::Refused(format!("gate at {addr}: {e}"));
    let mut sock = TcpStream::connect_timeout(&addr, EXCHANGE_TIMEOUT).map_err(io)?;
    sock.set_read_timeout(Some(EXCHANGE_TIMEOUT)).map_err(io)?;
    sock.set_write_timeout(Some(EXCHANGE_TIMEOUT)).map_err(io)?;
    let (mut conn, listener) = tls
        .connect(&mut sock)
        .map_err(|e| AdmissionError::Refused(format!("gate at {addr}: {e}")))?;
    let mut ticket = [0u8; 16];
    let mut got = 0;
    while got < ticket.len() {
        match conn.reader().read(&mut ticket[got..]) {
            Ok(0) => return Err(io(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if conn.read_tls(&mut sock).map_err(io)? == 0 {
                    return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
                }
                conn.process_new_packets()
                    .map_err(|e| AdmissionError::Refused(format!("gate at {addr}: {e}")))?;
            }
            Err(e) => return Err(io(e)),
        }
    }
    Ok((Ticket(ticket), listener))
}

#[cfg(test)]
mod tests;

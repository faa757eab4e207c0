//! A TLS session over a non-blocking socket, for an event loop that reads until
//! `WouldBlock` and writes what the socket takes.
//!
//! rustls holds ciphertext it could not write yet: [`TlsSession::pending`] says so,
//! and the owner keeps its write interest until [`TlsSession::push`] got it all out.
//! Plain bytes handed to [`TlsSession::write_vectored`] count as written once they
//! are encrypted, so a caller's accounting of its frames stays as it is with plain
//! TCP.

use std::io::{self, IoSlice, Read, Write};

use parking_lot::Mutex;
use rustls::Connection;

/// Ciphertext held before new plain bytes are refused with `WouldBlock`.
const BUFFER_LIMIT: usize = 256 << 10;

/// The session of one connection; both directions share it (leaf lock: held only
/// inside these calls).
pub struct TlsSession {
    conn: Mutex<Connection>,
}

impl std::fmt::Debug for TlsSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSession").finish_non_exhaustive()
    }
}

fn would_block() -> io::Error {
    io::Error::from(io::ErrorKind::WouldBlock)
}

/// Writes held ciphertext until none is left or the socket is full.
fn push_locked(conn: &mut Connection, sock: &mut impl Write) -> io::Result<()> {
    while conn.wants_write() {
        match conn.write_tls(sock) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(_) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl TlsSession {
    /// A session whose handshake is done.
    pub fn new(mut conn: Connection) -> Self {
        conn.set_buffer_limit(Some(BUFFER_LIMIT));
        Self {
            conn: Mutex::new(conn),
        }
    }

    /// Plain bytes that arrived, as `Read::read` on the socket would give them:
    /// `Ok(0)` at the end, `WouldBlock` when nothing is there yet.
    pub fn read(&self, sock: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
        let mut conn = self.conn.lock();
        loop {
            match conn.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            if conn.read_tls(sock)? == 0 {
                return Ok(0);
            }
            if let Err(e) = conn.process_new_packets() {
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
    }

    /// Encrypts what fits and writes what the socket takes; returns the plain bytes
    /// taken. Refuses (`WouldBlock`) while ciphertext from before is still held.
    pub fn write_vectored(&self, sock: &mut impl Write, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut conn = self.conn.lock();
        push_locked(&mut conn, sock)?;
        let n = conn.writer().write_vectored(bufs)?;
        if n == 0 && bufs.iter().any(|b| !b.is_empty()) {
            return Err(would_block());
        }
        match push_locked(&mut conn, sock) {
            Ok(()) => Ok(n),
            // Taken and encrypted; the rest goes out when the socket has room.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(n),
            Err(e) => Err(e),
        }
    }

    /// Writes held ciphertext: `Ok` once all is out, `WouldBlock` while some is left.
    pub fn push(&self, sock: &mut impl Write) -> io::Result<()> {
        push_locked(&mut self.conn.lock(), sock)
    }

    /// Whether ciphertext waits for room in the socket.
    pub fn pending(&self) -> bool {
        self.conn.lock().wants_write()
    }
}

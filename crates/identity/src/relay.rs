//! A mutual TLS connection handed to blocking code as a plain Unix stream: a thread
//! per connection moves bytes between the two (what stunnel does), so code written
//! for a byte stream with a reader and a writer on different threads (the control
//! channel) runs over TLS unchanged. For low-rate channels only: every byte crosses
//! one more socket.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;

use rustix::event::{PollFd, PollFlags, poll};
use rustls::Connection;

/// Starts relaying `conn` (handshake done) over `tcp`; returns the plain end.
pub fn relay(conn: Connection, tcp: TcpStream) -> io::Result<UnixStream> {
    let (ours, theirs) = UnixStream::pair()?;
    tcp.set_nonblocking(true)?;
    tcp.set_read_timeout(None)?;
    tcp.set_write_timeout(None)?;
    std::thread::Builder::new()
        .name("dpumesh-tls-relay".into())
        .spawn(move || run(conn, tcp, theirs))?;
    Ok(ours)
}

fn run(mut conn: Connection, mut tcp: TcpStream, mut local: UnixStream) {
    let mut buf = vec![0u8; 16 << 10];
    let mut local_open = true;
    'relay: loop {
        let tcp_wants = if conn.wants_write() {
            PollFlags::IN | PollFlags::OUT
        } else {
            PollFlags::IN
        };
        let local_wants = if local_open {
            PollFlags::IN
        } else {
            PollFlags::empty()
        };
        let mut fds = [
            PollFd::new(&tcp, tcp_wants),
            PollFd::new(&local, local_wants),
        ];
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => break,
        }
        let (from_tcp, from_local) = (fds[0].revents(), fds[1].revents());
        if !from_tcp.is_empty() {
            match conn.read_tls(&mut tcp) {
                Ok(0) => break,
                Ok(_) => {
                    if conn.process_new_packets().is_err() {
                        let _ = conn.write_tls(&mut tcp);
                        break;
                    }
                    loop {
                        match conn.reader().read(&mut buf) {
                            Ok(0) => break 'relay,
                            // Blocking: a reader that stops stalls its own connection.
                            Ok(n) => {
                                if local.write_all(&buf[..n]).is_err() {
                                    break 'relay;
                                }
                            }
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                            Err(_) => break 'relay,
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => break,
            }
        }
        if local_open && !from_local.is_empty() {
            match local.read(&mut buf) {
                Ok(0) | Err(_) => {
                    conn.send_close_notify();
                    local_open = false;
                }
                Ok(n) => {
                    if conn.writer().write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        while conn.wants_write() {
            match conn.write_tls(&mut tcp) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => break 'relay,
            }
        }
        if !local_open && !conn.wants_write() {
            break;
        }
    }
    let _ = tcp.shutdown(std::net::Shutdown::Both);
    let _ = local.shutdown(std::net::Shutdown::Both);
}

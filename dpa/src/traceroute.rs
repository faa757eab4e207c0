//! Traceroute's socket: UDP datagrams sent with a chosen IP TTL, and the ICMP errors
//! they draw (time exceeded from each router on the way, port unreachable from the
//! destination) read from the socket's error queue (`IP_RECVERR`, `MSG_ERRQUEUE`) —
//! no raw socket, no privilege. IPv4.
//!
//! FFI: `setsockopt(IP_RECVERR)` and `recvmsg(MSG_ERRQUEUE)` with its
//! `sock_extended_err` control message through libc (rustix parses neither).
#![allow(unsafe_code)]

use std::io;
use std::mem::{MaybeUninit, size_of};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::time::Instant;

/// What an ICMP error said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IcmpKind {
    /// Type 11: a router dropped it when its TTL ran out.
    TimeExceeded,
    /// Type 3 with its code (3: port unreachable — the destination answered).
    Unreachable(u8),
    /// Anything else: type and code.
    Other(u8, u8),
}

/// One ICMP error about a datagram this socket sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcmpReport {
    /// Who sent the error (the router, or the destination).
    pub from: IpAddr,
    /// Where the datagram it is about was going.
    pub to: SocketAddr,
    pub kind: IcmpKind,
    /// When it was read.
    pub at: Instant,
}

/// A UDP socket for traceroute.
#[derive(Debug)]
pub struct TraceSocket {
    sock: UdpSocket,
}

const SO_EE_ORIGIN_ICMP: u8 = 2;

impl TraceSocket {
    /// A socket on `ip` (any port), non-blocking, reporting ICMP errors.
    pub fn bind(ip: Ipv4Addr) -> io::Result<Self> {
        let sock = UdpSocket::bind(SocketAddrV4::new(ip, 0))?;
        sock.set_nonblocking(true)?;
        let on: libc::c_int = 1;
        // SAFETY: a valid socket and a c_int option of its size.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::IPPROTO_IP,
                libc::IP_RECVERR,
                (&on as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { sock })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.sock.local_addr()
    }

    /// Sends `payload` to `to` with IP TTL `ttl`.
    pub fn send(&self, to: SocketAddr, ttl: u8, payload: &[u8]) -> io::Result<()> {
        self.sock.set_ttl(u32::from(ttl.max(1)))?;
        match self.sock.send_to(payload, to) {
            Ok(_) => Ok(()),
            // An earlier datagram's error reported on this send: it waits in the
            // error queue all the same.
            Err(e) if e.raw_os_error() == Some(libc::EHOSTUNREACH) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Reads every ICMP error queued so far into `out`.
    pub fn errors(&self, out: &mut Vec<IcmpReport>) -> io::Result<()> {
        loop {
            match self.one_error()? {
                Some(Some(report)) => out.push(report),
                // Not an ICMP error we can place: skipped.
                Some(None) => {}
                None => return Ok(()),
            }
        }
    }

    /// One entry of the error queue: `None` when it is empty.
    fn one_error(&self) -> io::Result<Option<Option<IcmpReport>>> {
        let mut name = MaybeUninit::<libc::sockaddr_in>::zeroed();
        let mut data = [0u8; 512];
        let mut control = [0u64; 32];
        let mut iov = libc::iovec {
            iov_base: data.as_mut_ptr().cast(),
            iov_len: data.len(),
        };
        // SAFETY: all-zero is a valid msghdr; its pointers are set to live locals.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_name = name.as_mut_ptr().cast();
        msg.msg_namelen = size_of::<libc::sockaddr_in>() as libc::socklen_t;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of::<[u64; 32]>() as _;
        // SAFETY: msg points at buffers that live across the call, with their sizes.
        let n = unsafe {
            libc::recvmsg(
                self.sock.as_raw_fd(),
                &mut msg,
                libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock {
                Ok(None)
            } else {
                Err(e)
            };
        }
        // SAFETY: the kernel wrote the original destination into `name`.
        let to = unsafe { name.assume_init() };
        let to = SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(to.sin_addr.s_addr)),
            u16::from_be(to.sin_port),
        ));
        let mut report = None;
        // SAFETY: the kernel filled msg_control up to msg_controllen; the CMSG macros
        // walk it within those bounds, and IP_RECVERR's data is a sock_extended_err
        // followed by the offender's sockaddr_in (SO_EE_OFFENDER), both read unaligned.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::IPPROTO_IP && (*cmsg).cmsg_type == libc::IP_RECVERR {
                    let data = libc::CMSG_DATA(cmsg);
                    let ee = std::ptr::read_unaligned(data.cast::<libc::sock_extended_err>());
                    let offender = std::ptr::read_unaligned(
                        data.add(size_of::<libc::sock_extended_err>())
                            .cast::<libc::sockaddr_in>(),
                    );
                    if ee.ee_origin == SO_EE_ORIGIN_ICMP
                        && offender.sin_family as libc::c_int == libc::AF_INET
                    {
                        let kind = match (ee.ee_type, ee.ee_code) {
                            (11, _) => IcmpKind::TimeExceeded,
                            (3, code) => IcmpKind::Unreachable(code),
                            (t, c) => IcmpKind::Other(t, c),
                        };
                        report = Some(IcmpReport {
                            from: IpAddr::V4(Ipv4Addr::from(u32::from_be(
                                offender.sin_addr.s_addr,
                            ))),
                            to,
                            kind,
                            at: Instant::now(),
                        });
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        Ok(Some(report))
    }
}

impl AsFd for TraceSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_closed_port_answers_port_unreachable_with_the_destination() {
        let closed = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = closed.local_addr().unwrap();
        drop(closed);
        let s = TraceSocket::bind(Ipv4Addr::LOCALHOST).unwrap();
        s.send(to, 1, b"trace").unwrap();
        let mut out = Vec::new();
        for _ in 0..100 {
            s.errors(&mut out).unwrap();
            if !out.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].kind, IcmpKind::Unreachable(3));
        assert_eq!(out[0].to, to);
        assert_eq!(out[0].from, IpAddr::V4(Ipv4Addr::LOCALHOST));
    }

    #[test]
    fn an_empty_error_queue_is_nothing() {
        let s = TraceSocket::bind(Ipv4Addr::LOCALHOST).unwrap();
        let mut out = Vec::new();
        s.errors(&mut out).unwrap();
        assert!(out.is_empty());
    }
}

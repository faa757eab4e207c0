//! Receive timestamps for the software fabric's UD queue pairs: the kernel's time of
//! arrival of each datagram (`SO_TIMESTAMPNS`), the software stand-in for a NIC's
//! CQE timestamp. Without it, a receive would be stamped when its owner got round to
//! reading it, and the owner's wake-up would count as network time.
//!
//! FFI: `setsockopt` and `recvmsg` with control messages through libc (rustix does
//! not parse `SCM_TIMESTAMPNS`).
#![allow(unsafe_code)]

use std::io;
use std::mem::{MaybeUninit, size_of};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Asks the kernel to stamp every datagram `sock` receives.
pub(super) fn enable(sock: &UdpSocket) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: a valid socket descriptor and a c_int option of the right size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_TIMESTAMPNS,
            (&on as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A datagram read without blocking: its length, sender, whether it was cut to fit
/// `buf`, and when the kernel received it.
#[derive(Debug)]
pub(super) struct Received {
    pub len: usize,
    pub from: SocketAddr,
    pub truncated: bool,
    pub at: Option<SystemTime>,
}

/// Reads one datagram from `sock` into `buf` (`WouldBlock` when there is none).
pub(super) fn recv(sock: &UdpSocket, buf: &mut [u8]) -> io::Result<Received> {
    let mut name = MaybeUninit::<libc::sockaddr_storage>::zeroed();
    // u64s: control messages must be aligned for cmsghdr.
    let mut control = [0u64; 16];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: all-zero is a valid msghdr; its pointers are set below to live locals.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = name.as_mut_ptr().cast();
    msg.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of::<[u64; 16]>() as _;
    // SAFETY: msg points at buffers that live across the call, with their sizes.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut at = None;
    // SAFETY: the kernel filled msg_control up to msg_controllen; the CMSG macros
    // walk it within those bounds.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_TIMESTAMPNS
            {
                let ts = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::timespec>());
                at = Some(UNIX_EPOCH + Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32));
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    // SAFETY: the kernel wrote a sockaddr of the socket's family into `name`.
    let from = unsafe { sockaddr(name.as_ptr()) }
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "datagram from no address"))?;
    Ok(Received {
        len: n as usize,
        from,
        truncated: msg.msg_flags & libc::MSG_TRUNC != 0,
        at,
    })
}

/// The address in a sockaddr_storage the kernel filled.
///
/// # Safety
/// `s` points at an initialized sockaddr_storage.
unsafe fn sockaddr(s: *const libc::sockaddr_storage) -> Option<SocketAddr> {
    // SAFETY: the caller's contract; the family says which view is valid.
    unsafe {
        match (*s).ss_family as libc::c_int {
            libc::AF_INET => {
                let a = &*s.cast::<libc::sockaddr_in>();
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                    u16::from_be(a.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let a = &*s.cast::<libc::sockaddr_in6>();
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(a.sin6_addr.s6_addr),
                    u16::from_be(a.sin6_port),
                    a.sin6_flowinfo,
                    a.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_datagram_comes_with_its_sender_and_the_kernels_time() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        if let Err(e) = enable(&rx) {
            // qemu's user-mode emulation (the Arm64 test run) has no SO_TIMESTAMPNS.
            assert_eq!(e.raw_os_error(), Some(libc::ENOPROTOOPT), "{e}");
            eprintln!("SKIPPED: no SO_TIMESTAMPNS here ({e})");
            return;
        }
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let before = SystemTime::now();
        tx.send_to(b"hello", rx.local_addr().unwrap()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let mut buf = [0u8; 3];
        let got = recv(&rx, &mut buf).unwrap();
        assert_eq!(got.from, tx.local_addr().unwrap());
        assert!(got.truncated, "5 bytes into 3");
        let at = got.at.expect("a timestamp");
        assert!(at >= before - Duration::from_millis(5));
        // Stamped on arrival, not when read 50 ms later.
        assert!(SystemTime::now().duration_since(at).unwrap() >= Duration::from_millis(40));
        assert_eq!(
            recv(&rx, &mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
    }
}

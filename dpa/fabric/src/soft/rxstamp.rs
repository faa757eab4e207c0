//! Receive timestamps for the software fabric's UD queue pairs: the kernel's time of
//! arrival of each datagram (`SO_TIMESTAMPNS`), the software stand-in for a NIC's
//! CQE timestamp. Without it, a receive would be stamped when its owner got round to
//! reading it, and the owner's wake-up would count as network time.
//!
//! FFI: `setsockopt` and `recvmsg` with control messages through libc (rustix does
//! not parse `SCM_TIMESTAMPNS`).
#![allow(unsafe_code)]

use std::io;
use std::mem::size_of;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Asks the kernel to stamp every datagram `sock` receives. (Right after the first
/// socket of the system asks, the kernel may still stamp datagrams when they are read:
/// it turns arrival stamps on with deferred work. A probe stamped so counts its
/// wait in the socket as network time; only the first moments of an agent's life.)
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
/// its buffer, and when the kernel received it.
#[derive(Debug)]
pub(super) struct Received {
    /// Which datagram of the batch ([`Batch::data`]).
    pub index: usize,
    pub len: usize,
    pub from: SocketAddr,
    pub truncated: bool,
    pub at: Option<SystemTime>,
}

/// Datagrams read by one system call (`recvmmsg`).
pub(super) const BATCH: usize = 16;

/// Buffers for [`recv_many`], kept by the queue pair across calls (no allocation
/// or zeroing per read).
pub(super) struct Batch {
    slot: usize,
    data: Vec<u8>,
    names: Vec<libc::sockaddr_storage>,
    // u64s: control messages must be aligned for cmsghdr.
    controls: Vec<[u64; 16]>,
    iovecs: Vec<libc::iovec>,
    headers: Vec<libc::mmsghdr>,
}

// SAFETY: the raw pointers in `iovecs` and `headers` point into this struct's own
// heap buffers, are rebuilt before each use, and are only dereferenced by the kernel
// during `recv_many`, which takes the batch by `&mut`.
unsafe impl Send for Batch {}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch").field("slot", &self.slot).finish()
    }
}

impl Batch {
    /// Room for [`BATCH`] datagrams of up to `slot` bytes each.
    pub(super) fn new(slot: usize) -> Self {
        Self {
            slot,
            data: vec![0; slot * BATCH],
            // SAFETY: all-zero is a valid sockaddr_storage, iovec and mmsghdr.
            names: vec![unsafe { std::mem::zeroed() }; BATCH],
            controls: vec![[0; 16]; BATCH],
            iovecs: vec![unsafe { std::mem::zeroed() }; BATCH],
            headers: vec![unsafe { std::mem::zeroed() }; BATCH],
        }
    }

    /// The bytes of datagram `i` of the last read (`len` from its [`Received`]).
    pub(super) fn data(&self, i: usize, len: usize) -> &[u8] {
        let start = i * self.slot;
        &self.data[start..start + len.min(self.slot)]
    }
}

/// Reads up to [`BATCH`] datagrams from `sock` without blocking, in one system call;
/// `out` gets what each was (datagram `i`'s bytes are `batch.data(i, len)`).
/// `WouldBlock` when none is there.
pub(super) fn recv_many(
    sock: &UdpSocket,
    batch: &mut Batch,
    out: &mut Vec<Received>,
) -> io::Result<usize> {
    out.clear();
    let slot = batch.slot;
    // Every pointer comes from one base pointer per buffer, taken once: no later
    // borrow of a buffer invalidates what an earlier header holds.
    let (data, names, controls, iovecs) = (
        batch.data.as_mut_ptr(),
        batch.names.as_mut_ptr(),
        batch.controls.as_mut_ptr(),
        batch.iovecs.as_mut_ptr(),
    );
    for i in 0..BATCH {
        // SAFETY: i < BATCH, and each buffer holds BATCH entries (`data` BATCH
        // slots of `slot` bytes), so every offset stays inside its buffer.
        let (iov, name, control) = unsafe {
            let iov = iovecs.add(i);
            iov.write(libc::iovec {
                iov_base: data.add(i * slot).cast(),
                iov_len: slot,
            });
            (iov, names.add(i), controls.add(i))
        };
        // SAFETY: all-zero is a valid msghdr; its pointers are set below to this
        // batch's buffers, which outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_name = name.cast();
        msg.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        msg.msg_iov = iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.cast();
        msg.msg_controllen = size_of::<[u64; 16]>() as _;
        batch.headers[i] = libc::mmsghdr {
            msg_hdr: msg,
            msg_len: 0,
        };
    }
    // SAFETY: `headers` holds BATCH msghdrs whose buffers live across the call.
    let n = unsafe {
        libc::recvmmsg(
            sock.as_raw_fd(),
            batch.headers.as_mut_ptr(),
            BATCH as libc::c_uint,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    for i in 0..n as usize {
        let h = &batch.headers[i];
        // SAFETY: the kernel filled this message's control buffer and name.
        let at = unsafe { timestamp(&h.msg_hdr) };
        // SAFETY: as above: a sockaddr of the socket's family.
        let Some(from) = (unsafe { sockaddr(&batch.names[i]) }) else {
            // A datagram from no address cannot be answered: skipped, as a NIC
            // drops what it cannot parse.
            continue;
        };
        out.push(Received {
            index: i,
            len: h.msg_len as usize,
            from,
            truncated: h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0,
            at,
        });
    }
    Ok(n as usize)
}

/// The `SCM_TIMESTAMPNS` of a message the kernel filled.
///
/// # Safety
/// `msg` is a msghdr a receive call filled (its control length says how much).
unsafe fn timestamp(msg: &libc::msghdr) -> Option<SystemTime> {
    let mut at = None;
    // SAFETY: the caller's contract; the CMSG macros walk the control buffer within
    // the length the kernel set.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_TIMESTAMPNS
            {
                let ts = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::timespec>());
                at = Some(UNIX_EPOCH + Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32));
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    at
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
        let mut batch = Batch::new(3);
        let mut got = Vec::new();
        // The kernel turns arrival stamps on (for the first socket of the system that
        // asks, again after the last one closed) with deferred work: until that has
        // run, a datagram is stamped when it is read. A few rounds give it the time;
        // stamps taken on reading in every round would fail.
        let mut on_arrival = false;
        for _ in 0..5 {
            let before = SystemTime::now();
            tx.send_to(b"hello", rx.local_addr().unwrap()).unwrap();
            tx.send_to(b"hi", rx.local_addr().unwrap()).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(
                recv_many(&rx, &mut batch, &mut got).unwrap(),
                2,
                "one call, both"
            );
            assert_eq!(got[0].from, tx.local_addr().unwrap());
            assert!(got[0].truncated, "5 bytes into 3");
            assert_eq!(batch.data(0, got[0].len), b"hel");
            assert!(!got[1].truncated);
            assert_eq!(batch.data(got[1].index, got[1].len), b"hi");
            let at = got[0].at.expect("a timestamp");
            assert!(at >= before - Duration::from_millis(5));
            assert_eq!(
                recv_many(&rx, &mut batch, &mut got).unwrap_err().kind(),
                io::ErrorKind::WouldBlock
            );
            // Stamped on arrival, not when read 50 ms later.
            if SystemTime::now().duration_since(at).unwrap() >= Duration::from_millis(40) {
                on_arrival = true;
                break;
            }
        }
        assert!(on_arrival, "every datagram was stamped when read");
    }
}

//! Messages with file descriptors over a Unix stream socket (`SCM_RIGHTS`): how a
//! process hands another the eventfd that wakes it, so a producer in one process can
//! wake a consumer that sleeps in `epoll` in another.
//!
//! A message is a 4-byte little-endian length, the bytes, and up to [`MAX_FDS`]
//! descriptors riding on the first byte. Used at setup (registration, queue pair
//! handshakes), never per request.

use std::io::{IoSlice, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, recvmsg, sendmsg,
};

/// Most descriptors one message carries.
pub const MAX_FDS: usize = 64;
/// Largest message body.
pub const MAX_MESSAGE: usize = 64 << 10;

/// Sends `bytes` with `fds` as one message.
pub fn send<S: AsFd + std::io::Write>(
    sock: &mut S,
    bytes: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> std::io::Result<()> {
    if bytes.len() > MAX_MESSAGE || fds.len() > MAX_FDS {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "a message carries at most {MAX_MESSAGE} bytes and {MAX_FDS} descriptors (got {} and {})",
                bytes.len(),
                fds.len()
            ),
        ));
    }
    let len = (bytes.len() as u32).to_le_bytes();
    let iov = [IoSlice::new(&len), IoSlice::new(bytes)];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(std::io::Error::other(
            "descriptors do not fit the control buffer",
        ));
    }
    let total = len.len() + bytes.len();
    let sent = sendmsg(sock.as_fd(), &iov, &mut control, SendFlags::NOSIGNAL)?;
    if sent < total {
        // The descriptors went with the first part; the rest follows as plain bytes.
        let mut rest = Vec::with_capacity(total - sent);
        rest.extend_from_slice(&len);
        rest.extend_from_slice(bytes);
        sock.write_all(&rest[sent..])?;
    }
    Ok(())
}

/// Receives one message: its bytes and the descriptors that came with it.
pub fn recv<S: AsFd + Read>(sock: &mut S) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut len = [0u8; 4];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(
        sock.as_fd(),
        &mut [IoSliceMut::new(&mut len)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    if got.bytes == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    sock.read_exact(&mut len[got.bytes..])?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("message of {len} bytes exceeds {MAX_MESSAGE}"),
        ));
    }
    let mut bytes = vec![0u8; len];
    sock.read_exact(&mut bytes)?;
    Ok((bytes, fds))
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn a_descriptor_crosses_with_its_message() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        send(&mut a, b"hello", &[efd.as_fd()]).unwrap();
        let (bytes, fds) = recv(&mut b).unwrap();
        assert_eq!(bytes, b"hello");
        assert_eq!(fds.len(), 1);
        // The received descriptor is the same eventfd: a write on one shows on the other.
        rustix::io::write(&fds[0], &7u64.to_ne_bytes()).unwrap();
        let mut buf = [0u8; 8];
        rustix::io::read(&efd, &mut buf).unwrap();
        assert_eq!(u64::from_ne_bytes(buf), 7);
        // Plain messages too, and a closed peer is an end of file.
        send(&mut a, &[9; 1000], &[]).unwrap();
        assert_eq!(recv(&mut b).unwrap().0, vec![9; 1000]);
        drop(a);
        assert_eq!(
            recv(&mut b).unwrap_err().kind(),
            std::io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn oversized_messages_are_refused_both_ways() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        assert!(send(&mut a, &vec![0; MAX_MESSAGE + 1], &[]).is_err());
        // A peer claiming a huge length is refused before anything is allocated.
        use std::io::Write;
        a.write_all(&(u32::MAX).to_le_bytes()).unwrap();
        assert_eq!(
            recv(&mut b).unwrap_err().kind(),
            std::io::ErrorKind::InvalidData
        );
    }
}

//! Who is on the other end of a Unix socket (`SO_PEERCRED`): the fabric's handshake
//! socket and the control socket accept only processes of this one's user, or root.

use std::os::unix::net::UnixStream;

/// `Ok` when the peer process runs as this process's effective user or as root;
/// otherwise why not (its pid and user).
pub fn check_same_user(sock: &UnixStream) -> Result<(), String> {
    let cred = rustix::net::sockopt::socket_peercred(sock)
        .map_err(|e| format!("cannot read the peer's credentials: {e}"))?;
    let me = rustix::process::geteuid();
    if cred.uid != me && !cred.uid.is_root() {
        return Err(format!(
            "process {} runs as user {}, not this process's user {}",
            cred.pid.as_raw_nonzero(),
            cred.uid.as_raw(),
            me.as_raw()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_process_of_the_same_user_passes() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(super::check_same_user(&a), Ok(()));
    }
}

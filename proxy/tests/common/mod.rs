//! What the in-process node tests share: an HTTP GET and an ingress in front of one
//! node.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use dpumesh_dpa::fabric::shm::ShmFabric;
use dpumesh_ingress::{Ingress, Settings};

/// GET `path` from `addr` (HTTP/1.1, `host` as given): status and body.
pub fn get(addr: SocketAddr, host: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    let status = reply
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = reply
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_owned());
    (status, body)
}

/// An ingress on the shared-memory fabric sending `service` to the node at `node`,
/// with `threads` workers (a link to the node each).
pub fn ingress(
    policy: PathBuf,
    service: &str,
    node: SocketAddr,
    threads: usize,
    request_timeout: Duration,
) -> Ingress {
    Ingress::start(
        ShmFabric::new(),
        Settings {
            listen: "127.0.0.1:0".parse().unwrap(),
            max_head: 32 << 10,
            max_body: 1 << 20,
            body_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(10),
            max_headers: 100,
            request_timeout,
            slots: 8,
            slots_per_client: 8,
            threads: Some(threads),
            policy,
            services: BTreeMap::from([(service.to_owned(), vec![node])]),
            admin: None,
            path: Default::default(),
            eject: None,
        },
    )
    .unwrap()
}

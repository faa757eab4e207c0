//! What the in-process node tests share: an HTTP GET (for the admin API) and a GET
//! sent to a node over the fabric, as the ingress sends it (the proxy does not link
//! the ingress, even in its tests: the fabric client both use stands in for it).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use dpumesh_dpa::fabric::shm::ShmFabric;
use dpumesh_fabric_client::Client;
use dpumesh_fabric_client::health::Health;
use dpumesh_head::RequestHead;
use dpumesh_head::wire;

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

/// GET `path` for `host` from the node whose fabric listens at `node`, over a link of
/// its own on the shared-memory fabric (a new link per call: links land on the node's
/// shards in turn): the status and body the node answered, or the status of the error
/// the ingress would answer (502 for a link lost, 504 for a timeout).
pub fn fabric_get(node: SocketAddr, host: &str, path: &str, timeout: Duration) -> (u16, String) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let client = Client::new(
            "test",
            ShmFabric::new(),
            1,
            64 << 10,
            Arc::new(Health::new([])),
        )
        .unwrap();
        client.spawn_pump();
        let mut head = RequestHead::new("GET", path);
        head.authority = host.to_owned();
        let head = wire::encode_request(&head).unwrap();
        let slot = client.acquire().await;
        let answer = client.call(node, slot, head, 0, timeout);
        match tokio::time::timeout(timeout + Duration::from_secs(10), answer)
            .await
            .expect("an answer or an error comes: never a hang")
            .expect("the answer is never dropped unsent")
        {
            Ok(answer) => (
                wire::decode_response(&answer.head).unwrap().status,
                String::from_utf8_lossy(&answer.body).into_owned(),
            ),
            Err(e) => (e.status(), e.to_string()),
        }
    })
}

//! Nodes the Pingmesh analyzer judges unreachable, for the services that opted in
//! (`eject_unreachable` in the mesh file): the ingress routes their requests around
//! such nodes until the analyzer says they are back.
//!
//! A node can be unreachable while its fabric link still stands (a stopped host, a
//! NIC that drops): the link-based health of [`crate::health`] does not see it; the
//! probes do. A poller thread asks the analyzer's `/v1/unreachable` every second; if
//! the analyzer cannot be asked for `STALE`, nothing is ejected any more (fail open:
//! the monitor going away must not take nodes out of service).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::RwLock;

/// How often the analyzer is asked.
const EVERY: Duration = Duration::from_secs(1);
/// No answer for this long: eject nothing.
const STALE: Duration = Duration::from_secs(10);

/// Where to ask and whom it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EjectSettings {
    /// The analyzer's HTTP address.
    pub analyzer: SocketAddr,
    /// Node names (as the analyzer says them) and their fabric addresses.
    pub nodes: BTreeMap<String, SocketAddr>,
    /// The services that opted in.
    pub services: BTreeSet<String>,
}

/// The current verdict, shared by the shards.
#[derive(Debug, Default)]
pub struct Ejected {
    nodes: RwLock<BTreeSet<SocketAddr>>,
    services: BTreeSet<String>,
}

impl Ejected {
    /// Whether requests for `service` should avoid the node at `addr` now.
    pub fn avoids(&self, service: &str, addr: SocketAddr) -> bool {
        self.services.contains(service) && self.nodes.read().contains(&addr)
    }

    fn set(&self, nodes: BTreeSet<SocketAddr>) {
        let mut current = self.nodes.write();
        if *current != nodes {
            tracing::warn!(
                ejected = ?nodes,
                "Pingmesh: nodes the analyzer judges unreachable are routed around"
            );
            *current = nodes;
        }
    }
}

/// The node names in the analyzer's `/v1/unreachable` answer (a JSON array).
pub fn parse_unreachable(
    body: &str,
    nodes: &BTreeMap<String, SocketAddr>,
) -> Result<BTreeSet<SocketAddr>, String> {
    let names: Vec<String> =
        serde_json::from_str(body).map_err(|e| format!("not a list of node names: {e}"))?;
    Ok(names.iter().filter_map(|n| nodes.get(n).copied()).collect())
}

/// One `GET /v1/unreachable`.
fn ask(analyzer: SocketAddr) -> Result<String, String> {
    let timeout = Duration::from_millis(500);
    let mut s = TcpStream::connect_timeout(&analyzer, timeout).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET /v1/unreachable HTTP/1.1\r\nhost: {analyzer}\r\nconnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.take(1 << 20)
        .read_to_end(&mut raw)
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no HTTP answer")?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(head.lines().next().unwrap_or_default().to_owned());
    }
    Ok(body.to_owned())
}

/// The poller; stops when dropped.
#[derive(Debug)]
pub struct Poller {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts asking the analyzer; the verdict it keeps current.
pub fn start(settings: EjectSettings) -> std::io::Result<(Arc<Ejected>, Poller)> {
    let ejected = Arc::new(Ejected {
        nodes: RwLock::new(BTreeSet::new()),
        services: settings.services.clone(),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let (verdict, stopping) = (ejected.clone(), stop.clone());
    let thread = std::thread::Builder::new()
        .name("ingress-pingmesh".into())
        .spawn(move || {
            let mut last_answer = Instant::now();
            let mut said = false;
            while !stopping.load(Ordering::Relaxed) {
                match ask(settings.analyzer)
                    .and_then(|body| parse_unreachable(&body, &settings.nodes))
                {
                    Ok(nodes) => {
                        last_answer = Instant::now();
                        said = false;
                        verdict.set(nodes);
                    }
                    Err(e) if last_answer.elapsed() >= STALE => {
                        if !said {
                            tracing::warn!(error = %e, analyzer = %settings.analyzer,
                                "Pingmesh analyzer unanswered: no node is ejected until it answers");
                            said = true;
                        }
                        verdict.set(BTreeSet::new());
                    }
                    Err(_) => {}
                }
                std::thread::sleep(EVERY);
            }
        })?;
    Ok((
        ejected,
        Poller {
            stop,
            thread: Some(thread),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes() -> BTreeMap<String, SocketAddr> {
        [
            ("node1".to_owned(), "127.0.0.1:7101".parse().unwrap()),
            ("node2".to_owned(), "127.0.0.1:7102".parse().unwrap()),
        ]
        .into()
    }

    #[test]
    fn the_answer_names_nodes_by_their_mesh_names() {
        let got = parse_unreachable(r#"["node2", "someone-else"]"#, &nodes()).unwrap();
        assert_eq!(got, ["127.0.0.1:7102".parse().unwrap()].into());
        assert!(
            parse_unreachable("{}", &nodes())
                .unwrap_err()
                .contains("not a list")
        );
    }

    #[test]
    fn only_opted_in_services_avoid_an_ejected_node() {
        let e = Ejected {
            nodes: RwLock::new(["127.0.0.1:7102".parse().unwrap()].into()),
            services: ["frontend".to_owned()].into(),
        };
        let node2 = "127.0.0.1:7102".parse().unwrap();
        assert!(e.avoids("frontend", node2));
        assert!(!e.avoids("user", node2), "not opted in");
        assert!(!e.avoids("frontend", "127.0.0.1:7101".parse().unwrap()));
    }

    #[test]
    fn an_analyzer_that_cannot_be_asked_is_an_error_not_a_verdict() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        assert!(ask(addr).is_err());
    }
}

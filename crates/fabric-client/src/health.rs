//! What a sender knows of each node: not tried yet, reachable, or down (since when,
//! why). The fabric clients report their link events here (a link made, a connect refused, a
//! link lost: rare events, never one per request); the admin API's `/readyz` reads it,
//! and a prober connects to the nodes that are down, so a node that came back is seen
//! as reachable without waiting for traffic to find out.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// One node as its senders last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeState {
    /// No link was needed yet (links are made on demand).
    Untried,
    /// The last link made to it works.
    Up,
    /// The last connect failed or the link was lost.
    Down { since: Instant, why: String },
}

/// The nodes' states, shared by the clients (the ingress's shards), the ingress's
/// prober and its admin API.
#[derive(Debug)]
pub struct Health {
    nodes: Mutex<BTreeMap<SocketAddr, NodeState>>,
}

impl Health {
    /// Every node starts untried.
    pub fn new(nodes: impl IntoIterator<Item = SocketAddr>) -> Self {
        Self {
            nodes: Mutex::new(nodes.into_iter().map(|n| (n, NodeState::Untried)).collect()),
        }
    }

    fn set(&self, node: SocketAddr, state: NodeState) {
        self.nodes.lock().insert(node, state);
    }

    /// A link to `node` was made.
    pub fn up(&self, node: SocketAddr) {
        self.set(node, NodeState::Up);
    }

    /// Connecting to `node` failed, or its link was lost, at `now`. A node already
    /// down keeps the time it went down.
    pub fn down(&self, node: SocketAddr, why: &str, now: Instant) {
        let mut nodes = self.nodes.lock();
        let since = match nodes.get(&node) {
            Some(NodeState::Down { since, .. }) => *since,
            _ => now,
        };
        nodes.insert(
            node,
            NodeState::Down {
                since,
                why: why.to_owned(),
            },
        );
    }

    /// Whether the last word on `node` is that it is reachable.
    pub fn is_up(&self, node: SocketAddr) -> bool {
        self.nodes
            .lock()
            .get(&node)
            .is_some_and(|s| *s == NodeState::Up)
    }

    /// The nodes that are down.
    pub fn down_nodes(&self) -> Vec<SocketAddr> {
        self.nodes
            .lock()
            .iter()
            .filter(|(_, s)| matches!(s, NodeState::Down { .. }))
            .map(|(n, _)| *n)
            .collect()
    }

    /// Ready when no node is down; otherwise which are, for how long, and why.
    pub fn readiness(&self, now: Instant) -> Result<(), String> {
        let nodes = self.nodes.lock();
        let down: Vec<String> = nodes
            .iter()
            .filter_map(|(node, s)| match s {
                NodeState::Down { since, why } => Some(format!(
                    "node {node} unreachable for {:.1?}: {why}",
                    now.saturating_duration_since(*since)
                )),
                _ => None,
            })
            .collect();
        if down.is_empty() {
            Ok(())
        } else {
            Err(down.join("; "))
        }
    }

    /// Each node's state in words (for `/nodes`).
    pub fn describe(&self, now: Instant) -> Vec<(SocketAddr, String)> {
        let nodes = self.nodes.lock();
        nodes
            .iter()
            .map(|(node, s)| {
                let said = match s {
                    NodeState::Untried => "untried".to_owned(),
                    NodeState::Up => "up".to_owned(),
                    NodeState::Down { since, why } => format!(
                        "down for {:.1?}: {why}",
                        now.saturating_duration_since(*since)
                    ),
                };
                (*node, said)
            })
            .collect()
    }
}

/// How often the prober looks at the nodes that are down.
pub const PROBE_EVERY: Duration = Duration::from_millis(250);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_until_a_node_is_down_and_again_once_it_is_up() {
        let (a, b): (SocketAddr, SocketAddr) = (
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        );
        let h = Health::new([a, b]);
        let t = Instant::now();
        assert_eq!(
            h.readiness(t),
            Ok(()),
            "untried nodes do not hold readiness"
        );
        h.up(a);
        h.down(b, "connection refused", t);
        h.down(b, "connection refused again", t + Duration::from_secs(1));
        let why = h.readiness(t + Duration::from_secs(2)).unwrap_err();
        assert!(why.contains("127.0.0.1:2 unreachable for 2.0s"), "{why}");
        assert!(why.contains("again"), "the latest reason: {why}");
        assert_eq!(h.down_nodes(), [b]);
        h.up(b);
        assert_eq!(h.readiness(t), Ok(()));
        assert!(h.down_nodes().is_empty());
    }
}

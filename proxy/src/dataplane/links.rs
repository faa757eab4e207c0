//! The shard's links owner: queue pairs to the ingress and peer nodes, by queue pair
//! number and by node, and the peers waiting to be connected again.

use super::*;

impl<F: Fabric> Links<F> {
    /// Sets up the queue pairs the accept thread handed over.
    pub(super) fn accept(&mut self) {
        while let Ok(qp) = self.accepted.try_recv() {
            match Link::new(&self.fabric, &self.pd, qp) {
                Ok(link) => {
                    tracing::debug!(qp = link.qp_num(), "mesh link accepted");
                    self.by_qp
                        .insert(link.qp_num(), LinkState { link, node: None });
                }
                Err(e) => tracing::warn!(error = %e, "cannot set up an accepted mesh link"),
            }
        }
    }

    /// The upstream a peer link leads to, as the response phase names it.
    pub(super) fn upstream(&self, qp: u32) -> Option<String> {
        let node = self.by_qp.get(&qp)?.node.as_deref()?;
        Some(node_upstream(node))
    }

    /// The link to peer node `node` at `addr`: the one up, or a new one (unless the
    /// node's reconnect wait is still running).
    pub(super) fn peer(&mut self, node: &str, addr: SocketAddr) -> Option<u32> {
        if let Some(&qp) = self.by_node.get(node)
            && self.by_qp.get(&qp).is_some_and(|s| !s.link.is_down())
        {
            return Some(qp);
        }
        let key = node.to_owned();
        if !self.reconnect.may_try(&key, Instant::now()) {
            return None;
        }
        let qp = match self
            .fabric
            .connect(&self.pd, addr, &self.cq, QpCaps::default())
        {
            Ok(qp) => qp,
            Err(e) => {
                let wait = self.reconnect.failed(&key, Instant::now());
                tracing::warn!(node, %addr, error = %e, ?wait, "cannot reach peer node");
                return None;
            }
        };
        let link = match Link::new(&self.fabric, &self.pd, qp) {
            Ok(link) => link,
            Err(e) => {
                let wait = self.reconnect.failed(&key, Instant::now());
                tracing::warn!(node, error = %e, ?wait, "cannot set up the link to a peer node");
                return None;
            }
        };
        if self.reconnect.connected(&key) {
            tracing::info!(node, "link to peer node back");
            metrics::counter!("dpumesh_peer_reconnects_total", "node" => key.clone()).increment(1);
        }
        let num = link.qp_num();
        self.by_qp.insert(
            num,
            LinkState {
                link,
                node: Some(key.clone()),
            },
        );
        self.by_node.insert(key, num);
        Some(num)
    }

    /// Takes link `qp` out (it failed): a peer's is connected again after a wait.
    pub(super) fn remove(&mut self, qp: u32) -> Option<LinkState<F>> {
        let state = self.by_qp.remove(&qp)?;
        if let Some(node) = &state.node {
            self.by_node.remove(node);
            self.reconnect.lost(node);
        }
        Some(state)
    }

    /// The next of `count` nodes running `service`, round robin.
    pub(super) fn next_node(&mut self, service: &str) -> usize {
        next_turn(&mut self.node_turns, service)
    }
}

//! The shard's pods owner: the node's pods as last read, their body pools registered
//! with the fabric (once per node, shared by the shards), whom a service's next
//! request goes to, and the descriptors the DMA ring had no room for.

use super::*;

impl<F: Fabric> Pods<F> {
    /// Reads the node's pods again when `force`d or when the last read is old.
    pub(super) fn refresh(&mut self, force: bool) {
        if force || self.known_at.elapsed() >= Duration::from_millis(100) {
            self.known = self.dpu.pods();
            self.known_at = Instant::now();
        }
    }

    /// Pod `id` (read again once when it is new to this shard).
    pub(super) fn get(&mut self, id: u32) -> Option<&PodInfo> {
        if !self.known.iter().any(|p| p.id == id) {
            self.refresh(true);
        }
        self.known.iter().find(|p| p.id == id)
    }

    fn count_of(&self, service: &str) -> usize {
        self.known.iter().filter(|p| p.service == service).count()
    }

    /// The next pod of `service` on this node, round robin.
    pub(super) fn pick(&mut self, service: &str) -> Option<u32> {
        self.refresh(false);
        let mut count = self.count_of(service);
        if count == 0 {
            self.refresh(true);
            count = self.count_of(service);
        }
        if count == 0 {
            return None;
        }
        let n = next_turn(&mut self.turns, service);
        self.known
            .iter()
            .filter(|p| p.service == service)
            .nth(n % count)
            .map(|p| p.id)
    }

    /// Pod `pod`'s body pools, registered with `fabric` for READs and WRITEs.
    pub(super) fn regions(&mut self, pod: u32, fabric: &F, pd: &F::Pd) -> Option<&PodRegions<F>> {
        if !self.regions.contains_key(&pod) {
            let regions = self.node_regions_of(pod, fabric, pd)?;
            self.regions.insert(pod, regions);
        }
        self.regions.get(&pod).map(|r| &**r)
    }

    /// The node's registration of pod `pod`'s body pools: once per node, made by the
    /// first shard that needs it (the shards share one protection domain).
    fn node_regions_of(&mut self, pod: u32, fabric: &F, pd: &F::Pd) -> Option<Arc<PodRegions<F>>> {
        if let Some(known) = self.node_regions.lock().get(&pod) {
            return Some(known.clone());
        }
        let info = self.get(pod)?.clone();
        // The bytes' memory, which across PCIe is the host's, not the mirror pool's
        // (the offsets are the same: a mirror has its pool's layout).
        let (Some(rx_memory), Some(tx_memory)) = (info.rx_body_memory(), info.tx_body_memory())
        else {
            tracing::error!(
                pod,
                "the pod is across PCIe and its body pools are not reachable by the fabric on this build"
            );
            return None;
        };
        let register = |memory: &Arc<dpumesh_dpa::SharedRegion>| {
            fabric.register(
                pd,
                memory,
                0,
                memory.len() as u64,
                dpumesh_dpa::fabric::Access::all(),
            )
        };
        let (rx, tx) = match (register(rx_memory), register(tx_memory)) {
            (Ok(rx), Ok(tx)) => (rx, tx),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(pod, error = %e, "cannot register a pod's body pools");
                return None;
            }
        };
        let regions = Arc::new(PodRegions {
            rx,
            tx,
            rx_pool: info.rx_body,
            tx_pool: info.tx_body,
        });
        // Another shard may have registered it meanwhile: the first one stays.
        Some(
            self.node_regions
                .lock()
                .entry(pod)
                .or_insert(regions)
                .clone(),
        )
    }

    /// Reads the pods again and drops the registrations of those that left (their
    /// memory can go). Returns the pods still here.
    pub(super) fn forget_departed(&mut self) -> std::collections::HashSet<u32> {
        self.refresh(true);
        let live: std::collections::HashSet<u32> = self.known.iter().map(|p| p.id).collect();
        self.regions.retain(|id, _| live.contains(id));
        // A registration goes when the last shard holding it lets go.
        self.node_regions.lock().retain(|id, _| live.contains(id));
        live
    }

    /// Publishes the node's pods and slots in use per pool.
    pub(super) fn publish_occupancy(&self) {
        let (tx, rx) = self.dpu.dpu_pool_use();
        let bodies: usize = self
            .known
            .iter()
            .map(|p| p.rx_body.in_use() + p.tx_body.in_use())
            .sum();
        metrics::gauge!("dpumesh_pods").set(self.known.len() as f64);
        metrics::gauge!("dpumesh_pool_slots_in_use", "pool" => "dpu_tx_header").set(tx as f64);
        metrics::gauge!("dpumesh_pool_slots_in_use", "pool" => "dpu_rx_header").set(rx as f64);
        metrics::gauge!("dpumesh_pool_slots_in_use", "pool" => "pod_bodies").set(bodies as f64);
    }
}

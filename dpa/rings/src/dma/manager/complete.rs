//! What goes back: bodies returned to their pods, completions and refusals written to
//! the pods' RX rings and reported to the proxy, and deliveries held for a full ring
//! tried again.

use super::*;

impl<E: DmaEngine> DmaManager<E> {
    /// A body the manager claimed at intake goes back to its pod with a completion.
    pub(super) fn return_body(&mut self, src_id: u32, d: &Descriptor) {
        let Some(src) = self.pods.get(&src_id) else {
            return;
        };
        let Ok(slot) = src.tx_body.slot_of(d.body) else {
            return;
        };
        if src
            .tx_body
            .transfer(slot, OwnerId::DMA, OwnerId(src_id))
            .is_ok()
        {
            self.complete_to_pod(src_id, d, Buffer::NONE, d.body);
        }
    }

    /// The ARM is done with what `d` names (a body it sent over the fabric, a header
    /// it consumed): buffers go back to their owners.
    pub(super) fn arm_completion(&mut self, d: &Descriptor) {
        if d.kind.error && d.kind.stream && d.header.is_none() && d.body.is_none() {
            // The ARM gave a stream up (its receiver left): its sender hears it and
            // stops. Nothing is handed back: the parts it holds come back one by one.
            if self.pods.contains_key(&d.src_pod) {
                let mut notice = *d;
                notice.dst = Destination::Pod(d.src_pod);
                self.push_to_pod(d.src_pod, notice);
            }
            return;
        }
        if !d.header.is_none()
            && let Ok((is_tx, slot)) = self.dpu_header_slot(d.header)
        {
            let pool = if is_tx {
                &self.dpu_tx_header
            } else {
                &self.dpu_rx_header
            };
            let _ = pool.release(slot, OwnerId::PROXY);
        }
        if !d.body.is_none() {
            let src = d.src_pod;
            if self
                .pods
                .get(&src)
                .is_some_and(|p| p.tx_body.id() == d.body.addr.region())
            {
                if d.kind.error {
                    // Tell the pod its request failed before its body left.
                    self.return_body_with_error(src, d);
                } else {
                    self.return_body(src, d);
                }
            }
        }
    }

    pub(super) fn return_body_with_error(&mut self, src_id: u32, d: &Descriptor) {
        let Some(src) = self.pods.get(&src_id) else {
            return;
        };
        let Ok(slot) = src.tx_body.slot_of(d.body) else {
            return;
        };
        // Only a body this manager held goes back with a notice; anything else would
        // name a slot the pod may have reused.
        if src
            .tx_body
            .transfer(slot, OwnerId::DMA, OwnerId(src_id))
            .is_err()
        {
            return;
        }
        let status = d.error_status().unwrap_or(DescriptorStatus::CopyFailed);
        let mut e = *d;
        e.header = Buffer::NONE;
        e.kind = Kind {
            completion: true,
            error: true,
            // A stream part's notice keeps its direction: a pod may send a stream
            // each way under the same ids.
            response: d.kind.stream && d.kind.response,
            stream: d.kind.stream,
        };
        e.status = status as u16;
        e.dst = Destination::Pod(src_id);
        self.push_to_pod(src_id, e);
    }

    // === completions and errors ===

    pub(super) fn complete_to_pod(
        &mut self,
        pod_id: u32,
        d: &Descriptor,
        header: Buffer,
        body: Buffer,
    ) {
        let mut c = *d;
        // A stream part's completion says so, and which way the stream flows (a
        // pod may send a stream each way under the same ids): its sender counts
        // what the receiver took (the stream's window).
        c.kind = Kind {
            completion: true,
            stream: d.kind.stream,
            response: d.kind.stream && d.kind.response,
            ..Kind::default()
        };
        c.header = header;
        c.body = body;
        c.status = 0;
        c.dst = Destination::Pod(pod_id);
        self.stats.completions.fetch_add(1, Ordering::Relaxed);
        self.push_to_pod(pod_id, c);
    }

    pub(super) fn refuse_to_pod(&mut self, pod_id: u32, d: &Descriptor, refusal: Refusal) {
        tracing::debug!(pod = pod_id, req = d.req_id, step = d.step_id, status = ?refusal.status, detail = %refusal.detail, "refused a host descriptor");
        let mut e = *d;
        // The error hands the named buffers back: the pod still owns them. A stream
        // part's keeps its direction.
        e.kind = Kind {
            completion: true,
            error: true,
            response: d.kind.stream && d.kind.response,
            stream: d.kind.stream,
        };
        e.status = refusal.status as u16;
        e.dst = Destination::Pod(pod_id);
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        self.push_to_pod(pod_id, e);
    }

    /// Completions and errors are never dropped while the pod lives: they hand slots
    /// back. A full RX SQ queues them (in order, ahead of deliveries to that pod); the
    /// queue is bounded by the pod's slots, since each TX slot has one completion.
    pub(super) fn push_to_pod(&mut self, pod_id: u32, d: Descriptor) {
        if !self.pods.contains_key(&pod_id) {
            return;
        }
        let queued = self.completions.get(&pod_id).is_some_and(|q| !q.is_empty());
        if queued || self.publish_to_pod(pod_id, &d).is_err() {
            let queue = self.completions.entry(pod_id).or_default();
            if queue.len() >= MAX_QUEUED_COMPLETIONS {
                tracing::warn!(pod = pod_id, "pod reads no completions; one was dropped");
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                return;
            }
            queue.push_back(d);
        }
    }

    /// Tells the ARM that `d` could not be delivered (nothing left to release).
    pub(super) fn report_to_arm(&mut self, d: &Descriptor, status: DescriptorStatus) {
        let mut e = *d;
        e.header = Buffer::NONE;
        e.body = Buffer::NONE;
        e.kind = Kind {
            completion: true,
            error: true,
            response: d.kind.response,
            stream: d.kind.stream,
        };
        e.status = status as u16;
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        self.send_to_arm(e);
    }

    /// A delivery failed: the buffers go back, and the ARM hears why (it answers the
    /// caller: ingress or the pod that asked).
    pub(super) fn fail_delivery(&mut self, d: &Descriptor, refusal: Refusal) {
        tracing::debug!(req = d.req_id, step = d.step_id, status = ?refusal.status, detail = %refusal.detail, "delivery failed");
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        if !d.header.is_none()
            && let Ok((is_tx, slot)) = self.dpu_header_slot(d.header)
        {
            let pool = if is_tx {
                &self.dpu_tx_header
            } else {
                &self.dpu_rx_header
            };
            let _ = pool.release(slot, OwnerId::PROXY);
        }
        if !d.body.is_none() {
            let src = d.src_pod;
            if self
                .pods
                .get(&src)
                .is_some_and(|p| p.tx_body.id() == d.body.addr.region())
            {
                self.return_body(src, d);
            } else if let Destination::Pod(dst) = d.dst
                && let Some(pod) = self.pods.get(&dst)
                && let Ok(slot) = pod.rx_body.slot_of(d.body)
            {
                let _ = pod.rx_body.release(slot, OwnerId::PROXY);
                let _ = pod.rx_body.release(slot, OwnerId::FABRIC);
            }
        }
        // Behind anything already held for the ARM, so notices keep their order.
        self.stats.errors.fetch_sub(1, Ordering::Relaxed);
        self.report_to_arm(d, refusal.status);
    }

    pub(super) fn retry_held(&mut self) -> usize {
        let mut work = 0;
        // Completions first: they free the slots pods may be waiting for.
        let queued: Vec<u32> = self.completions.keys().copied().collect();
        for pod_id in queued {
            if !self.pods.contains_key(&pod_id) {
                self.completions.remove(&pod_id);
                continue;
            }
            let mut queue = self.completions.remove(&pod_id).expect("listed above");
            while let Some(d) = queue.front() {
                if self.publish_to_pod(pod_id, d).is_err() {
                    break;
                }
                queue.pop_front();
                work += 1;
            }
            if !queue.is_empty() {
                self.completions.insert(pod_id, queue);
            }
        }
        let pods: Vec<u32> = self.held.keys().copied().collect();
        for dst in pods {
            while let Some(room) = self.pods.get_mut(&dst).map(|p| p.rx_sq.free()) {
                // A delivery needs room for itself and a completion (see `deliver`):
                // with less, it would go straight back to the end of the queue, out
                // of order, and this loop would spin until the pod read its ring.
                if room < 2 || self.completions.contains_key(&dst) {
                    break;
                }
                let Some(d) = self.held.get_mut(&dst).and_then(VecDeque::pop_front) else {
                    break;
                };
                self.stats.held.fetch_sub(1, Ordering::Relaxed);
                work += 1;
                self.deliver(dst, d);
            }
            if self.held.get(&dst).is_some_and(VecDeque::is_empty) {
                self.held.remove(&dst);
            }
        }
        work
    }
}

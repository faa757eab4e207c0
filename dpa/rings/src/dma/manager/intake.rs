//! Intake and delivery: a pod's descriptor taken from its TX ring (its header copied
//! to a DPU slot for the proxy, its body claimed where it is), and the proxy's
//! decision carried out (header into the destination's RX pool, the body moved or
//! handed over).

use super::*;

impl<E: DmaEngine> DmaManager<E> {
    // === intake: host TX SQ → sidecar TX SQ ===

    pub(super) fn intake(&mut self, pod_id: u32, d: Descriptor) {
        if d.kind.completion || d.kind.error {
            self.refuse_to_pod(
                pod_id,
                &d,
                Refusal::new(
                    DescriptorStatus::Malformed,
                    "pods do not send completions or errors",
                ),
            );
            return;
        }
        if matches!(d.stream_part(), Some(StreamPart::Taken | StreamPart::Stop))
            && !(d.header.is_none() && d.body.is_none())
        {
            // What a pod did with a stream sent to it names nothing to move.
            self.refuse_to_pod(
                pod_id,
                &d,
                Refusal::new(
                    DescriptorStatus::Malformed,
                    "a stream's Taken or Stop carries no buffers",
                ),
            );
            return;
        }
        match self.claim_and_copy_header(pod_id, &d) {
            Ok(forward) => self.send_to_arm(forward),
            Err(refusal) => self.refuse_to_pod(pod_id, &d, refusal),
        }
    }

    /// Checks the pod owns what `d` names, copies the header into a DPU slot, hands
    /// the pod's header slot back, and claims the body slot. Returns what the ARM gets.
    pub(super) fn claim_and_copy_header(
        &mut self,
        pod_id: u32,
        d: &Descriptor,
    ) -> Result<Descriptor, Refusal> {
        let owner = OwnerId(pod_id);
        let pod = self.pods.get(&pod_id).expect("polled pods exist");
        let header_slot = if d.header.is_none() {
            None
        } else {
            Some(pod.tx_header.slot_of(d.header)?)
        };
        let body_slot = if d.body.is_none() {
            None
        } else {
            Some(pod.tx_body.slot_of(d.body)?)
        };
        // Claim both (ownership check and hand-over in one step each).
        if let Some(s) = header_slot {
            pod.tx_header.transfer(s, owner, OwnerId::DMA)?;
        }
        if let Some(s) = body_slot
            && let Err(e) = pod.tx_body.transfer(s, owner, OwnerId::DMA)
        {
            if let Some(h) = header_slot {
                let _ = pod.tx_header.transfer(h, OwnerId::DMA, owner);
            }
            return Err(e.into());
        }
        let mut forward = *d;
        forward.src_pod = pod_id;
        if let Some(h) = header_slot {
            let copied = self.copy_header_to_dpu(pod_id, d.header);
            let pod = self.pods.get(&pod_id).expect("polled pods exist");
            // The pod's header slot goes back either way; the completion frees it.
            let _ = pod.tx_header.transfer(h, OwnerId::DMA, owner);
            let header = match copied {
                Ok(header) => header,
                Err(refusal) => {
                    if let Some(b) = body_slot {
                        let _ = pod.tx_body.transfer(b, OwnerId::DMA, owner);
                    }
                    return Err(refusal);
                }
            };
            self.complete_to_pod(pod_id, d, d.header, Buffer::NONE);
            forward.header = header;
        }
        Ok(forward)
    }

    pub(super) fn copy_header_to_dpu(
        &mut self,
        pod_id: u32,
        header: Buffer,
    ) -> Result<Buffer, Refusal> {
        let pod = self.pods.get(&pod_id).expect("polled pods exist");
        if header.len > self.dpu_tx_header.layout().slot_size {
            return Err(Refusal::new(
                DescriptorStatus::BadBuffer,
                format!(
                    "header of {} bytes exceeds the DPU's {}-byte header slots",
                    header.len,
                    self.dpu_tx_header.layout().slot_size
                ),
            ));
        }
        let src_offset = pod.tx_header.offset_of(header)?;
        let dpu_slot = self.dpu_tx_header.alloc(OwnerId::DMA)?;
        // Cannot fail: the length was checked against the slot size above.
        let dst = self.dpu_tx_header.buffer(dpu_slot, header.len)?;
        let job = CopyJob {
            src: pod.tx_header.region(),
            src_offset,
            dst: self.dpu_tx_header.region(),
            dst_offset: self.dpu_tx_header.offset_of(dst)?,
            len: header.len as u64,
        };
        if let Err(e) = self.engine.copy(&[job]) {
            let _ = self.dpu_tx_header.release(dpu_slot, OwnerId::DMA);
            return Err(Refusal::new(DescriptorStatus::CopyFailed, e.to_string()));
        }
        self.count_copy(header.len as u64);
        self.dpu_tx_header
            .transfer(dpu_slot, OwnerId::DMA, OwnerId::PROXY)?;
        Ok(dst)
    }

    pub(super) fn send_to_arm(&mut self, d: Descriptor) {
        self.to_proxy.push_back(d);
    }

    // === from the ARM: sidecar RX SQ → host RX SQ ===

    pub(super) fn handle_from_arm(&mut self, d: Descriptor) {
        if d.kind.completion {
            self.arm_completion(&d);
            return;
        }
        let Destination::Pod(dst) = d.dst else {
            self.fail_delivery(
                &d,
                Refusal::new(DescriptorStatus::Malformed, "the ARM delivers to pods only"),
            );
            return;
        };
        if self.is_leaving(dst) {
            self.fail_delivery(
                &d,
                Refusal::new(DescriptorStatus::PodGone, format!("pod {dst} went away")),
            );
            return;
        }
        if !self.pods.contains_key(&dst) {
            self.fail_delivery(
                &d,
                Refusal::new(
                    DescriptorStatus::UnknownPod,
                    format!("pod {dst} is not registered on this node"),
                ),
            );
            return;
        }
        if !self.stalls.stalled.is_empty() && self.refuses(dst) {
            let refusal = self.stall_refusal(dst, Instant::now());
            self.fail_delivery(&d, refusal);
            return;
        }
        if self.held.get(&dst).is_some_and(|q| !q.is_empty()) {
            self.hold(dst, d);
            return;
        }
        self.deliver(dst, d);
    }

    pub(super) fn hold(&mut self, dst: u32, d: Descriptor) {
        let queue = self.held.entry(dst).or_default();
        if queue.len() >= MAX_HELD {
            self.fail_delivery(
                &d,
                Refusal::new(
                    DescriptorStatus::RingFull,
                    format!("pod {dst}'s RX ring stays full"),
                ),
            );
            return;
        }
        self.stats.held.fetch_add(1, Ordering::Relaxed);
        queue.push_back(d);
    }

    /// Moves header and body into pod `dst` and writes its RX SQ; holds `d` if the
    /// ring is full (nothing moved yet), fails it on any other error.
    pub(super) fn deliver(&mut self, dst: u32, d: Descriptor) {
        let pod = self.pods.get_mut(&dst).expect("checked by the caller");
        // Room for the delivery and for the completion a case 3 copy may send to the
        // source pod, which can be this pod (a service calling itself); completions
        // waiting for this pod go first.
        if pod.rx_sq.free() < 2 || self.completions.get(&dst).is_some_and(|q| !q.is_empty()) {
            self.hold(dst, d);
            return;
        }
        match self.move_into_pod(dst, &d) {
            Ok(delivered) => {
                match self.publish_to_pod(dst, &delivered) {
                    Ok(()) => {
                        self.stats.delivered.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        // Only a ring whose consumer corrupted it refuses here: the pod
                        // does not get this, and its slots go back.
                        tracing::warn!(pod = dst, error = %e, "host RX SQ refused a delivery it had room for");
                        let pod = self.pods.get(&dst).expect("checked by the caller");
                        let owner = OwnerId(dst);
                        for (pool, b) in [
                            (&pod.rx_header, delivered.header),
                            (&pod.rx_body, delivered.body),
                        ] {
                            if let Ok(slot) = pool.slot_of(b) {
                                let _ = pool.release(slot, owner);
                            }
                        }
                        self.report_to_arm(&d, DescriptorStatus::RingFull);
                    }
                }
            }
            Err(refusal) => self.fail_delivery(&d, refusal),
        }
    }

    pub(super) fn move_into_pod(
        &mut self,
        dst: u32,
        d: &Descriptor,
    ) -> Result<Descriptor, Refusal> {
        let owner = OwnerId(dst);
        let mut out = *d;
        // The header: from a DPU pool (owned by the ARM) into the pod's RX pool. The
        // DPU slot is freed only once the whole delivery has succeeded, so a failure
        // leaves it with the ARM for `fail_delivery` to free exactly once.
        let mut dpu_header = None;
        if !d.header.is_none() {
            let (src_is_tx, src_slot) = self.dpu_header_slot(d.header)?;
            let pod = self.pods.get(&dst).expect("checked");
            let slot = pod.rx_header.alloc(owner)?;
            let buffer = pod.rx_header.buffer(slot, d.header.len).inspect_err(|_| {
                let _ = pod.rx_header.release(slot, owner);
            })?;
            let src = if src_is_tx {
                &self.dpu_tx_header
            } else {
                &self.dpu_rx_header
            };
            let job = CopyJob {
                src: src.region(),
                src_offset: src.offset_of(d.header)?,
                dst: pod.rx_header.region(),
                dst_offset: pod.rx_header.offset_of(buffer)?,
                len: d.header.len as u64,
            };
            if let Err(e) = self.engine.copy(&[job]) {
                let _ = pod.rx_header.release(slot, owner);
                return Err(Refusal::new(DescriptorStatus::CopyFailed, e.to_string()));
            }
            self.count_copy(d.header.len as u64);
            dpu_header = Some((src_is_tx, src_slot));
            out.header = buffer;
        }
        if !d.body.is_none() {
            out.body = match self.move_body(dst, d) {
                Ok(body) => body,
                Err(refusal) => {
                    // Undo the header move: the pod never sees this descriptor.
                    if !out.header.is_none() {
                        let pod = self.pods.get(&dst).expect("checked");
                        if let Ok(s) = pod.rx_header.slot_of(out.header) {
                            let _ = pod.rx_header.release(s, owner);
                        }
                    }
                    return Err(refusal);
                }
            };
        }
        if let Some((is_tx, slot)) = dpu_header {
            let pool = if is_tx {
                &self.dpu_tx_header
            } else {
                &self.dpu_rx_header
            };
            let _ = pool.release(slot, OwnerId::PROXY);
        }
        Ok(out)
    }

    pub(super) fn dpu_header_slot(&self, header: Buffer) -> Result<(bool, SlotRef), Refusal> {
        let (is_tx, pool) = if header.addr.region() == self.dpu_tx_header.id() {
            (true, &self.dpu_tx_header)
        } else if header.addr.region() == self.dpu_rx_header.id() {
            (false, &self.dpu_rx_header)
        } else {
            return Err(Refusal::new(
                DescriptorStatus::BadBuffer,
                format!("header {} is not in a DPU header pool", header.addr),
            ));
        };
        let slot = pool.slot_of(header)?;
        match pool.state(slot.index) {
            Some((_, OwnerId::PROXY)) => Ok((is_tx, slot)),
            other => Err(Refusal::new(
                DescriptorStatus::BadBuffer,
                format!(
                    "header {} is not held by the proxy ({other:?})",
                    header.addr
                ),
            )),
        }
    }

    /// Case 2: the body is in `dst`'s RX body pool already (the fabric put it there);
    /// case 3: it is in the source pod's TX body pool and is copied across.
    pub(super) fn move_body(&mut self, dst: u32, d: &Descriptor) -> Result<Buffer, Refusal> {
        let owner = OwnerId(dst);
        let region = d.body.addr.region();
        let pod = self.pods.get(&dst).expect("checked");
        if region == pod.rx_body.id() {
            let slot = pod.rx_body.slot_of(d.body)?;
            match pod.rx_body.state(slot.index) {
                Some((_, holder)) if holder == OwnerId::PROXY || holder == OwnerId::FABRIC => {
                    // Across PCIe the fabric (or the proxy) put it in the staging
                    // copy: it reaches the host first.
                    self.unstage_rx_body(dst, d.body)?;
                    let pod = self.pods.get(&dst).expect("checked");
                    pod.rx_body.transfer(slot, holder, owner)?;
                    return Ok(d.body);
                }
                other => {
                    return Err(Refusal::new(
                        DescriptorStatus::BadBuffer,
                        format!(
                            "body {} in pod {dst}'s RX pool is not held by the proxy ({other:?})",
                            d.body.addr
                        ),
                    ));
                }
            }
        }
        let src_id = d.src_pod;
        let Some(src) = self.pods.get(&src_id).filter(|p| p.tx_body.id() == region) else {
            return Err(Refusal::new(
                DescriptorStatus::BadBuffer,
                format!(
                    "body {} is neither in pod {dst}'s RX pool nor in source pod {src_id}'s TX pool",
                    d.body.addr
                ),
            ));
        };
        let src_slot = src.tx_body.slot_of(d.body)?;
        if src.tx_body.state(src_slot.index).map(|s| s.1) != Some(OwnerId::DMA) {
            return Err(Refusal::new(
                DescriptorStatus::BadBuffer,
                format!(
                    "body {} of pod {src_id} was not handed to the DMA manager",
                    d.body.addr
                ),
            ));
        }
        let pod = self.pods.get(&dst).expect("checked");
        let slot = pod.rx_body.alloc(owner)?;
        let buffer = match pod.rx_body.buffer(slot, d.body.len) {
            Ok(b) => b,
            Err(e) => {
                let _ = pod.rx_body.release(slot, owner);
                return Err(e.into());
            }
        };
        // Pod A → pod B, directly.
        let job = CopyJob {
            src: src.tx_body.region(),
            src_offset: src.tx_body.offset_of(d.body)?,
            dst: pod.rx_body.region(),
            dst_offset: pod.rx_body.offset_of(buffer)?,
            len: d.body.len as u64,
        };
        if let Err(e) = self.engine.copy(&[job]) {
            let _ = pod.rx_body.release(slot, owner);
            return Err(Refusal::new(DescriptorStatus::CopyFailed, e.to_string()));
        }
        self.count_copy(d.body.len as u64);
        self.return_body(src_id, d);
        Ok(buffer)
    }
}

//! The client side: a ring of call contexts per connection; callers take turns polling.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Vacant,
    /// Meta sent, response awaited.
    Waiting,
    /// The response landed.
    Done,
    /// Failed with this status.
    Failed(WcStatus),
    /// Its caller gave up; the late response frees it.
    Abandoned,
}

struct ClientState {
    slots: Vec<Slot>,
    polling: bool,
    sends: u64,
    broken: Option<WcStatus>,
}

/// An RPC client: one connection with a ring of contexts. Share it between threads
/// to keep several calls in flight.
pub struct RpcClient<F: Fabric> {
    qp: F::Qp,
    cq: F::Cq,
    mr: F::Mr,
    region: Arc<SharedRegion>,
    config: RpcConfig,
    state: Mutex<ClientState>,
    changed: Condvar,
}

impl<F: Fabric> std::fmt::Debug for RpcClient<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcClient")
            .field("slots", &self.config.slots)
            .finish_non_exhaustive()
    }
}

impl<F: Fabric> RpcClient<F> {
    /// Connects to an [`RpcServer`] at `addr` (the server must use the same
    /// `slots`, `inline` and size limits).
    pub fn connect(fabric: &F, addr: SocketAddr, config: RpcConfig) -> Result<Self, RpcError> {
        let pd = fabric.alloc_pd()?;
        let cq = fabric.create_cq(config.slots * 4 + 64)?;
        let region = Arc::new(SharedRegion::create_unique(
            "dpumesh-rpc-client",
            config.region_len() as usize,
        )?);
        let mr = fabric.register(&pd, &region, 0, config.region_len(), Access::all())?;
        let caps = QpCaps {
            max_send_wr: config.slots * 2 + SIGNAL_EVERY as u32 * 2,
            max_recv_wr: config.slots * 2,
        };
        let qp = fabric.connect(&pd, addr, &cq, caps)?;
        // One receive per context, for the responses' immediate data.
        for i in 0..config.slots {
            qp.post_recv(RecvWr {
                wr_id: i as u64,
                sge: mr.sge(0, 0),
            })?;
        }
        Ok(Self {
            qp,
            cq,
            mr,
            region,
            state: Mutex::new(ClientState {
                slots: vec![Slot::Vacant; config.slots as usize],
                polling: false,
                sends: 0,
                broken: None,
            }),
            changed: Condvar::new(),
            config,
        })
    }

    /// Calls the server with `request` and waits for its response.
    pub fn call(&self, request: &[u8]) -> Result<Vec<u8>, RpcError> {
        if request.len() > self.config.max_request as usize {
            return Err(RpcError::RequestTooLarge {
                len: request.len(),
                limit: self.config.max_request,
            });
        }
        let deadline = Instant::now() + self.config.timeout;
        let ctx = self.take_slot(deadline)?;
        // The response is copied out while the context is still ours: once it is
        // vacant, another call may take it and the server may write its response into
        // the same buffer.
        let result = self
            .send(ctx, request)
            .and_then(|()| self.wait(ctx, deadline))
            .and_then(|(status, len)| {
                let body = self
                    .region
                    .read_vec(self.config.response_at(ctx) + RESP_HEADER, len as usize)?;
                Ok((status, body))
            });
        let mut state = self.state.lock();
        match &result {
            Err(RpcError::Timeout(_)) => state.slots[ctx as usize] = Slot::Abandoned,
            _ => state.slots[ctx as usize] = Slot::Vacant,
        }
        drop(state);
        self.changed.notify_all();
        let (status, body) = result?;
        match status {
            STATUS_OK => Ok(body),
            STATUS_TOO_LARGE => Err(RpcError::ResponseTooLarge {
                limit: self.config.max_response,
            }),
            _ => Err(RpcError::Handler(
                String::from_utf8_lossy(&body).into_owned(),
            )),
        }
    }

    fn take_slot(&self, deadline: Instant) -> Result<u32, RpcError> {
        let mut state = self.state.lock();
        loop {
            if let Some(status) = state.broken {
                return Err(RpcError::Completion(status));
            }
            if let Some(i) = state.slots.iter().position(|s| *s == Slot::Vacant) {
                state.slots[i] = Slot::Waiting;
                return Ok(i as u32);
            }
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                return Err(RpcError::Timeout(self.config.timeout));
            }
        }
    }

    fn send(&self, ctx: u32, request: &[u8]) -> Result<(), RpcError> {
        let c = &self.config;
        let mut meta = Meta {
            kind: KIND_INLINE,
            ctx,
            len: request.len() as u32,
            req: self.mr.remote(c.request_at(ctx)),
            resp: self.mr.remote(c.response_at(ctx)),
            resp_cap: c.max_response,
        };
        let meta_at = c.meta_at(ctx);
        let sge_len = if request.len() <= c.inline as usize {
            self.region.write(meta_at + META_LEN, request)?;
            META_LEN as u32 + request.len() as u32
        } else {
            meta.kind = KIND_REMOTE;
            self.region.write(c.request_at(ctx), request)?;
            META_LEN as u32
        };
        self.region.write(meta_at, &meta.encode())?;
        let signaled = {
            let mut state = self.state.lock();
            state.sends += 1;
            state.sends.is_multiple_of(SIGNAL_EVERY)
        };
        self.qp.post_send(SendWr {
            wr_id: u64::MAX,
            op: SendOp::Send,
            sge: self.mr.sge(meta_at, sge_len),
            signaled,
        })?;
        Ok(())
    }

    /// Waits for context `ctx`'s response; whoever waits takes turns polling.
    fn wait(&self, ctx: u32, deadline: Instant) -> Result<(u32, u32), RpcError> {
        let mut completions = Vec::new();
        loop {
            {
                let mut state = self.state.lock();
                loop {
                    match state.slots[ctx as usize] {
                        Slot::Done => {
                            drop(state);
                            let mut header = [0u8; RESP_HEADER as usize];
                            self.region
                                .read(self.config.response_at(ctx), &mut header)?;
                            let status =
                                u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
                            let len =
                                u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
                            return Ok((status, len.min(self.config.max_response)));
                        }
                        Slot::Failed(status) => return Err(RpcError::Completion(status)),
                        _ => {}
                    }
                    if Instant::now() >= deadline {
                        return Err(RpcError::Timeout(self.config.timeout));
                    }
                    if !state.polling {
                        state.polling = true;
                        break;
                    }
                    self.changed.wait_until(&mut state, deadline);
                }
            }
            // This caller polls for everyone until something changes.
            let left = deadline.saturating_duration_since(Instant::now());
            let waited = self.cq.wait(left.min(Duration::from_millis(50)));
            completions.clear();
            self.cq.poll(&mut completions, 64);
            let mut state = self.state.lock();
            state.polling = false;
            if let Err(e) = waited {
                state.broken = Some(WcStatus::General);
                drop(state);
                self.changed.notify_all();
                return Err(e.into());
            }
            self.dispatch(&mut state, &completions);
            drop(state);
            self.changed.notify_all();
        }
    }

    fn dispatch(&self, state: &mut ClientState, completions: &[WorkCompletion]) {
        for wc in completions {
            if wc.status != WcStatus::Success {
                // The connection is broken: every waiting call fails.
                state.broken = Some(wc.status);
                for s in state.slots.iter_mut() {
                    if *s == Slot::Waiting {
                        *s = Slot::Failed(wc.status);
                    }
                }
                continue;
            }
            if wc.opcode == WcOpcode::RecvRdmaWithImm {
                let _ = self.qp.post_recv(RecvWr {
                    wr_id: wc.wr_id,
                    sge: self.mr.sge(0, 0),
                });
                if let Some(ctx) = wc.imm
                    && let Some(slot) = state.slots.get_mut(ctx as usize)
                {
                    *slot = match *slot {
                        Slot::Abandoned => Slot::Vacant,
                        _ => Slot::Done,
                    };
                }
            }
        }
    }
}

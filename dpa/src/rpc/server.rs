//! The server side: one poller drains every connection's completions; handlers run on
//! a pool.

use super::*;

/// What a handler gets and returns: request bytes in, response bytes (or a message
/// for the caller) out.
pub type Handler = dyn Fn(&[u8]) -> Result<Vec<u8>, String> + Send + Sync;

struct Conn<F: Fabric> {
    qp: F::Qp,
    mr: F::Mr,
    region: Arc<SharedRegion>,
    sends: AtomicU64,
}

struct Job {
    conn: u32,
    meta: Meta,
    request: Vec<u8>,
}

/// A running RPC server: an accept thread, one poller for every connection, and a
/// pool of handler threads. Dropping it stops them.
pub struct RpcServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    stats: Arc<ServerStats>,
}

/// Server counters.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Responses posted.
    pub calls: AtomicU64,
    /// Requests that arrived inline.
    pub inline: AtomicU64,
    /// Requests fetched with RDMA_READ.
    pub read: AtomicU64,
    /// Connections accepted.
    pub connections: AtomicU64,
}

impl std::fmt::Debug for RpcServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl RpcServer {
    /// Listens at `addr` and serves calls with `handler`.
    pub fn start<F: Fabric>(
        fabric: F,
        addr: SocketAddr,
        config: RpcConfig,
        handler: Arc<Handler>,
    ) -> Result<Self, RpcError> {
        let pd = fabric.alloc_pd()?;
        let cq = fabric.create_cq(4096)?;
        let caps = QpCaps {
            max_send_wr: config.slots * 2 + SIGNAL_EVERY as u32 * 2,
            max_recv_wr: config.slots * 2,
        };
        let listener = fabric.listen(&pd, addr, &cq, caps)?;
        let addr = listener.local_addr();
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(ServerStats::default());
        let conns: Arc<Mutex<HashMap<u32, Arc<Conn<F>>>>> = Arc::default();
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
        let mut threads = Vec::new();

        // Accept: set up each connection's buffers and receives, hand it to the poller.
        {
            let stop = stop.clone();
            let conns = conns.clone();
            let stats = stats.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("dpumesh-rpc-accept".into())
                    .spawn(move || {
                        let mut next = 0u32;
                        while !stop.load(Ordering::Relaxed) {
                            let qp = match listener.accept(Duration::from_millis(50)) {
                                Ok(Some(qp)) => qp,
                                Ok(None) => continue,
                                Err(e) => {
                                    tracing::warn!(error = %e, "RPC accept failed");
                                    continue;
                                }
                            };
                            // The poller must know the connection before its first
                            // receive is posted: a request arriving in between would
                            // complete on a queue pair it cannot place, and be lost.
                            let conn = match setup::<F>(&fabric, &pd, qp, &config) {
                                Ok(conn) => Arc::new(conn),
                                Err(e) => {
                                    tracing::warn!(error = %e, "RPC connection setup failed");
                                    continue;
                                }
                            };
                            conns.lock().insert(next, conn.clone());
                            match post_receives(&conn, &config) {
                                Ok(()) => {
                                    stats.connections.fetch_add(1, Ordering::Relaxed);
                                    next += 1;
                                }
                                Err(e) => {
                                    conns.lock().remove(&next);
                                    tracing::warn!(error = %e, "RPC connection setup failed");
                                }
                            }
                        }
                    })?,
            );
        }
        // The poller: metadata arrives, small requests go straight to a handler, large
        // ones are read first.
        {
            let stop = stop.clone();
            let conns = conns.clone();
            let stats = stats.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("dpumesh-rpc-poll".into())
                    .spawn(move || {
                        poller::<F>(cq, conns, jobs_tx, config, stop, stats);
                    })?,
            );
        }
        for i in 0..config.handlers.max(1) {
            let jobs = jobs_rx.clone();
            let conns = conns.clone();
            let handler = handler.clone();
            let stop = stop.clone();
            let stats = stats.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("dpumesh-rpc-handler-{i}"))
                    .spawn(move || {
                        handle::<F>(jobs, conns, handler, config, stop, stats);
                    })?,
            );
        }
        Ok(Self {
            addr,
            stop,
            threads,
            stats,
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Counters.
    pub fn stats(&self) -> &ServerStats {
        &self.stats
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn setup<F: Fabric>(
    fabric: &F,
    pd: &F::Pd,
    qp: F::Qp,
    config: &RpcConfig,
) -> Result<Conn<F>, RpcError> {
    let region = Arc::new(SharedRegion::create_unique(
        "dpumesh-rpc-server",
        config.region_len() as usize,
    )?);
    let mr = fabric.register(pd, &region, 0, config.region_len(), Access::all())?;
    Ok(Conn {
        qp,
        mr,
        region,
        sends: AtomicU64::new(0),
    })
}

/// One receive per context, for the requests' metadata.
fn post_receives<F: Fabric>(conn: &Conn<F>, config: &RpcConfig) -> Result<(), RpcError> {
    for i in 0..config.slots {
        conn.qp.post_recv(RecvWr {
            wr_id: i as u64,
            sge: conn.mr.sge(config.meta_at(i), config.meta_cap() as u32),
        })?;
    }
    Ok(())
}

/// Read work requests carry the connection and context: `conn << 32 | ctx`.
fn read_id(conn: u32, ctx: u32) -> u64 {
    (conn as u64) << 32 | ctx as u64 | 1 << 63
}

fn poller<F: Fabric>(
    cq: F::Cq,
    conns: Arc<Mutex<HashMap<u32, Arc<Conn<F>>>>>,
    jobs: Sender<Job>,
    config: RpcConfig,
    stop: Arc<AtomicBool>,
    stats: Arc<ServerStats>,
) {
    let mut completions = Vec::new();
    // Requests being read, by read id: their metadata.
    let mut reading: HashMap<u64, Meta> = HashMap::new();
    let mut by_qp: HashMap<u32, u32> = HashMap::new();
    while !stop.load(Ordering::Relaxed) {
        if cq.wait(Duration::from_millis(50)).is_err() {
            continue;
        }
        completions.clear();
        cq.poll(&mut completions, 256);
        for wc in &completions {
            let conn_id = match by_qp.get(&wc.qp_num) {
                Some(&c) => c,
                None => {
                    let found = conns
                        .lock()
                        .iter()
                        .find(|(_, c)| c.qp.qp_num() == wc.qp_num)
                        .map(|(&id, _)| id);
                    match found {
                        Some(id) => {
                            by_qp.insert(wc.qp_num, id);
                            id
                        }
                        None => continue,
                    }
                }
            };
            let Some(conn) = conns.lock().get(&conn_id).cloned() else {
                continue;
            };
            if wc.status != WcStatus::Success {
                // The client went away or broke the protocol: drop the connection.
                if wc.status != WcStatus::WrFlush {
                    tracing::debug!(conn = conn_id, status = ?wc.status, "RPC connection failed");
                }
                conns.lock().remove(&conn_id);
                by_qp.remove(&wc.qp_num);
                continue;
            }
            match wc.opcode {
                WcOpcode::Recv => {
                    let slot = wc.wr_id as u32;
                    let at = config.meta_at(slot);
                    let Ok(bytes) = conn
                        .region
                        .read_vec(at, wc.byte_len.min(config.meta_cap() as u32) as usize)
                    else {
                        continue;
                    };
                    // The receive is free again as soon as its bytes are copied out.
                    let _ = conn.qp.post_recv(RecvWr {
                        wr_id: wc.wr_id,
                        sge: conn.mr.sge(at, config.meta_cap() as u32),
                    });
                    let Some(meta) = Meta::decode(&bytes) else {
                        tracing::warn!(
                            conn = conn_id,
                            "malformed RPC metadata; dropping the connection"
                        );
                        conns.lock().remove(&conn_id);
                        continue;
                    };
                    if meta.ctx >= config.slots || meta.len > config.max_request {
                        tracing::warn!(
                            conn = conn_id,
                            ctx = meta.ctx,
                            len = meta.len,
                            "RPC metadata out of range; dropping the connection"
                        );
                        conns.lock().remove(&conn_id);
                        continue;
                    }
                    if meta.kind == KIND_INLINE {
                        let end = (META_LEN as usize + meta.len as usize).min(bytes.len());
                        stats.inline.fetch_add(1, Ordering::Relaxed);
                        let mut request = bytes;
                        request.truncate(end);
                        request.drain(..META_LEN as usize);
                        let _ = jobs.send(Job {
                            conn: conn_id,
                            meta,
                            request,
                        });
                    } else {
                        // ReadingRequest: fetch it into this context's request buffer.
                        let id = read_id(conn_id, meta.ctx);
                        reading.insert(id, meta);
                        let posted = conn.qp.post_send(SendWr {
                            wr_id: id,
                            op: SendOp::Read(meta.req),
                            sge: conn.mr.sge(config.request_at(meta.ctx), meta.len),
                            signaled: true,
                        });
                        if posted.is_err() {
                            reading.remove(&id);
                        }
                    }
                }
                WcOpcode::RdmaRead => {
                    let Some(meta) = reading.remove(&wc.wr_id) else {
                        continue;
                    };
                    let Ok(request) = conn
                        .region
                        .read_vec(config.request_at(meta.ctx), meta.len as usize)
                    else {
                        continue;
                    };
                    stats.read.fetch_add(1, Ordering::Relaxed);
                    let _ = jobs.send(Job {
                        conn: conn_id,
                        meta,
                        request,
                    });
                }
                _ => {}
            }
        }
    }
}

fn handle<F: Fabric>(
    jobs: Receiver<Job>,
    conns: Arc<Mutex<HashMap<u32, Arc<Conn<F>>>>>,
    handler: Arc<Handler>,
    config: RpcConfig,
    stop: Arc<AtomicBool>,
    stats: Arc<ServerStats>,
) {
    while !stop.load(Ordering::Relaxed) {
        // Spin briefly: back-to-back calls then never pay a sleep and a wake-up.
        let started = Instant::now();
        let job = loop {
            match jobs.try_recv() {
                Ok(job) => break Some(job),
                Err(TryRecvError::Disconnected) => return,
                Err(TryRecvError::Empty) if started.elapsed() < config.handler_spin => {
                    std::hint::spin_loop()
                }
                Err(TryRecvError::Empty) => {
                    break jobs.recv_timeout(Duration::from_millis(50)).ok();
                }
            }
        };
        let Some(job) = job else { continue };
        let Some(conn) = conns.lock().get(&job.conn).cloned() else {
            continue;
        };
        let (status, body) = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            handler(&job.request)
        })) {
            Ok(Ok(body))
                if body.len() <= job.meta.resp_cap as usize
                    && body.len() <= config.max_response as usize =>
            {
                (STATUS_OK, body)
            }
            Ok(Ok(_)) => (STATUS_TOO_LARGE, Vec::new()),
            Ok(Err(message)) => (STATUS_HANDLER, message.into_bytes()),
            Err(_) => (STATUS_HANDLER, b"the handler panicked".to_vec()),
        };
        let body = if status == STATUS_HANDLER {
            body[..body.len().min(job.meta.resp_cap as usize)].to_vec()
        } else {
            body
        };
        let at = config.response_at(job.meta.ctx);
        let mut header = [0u8; RESP_HEADER as usize];
        header[0..4].copy_from_slice(&status.to_le_bytes());
        header[4..8].copy_from_slice(&(body.len() as u32).to_le_bytes());
        if conn.region.write(at, &header).is_err()
            || conn.region.write(at + RESP_HEADER, &body).is_err()
        {
            continue;
        }
        // FilledWithResponse → WritingResponse: header and body in one write, the
        // context in the immediate data.
        let n = conn.sends.fetch_add(1, Ordering::Relaxed) + 1;
        // Counted before posting: the caller may see the response before this thread
        // runs again.
        stats.calls.fetch_add(1, Ordering::Relaxed);
        let written = conn.qp.post_send(SendWr {
            wr_id: u64::MAX,
            op: SendOp::WriteWithImm(job.meta.resp, job.meta.ctx),
            sge: conn.mr.sge(at, (RESP_HEADER as usize + body.len()) as u32),
            signaled: n.is_multiple_of(SIGNAL_EVERY),
        });
        if written.is_err() {
            stats.calls.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

//! The ingress's side of the fabric: one thread owning a link to each node's DPU proxy
//! and the two registered regions requests use — request bodies (the proxy READs them
//! once policy allowed the request) and response bodies (the proxy WRITEs them before
//! it sends the response head). A request holds one slot of each until its response
//! came or its link failed: only then can nothing write into them any more.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use crossbeam_channel::{Receiver, Sender};
use dpumesh_dpa::fabric::{Access, CompletionQueue, Fabric, MemoryRegion, QpCaps, WorkCompletion};
use dpumesh_dpa::frame::{Message, RemoteBuf, Request, RequestFlags, ResponseBody};
use dpumesh_dpa::link::{Link, LinkEvent, Wake};
use dpumesh_dpa::shm::SharedRegion;
use dpumesh_error::{ErrorKind, ProxyError};
use dpumesh_supervise::{RestartPolicy, Supervisor};
use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, oneshot};

/// A request slot: its index names a request body buffer and a response buffer, and
/// goes back to the free list when dropped (after the permit that bounded it).
pub struct Slot {
    index: u32,
    free: Arc<Mutex<Vec<u32>>>,
    _permit: OwnedSemaphorePermit,
}

impl Slot {
    pub fn index(&self) -> u32 {
        self.index
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.free.lock().push(self.index);
    }
}

/// An answer from a node.
#[derive(Debug)]
pub struct Answer {
    /// The response head (wire form).
    pub head: Vec<u8>,
    pub body: Bytes,
}

/// What the HTTP side asks of the uplink.
pub struct Call {
    /// The node's proxy.
    pub node: SocketAddr,
    /// The request's slot (its body is in the slot's request buffer).
    pub slot: Slot,
    /// The request head (wire form).
    pub head: Vec<u8>,
    /// Body bytes in the slot.
    pub body_len: u32,
    /// Time the node has to answer.
    pub deadline: Duration,
    /// Where the answer goes.
    pub reply: oneshot::Sender<Result<Answer, ProxyError>>,
}

struct Pending {
    qp: u32,
    slot: Slot,
    reply: oneshot::Sender<Result<Answer, ProxyError>>,
}

/// Shared by the HTTP side: the slots' memory.
pub struct Slots {
    requests: Arc<SharedRegion>,
    slot_size: u64,
    free: Arc<Mutex<Vec<u32>>>,
    permits: Arc<tokio::sync::Semaphore>,
}

impl Slots {
    /// Waits for a free slot.
    pub async fn acquire(&self) -> Slot {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let index = self
            .free
            .lock()
            .pop()
            .expect("a permit guarantees a free slot");
        Slot {
            index,
            free: self.free.clone(),
            _permit: permit,
        }
    }

    /// Writes body bytes at `at` in `slot`'s request buffer.
    pub fn write(&self, slot: &Slot, at: u64, bytes: &[u8]) -> Result<(), ProxyError> {
        if at + bytes.len() as u64 > self.slot_size {
            return Err(ProxyError::new(
                ErrorKind::BodyTooLarge,
                format!("request body exceeds the {}-byte slot", self.slot_size),
            ));
        }
        self.requests
            .write(u64::from(slot.index) * self.slot_size + at, bytes)
            .map_err(|e| {
                ProxyError::new(
                    ErrorKind::Internal,
                    format!("cannot write the body into its slot: {e}"),
                )
            })
    }
}

/// The running uplink.
pub struct Uplink {
    calls: Sender<Call>,
    wake: Wake,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    slots: Arc<Slots>,
    supervisor: Arc<Supervisor>,
    #[cfg(feature = "fault-injection")]
    panic_next: Arc<AtomicBool>,
}

impl std::fmt::Debug for Uplink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uplink").finish_non_exhaustive()
    }
}

impl Uplink {
    /// Starts the uplink thread with `slots` request slots of `slot_size` bytes.
    pub fn start<F: Fabric>(fabric: F, slots: u32, slot_size: u64) -> anyhow::Result<Self> {
        let pd = fabric.alloc_pd()?;
        let cq = fabric.create_cq(8192)?;
        let wake = Wake::new(&cq);
        let len = u64::from(slots) * slot_size;
        let requests = Arc::new(SharedRegion::create_unique(
            "dpumesh-ingress-req",
            len as usize,
        )?);
        let responses = Arc::new(SharedRegion::create_unique(
            "dpumesh-ingress-resp",
            len as usize,
        )?);
        let req_mr = fabric.register(&pd, &requests, 0, len, Access::all())?;
        let resp_mr = fabric.register(&pd, &responses, 0, len, Access::all())?;
        let shared = Arc::new(Slots {
            requests,
            slot_size,
            free: Arc::new(Mutex::new((0..slots).rev().collect())),
            permits: Arc::new(tokio::sync::Semaphore::new(slots as usize)),
        });
        let (calls, inbox) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        #[cfg(feature = "fault-injection")]
        let panic_next = Arc::new(AtomicBool::new(false));
        let reactor = Reactor {
            #[cfg(feature = "fault-injection")]
            panic_next: panic_next.clone(),
            fabric,
            pd,
            cq,
            wake: wake.clone(),
            links: HashMap::new(),
            by_node: HashMap::new(),
            req_mr,
            resp_mr,
            responses,
            slot_size,
            pending: HashMap::new(),
            inbox,
            stop: stop.clone(),
        };
        let supervisor = Supervisor::new();
        let thread = supervisor.spawn(
            "dpumesh-uplink",
            RestartPolicy::default(),
            reactor,
            Reactor::run,
            Reactor::recover,
        )?;
        Ok(Self {
            calls,
            wake,
            stop,
            thread: Some(thread),
            slots: shared,
            supervisor,
            #[cfg(feature = "fault-injection")]
            panic_next,
        })
    }

    /// The uplink thread, for readiness.
    pub fn supervisor(&self) -> &Arc<Supervisor> {
        &self.supervisor
    }

    /// Makes the uplink thread panic at its next turn (tests of supervision).
    #[cfg(feature = "fault-injection")]
    pub fn inject_panic(&self) {
        self.panic_next.store(true, Ordering::SeqCst);
        self.wake.wake();
    }

    /// The request slots.
    pub fn slots(&self) -> &Arc<Slots> {
        &self.slots
    }

    /// Hands a call to the uplink thread.
    pub fn call(&self, call: Call) {
        if let Err(e) = self.calls.send(call) {
            // The thread is gone: stopped with the ingress, or left down after it
            // kept panicking.
            let call = e.into_inner();
            let e = match self.supervisor.ready() {
                Ok(()) => shutting_down(),
                Err(why) => ProxyError::new(ErrorKind::ThreadLost, why),
            };
            let _ = call.reply.send(Err(e));
            return;
        }
        self.wake.wake();
    }
}

impl Drop for Uplink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake.interrupt();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Reactor<F: Fabric> {
    fabric: F,
    pd: F::Pd,
    cq: F::Cq,
    wake: Wake,
    links: HashMap<u32, (SocketAddr, Link<F>)>,
    by_node: HashMap<SocketAddr, u32>,
    req_mr: F::Mr,
    resp_mr: F::Mr,
    responses: Arc<SharedRegion>,
    slot_size: u64,
    pending: HashMap<u32, Pending>,
    inbox: Receiver<Call>,
    stop: Arc<AtomicBool>,
    #[cfg(feature = "fault-injection")]
    panic_next: Arc<AtomicBool>,
}

impl<F: Fabric> Reactor<F> {
    /// After a panic: every request in flight is answered (503) and every link
    /// dropped (the nodes free what those requests held when they see it go); links
    /// are made again on the next call.
    fn recover(&mut self) {
        for (_, p) in self.pending.drain() {
            let _ = p.reply.send(Err(ProxyError::new(
                ErrorKind::ThreadLost,
                "the ingress uplink thread restarted after a panic",
            )));
        }
        self.links.clear();
        self.by_node.clear();
    }

    fn run(&mut self) {
        let mut wcs: Vec<WorkCompletion> = Vec::with_capacity(64);
        while !self.stop.load(Ordering::Relaxed) {
            #[cfg(feature = "fault-injection")]
            if self.panic_next.swap(false, Ordering::SeqCst) {
                panic!("injected uplink panic");
            }
            let mut work = 0;
            while let Ok(call) = self.inbox.try_recv() {
                work += 1;
                self.send(call);
            }
            wcs.clear();
            self.cq.poll(&mut wcs, 64);
            work += wcs.len();
            for wc in wcs.drain(..) {
                self.completion(&wc);
            }
            if work > 0 {
                continue;
            }
            self.wake.sleep_begins();
            if !self.inbox.is_empty() {
                self.wake.sleep_ends();
                continue;
            }
            let _ = self.cq.wait(Duration::from_millis(50));
            self.wake.sleep_ends();
        }
        for (_, p) in self.pending.drain() {
            let _ = p.reply.send(Err(shutting_down()));
        }
    }

    fn link(&mut self, node: SocketAddr) -> Result<u32, ProxyError> {
        if let Some(&qp) = self.by_node.get(&node)
            && self.links.get(&qp).is_some_and(|(_, l)| !l.is_down())
        {
            return Ok(qp);
        }
        let qp = self
            .fabric
            .connect(&self.pd, node, &self.cq, QpCaps::default())
            .map_err(|e| {
                ProxyError::new(
                    ErrorKind::Unreachable,
                    format!("cannot reach the node at {node}: {e}"),
                )
            })?;
        let link = Link::new(&self.fabric, &self.pd, qp).map_err(|e| {
            ProxyError::new(
                ErrorKind::Unreachable,
                format!("cannot set up the link to {node}: {e}"),
            )
        })?;
        let num = link.qp_num();
        self.links.insert(num, (node, link));
        self.by_node.insert(node, num);
        Ok(num)
    }

    fn send(&mut self, call: Call) {
        let qp = match self.link(call.node) {
            Ok(qp) => qp,
            Err(e) => {
                let _ = call.reply.send(Err(e));
                return;
            }
        };
        let offset = u64::from(call.slot.index()) * self.slot_size;
        let xid = call.slot.index();
        let request = Request {
            xid,
            flags: RequestFlags::default(),
            deadline_ms: call.deadline.as_millis().clamp(1, u128::from(u32::MAX)) as u32,
            body: (call.body_len > 0).then(|| RemoteBuf {
                at: self.req_mr.remote(offset),
                len: call.body_len,
            }),
            reply: RemoteBuf {
                at: self.resp_mr.remote(offset),
                len: self.slot_size as u32,
            },
            head: call.head,
        };
        let (_, link) = self.links.get_mut(&qp).expect("just made");
        if let Err(e) = link.send(Message::Request(request)) {
            let _ = call.reply.send(Err(ProxyError::new(
                ErrorKind::LinkLost,
                format!("cannot send to the node: {e}"),
            )));
            if link.is_down() {
                self.down(qp, e.to_string());
            }
            return;
        }
        self.pending.insert(
            xid,
            Pending {
                qp,
                slot: call.slot,
                reply: call.reply,
            },
        );
    }

    fn completion(&mut self, wc: &WorkCompletion) {
        let Some((_, link)) = self.links.get_mut(&wc.qp_num) else {
            return;
        };
        match link.on_completion(wc) {
            Ok(Some(LinkEvent::Message(Message::Response(r)))) => {
                let Some(p) = self.pending.remove(&r.xid) else {
                    return;
                };
                if p.qp != wc.qp_num {
                    // Another node answered for this slot: not ours to take.
                    self.pending.insert(r.xid, p);
                    return;
                }
                let body = match r.body {
                    ResponseBody::None => Ok(Bytes::new()),
                    ResponseBody::Inline(b) => Ok(Bytes::from(b)),
                    ResponseBody::Written(len) if u64::from(len) <= self.slot_size => self
                        .responses
                        .read_vec(u64::from(p.slot.index()) * self.slot_size, len as usize)
                        .map(Bytes::from)
                        .map_err(|e| {
                            ProxyError::new(
                                ErrorKind::Internal,
                                format!("cannot read the response body: {e}"),
                            )
                        }),
                    ResponseBody::Written(len) => Err(ProxyError::new(
                        ErrorKind::BadResponse,
                        format!(
                            "node wrote a {len}-byte body into a {}-byte buffer",
                            self.slot_size
                        ),
                    )),
                };
                let _ = p.reply.send(body.map(|body| Answer { head: r.head, body }));
                drop(p.slot);
            }
            Ok(Some(LinkEvent::Message(_))) | Ok(None) => {}
            Ok(Some(LinkEvent::OpDone(_))) => {}
            Ok(Some(LinkEvent::OpFailed(_, status))) => {
                self.down(wc.qp_num, format!("{status:?}"));
            }
            Err(e) => self.down(wc.qp_num, e.to_string()),
        }
    }

    fn down(&mut self, qp: u32, why: String) {
        let Some((node, _)) = self.links.remove(&qp) else {
            return;
        };
        tracing::warn!(%node, why, "link to node down");
        self.by_node.remove(&node);
        let lost: Vec<u32> = self
            .pending
            .iter()
            .filter(|(_, p)| p.qp == qp)
            .map(|(x, _)| *x)
            .collect();
        for xid in lost {
            let p = self.pending.remove(&xid).expect("listed");
            let _ = p.reply.send(Err(ProxyError::new(
                ErrorKind::LinkLost,
                format!("lost the link to the node at {node} ({why})"),
            )));
        }
    }
}

fn shutting_down() -> ProxyError {
    ProxyError::new(ErrorKind::ShuttingDown, "the ingress is shutting down")
}

//! A link: one reliable-connected queue pair carrying [`frame`](crate::frame)s both
//! ways, plus the one-sided body transfers that go with them.
//!
//! - Both ends post [`LINK_RECVS`] receives of [`MAX_FRAME`] bytes; a sender may only
//!   SEND into receives the peer posted (credits). Every frame returns the credits of
//!   the receives its sender posted again; a [`Message::Credit`] frame returns them
//!   when there is nothing else to say. The last credit is kept for credit frames, so
//!   two ends that both ran out can always tell each other.
//! - Frames and one-sided operations (READ, WRITE) leave in the order they were
//!   asked for: a response whose body was written first is sent after that WRITE,
//!   and RC ordering makes the body visible before the response arrives.
//! - The link is driven by its owner's completion-queue poller
//!   ([`Link::on_completion`]); it never blocks.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};

use crate::fabric::{
    Access, Fabric, FabricError, Interrupter, MemoryRegion, QueuePair, RecvWr, RemoteAddr, SendOp,
    SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};
use crate::frame::{Frame, FrameError, MAX_FRAME, Message};
use crate::shm::{SharedRegion, ShmError};

/// Receives each end keeps posted (the credits each end starts with).
pub const LINK_RECVS: u32 = 64;
/// Frames one end may have on the wire at once.
const SENDS: u32 = 64;
/// Send work requests outstanding at once (fits the default queue pair caps).
const MAX_OUTSTANDING: u32 = 200;

const KIND_SHIFT: u32 = 62;
const KIND_RECV: u64 = 0;
const KIND_SEND: u64 = 1;
const KIND_OP: u64 = 2;
/// Largest token a one-sided operation may carry.
pub const MAX_TOKEN: u64 = (1 << KIND_SHIFT) - 1;

/// Why a link failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// Setting up its memory.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// The fabric refused a call.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// The peer sent a frame that does not decode.
    #[error("peer sent a bad frame: {0}")]
    Frame(#[from] FrameError),
    /// A frame could not be written.
    #[error("cannot send: {0}")]
    Encode(FrameError),
    /// A posted operation failed on the link itself.
    #[error("link failed: {0:?}")]
    Completion(WcStatus),
    /// The link failed earlier.
    #[error("link is down")]
    Down,
    /// The peer granted more credits than it has receives.
    #[error("peer returned {0} credits, more than it can have posted")]
    Credits(u32),
}

/// What a completion meant.
#[derive(Debug)]
pub enum LinkEvent {
    /// A frame's message arrived.
    Message(Message),
    /// A one-sided operation finished.
    OpDone(u64),
    /// A one-sided operation failed (e.g. the peer's key or bounds refused it).
    OpFailed(u64, WcStatus),
}

enum Outbound {
    Message(Message),
    Op(SendOp, Sge, u64),
}

/// One end of a link.
pub struct Link<F: Fabric> {
    qp: F::Qp,
    region: Arc<SharedRegion>,
    mr: F::Mr,
    credits: u32,
    owed: u32,
    free_sends: Vec<u32>,
    outstanding: u32,
    queue: VecDeque<Outbound>,
    buf: Vec<u8>,
    /// The frame received last, copied out of its slot.
    rx: Vec<u8>,
    down: bool,
}

impl<F: Fabric> std::fmt::Debug for Link<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("qp", &self.qp.qp_num())
            .field("credits", &self.credits)
            .field("queued", &self.queue.len())
            .field("down", &self.down)
            .finish()
    }
}

fn slot_offset(index: u32) -> u64 {
    u64::from(index) * MAX_FRAME as u64
}

impl<F: Fabric> Link<F> {
    /// Wraps a connected queue pair: sets up the frame buffers and posts the receives.
    pub fn new(fabric: &F, pd: &F::Pd, qp: F::Qp) -> Result<Self, LinkError> {
        let len = (LINK_RECVS + SENDS) as usize * MAX_FRAME;
        let region = Arc::new(SharedRegion::create_unique("dpumesh-link", len)?);
        let mr = fabric.register(pd, &region, 0, len as u64, Access::all())?;
        let link = Self {
            qp,
            region,
            mr,
            credits: LINK_RECVS,
            owed: 0,
            free_sends: (LINK_RECVS..LINK_RECVS + SENDS).rev().collect(),
            outstanding: 0,
            queue: VecDeque::new(),
            buf: Vec::with_capacity(1024),
            rx: Vec::new(),
            down: false,
        };
        for i in 0..LINK_RECVS {
            link.post_recv(i)?;
        }
        Ok(link)
    }

    fn post_recv(&self, index: u32) -> Result<(), FabricError> {
        self.qp.post_recv(RecvWr {
            wr_id: (KIND_RECV << KIND_SHIFT) | u64::from(index),
            sge: self.mr.sge(slot_offset(index), MAX_FRAME as u32),
        })
    }

    /// The queue pair's number (completions name it).
    pub fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    /// Who the peer proved to be (mutual TLS), if the fabric checks.
    pub fn peer_identity(&self) -> Option<&dpumesh_identity::SpiffeId> {
        self.qp.peer_identity()
    }

    /// Whether the link failed.
    pub fn is_down(&self) -> bool {
        self.down
    }

    /// Frames and operations waiting for credits or room.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Sends a message (now, or as soon as credits allow; in order).
    pub fn send(&mut self, message: Message) -> Result<(), LinkError> {
        if self.down {
            return Err(LinkError::Down);
        }
        let size = match &message {
            Message::Request(r) => r.head.len() + 64,
            Message::Response(r) => match &r.body {
                crate::frame::ResponseBody::Inline(b) => r.head.len() + b.len() + 64,
                _ => r.head.len() + 64,
            },
            Message::Chunk(c) | Message::UpChunk(c) => match &c.end {
                crate::frame::ChunkEnd::Last(t) => t.len() + 64,
                crate::frame::ChunkEnd::Abort(why) => why.len() + 64,
                crate::frame::ChunkEnd::More => 64,
            },
            Message::Credit
            | Message::Window { .. }
            | Message::Cancel { .. }
            | Message::UpWindow { .. }
            | Message::UpCancel { .. } => 0,
        };
        if size > MAX_FRAME {
            return Err(LinkError::Encode(FrameError::TooLarge(size)));
        }
        self.queue.push_back(Outbound::Message(message));
        self.flush()
    }

    /// Reads `remote` into `local`; [`LinkEvent::OpDone`] with `token` when done.
    pub fn read(&mut self, local: Sge, remote: RemoteAddr, token: u64) -> Result<(), LinkError> {
        self.op(SendOp::Read(remote), local, token)
    }

    /// Writes `local` to `remote`; [`LinkEvent::OpDone`] with `token` when done.
    pub fn write(&mut self, local: Sge, remote: RemoteAddr, token: u64) -> Result<(), LinkError> {
        self.op(SendOp::Write(remote), local, token)
    }

    fn op(&mut self, op: SendOp, local: Sge, token: u64) -> Result<(), LinkError> {
        if self.down {
            return Err(LinkError::Down);
        }
        assert!(token <= MAX_TOKEN, "operation token {token} too large");
        self.queue.push_back(Outbound::Op(op, local, token));
        self.flush()
    }

    fn flush(&mut self) -> Result<(), LinkError> {
        while let Some(next) = self.queue.front() {
            if self.outstanding >= MAX_OUTSTANDING {
                return Ok(());
            }
            match next {
                Outbound::Op(op, sge, token) => {
                    let wr = SendWr {
                        wr_id: (KIND_OP << KIND_SHIFT) | token,
                        op: *op,
                        sge: *sge,
                        signaled: true,
                    };
                    self.post(wr)?;
                }
                Outbound::Message(message) => {
                    if !matches!(message, Message::Credit) && self.credits == 1 {
                        // Blocked on the last credit: spend it returning ours, so a
                        // peer blocked the same way can go on (and so can we, then).
                        if self.owed > 0 {
                            let _ = self.send_frame(Message::Credit)?;
                        }
                        return Ok(());
                    }
                    if self.credits == 0 {
                        return Ok(());
                    }
                    let Some(Outbound::Message(message)) = self.queue.pop_front() else {
                        unreachable!("the front is a message");
                    };
                    if let Some(message) = self.send_frame(message)? {
                        self.queue.push_front(Outbound::Message(message));
                        return Ok(());
                    }
                    continue;
                }
            }
            self.queue.pop_front();
        }
        // Everything is out: return what we owe if it is a lot, so a peer that only
        // talks (and ran low) does not wait for our next message.
        if self.owed >= LINK_RECVS / 2 && self.credits >= 1 {
            let _ = self.send_frame(Message::Credit)?;
        }
        Ok(())
    }

    /// Sends one frame now, or gives the message back if no send buffer is free. A
    /// message that cannot be encoded is dropped with the error.
    fn send_frame(&mut self, message: Message) -> Result<Option<Message>, LinkError> {
        let Some(slot) = self.free_sends.pop() else {
            return Ok(Some(message));
        };
        let frame = Frame {
            credits: self.owed.min(u32::from(u16::MAX)) as u16,
            message,
        };
        if let Err(e) = frame.encode_into(&mut self.buf) {
            self.free_sends.push(slot);
            return Err(LinkError::Encode(e));
        }
        self.region.write(slot_offset(slot), &self.buf)?;
        let wr = SendWr {
            wr_id: (KIND_SEND << KIND_SHIFT) | u64::from(slot),
            op: SendOp::Send,
            sge: self.mr.sge(slot_offset(slot), self.buf.len() as u32),
            signaled: true,
        };
        if let Err(e) = self.post(wr) {
            self.free_sends.push(slot);
            return Err(e);
        }
        self.owed -= u32::from(frame.credits);
        self.credits -= 1;
        Ok(None)
    }

    fn post(&mut self, wr: SendWr) -> Result<(), LinkError> {
        match self.qp.post_send(wr) {
            Ok(()) => {
                self.outstanding += 1;
                Ok(())
            }
            Err(e) => {
                self.down = true;
                Err(e.into())
            }
        }
    }

    /// Handles a completion of this link's queue pair. `Err` means the link is down
    /// (the peer went away or broke the protocol); everything queued is lost and the
    /// owner must fail what waited on it.
    pub fn on_completion(&mut self, wc: &WorkCompletion) -> Result<Option<LinkEvent>, LinkError> {
        let kind = wc.wr_id >> KIND_SHIFT;
        let id = wc.wr_id & MAX_TOKEN;
        if kind != KIND_RECV {
            self.outstanding = self.outstanding.saturating_sub(1);
        }
        match kind {
            KIND_OP => {
                let event = if wc.status == WcStatus::Success {
                    LinkEvent::OpDone(id)
                } else {
                    // As in verbs, any failed operation puts the queue pair in the
                    // error state: everything after it is flushed.
                    self.down = true;
                    LinkEvent::OpFailed(id, wc.status)
                };
                if !self.down {
                    self.flush()?;
                }
                Ok(Some(event))
            }
            _ if wc.status != WcStatus::Success => {
                self.down = true;
                Err(LinkError::Completion(wc.status))
            }
            KIND_SEND => {
                self.free_sends.push(id as u32);
                self.flush()?;
                Ok(None)
            }
            _ => {
                debug_assert_eq!(wc.opcode, WcOpcode::Recv);
                let index = id as u32;
                // Copied out of the shared slot once, into a buffer the link keeps (the
                // peer may write the slot again once it is posted), and decoded from
                // there: the frame's own copy of the head is the only allocation.
                let len = wc.byte_len as usize;
                if self.rx.len() < len {
                    self.rx.resize(len, 0);
                }
                self.region.read(slot_offset(index), &mut self.rx[..len])?;
                self.post_recv(index)?;
                self.owed += 1;
                let frame = match Frame::decode(&self.rx[..len]) {
                    Ok(frame) => frame,
                    Err(e) => {
                        self.down = true;
                        return Err(e.into());
                    }
                };
                self.credits += u32::from(frame.credits);
                if self.credits > LINK_RECVS {
                    self.down = true;
                    return Err(LinkError::Credits(self.credits));
                }
                if self.owed >= LINK_RECVS / 2 && self.queue.is_empty() {
                    self.queue.push_back(Outbound::Message(Message::Credit));
                }
                self.flush()?;
                Ok(match frame.message {
                    Message::Credit => None,
                    message => Some(LinkEvent::Message(message)),
                })
            }
        }
    }
}

/// Wakes the reactor from other threads, with a system call only when it sleeps.
#[derive(Clone, Debug)]
pub struct Wake {
    sleeping: Arc<AtomicBool>,
    interrupter: Interrupter,
}

impl Wake {
    /// For a reactor sleeping on `cq`.
    pub fn new(cq: &impl crate::fabric::CompletionQueue) -> Self {
        Self {
            sleeping: Arc::new(AtomicBool::new(false)),
            interrupter: cq.interrupter(),
        }
    }

    /// Wakes the reactor if it sleeps.
    pub fn wake(&self) {
        // Pairs with the reactor's fence between raising `sleeping` and its last look
        // at its queues: either it sees our work, or we see it sleeping.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) {
            self.interrupter.interrupt();
        }
    }

    /// Interrupts the sleep unconditionally (shutdown).
    pub fn interrupt(&self) {
        self.interrupter.interrupt();
    }

    /// The reactor is about to sleep: after this, it must look at its queues once
    /// more before it does.
    pub fn sleep_begins(&self) {
        self.sleeping.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// The reactor is awake.
    pub fn sleep_ends(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
    }

    /// As an interrupter (for the DMA manager's sidecar rings).
    pub fn interrupter(&self) -> Interrupter {
        let me = self.clone();
        Interrupter::new(move || me.wake())
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::fabric::{CompletionQueue, QpCaps, QpListener};
    use crate::frame::{RemoteBuf, Request, RequestFlags, Response, ResponseBody};

    struct End<F: Fabric> {
        link: Link<F>,
        cq: F::Cq,
        got: Vec<LinkEvent>,
        errors: Vec<LinkError>,
    }

    impl<F: Fabric> End<F> {
        fn pump(&mut self) {
            let mut completions = Vec::new();
            let _ = self.cq.wait(Duration::from_millis(1));
            self.cq.poll(&mut completions, 64);
            for wc in completions {
                match self.link.on_completion(&wc) {
                    Ok(Some(e)) => self.got.push(e),
                    Ok(None) => {}
                    Err(e) => self.errors.push(e),
                }
            }
        }
    }

    fn pair<F: Fabric>(fabric: &F) -> (End<F>, End<F>, F::Pd) {
        let pd = fabric.alloc_pd().unwrap();
        let (cq1, cq2) = (
            fabric.create_cq(4096).unwrap(),
            fabric.create_cq(4096).unwrap(),
        );
        let listener = fabric
            .listen(&pd, "127.0.0.1:0".parse().unwrap(), &cq2, QpCaps::default())
            .unwrap();
        let addr = listener.local_addr();
        let accept =
            std::thread::spawn(move || listener.accept(Duration::from_secs(10)).unwrap().unwrap());
        let qp1 = fabric.connect(&pd, addr, &cq1, QpCaps::default()).unwrap();
        let qp2 = dpumesh_test_support::joined(accept);
        let a = End {
            link: Link::new(fabric, &pd, qp1).unwrap(),
            cq: cq1,
            got: Vec::new(),
            errors: Vec::new(),
        };
        let b = End {
            link: Link::new(fabric, &pd, qp2).unwrap(),
            cq: cq2,
            got: Vec::new(),
            errors: Vec::new(),
        };
        (a, b, pd)
    }

    fn request(xid: u32, head: &[u8]) -> Message {
        Message::Request(Request {
            xid,
            flags: RequestFlags::default(),
            deadline_ms: 0,
            body: None,
            reply: RemoteBuf::default(),
            head: head.to_vec(),
        })
    }

    fn until<F: Fabric>(
        a: &mut End<F>,
        b: &mut End<F>,
        mut done: impl FnMut(&End<F>, &End<F>) -> bool,
    ) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done(a, b) {
            assert!(Instant::now() < deadline, "timed out");
            a.pump();
            b.pump();
        }
    }

    fn many_more_frames_than_receives_flow_by_credits_in_order<F: Fabric + Default>() {
        let fabric = F::default();
        let (mut a, mut b, _pd) = pair(&fabric);
        // One side talks, the other never answers: credits must come back by
        // credit frames alone.
        for i in 0..1000u32 {
            a.link.send(request(i, &i.to_le_bytes())).unwrap();
            a.pump();
            b.pump();
        }
        until(&mut a, &mut b, |_, b| b.got.len() == 1000);
        for (i, e) in b.got.iter().enumerate() {
            let LinkEvent::Message(Message::Request(r)) = e else {
                panic!("{e:?}");
            };
            assert_eq!(r.xid, i as u32, "in order");
        }
        assert_eq!(a.link.queued(), 0);
    }

    fn both_ends_flooding_each_other_do_not_deadlock<F: Fabric + Default>() {
        let fabric = F::default();
        let (mut a, mut b, _pd) = pair(&fabric);
        for i in 0..500u32 {
            a.link.send(request(i, b"a")).unwrap();
            b.link.send(request(i, b"b")).unwrap();
        }
        until(&mut a, &mut b, |a, b| {
            a.got.len() == 500 && b.got.len() == 500
        });
    }

    fn a_body_is_read_and_a_reply_written_before_its_response_arrives<F: Fabric + Default>() {
        let fabric = F::default();
        let (mut a, mut b, pd) = pair(&fabric);
        // A's memory: a request body, and room for the reply.
        let mem_a = Arc::new(SharedRegion::create_unique("dpumesh-test-link", 1 << 20).unwrap());
        let mr_a = fabric
            .register(&pd, &mem_a, 0, 1 << 20, Access::all())
            .unwrap();
        let mem_b = Arc::new(SharedRegion::create_unique("dpumesh-test-link", 1 << 20).unwrap());
        let mr_b = fabric
            .register(&pd, &mem_b, 0, 1 << 20, Access::all())
            .unwrap();
        let body: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        mem_a.write(0, &body).unwrap();
        a.link
            .send(Message::Request(Request {
                xid: 1,
                flags: RequestFlags::default(),
                deadline_ms: 100,
                body: Some(RemoteBuf {
                    at: mr_a.remote(0),
                    len: body.len() as u32,
                }),
                reply: RemoteBuf {
                    at: mr_a.remote(512 << 10),
                    len: 512 << 10,
                },
                head: b"h".to_vec(),
            }))
            .unwrap();
        until(&mut a, &mut b, |_, b| !b.got.is_empty());
        let LinkEvent::Message(Message::Request(r)) = b.got.remove(0) else {
            panic!();
        };
        let src = r.body.unwrap();
        b.link.read(mr_b.sge(0, src.len), src.at, 7).unwrap();
        until(&mut a, &mut b, |_, b| !b.got.is_empty());
        assert!(matches!(b.got.remove(0), LinkEvent::OpDone(7)));
        assert!(mem_b.read_vec(0, body.len()).unwrap() == body);
        // The reply: reversed, written, then the response frame right behind it.
        let mut reply = body.clone();
        reply.reverse();
        mem_b.write(0, &reply).unwrap();
        b.link
            .write(mr_b.sge(0, reply.len() as u32), r.reply.at, 8)
            .unwrap();
        b.link
            .send(Message::Response(Response {
                xid: 1,
                body: ResponseBody::Written(reply.len() as u32),
                head: b"r".to_vec(),
            }))
            .unwrap();
        until(&mut a, &mut b, |a, _| !a.got.is_empty());
        let LinkEvent::Message(Message::Response(resp)) = a.got.remove(0) else {
            panic!();
        };
        assert_eq!(resp.body, ResponseBody::Written(reply.len() as u32));
        assert!(mem_a.read_vec(512 << 10, reply.len()).unwrap() == reply);
        until(&mut a, &mut b, |_, b| !b.got.is_empty());
        assert!(matches!(b.got.remove(0), LinkEvent::OpDone(8)));
        assert!(a.errors.is_empty() && b.errors.is_empty());
        // A write outside what A registered fails, and (as in verbs) takes the queue
        // pair down with it.
        b.link
            .write(
                mr_b.sge(0, 16),
                RemoteAddr {
                    addr: mr_a.addr() + (1 << 20),
                    rkey: mr_a.rkey(),
                },
                9,
            )
            .unwrap();
        until(&mut a, &mut b, |_, b| !b.got.is_empty());
        assert!(matches!(
            b.got.remove(0),
            LinkEvent::OpFailed(9, WcStatus::RemoteAccess)
        ));
        assert!(b.link.is_down());
        assert!(matches!(
            b.link.send(request(2, b"x")),
            Err(LinkError::Down)
        ));
    }

    fn a_frame_too_large_is_refused_at_send<F: Fabric + Default>() {
        let fabric = F::default();
        let (mut a, _b, _pd) = pair(&fabric);
        let err = a.link.send(request(1, &vec![0; MAX_FRAME])).unwrap_err();
        assert!(
            matches!(err, LinkError::Encode(FrameError::TooLarge(_))),
            "{err}"
        );
        assert!(!a.link.is_down());
    }

    /// Every link test, on the fabric `$fabric`, in module `$name`.
    macro_rules! link_tests {
        ($name:ident, $fabric:ty) => {
            mod $name {
                #[test]
                fn many_more_frames_than_receives_flow_by_credits_in_order() {
                    super::many_more_frames_than_receives_flow_by_credits_in_order::<$fabric>()
                }
                #[test]
                fn both_ends_flooding_each_other_do_not_deadlock() {
                    super::both_ends_flooding_each_other_do_not_deadlock::<$fabric>()
                }
                #[test]
                fn a_body_is_read_and_a_reply_written_before_its_response_arrives() {
                    super::a_body_is_read_and_a_reply_written_before_its_response_arrives::<$fabric>()
                }
                #[test]
                fn a_frame_too_large_is_refused_at_send() {
                    super::a_frame_too_large_is_refused_at_send::<$fabric>()
                }
            }
        };
    }

    link_tests!(soft, crate::fabric::soft::SoftFabric);
    link_tests!(shm, crate::fabric::shm::ShmFabric);
}

//! A host pod's end of the data path: registers over the control channel, maps the
//! pools and rings the DPU exported, sends heads and bodies as TX descriptors and
//! receives RX descriptors. Completions (the DPU is done with a TX slot) are handled
//! here and free the slots; what reaches the caller is requests, responses and
//! errors.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::bell::{Bell, BellError};
use crate::control::transport::{ControlClient, Endpoint};
use crate::control::{ControlError, PodExports, RegionExport, Role};
use crate::descriptor::{Buffer, Case, Descriptor, DescriptorStatus, Destination};
use crate::pool::{BufferPool, OwnerId, PoolError};
use crate::ring::{Consumer, Producer, Ring, RingError, WakeMode};
use crate::shm::{SharedRegion, ShmError};

/// Why a host port operation failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// Registration.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// Mapping an export.
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A ring (full: back-pressure; nothing was sent and no slot is held).
    #[error(transparent)]
    Ring(#[from] RingError),
    /// A shard's bell.
    #[error(transparent)]
    Bell(#[from] BellError),
    /// The node's exports do not make a usable set of lanes.
    #[error("the node exported {lanes} lanes and {bells} bells: {why}")]
    Lanes {
        lanes: usize,
        bells: usize,
        why: &'static str,
    },
    /// A response for a lane the pod does not have (its request came on another).
    #[error("lane {lane} does not exist (the node gave this pod {lanes})")]
    NoLane { lane: u8, lanes: usize },
    /// A message larger than a slot.
    #[error("{what} of {len} bytes exceeds the {limit}-byte slots this pod was given")]
    TooLarge {
        /// "header" or "body".
        what: &'static str,
        len: usize,
        /// The slot size.
        limit: u32,
    },
}

/// A message to send.
#[derive(Debug, Clone)]
pub struct Outgoing<'a> {
    /// The data path: [`Case::PodToPod`] for a pod on this node,
    /// [`Case::HostToRemote`] for another node.
    pub case: Case,
    /// Where to.
    pub dst: Destination,
    /// The request (execution context).
    pub req_id: u32,
    /// The step in it.
    pub step_id: u32,
    /// A response (to the request with the same ids).
    pub response: bool,
    /// HTTP status for responses (for a stream part, the part's code:
    /// [`crate::StreamPart::code`] or the opening's HTTP status).
    pub status: u16,
    /// A part of a streamed body.
    pub stream: bool,
    /// The head (serialized).
    pub header: &'a [u8],
    pub body: &'a [u8],
    /// For a response or a stream part: the lane its exchange came on (so it reaches
    /// the shard that holds the exchange). A request goes on the next lane in turn
    /// and ignores it.
    pub lane: u8,
}

/// A message received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incoming {
    /// A request or response with its head and body.
    Message {
        /// The descriptor as delivered.
        descriptor: Descriptor,
        /// The head bytes.
        header: Vec<u8>,
        /// The body bytes.
        body: Vec<u8>,
    },
    /// Something this pod sent could not be carried, or a delivery failed (or, for a
    /// stream part, [`DescriptorStatus::Cancelled`]: its receiver gave the stream
    /// up).
    Error {
        /// The descriptor that failed.
        descriptor: Descriptor,
        /// Why.
        status: DescriptorStatus,
    },
    /// The node is done with a stream part this pod sent (its body slot is free
    /// again): the stream's sender may send another. Only parts with a body are
    /// told.
    Sent {
        /// The part's completion (the stream's `(req_id, step_id)`).
        descriptor: Descriptor,
    },
}

/// Whether a port's node hung up (see [`HostPort::watch_node`]); the watching thread
/// ends when this is dropped.
#[derive(Debug)]
pub struct NodeWatch {
    gone: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl NodeWatch {
    /// The node closed the control connection.
    pub fn gone(&self) -> bool {
        self.gone.load(Ordering::Relaxed)
    }
}

impl Drop for NodeWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A registered pod's port. Dropping it waits briefly (up to [`HostPort::LINGER`]) for
/// the DPU to hand back TX slots still in flight, so a pod that sends and exits does
/// not leave the DPU copying from memory that is going away.
pub struct HostPort {
    control: ControlClient,
    exports: PodExports,
    owner: OwnerId,
    tx_header: BufferPool,
    tx_body: BufferPool,
    rx_header: BufferPool,
    rx_body: BufferPool,
    /// One TX SQ per lane (per shard of the node), each ringing its shard's bell.
    tx: Vec<Producer>,
    /// One RX SQ per lane; the pod sleeps on the first one's wake words for all.
    rx: Vec<Consumer>,
    /// The pod's bell (see [`HostPort::bell`]).
    bell: Bell,
    /// The lane the next request goes on (requests take turns).
    next_lane: usize,
    /// The lane `try_recv` looks at first (lanes take turns being first).
    first_rx: usize,
    in_flight: usize,
}

impl std::fmt::Debug for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPort")
            .field("pod_id", &self.exports.pod_id)
            .finish_non_exhaustive()
    }
}

/// Maps an exported region from the descriptor that came for it (a sealed memfd:
/// see [`SharedRegion::from_fd`]).
fn map(
    export: &RegionExport,
    fds: &mut impl Iterator<Item = std::os::fd::OwnedFd>,
) -> Result<Arc<SharedRegion>, HostError> {
    let name = export.path.display().to_string();
    let fd = fds.next().ok_or(HostError::Lanes {
        lanes: 0,
        bells: 0,
        why: "fewer region descriptors came than regions were exported",
    })?;
    let region = SharedRegion::from_fd(fd, &name)?;
    if (region.len() as u64) < export.len {
        return Err(ShmError::OutOfBounds {
            name,
            offset: 0,
            len: export.len,
            size: region.len(),
        }
        .into());
    }
    Ok(Arc::new(region))
}

impl Drop for HostPort {
    fn drop(&mut self) {
        let deadline = Instant::now() + Self::LINGER;
        while self.in_flight > 0 && Instant::now() < deadline {
            // Requests and responses that arrive now have no reader: drop them
            // (their slots are freed by `try_recv`).
            let _ = self.recv(WakeMode::LOW_CPU, Duration::from_millis(10));
        }
    }
}

impl HostPort {
    /// How long dropping a port waits for in-flight TX slots.
    pub const LINGER: Duration = Duration::from_secs(1);

    /// Registers pod `name` of `service` with the DPU at `endpoint` and maps what it
    /// exports. The service's registration token comes from `DPUMESH_TOKEN` (set by
    /// `dpumesh up`), as the control socket comes from `DPUMESH_CONTROL`.
    pub fn connect(endpoint: &Endpoint, name: &str, service: &str) -> Result<Self, HostError> {
        let mut control = ControlClient::connect(endpoint, Role::Host, name)?;
        let token = std::env::var("DPUMESH_TOKEN").ok();
        let exports = control.register_pod(name, service, token.as_deref())?;
        // Everything comes as descriptors with the answer, on the node's Unix socket
        // (PodExports gives the order): the shards' bell eventfds, then the regions.
        // A region is never opened by a name: no pod can map another's.
        let fds = control.take_fds();
        let lanes = exports.lanes.len();
        let refuse = |why| HostError::Lanes {
            lanes,
            bells: fds.len(),
            why,
        };
        if lanes == 0 || lanes > usize::from(u8::MAX) + 1 {
            return Err(refuse("a pod needs between 1 and 256 lanes"));
        }
        if fds.len() != exports.descriptors() {
            return Err(refuse(
                "the node passes every bell and region as a descriptor, on its Unix control socket only (DPUMESH_CONTROL=unix:...): a pod shares memory with a node on its own host",
            ));
        }
        let mut fds = fds.into_iter();
        let bells: Vec<_> = fds.by_ref().take(lanes).collect();
        let bell_regions = exports
            .lanes
            .iter()
            .map(|lane| map(&lane.bell, &mut fds))
            .collect::<Result<Vec<_>, _>>()?;
        let tx_header = BufferPool::attach(map(&exports.tx_header, &mut fds)?)?;
        let tx_body = BufferPool::attach(map(&exports.tx_body, &mut fds)?)?;
        let rx_header = BufferPool::attach(map(&exports.rx_header, &mut fds)?)?;
        let rx_body = BufferPool::attach(map(&exports.rx_body, &mut fds)?)?;
        let mut tx = Vec::with_capacity(lanes);
        let mut rx = Vec::with_capacity(lanes);
        for ((lane, bell), region) in exports.lanes.iter().zip(bells).zip(bell_regions) {
            let producer = Ring::attach(map(&lane.tx_sq, &mut fds)?)?.producer();
            tx.push(producer.with_bell(Bell::from_parts(region, bell)?));
            rx.push(Ring::attach(map(&lane.rx_sq, &mut fds)?)?.consumer());
        }
        let bell_region = map(&exports.bell, &mut fds)?;
        let bell = Bell::from_parts(
            bell_region,
            fds.next().ok_or(HostError::Lanes {
                lanes,
                bells: 0,
                why: "the pod's bell came without its eventfd",
            })?,
        )?;
        let port = Self {
            owner: OwnerId(exports.pod_id),
            tx_header,
            tx_body,
            rx_header,
            rx_body,
            tx,
            rx,
            bell,
            next_lane: 0,
            first_rx: 0,
            in_flight: 0,
            control,
            exports,
        };
        Ok(port)
    }

    /// Watches the control connection on a thread of its own: when the node hangs up
    /// (it stopped, crashed or was killed), [`NodeWatch::gone`] turns true and a
    /// waiting [`HostPort::recv`] returns, so the pod can register again with the
    /// node's successor instead of waiting on rings nobody serves.
    pub fn watch_node(&self) -> Result<NodeWatch, HostError> {
        let fd = self
            .control
            .watch_fd()
            .map_err(|e| HostError::Control(ControlError::Io(e)))?;
        let gone = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let interrupter = self.interrupter();
        let (flag, stopped) = (gone.clone(), stop.clone());
        std::thread::Builder::new()
            .name("dpumesh-node-watch".into())
            .spawn(move || {
                use rustix::event::{PollFd, PollFlags, poll};
                // Hang-ups only: the answers on this connection are the port's to read.
                let ts = rustix::fs::Timespec {
                    tv_sec: 0,
                    tv_nsec: 500_000_000,
                };
                while !stopped.load(Ordering::Relaxed) {
                    let mut fds = [PollFd::new(&fd, PollFlags::RDHUP)];
                    if poll(&mut fds, Some(&ts)).is_ok_and(|n| n > 0)
                        && fds[0]
                            .revents()
                            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
                    {
                        flag.store(true, Ordering::SeqCst);
                        interrupter.interrupt();
                        return;
                    }
                }
            })
            .map_err(|e| HostError::Control(ControlError::Io(e)))?;
        Ok(NodeWatch { gone, stop })
    }

    /// Lets go of a port whose node is gone: nothing will hand back the TX slots in
    /// flight, so dropping does not wait for them.
    pub fn abandon(mut self) {
        self.in_flight = 0;
    }

    /// What the node answered its registration with: the pod's regions as exported
    /// (their `hw_export`s are a DMA engine's across PCIe, empty on the software path).
    pub fn exports(&self) -> &PodExports {
        &self.exports
    }

    /// The id the DPU gave this pod.
    pub fn pod_id(&self) -> u32 {
        self.exports.pod_id
    }

    /// A handle that makes a waiting [`HostPort::recv`] return early (from another
    /// thread of this process).
    pub fn interrupter(&self) -> crate::fabric::Interrupter {
        let futex = self.rx[0].interrupter();
        let bell = self.bell.clone();
        // Whichever the pod sleeps on: each costs nothing unless it is slept on.
        crate::fabric::Interrupter::new(move || {
            futex.interrupt();
            bell.ring();
        })
    }

    /// The pod's bell: its eventfd turns readable when a shard pushes to an RX lane,
    /// or an interrupter fires, while the pod sleeps on it
    /// ([`HostPort::sleep_begins`]). For a pod that waits in a reactor of its own,
    /// with its sockets, instead of in [`HostPort::recv`].
    pub fn bell(&self) -> &Bell {
        &self.bell
    }

    /// Announces a sleep on the bell. True when something is there already (an RX
    /// descriptor, an interrupt, which this consumes): then do not sleep. Either way
    /// [`HostPort::sleep_ends`] follows.
    pub fn sleep_begins(&self) -> bool {
        self.bell.sleep_begins();
        self.rx[0].take_interrupted() || self.rx.iter().any(|r| r.has_next())
    }

    /// Ends a sleep announced with [`HostPort::sleep_begins`] and consumes the bell's
    /// rings.
    pub fn sleep_ends(&self) {
        self.bell.sleep_ends();
        self.bell.drain();
    }

    /// TX slots the DPU has not handed back yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The control connection (for pings, unregistering).
    pub fn control(&mut self) -> &mut ControlClient {
        &mut self.control
    }

    /// The lanes (one per shard of the node) this pod sends and receives on.
    pub fn lanes(&self) -> usize {
        self.tx.len()
    }

    /// Sends a message: the head and body go into TX slots, the descriptor into the
    /// TX SQ. On any failure nothing is sent and no slot stays taken.
    pub fn send(&mut self, msg: &Outgoing<'_>) -> Result<(), HostError> {
        let limit = self.tx_header.layout().slot_size;
        if msg.header.len() > limit as usize {
            return Err(HostError::TooLarge {
                what: "header",
                len: msg.header.len(),
                limit,
            });
        }
        let limit = self.tx_body.layout().slot_size;
        if msg.body.len() > limit as usize {
            return Err(HostError::TooLarge {
                what: "body",
                len: msg.body.len(),
                limit,
            });
        }
        let lanes = self.tx.len();
        // An answer, and any part of a stream (whichever way it flows), stays on the
        // lane of its exchange: the shard that holds it.
        let lane = if msg.response || msg.stream {
            if usize::from(msg.lane) >= lanes {
                return Err(HostError::NoLane {
                    lane: msg.lane,
                    lanes,
                });
            }
            usize::from(msg.lane)
        } else {
            self.next_lane = (self.next_lane + 1) % lanes;
            self.next_lane
        };
        let mut d = Descriptor::request(msg.case, msg.req_id, msg.step_id, self.pod_id(), msg.dst);
        d.kind.response = msg.response;
        d.kind.stream = msg.stream;
        d.status = msg.status;
        d.lane = lane as u8;
        let (mut header_slot, mut body_slot) = (None, None);
        let result = (|| -> Result<(), HostError> {
            if !msg.header.is_empty() {
                let slot = self.tx_header.alloc(self.owner)?;
                header_slot = Some(slot);
                d.header = self.tx_header.write(slot, msg.header)?;
            }
            if !msg.body.is_empty() {
                let slot = self.tx_body.alloc(self.owner)?;
                body_slot = Some(slot);
                d.body = self.tx_body.write(slot, msg.body)?;
            }
            self.tx[lane].push(&d)?;
            Ok(())
        })();
        match result {
            Ok(()) => {
                self.in_flight +=
                    usize::from(header_slot.is_some()) + usize::from(body_slot.is_some());
                Ok(())
            }
            Err(e) => {
                if let Some(slot) = header_slot {
                    let _ = self.tx_header.release(slot, self.owner);
                }
                if let Some(slot) = body_slot {
                    let _ = self.tx_body.release(slot, self.owner);
                }
                Err(e)
            }
        }
    }

    /// Waits up to `timeout` for the next request, response or error; completions on
    /// the way free TX slots.
    pub fn recv(
        &mut self,
        mode: WakeMode,
        timeout: Duration,
    ) -> Result<Option<Incoming>, HostError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(incoming) = self.try_recv()? {
                return Ok(Some(incoming));
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Ok(None);
            };
            if !self.rx[0].wait_any(&self.rx[1..], mode, left) {
                return Ok(None);
            }
        }
    }

    /// Takes the next request, response or error if one is waiting (completions are
    /// consumed on the way).
    pub fn try_recv(&mut self) -> Result<Option<Incoming>, HostError> {
        // Lanes take turns being looked at first, so a busy shard cannot starve
        // another's answers.
        let lanes = self.rx.len();
        for i in 0..lanes {
            let lane = (self.first_rx + i) % lanes;
            if let Some(incoming) = self.recv_lane(lane)? {
                self.first_rx = (lane + 1) % lanes;
                return Ok(Some(incoming));
            }
        }
        Ok(None)
    }

    /// The next request, response or error on `lane`, if one is waiting.
    fn recv_lane(&mut self, lane: usize) -> Result<Option<Incoming>, HostError> {
        loop {
            let Some(mut d) = self.rx[lane].try_pop()? else {
                return Ok(None);
            };
            // The lane it came on, whatever it says: the answer goes back there.
            d.lane = lane as u8;
            if d.kind.completion {
                self.free_sent_slots(&d);
                if d.kind.error {
                    return Ok(Some(Incoming::Error {
                        descriptor: d,
                        status: d.error_status().unwrap_or(DescriptorStatus::Malformed),
                    }));
                }
                if d.kind.stream && !d.body.is_none() {
                    return Ok(Some(Incoming::Sent { descriptor: d }));
                }
                continue;
            }
            let header = self.take(&self.rx_header, d.header)?;
            let body = self.take(&self.rx_body, d.body)?;
            return Ok(Some(Incoming::Message {
                descriptor: d,
                header,
                body,
            }));
        }
    }

    /// Reads an RX buffer and frees its slot.
    fn take(&self, pool: &BufferPool, b: Buffer) -> Result<Vec<u8>, HostError> {
        if b.is_none() {
            return Ok(Vec::new());
        }
        let bytes = pool.read(b)?;
        let slot = pool.slot_of(b)?;
        pool.release(slot, self.owner)?;
        Ok(bytes)
    }

    /// The DPU is done with TX slots: free them.
    fn free_sent_slots(&mut self, d: &Descriptor) {
        for (pool, b) in [(&self.tx_header, d.header), (&self.tx_body, d.body)] {
            if b.is_none() || b.addr.region() != pool.id() {
                continue;
            }
            if let Ok(slot) = pool.slot_of(b)
                && pool.release(slot, self.owner).is_ok()
            {
                self.in_flight = self.in_flight.saturating_sub(1);
            }
        }
    }

    /// A reply to `request`: same ids, back to its sender (pod 0 = from outside the
    /// node: the proxy routes it by its ids).
    pub fn reply<'a>(
        request: &Descriptor,
        status: u16,
        header: &'a [u8],
        body: &'a [u8],
    ) -> Outgoing<'a> {
        Outgoing {
            case: request.case,
            dst: Destination::Pod(request.src_pod),
            req_id: request.req_id,
            step_id: request.step_id,
            response: true,
            status,
            stream: false,
            header,
            body,
            lane: request.lane,
        }
    }
}

//! The data-path transport: requests arrive as RX descriptors from the node's DMA
//! manager (head in the pod's RX header pool, body in its RX body pool); egress calls
//! and answers leave as TX descriptors. The pod never opens a socket.
//!
//! - An egress call names its service as the URL's host (`http://user/profile`). The
//!   node says where that service runs (`Locate`, cached for a second): a pod here
//!   (case 3) or another node (case 1). The DPU proxy routes by the head either way;
//!   the descriptor's destination is what the pod knows.
//! - `(req_id, step_id)` of a call travel in its descriptor and come back on the
//!   response, which the event loop matches to its step.
//! - A full TX ring is back-pressure: what does not fit waits here, in order, and
//!   goes out on the next turn.
//! - A streamed answer ([`HttpResponse::streaming`]) leaves as an opening (the head
//!   and what the body had ready) and then a part per piece of its body, each sent
//!   once the body yields it and while fewer than [`crate::body::STREAM_WINDOW_PARTS`]
//!   of its parts are in flight; a part comes back (`Sent`) when the node passed it
//!   on. A stream its receiver gave up (`Cancelled`) drops its body.
//! - An answer to a call may stream too (a download, server-sent events, a gRPC
//!   server stream): its opening, then its parts, each told to the node once taken
//!   (`Taken`) so the node sends only a few ahead. A call made with
//!   [`AnswerBody::Streamed`] completes at the opening, the rest of the body following
//!   in [`HttpResponse::stream`]; a graph's call gets the body collected whole (up to
//!   [`crate::LoopConfig::max_answer_body`], past it the call fails and the callee is
//!   told to stop).
//! - A call's request body may stream the other way (an upload of any size, a gRPC
//!   client stream: [`HttpRequest::stream`] on the call): an opening with the head,
//!   then its parts, on one lane, no more than [`crate::body::STREAM_WINDOW_PARTS`]
//!   in flight; the node's `Cancelled` (the callee answered or stopped it, the call
//!   failed) drops the body.
//! - A node that goes away (stopped, crashed, killed) is noticed at once (its control
//!   connection hangs up): calls in flight fail, answers to requests it delivered are
//!   dropped, and the pod registers again, with backoff, until the node (or its
//!   successor, started by `dpumesh up` or an orchestrator) takes it back with fresh
//!   pools and rings.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dpumesh_dpa::control::ControlError;
use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_dpa::fabric::Interrupter;
use dpumesh_dpa::{
    Case, Descriptor, Destination, HostError, HostPort, Incoming, NodeWatch, Outgoing, Polling,
    RingError, Spin, StreamPart,
};
use dpumesh_head::RequestHead;
use dpumesh_head::wire::{self, ResponseHead};
use foldhash::{HashMap, HashMapExt};
use http::Method;
use parking_lot::Mutex;

use crate::http::{Caller, HttpRequest, HttpResponse};
use crate::instream::{ANSWER_ENDED_EARLY, InStreams, REQUEST_ENDED_EARLY, Step, Whole};
use crate::outstream::{OutStreams, Part};
use crate::transport::{AnswerBody, Event, IncomingId, Tag, Transport, TransportError, Waker};

/// How long a `Locate` answer is trusted.
const LOCATE_TTL: Duration = Duration::from_secs(1);

/// The first wait before registering again with a node that went away, and the
/// longest (the delay doubles with each refusal in between).
const REGISTER_FIRST: Duration = Duration::from_millis(50);
const REGISTER_CAP: Duration = Duration::from_millis(500);

/// How long a starting pod keeps trying to register before it gives up (less than a
/// supervisor's "ran long enough to count as healthy", so a pod whose node never
/// comes counts as crash-looping). `DPUMESH_REGISTER_PATIENCE` overrides it: on a
/// cluster the pod waits for its node instead (the manifests say `forever`), as a
/// host pod may start long before its DPU's proxy is Ready.
pub const REGISTER_PATIENCE: Duration = Duration::from_secs(5);

/// `DPUMESH_REGISTER_PATIENCE`'s value: `forever` (None), or a duration written
/// `500ms`, `30s` or `10m`.
pub fn parse_patience(text: &str) -> Result<Option<Duration>, String> {
    let text = text.trim();
    if text == "forever" {
        return Ok(None);
    }
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .filter(|&i| i > 0)
        .ok_or_else(|| format!("{text:?} is neither `forever` nor a duration like 30s"))?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is too large"))?;
    match unit {
        "ms" => Ok(Some(Duration::from_millis(n))),
        "s" => Ok(Some(Duration::from_secs(n))),
        "m" => Ok(Some(Duration::from_secs(n.saturating_mul(60)))),
        other => Err(format!(
            "unknown unit {other:?} in {text:?} (use ms, s or m)"
        )),
    }
}

/// Who this pod is, to register again when its node comes back.
#[derive(Debug, Clone)]
struct Registration {
    control: Endpoint,
    pod: String,
    service: String,
}

/// Registering again after the node went away.
#[derive(Debug)]
struct Away {
    next_try: Instant,
    delay: Duration,
}

struct Queued {
    case: Case,
    dst: Destination,
    req_id: u32,
    step_id: u32,
    response: bool,
    status: u16,
    /// A stream part (`status` is the part's code, or the opening's HTTP status).
    stream: bool,
    header: Vec<u8>,
    body: Bytes,
    /// For egress calls: the tag to fail if it cannot be sent at all, and how it
    /// takes a streamed answer.
    tag: Option<(Tag, AnswerBody)>,
    /// For responses: the lane the request came on.
    lane: u8,
}

/// Requests a pod was given and has not answered, by the id the loop knows them by.
#[derive(Debug)]
struct Unanswered {
    waiting: HashMap<u64, Descriptor>,
    next: u64,
    /// Requests below this id were delivered by a node that went away: their answers
    /// have nowhere to go.
    lost_below: u64,
}

/// A service pod's transport over its registered port.
pub struct DataPathTransport {
    /// `None` while the node is away.
    port: Option<HostPort>,
    /// Says when the node hangs up (only for a transport that can register again).
    watch: Option<NodeWatch>,
    registration: Option<Registration>,
    away: Option<Away>,
    /// Times the pod registered again.
    reregistered: u32,
    started: Instant,
    /// The requests handed to the handler and not answered yet.
    incoming: Unanswered,
    /// Egress calls on the wire (failed if the node goes away with them), and how
    /// each takes a streamed answer.
    calls: HashMap<Tag, AnswerBody>,
    located: HashMap<String, (Case, Destination, Instant)>,
    /// Round robin over the pods of a service on this node.
    next_pod: usize,
    out: VecDeque<Queued>,
    failed: Vec<Event>,
    /// What wakes a waiting `poll`: the RX ring's interrupter, or the loop thread
    /// while the node is away (swapped when the pod registers again).
    wake: Arc<Wake>,
    /// How the loop waits for the ring: polls a while after the last work (adapting),
    /// then sleeps until the node wakes it; `DPUMESH_POLL` sets the bounds.
    spin: Spin,
    /// Streamed answers being sent.
    streams: OutStreams,
    /// Wakes `poll` when a streamed body has more (its producer is another thread or
    /// task), or a request body arriving in parts was read.
    stream_waker: std::task::Waker,
    /// Request bodies arriving in parts.
    in_streams: InStreams,
    /// Answers to calls arriving in parts.
    answers: InStreams,
    /// Calls' request bodies being sent in parts.
    uploads: OutStreams,
    /// The lane the last streamed call went on (its parts follow it there).
    upload_lane: usize,
    /// Which requests' bodies stream to the handler.
    wants_stream: fn(&HttpRequest) -> bool,
}

/// What ends the transport's wait: the interrupter, or on a reactor's own thread
/// ([`DataPathTransport::wake_locally`]) its task's notification.
struct Wake {
    interrupter: Mutex<Interrupter>,
    local: std::sync::OnceLock<(std::thread::ThreadId, Arc<tokio::sync::Notify>)>,
}

impl Wake {
    fn wake(&self) {
        match self.local.get() {
            // A waker that fires on the loop's thread (a socket's task the reactor
            // ran): the loop is not asleep in the kernel, its task is pending in the
            // same runtime; telling it costs no system call.
            Some((thread, notify)) if *thread == std::thread::current().id() => {
                notify.notify_one();
            }
            _ => self.interrupter.lock().interrupt(),
        }
    }
}

/// A `std::task::Waker` that ends the transport's wait.
struct WakeTransport(Arc<Wake>);

impl std::task::Wake for WakeTransport {
    fn wake(self: Arc<Self>) {
        self.0.wake();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.wake();
    }
}

impl std::fmt::Debug for DataPathTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPathTransport")
            .field("pod", &self.port.as_ref().map(HostPort::pod_id))
            .field("waiting", &self.incoming.waiting.len())
            .finish_non_exhaustive()
    }
}

/// Where and as what a pod registers, from the environment `dpumesh up` (and the
/// chart) start it with: `DPUMESH_CONTROL` (the node's control socket, or
/// `tcp:HOST:PORT`), `DPUMESH_SERVICE`, `DPUMESH_POD` and
/// `DPUMESH_REGISTER_PATIENCE`.
#[derive(Debug, Clone)]
pub struct PodEnv {
    /// The node's control endpoint.
    pub control: Endpoint,
    /// The service the pod serves.
    pub service: String,
    /// The pod's name (`<service>-<pid>` when not given).
    pub pod: String,
    /// How long registering is tried at start (None: until the node takes it).
    pub patience: Option<Duration>,
}

impl PodEnv {
    /// Reads the environment; `service` stands in for a missing `DPUMESH_SERVICE`.
    pub fn read(service: Option<&str>) -> Result<Self, String> {
        let control = std::env::var("DPUMESH_CONTROL")
            .map_err(|_| {
                "DPUMESH_CONTROL (the node's control endpoint) is not set: start it with `dpumesh up`"
                    .to_owned()
            })?
            .parse()
            .map_err(|e| format!("DPUMESH_CONTROL: {e}"))?;
        let service = match (std::env::var("DPUMESH_SERVICE"), service) {
            (Ok(s), _) => s,
            (Err(_), Some(s)) => s.to_owned(),
            (Err(_), None) => {
                return Err("DPUMESH_SERVICE (the service to serve) is not set".into());
            }
        };
        let pod = std::env::var("DPUMESH_POD")
            .unwrap_or_else(|_| format!("{service}-{}", std::process::id()));
        let patience = match std::env::var("DPUMESH_REGISTER_PATIENCE") {
            Ok(text) => {
                parse_patience(&text).map_err(|e| format!("DPUMESH_REGISTER_PATIENCE: {e}"))?
            }
            Err(_) => Some(REGISTER_PATIENCE),
        };
        Ok(Self {
            control,
            service,
            pod,
            patience,
        })
    }

    /// Registers the pod ([`DataPathTransport::connect`]).
    pub fn connect(&self) -> Result<DataPathTransport, HostError> {
        DataPathTransport::connect_patiently(&self.control, &self.pod, &self.service, self.patience)
    }
}

impl DataPathTransport {
    /// Registers pod `pod` of `service` with the node at `control`; if the node goes
    /// away later, the pod registers again with whoever serves `control` next.
    ///
    /// A pod often starts while its node cannot take it yet: the node is starting
    /// (no control socket), or it still reclaims the pod's predecessor of the same
    /// name (killed a moment ago). Registration is tried again, after 50 ms doubling
    /// to 0.5 s, for up to [`REGISTER_PATIENCE`]; the last refusal is the error.
    pub fn connect(control: &Endpoint, pod: &str, service: &str) -> Result<Self, HostError> {
        Self::connect_patiently(control, pod, service, Some(REGISTER_PATIENCE))
    }

    /// [`Self::connect`], waiting for an absent node for `patience` (None: until it
    /// comes). A node that is there and refuses the pod (a bad token, another
    /// release) is tried for [`REGISTER_PATIENCE`] at most: only a predecessor's
    /// reclaim makes that refusal pass.
    pub fn connect_patiently(
        control: &Endpoint,
        pod: &str,
        service: &str,
        patience: Option<Duration>,
    ) -> Result<Self, HostError> {
        // A pod `dpumesh up` started ends with it (a service is a child like a node).
        dpumesh_supervise::parent::die_with_parent();
        let start = Instant::now();
        let absent_until = patience.map(|p| start + p);
        let refused_until = start + patience.unwrap_or(REGISTER_PATIENCE).min(REGISTER_PATIENCE);
        let mut delay = REGISTER_FIRST;
        let mut told = false;
        let port = loop {
            let e = match HostPort::connect(control, pod, service) {
                Ok(port) => break port,
                Err(e) => e,
            };
            let absent = matches!(
                e,
                HostError::Control(ControlError::Io(_) | ControlError::Closed)
            );
            let until = if absent {
                absent_until
            } else {
                Some(refused_until)
            };
            if until.is_some_and(|d| Instant::now() + delay >= d) {
                return Err(e);
            }
            // Said once at info (a pod waiting minutes for its DPU's proxy should say
            // why it does not serve), then at debug.
            if !told && delay >= REGISTER_CAP {
                tracing::info!(error = %e, %control, "waiting for the node to take the pod");
                told = true;
            }
            tracing::debug!(error = %e, "the node does not take the pod yet");
            std::thread::sleep(delay);
            delay = (delay * 2).min(REGISTER_CAP);
        };
        let watch = port.watch_node()?;
        let mut transport = Self::new(port);
        transport.watch = Some(watch);
        transport.registration = Some(Registration {
            control: control.clone(),
            pod: pod.to_owned(),
            service: service.to_owned(),
        });
        Ok(transport)
    }

    /// Over a registered port (that is not registered again if its node goes away).
    pub fn new(port: HostPort) -> Self {
        let wake = Arc::new(Wake {
            interrupter: Mutex::new(port.interrupter()),
            local: std::sync::OnceLock::new(),
        });
        let stream_waker = std::task::Waker::from(Arc::new(WakeTransport(wake.clone())));
        Self {
            in_streams: InStreams::new(stream_waker.clone(), 8 << 20, REQUEST_ENDED_EARLY),
            answers: InStreams::new(stream_waker.clone(), 8 << 20, ANSWER_ENDED_EARLY),
            uploads: OutStreams::default(),
            upload_lane: 0,
            wants_stream: |_| false,
            stream_waker,
            streams: OutStreams::default(),
            wake,
            port: Some(port),
            watch: None,
            registration: None,
            away: None,
            reregistered: 0,
            started: Instant::now(),
            incoming: Unanswered {
                waiting: HashMap::new(),
                next: 1,
                lost_below: 0,
            },
            calls: HashMap::new(),
            located: HashMap::new(),
            next_pod: 0,
            out: VecDeque::new(),
            failed: Vec::new(),
            spin: Spin::new(Polling::from_env()),
        }
    }

    /// The pod's id on its node (0 while the node is away).
    pub fn pod_id(&self) -> u32 {
        self.port.as_ref().map_or(0, HostPort::pod_id)
    }

    /// Times the pod registered again after its node went away.
    pub fn reregistered(&self) -> u32 {
        self.reregistered
    }

    /// The node hung up: everything it held for this pod is gone with it.
    fn lose_node(&mut self) {
        let Some(port) = self.port.take() else {
            return;
        };
        self.watch = None;
        tracing::warn!(
            pod = port.pod_id(),
            calls = self.calls.len(),
            unanswered = self.incoming.waiting.len(),
            "the node went away: registering again"
        );
        port.abandon();
        for (tag, _) in self.calls.drain() {
            self.failed.push(Event::Completion {
                tag,
                outcome: Err("the node went away with the call".to_owned()),
            });
        }
        for q in self.out.drain(..) {
            if let Some((tag, _)) = q.tag {
                self.failed.push(Event::Completion {
                    tag,
                    outcome: Err("the node went away before the call left".to_owned()),
                });
            }
        }
        self.incoming.waiting.clear();
        self.streams.clear();
        self.in_streams.clear();
        self.answers.clear();
        self.uploads.clear();
        self.incoming.lost_below = self.incoming.next;
        self.located.clear();
        let me = std::thread::current();
        *self.wake.interrupter.lock() = Interrupter::new(move || me.unpark());
        self.away = Some(Away {
            next_try: Instant::now(),
            delay: REGISTER_FIRST,
        });
    }

    /// Tries to register again if it is time to.
    fn register_again(&mut self) {
        let (Some(away), Some(registration)) = (self.away.as_mut(), &self.registration) else {
            return;
        };
        let now = Instant::now();
        if now < away.next_try {
            return;
        }
        let registered = HostPort::connect(
            &registration.control,
            &registration.pod,
            &registration.service,
        )
        .and_then(|port| Ok((port.watch_node()?, port)));
        match registered {
            Ok((watch, port)) => {
                tracing::info!(pod = port.pod_id(), "registered again");
                *self.wake.interrupter.lock() = port.interrupter();
                self.port = Some(port);
                self.watch = Some(watch);
                self.away = None;
                self.reregistered += 1;
            }
            Err(e) => {
                tracing::debug!(error = %e, "the node does not take the pod yet");
                away.next_try = now + away.delay;
                away.delay = (away.delay * 2).min(REGISTER_CAP);
            }
        }
    }

    /// The pod's bell's eventfd, for a loop that waits in a reactor of its own
    /// ([`crate::reactor`]): readable when the node has something for the pod, or a
    /// waker fired, while the pod sleeps on it. None while the node is away. A new
    /// one comes with each registration ([`DataPathTransport::reregistered`] counts
    /// them).
    pub fn bell_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.port.as_ref().map(|p| p.bell().fd())
    }

    /// Wakers that fire on this thread notify `notify` instead of ringing the bell:
    /// for a loop driven by a reactor on this thread, which waits on both. Set once.
    pub fn wake_locally(&self, notify: Arc<tokio::sync::Notify>) {
        let _ = self.wake.local.set((std::thread::current().id(), notify));
    }

    /// Announces a sleep on the bell (see [`DataPathTransport::bell_fd`]); true when
    /// something is there already: then do not sleep. [`DataPathTransport::sleep_ends`]
    /// follows either way.
    pub fn sleep_begins(&self) -> bool {
        self.port.as_ref().is_some_and(HostPort::sleep_begins)
    }

    /// Ends a sleep announced with [`DataPathTransport::sleep_begins`].
    pub fn sleep_ends(&self) {
        if let Some(port) = &self.port {
            port.sleep_ends();
        }
    }

    /// How long a reactor may sleep before this transport needs a turn although its
    /// bell did not ring: sends waiting for ring room (the completions that make room
    /// do not ring), or the next registration try while the node is away.
    pub fn wait_limit(&self) -> Option<Duration> {
        if self.port.is_none() {
            return Some(self.next_try_in().min(REGISTER_CAP));
        }
        (!self.out.is_empty()).then_some(Duration::from_millis(1))
    }

    /// Time until the next registration try while the node is away.
    fn next_try_in(&self) -> Duration {
        self.away.as_ref().map_or(REGISTER_CAP, |a| {
            a.next_try.saturating_duration_since(Instant::now())
        })
    }

    /// Requests received and not answered yet.
    pub fn unanswered(&self) -> usize {
        self.incoming.waiting.len()
    }

    /// Where `service` runs, as the node says.
    fn locate(&mut self, service: &str) -> Result<(Case, Destination), String> {
        if let Some((case, dst, at)) = self.located.get(service)
            && at.elapsed() < LOCATE_TTL
        {
            return Ok((*case, *dst));
        }
        let Some(port) = self.port.as_mut() else {
            return Err("the node is away (the pod is registering again)".to_owned());
        };
        let (pods, remote) = port
            .control()
            .locate(service)
            .map_err(|e| format!("cannot ask the node where {service:?} runs: {e}"))?;
        let (case, dst) = if !pods.is_empty() {
            self.next_pod = self.next_pod.wrapping_add(1);
            (
                Case::PodToPod,
                Destination::Pod(pods[self.next_pod % pods.len()]),
            )
        } else if let Some(addr) = remote {
            (Case::HostToRemote, Destination::External(addr))
        } else {
            return Err(format!("service {service:?} runs nowhere in the mesh"));
        };
        self.located
            .insert(service.to_owned(), (case, dst, Instant::now()));
        Ok((case, dst))
    }

    /// Sends what waits, in order, until the ring is full.
    fn flush(&mut self) {
        let Some(port) = self.port.as_mut() else {
            return;
        };
        while let Some(q) = self.out.front() {
            let sent = port.send(&Outgoing {
                case: q.case,
                dst: q.dst,
                req_id: q.req_id,
                step_id: q.step_id,
                response: q.response,
                status: q.status,
                stream: q.stream,
                header: &q.header,
                body: &q.body,
                lane: q.lane,
            });
            match sent {
                Ok(()) => {
                    if let Some((tag, answer)) = self.out.pop_front().and_then(|q| q.tag) {
                        self.calls.insert(tag, answer);
                    }
                }
                Err(HostError::Ring(RingError::Full { .. }))
                | Err(HostError::Pool(dpumesh_dpa::PoolError::Exhausted { .. })) => return,
                Err(e) => {
                    let q = self.out.pop_front().expect("front");
                    match q.tag {
                        Some((tag, _)) => self.failed.push(Event::Completion {
                            tag,
                            outcome: Err(format!("data path refused the call: {e}")),
                        }),
                        None => tracing::warn!(error = %e, "response could not be sent"),
                    }
                }
            }
        }
    }

    fn push(&mut self, q: Queued) {
        self.out.push_back(q);
        self.flush();
    }

    /// Turns a received descriptor into an event.
    fn incoming(&mut self, incoming: Incoming, out: &mut Vec<Event>) {
        match incoming {
            Incoming::Message {
                descriptor,
                header,
                body,
            } if descriptor.kind.response && descriptor.kind.stream => {
                self.answer_part(descriptor, header, body, out);
            }
            Incoming::Message {
                descriptor,
                header,
                body,
            } if descriptor.kind.response => {
                let tag = Tag {
                    req_id: descriptor.req_id,
                    step_id: descriptor.step_id,
                };
                self.calls.remove(&tag);
                let outcome = wire::decode_response(&header)
                    .map(|head| HttpResponse {
                        status: head.status,
                        headers: head.headers,
                        body: Bytes::from(body),
                        trailers: head.trailers,
                        stream: None,
                    })
                    .map_err(|e| format!("malformed response head: {e}"));
                out.push(Event::Completion { tag, outcome });
            }
            Incoming::Message {
                descriptor,
                header,
                body,
            } if descriptor.kind.stream => self.in_part(descriptor, header, body, out),
            Incoming::Message {
                descriptor,
                header,
                body,
            } => match wire::decode_request(&header) {
                Ok(head) => {
                    let id = self.incoming.next;
                    self.incoming.next += 1;
                    self.incoming.waiting.insert(id, descriptor);
                    out.push(Event::Request {
                        id: IncomingId(id),
                        request: to_request(head, body),
                    });
                }
                Err(e) => {
                    let (head, body) = plain(400, &format!("malformed request head: {e}"));
                    self.answer(&descriptor, &head, body);
                }
            },
            Incoming::Sent { descriptor } => {
                // Which way the part went: an answer's, or a call's request body's
                // (the ids of the two may be the same).
                let key = (descriptor.req_id, descriptor.step_id, descriptor.lane);
                if descriptor.kind.response {
                    self.streams.sent(key);
                } else {
                    self.uploads.sent(key);
                }
            }
            Incoming::Error { descriptor, status } if descriptor.kind.stream => {
                // The stream's receiver left (or its node gave it up): stop making it.
                let key = (descriptor.req_id, descriptor.step_id, descriptor.lane);
                let response = descriptor.kind.response;
                let stopped = if response {
                    self.streams.cancel(key)
                } else {
                    self.uploads.cancel(key)
                };
                if stopped {
                    tracing::debug!(
                        ?status,
                        req = key.0,
                        response,
                        "a streamed body was cancelled"
                    );
                }
                self.out.retain(|q| {
                    !(q.stream
                        && q.response == response
                        && q.status != StreamPart::Taken.code()
                        && q.status != StreamPart::Stop.code()
                        && (q.req_id, q.step_id, q.lane) == key)
                });
            }
            Incoming::Error { descriptor, status } => {
                if descriptor.kind.response {
                    tracing::warn!(
                        ?status,
                        req = descriptor.req_id,
                        "a response was not delivered"
                    );
                } else {
                    let tag = Tag {
                        req_id: descriptor.req_id,
                        step_id: descriptor.step_id,
                    };
                    self.calls.remove(&tag);
                    out.push(Event::Completion {
                        tag,
                        outcome: Err(format!("data path could not carry the call: {status:?}")),
                    });
                }
            }
        }
    }

    /// A streamed request's opening, or a part of its body.
    fn in_part(
        &mut self,
        descriptor: Descriptor,
        header: Vec<u8>,
        body: Vec<u8>,
        out: &mut Vec<Event>,
    ) {
        let key = (descriptor.req_id, descriptor.step_id, descriptor.lane);
        let part = match descriptor.stream_part() {
            Some(StreamPart::Open) => {
                let mut request = match wire::decode_request(&header) {
                    Ok(head) => to_request(head, Vec::new()),
                    Err(e) => {
                        let (head, body) = plain(400, &format!("malformed request head: {e}"));
                        self.answer(&descriptor, &head, body);
                        self.tell_node(&descriptor, StreamPart::Stop);
                        return;
                    }
                };
                if (self.wants_stream)(&request) {
                    let body = self.in_streams.stream(descriptor);
                    request.stream = Some(crate::body::BodyStream::new(body));
                    self.hand_over(descriptor, request, out);
                    return;
                }
                if request.headers.contains_key(http::header::UPGRADE) {
                    // An upgrade's handshake (a WebSocket) has no body, and a handler
                    // that takes whole bodies answers it as a plain request: nothing
                    // of the stream is wanted.
                    self.tell_node(&descriptor, StreamPart::Stop);
                    self.hand_over(descriptor, request, out);
                    return;
                }
                let stated = request
                    .headers
                    .get(http::header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok());
                if stated.is_some_and(|n| n > self.in_streams.limit() as u64) {
                    // Refused before a byte of it moves.
                    self.too_large(&descriptor);
                    return;
                }
                self.in_streams
                    .collect(descriptor, Whole::Request(Box::new(request)));
                return;
            }
            Some(part) => part,
            None => return,
        };
        let trailers = trailers_of(&header, "the request's");
        match self.in_streams.part(key, part, body, trailers) {
            Step::Nothing => {}
            Step::Taken(opening) => {
                self.tell_node(&opening, StreamPart::Taken);
            }
            Step::Whole(opening, Whole::Request(request)) => self.hand_over(opening, *request, out),
            // The request streams hold requests only.
            Step::Whole(_, Whole::Answer(_)) => {}
            Step::TooLarge(opening) => self.too_large(&opening),
            Step::Aborted(opening, why) => {
                let (head, body) = plain(400, &why);
                self.answer(&opening, &head, body);
            }
        }
    }

    /// An answer to a call arriving in parts: its opening, or a part of its body.
    fn answer_part(
        &mut self,
        descriptor: Descriptor,
        header: Vec<u8>,
        body: Vec<u8>,
        out: &mut Vec<Event>,
    ) {
        let tag = Tag {
            req_id: descriptor.req_id,
            step_id: descriptor.step_id,
        };
        let key = (descriptor.req_id, descriptor.step_id, descriptor.lane);
        let part = match descriptor.stream_part() {
            Some(StreamPart::Open) => {
                let Some(&answer) = self.calls.get(&tag) else {
                    // Nobody waits for it (its call failed here first): no more of it.
                    self.tell_callee(&descriptor, StreamPart::Stop);
                    return;
                };
                let head = match wire::decode_response(&header) {
                    Ok(head) => head,
                    Err(e) => {
                        self.calls.remove(&tag);
                        self.tell_callee(&descriptor, StreamPart::Stop);
                        out.push(Event::Completion {
                            tag,
                            outcome: Err(format!("malformed response head: {e}")),
                        });
                        return;
                    }
                };
                // What came with the head goes first; the parts follow it.
                let mut response = HttpResponse {
                    status: head.status,
                    headers: head.headers,
                    body: Bytes::from(body),
                    trailers: http::HeaderMap::new(),
                    stream: None,
                };
                match answer {
                    AnswerBody::Streamed => {
                        self.calls.remove(&tag);
                        let stream = self.answers.stream(descriptor);
                        response.stream = Some(crate::body::BodyStream::new(stream));
                        out.push(Event::Completion {
                            tag,
                            outcome: Ok(response),
                        });
                    }
                    AnswerBody::Whole => {
                        if response.body.len() > self.answers.limit() {
                            self.answer_too_large(&descriptor, tag, out);
                            return;
                        }
                        self.answers
                            .collect(descriptor, Whole::Answer(Box::new(response)));
                    }
                }
                return;
            }
            Some(part) => part,
            None => return,
        };
        let trailers = trailers_of(&header, "the answer's");
        match self.answers.part(key, part, body, trailers) {
            Step::Nothing => {}
            Step::Taken(opening) => self.tell_callee(&opening, StreamPart::Taken),
            Step::Whole(_, whole) => {
                self.calls.remove(&tag);
                if let Whole::Answer(response) = whole {
                    out.push(Event::Completion {
                        tag,
                        outcome: Ok(*response),
                    });
                }
            }
            Step::TooLarge(opening) => self.answer_too_large(&opening, tag, out),
            Step::Aborted(_, why) => {
                self.calls.remove(&tag);
                out.push(Event::Completion {
                    tag,
                    outcome: Err(why),
                });
            }
        }
    }

    /// A streamed answer too large to collect whole: the call fails, and the callee
    /// is told to stop.
    fn answer_too_large(&mut self, opening: &Descriptor, tag: Tag, out: &mut Vec<Event>) {
        self.calls.remove(&tag);
        self.tell_callee(opening, StreamPart::Stop);
        out.push(Event::Completion {
            tag,
            outcome: Err(format!(
                "the answer's body exceeds the {}-byte limit of a call that takes answers whole (LoopConfig::max_answer_body)",
                self.answers.limit()
            )),
        });
    }

    /// Tells the node what the pod did with an answer's streamed body (`Taken`,
    /// `Stop`): on the call's ids, in the request's direction.
    fn tell_callee(&mut self, opening: &Descriptor, part: StreamPart) {
        self.push(Queued {
            case: opening.case,
            dst: Destination::Pod(opening.src_pod),
            req_id: opening.req_id,
            step_id: opening.step_id,
            response: false,
            status: part.code(),
            stream: true,
            header: Vec::new(),
            body: Bytes::new(),
            tag: None,
            lane: opening.lane,
        });
    }

    /// Tells the node what the pod did with a request's streamed body (`Taken`,
    /// `Stop`), on the request's ids.
    fn tell_node(&mut self, opening: &Descriptor, part: StreamPart) {
        self.push_reply(opening, part.code(), true, Vec::new(), Bytes::new());
    }

    /// A streamed request too large to collect whole: 413, and no more of it.
    fn too_large(&mut self, opening: &Descriptor) {
        let (head, body) = plain(
            413,
            &format!(
                "request body exceeds the {}-byte limit of a handler that takes whole bodies",
                self.in_streams.limit()
            ),
        );
        self.tell_node(opening, StreamPart::Stop);
        self.answer(opening, &head, body);
    }

    /// A request for the handler.
    fn hand_over(&mut self, descriptor: Descriptor, request: HttpRequest, out: &mut Vec<Event>) {
        let id = self.incoming.next;
        self.incoming.next += 1;
        self.incoming.waiting.insert(id, descriptor);
        out.push(Event::Request {
            id: IncomingId(id),
            request,
        });
    }

    /// Tells the node what readers did with bodies arriving in parts (requests'
    /// and answers').
    fn pump_in_streams(&mut self) {
        if self.in_streams.len() > 0 {
            let (mut taken, mut stopped) = (Vec::new(), Vec::new());
            self.in_streams.news(&mut taken, &mut stopped);
            for opening in taken {
                self.tell_node(&opening, StreamPart::Taken);
            }
            for opening in stopped {
                self.tell_node(&opening, StreamPart::Stop);
            }
        }
        if self.answers.len() > 0 {
            let (mut taken, mut stopped) = (Vec::new(), Vec::new());
            self.answers.news(&mut taken, &mut stopped);
            for opening in taken {
                self.tell_callee(&opening, StreamPart::Taken);
            }
            for opening in stopped {
                self.tell_callee(&opening, StreamPart::Stop);
            }
        }
    }

    /// Sends what the streams have ready, as parts.
    fn pump_streams(&mut self) {
        if self.streams.len() == 0 {
            return;
        }
        let mut parts = Vec::new();
        self.streams.poll(&self.stream_waker, &mut parts);
        for (request, part) in parts {
            let (code, header, body) = wire_part(part, request.req_id, "a streamed answer");
            self.push_reply(&request, code, true, header, body);
        }
    }

    /// Sends what calls' streamed request bodies have ready, as parts.
    fn pump_uploads(&mut self) {
        if self.uploads.len() == 0 {
            return;
        }
        let mut parts = Vec::new();
        self.uploads.poll(&self.stream_waker, &mut parts);
        for (call, part) in parts {
            let (status, header, body) = wire_part(part, call.req_id, "a call's streamed body");
            self.push(Queued {
                case: call.case,
                dst: call.dst,
                req_id: call.req_id,
                step_id: call.step_id,
                response: false,
                status,
                stream: true,
                header,
                body,
                tag: None,
                lane: call.lane,
            });
        }
    }

    /// Queues an answer (or a stream part) to `request`.
    fn push_reply(
        &mut self,
        request: &Descriptor,
        status: u16,
        stream: bool,
        header: Vec<u8>,
        body: Bytes,
    ) {
        let reply = HostPort::reply(request, status, &[], &[]);
        self.push(Queued {
            case: reply.case,
            dst: reply.dst,
            req_id: reply.req_id,
            step_id: reply.step_id,
            response: true,
            status,
            stream,
            header,
            body,
            tag: None,
            lane: reply.lane,
        });
    }

    fn answer(&mut self, request: &Descriptor, head: &ResponseHead, body: Bytes) {
        let header = match wire::encode_response(head) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "response head cannot be encoded");
                let (h, _) = plain(500, "");
                wire::encode_response(&h).expect("a plain head encodes")
            }
        };
        self.push_reply(request, head.status, false, header, body);
    }
}

/// The trailers an end part carries in its header (a head's trailer section; none
/// when it is empty), or why they cannot be read.
fn trailers_of(header: &[u8], whose: &str) -> Result<http::HeaderMap, String> {
    if header.is_empty() {
        return Ok(http::HeaderMap::new());
    }
    wire::decode_response(header)
        .map(|h| h.trailers)
        .map_err(|e| format!("{whose} trailers are malformed: {e}"))
}

/// A stream part as it travels: its status code, header (an end's trailers, as a
/// head's trailer section) and body.
fn wire_part(part: Part, req: u32, what: &str) -> (u16, Vec<u8>, Bytes) {
    match part {
        Part::Data(b) => (StreamPart::Data.code(), Vec::new(), b),
        Part::End(trailers) if trailers.is_empty() => {
            (StreamPart::End.code(), Vec::new(), Bytes::new())
        }
        Part::End(trailers) => {
            let head = ResponseHead {
                status: 200,
                headers: http::HeaderMap::new(),
                trailers,
            };
            match wire::encode_response(&head) {
                Ok(h) => (StreamPart::End.code(), h, Bytes::new()),
                Err(e) => {
                    tracing::warn!(error = %e, "{what}'s trailers cannot be encoded");
                    (StreamPart::Abort.code(), Vec::new(), Bytes::new())
                }
            }
        }
        Part::Abort(why) => {
            tracing::warn!(req, why, "{what} failed");
            (StreamPart::Abort.code(), Vec::new(), Bytes::new())
        }
    }
}

fn plain(status: u16, message: &str) -> (ResponseHead, Bytes) {
    let mut head = ResponseHead {
        status,
        ..Default::default()
    };
    head.headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain"),
    );
    (head, Bytes::from(format!("{message}\n")))
}

/// A received head and body as the request a handler sees: the URL is the path and
/// query; the authority is in `host`.
fn to_request(mut head: RequestHead, body: Vec<u8>) -> HttpRequest {
    let method = Method::from_bytes(head.method.as_bytes()).unwrap_or(Method::GET);
    let url = match &head.query {
        Some(q) => format!("{}?{q}", head.path),
        None => head.path.clone(),
    };
    let mut headers = head.take_headers();
    if !head.authority.is_empty()
        && !headers.contains_key(http::header::HOST)
        && let Ok(v) = http::HeaderValue::from_str(&head.authority)
    {
        headers.insert(http::header::HOST, v);
    }
    HttpRequest {
        method,
        url,
        headers,
        body: Bytes::from(body),
        trailers: std::mem::take(&mut head.trailers),
        caller: Some(Caller {
            addr: head.source.addr,
            identity: head.source.identity.take(),
            scheme: std::mem::take(&mut head.scheme),
        }),
        stream: None,
    }
}

/// An egress call as a head (its headers moved into it): the URL's host is the
/// authority (the service).
fn to_head(request: &mut HttpRequest) -> Result<(String, RequestHead), String> {
    let uri: http::Uri = request
        .url
        .parse()
        .map_err(|e| format!("bad URL {:?}: {e}", request.url))?;
    let authority = uri
        .authority()
        .ok_or_else(|| {
            format!(
                "a mesh call names its service as the URL's host (http://service/path), not {:?}",
                request.url
            )
        })?
        .to_string();
    let service = uri.host().unwrap_or_default().to_owned();
    let target = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut head = RequestHead::new(request.method.as_str(), target);
    head.authority = authority;
    let mut headers = std::mem::take(&mut request.headers);
    // Framing is the data path's: a whole body's length travels in the descriptor
    // (a streamed one's stated length goes with its head, for the callee to read).
    if request.stream.is_none() {
        headers.remove(http::header::CONTENT_LENGTH);
    }
    headers.remove(http::header::TRANSFER_ENCODING);
    headers.remove(http::header::HOST);
    head.set_headers(headers);
    head.trailers = std::mem::take(&mut request.trailers);
    Ok((service, head))
}

impl Transport for DataPathTransport {
    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    fn send_request(&mut self, tag: Tag, request: HttpRequest) -> Result<(), TransportError> {
        self.send_call(tag, request, AnswerBody::Whole)
    }

    fn send_call(
        &mut self,
        tag: Tag,
        mut request: HttpRequest,
        answer: AnswerBody,
    ) -> Result<(), TransportError> {
        let prepared = to_head(&mut request).and_then(|(service, head)| {
            let bytes = wire::encode_request(&head).map_err(|e| e.to_string())?;
            let (case, dst) = self.locate(&service)?;
            Ok((case, dst, bytes))
        });
        let streamed = request.stream.take().and_then(|s| s.take());
        match (prepared, streamed) {
            (Ok((case, dst, header)), None) => self.push(Queued {
                case,
                dst,
                req_id: tag.req_id,
                step_id: tag.step_id,
                response: false,
                status: 0,
                stream: false,
                header,
                body: request.body,
                tag: Some((tag, answer)),
                lane: 0,
            }),
            (Ok((case, dst, header)), Some(rest)) => {
                // Its parts follow it on its lane (the shard that will hold it), in
                // turn over the lanes as plain calls go.
                let lanes = self.port.as_ref().map_or(1, HostPort::lanes).max(1);
                self.upload_lane = (self.upload_lane + 1) % lanes;
                let lane = self.upload_lane as u8;
                self.push(Queued {
                    case,
                    dst,
                    req_id: tag.req_id,
                    step_id: tag.step_id,
                    response: false,
                    status: StreamPart::OPEN_REQUEST,
                    stream: true,
                    header,
                    // The opening carries the head only: every byte of the body is a
                    // part, so each part's `Sent` names this stream.
                    body: Bytes::new(),
                    tag: Some((tag, answer)),
                    lane,
                });
                let mut call = Descriptor::request(case, tag.req_id, tag.step_id, 0, dst);
                call.lane = lane;
                let body = crate::body::Prefixed::new(request.body, rest);
                self.uploads.open(call, Box::pin(body), false);
                self.pump_uploads();
            }
            (Err(e), _) => self.failed.push(Event::Completion {
                tag,
                outcome: Err(e),
            }),
        }
        Ok(())
    }

    fn send_response(
        &mut self,
        id: IncomingId,
        response: HttpResponse,
    ) -> Result<(), TransportError> {
        let Some(request) = self.incoming.waiting.remove(&id.0) else {
            if id.0 < self.incoming.lost_below {
                // Its node went away with it: nobody waits for this answer.
                return Ok(());
            }
            return Err(TransportError::Other(format!(
                "request {} was answered already",
                id.0
            )));
        };
        let mut headers = response.headers;
        headers.remove(http::header::CONTENT_LENGTH);
        headers.remove(http::header::TRANSFER_ENCODING);
        if let Some(body) = response.stream.as_ref().and_then(|s| s.take()) {
            // The opening: the head, and what the body had ready; the rest follows
            // as parts. (Its trailers come at the end, from the body.)
            let head = ResponseHead {
                status: response.status,
                headers,
                trailers: http::HeaderMap::new(),
            };
            let header = match wire::encode_response(&head) {
                Ok(h) => h,
                Err(e) => {
                    let (head, body) = plain(500, &format!("response head cannot be sent: {e}"));
                    self.answer(&request, &head, body);
                    return Ok(());
                }
            };
            let first = !response.body.is_empty();
            self.push_reply(&request, head.status, true, header, response.body);
            self.streams.open(request, body, first);
            self.pump_streams();
            return Ok(());
        }
        let head = ResponseHead {
            status: response.status,
            headers,
            trailers: response.trailers,
        };
        self.answer(&request, &head, response.body);
        Ok(())
    }

    fn poll(
        &mut self,
        timeout: Option<Duration>,
        _idle: bool,
        out: &mut Vec<Event>,
    ) -> Result<(), TransportError> {
        if self.watch.as_ref().is_some_and(NodeWatch::gone) {
            self.lose_node();
        }
        if self.port.is_none() {
            self.register_again();
        }
        self.flush();
        out.append(&mut self.failed);
        let other = |e: HostError| TransportError::Other(e.to_string());
        let Some(port) = self.port.as_mut() else {
            if out.is_empty() {
                // Nothing to do until the next try (or a waker: an internal step ended).
                std::thread::park_timeout(self.next_try_in().min(timeout.unwrap_or(REGISTER_CAP)));
            }
            return Ok(());
        };
        if out.is_empty() {
            // With sends waiting for room, look again soon: the completions that make
            // room are consumed inside `recv` and do not end its wait.
            let wait = if self.out.is_empty() {
                timeout.unwrap_or(Duration::from_secs(1))
            } else {
                Duration::from_millis(1).min(timeout.unwrap_or(Duration::MAX))
            };
            let budget = self.spin.budget().unwrap_or(wait);
            let started = Instant::now();
            let got = port.recv(self.spin.wake_mode(), wait).map_err(other)?;
            self.spin
                .record(Spin::classify(budget, started.elapsed(), got.is_some()));
            if let Some(incoming) = got {
                self.incoming(incoming, out);
            }
        }
        // Take everything else that is there without waiting.
        for _ in 0..256 {
            let Some(port) = self.port.as_mut() else {
                break;
            };
            match port.try_recv().map_err(other)? {
                Some(incoming) => self.incoming(incoming, out),
                None => break,
            }
        }
        self.pump_streams();
        self.pump_uploads();
        self.pump_in_streams();
        self.flush();
        out.append(&mut self.failed);
        Ok(())
    }

    fn stream_requests(&mut self, wants: fn(&HttpRequest) -> bool, whole_limit: usize) {
        self.wants_stream = wants;
        self.in_streams.set_limit(whole_limit);
    }

    fn answer_limit(&mut self, whole_limit: usize) {
        self.answers.set_limit(whole_limit);
    }

    fn waker(&self) -> Waker {
        let wake = self.wake.clone();
        Arc::new(move || wake.wake())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_egress_call_becomes_a_head_for_its_service() {
        let r = HttpRequest::post("http://user:8080/profile?id=7", "x")
            .header("x-trace", "t")
            .header("content-length", "1");
        let (service, head) = to_head(&mut r.clone()).unwrap();
        assert_eq!(service, "user");
        assert_eq!(head.authority, "user:8080");
        assert_eq!(
            (head.path.as_str(), head.query.as_deref()),
            ("/profile", Some("id=7"))
        );
        assert_eq!(head.header("x-trace").as_deref(), Some("t"));
        assert_eq!(
            head.header("content-length"),
            None,
            "framing is the data path's"
        );
        let err = to_head(&mut HttpRequest::get("/no-host")).unwrap_err();
        assert!(err.contains("names its service"), "{err}");
    }

    #[test]
    fn a_received_head_becomes_the_handlers_request() {
        let mut head = RequestHead::new("PUT", "/r/1?x=2");
        head.authority = "frontend".into();
        head.append_received("x-user", "alice").unwrap();
        let r = to_request(head, b"body".to_vec());
        assert_eq!(r.method, Method::PUT);
        assert_eq!(r.url, "/r/1?x=2");
        assert_eq!(r.header_str("x-user"), Some("alice"));
        assert_eq!(r.header_str("host"), Some("frontend"));
        assert_eq!(&r.body[..], b"body");
    }
}

//! An in-memory [`Transport`] on a virtual clock, for tests, examples and benchmarks.
//!
//! Upstream services are functions registered by host name; each answers with a
//! response and a latency (virtual). When the event loop is idle (no internal step
//! running) time jumps to the next thing that can happen; while internal steps run, it
//! moves with real time (they take what they take). A test asserts concurrency from the
//! clock: two 10 ms calls in parallel finish at 10 ms, one after another at 20 ms,
//! however fast or slow the machine is.

use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::http::{HttpRequest, HttpResponse};
use crate::transport::{Event, IncomingId, Tag, Transport, TransportError, Waker};

/// How a simulated service answers one request.
#[derive(Debug, Clone)]
// Test replies are built once per scripted call: their size does not matter, and
// `Reply::After(t, response)` reads better than a boxed response.
#[allow(clippy::large_enum_variant)]
pub enum Reply {
    /// With `response` after `after` (virtual time).
    After(Duration, HttpResponse),
    /// The transport fails to carry the request after `after`.
    Fail(Duration, String),
    /// Never (for timeout tests).
    Never,
}

impl Reply {
    /// 200 with `body` after `ms` milliseconds.
    pub fn ok_after(ms: u64, body: impl Into<bytes::Bytes>) -> Self {
        Self::After(Duration::from_millis(ms), HttpResponse::ok(body))
    }
}

type ServiceFn = Box<dyn FnMut(&HttpRequest) -> Reply + Send>;

/// Something the transport saw, with its virtual time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    /// When.
    pub at: Duration,
    /// The tag.
    pub tag: Tag,
    /// The request.
    pub request: HttpRequest,
}

struct Scheduled {
    at: Duration,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    // Earliest first (BinaryHeap is a max-heap).
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Default)]
struct Signal {
    woken: Mutex<bool>,
    cond: Condvar,
    /// The loop is waiting on `cond` (set and cleared under `woken`'s lock).
    waiting: AtomicBool,
}

/// The in-memory transport.
pub struct InMemoryTransport {
    now: Duration,
    seq: u64,
    queue: BinaryHeap<Scheduled>,
    services: HashMap<String, ServiceFn>,
    next_incoming: u64,
    responses: Vec<(IncomingId, Duration, HttpResponse)>,
    sent: Vec<Sent>,
    signal: Arc<Signal>,
    record: bool,
    closed: Arc<AtomicBool>,
}

impl std::fmt::Debug for InMemoryTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InMemoryTransport")
            .field("now", &self.now)
            .field("queued", &self.queue.len())
            .finish_non_exhaustive()
    }
}

impl Default for InMemoryTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl InMemoryTransport {
    /// A transport at virtual time 0 with no services.
    pub fn new() -> Self {
        Self {
            now: Duration::ZERO,
            seq: 0,
            queue: BinaryHeap::new(),
            services: HashMap::new(),
            next_incoming: 1,
            responses: Vec::new(),
            sent: Vec::new(),
            signal: Arc::default(),
            record: true,
            closed: Arc::default(),
        }
    }

    /// Does not keep a log of sent requests and responses (benchmarks).
    pub fn without_log(mut self) -> Self {
        self.record = false;
        self
    }

    /// Registers service `host` (the URL host egress requests name).
    pub fn service(
        mut self,
        host: &str,
        f: impl FnMut(&HttpRequest) -> Reply + Send + 'static,
    ) -> Self {
        self.services.insert(host.to_owned(), Box::new(f));
        self
    }

    fn schedule(&mut self, at: Duration, event: Event) {
        self.seq += 1;
        self.queue.push(Scheduled {
            at,
            seq: self.seq,
            event,
        });
    }

    /// Delivers `request` to the service at virtual time `at` (from now).
    pub fn inject_after(&mut self, after: Duration, request: HttpRequest) -> IncomingId {
        let id = IncomingId(self.next_incoming);
        self.next_incoming += 1;
        let at = self.now + after;
        self.schedule(at, Event::Request { id, request });
        id
    }

    /// Delivers `request` now.
    pub fn inject(&mut self, request: HttpRequest) -> IncomingId {
        self.inject_after(Duration::ZERO, request)
    }

    /// Answers sent so far: (request, virtual time, response).
    pub fn responses(&self) -> &[(IncomingId, Duration, HttpResponse)] {
        &self.responses
    }

    /// Takes the answers sent so far.
    pub fn take_responses(&mut self) -> Vec<(IncomingId, Duration, HttpResponse)> {
        std::mem::take(&mut self.responses)
    }

    /// The answer to `id`, with its virtual time.
    pub fn response(&self, id: IncomingId) -> Option<(Duration, &HttpResponse)> {
        self.responses
            .iter()
            .find(|(i, ..)| *i == id)
            .map(|(_, at, r)| (*at, r))
    }

    /// From now on, sending a request fails at once (as a transport whose data path
    /// went away does).
    pub fn close(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
    }

    /// Egress requests sent so far, with their virtual times.
    pub fn sent(&self) -> &[Sent] {
        &self.sent
    }

    /// Events scheduled and not yet delivered.
    pub fn pending(&self) -> usize {
        self.queue.len()
    }
}

impl Transport for InMemoryTransport {
    fn now(&self) -> Duration {
        self.now
    }

    fn send_request(&mut self, tag: Tag, request: HttpRequest) -> Result<(), TransportError> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(TransportError::Closed);
        }
        let host = request.host().unwrap_or_default();
        let reply = match self.services.get_mut(&host) {
            Some(service) => service(&request),
            None => Reply::Fail(Duration::ZERO, format!("no route to service {host:?}")),
        };
        if self.record {
            self.sent.push(Sent {
                at: self.now,
                tag,
                request,
            });
        }
        match reply {
            Reply::After(after, response) => {
                let at = self.now + after;
                self.schedule(
                    at,
                    Event::Completion {
                        tag,
                        outcome: Ok(response),
                    },
                );
            }
            Reply::Fail(after, why) => {
                let at = self.now + after;
                self.schedule(
                    at,
                    Event::Completion {
                        tag,
                        outcome: Err(why),
                    },
                );
            }
            Reply::Never => {}
        }
        Ok(())
    }

    fn send_response(
        &mut self,
        id: IncomingId,
        response: HttpResponse,
    ) -> Result<(), TransportError> {
        self.responses.push((id, self.now, response));
        Ok(())
    }

    fn poll(
        &mut self,
        timeout: Option<Duration>,
        idle: bool,
        out: &mut Vec<Event>,
    ) -> Result<(), TransportError> {
        let due = |q: &BinaryHeap<Scheduled>, now: Duration| q.peek().is_some_and(|s| s.at <= now);
        if !due(&self.queue, self.now) {
            if idle {
                // Nothing else can happen before the next scheduled event or the
                // loop's next timer: move the clock there.
                let next = self.queue.peek().map(|s| s.at);
                let limit = timeout.map(|t| self.now + t);
                match (next, limit) {
                    (Some(n), Some(l)) => self.now = n.min(l),
                    (Some(n), None) => self.now = n,
                    (None, Some(l)) => self.now = l,
                    (None, None) => return Ok(()),
                }
            } else {
                // An internal step is running on a real thread: wait (real time) for
                // it to wake us, and count that time, so internal work takes the time
                // it really takes (and internal timeouts can pass).
                let started = std::time::Instant::now();
                let limit = timeout
                    .unwrap_or(Duration::from_millis(50))
                    .min(Duration::from_millis(50));
                {
                    let mut woken = self.signal.woken.lock();
                    self.signal.waiting.store(true, Ordering::SeqCst);
                    if !*woken {
                        self.signal.cond.wait_for(&mut woken, limit);
                    }
                    self.signal.waiting.store(false, Ordering::SeqCst);
                    *woken = false;
                }
                self.now += started.elapsed();
                while due(&self.queue, self.now) {
                    out.push(self.queue.pop().expect("due").event);
                }
                return Ok(());
            }
        }
        while due(&self.queue, self.now) {
            out.push(self.queue.pop().expect("due").event);
        }
        Ok(())
    }

    fn waker(&self) -> Waker {
        let signal = self.signal.clone();
        Arc::new(move || {
            // The flag is set under the lock the waiter checks it under, so a wake-up
            // is never lost; the notify is skipped when nobody waits.
            let mut woken = signal.woken.lock();
            *woken = true;
            if signal.waiting.load(Ordering::SeqCst) {
                signal.cond.notify_one();
            }
        })
    }
}

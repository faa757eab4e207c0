//! How long a client connection may say nothing.
//!
//! hyper's HTTP/1 header-read timer runs whenever a connection waits for a head,
//! kept-alive ones included: a client between requests was dropped after
//! `header_timeout` (10 s), where nginx keeps one 75 s and Envoy an hour. The ingress
//! times its connections itself, on the reader ([`Watched`]), with two clocks:
//! - **a head**: `header_timeout` from its first byte, and the first head of a
//!   connection from the accept (a client that connects and says nothing is a slow
//!   one). It is cut off with an error, as hyper did.
//! - **idle**: `idle_timeout` from when the connection's last request was done with
//!   (its answer's body dropped by hyper): HTTP/1 between requests, HTTP/2 with no
//!   stream open (also from its last read: a client's pings keep it). The connection
//!   is ended as if the client had closed it.
//!
//! - **parking**: an HTTP/1 connection with no request open for `park_after` (250 ms
//!   by default) gives its buffers back. hyper keeps a read buffer (8 KiB, grown to 16)
//!   and a write buffer (8 KiB) for as long as a connection lives, and the connection's
//!   task holds hyper's state (3.6 KiB): 34 KiB of RSS per idle keep-alive connection,
//!   where HAProxy holds 1.2. The reader then ends hyper's connection as a client's
//!   close would, but leaves the stream in a [`Dock`] instead of closing it; the
//!   ingress waits on the bare socket (and the idle limit) and serves the next request
//!   with a new hyper connection. Only at a message boundary with nothing of the next
//!   head read (the tracker's `Between`), so hyper holds no byte the new connection
//!   would miss.
//!
//! While a request is open neither clock runs: it has its own limits (`body_timeout`,
//! `request_timeout`, a stream's idle limit), and so has a tunnel (a WebSocket or a
//! `CONNECT`: its route's `stream_idle_timeout`), after which the connection is never
//! idle.
//!
//! Deadlines are entries on the thread's [`HeaderTimer`] list: arming one per request
//! costs no system call. A connection keeps its one entry and moves it.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::rt::{Sleep, Timer};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, ReadBuf};

use crate::framing::{Phase, Sniff};
use crate::header_timer::HeaderTimer;

/// The two limits.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// A head, from its first byte (the first one from the accept).
    pub head: Duration,
    /// A connection with no request open.
    pub idle: Duration,
    /// An HTTP/1 connection with no request open, before it is parked (at or past
    /// `idle`: never).
    pub park: Duration,
}

/// Which clock ended a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    Head,
    Idle,
    /// Not a cut: the connection is parked (see the module's doc).
    Park,
}

impl Why {
    fn label(self) -> &'static str {
        match self {
            Why::Head => "head",
            Why::Idle => "idle",
            Why::Park => "park",
        }
    }
}

/// Counts a connection cut off by clock `why`.
pub fn timed_out(why: Why) {
    metrics::counter!("dpumesh_ingress_connections_timed_out_total", "clock" => why.label())
        .increment(1);
}

/// Where a parked connection's stream is left for the ingress to wait on.
pub type Dock<T> = Arc<Mutex<Option<T>>>;

/// What a connection's requests tell its reader: how many are open, since when none
/// is, and whether it became a tunnel. Shared by the service (on the connection's
/// thread) and the reader (`Send`: hyper hands an upgraded connection on as such).
#[derive(Debug)]
pub struct Activity {
    state: Mutex<Quiet>,
}

#[derive(Debug)]
struct Quiet {
    open: u32,
    tunnel: bool,
    /// When the connection last became quiet (no request open, or a read of an
    /// unfollowed stream).
    since: Instant,
}

impl Activity {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(Quiet {
                open: 0,
                tunnel: false,
                since: now(),
            }),
        })
    }

    /// A request opens; it is done with when the returned guard drops (held by its
    /// answer's body).
    pub fn open(self: &Arc<Self>) -> Open {
        self.state.lock().open += 1;
        Open(self.clone())
    }

    /// The connection became a tunnel: it is never idle again (the tunnel times
    /// itself).
    pub fn tunnel(&self) {
        self.state.lock().tunnel = true;
    }

    /// When the connection's idle limit runs out, counted from its last request
    /// (for a parked connection: it has none open).
    pub fn idle_deadline(&self, t: Timeouts) -> Instant {
        self.state.lock().since + t.idle
    }
}

/// One open request of a connection (see [`Activity::open`]).
#[derive(Debug)]
pub struct Open(Arc<Activity>);

impl Drop for Open {
    fn drop(&mut self) {
        let mut q = self.0.state.lock();
        q.open -= 1;
        if q.open == 0 {
            q.since = now();
        }
    }
}

/// An answer's body, holding its request open until hyper is done with it.
pub struct Answered<B> {
    body: B,
    _open: Open,
}

impl<B> Answered<B> {
    pub fn new(body: B, open: Open) -> Self {
        Self { body, _open: open }
    }
}

impl<B: hyper::body::Body + Unpin> hyper::body::Body for Answered<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// What a connection's clock does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Clock {
    /// Nothing: a tunnel.
    Off,
    /// A request is open: look again by then. The reader is not polled when the
    /// last request is done with (hyper's HTTP/1 reader may wait on the socket
    /// already, HTTP/2's streams end on their own tasks), so the idle and park clocks
    /// start at the next look: a connection busy all along is looked at about once a
    /// park spell (250 ms; a timer entry moved, no system call), and an idle one is
    /// parked at most two spells after its last answer.
    Look(Instant),
    /// Cut off then, by this clock.
    Cut(Instant, Why),
}

impl Quiet {
    /// The clock of a connection whose reader is at `phase` (`first`: no head came
    /// yet) and whose head being read began at `head_started`.
    fn clock(
        &self,
        phase: Phase,
        first: bool,
        head_started: Instant,
        now: Instant,
        t: Timeouts,
    ) -> Clock {
        if self.tunnel {
            return Clock::Off;
        }
        if self.open > 0 {
            return Clock::Look(now + t.park.min(t.idle));
        }
        match phase {
            Phase::InHead => Clock::Cut(head_started + t.head, Why::Head),
            Phase::Between if first => Clock::Cut(head_started + t.head, Why::Head),
            Phase::Between if t.park < t.idle => Clock::Cut(self.since + t.park, Why::Park),
            Phase::Between | Phase::Other => Clock::Cut(self.since + t.idle, Why::Idle),
        }
    }
}

/// The time as tokio sees it (paused in tests), as [`HeaderTimer`] keeps it.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// A client connection whose reads are timed (see the module's doc).
pub struct Watched<T> {
    /// `None` once parked: the stream is in `dock`, and hyper reads the end.
    inner: Option<Sniff<T>>,
    dock: Dock<T>,
    /// Taken up again after it was parked: its first head is not timed from the
    /// accept (it was waited for on the bare socket).
    resumed: bool,
    activity: Arc<Activity>,
    timer: HeaderTimer,
    timeouts: Timeouts,
    /// When the head being read began (the accept, for the first).
    head_started: Instant,
    /// The connection's one entry on the timer, and the deadline it is set for.
    sleep: Option<Pin<Box<dyn Sleep>>>,
    armed: Option<Instant>,
}

impl<T> Watched<T> {
    /// `dock`: where the stream is left if the connection is parked; `resumed`: it
    /// was parked before.
    pub fn new(
        inner: Sniff<T>,
        activity: Arc<Activity>,
        timer: HeaderTimer,
        timeouts: Timeouts,
        dock: Dock<T>,
        resumed: bool,
    ) -> Self {
        Self {
            inner: Some(inner),
            dock,
            resumed,
            activity,
            timer,
            timeouts,
            head_started: now(),
            sleep: None,
            armed: None,
        }
    }

    /// After a read of some bytes: starts a head's clock, or marks an unfollowed
    /// stream (HTTP/2) active.
    fn after_read(&mut self, before: Phase, after: Phase) {
        match (before, after) {
            (Phase::InHead, Phase::InHead) => {}
            (_, Phase::InHead) => self.head_started = now(),
            (_, Phase::Other) => self.activity.state.lock().since = now(),
            _ => {}
        }
    }

    /// Nothing to read: whether a clock ran out (it is armed for the next wait if
    /// not).
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<Why> {
        let tracker = self.inner.as_ref()?.tracker();
        let first = tracker.heads() == 0 && !self.resumed;
        let (phase, now) = (tracker.phase(), now());
        let clock =
            self.activity
                .state
                .lock()
                .clock(phase, first, self.head_started, now, self.timeouts);
        let (at, cut) = match clock {
            // The entry is left where it was; if it fires, the reader is polled once
            // for nothing.
            Clock::Off => return None,
            // Any look still to come, no later than this one, does (the common
            // case: a request after request moves nothing). A later one (a first
            // head's limit) is brought forward.
            Clock::Look(at) if self.armed.is_some_and(|a| a > now && a <= at) => (at, None),
            Clock::Look(at) => {
                self.arm(at);
                (at, None)
            }
            Clock::Cut(at, why) => {
                if self.armed != Some(at) {
                    self.arm(at);
                }
                (at, Some(why))
            }
        };
        let sleep = self.sleep.as_mut()?;
        if sleep.as_mut().poll(cx).is_pending() {
            return None;
        }
        match cut {
            Some(Why::Park) => {
                metrics::counter!("dpumesh_ingress_connections_parked_total").increment(1);
                if let Some(sniff) = self.inner.take() {
                    *self.dock.lock() = Some(sniff.into_inner());
                }
                Some(Why::Park)
            }
            Some(why) => {
                timed_out(why);
                Some(why)
            }
            None => {
                // A look that fired as it was kept: look again later.
                self.arm(at);
                let _ = self.sleep.as_mut()?.as_mut().poll(cx);
                None
            }
        }
    }

    /// Moves the connection's entry to `at`.
    fn arm(&mut self, at: Instant) {
        match &mut self.sleep {
            Some(sleep) => self.timer.reset(sleep, at),
            None => self.sleep = Some(self.timer.sleep_until(at)),
        }
        self.armed = Some(at);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        // Parked: hyper reads the end (and closes nothing, see `AsyncWrite`).
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        let (before, filled) = (inner.tracker().phase(), buf.filled().len());
        match Pin::new(&mut *inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > filled {
                    let after = inner.tracker().phase();
                    this.after_read(before, after);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match this.expired(cx) {
                None => Poll::Pending,
                // Ended as if the client had closed it; parked, the same to hyper.
                Some(Why::Idle | Why::Park) => Poll::Ready(Ok(())),
                Some(Why::Head) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the request head did not come within the header timeout",
                ))),
            },
            ready => ready,
        }
    }
}

/// Writes go to the stream; parked, there is none: hyper, ending the connection it
/// read the end of, flushes and shuts down nothing (the stream waits in the dock).
impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_write(cx, buf),
            None => Poll::Ready(Err(parked())),
        }
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_write_vectored(cx, bufs),
            None => Poll::Ready(Err(parked())),
        }
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.as_ref().is_some_and(|i| i.is_write_vectored())
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_shutdown(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}

fn parked() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "the connection is parked")
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Timeouts = Timeouts {
        head: Duration::from_secs(10),
        idle: Duration::from_secs(60),
        // Never: the tests of the two clocks.
        park: Duration::from_secs(60),
    };

    fn at(base: Instant, secs: u64) -> Instant {
        base + Duration::from_secs(secs)
    }

    fn at_(
        phase: Phase,
        first: bool,
        open: u32,
        tunnel: bool,
        since: Instant,
        head: Instant,
        now: Instant,
    ) -> Clock {
        let quiet = Quiet {
            open,
            tunnel,
            since,
        };
        quiet.clock(phase, first, head, now, T)
    }

    #[test]
    fn a_first_head_is_timed_from_the_accept() {
        let t0 = Instant::now();
        assert_eq!(
            at_(Phase::Between, true, 0, false, t0, t0, at(t0, 1)),
            Clock::Cut(at(t0, 10), Why::Head)
        );
    }

    #[test]
    fn a_kept_alive_connection_waits_the_idle_limit_from_its_last_answer() {
        let t0 = Instant::now();
        let done = at(t0, 3);
        assert_eq!(
            at_(Phase::Between, false, 0, false, done, t0, at(t0, 20)),
            Clock::Cut(at(t0, 63), Why::Idle)
        );
        // Its next head, once started, has the head limit from its first byte.
        let started = at(t0, 40);
        assert_eq!(
            at_(Phase::InHead, false, 0, false, done, started, at(t0, 41)),
            Clock::Cut(at(t0, 50), Why::Head)
        );
    }

    #[test]
    fn a_kept_alive_connection_is_parked_after_its_spell_and_nothing_else_is() {
        let t = Timeouts {
            park: Duration::from_millis(250),
            ..T
        };
        let t0 = Instant::now();
        let done = at(t0, 3);
        let quiet = |open, tunnel| Quiet {
            open,
            tunnel,
            since: done,
        };
        let park = Clock::Cut(done + Duration::from_millis(250), Why::Park);
        assert_eq!(
            quiet(0, false).clock(Phase::Between, false, t0, done, t),
            park
        );
        // Not with a head begun, a request open, a tunnel, HTTP/2, or before the
        // first head (timed from the accept).
        assert_eq!(
            quiet(0, false).clock(Phase::InHead, false, done, done, t),
            Clock::Cut(at(t0, 13), Why::Head)
        );
        // An open request is looked at again within a spell, so the park follows
        // its end closely (hyper may not read again when it ends).
        assert_eq!(
            quiet(1, false).clock(Phase::Between, false, t0, done, t),
            Clock::Look(done + Duration::from_millis(250))
        );
        assert_eq!(
            quiet(0, true).clock(Phase::Between, false, t0, done, t),
            Clock::Off
        );
        assert_eq!(
            quiet(0, false).clock(Phase::Other, false, t0, done, t),
            Clock::Cut(at(t0, 63), Why::Idle)
        );
        assert_eq!(
            quiet(0, false).clock(Phase::Between, true, t0, done, t),
            Clock::Cut(at(t0, 10), Why::Head)
        );
    }

    #[test]
    fn an_open_request_is_looked_at_later_and_a_tunnel_never() {
        let t0 = Instant::now();
        let now = at(t0, 7);
        for phase in [Phase::Between, Phase::InHead, Phase::Other] {
            assert_eq!(
                at_(phase, false, 1, false, t0, t0, now),
                Clock::Look(at(t0, 67))
            );
            assert_eq!(at_(phase, false, 0, true, t0, t0, now), Clock::Off);
        }
    }

    #[test]
    fn an_unfollowed_stream_with_nothing_open_idles() {
        let t0 = Instant::now();
        assert_eq!(
            at_(Phase::Other, false, 0, false, t0, t0, t0),
            Clock::Cut(at(t0, 60), Why::Idle)
        );
    }

    #[test]
    fn the_last_request_done_marks_the_connection_quiet() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let activity = Activity::new();
            let (a, b) = (activity.open(), activity.open());
            tokio::time::advance(Duration::from_secs(5)).await;
            let before = activity.state.lock().since;
            drop(a);
            assert_eq!(activity.state.lock().open, 1);
            assert_eq!(activity.state.lock().since, before, "one is still open");
            drop(b);
            let q = activity.state.lock();
            assert_eq!(q.open, 0);
            assert_eq!(q.since, now());
            assert_eq!(q.since, before + Duration::from_secs(5));
        });
    }
}

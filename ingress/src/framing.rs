//! Finds HTTP/1.1 requests that carry both `Content-Length` and `Transfer-Encoding`.
//!
//! hyper reads such a request as chunked and closes the connection after answering
//! (RFC 9112 §6.1), but it drops `Content-Length` from the headers it hands over, so
//! the handler cannot tell: the request would be served 200. A front end and a back end
//! reading one message two ways is request smuggling, and RFC 9112 §6.3 lets a server
//! refuse it; every hardened proxy answers 400 and closes. [`Sniff`] watches the bytes
//! hyper reads on a connection, follows message boundaries (heads, fixed and chunked
//! bodies) and records which requests, by their order on the connection, were
//! ambiguous; the handler of that request answers 400 + `connection: close`.
//!
//! It only observes: it never changes or holds a byte. It follows every HTTP/1.x
//! request of a connection: HTTP/1.0 ones (framed by their length alone), those that
//! ask for an `Upgrade` (the ingress switches no protocol, so hyper goes on reading
//! requests after them) and pipelined ones. Where it cannot follow the stream (a head
//! hyper would refuse anyway, a `CONNECT`, HTTP/2's preface) it stops, and says from
//! which request on it could not vouch for the framing: an HTTP/1 request from there
//! on is refused too (fail closed), never served unchecked.
//! Cost: fixed-length bodies are skipped by count; heads are scanned for their end and
//! parsed once more with `httparse` (the parser hyper uses), chunked bodies scanned.

use std::collections::BTreeSet;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

/// The most header fields a head is read with (hyper refuses more than the ingress's
/// `max_headers` anyway).
const MAX_FIELDS: usize = 4096;

/// What the handlers of one connection learn from its reader.
#[derive(Debug, Default)]
pub struct Ambiguous {
    /// Indexes (0 = first on the connection) of requests with both framings.
    requests: BTreeSet<u64>,
    /// The index of the first request the tracker could not follow (it stopped
    /// there): none from it on is vouched for.
    lost_at: Option<u64>,
}

/// Why an HTTP/1 request is refused for its framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It carried both `Content-Length` and `Transfer-Encoding`.
    BothFramings,
    /// It came after a point where the connection's framing could not be followed.
    Unfollowed,
}

impl Refusal {
    /// What the client is told.
    pub fn message(self) -> &'static str {
        match self {
            Self::BothFramings => {
                "both Content-Length and Transfer-Encoding: ambiguous framing refused"
            }
            Self::Unfollowed => {
                "the connection's framing could not be followed past an earlier request: refused"
            }
        }
    }
}

impl Ambiguous {
    /// Every request index found so far, in order.
    pub fn indexes(&self) -> Vec<u64> {
        self.requests.iter().copied().collect()
    }

    /// Whether the `index`-th HTTP/1 request of the connection is refused, and why
    /// (forgets a finding of both framings once asked).
    pub fn verdict(&mut self, index: u64) -> Option<Refusal> {
        if self.requests.remove(&index) {
            Some(Refusal::BothFramings)
        } else if self.lost_at.is_some_and(|at| index >= at) {
            Some(Refusal::Unfollowed)
        } else {
            None
        }
    }
}

/// Where in the stream the reader is.
#[derive(Debug)]
enum State {
    /// Reading a head (its bytes so far, if it spans reads, in `Tracker::kept`).
    Head,
    /// In a body of this many more bytes.
    Fixed(u64),
    /// In a chunked body.
    Chunked(Chunk),
    /// Not following any more.
    Off,
}

#[derive(Debug)]
enum Chunk {
    /// The size line so far.
    Size(Vec<u8>),
    /// Data left in this chunk.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer fields; `true` when the current line is empty so far.
    Trailers(bool),
}

/// Follows HTTP/1 message boundaries over the bytes of one connection.
#[derive(Debug)]
pub struct Tracker {
    state: State,
    /// The start of a head that did not end in the read it began in (kept, with its
    /// capacity, for the next one: a head that fits one read is parsed where it lies).
    kept: Vec<u8>,
    /// Heads seen so far.
    index: u64,
    max_head: usize,
    found: Arc<parking_lot::Mutex<Ambiguous>>,
}

impl Tracker {
    pub fn new(max_head: usize, found: Arc<parking_lot::Mutex<Ambiguous>>) -> Self {
        Self {
            state: State::Head,
            kept: Vec::new(),
            index: 0,
            max_head,
            found,
        }
    }

    /// Stops following: no request from the `index`-th on is vouched for.
    fn lose(&mut self) {
        self.state = State::Off;
        let mut found = self.found.lock();
        found.lost_at = Some(found.lost_at.map_or(self.index, |at| at.min(self.index)));
    }

    /// Takes the next bytes the connection read.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            bytes = match &mut self.state {
                State::Off => return,
                State::Fixed(left) => {
                    let n = (*left).min(bytes.len() as u64);
                    *left -= n;
                    if *left == 0 {
                        self.state = State::Head;
                    }
                    &bytes[n as usize..]
                }
                State::Head => {
                    // Empty lines before a request line are allowed (RFC 9112 §2.2).
                    if self.kept.is_empty() {
                        let skip = bytes.iter().take_while(|&&b| b == b'\r' || b == b'\n');
                        bytes = &bytes[skip.count()..];
                        if bytes.is_empty() {
                            return;
                        }
                    }
                    let Some(used) = head_end(&self.kept, bytes) else {
                        self.kept.extend_from_slice(bytes);
                        if self.kept.len() > self.max_head {
                            // hyper refuses such a head (431) and closes.
                            self.lose();
                            self.kept = Vec::new();
                        }
                        return;
                    };
                    if self.kept.is_empty() {
                        self.head(&bytes[..used]);
                    } else {
                        let mut kept = std::mem::take(&mut self.kept);
                        kept.extend_from_slice(&bytes[..used]);
                        self.head(&kept);
                        kept.clear();
                        self.kept = kept;
                    }
                    &bytes[used..]
                }
                State::Chunked(chunk) => {
                    let (used, done) = chunk.feed(bytes);
                    match done {
                        Some(true) => self.state = State::Head,
                        Some(false) => self.lose(),
                        None => {}
                    }
                    &bytes[used..]
                }
            };
        }
    }

    /// A complete head: records it and sets how its body is framed.
    fn head(&mut self, head: &[u8]) {
        let mut fields = [httparse::EMPTY_HEADER; 128];
        let mut more = Vec::new();
        let mut req = httparse::Request::new(&mut fields);
        let mut parsed = req.parse(head);
        if matches!(parsed, Err(httparse::Error::TooManyHeaders)) {
            // A head with more fields than usual (the ingress's limit may be higher).
            more.resize(MAX_FIELDS, httparse::EMPTY_HEADER);
            req = httparse::Request::new(&mut more);
            parsed = req.parse(head);
        }
        if !matches!(parsed, Ok(httparse::Status::Complete(_))) {
            // HTTP/2's preface (its requests are not HTTP/1's to refuse) or a head
            // hyper refuses anyway.
            self.lose();
            return;
        }
        if req.method == Some("CONNECT") {
            // Refused by the ingress (it tunnels nothing) and the connection closed;
            // were it accepted, what follows would be tunnel bytes.
            self.index += 1;
            self.lose();
            return;
        }
        let (mut length, mut chunked, mut te) = (None, false, false);
        for field in req.headers.iter() {
            if field.name.eq_ignore_ascii_case("content-length") {
                length = std::str::from_utf8(field.value)
                    .ok()
                    .and_then(|v| v.trim().parse::<u64>().ok());
            } else if field.name.eq_ignore_ascii_case("transfer-encoding") {
                te = true;
                chunked = field
                    .value
                    .rsplit(|&b| b == b',')
                    .next()
                    .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            }
            // `Upgrade` is followed like any field: the ingress answers no 101, so
            // hyper goes on reading requests after one that asked.
        }
        let has_length = req
            .headers
            .iter()
            .any(|f| f.name.eq_ignore_ascii_case("content-length"));
        if te && has_length {
            self.found.lock().requests.insert(self.index);
        }
        self.index += 1;
        if te && req.version != Some(1) {
            // hyper refuses a transfer coding on HTTP/1.0 (400) and closes.
            self.lose();
            return;
        }
        self.state = if te {
            // hyper refuses a transfer coding that does not end in chunked.
            if chunked {
                State::Chunked(Chunk::Size(Vec::new()))
            } else {
                self.lose();
                return;
            }
        } else if has_length {
            match length {
                Some(0) => State::Head,
                Some(n) => State::Fixed(n),
                // An unreadable length: hyper answers 400 and closes.
                None => {
                    self.lose();
                    return;
                }
            }
        } else {
            State::Head
        };
    }
}

/// How many bytes of `bytes` complete the head that `kept` began: up to and including
/// the `\n` of `\r\n\r\n` or `\n\n`.
fn head_end(kept: &[u8], bytes: &[u8]) -> Option<usize> {
    // The byte `back` places before `bytes[i]`, looking into `kept` when needed.
    let before = |i: usize, back: usize| -> Option<u8> {
        match i.checked_sub(back) {
            Some(j) => Some(bytes[j]),
            None => kept.len().checked_sub(back - i).map(|j| kept[j]),
        }
    };
    bytes.iter().enumerate().find_map(|(i, &b)| {
        let end = b == b'\n'
            && (before(i, 1) == Some(b'\n')
                || (before(i, 1) == Some(b'\r') && before(i, 2) == Some(b'\n')));
        end.then_some(i + 1)
    })
}

impl Chunk {
    /// Consumes what it can of `bytes`: how many, and `Some(true)` when the body ended,
    /// `Some(false)` when it cannot be followed.
    fn feed(&mut self, bytes: &[u8]) -> (usize, Option<bool>) {
        let mut used = 0;
        while used < bytes.len() {
            let rest = &bytes[used..];
            match self {
                Chunk::Size(line) => {
                    let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
                        line.extend_from_slice(rest);
                        if line.len() > 1024 {
                            return (bytes.len(), Some(false));
                        }
                        return (bytes.len(), None);
                    };
                    line.extend_from_slice(&rest[..nl]);
                    used += nl + 1;
                    let digits: Vec<u8> = line
                        .iter()
                        .copied()
                        .take_while(u8::is_ascii_hexdigit)
                        .collect();
                    let size = std::str::from_utf8(&digits)
                        .ok()
                        .and_then(|d| u64::from_str_radix(d, 16).ok());
                    *self = match size {
                        Some(0) => Chunk::Trailers(true),
                        Some(n) => Chunk::Data(n),
                        None => return (used, Some(false)),
                    };
                }
                Chunk::Data(left) => {
                    let n = (*left).min(rest.len() as u64);
                    *left -= n;
                    used += n as usize;
                    if *left == 0 {
                        *self = Chunk::DataEnd;
                    }
                }
                Chunk::DataEnd => match rest.iter().position(|&b| b == b'\n') {
                    Some(nl) => {
                        used += nl + 1;
                        *self = Chunk::Size(Vec::new());
                    }
                    None => return (bytes.len(), None),
                },
                Chunk::Trailers(empty) => {
                    let b = rest[0];
                    used += 1;
                    match b {
                        b'\n' if *empty => return (used, Some(true)),
                        b'\n' => *empty = true,
                        b'\r' => {}
                        _ => *empty = false,
                    }
                }
            }
        }
        (used, None)
    }
}

/// Where a connection's reader is between messages, as its [`Tracker`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// No byte of the next head yet.
    Between,
    /// Part of a head came, not its end.
    InHead,
    /// In a body, or not followed any more (HTTP/2, a tunnel, a head hyper refuses).
    Other,
}

impl Tracker {
    /// Where the reader is.
    pub fn phase(&self) -> Phase {
        match self.state {
            State::Head if self.kept.is_empty() => Phase::Between,
            State::Head => Phase::InHead,
            _ => Phase::Other,
        }
    }

    /// Heads seen so far.
    pub fn heads(&self) -> u64 {
        self.index
    }
}

/// A connection whose reads are watched by a [`Tracker`].
pub struct Sniff<T> {
    inner: T,
    tracker: Tracker,
}

impl<T> Sniff<T> {
    pub fn new(inner: T, tracker: Tracker) -> Self {
        Self { inner, tracker }
    }

    /// The connection's tracker.
    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    /// The stream, its tracker dropped.
    pub fn into_inner(self) -> T {
        self.inner
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Sniff<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let poll = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = poll {
            this.tracker.feed(&buf.filled()[before..]);
        }
        poll
    }
}

crate::write_through!(Sniff);

#[cfg(test)]
mod tests {
    use super::*;

    /// The ambiguous request indexes of a stream fed in pieces of `step` bytes.
    fn found(stream: &[u8], step: usize) -> Vec<u64> {
        let found = Arc::new(parking_lot::Mutex::new(Ambiguous::default()));
        let mut t = Tracker::new(32 << 10, found.clone());
        for piece in stream.chunks(step) {
            t.feed(piece);
        }
        found.lock().requests.iter().copied().collect()
    }

    fn every_split(stream: &[u8], want: &[u64]) {
        for step in [1, 2, 3, 7, 64, stream.len()] {
            assert_eq!(found(stream, step), want, "fed {step} bytes at a time");
        }
    }

    #[test]
    fn both_framings_are_found_whatever_their_order_and_position() {
        every_split(
            b"POST /a HTTP/1.1\r\nhost: h\r\ncontent-length: 6\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            &[0],
        );
        every_split(
            b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            &[0],
        );
        // The third request on a kept-alive connection, after a fixed and a chunked body.
        every_split(
            b"POST /a HTTP/1.1\r\ncontent-length: 5\r\n\r\nhelloPOST /b HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n0\r\nx-trailer: 1\r\n\r\n\r\nGET /c HTTP/1.1\r\ncontent-length: 0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            &[2],
        );
    }

    #[test]
    fn a_head_with_many_fields_is_still_read() {
        let fields: String = (0..300).map(|i| format!("x-f{i}: v\r\n")).collect();
        let stream = format!(
            "POST /a HTTP/1.1\r\n{fields}content-length: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
        );
        assert_eq!(found(stream.as_bytes(), 64), [0]);
    }

    #[test]
    fn clean_streams_are_never_flagged() {
        every_split(
            b"GET / HTTP/1.1\r\nhost: h\r\n\r\nGET /2 HTTP/1.1\nhost: h\n\nPOST /3 HTTP/1.1\r\ncontent-length: 40\r\n\r\ntransfer-encoding: chunked\r\ncontent-length: 1\r\n",
            &[],
        );
    }

    /// Each request's verdict (indexes 0..n) after feeding `stream` whole.
    fn verdicts(stream: &[u8], n: u64, max_head: usize) -> Vec<Option<Refusal>> {
        let found = Arc::new(parking_lot::Mutex::new(Ambiguous::default()));
        let mut t = Tracker::new(max_head, found.clone());
        for piece in stream.chunks(5) {
            t.feed(piece);
        }
        (0..n).map(|i| found.lock().verdict(i)).collect()
    }

    #[test]
    fn http_1_0_and_upgrade_requests_are_followed_and_what_comes_after_checked() {
        // Both were where the tracker used to stop: a later request with both
        // framings was then served.
        every_split(
            b"GET / HTTP/1.0\r\nconnection: keep-alive\r\n\r\nPOST /b HTTP/1.0\r\nconnection: keep-alive\r\ncontent-length: 3\r\n\r\nabcGET / HTTP/1.1\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            &[2],
        );
        every_split(
            b"GET / HTTP/1.1\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\nGET / HTTP/1.1\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            &[1],
        );
        // Pipelined, in one read: the third of three.
        assert_eq!(
            found(
                b"GET /1 HTTP/1.1\r\n\r\nGET /2 HTTP/1.1\r\n\r\nPOST /3 HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n0\r\n\r\n",
                usize::MAX
            ),
            [2]
        );
    }

    #[test]
    fn past_what_it_cannot_follow_every_request_is_refused() {
        use Refusal::*;
        // HTTP/2's preface: none of HTTP/1 is vouched for (its own requests are
        // HTTP/2's and never asked).
        assert_eq!(
            verdicts(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 1, 1 << 15),
            [Some(Unfollowed)]
        );
        // A CONNECT is judged on its own; what follows it is not followed.
        assert_eq!(
            verdicts(
                b"CONNECT h:443 HTTP/1.1\r\nhost: h:443\r\n\r\nGET / HTTP/1.1\r\n\r\n",
                2,
                1 << 15
            ),
            [None, Some(Unfollowed)]
        );
        // A chunk size that is not one (hyper fails that body): what follows it is
        // not followed.
        assert_eq!(
            verdicts(
                b"GET / HTTP/1.1\r\n\r\nPOST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nGET / HTTP/1.1\r\n\r\n",
                3,
                1 << 15
            ),
            [None, None, Some(Unfollowed)]
        );
        // A transfer coding on HTTP/1.0 (hyper refuses it): the rest is not followed.
        assert_eq!(
            verdicts(
                b"POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET / HTTP/1.1\r\n\r\n",
                2,
                1 << 15
            ),
            [None, Some(Unfollowed)]
        );
        // A head over the limit.
        assert_eq!(
            verdicts(b"GET /a-long-path HTTP/1.1\r\nx: y\r\n", 1, 16),
            [Some(Unfollowed)]
        );
        // Both framings are said as such, once.
        let found = Arc::new(parking_lot::Mutex::new(Ambiguous::default()));
        let mut t = Tracker::new(1 << 15, found.clone());
        t.feed(
            b"POST / HTTP/1.1\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        );
        assert_eq!(found.lock().verdict(0), Some(BothFramings));
        assert_eq!(found.lock().verdict(0), None);
    }
}

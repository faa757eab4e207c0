//! The bridge's HTTP/1.1 client to its server, for requests whose body is whole (the
//! common case: the host library reads bodies under 1 MiB whole). It is the request's
//! own future that writes the request and reads the answer: one write, then reads
//! as the socket is readable, on the loop's thread, with no task between (hyper's
//! pooled client hands each request to a connection task and back, and moved
//! kilobytes of futures doing it: a third of the bridge's work in `perf`).
//! Streamed uploads, WebSockets and HTTP/2 stay with hyper ([`crate::forward`]).
//!
//! Connections are kept (LIFO, at most [`MAX_IDLE`], for [`IDLE_FOR`]). A kept
//! connection the server closed meanwhile is found closed at checkout or fails
//! before any byte of the answer; the request is then sent once more on a new
//! connection, as nginx does with its cached upstream connections (the server saw no
//! request it answered).

pub mod decode;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use decode::{BodyDecoder, DecodeError, Event};
use dpumesh_head::whole_body::WholeBody;
use http::{HeaderMap, Method, Response};
use http_body::Frame;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The most idle connections kept.
pub const MAX_IDLE: usize = 64;

/// How long an idle connection is kept.
pub const IDLE_FOR: Duration = Duration::from_secs(90);

/// A connection idle for longer is checked for a close before it is used.
const CHECK_AFTER: Duration = Duration::from_secs(1);

/// How much is read from the socket at a time (at least).
const READ_SIZE: usize = 16 << 10;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot connect: {0}")]
    Connect(std::io::Error),
    #[error("{0}")]
    Io(std::io::Error),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("the server switched protocols though none was asked for")]
    UnaskedUpgrade,
    #[error("the server closed the connection before answering")]
    ClosedBeforeAnswer,
}

impl Error {
    /// Whether the server may have seen nothing of the request: the connection
    /// failed or closed before any byte of an answer.
    fn before_answer(&self) -> bool {
        matches!(self, Self::Io(_) | Self::ClosedBeforeAnswer)
    }
}

struct Conn {
    io: TcpStream,
    buf: BytesMut,
    idle_since: Instant,
}

/// Connections to one server.
#[derive(Clone)]
pub struct Client {
    to: Arc<str>,
    idle: Arc<Mutex<Vec<Conn>>>,
}

impl Client {
    pub fn new(to: &str) -> Self {
        Self {
            to: to.into(),
            idle: Arc::default(),
        }
    }

    /// Sends a request with a whole body (and trailers, sent chunked) and returns
    /// the answer once its head is read; its body comes whole if it came with the
    /// head, else as it arrives.
    pub async fn send(
        &self,
        parts: &http::request::Parts,
        body: Bytes,
        trailers: &HeaderMap,
    ) -> Result<Response<Body>, Error> {
        let wire = encode(parts, &body, trailers, &self.to);
        let head_request = parts.method == Method::HEAD;
        let mut fresh_only = false;
        loop {
            let (mut conn, reused) = match (!fresh_only).then(|| self.checkout()).flatten() {
                Some(c) => (c, true),
                None => (self.connect().await?, false),
            };
            match exchange(&mut conn, &wire, head_request).await {
                Ok(head) => return Ok(self.answer(conn, head)),
                Err(e) if reused && e.before_answer() => fresh_only = true,
                Err(e) => return Err(e),
            }
        }
    }

    /// An idle connection the server has not closed, if any.
    fn checkout(&self) -> Option<Conn> {
        let mut idle = self.idle.lock();
        while let Some(conn) = idle.pop() {
            let idle_for = conn.idle_since.elapsed();
            if idle_for > IDLE_FOR {
                continue;
            }
            // A server closes an idle connection after seconds (its keep-alive
            // timeout); one closing sooner says `connection: close`, and the
            // connection was not kept. A connection idle for less is taken as it is:
            // checking costs a `recv` that finds nothing (tokio's readiness still
            // says readable after the read that ended the last answer), and should
            // it be closed after all, the request goes again on a new connection.
            if idle_for < CHECK_AFTER {
                return Some(conn);
            }
            // Readable while idle: closed by the server (or it sent what nobody asked
            // for).
            match conn.io.try_read(&mut [0u8; 1]) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Some(conn),
                _ => continue,
            }
        }
        None
    }

    async fn connect(&self) -> Result<Conn, Error> {
        let io = TcpStream::connect(&*self.to)
            .await
            .map_err(Error::Connect)?;
        let _ = io.set_nodelay(true);
        Ok(Conn {
            io,
            buf: BytesMut::with_capacity(READ_SIZE),
            idle_since: Instant::now(),
        })
    }

    fn release(&self, mut conn: Conn) {
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE {
            conn.idle_since = Instant::now();
            idle.push(conn);
        }
    }

    /// The response: the body whole when it is all in the buffer (the connection
    /// goes back at once), else read as it comes.
    fn answer(&self, mut conn: Conn, head: decode::Head) -> Response<Body> {
        let mut decoder = BodyDecoder::new(head.framing);
        // One part (the common answer) is kept as it came; only more are joined.
        let mut data = Bytes::new();
        let mut trailers = HeaderMap::new();
        let whole = loop {
            // Errors and a body not all there yet go to the streaming body, which
            // meets them again.
            match decoder.decode(&mut conn.buf) {
                Ok(Some(Event::Data(d))) if data.is_empty() => data = d,
                Ok(Some(Event::Data(d))) => data = [data, d].concat().into(),
                Ok(Some(Event::Trailers(t))) => trailers = t,
                Ok(Some(Event::End)) => break true,
                Ok(None) | Err(_) => break false,
            }
        };
        let mut headers = head.headers;
        // The mesh frames the body itself.
        for name in dpumesh_head::HOP_BY_HOP {
            headers.remove(name);
        }
        let body = if whole {
            if head.keep_alive && conn.buf.is_empty() {
                self.release(conn);
            }
            Body::Whole(WholeBody::new(data, trailers))
        } else {
            Body::Streaming(Box::new(Streaming {
                conn: Some(conn),
                decoder,
                first: (!data.is_empty()).then_some(data),
                keep_alive: head.keep_alive,
                client: self.clone(),
            }))
        };
        let mut response = Response::new(body);
        *response.status_mut() = head.status;
        *response.headers_mut() = headers;
        response
    }
}

/// The request on the wire: head, then the body with its length, or chunked with
/// its trailers.
fn encode(parts: &http::request::Parts, body: &Bytes, trailers: &HeaderMap, to: &str) -> Bytes {
    let mut w = BytesMut::with_capacity(256 + body.len());
    w.put_slice(parts.method.as_str().as_bytes());
    w.put_u8(b' ');
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    w.put_slice(target.as_bytes());
    w.put_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        if dpumesh_head::is_hop_by_hop(name.as_str()) {
            continue;
        }
        w.put_slice(name.as_str().as_bytes());
        w.put_slice(b": ");
        w.put_slice(value.as_bytes());
        w.put_slice(b"\r\n");
    }
    if !parts.headers.contains_key(http::header::HOST) {
        w.put_slice(b"host: ");
        w.put_slice(to.as_bytes());
        w.put_slice(b"\r\n");
    }
    let chunked = !trailers.is_empty();
    if chunked {
        w.put_slice(b"transfer-encoding: chunked\r\n\r\n");
        if !body.is_empty() {
            w.put_slice(format!("{:x}\r\n", body.len()).as_bytes());
            w.put_slice(body);
            w.put_slice(b"\r\n");
        }
        w.put_slice(b"0\r\n");
        for (name, value) in trailers {
            w.put_slice(name.as_str().as_bytes());
            w.put_slice(b": ");
            w.put_slice(value.as_bytes());
            w.put_slice(b"\r\n");
        }
        w.put_slice(b"\r\n");
    } else {
        // A length where there is a body, or where the method usually has one (a
        // server may wait for a POST's length).
        let usual = !matches!(
            parts.method,
            Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE
        );
        if !body.is_empty() || usual {
            w.put_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
        }
        w.put_slice(b"\r\n");
        w.put_slice(body);
    }
    w.freeze()
}

/// Writes the request and reads the answer's head (past any 1xx).
async fn exchange(conn: &mut Conn, wire: &[u8], head_request: bool) -> Result<decode::Head, Error> {
    conn.io.write_all(wire).await.map_err(Error::Io)?;
    let mut answered = false;
    loop {
        if let Some((head, n)) = decode::parse_head(&conn.buf, head_request)? {
            let _ = conn.buf.split_to(n);
            if head.status == http::StatusCode::SWITCHING_PROTOCOLS {
                return Err(Error::UnaskedUpgrade);
            }
            if head.status.is_informational() {
                answered = true;
                continue;
            }
            return Ok(head);
        }
        conn.buf.reserve(READ_SIZE);
        match conn.io.read_buf(&mut conn.buf).await {
            Ok(0) if conn.buf.is_empty() && !answered => {
                return Err(Error::ClosedBeforeAnswer);
            }
            Ok(0) => return Err(DecodeError::Closed("in the middle of the head").into()),
            Ok(_) => answered = true,
            Err(e) if !answered => return Err(Error::Io(e)),
            Err(e) => return Err(DecodeError::Head(format!("read failed: {e}")).into()),
        }
    }
}

/// An answer's body.
pub enum Body {
    /// All of it came with the head.
    Whole(WholeBody),
    /// Read from the connection as it comes.
    Streaming(Box<Streaming>),
}

/// A body read from its connection, which goes back to the client once the body
/// ended cleanly (a body dropped before its end takes its connection with it).
pub struct Streaming {
    conn: Option<Conn>,
    decoder: BodyDecoder,
    /// What came with the head.
    first: Option<Bytes>,
    keep_alive: bool,
    client: Client,
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        match self.get_mut() {
            Self::Whole(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|f| f.map_err(|never| match never {}))),
            Self::Streaming(s) => s.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Whole(b) => b.is_end_stream(),
            Self::Streaming(s) => s.conn.is_none() && s.first.is_none(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            Self::Whole(b) => b.size_hint(),
            Self::Streaming(_) => http_body::SizeHint::default(),
        }
    }
}

impl Streaming {
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        let Some(conn) = self.conn.as_mut() else {
            return Poll::Ready(None);
        };
        loop {
            let event = match self.decoder.decode(&mut conn.buf) {
                Ok(Some(e)) => e,
                Ok(None) => {
                    conn.buf.reserve(READ_SIZE);
                    match ready!(poll_read(&conn.io, &mut conn.buf, cx)) {
                        Ok(0) => match self.decoder.eof() {
                            Ok(e) => e,
                            Err(e) => return self.fail(e.into()),
                        },
                        Ok(_) => continue,
                        Err(e) => return self.fail(Error::Io(e)),
                    }
                }
                Err(e) => return self.fail(e.into()),
            };
            return Poll::Ready(match event {
                Event::Data(d) => Some(Ok(Frame::data(d))),
                Event::Trailers(t) => Some(Ok(Frame::trailers(t))),
                Event::End => {
                    let conn = self.conn.take().expect("checked above");
                    if self.keep_alive && conn.buf.is_empty() {
                        self.client.release(conn);
                    }
                    None
                }
            });
        }
    }

    fn fail(&mut self, e: Error) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        self.conn = None;
        Poll::Ready(Some(Err(e)))
    }
}

/// Reads what the socket has into `buf`'s spare room.
fn poll_read(
    io: &TcpStream,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<std::io::Result<usize>> {
    loop {
        ready!(io.poll_read_ready(cx))?;
        match io.try_read_buf(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            other => return Poll::Ready(other),
        }
    }
}

#[cfg(test)]
mod tests;

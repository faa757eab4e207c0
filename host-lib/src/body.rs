//! Response bodies sent as they are made: a handler answers with a head now and the
//! body in parts, of any total size, each part leaving for the client before the next
//! is made (downloads larger than a slot, server-sent events, long polls, gRPC server
//! streaming). The data path carries each part in a body slot and at most
//! [`STREAM_WINDOW_PARTS`] of a stream's parts are in flight: a client that reads
//! slowly slows the body's producer instead of growing anybody's memory.
//!
//! Any `http_body::Body` streams ([`HttpResponse::streaming`]); [`channel`] is the
//! usual producer, fed from a task or a thread:
//!
//! ```
//! use dpumesh_host::{HttpResponse, body};
//! let (mut tx, rx) = body::channel(4);
//! std::thread::spawn(move || {
//!     for i in 0..3 {
//!         if tx.blocking_send(format!("data: {i}\n\n")).is_err() {
//!             return; // the client left
//!         }
//!     }
//! });
//! let response = HttpResponse::streaming(200, rx).header("content-type", "text/event-stream");
//! assert!(response.stream.is_some());
//! ```
//!
//! [`HttpResponse::streaming`]: crate::HttpResponse::streaming

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame};
use parking_lot::Mutex;

/// The error a streamed body may end with: the stream is aborted, and the client
/// sees an incomplete body (a reset h2 stream, a closed HTTP/1.1 connection).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A stream's parts the data path lets be in flight (sent, not yet taken by the
/// node).
pub const STREAM_WINDOW_PARTS: usize = 4;

type Boxed = Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send>>;

/// A response body sent as it is made. Cloning shares it: it is polled by one taker
/// (the transport that sends it).
#[derive(Clone)]
pub struct BodyStream(Arc<Mutex<Option<Boxed>>>);

impl BodyStream {
    /// Streams `body`.
    pub fn new<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        use http_body_util::BodyExt;
        Self(Arc::new(Mutex::new(Some(Box::pin(
            body.map_err(Into::into),
        )))))
    }

    /// Takes the body out to poll it (`None` once taken).
    pub fn take(&self) -> Option<Boxed> {
        self.0.lock().take()
    }
}

impl std::fmt::Debug for BodyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BodyStream")
    }
}

impl PartialEq for BodyStream {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for BodyStream {}

/// A bounded channel whose receiving half is a body: at most `parts` parts wait in
/// it, and a sender waits (`send`) or is refused (`try_send`) while it is full.
/// Dropping the sender ends the body; [`Sender::abort`] aborts it.
pub fn channel(parts: usize) -> (Sender, Receiver) {
    let (tx, rx) = tokio::sync::mpsc::channel(parts.max(1));
    (Sender { tx }, Receiver { rx, ended: false })
}

enum Item {
    Data(Bytes),
    Trailers(HeaderMap),
    Abort(String),
}

/// The sending half of [`channel`].
#[derive(Debug, Clone)]
pub struct Sender {
    tx: tokio::sync::mpsc::Sender<Item>,
}

/// The body's reader is gone (the client left, or the stream was cancelled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the stream's reader is gone")]
pub struct Closed;

impl Sender {
    /// Sends a part, waiting while the channel is full.
    pub async fn send(&mut self, data: impl Into<Bytes>) -> Result<(), Closed> {
        self.tx
            .send(Item::Data(data.into()))
            .await
            .map_err(|_| Closed)
    }

    /// Sends a part from a thread, blocking while the channel is full (never on the
    /// event loop's thread: it would wait for itself).
    pub fn blocking_send(&mut self, data: impl Into<Bytes>) -> Result<(), Closed> {
        self.tx
            .blocking_send(Item::Data(data.into()))
            .map_err(|_| Closed)
    }

    /// Sends a part if there is room now; gives it back otherwise.
    pub fn try_send(&mut self, data: impl Into<Bytes>) -> Result<(), TrySendError> {
        use tokio::sync::mpsc::error::TrySendError as E;
        self.tx
            .try_send(Item::Data(data.into()))
            .map_err(|e| match e {
                E::Full(_) => TrySendError::Full,
                E::Closed(_) => TrySendError::Closed,
            })
    }

    /// Ends the body with trailer fields.
    pub async fn finish(self, trailers: HeaderMap) -> Result<(), Closed> {
        self.tx
            .send(Item::Trailers(trailers))
            .await
            .map_err(|_| Closed)
    }

    /// Ends the body with trailer fields, from a thread (blocking while the channel
    /// is full).
    pub fn blocking_finish(self, trailers: HeaderMap) -> Result<(), Closed> {
        self.tx
            .blocking_send(Item::Trailers(trailers))
            .map_err(|_| Closed)
    }

    /// Aborts the body from a thread (blocking while the channel is full).
    pub fn blocking_abort(&mut self, why: impl Into<String>) -> Result<(), Closed> {
        self.tx
            .blocking_send(Item::Abort(why.into()))
            .map_err(|_| Closed)
    }

    /// Aborts the body: the client sees it incomplete, not ended.
    pub async fn abort(self, why: impl Into<String>) {
        let _ = self.tx.send(Item::Abort(why.into())).await;
    }

    /// Whether the reader is gone.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// Why [`Sender::try_send`] did not send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TrySendError {
    /// No room now.
    #[error("the stream's channel is full")]
    Full,
    /// The reader is gone.
    #[error("the stream's reader is gone")]
    Closed,
}

/// The receiving half of [`channel`]: a body.
#[derive(Debug)]
pub struct Receiver {
    rx: tokio::sync::mpsc::Receiver<Item>,
    /// The trailers were given: the body ended.
    ended: bool,
}

impl Body for Receiver {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Item::Data(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(Some(Item::Trailers(t))) => {
                self.ended = true;
                Poll::Ready(Some(Ok(Frame::trailers(t))))
            }
            Poll::Ready(Some(Item::Abort(why))) => Poll::Ready(Some(Err(why.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A received request's body as a `tower::Service` gets it ([`crate::tower::handler`]):
/// whole, or arriving in parts ([`crate::HttpRequest::stream`]).
pub enum RequestBody {
    /// All there (with its trailers).
    Whole(dpumesh_head::whole_body::WholeBody),
    /// Arriving as the client sends it.
    Stream(Boxed),
}

impl std::fmt::Debug for RequestBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Whole(_) => f.write_str("RequestBody::Whole"),
            Self::Stream(_) => f.write_str("RequestBody::Stream"),
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Self::Whole(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|f| f.map_err(|never| match never {}))),
            Self::Stream(b) => b.as_mut().poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Whole(b) => b.is_end_stream(),
            Self::Stream(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            Self::Whole(b) => b.size_hint(),
            Self::Stream(b) => b.size_hint(),
        }
    }
}

/// A body whose first bytes are at hand and whose rest comes as a stream: an answer
/// that arrived in parts (what its opening carried, then the parts).
pub(crate) struct Prefixed {
    first: Option<Bytes>,
    rest: Boxed,
}

impl Prefixed {
    pub(crate) fn new(first: Bytes, rest: Boxed) -> Self {
        Self {
            first: (!first.is_empty()).then_some(first),
            rest,
        }
    }
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        self.rest.as_mut().poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.rest.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn a_channel_body_gives_its_parts_then_its_trailers() {
        let (mut tx, rx) = channel(2);
        tx.try_send("a").unwrap();
        tx.try_send("b").unwrap();
        assert_eq!(tx.try_send("c"), Err(TrySendError::Full));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let collected = rt.block_on(async move {
            let reader = tokio::spawn(rx.collect());
            let mut t = HeaderMap::new();
            t.insert("grpc-status", "0".parse().unwrap());
            tx.finish(t).await.unwrap();
            reader.await.unwrap().unwrap()
        });
        assert_eq!(collected.trailers().unwrap()["grpc-status"], "0");
        assert_eq!(collected.to_bytes(), "ab");
    }

    #[test]
    fn a_gone_reader_refuses_more_and_an_abort_is_an_error() {
        let (mut tx, rx) = channel(1);
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.try_send("x"), Err(TrySendError::Closed));
        let (tx, rx) = channel(1);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let got = rt.block_on(async move {
            tx.abort("the disk failed").await;
            rx.collect().await
        });
        assert_eq!(got.unwrap_err().to_string(), "the disk failed");
    }
}

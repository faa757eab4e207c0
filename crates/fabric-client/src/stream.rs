//! A streamed answer's body as the client reads it: each part the node announces
//! (`Chunk`) names a window of the request's response buffer; the body reads the
//! window when its reader asks for more, and only then hands the window back
//! (`Window`), so the node writes no faster than the reader reads. Dropping the body
//! before its end cancels the stream; the request's slot is freed once the node's
//! last frame says nothing more will be written into it.

use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use bytes::Bytes;
use dpumesh_error::{ErrorKind, ProxyError};
use http_body::{Body, Frame};
use tokio::sync::mpsc;

use crate::client::Slot;

/// What the node said of a stream, in order.
#[derive(Debug)]
pub(crate) enum Piece {
    /// Bytes in window `window`.
    Data { window: u8, len: u32 },
    /// The end, with the trailers' head (wire form; empty: none).
    Last(Vec<u8>),
    /// The node gave the stream up.
    Abort(String),
}

/// What the body asks of its client (done by the client's pump, on its thread).
pub(crate) trait StreamSource {
    /// Bytes of `window` of `slot`'s response buffer.
    fn read_window(&self, slot: &Slot, window: u8, len: u32) -> Result<Bytes, ProxyError>;
    /// Window(s) of stream `xid` on link `qp` were passed on.
    fn window_done(&self, qp: u32, xid: u32);
    /// The reader gave the stream up; `slot` is held until the node's last frame.
    fn cancel(&self, qp: u32, xid: u32, slot: Slot);
}

/// A streamed answer's body.
pub struct StreamBody {
    pub(crate) source: Rc<dyn StreamSource>,
    pub(crate) qp: u32,
    pub(crate) xid: u32,
    /// Its request's slot (the windows are in its response buffer); `None` once the
    /// body ended.
    pub(crate) slot: Option<Slot>,
    pub(crate) rx: mpsc::UnboundedReceiver<Piece>,
}

impl std::fmt::Debug for StreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamBody")
            .field("qp", &self.qp)
            .field("xid", &self.xid)
            .finish()
    }
}

impl Body for StreamBody {
    type Data = Bytes;
    type Error = ProxyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ProxyError>>> {
        if self.slot.is_none() {
            return Poll::Ready(None);
        }
        let piece = match self.rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(piece) => piece,
        };
        match piece {
            Some(Piece::Data { window, len }) => {
                let this = &mut *self;
                let Some(slot) = this.slot.as_ref() else {
                    return Poll::Ready(None);
                };
                let bytes = this.source.read_window(slot, window, len);
                // Read (or failed to be): the window may be written again.
                self.source.window_done(self.qp, self.xid);
                match bytes {
                    Ok(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                    Err(e) => {
                        self.end_early();
                        Poll::Ready(Some(Err(e)))
                    }
                }
            }
            Some(Piece::Last(trailers)) => {
                // Nothing more is written into the buffer: the slot may go.
                self.slot = None;
                if trailers.is_empty() {
                    return Poll::Ready(None);
                }
                match dpumesh_head::wire::decode_response(&trailers) {
                    Ok(head) => {
                        let mut t = head.trailers;
                        dpumesh_head::trailers::keep_allowed(&mut t);
                        if t.is_empty() {
                            Poll::Ready(None)
                        } else {
                            Poll::Ready(Some(Ok(Frame::trailers(t))))
                        }
                    }
                    Err(e) => Poll::Ready(Some(Err(ProxyError::new(
                        ErrorKind::BadResponse,
                        format!("the stream's trailers are malformed: {e}"),
                    )))),
                }
            }
            Some(Piece::Abort(why)) => {
                self.slot = None;
                Poll::Ready(Some(Err(ProxyError::new(
                    ErrorKind::BadResponse,
                    format!("the stream ended early: {why}"),
                ))))
            }
            None => {
                // The link went down (its sender left with it): nothing writes any
                // more.
                self.slot = None;
                Poll::Ready(Some(Err(ProxyError::new(
                    ErrorKind::LinkLost,
                    "the link carrying the stream was lost",
                ))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.slot.is_none()
    }
}

impl StreamBody {
    /// Gives the stream up (the slot waits for the node's last frame).
    fn end_early(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.source.cancel(self.qp, self.xid, slot);
        }
    }
}

impl Drop for StreamBody {
    fn drop(&mut self) {
        self.end_early();
    }
}

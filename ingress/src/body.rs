//! What the ingress writes to a client: a body that crossed the mesh whole (with its
//! trailers), or a streamed answer's body, read part by part as the client takes it
//! (`dpumesh_fabric_client::StreamBody`: a client that stops reading stops the
//! service; one that leaves cancels the stream).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use dpumesh_error::ProxyError;
use dpumesh_fabric_client::StreamBody;
use dpumesh_head::whole_body::WholeBody;
use http_body::{Body, Frame, SizeHint};

/// A client's response body.
#[derive(Debug)]
pub enum ClientBody {
    /// Whole (with its trailers).
    Whole(WholeBody),
    /// Streamed; with the client's share of the ingress's slots, held until the
    /// body is done with (a client that does not read its streams holds no more
    /// slots than its share).
    Stream(StreamBody, Option<crate::fair::Held>),
}

impl From<WholeBody> for ClientBody {
    fn from(b: WholeBody) -> Self {
        Self::Whole(b)
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = ProxyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ProxyError>>> {
        match self.get_mut() {
            ClientBody::Whole(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(|never| match never {}))),
            ClientBody::Stream(s, _) => {
                let polled = Pin::new(s).poll_frame(cx);
                if let Poll::Ready(Some(Err(e))) = &polled {
                    // hyper resets the h2 stream (or closes the HTTP/1.1 connection
                    // without the last chunk): the client sees the body incomplete.
                    tracing::debug!(error = %e, "a streamed answer ended early");
                }
                polled
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ClientBody::Whole(b) => b.is_end_stream(),
            ClientBody::Stream(s, _) => s.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ClientBody::Whole(b) => b.size_hint(),
            // Its length is not known: chunked on HTTP/1.1.
            ClientBody::Stream(..) => SizeHint::default(),
        }
    }
}

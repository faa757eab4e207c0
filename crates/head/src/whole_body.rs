//! A body that crosses the mesh whole, with its trailers: what the ingress writes to
//! a client (the bytes a service or the mesh answered with, then a gRPC status), and
//! what the host library hands a `tower::Service` (a request's body and trailers).
//! `http_body_util::Full` cannot carry trailers.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

/// A whole body and its trailers, yielded as one data frame and one trailers frame.
#[derive(Debug, Default)]
pub struct WholeBody {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl WholeBody {
    /// `data` (nothing if empty), then `trailers` (nothing if empty).
    pub fn new(data: Bytes, trailers: HeaderMap) -> Self {
        Self {
            data: (!data.is_empty()).then_some(data),
            trailers: (!trailers.is_empty()).then_some(trailers),
        }
    }

    /// Just bytes.
    pub fn bytes(data: impl Into<Bytes>) -> Self {
        Self::new(data.into(), HeaderMap::new())
    }

    /// Its bytes and trailers (what was not read yet).
    pub fn into_parts(self) -> (Bytes, HeaderMap) {
        (
            self.data.unwrap_or_default(),
            self.trailers.unwrap_or_default(),
        )
    }
}

impl Body for WholeBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let frame = match this.data.take() {
            Some(data) => Some(Frame::data(data)),
            None => this.trailers.take().map(Frame::trailers),
        };
        Poll::Ready(frame.map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let len = self.data.as_ref().map_or(0, |d| d.len() as u64);
        // With trailers the length stays open: an HTTP/1.1 writer that is given an
        // exact length sends `content-length` and no trailers; chunked carries them.
        if self.trailers.is_some() {
            let mut hint = SizeHint::new();
            hint.set_lower(len);
            hint
        } else {
            SizeHint::with_exact(len)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use http_body_util::BodyExt;

    use super::*;

    /// A whole body never waits: one poll finishes what reads it.
    fn poll_now<F: Future>(f: F) -> F::Output {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match std::pin::pin!(f).poll(&mut cx) {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("a whole body made its reader wait"),
        }
    }

    #[test]
    fn data_then_trailers_and_an_open_length_only_with_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let body = WholeBody::new(Bytes::from_static(b"hi"), trailers.clone());
        assert_eq!(body.size_hint().exact(), None);
        let collected = poll_now(body.collect()).unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), "hi");

        let plain = WholeBody::bytes("abc");
        assert_eq!(plain.size_hint().exact(), Some(3));
        let empty = WholeBody::default();
        assert!(empty.is_end_stream());
        assert_eq!(empty.size_hint().exact(), Some(0));
    }
}

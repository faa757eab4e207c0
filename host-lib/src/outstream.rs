//! Streamed answers leaving a pod: each stream's body is polled for parts while the
//! stream has room in its window ([`STREAM_WINDOW_PARTS`] parts the node has not
//! handed back), and each part becomes one stream descriptor. Pure logic: the
//! transport sends the parts it returns and tells it what the node handed back or
//! cancelled.

use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use dpumesh_dpa::Descriptor;
use foldhash::HashMap;
use http::HeaderMap;
use http_body::Body;

use crate::body::{BoxError, STREAM_WINDOW_PARTS};

/// The most bytes one part carries (the node's stream windows take parts of up to
/// this size whole).
pub(crate) const PART_MAX: usize = dpumesh_dpa::frame::STREAM_WINDOW as usize;

/// A part to send.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Part {
    /// More of the body.
    Data(Bytes),
    /// The end, with trailers (empty: none).
    End(HeaderMap),
    /// The body failed: the client sees it incomplete.
    Abort(String),
}

type Boxed = Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send>>;

struct OutStream {
    /// The request it answers (where its parts go).
    request: Descriptor,
    body: Boxed,
    /// Parts with a body the node has not handed back.
    in_flight: usize,
}

/// A stream's key: its request's ids and the lane it came on (each of the node's
/// shards numbers its exchanges on its own: the lane tells two apart).
pub(crate) type Key = (u32, u32, u8);

/// The streams a pod is sending, by [`Key`].
#[derive(Default)]
pub(crate) struct OutStreams {
    streams: HashMap<Key, OutStream>,
}

impl OutStreams {
    /// A stream opened: its opening (sent by the caller) carried a body part when
    /// `first_part` says so.
    pub fn open(&mut self, request: Descriptor, body: Boxed, first_part: bool) {
        self.streams.insert(
            (request.req_id, request.step_id, request.lane),
            OutStream {
                request,
                body,
                in_flight: usize::from(first_part),
            },
        );
    }

    /// The node handed a part of stream `key` back.
    pub fn sent(&mut self, key: Key) {
        if let Some(s) = self.streams.get_mut(&key) {
            s.in_flight = s.in_flight.saturating_sub(1);
        }
    }

    /// The stream's receiver gave it up: its body is dropped (its producer sees the
    /// channel close). Whether it was open.
    pub fn cancel(&mut self, key: Key) -> bool {
        self.streams.remove(&key).is_some()
    }

    /// Every stream ends (the node went away).
    pub fn clear(&mut self) {
        self.streams.clear();
    }

    /// Streams open.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Polls every stream with room for parts; appends `(request, part)` to `out`.
    /// A stream that ended (or aborted) leaves.
    pub fn poll(&mut self, waker: &Waker, out: &mut Vec<(Descriptor, Part)>) {
        let mut cx = Context::from_waker(waker);
        self.streams.retain(|_, s| {
            while s.in_flight < STREAM_WINDOW_PARTS {
                match s.body.as_mut().poll_frame(&mut cx) {
                    Poll::Pending => return true,
                    Poll::Ready(None) => {
                        out.push((s.request, Part::End(HeaderMap::new())));
                        return false;
                    }
                    Poll::Ready(Some(Err(e))) => {
                        out.push((s.request, Part::Abort(e.to_string())));
                        return false;
                    }
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(mut data) => {
                            while !data.is_empty() {
                                let piece = data.split_to(data.len().min(PART_MAX));
                                s.in_flight += 1;
                                out.push((s.request, Part::Data(piece)));
                            }
                        }
                        Err(frame) => {
                            let trailers = frame.into_trailers().unwrap_or_default();
                            out.push((s.request, Part::End(trailers)));
                            return false;
                        }
                    },
                }
            }
            true
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body;
    use dpumesh_dpa::{Case, Destination};

    fn request(req: u32) -> Descriptor {
        Descriptor::request(Case::ExternalToHost, req, 1, 0, Destination::Pod(3))
    }

    fn waker() -> Waker {
        Waker::noop().clone()
    }

    #[test]
    fn a_stream_sends_no_more_than_its_window_until_parts_come_back() {
        let (mut tx, rx) = body::channel(64);
        for i in 0..10 {
            tx.try_send(format!("part {i}")).unwrap();
        }
        let mut streams = OutStreams::default();
        streams.open(request(7), Box::pin(rx), false);
        let mut out = Vec::new();
        streams.poll(&waker(), &mut out);
        assert_eq!(out.len(), STREAM_WINDOW_PARTS);
        out.clear();
        streams.poll(&waker(), &mut out);
        assert!(out.is_empty(), "a full window sends nothing");
        streams.sent((7, 1, 0));
        streams.sent((7, 1, 0));
        streams.poll(&waker(), &mut out);
        assert_eq!(
            out.iter().map(|(_, p)| p).collect::<Vec<_>>(),
            vec![
                &Part::Data(Bytes::from("part 4")),
                &Part::Data(Bytes::from("part 5"))
            ]
        );
    }

    #[test]
    fn a_large_part_is_cut_and_the_end_carries_the_trailers() {
        let (mut tx, rx) = body::channel(4);
        tx.try_send(vec![1u8; PART_MAX + 10]).unwrap();
        let mut streams = OutStreams::default();
        streams.open(request(8), Box::pin(rx), false);
        let mut out = Vec::new();
        streams.poll(&waker(), &mut out);
        let lens: Vec<usize> = out
            .iter()
            .map(|(_, p)| match p {
                Part::Data(b) => b.len(),
                _ => 0,
            })
            .collect();
        assert_eq!(lens, vec![PART_MAX, 10]);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let mut t = HeaderMap::new();
        t.insert("grpc-status", "0".parse().unwrap());
        rt.block_on(tx.finish(t.clone())).unwrap();
        out.clear();
        streams.sent((8, 1, 0));
        streams.sent((8, 1, 0));
        streams.poll(&waker(), &mut out);
        assert_eq!(out.pop().map(|(_, p)| p), Some(Part::End(t)));
        assert_eq!(streams.len(), 0, "an ended stream leaves");
    }

    #[test]
    fn a_failed_body_aborts_and_a_cancelled_stream_drops_its_producer() {
        let (tx, rx) = body::channel(1);
        let mut streams = OutStreams::default();
        streams.open(request(9), Box::pin(rx), true);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(tx.abort("disk failed"));
        let mut out = Vec::new();
        streams.poll(&waker(), &mut out);
        assert_eq!(out, vec![(request(9), Part::Abort("disk failed".into()))]);

        let (tx, rx) = body::channel(1);
        streams.open(request(10), Box::pin(rx), false);
        assert!(streams.cancel((10, 1, 0)));
        assert!(tx.is_closed(), "the producer hears the client left");
    }
}

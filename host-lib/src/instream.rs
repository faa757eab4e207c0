//! Bodies that arrive in parts: requests' (uploads of any size, gRPC client streams)
//! and the answers to the pod's own calls (downloads, server-sent events, gRPC server
//! streams). The node delivers the head as the stream's opening, then the body part
//! by part, then its end (with the trailers) or an abort.
//!
//! A reader that takes bodies as they come (for requests, the loop's
//! `stream_requests` says which; for answers, a call made with
//! [`crate::AnswerBody::Streamed`]) gets the body as an `http_body::Body`: each part
//! it takes is told to the node (`Taken`), which delivers no more than a few parts
//! ahead of the reader, so a reader that is slow slows the sender and nothing grows
//! in the pod. Dropping the body before its end tells the node to stop (`Stop`).
//! Other bodies are collected whole first (up to a limit, past it the request is
//! answered 413 or the call fails), so code written for whole bodies never sees half
//! of one.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use dpumesh_dpa::{Descriptor, StreamPart};
use foldhash::{HashMap, HashMapExt};
use http::HeaderMap;
use http_body::{Body, Frame};
use parking_lot::Mutex;

use crate::body::BoxError;
use crate::http::{HttpRequest, HttpResponse};

/// A stream's key: the ids its opening came with, and its lane (each of the node's
/// shards numbers its exchanges on its own).
pub(crate) type Key = (u32, u32, u8);

/// What a streamed body and the transport share.
#[derive(Debug, Default)]
struct Shared {
    parts: VecDeque<Bytes>,
    /// How the body ended, once the node said (trailers, or why it was aborted).
    end: Option<Result<HeaderMap, String>>,
    /// The reader waiting for a part.
    reader: Option<std::task::Waker>,
}

/// What bodies tell the transport: parts taken, readers gone.
#[derive(Debug, Default)]
struct News {
    taken: Vec<Key>,
    dropped: Vec<Key>,
}

/// A body arriving in parts, as its reader reads it.
pub(crate) struct RequestStream {
    key: Key,
    shared: Arc<Mutex<Shared>>,
    news: Arc<Mutex<News>>,
    wake: std::task::Waker,
    done: bool,
}

impl Body for RequestStream {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let mut shared = self.shared.lock();
        if let Some(part) = shared.parts.pop_front() {
            drop(shared);
            self.news.lock().taken.push(self.key);
            self.wake.wake_by_ref();
            return Poll::Ready(Some(Ok(Frame::data(part))));
        }
        match shared.end.take() {
            Some(Ok(trailers)) => {
                drop(shared);
                self.done = true;
                if trailers.is_empty() {
                    Poll::Ready(None)
                } else {
                    Poll::Ready(Some(Ok(Frame::trailers(trailers))))
                }
            }
            Some(Err(why)) => {
                drop(shared);
                self.done = true;
                Poll::Ready(Some(Err(why.into())))
            }
            None => {
                shared.reader = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            self.news.lock().dropped.push(self.key);
            self.wake.wake_by_ref();
        }
    }
}

enum Mode {
    /// Read by its reader as it comes.
    Stream(Arc<Mutex<Shared>>),
    /// Collected whole for code that takes whole bodies.
    Collect { whole: Whole, body: BytesMut },
}

/// What a collected body completes: a request for a handler, or the answer to a
/// call.
pub(crate) enum Whole {
    Request(Box<HttpRequest>),
    Answer(Box<HttpResponse>),
}

impl Whole {
    fn finish(&mut self, body: BytesMut, trailers: HeaderMap) {
        match self {
            Whole::Request(r) => {
                r.body = body.freeze();
                r.trailers = trailers;
            }
            Whole::Answer(a) => {
                // After what the opening brought.
                let mut all = BytesMut::with_capacity(a.body.len() + body.len());
                all.extend_from_slice(&a.body);
                all.extend_from_slice(&body);
                a.body = all.freeze();
                a.trailers = trailers;
            }
        }
    }
}

struct Entry {
    opening: Descriptor,
    mode: Mode,
}

/// What a part means for the transport.
pub(crate) enum Step {
    /// Nothing more to do.
    Nothing,
    /// Tell the node the part was taken (collected: taken at once).
    Taken(Descriptor),
    /// A collected body is whole: the handler (or the caller) gets it.
    Whole(Descriptor, Whole),
    /// A collected body grew past the limit: the request is answered 413 (the call
    /// fails), the rest refused.
    TooLarge(Descriptor),
    /// A collected body was aborted: the request is answered 400 (the call fails).
    Aborted(Descriptor, String),
}

/// The bodies arriving in parts (of one direction: requests, or answers), by their
/// opening's ids.
pub(crate) struct InStreams {
    open: HashMap<Key, Entry>,
    news: Arc<Mutex<News>>,
    wake: std::task::Waker,
    /// The most a collected body may hold.
    limit: usize,
    /// What an aborted body's reader is told.
    ended_early: &'static str,
}

/// What a reader of an aborted request body is told.
pub(crate) const REQUEST_ENDED_EARLY: &str =
    "the request body ended early (the client left or failed)";
/// What a reader of an aborted answer is told.
pub(crate) const ANSWER_ENDED_EARLY: &str =
    "the answer's body ended early (the service gave it up, failed or left)";

impl InStreams {
    /// Bodies that wake `wake` (the transport's wait) when read or dropped; an
    /// aborted one fails with `ended_early`.
    pub fn new(wake: std::task::Waker, limit: usize, ended_early: &'static str) -> Self {
        Self {
            open: HashMap::new(),
            news: Arc::default(),
            wake,
            limit,
            ended_early,
        }
    }

    /// Sets the most a collected body may hold.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// The most a collected body may hold.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Streams open.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// A body opened, for a reader that reads it as it comes: its body.
    pub fn stream(&mut self, opening: Descriptor) -> RequestStream {
        let key = (opening.req_id, opening.step_id, opening.lane);
        let shared = Arc::new(Mutex::new(Shared::default()));
        self.open.insert(
            key,
            Entry {
                opening,
                mode: Mode::Stream(shared.clone()),
            },
        );
        RequestStream {
            key,
            shared,
            news: self.news.clone(),
            wake: self.wake.clone(),
            done: false,
        }
    }

    /// A body opened, for code that takes whole bodies: `whole` gets it.
    pub fn collect(&mut self, opening: Descriptor, whole: Whole) {
        let key = (opening.req_id, opening.step_id, opening.lane);
        self.open.insert(
            key,
            Entry {
                opening,
                mode: Mode::Collect {
                    whole,
                    body: BytesMut::new(),
                },
            },
        );
    }

    /// A part of stream `key` came: `body` its bytes, `trailers` (for the end)
    /// decoded by the caller.
    pub fn part(
        &mut self,
        key: Key,
        part: StreamPart,
        body: Vec<u8>,
        trailers: Result<HeaderMap, String>,
    ) -> Step {
        let Some(entry) = self.open.get_mut(&key) else {
            // Its reader left (the node heard `Stop`), or it never opened.
            return Step::Nothing;
        };
        let opening = entry.opening;
        match (&mut entry.mode, part) {
            (Mode::Stream(shared), StreamPart::Data) => {
                let mut s = shared.lock();
                s.parts.push_back(Bytes::from(body));
                if let Some(w) = s.reader.take() {
                    w.wake();
                }
                Step::Nothing
            }
            (Mode::Stream(shared), StreamPart::End | StreamPart::Abort) => {
                let mut s = shared.lock();
                s.end = Some(match part {
                    StreamPart::End => trailers,
                    _ => Err(self.ended_early.into()),
                });
                if let Some(w) = s.reader.take() {
                    w.wake();
                }
                drop(s);
                self.open.remove(&key);
                Step::Nothing
            }
            (
                Mode::Collect {
                    body: collected, ..
                },
                StreamPart::Data,
            ) => {
                if collected.len() + body.len() > self.limit {
                    self.open.remove(&key);
                    return Step::TooLarge(opening);
                }
                collected.extend_from_slice(&body);
                Step::Taken(opening)
            }
            (Mode::Collect { .. }, StreamPart::End) => {
                let Some(Entry {
                    mode: Mode::Collect { mut whole, body },
                    ..
                }) = self.open.remove(&key)
                else {
                    return Step::Nothing;
                };
                match trailers {
                    Ok(t) => {
                        whole.finish(body, t);
                        Step::Whole(opening, whole)
                    }
                    Err(why) => Step::Aborted(opening, why),
                }
            }
            (Mode::Collect { .. }, StreamPart::Abort) => {
                self.open.remove(&key);
                Step::Aborted(opening, self.ended_early.into())
            }
            // An opening or an acknowledgement is no part of a body coming in.
            (_, StreamPart::Open | StreamPart::Taken | StreamPart::Stop) => Step::Nothing,
        }
    }

    /// What the readers did since the last look: for each part taken, the opening
    /// to acknowledge it on; for each reader gone, the opening to say `Stop` on.
    pub fn news(&mut self, taken: &mut Vec<Descriptor>, stopped: &mut Vec<Descriptor>) {
        let news = std::mem::take(&mut *self.news.lock());
        for key in news.taken {
            if let Some(e) = self.open.get(&key) {
                taken.push(e.opening);
            }
        }
        for key in news.dropped {
            if let Some(e) = self.open.remove(&key) {
                stopped.push(e.opening);
            }
        }
    }

    /// The node went away: every body fails.
    pub fn clear(&mut self) {
        for (_, e) in self.open.drain() {
            if let Mode::Stream(shared) = e.mode {
                let mut s = shared.lock();
                s.end = Some(Err("the node went away mid-body".into()));
                if let Some(w) = s.reader.take() {
                    w.wake();
                }
            }
        }
        *self.news.lock() = News::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dpumesh_dpa::{Case, Destination};
    use http_body_util::BodyExt;

    fn opening() -> Descriptor {
        Descriptor::request(Case::ExternalToHost, 7, 1, 0, Destination::Pod(3))
    }

    #[test]
    fn a_streamed_body_gives_its_parts_in_order_and_each_taken_is_told() {
        let mut streams = InStreams::new(
            std::task::Waker::noop().clone(),
            1 << 20,
            REQUEST_ENDED_EARLY,
        );
        let mut body = streams.stream(opening());
        let key = (7, 1, 0);
        for p in ["ab", "cd"] {
            let step = streams.part(key, StreamPart::Data, p.into(), Ok(HeaderMap::new()));
            assert!(matches!(step, Step::Nothing));
        }
        let mut t = HeaderMap::new();
        t.insert("x-sum", "9".parse().unwrap());
        streams.part(key, StreamPart::End, Vec::new(), Ok(t));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let collected = rt.block_on(async { (&mut body).collect().await.unwrap() });
        assert_eq!(collected.trailers().unwrap()["x-sum"], "9");
        assert_eq!(&collected.to_bytes()[..], b"abcd");
        let (mut taken, mut stopped) = (Vec::new(), Vec::new());
        streams.news(&mut taken, &mut stopped);
        // The end removed the stream: its acknowledgements are not needed.
        assert!(taken.is_empty() && stopped.is_empty());
        assert_eq!(streams.len(), 0);
    }

    #[test]
    fn a_reader_that_leaves_early_stops_the_stream() {
        let mut streams = InStreams::new(
            std::task::Waker::noop().clone(),
            1 << 20,
            REQUEST_ENDED_EARLY,
        );
        let body = streams.stream(opening());
        streams.part(
            (7, 1, 0),
            StreamPart::Data,
            b"x".to_vec(),
            Ok(HeaderMap::new()),
        );
        drop(body);
        let (mut taken, mut stopped) = (Vec::new(), Vec::new());
        streams.news(&mut taken, &mut stopped);
        assert_eq!(stopped.len(), 1);
        assert_eq!(streams.len(), 0);
        // What comes after is nobody's.
        let late = streams.part(
            (7, 1, 0),
            StreamPart::Data,
            b"y".to_vec(),
            Ok(HeaderMap::new()),
        );
        assert!(matches!(late, Step::Nothing));
    }

    #[test]
    fn a_collected_body_comes_whole_or_past_its_limit_is_refused() {
        let mut streams = InStreams::new(std::task::Waker::noop().clone(), 4, REQUEST_ENDED_EARLY);
        streams.collect(
            opening(),
            Whole::Request(Box::new(HttpRequest::post("/up", ""))),
        );
        let ok = Ok(HeaderMap::new());
        assert!(matches!(
            streams.part((7, 1, 0), StreamPart::Data, b"ab".to_vec(), ok.clone()),
            Step::Taken(_)
        ));
        match streams.part((7, 1, 0), StreamPart::End, Vec::new(), ok.clone()) {
            Step::Whole(_, Whole::Request(r)) => assert_eq!(&r.body[..], b"ab"),
            _ => panic!("the body is whole"),
        }
        streams.collect(
            opening(),
            Whole::Request(Box::new(HttpRequest::post("/up", ""))),
        );
        streams.part((7, 1, 0), StreamPart::Data, b"abc".to_vec(), ok.clone());
        assert!(matches!(
            streams.part((7, 1, 0), StreamPart::Data, b"de".to_vec(), ok.clone()),
            Step::TooLarge(_)
        ));
        streams.collect(
            opening(),
            Whole::Request(Box::new(HttpRequest::post("/up", ""))),
        );
        assert!(matches!(
            streams.part((7, 1, 0), StreamPart::Abort, Vec::new(), ok),
            Step::Aborted(..)
        ));
    }

    #[test]
    fn a_collected_answer_comes_whole_after_what_its_opening_carried() {
        let mut streams = InStreams::new(std::task::Waker::noop().clone(), 6, ANSWER_ENDED_EARLY);
        let ok = Ok(HeaderMap::new());
        let answer = || Whole::Answer(Box::new(HttpResponse::ok("ab")));
        streams.collect(opening(), answer());
        for part in ["cd", "ef"] {
            assert!(matches!(
                streams.part((7, 1, 0), StreamPart::Data, part.into(), ok.clone()),
                Step::Taken(_)
            ));
        }
        let mut t = HeaderMap::new();
        t.insert("grpc-status", "0".parse().unwrap());
        match streams.part((7, 1, 0), StreamPart::End, Vec::new(), Ok(t)) {
            Step::Whole(_, Whole::Answer(a)) => {
                assert_eq!(&a.body[..], b"abcdef");
                assert_eq!(a.trailers["grpc-status"], "0");
            }
            _ => panic!("the answer is whole"),
        }
        // The limit counts the parts; an abort says the service gave the body up.
        streams.collect(opening(), answer());
        streams.part((7, 1, 0), StreamPart::Data, b"12345".to_vec(), ok.clone());
        assert!(matches!(
            streams.part((7, 1, 0), StreamPart::Data, b"67".to_vec(), ok.clone()),
            Step::TooLarge(_)
        ));
        streams.collect(opening(), answer());
        match streams.part((7, 1, 0), StreamPart::Abort, Vec::new(), ok) {
            Step::Aborted(_, why) => assert_eq!(why, ANSWER_ENDED_EARLY),
            _ => panic!("an abort fails the answer"),
        }
    }
}

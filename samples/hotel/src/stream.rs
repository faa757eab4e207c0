//! The frontend's streamed answers: `/download?bytes=N` (N bytes made as the client
//! reads them, with no thread: the body is a generator the data path polls when its
//! window has room) and `/events?count=N&every_ms=M` (server-sent events from a
//! producer thread, ended with a trailer); and streamed requests: `/upload` (the
//! body read as it arrives, answered with its length and CRC-32) and `/echo-stream`
//! (the body sent back as it arrives: both ways at once).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use dpumesh_host::{ExecutionContext, HttpResponse, body};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

/// Bytes per part of a download: a multiple of the pattern's period, so every part
/// is the same bytes and the body is made once, not per request.
const PART: usize = 251 * 1044;

/// Byte `i` of every download: a pattern a client can check anywhere in the body.
pub fn pattern(i: u64) -> u8 {
    (i % 251) as u8
}

/// One part of the pattern, made once; each part of a download is a slice of it (no
/// copy: the transport copies it into a slot).
fn part() -> &'static Bytes {
    static PART_BYTES: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
    PART_BYTES.get_or_init(|| (0..PART as u64).map(pattern).collect::<Vec<u8>>().into())
}

/// `len` bytes of [`pattern`], a part at a time.
struct Download {
    at: u64,
    len: u64,
}

impl Body for Download {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.at >= self.len {
            return Poll::Ready(None);
        }
        let n = (self.len - self.at).min(PART as u64);
        self.at += n;
        Poll::Ready(Some(Ok(Frame::data(part().slice(..n as usize)))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.len - self.at)
    }
}

/// A download of `len` bytes.
pub fn download(len: u64) -> HttpResponse {
    HttpResponse::streaming(200, Download { at: 0, len })
        .header("content-type", "application/octet-stream")
}

/// `count` server-sent events, one every `every`, then a trailer counting them.
pub fn events(count: u32, every: Duration) -> HttpResponse {
    let (mut tx, rx) = body::channel(4);
    std::thread::spawn(move || {
        for i in 0..count {
            if i > 0 {
                std::thread::sleep(every);
            }
            if tx
                .blocking_send(format!("id: {i}\ndata: event {i}\n\n"))
                .is_err()
            {
                return; // the client left: the stream was cancelled
            }
        }
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-events", count.into());
        let _ = tx.blocking_finish(trailers);
    });
    HttpResponse::streaming(200, rx)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
}

/// `/upload`: reads the body as it arrives (a part at a time: nothing of it is kept)
/// and answers its length, its CRC-32 and the client's `x-checksum` trailer, if any;
/// with `crc=0` only its length (what a benchmark's sink pays: nothing per byte).
pub fn upload(ctx: &mut ExecutionContext, checksum: bool) {
    let request = ctx.take_request();
    let stream = request.stream.as_ref().and_then(|s| s.take());
    let whole = request.body;
    ctx.respond_future(move |_| async move {
        let mut len = whole.len() as u64;
        let mut crc = crc32fast::Hasher::new();
        crc.update(&whole);
        let mut trailer = None;
        if let Some(mut body) = stream {
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| format!("the upload failed: {e}"))?;
                match frame.into_data() {
                    Ok(data) => {
                        len += data.len() as u64;
                        if checksum {
                            crc.update(&data);
                        }
                    }
                    Err(frame) => {
                        trailer = frame.into_trailers().ok().and_then(|t| {
                            t.get("x-checksum")
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned)
                        });
                    }
                }
            }
        }
        let text = if checksum {
            format!("bytes={len} crc32={:08x}\n", crc.finalize())
        } else {
            format!("bytes={len}\n")
        };
        let mut answer = HttpResponse::ok(text);
        if let Some(t) = trailer {
            answer = answer.header("x-trailer-checksum", &t);
        }
        Ok::<_, String>(answer)
    });
}

/// `/echo-stream`: the body sent back as it arrives.
pub fn echo_stream(ctx: &mut ExecutionContext) {
    let request = ctx.take_request();
    let stream = request.stream.as_ref().and_then(|s| s.take());
    let whole = request.body;
    ctx.respond(move |_| {
        Ok::<_, String>(match stream {
            Some(body) => HttpResponse::streaming(200, body),
            None => HttpResponse::ok(whole),
        })
    });
}

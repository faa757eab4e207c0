//! A client's request body streamed to the service as it comes
//! ([`dpumesh_fabric_client::Upload`]): each part is copied into a window of the
//! request's buffer and announced; a window is taken from the client only when the
//! node handed one back, so a slow service slows the client (HTTP/2 flow control,
//! TCP) rather than growing the ingress. What is ready goes on in whole windows; a
//! pause sends what came. The body ends with the client's trailers (those
//! `trailers::allowed` lets pass), and is aborted when the client fails or leaves,
//! or sends nothing for `idle`; the node's cancel (the service answered, or the
//! request was refused) stops the reading.

use std::time::Duration;

use bytes::Bytes;
use dpumesh_fabric_client::{Upload, UploadError};
use dpumesh_head::wire::{self, ResponseHead};
use http_body_util::BodyExt;
use hyper::body::Incoming;

/// What is read and dropped of a body nobody wants any more (the service answered,
/// or the request failed, before it ended), and for how long: enough that a client
/// still sending its body reads the answer (a connection closed with unread bytes is
/// reset, and the answer with it), no more.
const DRAIN_BYTES: usize = 16 << 20;
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Sends the rest of `body` (after `carry`, a frame read ahead that did not fit the
/// first window) through `upload`; `share` (the client's slot share) is held while
/// the body is sent, and what the service no longer wants of it is drained after.
pub(crate) async fn send_body<S>(
    upload: Upload,
    body: Incoming,
    carry: Option<Bytes>,
    idle: Duration,
    share: S,
) {
    let rest = send(upload, body, carry, idle).await;
    drop(share);
    if let Some(body) = rest {
        drain(body).await;
    }
}

/// [`send_body`]'s sending; the body when what is left of it is to be drained.
async fn send(
    mut upload: Upload,
    mut body: Incoming,
    carry: Option<Bytes>,
    idle: Duration,
) -> Option<Incoming> {
    if let Some(data) = carry
        && upload.write(&data).await.is_err()
    {
        return Some(body);
    }
    let mut trailers = http::HeaderMap::new();
    loop {
        let frame = match crate::futures_now(body.frame()) {
            Some(frame) => frame,
            None => {
                // The client paused: what came goes on now.
                if upload.flush().is_err() {
                    return Some(body);
                }
                tokio::select! {
                    frame = tokio::time::timeout(idle, body.frame()) => match frame {
                        Ok(frame) => frame,
                        Err(_) => {
                            let why = format!("the client sent nothing of its body for {} ms", idle.as_millis());
                            tracing::debug!(why, "request body aborted");
                            upload.abort(&why);
                            return None;
                        }
                    },
                    // The node wants no more: nothing more is sent on.
                    () = upload.cancelled_or_lost() => return Some(body),
                }
            }
        };
        let frame = match frame {
            None => break,
            Some(Ok(frame)) => frame,
            Some(Err(e)) => {
                upload.abort(&format!("the client's body failed: {e}"));
                return None;
            }
        };
        match frame.into_data() {
            Ok(data) => match upload.write(&data).await {
                Ok(()) => {}
                Err(UploadError::Cancelled) => return Some(body),
                Err(UploadError::Failed(e)) => {
                    tracing::debug!(error = %e, "request body not sent");
                    return Some(body);
                }
            },
            Err(frame) => {
                if let Ok(mut fields) = frame.into_trailers() {
                    // Sent after the head, so never seen by the chain: only fields
                    // that decide nothing pass.
                    dpumesh_head::trailers::keep_allowed(&mut fields);
                    trailers.extend(fields);
                }
            }
        }
    }
    let tail = if trailers.is_empty() {
        Vec::new()
    } else {
        // The trailers ride as a head's trailer section, as a streamed answer's do.
        let head = ResponseHead {
            status: 200,
            headers: http::HeaderMap::new(),
            trailers,
        };
        match wire::encode_response(&head) {
            Ok(b) => b,
            Err(e) => {
                upload.abort(&format!("the request's trailers cannot be carried: {e}"));
                return None;
            }
        }
    };
    if let Err(e) = upload.finish(tail) {
        tracing::debug!(error = %e, "request body's end not sent");
    }
    None
}

/// Reads and drops what the client still sends of a body nobody wants, up to
/// [`DRAIN_BYTES`] and [`DRAIN_TIME`]: the answer, written meanwhile, reaches a client
/// that sends its whole body before it reads (then hyper closes the connection).
pub(crate) async fn drain(mut body: Incoming) {
    let mut left = DRAIN_BYTES;
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        while let Some(Ok(frame)) = body.frame().await {
            let n = frame.data_ref().map_or(0, |d| d.len());
            if n >= left {
                return;
            }
            left -= n;
        }
    })
    .await;
}

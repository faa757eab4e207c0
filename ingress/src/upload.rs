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

/// Sends the rest of `body` (after `carry`, a frame read ahead that did not fit the
/// first window) through `upload`.
pub(crate) async fn send_body(
    mut upload: Upload,
    mut body: Incoming,
    carry: Option<Bytes>,
    idle: Duration,
) {
    if let Some(data) = carry
        && upload.write(&data).await.is_err()
    {
        return;
    }
    let mut trailers = http::HeaderMap::new();
    loop {
        let frame = match crate::futures_now(body.frame()) {
            Some(frame) => frame,
            None => {
                // The client paused: what came goes on now.
                if upload.flush().is_err() {
                    return;
                }
                tokio::select! {
                    frame = tokio::time::timeout(idle, body.frame()) => match frame {
                        Ok(frame) => frame,
                        Err(_) => {
                            let why = format!("the client sent nothing of its body for {} ms", idle.as_millis());
                            tracing::debug!(why, "request body aborted");
                            upload.abort(&why);
                            return;
                        }
                    },
                    // The node wants no more: nothing more is read from the client.
                    () = upload.cancelled_or_lost() => return,
                }
            }
        };
        let frame = match frame {
            None => break,
            Some(Ok(frame)) => frame,
            Some(Err(e)) => {
                upload.abort(&format!("the client's body failed: {e}"));
                return;
            }
        };
        match frame.into_data() {
            Ok(data) => match upload.write(&data).await {
                Ok(()) => {}
                Err(UploadError::Cancelled) => return,
                Err(UploadError::Failed(e)) => {
                    tracing::debug!(error = %e, "request body not sent");
                    return;
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
                return;
            }
        }
    };
    if let Err(e) = upload.finish(tail) {
        tracing::debug!(error = %e, "request body's end not sent");
    }
}

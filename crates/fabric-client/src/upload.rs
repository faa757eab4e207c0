//! A request body sent as it comes (an upload of any size, a gRPC client stream):
//! each part is copied into a window of the request's buffer and announced
//! (`UpChunk`); the node reads it into the service's memory when the service has room
//! for it and hands the window back (`UpWindow`). A sender with no free window waits,
//! so the client is read no faster than the service takes its body, and nothing grows
//! on the way. The node's `UpCancel` (the service answered, left, or was never
//! reached) stops the sender.
//!
//! The request's slot is held until the node is done with its buffer: after the end
//! (or an abort), until every window announced came back.

use std::rc::Rc;

use dpumesh_dpa::frame::{Chunk, ChunkEnd, Message, StreamWindows};
use dpumesh_error::{ErrorKind, ProxyError};
use tokio::sync::mpsc;

use crate::client::Slot;

/// What the node said of an upload.
#[derive(Debug)]
pub(crate) enum UpNews {
    /// It read this many windows: they may be written again.
    Window(u8),
    /// It wants no more of the body (and reads nothing more).
    Cancel,
}

/// What an upload asks of its client (on the client's thread).
pub(crate) trait UpSink {
    /// Writes `bytes` at `at` in `slot`'s request buffer.
    fn write_at(&self, slot: &Slot, at: u64, bytes: &[u8]) -> Result<(), ProxyError>;
    /// Posts a frame on link `qp`.
    fn send_up(&self, qp: u32, message: Message) -> Result<(), ProxyError>;
    /// The upload of request `xid` ended; `slot` is held until `busy` windows come
    /// back (or the node cancels, or the link goes).
    fn release(&self, qp: u32, xid: u32, slot: Slot, busy: u8);
}

/// Why an upload stopped before its end.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UploadError {
    /// The node wants no more of the body: the request was answered (or refused)
    /// already. Not the client's fault, and nothing to tell it.
    #[error("the service wants no more of the request body")]
    Cancelled,
    /// The link went, or the buffer could not be written.
    #[error(transparent)]
    Failed(#[from] ProxyError),
}

/// A request body being sent in parts ([`crate::Client::call_streamed`]).
pub struct Upload {
    sink: Rc<dyn UpSink>,
    qp: u32,
    xid: u32,
    /// `None` once ended.
    slot: Option<Slot>,
    windows: StreamWindows,
    /// The window being filled (or to fill next), and its bytes so far (`None`: not
    /// taken yet).
    next: u8,
    filling: Option<u32>,
    /// Windows announced and not handed back.
    busy: u8,
    news: mpsc::UnboundedReceiver<UpNews>,
    cancelled: bool,
}

impl std::fmt::Debug for Upload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upload")
            .field("xid", &self.xid)
            .field("busy", &self.busy)
            .finish_non_exhaustive()
    }
}

impl Upload {
    pub(crate) fn new(
        sink: Rc<dyn UpSink>,
        qp: u32,
        slot: Slot,
        windows: StreamWindows,
        first: u32,
        news: mpsc::UnboundedReceiver<UpNews>,
    ) -> Self {
        Self {
            sink,
            qp,
            xid: slot.index(),
            slot: Some(slot),
            windows,
            next: 0,
            filling: (first > 0).then_some(first.min(windows.size)),
            busy: 0,
            news,
            cancelled: false,
        }
    }

    /// Sends `data` (announcing each window it fills), waiting for windows while
    /// all are with the node.
    pub async fn write(&mut self, mut data: &[u8]) -> Result<(), UploadError> {
        self.take_news();
        if self.cancelled {
            return Err(UploadError::Cancelled);
        }
        while !data.is_empty() {
            let fill = match self.filling {
                Some(fill) => fill,
                None => {
                    self.take_news();
                    while self.busy >= self.windows.count {
                        self.wait_news().await?;
                    }
                    0
                }
            };
            let slot = self.slot.as_ref().ok_or(UploadError::Cancelled)?;
            let n = ((self.windows.size - fill) as usize).min(data.len());
            let at = self.windows.offset(self.next) + u64::from(fill);
            self.sink.write_at(slot, at, &data[..n])?;
            data = &data[n..];
            let fill = fill + n as u32;
            if fill == self.windows.size {
                self.announce(fill)?;
            } else {
                self.filling = Some(fill);
            }
        }
        Ok(())
    }

    /// Announces what the current window holds (the client paused: what came goes
    /// on now rather than wait for a full window).
    pub fn flush(&mut self) -> Result<(), UploadError> {
        match self.filling {
            Some(fill) if fill > 0 => self.announce(fill),
            _ => Ok(()),
        }
    }

    /// Ends the body, with `trailers` (a response head's wire form holding them;
    /// empty: none).
    pub fn finish(mut self, trailers: Vec<u8>) -> Result<(), UploadError> {
        self.flush()?;
        self.end(ChunkEnd::Last(trailers))
    }

    /// Ends the body early: the service sees it incomplete.
    pub fn abort(mut self, why: &str) {
        let _ = self.end(ChunkEnd::Abort(why.to_owned()));
    }

    fn announce(&mut self, len: u32) -> Result<(), UploadError> {
        let chunk = Chunk {
            xid: self.xid,
            window: self.next,
            len,
            end: ChunkEnd::More,
        };
        self.sink.send_up(self.qp, Message::UpChunk(chunk))?;
        self.busy += 1;
        self.next = (self.next + 1) % self.windows.count;
        self.filling = None;
        Ok(())
    }

    fn end(&mut self, end: ChunkEnd) -> Result<(), UploadError> {
        let Some(slot) = self.slot.take() else {
            return Ok(());
        };
        self.take_news();
        let sent = if self.cancelled {
            Ok(())
        } else {
            let chunk = Chunk {
                xid: self.xid,
                window: 0,
                len: 0,
                end,
            };
            self.sink.send_up(self.qp, Message::UpChunk(chunk))
        };
        let busy = if self.cancelled { 0 } else { self.busy };
        self.sink.release(self.qp, self.xid, slot, busy);
        sent.map_err(UploadError::Failed)
    }

    /// What the node said since the last look, without waiting.
    fn take_news(&mut self) {
        while let Ok(news) = self.news.try_recv() {
            self.heard(news);
        }
    }

    fn heard(&mut self, news: UpNews) {
        match news {
            UpNews::Window(n) => self.busy = self.busy.saturating_sub(n),
            UpNews::Cancel => {
                self.cancelled = true;
                self.busy = 0;
            }
        }
    }

    async fn wait_news(&mut self) -> Result<(), UploadError> {
        if self.cancelled {
            return Err(UploadError::Cancelled);
        }
        match self.news.recv().await {
            Some(news) => {
                self.heard(news);
                if self.cancelled {
                    Err(UploadError::Cancelled)
                } else {
                    Ok(())
                }
            }
            None => Err(UploadError::Failed(ProxyError::new(
                ErrorKind::LinkLost,
                "the link carrying the request body was lost",
            ))),
        }
    }

    /// Waits until the node wants no more of the body, or its link is gone (the
    /// windows it hands back meanwhile are counted).
    pub async fn cancelled_or_lost(&mut self) {
        while self.wait_news().await.is_ok() {}
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        if self.slot.is_some() {
            let _ = self.end(ChunkEnd::Abort("the request body ended early".into()));
        }
    }
}

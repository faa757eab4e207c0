//! A guest's stderr: kept as a short tail so a panic message can be quoted in the
//! fault report, never blocking, never failing the guest's writes.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};

/// How much of a guest's stderr is kept.
const TAIL_BYTES: usize = 2048;

/// The last [`TAIL_BYTES`] a guest wrote to stderr.
#[derive(Debug, Clone, Default)]
pub(crate) struct StderrTail {
    buf: Arc<Mutex<VecDeque<u8>>>,
}

impl StderrTail {
    pub(crate) fn push(&self, bytes: &[u8]) {
        // The lock is per instance and only taken when the guest writes to stderr,
        // which well-behaved filters never do on the request path.
        let mut buf = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = &bytes[bytes.len().saturating_sub(TAIL_BYTES)..];
        let overflow = (buf.len() + bytes.len()).saturating_sub(TAIL_BYTES);
        buf.drain(..overflow);
        buf.extend(bytes);
    }

    /// Takes the tail, trimmed, leaving it empty.
    pub(crate) fn take(&self) -> String {
        let mut buf = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        let bytes: Vec<u8> = buf.drain(..).collect();
        String::from_utf8_lossy(&bytes).trim().to_owned()
    }
}

impl IsTerminal for StderrTail {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for StderrTail {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for StderrTail {
    async fn ready(&mut self) {}
}

#[wasmtime_wasi::async_trait]
impl OutputStream for StderrTail {
    fn write(&mut self, bytes: Bytes) -> Result<(), StreamError> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        Ok(64 * 1024)
    }
}

impl tokio::io::AsyncWrite for StderrTail {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_the_tail() {
        let tail = StderrTail::default();
        tail.push(&vec![b'a'; TAIL_BYTES]);
        tail.push(b"panicked at boom");
        let text = tail.take();
        assert_eq!(text.len(), TAIL_BYTES);
        assert!(text.ends_with("panicked at boom"));
        assert_eq!(tail.take(), "");
    }
}

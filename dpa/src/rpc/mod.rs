//! RPC on the fabric, after the classic RDMA RPC design:
//!
//! ```text
//! client                                   server
//!   post recv (for the response's imm)       pre-posted recvs for metadata
//!   SEND meta (+ the request, if small) ──▶  recv completion
//!                                            small: request is in the meta
//!                                            large: RDMA_READ the request ◀── client memory
//!                                            handler runs (off the poller thread)
//!   recv completion (imm = context) ◀──────  RDMA_WRITE_WITH_IMM the response
//! ```
//!
//! Client contexts go Vacant → SendingMeta → WaitingForResponse → Vacant; a ring of
//! them per connection keeps many calls in flight. Server contexts go
//! WaitingForMeta → (ReadingRequest →) FilledWithRequest → FilledWithResponse →
//! WritingResponse → WaitingForMeta. One server poller thread drains the completion
//! queue of every connection; handlers run on a pool. Callers on the client take turns
//! polling (the one waiting polls and hands others their completions), so a lone
//! caller pays no thread hop.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use parking_lot::{Condvar, Mutex};

use crate::fabric::{
    Access, CompletionQueue, Fabric, FabricError, MemoryRegion, QpCaps, QpListener, QueuePair,
    RecvWr, RemoteAddr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};
use crate::shm::SharedRegion;

mod client;
mod server;
#[cfg(test)]
mod tests;

pub use client::RpcClient;
pub use server::{Handler, RpcServer, ServerStats};

const META_MAGIC: u16 = 0x5250; // "RP"
const META_LEN: u64 = 48;
const KIND_INLINE: u8 = 1;
const KIND_REMOTE: u8 = 2;
/// Response header: status and length.
const RESP_HEADER: u64 = 8;
const STATUS_OK: u32 = 0;
const STATUS_HANDLER: u32 = 1;
const STATUS_TOO_LARGE: u32 = 2;
/// One signaled send in this many lets the send queue drain.
const SIGNAL_EVERY: u64 = 16;

/// Sizes and behaviour of an RPC endpoint.
#[derive(Debug, Clone, Copy)]
pub struct RpcConfig {
    /// Calls in flight per connection (the ring of contexts).
    pub slots: u32,
    pub max_request: u32,
    pub max_response: u32,
    /// Requests up to this size travel inside the SEND ("accelerate small rpc");
    /// larger ones are RDMA-READ by the server.
    pub inline: u32,
    /// Handler threads on the server.
    pub handlers: usize,
    /// How long a handler thread spins for the next job before sleeping.
    pub handler_spin: Duration,
    /// How long a call waits for its response.
    pub timeout: Duration,
}

impl Default for RpcConfig {
    fn default() -> Self {
        Self {
            slots: 16,
            max_request: 1 << 20,
            max_response: 1 << 20,
            inline: 64 << 10,
            handlers: 2,
            handler_spin: Duration::from_micros(50),
            timeout: Duration::from_secs(30),
        }
    }
}

impl RpcConfig {
    fn meta_cap(&self) -> u64 {
        META_LEN + self.inline as u64
    }

    fn resp_cap(&self) -> u64 {
        RESP_HEADER + self.max_response as u64
    }

    /// Per context on either side: [meta][request][response].
    fn stride(&self) -> u64 {
        (self.meta_cap() + self.max_request as u64 + self.resp_cap()).next_multiple_of(4096)
    }

    fn meta_at(&self, ctx: u32) -> u64 {
        ctx as u64 * self.stride()
    }

    fn request_at(&self, ctx: u32) -> u64 {
        self.meta_at(ctx) + self.meta_cap()
    }

    fn response_at(&self, ctx: u32) -> u64 {
        self.request_at(ctx) + self.max_request as u64
    }

    fn region_len(&self) -> u64 {
        self.slots as u64 * self.stride()
    }
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// The fabric refused a call or failed.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// Shared memory for buffers.
    #[error(transparent)]
    Shm(#[from] crate::shm::ShmError),
    /// Starting a thread.
    #[error("cannot start an RPC thread: {0}")]
    Thread(#[from] std::io::Error),
    /// A completion came back in error.
    #[error("RPC transport failed: {0:?}")]
    Completion(WcStatus),
    /// The request is larger than the connection takes.
    #[error("request of {len} bytes exceeds the {limit}-byte limit")]
    RequestTooLarge { len: usize, limit: u32 },
    /// The response did not fit the client's buffer.
    #[error("the server's response exceeds the client's {limit}-byte response buffer")]
    ResponseTooLarge { limit: u32 },
    /// The handler failed.
    #[error("the server's handler failed: {0}")]
    Handler(String),
    /// No response in time.
    #[error("no response within {0:?}")]
    Timeout(Duration),
    /// The connection is gone.
    #[error("the RPC connection is closed")]
    Closed,
}

#[derive(Debug, Clone, Copy, Default)]
struct Meta {
    kind: u8,
    ctx: u32,
    len: u32,
    req: RemoteAddr,
    resp: RemoteAddr,
    resp_cap: u32,
}

impl Meta {
    fn encode(&self) -> [u8; META_LEN as usize] {
        let mut b = [0u8; META_LEN as usize];
        b[0..2].copy_from_slice(&META_MAGIC.to_le_bytes());
        b[2] = self.kind;
        b[4..8].copy_from_slice(&self.ctx.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.req.rkey.to_le_bytes());
        b[16..24].copy_from_slice(&self.req.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.resp.addr.to_le_bytes());
        b[32..36].copy_from_slice(&self.resp.rkey.to_le_bytes());
        b[36..40].copy_from_slice(&self.resp_cap.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < META_LEN as usize || u16::from_le_bytes([b[0], b[1]]) != META_MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Some(Self {
            kind: b[2],
            ctx: u32_at(4),
            len: u32_at(8),
            req: RemoteAddr {
                addr: u64_at(16),
                rkey: u32_at(12),
            },
            resp: RemoteAddr {
                addr: u64_at(24),
                rkey: u32_at(32),
            },
            resp_cap: u32_at(36),
        })
    }
}

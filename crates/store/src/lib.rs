//! BlueCache: a DPU-resident object store fed by DMA.
//!
//! A host client registers a buffer (exports it), then asks the DPU agent, over the
//! node's control channel, to PUSH ranges of it into objects or PULL objects into
//! it; the agent moves the bytes with its DMA engine through a staging buffer
//! registered once, and stores them with a backend (POSIX files by default). Only
//! metadata travels on the control channel.
//!
//! - [`protocol`]: the versioned `DTRF` request/response messages.
//! - [`backend`]: storage backends (POSIX files, memory) with whole-object commits.
//! - [`catalog`]: what is stored, capacity and LRU eviction.
//! - [`agent`]: the DPU agent (progress loop, staging slots, pipelined transfers).
//! - [`namespace`]: each service's keys under its own prefix, the node's apart.
//!
//! The host client lives in `dpumesh-host` (`dpumesh_host::store`).

#![forbid(unsafe_code)]

pub mod agent;
pub mod backend;
pub mod catalog;
pub mod namespace;
pub mod protocol;

pub use agent::{Agent, AgentConfig, AgentError, AgentStats, PutError, Reply};
pub use backend::{Backend, MemoryBackend, ObjectMeta, PosixBackend, PosixOptions, StorageError};

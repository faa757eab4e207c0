//! The DPUmesh DPU proxy runtime.
//!
//! This crate runs WebAssembly filter components against request heads: one wasmtime
//! [`Engine`](wasmtime::Engine) per proxy, each filter compiled once (with an on-disk
//! `.cwasm` cache) and checked against the `dpumesh:filter@0.1.3` world (a component
//! built for any 0.1.x loads), instantiated from a pooling allocator per worker thread,
//! and run in [chains](FilterChain) with a memory cap, a CPU deadline per call and a
//! failure policy per filter.
//!
//! ```text
//! Runtime::load_filter ──▶ LoadedFilter (compiled, checked, configure()d once)
//!        FilterChain [jwt, rbac, ratelimit, ...]   (shared definition, maybe fused)
//!        LocalChains (a node shard's own runners: the chain runs inline on the
//!          shard's thread) ──▶ ChainRunner (its own instances)
//!                                 on-request in order, first deny wins
//!                                 on-response in reverse
//!        WorkerPool ──▶ worker thread ──▶ ChainRunner: only for chains with an
//!          `offload` filter, and for the standalone proxy's listener
//! ```

#![deny(unsafe_code)]

mod artifacts;
mod bindings;
mod budget;
mod call;
pub mod callout;
pub(crate) mod canon;
mod chain;
mod epoch;
mod error;
mod filter;
mod fusion;
mod generation;
mod health;
mod imports;
pub mod input;
mod instance;
mod limits;
mod local;
pub mod proxywasm;
pub mod queues;
mod runtime;
mod stamp;
mod stderr;
pub mod timing;
mod worker;

pub use bindings::{FailureKind, ResponseInfo};
pub use call::ResponseHeaders;
pub use callout::{Callout, CalloutReply, CalloutTargets};
pub use chain::{ChainOutcome, ChainRunner, Decision, DenyCause, FilterChain, LocalReply};
pub use dpumesh_head::{HeaderError, Peer, RequestHead};
pub use error::{FaultKind, FilterFault, LoadError, Phase};
pub use filter::{FailurePolicy, FilterSettings, LoadedFilter, WIT_VERSION};
pub use generation::{Generation, RequestDone, ResponseDone, Ticket};
pub use health::{FilterHealth, HealthPolicy, HealthState};
pub use imports::NodeServices;
pub use instance::{FilterInstance, Startup};
pub use local::{LocalChains, RootCall};
pub use runtime::{AddressSpace, Runtime, RuntimeConfig, RuntimeError, default_cache_dir};
pub use worker::{PoolError, WorkerPool};

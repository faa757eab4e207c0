//! The host library: what a service on a host links to receive requests from, and make
//! calls through, the DPU data path, without ever blocking a thread on I/O: the
//! Execution Graph.
//!
//! A handler gets an [`ExecutionContext`] and schedules steps: egress calls
//! ([`ExecutionContext::call`]), CPU work on a thread pool
//! ([`ExecutionContext::run_internal`]), parallel blocks
//! ([`ExecutionContext::parallel`]), with `inputs` chaining results and
//! `request_builder` deciding calls at run time (none: skip; several: fan-out). It
//! returns at once; the [`EventLoop`] runs the graph and answers with its result (see
//! [`context`] for how the response is chosen). The low-level graph ([`order`],
//! [`pipe`], [`EgressStep`], [`InternalStep`]) is what the high-level API builds and can
//! be used directly.
//!
//! Semantics: a sequence ([`order`]) stops at its first failure and propagates it; a
//! parallel block ([`pipe`]) lets its members finish and then fails naming those that
//! failed; an egress call answered with a status ≥ 400 fails; an internal step that
//! panics or returns an error fails with that; a step with a timeout fails when it
//! passes it, and what arrives for it later is dropped.
//!
//! The loop runs on a [`Transport`]: [`memory::InMemoryTransport`] (virtual clock) for
//! tests and examples; [`datapath::DataPathTransport`] (descriptors through the node's
//! DMA manager and DPU proxy) in the mesh.
//!
//! [`store`] is the BlueCache client: objects on the DPU, moved by DMA.

#![warn(missing_docs)]

pub mod body;
pub mod context;
pub mod datapath;
mod event_loop;
pub mod graph;
pub mod http;
mod instream;
pub mod memory;
mod outstream;
mod pool;
pub mod reactor;
pub mod result;
mod run;
mod spans;
pub mod store;
mod tasks;
pub mod tower;
pub mod transport;

pub use context::{CallBuilder, ExecutionContext, InternalBuilder, StepRef};
/// Where a pod registers: the node's control socket (`DPUMESH_CONTROL` as `dpumesh up`
/// and the chart set it: a path, or `tcp:HOST:PORT`). Parse it with `str::parse`.
pub use dpumesh_dpa::control::transport::Endpoint;
pub use event_loop::{EventLoop, Handler, LoopConfig, LoopStats, Outbound};
#[allow(deprecated)]
pub use graph::Node;
pub use graph::{EgressStep, InternalStep, Step, Work, order, pipe};
pub use http::{Caller, HttpRequest, HttpResponse};
pub use pool::WorkerScope;
pub use result::{Inputs, StepError, StepId, StepOutput, StepResult};
pub use transport::{AnswerBody, Event, IncomingId, Tag, Transport, TransportError};

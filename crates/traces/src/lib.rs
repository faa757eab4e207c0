//! OpenTelemetry spans of the mesh's hops (the ingress, each DPU proxy exchange with
//! its filters as events, the host library's steps), exported over OTLP/HTTP with
//! protobuf bodies (`opentelemetry-proto`'s messages) to a collector.
//!
//! A hop records its span when the exchange ends, from what it already knows (times,
//! status, the filters' times): nothing is built for a request that is not sampled,
//! and a sampled one is encoded in protobuf on the hop's thread ([`span`]) and
//! appended to the process's batch. A thread posts the batches ([`export`]). Configuration is OpenTelemetry's own environment
//! ([`Settings::from_env`]); sampling is parent-based with a trace-id ratio
//! ([`context`]), so every hop of one trace decides alike.

#![forbid(unsafe_code)]

pub mod context;
pub mod export;
pub mod span;

pub use context::{SpanId, TraceContext, TraceId};
pub use export::{Exporter, Settings, SettingsError};
pub use span::{SpanHead, SpanKind, SpanWriter, Value};

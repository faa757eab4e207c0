//! R-Pingmesh (SIGCOMM 2024) for the mesh: every node's agent probes its peers over UD
//! queue pairs and tells network faults from host faults; a controller hands out
//! pinglists; an analyzer localizes and classifies what the probes saw.
//!
//! - [`probe`]: the probe messages and the T1..T6 arithmetic;
//! - [`ecmp`]: formula (1), tuples per inter-ToR target;
//! - [`registry`]: the RNIC registry ([`registry::RnicStore`], SQLite and memory);
//! - [`pinglist`]: ToR-mesh and inter-ToR lists, rotated;
//! - [`controller`]: the controller's gRPC service;
//! - [`agent`]: what every node runs: registration, prober and responder, uploads;
//! - [`analyzer`]: non-network filtering, anomalous RNICs, voting, SLAs, impact;
//! - [`dashboard`]: the web dashboard (mesh, heatmap, problems);
//! - [`server`]: controller and analyzer in one process (the embedded default);
//! - [`proto`]: the gRPC messages and services (`proto/pingmesh.proto`).

pub mod agent;
pub mod analyzer;
pub mod controller;
mod convert;
pub mod dashboard;
pub mod ecmp;
pub mod pinglist;
pub mod probe;
pub mod registry;
pub mod server;
pub mod tls;

/// The gRPC API, generated from `proto/pingmesh.proto`.
#[allow(clippy::all, rust_2018_idioms, missing_docs)]
pub mod proto {
    tonic::include_proto!("dpumesh.pingmesh.v1");
}

//! Host-side bindings generated from `wit/filter.wit`. This module is the only place
//! `bindgen!` runs on the host side.

#![expect(missing_docs, reason = "bindgen-generated")]

wasmtime::component::bindgen!({
    path: "../wit",
    world: "batched-filter",
    with: {
        "dpumesh:filter/types.request-head": HeadHandle,
    },
    // Every import may trap: a host-side failure ends the call (and the filter's
    // failure policy applies) instead of panicking the worker thread.
    imports: { default: trappable },
});

pub(crate) use dpumesh::filter::types::HeaderEdit;
pub use dpumesh::filter::types::{FailureKind, LocalReply};

/// The version of the `dpumesh:filter` package this runtime serves (the WIT above).
pub const WIT_VERSION: &str = "0.1.3";

/// Stand-in type of the `request-head` resource: the head itself is lent to the
/// instance's store for a call, so the handle names no table entry (see
/// [`crate::imports`]).
#[derive(Debug)]
pub struct HeadHandle;

//! Host-side bindings generated from `wit/filter.wit`. This module is the only place
//! `bindgen!` runs on the host side.

#![expect(missing_docs, reason = "bindgen-generated")]

wasmtime::component::bindgen!({
    path: "../wit",
    world: "batched-filter",
    with: {
        "dpumesh:filter/types.request-head": crate::imports::HeadHandle,
    },
    // Every import may trap: a host-side failure ends the call (and the filter's
    // failure policy applies) instead of panicking the worker thread.
    imports: { default: trappable },
});

pub(crate) use dpumesh::filter::types::HeaderEdit;
pub use dpumesh::filter::types::{FailureKind, LocalReply};

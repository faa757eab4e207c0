//! Host-side bindings generated from `wit/filter.wit`. This module is the only place
//! `bindgen!` runs on the host side.

#![expect(missing_docs, reason = "bindgen-generated")]

wasmtime::component::bindgen!({
    path: "../wit",
    world: "filter",
    with: {
        "dpumesh:filter/types.request-head": crate::host::HeadHandle,
    },
});

pub use dpumesh::filter::types::{FailureKind, LocalReply};

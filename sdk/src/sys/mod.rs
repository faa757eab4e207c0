//! What a filter's helpers call: the proxy's imports when the filter is built for Wasm
//! ([`wasm`]), the mock proxy on a native target ([`native`], for `cargo test`). Both
//! backends offer the same functions with the same types, so the public helper
//! modules (`log`, `clock`, `metrics`, `shared`, `crypto`) hold no target-specific
//! code of their own; this is the one place the target is chosen.

#[cfg(not(target_arch = "wasm32"))]
mod native;
#[cfg(target_arch = "wasm32")]
mod wasm;

#[cfg(not(target_arch = "wasm32"))]
pub(crate) use native::*;
#[cfg(target_arch = "wasm32")]
pub(crate) use wasm::*;

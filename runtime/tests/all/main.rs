//! Integration tests of the runtime, in one binary to keep link time down.

mod chain;
mod claims;
mod compat;
mod compat_builtins;
mod core_calls;
mod differential;
mod errors;
mod faults;
mod fused;
mod layers;
mod proxy_wasm;
mod proxy_wasm_calls;
mod proxy_wasm_queues;
mod support;
mod workers;

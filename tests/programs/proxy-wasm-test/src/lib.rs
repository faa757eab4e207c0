//! A proxy-wasm plugin for the host's tests, written against the proxy-wasm Rust SDK
//! as any Envoy plugin is. Its plugin configuration (JSON) picks what it does; every
//! request phase callback and host call the tests check is reachable from here.
//! Built for `wasm32-wasip1`; on other targets it is empty.

#[cfg(target_arch = "wasm32")]
mod plugin;

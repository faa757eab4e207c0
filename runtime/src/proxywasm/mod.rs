//! proxy-wasm ABI 0.2.x: existing Envoy / Istio Wasm plugins (core modules exporting
//! `proxy_abi_version_0_2_1` or `_0_2_0`) run as filters beside components, with the
//! same cache, limits, failure policies, health and reloads.
//!
//! ```text
//! Runtime::load_filter ── core module? ──▶ plugin::prepare (ABI marker, exports, imports)
//!                                          ▼
//! FilterInstance ──▶ PwInstance: root context, vm_start, configure (at instantiation)
//!    on_request:  context_create(ctx, root), on_request_headers(ctx, n, eos)
//!    on_callout:  on_http_call_response(root, token, ...) on a paused request
//!    on_response: on_response_headers (edits applied), on_log, on_done, on_delete
//!    tick:        on_queue_ready, on_tick (between requests, on the owning thread)
//! ```
//!
//! The proxy is header-only: body and trailer callbacks are never called. A request a
//! plugin pauses for its HTTP calls is parked in its [`crate::ChainRunner`] (the owner
//! performs the calls and hands the answers back); shared queues are the node's
//! ([`crate::queues`]). docs/proxy-wasm.md says what is built and what differs from Envoy.

pub mod abi;
pub(crate) mod calls;
pub(crate) mod host;
pub(crate) mod instance;
pub(crate) mod plugin;
pub mod properties;
pub(crate) mod state;

pub use plugin::is_core_module;
pub use state::PluginConfig;

use state::PwState;

/// The `env` and WASI functions every plugin links against.
pub(crate) fn linker(engine: &wasmtime::Engine) -> wasmtime::Result<wasmtime::Linker<PwState>> {
    let mut linker = wasmtime::Linker::new(engine);
    host::define(&mut linker)?;
    wasmtime_wasi::p1::add_to_linker_sync(&mut linker, |state: &mut PwState| &mut state.wasi)?;
    // `poll_oneoff` is how WASI p1 sleeps (a clock subscription) or waits on a file:
    // a plugin runs on a thread that serves other requests, and sleeping spends no
    // CPU for the deadline to count, so it traps (as a fault of the plugin, under its
    // failure policy) instead of holding the thread.
    linker.allow_shadowing(true);
    linker.func_wrap(
        "wasi_snapshot_preview1",
        "poll_oneoff",
        |_: wasmtime::Caller<'_, PwState>,
         _subscriptions: i32,
         _events: i32,
         _count: i32,
         _written: i32|
         -> wasmtime::Result<i32> {
            Err(wasmtime::format_err!(
                "poll_oneoff (sleeping, waiting) is not served to a plugin: it would hold a thread that serves other requests"
            ))
        },
    )?;
    linker.allow_shadowing(false);
    Ok(linker)
}

impl crate::call::CallData for PwState {
    fn limiter(&mut self) -> &mut crate::limits::MemoryLimiter {
        &mut self.limiter
    }
    fn budget(&mut self) -> &mut crate::budget::CpuBudget {
        &mut self.budget
    }
    fn stderr(&self) -> &crate::stderr::StderrTail {
        &self.stderr
    }
}

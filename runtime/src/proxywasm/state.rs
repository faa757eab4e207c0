//! The `Store` data of a proxy-wasm instance, and the guest-memory helpers every host
//! function uses: bounds-checked reads, and buffers handed to the guest through its
//! own allocator (one allocation of exactly the returned length: the SDK frees it
//! with that size).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use dpumesh_head::RequestHead;
use dpumesh_shared_state::Namespace;
use wasmtime::{Caller, Extern, Memory};
use wasmtime_wasi::p1::WasiP1Ctx;

use super::abi::BufferType;
use crate::imports::NodeServices;
use crate::limits::MemoryLimiter;
use crate::stderr::StderrTail;

/// Most bytes one host call takes from or gives to a guest (a header map, a config, a
/// local reply's body): a module asking for more is refused with a trap, not served
/// by allocating what it named.
pub(crate) const MAX_GUEST_BYTES: usize = 16 << 20;

/// What a plugin is given at load: its configuration, its names, the node's metadata.
#[derive(Debug, Clone, Default)]
pub struct PluginConfig {
    /// The plugin configuration (`proxy_on_configure`, buffer type 7).
    pub plugin: Vec<u8>,
    /// The VM configuration (`proxy_on_vm_start`, buffer type 6).
    pub vm: Vec<u8>,
    /// The filter's name (`plugin_name`).
    pub name: String,
    /// The root id (`plugin_root_id`): which root context of a multi-plugin module.
    pub root_id: String,
    /// `node.metadata` as configured for the proxy.
    pub node_metadata: BTreeMap<String, String>,
}

/// Header pairs as the ABI carries them: names, and values as bytes.
pub(crate) type Pairs = Vec<(String, Vec<u8>)>;

/// A local reply a filter asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LocalResponse {
    pub(crate) status: u16,
    pub(crate) details: String,
    pub(crate) body: Vec<u8>,
    pub(crate) headers: Pairs,
}

/// What one callback into the guest may read and changes.
#[derive(Default)]
pub(crate) struct CallState {
    /// The request head lent for the call.
    pub(crate) head: Option<Box<RequestHead>>,
    /// The response status and headers, in the response phase.
    pub(crate) response: Option<(u16, Pairs)>,
    /// The buffer readable in this callback (the configurations).
    pub(crate) buffer: Option<(BufferType, Arc<[u8]>)>,
    /// Set by `proxy_send_local_response`.
    pub(crate) local_response: Option<LocalResponse>,
    /// Set by `proxy_close_stream`.
    pub(crate) closed: bool,
    /// Whether a filter edited the response's headers in this callback.
    pub(crate) response_edited: bool,
    /// Set by `proxy_continue_stream` on the request (resumes a paused request).
    pub(crate) resumed: bool,
    /// The answer to an HTTP call, in `proxy_on_http_call_response` (its headers; the
    /// body is the readable buffer).
    pub(crate) call_response: Option<Vec<(String, Vec<u8>)>>,
    /// HTTP calls made in this callback, for the chain's owner to perform.
    pub(crate) callouts: Vec<crate::callout::Callout>,
}

/// One metric a module defined.
pub(crate) enum Metric {
    Counter(::metrics::Counter, u64),
    Gauge(::metrics::Gauge, i64),
    Histogram(::metrics::Histogram),
}

/// The data of one proxy-wasm instance's `Store`.
pub(crate) struct PwState {
    pub(crate) limiter: MemoryLimiter,
    pub(crate) budget: crate::budget::CpuBudget,
    pub(crate) stderr: StderrTail,
    pub(crate) wasi: WasiP1Ctx,
    pub(crate) services: NodeServices,
    pub(crate) shared: Namespace,
    pub(crate) config: Arc<PluginConfig>,
    pub(crate) call: CallState,
    pub(crate) metrics: Vec<Metric>,
    pub(crate) metric_ids: HashMap<(i32, String), u32>,
    /// The VM id its shared queues are registered under (the filter's namespace).
    pub(crate) vm_id: String,
    /// This instance's side of the node's shared queues.
    pub(crate) queue_owner: Arc<crate::queues::QueueOwner>,
    /// The root's tick period (`proxy_set_tick_period_milliseconds`); 0 = none.
    pub(crate) tick_ms: u32,
    pub(crate) contexts: Contexts,
}

/// The guest's contexts and the HTTP calls they made.
#[derive(Debug, Default)]
pub(crate) struct Contexts {
    /// The contexts alive in the guest: the root and the requests under way.
    pub(crate) alive: std::collections::BTreeSet<u32>,
    /// The context later host calls act on (`proxy_set_effective_context`).
    pub(crate) effective: u32,
    /// The last HTTP call token handed out.
    pub(crate) last_token: u32,
    /// HTTP calls under way: token → the context that made it.
    pub(crate) pending: HashMap<u32, u32>,
}

/// The guest's linear memory.
fn memory(caller: &mut Caller<'_, PwState>) -> wasmtime::Result<Memory> {
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Ok(m),
        _ => Err(wasmtime::format_err!("the module exports no memory")),
    }
}

/// Copies `len` bytes at `ptr` out of the guest, refusing a range outside its memory
/// or larger than [`MAX_GUEST_BYTES`] (a trap: the call faults under the filter's
/// failure policy).
pub(crate) fn read(
    caller: &mut Caller<'_, PwState>,
    ptr: i32,
    len: i32,
) -> wasmtime::Result<Vec<u8>> {
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    if len > MAX_GUEST_BYTES {
        wasmtime::bail!("a host call passed {len} bytes, more than the {MAX_GUEST_BYTES} allowed");
    }
    let memory = memory(caller)?;
    let data = memory.data(&*caller);
    let end = ptr
        .checked_add(len)
        .filter(|&end| end <= data.len())
        .ok_or_else(|| {
            wasmtime::format_err!(
                "a host call passed bytes {ptr}..{} outside the module's memory ({} bytes)",
                ptr as u64 + len as u64,
                data.len()
            )
        })?;
    Ok(data[ptr..end].to_vec())
}

/// [`read`] as UTF-8 (names, paths, keys); not UTF-8 is a trap naming `what`.
pub(crate) fn read_str(
    caller: &mut Caller<'_, PwState>,
    ptr: i32,
    len: i32,
    what: &str,
) -> wasmtime::Result<String> {
    String::from_utf8(read(caller, ptr, len)?)
        .map_err(|_| wasmtime::format_err!("{what} is not UTF-8"))
}

fn write(caller: &mut Caller<'_, PwState>, at: i32, bytes: &[u8]) -> wasmtime::Result<()> {
    let memory = memory(caller)?;
    memory
        .write(&mut *caller, at as u32 as usize, bytes)
        .map_err(|_| {
            wasmtime::format_err!(
                "a host call's out-pointer {} is outside the module's memory",
                at as u32
            )
        })
}

pub(crate) fn write_u32(
    caller: &mut Caller<'_, PwState>,
    at: i32,
    value: u32,
) -> wasmtime::Result<()> {
    write(caller, at, &value.to_le_bytes())
}

pub(crate) fn write_u64(
    caller: &mut Caller<'_, PwState>,
    at: i32,
    value: u64,
) -> wasmtime::Result<()> {
    write(caller, at, &value.to_le_bytes())
}

/// Hands `bytes` to the guest: allocated by its `proxy_on_memory_allocate` (or
/// `malloc`), copied in, address and length written to the out-pointers. Empty data
/// is (0, 0) without an allocation, which the SDK reads as "none".
pub(crate) fn give(
    caller: &mut Caller<'_, PwState>,
    bytes: &[u8],
    ret_ptr: i32,
    ret_len: i32,
) -> wasmtime::Result<()> {
    if bytes.is_empty() {
        write_u32(caller, ret_ptr, 0)?;
        return write_u32(caller, ret_len, 0);
    }
    if bytes.len() > MAX_GUEST_BYTES {
        wasmtime::bail!(
            "a value of {} bytes is too large to hand to the module",
            bytes.len()
        );
    }
    let allocate = ["proxy_on_memory_allocate", "malloc"]
        .iter()
        .find_map(|name| caller.get_export(name).and_then(Extern::into_func))
        .ok_or_else(|| wasmtime::format_err!("the module exports no allocator"))?
        .typed::<i32, i32>(&*caller)?;
    let ptr = allocate.call(&mut *caller, bytes.len() as i32)?;
    if ptr == 0 {
        wasmtime::bail!(
            "the module's allocator returned null for {} bytes",
            bytes.len()
        );
    }
    write(caller, ptr, bytes)?;
    write_u32(caller, ret_ptr, ptr as u32)?;
    write_u32(caller, ret_len, bytes.len() as u32)
}

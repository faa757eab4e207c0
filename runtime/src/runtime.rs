//! The [`Runtime`]: one wasmtime engine, the linker with the filter world's imports,
//! the compile cache, node-wide host services and the epoch ticker that enforces CPU
//! deadlines.

use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use dpumesh_clock::{SharedClock, SystemClock};
use dpumesh_keys::KeyStore;
use dpumesh_shared_state::{SharedState, StateLimits};
use wasmtime::component::{HasSelf, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use crate::artifacts::ArtifactStore;
use crate::epoch::Epoch;
use crate::imports::{NodeServices, StoreState};

/// How the runtime is set up. [`RuntimeConfig::default`] suits one proxy process.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Directory for compiled `.cwasm` artifacts; `None` keeps them in memory only.
    pub cache_dir: Option<PathBuf>,
    /// Most filter instances alive at once (workers × filters, plus headroom for
    /// validation and replacement during reloads). Sizes the pooling allocator.
    pub max_instances: u32,
    /// Largest linear memory any filter may have; per-filter caps must not exceed it.
    pub max_memory_bytes: usize,
    /// Granularity of CPU deadlines: the epoch advances this often.
    pub epoch_tick: Duration,
    /// Time source for filters and shared state.
    pub clock: SharedClock,
    /// Capacity of the node-wide shared state.
    pub state_limits: StateLimits,
    /// How linear memories take address space.
    pub address_space: AddressSpace,
    /// Whether components that can run as core instances do ([`crate::canon`]:
    /// the world's canonical ABI done by the host, several times cheaper per call).
    /// `DPUMESH_CORE_CALLS=off` turns it off by default (for comparisons).
    pub core_calls: bool,
}

/// How filter memories are laid out in the process's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AddressSpace {
    /// A pool of instance slots reserved up front, each memory in a large reservation
    /// with guard pages, so guest loads need no bounds checks (terabytes of virtual
    /// address space for the default pool; fine with 47–48-bit user address spaces).
    #[default]
    Reserved,
    /// Memories allocated on demand with small reservations and explicit bounds
    /// checks: for kernels with small address spaces (39-bit VA Arm kernels) and for
    /// user-mode emulators (qemu-aarch64), which track every reserved page.
    /// `DPUMESH_WASM_ADDRESS_SPACE=compact` selects it.
    Compact,
}

impl AddressSpace {
    /// `DPUMESH_WASM_ADDRESS_SPACE` (`reserved` or `compact`), else `Reserved`.
    pub fn from_env() -> Self {
        match std::env::var("DPUMESH_WASM_ADDRESS_SPACE").as_deref() {
            Ok("compact") => Self::Compact,
            Ok("reserved") | Err(_) => Self::Reserved,
            Ok(other) => {
                tracing::warn!(
                    value = other,
                    "DPUMESH_WASM_ADDRESS_SPACE is reserved or compact; using reserved"
                );
                Self::Reserved
            }
        }
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            cache_dir: default_cache_dir(),
            max_instances: 256,
            max_memory_bytes: 256 << 20,
            epoch_tick: Duration::from_millis(1),
            clock: SystemClock::shared(),
            state_limits: StateLimits::default(),
            address_space: AddressSpace::from_env(),
            core_calls: std::env::var("DPUMESH_CORE_CALLS").as_deref() != Ok("off"),
        }
    }
}

/// `$DPUMESH_CACHE_DIR`, else `$XDG_CACHE_HOME/dpumesh/cwasm`, else
/// `~/.cache/dpumesh/cwasm`.
pub fn default_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DPUMESH_CACHE_DIR") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("dpumesh").join("cwasm"))
}

/// Why the runtime could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot create the Wasm engine: {0}")]
pub struct RuntimeError(String);

pub(crate) struct RuntimeInner {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<StoreState>,
    /// The proxy-wasm ABI's functions, for plugins (core modules).
    pub(crate) pw_linker: wasmtime::Linker<crate::proxywasm::state::PwState>,
    /// The filter world and WASI as core functions, for components run as core
    /// instances ([`crate::canon`]).
    pub(crate) core_linker: wasmtime::Linker<StoreState>,
    pub(crate) services: NodeServices,
    pub(crate) cache: ArtifactStore,
    pub(crate) config: RuntimeConfig,
    /// The epoch ticker's shared side (calls wake it when it parked).
    pub(crate) epoch: Arc<Epoch>,
    ticker: Option<JoinHandle<()>>,
}

impl Drop for RuntimeInner {
    fn drop(&mut self) {
        self.epoch.stop();
        if let Some(ticker) = self.ticker.take() {
            let _ = ticker.join();
        }
    }
}

/// The filter runtime of one proxy. Cheap to clone.
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<RuntimeInner>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// Creates the engine, linker and services, and starts the epoch ticker.
    pub fn new(config: RuntimeConfig) -> Result<Self, RuntimeError> {
        let engine =
            Engine::new(&engine_config(&config)).map_err(|e| RuntimeError(format!("{e:#}")))?;
        let mut linker = Linker::<StoreState>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .map_err(|e| RuntimeError(format!("linking WASI: {e:#}")))?;
        // No filter may sleep: its clock subscriptions are ready at once.
        crate::imports::clocks::shadow(&mut linker)
            .map_err(|e| RuntimeError(format!("linking WASI's clock: {e:#}")))?;
        crate::bindings::BatchedFilter::add_to_linker::<StoreState, HasSelf<StoreState>>(
            &mut linker,
            |state| state,
        )
        .map_err(|e| RuntimeError(format!("linking the filter world: {e:#}")))?;
        // What a fused chain's driver calls before each filter (a filter importing it
        // is refused at load: it is not part of the filter world).
        linker
            .root()
            .func_wrap(
                crate::fusion::driver::ENTER,
                crate::fusion::driver::enter_filter,
            )
            .map_err(|e| RuntimeError(format!("linking the chain driver: {e:#}")))?;
        let pw_linker = crate::proxywasm::linker(&engine)
            .map_err(|e| RuntimeError(format!("linking the proxy-wasm ABI: {e:#}")))?;
        let core_linker = crate::canon::linker(&engine)
            .map_err(|e| RuntimeError(format!("linking the core filter world: {e:#}")))?;
        let services = NodeServices {
            clock: config.clock.clone(),
            state: SharedState::new(config.clock.clone(), config.state_limits),
            keys: KeyStore::new(),
            callouts: Arc::default(),
            queues: Arc::default(),
        };
        let cache = ArtifactStore::new(&engine, config.cache_dir.clone());
        let (epoch, ticker) =
            crate::epoch::spawn(engine.clone(), services.state.clone(), config.epoch_tick)
                .map_err(|e| RuntimeError(format!("starting the epoch ticker: {e}")))?;
        Ok(Self {
            inner: Arc::new(RuntimeInner {
                engine,
                linker,
                pw_linker,
                core_linker,
                services,
                cache,
                config,
                epoch,
                ticker: Some(ticker),
            }),
        })
    }

    /// The node-wide services (clock, shared state, key store).
    pub fn services(&self) -> &NodeServices {
        &self.inner.services
    }

    /// The key store filters verify against.
    pub fn keys(&self) -> &Arc<KeyStore> {
        &self.inner.services.keys
    }

    /// The node-wide shared state.
    pub fn shared_state(&self) -> &Arc<SharedState> {
        &self.inner.services.state
    }

    /// The configuration the runtime was built with.
    pub fn config(&self) -> &RuntimeConfig {
        &self.inner.config
    }

    /// The wasmtime engine.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }
}

/// The instance pool of [`AddressSpace::Reserved`].
fn pool_config(config: &RuntimeConfig) -> PoolingAllocationConfig {
    let instances = config.max_instances.max(1);
    let mut pool = PoolingAllocationConfig::default();
    // Interpreted guests (Python, JavaScript) are components of many core modules with
    // several memories and large tables; a fused chain holds all its filters' (up to
    // 32, plus its driver): size per-component limits for them.
    pool.total_component_instances(instances)
        .total_core_instances(instances.saturating_mul(16))
        .total_memories(instances.saturating_mul(4))
        .total_tables(instances.saturating_mul(8))
        .max_core_instances_per_component(256)
        .max_memories_per_component(64)
        .max_tables_per_component(128)
        .max_memory_size(config.max_memory_bytes)
        .table_elements(100_000)
        .max_component_instance_size(4 << 20)
        .max_core_instance_size(4 << 20)
        // Reusing a slot would otherwise madvise its pages away (a TLB shootdown on
        // every core) and fault them back in on the next instance. Keep the low pages
        // resident and reset only those actually touched (PAGEMAP_SCAN on Linux 6.7+).
        .linear_memory_keep_resident(2 << 20)
        .table_keep_resident(256 << 10)
        .pagemap_scan(wasmtime::Enabled::Auto)
        .decommit_batch_size(16);
    pool
}

fn engine_config(config: &RuntimeConfig) -> Config {
    let mut wasm = Config::new();
    wasm.wasm_component_model(true)
        .epoch_interruption(true)
        .cranelift_opt_level(wasmtime::OptLevel::Speed);
    match config.address_space {
        AddressSpace::Reserved => {
            wasm.allocation_strategy(InstanceAllocationStrategy::Pooling(pool_config(config)));
        }
        AddressSpace::Compact => {
            // No up-front reservation: a memory takes what it uses plus room to grow,
            // and guest loads are bounds-checked.
            wasm.allocation_strategy(InstanceAllocationStrategy::OnDemand)
                .memory_reservation(0)
                .memory_guard_size(64 << 10)
                .memory_reservation_for_growth(1 << 20);
        }
    }
    // `perf` names guest functions only if the engine tells it where they are:
    // DPUMESH_WASM_PROFILER=perfmap (/tmp/perf-<pid>.map) or jitdump (`perf inject`).
    match std::env::var("DPUMESH_WASM_PROFILER").as_deref() {
        Ok("perfmap") => {
            wasm.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        Ok("jitdump") => {
            wasm.profiler(wasmtime::ProfilingStrategy::JitDump);
        }
        Ok(other) => {
            tracing::warn!(
                value = other,
                "DPUMESH_WASM_PROFILER is perfmap or jitdump; ignored"
            )
        }
        Err(_) => {}
    }
    wasm
}

//! Loading a filter: compile (once), check it targets our world, prepare instantiation,
//! and validate its configuration by configuring one instance.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use wasmtime::component::{Component, ComponentExportIndex, InstancePre};

use crate::artifacts::{CompileError, content_hash};
use crate::error::LoadError;
use crate::health::{FilterHealth, HealthPolicy};
use crate::imports::{FilterTag, StoreState};
use crate::runtime::Runtime;

pub use crate::bindings::WIT_VERSION;
const WIT_PACKAGE: &str = "dpumesh:filter";
/// Types the `filter` world `use`s at its top level; components import them by these
/// plain names.
const WORLD_TYPES: [&str; 4] = ["request-line", "request-head", "verdict", "response-info"];

/// What happens to a request when a filter faults (traps, runs past its deadline,
/// exceeds its memory cap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailurePolicy {
    /// Deny with 500 and a body naming the filter and the cause. The default: an
    /// authentication filter that fails must not let requests through.
    #[default]
    FailClosed,
    /// Skip the filter and go on with the chain.
    FailOpen,
    /// Replace the instance and retry the call once on the head as it was before the
    /// failed call; deny with 500 if the retry faults too. For filters whose faults are
    /// rare and tied to instance state (a leak, a corrupted cache).
    Reload,
}

impl FailurePolicy {
    /// Whether a call under this policy needs the head as it was before the call: to
    /// retry on it (`Reload`), or to go on without the faulted call's edits
    /// (`FailOpen`). Under `FailClosed` the request is denied and its head goes no
    /// further, so no copy is made.
    pub fn restores_head(self) -> bool {
        matches!(self, Self::FailOpen | Self::Reload)
    }
}

/// How one filter of a chain is configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterSettings {
    /// Name used in logs, metrics, errors and as the shared-state namespace.
    pub name: String,
    /// The string passed to `configure` (usually JSON).
    pub config: String,
    /// What a fault does to the request.
    pub failure_policy: FailurePolicy,
    /// Most linear memory one instance may use.
    pub memory_cap: usize,
    /// CPU deadline of one `on-request` or `on-response` call.
    pub deadline: Duration,
    /// CPU deadline of `configure` (interpreted guests start slowly).
    pub configure_deadline: Duration,
    /// Shared-state namespace; the filter's name when `None`. Filters that share a
    /// namespace share counters and buckets.
    pub namespace: Option<String>,
    /// When repeated faults degrade the filter.
    pub health: HealthPolicy,
    /// Chains with this filter run on the worker pool rather than inline on the
    /// proxy's shard: for filters slow by nature (interpreted guests), so they do not
    /// hold up everything else the shard serves. Never the default.
    pub offload: bool,
    /// For a proxy-wasm plugin: its VM configuration (`proxy_on_vm_start`); the
    /// plugin configuration is `config`.
    pub vm_config: String,
    /// For a proxy-wasm plugin: its root id (`plugin_root_id`), empty by default.
    pub root_id: String,
}

impl FilterSettings {
    /// Settings with the defaults: fail-closed, 64 MiB, 5 ms per call, 1 s configure.
    pub fn new(name: impl Into<String>, config: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            config: config.into(),
            failure_policy: FailurePolicy::FailClosed,
            memory_cap: 64 << 20,
            deadline: Duration::from_millis(5),
            configure_deadline: Duration::from_secs(1),
            namespace: None,
            health: HealthPolicy::default(),
            offload: false,
            vm_config: String::new(),
            root_id: String::new(),
        }
    }

    /// Sets the failure policy.
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.failure_policy = policy;
        self
    }

    /// Sets the memory cap.
    pub fn memory_cap(mut self, bytes: usize) -> Self {
        self.memory_cap = bytes;
        self
    }

    /// Sets the per-call CPU deadline.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Sets the CPU deadline of `configure`.
    pub fn configure_deadline(mut self, deadline: Duration) -> Self {
        self.configure_deadline = deadline;
        self
    }

    /// Sets when repeated faults degrade the filter.
    pub fn health(mut self, policy: HealthPolicy) -> Self {
        self.health = policy;
        self
    }

    /// Sets whether chains with this filter run on the worker pool.
    pub fn offload(mut self, offload: bool) -> Self {
        self.offload = offload;
        self
    }

    /// Sets the shared-state namespace.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }
}

/// Where the world's exports are in a component.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Exports {
    pub(crate) configure: Option<ComponentExportIndex>,
    pub(crate) on_request: ComponentExportIndex,
    pub(crate) on_response: Option<ComponentExportIndex>,
    /// The `batched-filter` world's (0.1.1): called instead of `on-request`.
    pub(crate) handle_request: Option<ComponentExportIndex>,
    pub(crate) interest: Option<ComponentExportIndex>,
}

/// What a filter is: a component of our world, or a proxy-wasm plugin.
pub(crate) enum FilterKind {
    Component {
        pre: InstancePre<StoreState>,
        exports: Exports,
        /// The component's bytes, kept to compose the chains it is in
        /// ([`crate::FilterChain::fuse`]).
        bytes: Arc<[u8]>,
        /// Its core module when it can run as a core instance ([`crate::canon`]);
        /// instances are made from it then.
        core: Option<Arc<crate::canon::CoreFilter>>,
    },
    ProxyWasm(Arc<crate::proxywasm::plugin::Plugin>),
}

/// A compiled, checked and validated filter version, ready to instantiate on any
/// worker. Shared by `Arc`.
pub struct LoadedFilter {
    pub(crate) settings: FilterSettings,
    pub(crate) runtime: Runtime,
    pub(crate) kind: FilterKind,
    pub(crate) tag: Arc<FilterTag>,
    pub(crate) health: FilterHealth,
    pub(crate) live: AtomicUsize,
    /// Bytes of linear memory an instance takes when it starts, before `configure`
    /// (measured by each instance): where a fused chain's budget for it starts.
    pub(crate) initial_memory: AtomicUsize,
    /// Whether it takes the batched call, learned from its first instance (one that
    /// exports `handle-request` and declares something it reads).
    pub(crate) batched: std::sync::OnceLock<bool>,
    hash: String,
}

impl std::fmt::Debug for LoadedFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedFilter")
            .field("name", &self.settings.name)
            .field("hash", &self.hash)
            .finish_non_exhaustive()
    }
}

impl LoadedFilter {
    /// The filter's settings.
    pub fn settings(&self) -> &FilterSettings {
        &self.settings
    }

    /// The filter's name.
    pub fn name(&self) -> &str {
        &self.settings.name
    }

    /// SHA-256 of the component bytes (hex): the filter's version.
    pub fn version_hash(&self) -> &str {
        &self.hash
    }

    /// Whether repeated faults have put the filter in backoff.
    pub fn health(&self) -> &FilterHealth {
        &self.health
    }

    /// Instances alive now, on every worker.
    pub fn live_instances(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Whether the component exports `on-response`; a proxy-wasm plugin always has
    /// one (each request's context is finished there).
    pub fn has_response_phase(&self) -> bool {
        match &self.kind {
            FilterKind::Component { exports, .. } => exports.on_response.is_some(),
            FilterKind::ProxyWasm(_) => true,
        }
    }

    /// Whether its instances run as core instances (the component's one core module
    /// with the world's canonical ABI done by the host; see docs/benchmarks.md).
    pub fn runs_as_core(&self) -> bool {
        matches!(&self.kind, FilterKind::Component { core: Some(_), .. })
    }

    /// Whether this is a proxy-wasm plugin (a core module) rather than a component.
    pub fn is_proxy_wasm(&self) -> bool {
        matches!(self.kind, FilterKind::ProxyWasm(_))
    }

    /// The proxy-wasm ABI version a plugin declares (`None` for a component).
    pub fn proxy_wasm_abi(&self) -> Option<&'static str> {
        match &self.kind {
            FilterKind::ProxyWasm(plugin) => Some(plugin.abi.as_str()),
            FilterKind::Component { .. } => None,
        }
    }

    /// Whether requests reach it through the batched call (`handle-request`, WIT
    /// 0.1.1) rather than `on-request`: when the component exports it and declares
    /// something it reads. One that declares nothing gains nothing from the call's
    /// input, so it keeps `on-request`, which measured cheaper for it (the input's
    /// fixed cost; docs/benchmarks.md).
    pub fn is_batched(&self) -> bool {
        self.batched.get().copied().unwrap_or(false)
    }
}

impl Runtime {
    /// Loads a filter from component bytes: compiles it (or takes it from the cache),
    /// checks that it targets `dpumesh:filter@0.1.x`, and configures one instance to
    /// validate the configuration. Nothing is published; the caller decides.
    pub fn load_filter(
        &self,
        settings: FilterSettings,
        bytes: &[u8],
    ) -> Result<Arc<LoadedFilter>, LoadError> {
        let name = settings.name.clone();
        if settings.memory_cap > self.inner.config.max_memory_bytes {
            return Err(LoadError::Settings {
                filter: name,
                detail: format!(
                    "memory cap of {} MiB exceeds the runtime maximum of {} MiB",
                    settings.memory_cap >> 20,
                    self.inner.config.max_memory_bytes >> 20
                ),
            });
        }
        let hash = content_hash(bytes);
        if crate::proxywasm::is_core_module(bytes) {
            let module = self
                .inner
                .cache
                .get_or_compile_module(&self.inner.engine, &hash, bytes)
                .map_err(|e| compile_error(&name, e))?;
            let config = crate::proxywasm::PluginConfig {
                plugin: settings.config.clone().into_bytes(),
                vm: settings.vm_config.clone().into_bytes(),
                name: name.clone(),
                root_id: settings.root_id.clone(),
                node_metadata: Default::default(),
            };
            let plugin =
                crate::proxywasm::plugin::prepare(&name, &module, &self.inner.pw_linker, config)?;
            return self.publish(settings, FilterKind::ProxyWasm(Arc::new(plugin)), hash);
        }
        let component = self
            .inner
            .cache
            .get_or_compile(&self.inner.engine, &hash, bytes)
            .map_err(|e| compile_error(&name, e))?;
        self.prepare(settings, component, bytes, hash)
    }

    /// Compiles a component ahead of time for this runtime's engine (a `.cwasm`), after
    /// checking it targets `dpumesh:filter@0.1.x`. Loading it back is only for files
    /// this machine produced: see the compile cache.
    pub fn precompile(&self, name: &str, bytes: &[u8]) -> Result<Vec<u8>, LoadError> {
        let engine = &self.inner.engine;
        // Through the compile cache, so loading the same component next is instant.
        let component = self
            .inner
            .cache
            .get_or_compile(engine, &content_hash(bytes), bytes)
            .map_err(|e| compile_error(name, e))?;
        check_imports(name, &component, engine)?;
        component.serialize().map_err(|e| LoadError::Compile {
            filter: name.to_owned(),
            detail: format!("{e:#}"),
        })
    }

    /// Loads a filter from a component file; see [`Runtime::load_filter`].
    pub fn load_filter_file(
        &self,
        settings: FilterSettings,
        path: &Path,
    ) -> Result<Arc<LoadedFilter>, LoadError> {
        let bytes = std::fs::read(path).map_err(|source| LoadError::Io {
            filter: settings.name.clone(),
            path: path.to_owned(),
            source,
        })?;
        self.load_filter(settings, &bytes)
    }

    fn prepare(
        &self,
        settings: FilterSettings,
        component: Component,
        bytes: &[u8],
        hash: String,
    ) -> Result<Arc<LoadedFilter>, LoadError> {
        let name = settings.name.clone();
        check_imports(&name, &component, &self.inner.engine)?;
        let export = |export: &'static str| component.get_export_index(None, export);
        let exports = Exports {
            configure: export("configure"),
            on_request: export("on-request").ok_or_else(|| LoadError::MissingExport {
                filter: name.clone(),
                export: "on-request",
            })?,
            on_response: export("on-response"),
            // DPUMESH_BATCHED_CALLS=off calls `on-request` even where `handle-request`
            // is exported: how the two were measured against each other (see
            // docs/benchmarks.md).
            handle_request: match std::env::var("DPUMESH_BATCHED_CALLS").as_deref() {
                Ok("off") => None,
                _ => export("handle-request"),
            },
            interest: export("interest"),
        };
        let pre =
            self.inner
                .linker
                .instantiate_pre(&component)
                .map_err(|e| LoadError::Instantiate {
                    filter: name.clone(),
                    detail: format!("{e:#}"),
                })?;
        let core = match crate::canon::prepare(
            &self.inner.engine,
            &self.inner.core_linker,
            &self.inner.cache,
            &hash,
            bytes,
            self.inner.config.core_calls,
        ) {
            Ok(core) => Some(Arc::new(core)),
            Err(why) => {
                tracing::debug!(filter = %name, "component calls, not core calls: {why}");
                None
            }
        };
        let kind = FilterKind::Component {
            pre,
            exports,
            bytes: Arc::from(bytes),
            core,
        };
        self.publish(settings, kind, hash)
    }

    /// The loaded filter of `kind`, validated by configuring one instance.
    fn publish(
        &self,
        settings: FilterSettings,
        kind: FilterKind,
        hash: String,
    ) -> Result<Arc<LoadedFilter>, LoadError> {
        let settings_health = settings.health;
        let tag = Arc::new(FilterTag {
            name: Arc::from(settings.name.as_str()),
        });
        let loaded = Arc::new(LoadedFilter {
            settings,
            runtime: self.clone(),
            kind,
            tag,
            health: FilterHealth::new(self.inner.config.clock.clone(), settings_health),
            live: AtomicUsize::new(0),
            initial_memory: AtomicUsize::new(0),
            batched: std::sync::OnceLock::new(),
            hash,
        });
        // Configure one instance now, so a bad configuration is refused at load time
        // rather than at the first request.
        loaded.instantiate()?;
        Ok(loaded)
    }
}

fn compile_error(filter: &str, error: CompileError) -> LoadError {
    let filter = filter.to_owned();
    match error {
        CompileError::NotAComponent(detail) => LoadError::NotAComponent { filter, detail },
        CompileError::Compile(detail) => LoadError::Compile { filter, detail },
    }
}

/// Refuses components built for another version of our package or for another world,
/// with a message naming what they import.
fn check_imports(
    filter: &str,
    component: &Component,
    engine: &wasmtime::Engine,
) -> Result<(), LoadError> {
    let wanted_prefix = format!("{WIT_PACKAGE}/");
    let (major_minor, _) = WIT_VERSION.rsplit_once('.').unwrap_or((WIT_VERSION, ""));
    for (import, _) in component.component_type().imports(engine) {
        if let Some(rest) = import.strip_prefix(&wanted_prefix) {
            let version = rest.split_once('@').map(|(_, v)| v).unwrap_or("");
            let compatible = version
                .strip_prefix(major_minor)
                .is_some_and(|patch| patch.starts_with('.'));
            if !compatible {
                return Err(LoadError::WrongVersion {
                    filter: filter.to_owned(),
                    found: import.to_owned(),
                    expected: WIT_VERSION,
                });
            }
        } else if !import.starts_with("wasi:") && !WORLD_TYPES.contains(&import) {
            return Err(LoadError::UnknownImport {
                filter: filter.to_owned(),
                import: import.to_owned(),
            });
        }
    }
    Ok(())
}

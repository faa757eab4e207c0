//! The policy side of the proxy: turns a config file into a published generation
//! (key sets, filters, chains, routes), and reloads it — whole or not at all — when the
//! file or anything it names changes, or when asked.
//!
//! A reload compiles and configures every filter on the calling thread (never a
//! worker), so requests keep flowing on the old generation meanwhile; only when all of
//! it loaded are the key sets swapped and the new generation published.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use dpumesh_keys::KeySet;
use dpumesh_runtime::{
    FailurePolicy, FilterChain, FilterSettings, Generation, LoadedFilter, Runtime, RuntimeConfig,
    WorkerPool,
};
use parking_lot::Mutex;

use dpumesh_config::{ConfigError, LoadedConfig, RoutePolicy, RouteTable, strip_port};

/// Why a (re)load was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The config file, or a file or filter it names, is wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The runtime or the workers could not start.
    #[error("cannot start the proxy: {0}")]
    Start(String),
}

/// What runs now.
#[derive(Debug)]
pub struct Snapshot {
    /// The published chains.
    pub generation: Arc<Generation>,
    /// Routes into those chains.
    pub routes: RouteTable,
    /// The config they came from.
    pub config: Arc<LoadedConfig>,
    /// Request duration per chain (by index), registered once per generation rather
    /// than looked up by label on every request.
    pub durations: Vec<metrics::Histogram>,
}

/// Where a request goes.
#[derive(Debug, Clone)]
pub struct Routed {
    pub service: String,
    /// Its chain's index in the generation.
    pub chain: usize,
    pub policy: RoutePolicy,
    /// The route's label for metrics, logs and taps ([`CALL_ROUTE`] for a mesh call
    /// that named its service).
    pub route: Arc<str>,
}

/// The route label of a pod's call that named its service (no route matched it).
pub static CALL_ROUTE: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| Arc::from("call"));

impl Snapshot {
    /// The service and chain for a request from outside the mesh (through the
    /// ingress) to `authority` and `path`: the routes alone decide. A host that names a
    /// service gives no way in: only a route (which may match on the host, a virtual
    /// host) exposes a service, with the route's chain.
    pub fn resolve_route(&self, authority: &str, path: &str) -> Option<Routed> {
        self.routes.find(authority, path).map(|m| Routed {
            service: m.service.to_owned(),
            chain: m.chain,
            policy: m.policy,
            route: m.label.clone(),
        })
    }

    /// The service and chain for a call from a pod of the mesh: a call names its
    /// service as the host (`http://user/...`, port ignored) and meets that service's
    /// own chain; any other host goes through the routes, as a request from outside
    /// would.
    pub fn resolve_call(&self, authority: &str, path: &str) -> Option<Routed> {
        let host = strip_port(authority);
        if let Some(service) = self.config.config.services.get(host) {
            let chain = self.generation.chain_index(&service.chain)?;
            let policy = RoutePolicy::of_service(service);
            return Some(Routed {
                service: host.to_owned(),
                chain,
                policy,
                route: Arc::clone(&CALL_ROUTE),
            });
        }
        self.resolve_route(authority, path)
    }

    /// The timeout and retries of service `service` (for requests a peer proxy
    /// already routed).
    pub fn service_policy(&self, service: &str) -> RoutePolicy {
        self.config
            .config
            .services
            .get(service)
            .map(RoutePolicy::of_service)
            .unwrap_or_default()
    }

    fn new(built: Built, config: LoadedConfig) -> Self {
        let durations = built
            .generation
            .chains()
            .iter()
            .map(|c| {
                metrics::histogram!("dpumesh_request_duration_seconds", "chain" => c.name().to_owned())
            })
            .collect();
        Self {
            generation: built.generation,
            routes: built.routes,
            config: Arc::new(config),
            durations,
        }
    }
}

/// The result of a successful reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reloaded {
    /// The new generation.
    pub generation: u64,
    /// Time spent compiling and configuring (before the publish).
    pub build: Duration,
}

/// The running proxy's configuration state.
pub struct Policy {
    file: PathBuf,
    runtime: Runtime,
    pool: WorkerPool,
    snapshot: ArcSwap<Snapshot>,
    /// One reload at a time.
    reloading: Mutex<()>,
    last_error: Mutex<Option<String>>,
    /// The files as they were just before the last (re)load attempt read them: the
    /// watcher reloads when they differ from that, so a change made while a load was
    /// running is never missed, and a failed attempt is not retried until something
    /// changes again.
    attempted: Mutex<Fingerprint>,
    /// Generations of the runners outside the pool (data-plane shards).
    runners: Mutex<Vec<Arc<std::sync::atomic::AtomicU64>>>,
    /// Told of each config published ([`Policy::on_publish`]).
    listeners: Mutex<Vec<PublishListener>>,
}

/// Something told of each published config.
type PublishListener = Box<dyn Fn(&LoadedConfig) + Send + Sync>;

/// A hash of the config file's text (two saves within one timestamp tick must still
/// differ), and size, modification time and file identity (device, inode) of every
/// file it names, symbolic links followed. The identity catches a replaced file
/// that kept size and time: Kubernetes updates a ConfigMap volume by pointing its
/// `..data` link at a new folder, and a copy that preserved times would look the same
/// by size and time alone.
type Fingerprint = (u64, Vec<(PathBuf, Option<Stamp>)>);

/// Modification time, size, device, inode.
type Stamp = (SystemTime, u64, u64, u64);

/// Reads the config file once: the fingerprint of its text and of the files the
/// text names, and the config parsed from that same text. A reload parses its text
/// once (at 50 000 routes the YAML is most of a reload's time).
fn read_config(file: &Path) -> (Fingerprint, Result<LoadedConfig, ConfigError>) {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(e) => {
            let error = ConfigError::file(file, format!("cannot read: {e}"));
            return ((0, Vec::new()), Err(error));
        }
    };
    let hash = text_hash(&text);
    match LoadedConfig::parse(file, text) {
        Ok(config) => {
            let files = config.referenced_files().into_iter().map(stamp);
            ((hash, files.collect()), Ok(config))
        }
        Err(e) => ((hash, Vec::new()), Err(e)),
    }
}

/// The file's fingerprint as of now, for a watcher that last saw `last`: the text's
/// hash and the stamps of the files `last` named, without parsing the text (the
/// watcher looks on every inotify event and every poll; an idle node should not
/// parse YAML that often).
/// When the text changed the files it names may have too, and the reload that follows
/// stamps them anew.
fn look(file: &Path, last: &Fingerprint) -> Fingerprint {
    let hash = std::fs::read_to_string(file).map_or(0, |text| text_hash(&text));
    let files = last.1.iter().map(|(f, _)| stamp(f.clone()));
    (hash, files.collect())
}

fn text_hash(text: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut hasher);
    hasher.finish()
}

fn stamp(f: PathBuf) -> (PathBuf, Option<Stamp>) {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(&f)
        .ok()
        .and_then(|m| Some((m.modified().ok()?, m.len(), m.dev(), m.ino())));
    (f, meta)
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("file", &self.file)
            .field("generation", &self.snapshot.load().generation.number())
            .finish_non_exhaustive()
    }
}

/// `chain` fused when it can be and it pays (a chain with a proxy-wasm plugin cannot,
/// and one whose filters run as core instances is cheaper unfused: both say so in the
/// log); as it is when composing it fails, which is logged as a warning: its filters
/// each loaded, so the chain runs, only without fusion's saving.
fn fused(chain: FilterChain) -> FilterChain {
    if !chain.fusion_pays() {
        tracing::info!(
            chain = chain.name(),
            "chain runs unfused: its filters run as core instances, which costs less"
        );
        return chain;
    }
    if let Some(reason) = chain.unfusable() {
        tracing::info!(chain = chain.name(), "chain runs unfused: {reason}");
        return chain;
    }
    match chain.fuse() {
        Ok(fused) => fused,
        Err(e) => {
            tracing::warn!(chain = chain.name(), error = %e, "chain runs unfused");
            chain
        }
    }
}

/// Instances the pooling allocator must hold: every worker's instance of every chained
/// filter, for the current generation, up to three retired ones and one being built,
/// plus load-time validation instances.
/// Sized at start with room for chains to double, so ordinary reloads fit.
fn pool_slots(config: &LoadedConfig, workers: usize) -> u32 {
    let chained: usize = config.config.chains.values().map(Vec::len).sum();
    let per_generation = workers.saturating_mul(chained.max(1));
    (per_generation.saturating_mul(5) + 16).clamp(64, 4096) as u32
}

fn pool_capacity(config: &LoadedConfig, workers: usize) -> u32 {
    pool_slots(config, workers).saturating_mul(2).min(8192)
}

fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

impl Policy {
    /// Loads `file`, starts the runtime and the workers on generation 1.
    pub fn start(file: &Path) -> Result<Arc<Self>, ReloadError> {
        let (attempted, config) = read_config(file);
        let config = config?;
        let workers = config.config.workers.unwrap_or_else(default_workers);
        let runtime = Runtime::new(RuntimeConfig {
            cache_dir: config
                .config
                .cache_dir
                .as_ref()
                .map(|d| config.resolve(d))
                .or_else(dpumesh_runtime::default_cache_dir),
            max_instances: pool_capacity(&config, workers),
            state_limits: dpumesh_shared_state::StateLimits {
                max_entries: config.config.shared_state.max_entries(),
            },
            ..RuntimeConfig::default()
        })
        .map_err(|e| ReloadError::Start(e.to_string()))?;
        let mut built = build(&runtime, &config, 1)?;
        runtime
            .keys()
            .replace_all(std::mem::take(&mut built.key_sets));
        runtime.services().callouts.set(callout_targets(&config));
        let pool = WorkerPool::start(built.generation.clone(), workers)
            .map_err(|e| ReloadError::Start(format!("starting workers: {e}")))?;
        metrics::gauge!("dpumesh_generation").set(1.0);
        Ok(Arc::new(Self {
            file: file.to_owned(),
            runtime,
            pool,
            snapshot: ArcSwap::from_pointee(Snapshot::new(built, config)),
            reloading: Mutex::new(()),
            last_error: Mutex::new(None),
            attempted: Mutex::new(attempted),
            runners: Mutex::new(Vec::new()),
            listeners: Mutex::new(Vec::new()),
        }))
    }

    /// Calls `listener` with the config now, and again with each one a reload
    /// publishes (on the reloading thread, after the publish).
    pub fn on_publish(&self, listener: impl Fn(&LoadedConfig) + Send + Sync + 'static) {
        listener(&self.snapshot().config);
        self.listeners.lock().push(Box::new(listener));
    }

    /// The config file.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// What runs now.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// The workers.
    pub fn pool(&self) -> &WorkerPool {
        &self.pool
    }

    /// The filter runtime.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// The last reload error, until a reload succeeds.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().clone()
    }

    /// Re-reads the config file and everything it names, and publishes it as the next
    /// generation. On any error nothing changes: the old generation keeps serving.
    pub fn reload(&self) -> Result<Reloaded, ReloadError> {
        let _one = self.reloading.lock();
        let started = Instant::now();
        let result = self.try_reload();
        match &result {
            Ok(done) => {
                metrics::counter!("dpumesh_reloads_total", "result" => "ok").increment(1);
                metrics::gauge!("dpumesh_generation").set(done.generation as f64);
                *self.last_error.lock() = None;
                tracing::info!(
                    generation = done.generation,
                    build_ms = done.build.as_millis() as u64,
                    total_ms = started.elapsed().as_millis() as u64,
                    "config reloaded"
                );
            }
            Err(e) => {
                metrics::counter!("dpumesh_reloads_total", "result" => "failed").increment(1);
                *self.last_error.lock() = Some(e.to_string());
                tracing::error!(error = %e, "reload rejected; the previous generation keeps serving");
            }
        }
        result
    }

    fn try_reload(&self) -> Result<Reloaded, ReloadError> {
        let started = Instant::now();
        let (attempted, config) = read_config(&self.file);
        *self.attempted.lock() = attempted;
        let config = config?;
        let current = self.snapshot();
        let old = &current.config.config;
        let new = &config.config;
        // Workers, sockets, the compile cache and logging are set up once per process.
        for (key, changed) in [
            ("workers", old.workers != new.workers),
            ("admin", old.admin != new.admin),
            ("listener", old.listener != new.listener),
            ("cache_dir", old.cache_dir != new.cache_dir),
            ("shared_state", old.shared_state != new.shared_state),
            ("log", old.log != new.log),
        ] {
            if changed {
                return Err(config
                    .error(key, "changing this needs a restart of the proxy")
                    .into());
            }
        }
        let workers = self.pool.workers();
        let capacity = self.runtime.config().max_instances;
        if pool_slots(&config, workers) > capacity {
            return Err(config
                .error(
                    "chains",
                    format!(
                        "the instance pool was sized at start for {capacity} instances; these chains on {workers} workers need more: restart the proxy to grow it"
                    ),
                )
                .into());
        }
        let number = current.generation.number() + 1;
        let mut built = build(&self.runtime, &config, number)?;
        let build_time = started.elapsed();
        self.runtime
            .keys()
            .replace_all(std::mem::take(&mut built.key_sets));
        self.runtime
            .services()
            .callouts
            .set(callout_targets(&config));
        self.pool
            .publish(built.generation.clone())
            .map_err(|e| ReloadError::Start(e.to_string()))?;
        let snapshot = Arc::new(Snapshot::new(built, config));
        self.snapshot.store(snapshot.clone());
        for listener in self.listeners.lock().iter() {
            listener(&snapshot.config);
        }
        Ok(Reloaded {
            generation: number,
            build: build_time,
        })
    }

    /// Whether every worker and every shard that runs chains inline runs the
    /// published generation.
    pub fn settled(&self) -> bool {
        let current = self.snapshot().generation.number();
        self.pool.worker_generations().iter().all(|g| *g == current)
            && self
                .runners
                .lock()
                .iter()
                .all(|g| g.load(std::sync::atomic::Ordering::Acquire) == current)
    }

    /// A new runner of chains outside the pool (a shard of the data plane): it stores
    /// the generation it runs new requests on here, for [`Policy::settled`].
    pub fn add_runner(&self) -> Arc<std::sync::atomic::AtomicU64> {
        let generation = Arc::new(std::sync::atomic::AtomicU64::new(
            self.snapshot().generation.number(),
        ));
        self.runners.lock().push(generation.clone());
        generation
    }

    /// Watches the config file and the files it names, reloading on change, on a
    /// thread of its own until `self` is dropped.
    pub fn watch(self: &Arc<Self>, every: Duration) -> std::io::Result<()> {
        let policy = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("dpumesh-watch".to_owned())
            .spawn(move || {
                let mut nudge = crate::nudge::Nudge::new();
                loop {
                    // With inotify on every folder, polling is only the fallback
                    // (network filesystems, writes through a mapping): an eighth as
                    // often, so an idle node reads and hashes its policy every 2 s
                    // rather than four times a second.
                    nudge.wait(if nudge.covers() { every * 8 } else { every });
                    let Some(policy) = policy.upgrade() else {
                        return;
                    };
                    let last = policy.attempted.lock().clone();
                    let files = std::iter::once(policy.file.as_path());
                    nudge.watch(files.chain(last.1.iter().map(|(f, _)| f.as_path())));
                    let now = look(&policy.file, &last);
                    if now == last {
                        continue;
                    }
                    // Let a writer finish: reload once the files stop changing. A
                    // fifth of the period: editors and `kubectl` replace a file in
                    // one step, and a reload that read a half-written file fails and
                    // is tried again when the rest lands, so a longer wait would
                    // only delay every reload.
                    std::thread::sleep(every / 5);
                    if look(&policy.file, &last) != now {
                        continue;
                    }
                    tracing::info!("config or a file it names changed; reloading");
                    let _ = policy.reload();
                }
            })?;
        Ok(())
    }
}

/// What filters' HTTP calls may name: the mesh's services and the configured
/// upstreams.
fn callout_targets(config: &LoadedConfig) -> std::collections::BTreeSet<String> {
    let c = &config.config;
    c.services
        .keys()
        .chain(c.upstreams.keys())
        .cloned()
        .collect()
}

/// The runtime's failure policy for the config's.
fn failure_policy(policy: dpumesh_config::FailurePolicy) -> FailurePolicy {
    match policy {
        dpumesh_config::FailurePolicy::FailClosed => FailurePolicy::FailClosed,
        dpumesh_config::FailurePolicy::FailOpen => FailurePolicy::FailOpen,
        dpumesh_config::FailurePolicy::Reload => FailurePolicy::Reload,
    }
}

struct Built {
    generation: Arc<Generation>,
    routes: RouteTable,
    key_sets: Vec<(String, KeySet)>,
}

fn build(runtime: &Runtime, config: &LoadedConfig, number: u64) -> Result<Built, ConfigError> {
    let c = &config.config;
    let read = |path: &Path, key: &str| {
        std::fs::read(config.resolve(path)).map_err(|e| {
            config.error(
                key,
                format!("cannot read {}: {e}", config.resolve(path).display()),
            )
        })
    };
    let mut key_sets = Vec::new();
    for (name, source) in &c.key_sets {
        let key = format!("key_sets.{name}");
        let jwks = match (&source.jwks, &source.jwks_file) {
            (Some(text), _) => Some(text.clone()),
            (None, Some(file)) => Some(
                String::from_utf8(read(file, &key)?)
                    .map_err(|_| config.error(&key, "the JWKS file is not UTF-8"))?,
            ),
            (None, None) => None,
        };
        let set = match jwks {
            Some(jwks) => {
                let set =
                    KeySet::from_jwks(&jwks).map_err(|e| config.error(&key, e.to_string()))?;
                // Envoy's behaviour: the usable keys serve, the others are named.
                for skipped in set.skipped() {
                    tracing::warn!(key_set = %name, "JWKS key skipped: {skipped}");
                }
                set
            }
            None => {
                let secret = match (&source.secret, &source.secret_file) {
                    (Some(secret), _) => secret.as_bytes().to_vec(),
                    (None, Some(file)) => read(file, &key)?,
                    (None, None) => return Err(config.error(&key, "no key source")),
                };
                if secret.is_empty() {
                    return Err(config.error(&key, "the secret is empty"));
                }
                KeySet::from_secret(source.kid.as_deref(), &secret)
            }
        };
        key_sets.push((name.clone(), set));
    }

    let mut loaded: Vec<(&String, Arc<LoadedFilter>)> = Vec::new();
    for (name, f) in &c.filters {
        let key = format!("filters.{name}");
        let bytes = read(&f.component, &format!("{key}.component"))?;
        // A proxy-wasm plugin's configuration is bytes, Envoy's StringValue: a string
        // goes as is (a component gets JSON, quotes and all).
        let plugin = dpumesh_runtime::proxywasm::is_core_module(&bytes);
        let as_config = |value: &serde_json::Value| match value {
            serde_json::Value::String(s) if plugin => s.clone(),
            other => other.to_string(),
        };
        if !plugin && (f.vm_config.is_some() || f.root_id.is_some()) {
            return Err(config.error(
                &key,
                "vm_config and root_id are for proxy-wasm plugins; this component is not one",
            ));
        }
        let filter_config = match (&f.config, &f.config_file) {
            (Some(value), _) => as_config(value),
            (None, Some(file)) => {
                let text = String::from_utf8(read(file, &format!("{key}.config_file"))?)
                    .map_err(|_| config.error(format!("{key}.config_file"), "not UTF-8"))?;
                let yaml = file.extension().is_some_and(|e| e == "yaml" || e == "yml");
                if yaml {
                    let value: serde_json::Value = serde_norway::from_str(&text)
                        .map_err(|e| config.error(format!("{key}.config_file"), e.to_string()))?;
                    value.to_string()
                } else {
                    text
                }
            }
            (None, None) => String::new(),
        };
        let mut settings = FilterSettings::new(name.clone(), filter_config)
            .failure_policy(failure_policy(f.failure_policy));
        if let Some(cap) = f.memory_cap {
            settings = settings.memory_cap(cap.0);
        }
        if let Some(deadline) = f.deadline {
            settings = settings.deadline(deadline.0);
        }
        if let Some(deadline) = f.configure_deadline {
            settings = settings.configure_deadline(deadline.0);
        }
        if let Some(ns) = &f.namespace {
            settings = settings.namespace(ns.clone());
        }
        settings = settings.offload(f.offload);
        if let Some(vm) = &f.vm_config {
            settings.vm_config = as_config(vm);
        }
        if let Some(root_id) = &f.root_id {
            settings.root_id = root_id.clone();
        }
        let filter = runtime
            .load_filter(settings, &bytes)
            .map_err(|e| config.error(&key, e.to_string()))?;
        loaded.push((name, filter));
    }

    let chains: Vec<Arc<FilterChain>> = c
        .chains
        .iter()
        .map(|(name, filters)| {
            let filters = filters
                .iter()
                .filter_map(|f| loaded.iter().find(|(n, _)| *n == f).map(|(_, l)| l.clone()))
                .collect();
            let chain = FilterChain::new(name.clone(), filters);
            Arc::new(if c.fuse_chains { fused(chain) } else { chain })
        })
        .collect();
    let generation = Generation::new(number, chains);
    let routes = RouteTable::new(c, |name| generation.chain_index(name));
    Ok(Built {
        generation,
        routes,
        key_sets,
    })
}

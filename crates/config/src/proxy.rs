//! The proxy config file: YAML, every section checked, every error naming the file,
//! the key path and the line.
//!
//! ```yaml
//! admin: 127.0.0.1:9901          # admin API (/healthz, /metrics, /filters, /reload)
//! admin_token_file: admin.token  # bearer token of its mutations (POST /reload, ...)
//! listener: 127.0.0.1:8080       # loopback HTTP listener answering the verdict
//! workers: 4
//! log: {level: info, format: text}
//! key_sets:
//!   idp: {jwks_file: keys/jwks.json}
//!   shared: {secret: "..."}
//! filters:
//!   jwt:
//!     component: filters/jwt.wasm  # relative to this file
//!     config: {providers: {...}}   # or config_file: jwt.json
//!     failure_policy: fail-closed  # fail-open, reload
//!     memory_cap: 32MiB
//!     deadline: 5ms
//! chains:
//!   api: [jwt]
//! services:
//!   items: {chain: api}
//! routes:
//!   - {host: api.example.com, path_prefix: /api, service: items}
//! ```

use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::error::{ConfigError, parse_yaml};
use crate::units::{ByteSize, Span};

/// Log settings.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// A `tracing` filter: `info`, `dpumesh=debug,warn`, ... (`DPUMESH_LOG` overrides).
    #[serde(default = "default_level")]
    pub level: String,
    /// `auto` (JSON when stderr is not a terminal), `text` or `json`
    /// (`DPUMESH_LOG_FORMAT` overrides).
    #[serde(default)]
    pub format: LogFormat,
}

fn default_level() -> String {
    "info".to_owned()
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: default_level(),
            format: LogFormat::Auto,
        }
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Text on a terminal, JSON lines anywhere else: what a log collector reads
    /// (a container's stderr, a file, a pipe) gets one object per line.
    #[default]
    Auto,
    /// Human-readable, one line per event.
    Text,
    /// One JSON object per line.
    Json,
}

/// What happens to a request when a filter faults (traps, runs past its deadline,
/// exceeds its memory cap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailurePolicy {
    /// Deny with 500 naming the filter and the cause (the default: an authentication
    /// filter that fails must not let requests through).
    #[default]
    FailClosed,
    /// Skip the filter and go on with the chain.
    FailOpen,
    /// Retry the call once on a fresh instance; 500 if that faults too.
    Reload,
}

/// Where a key set comes from (exactly one source).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySetSource {
    /// Inline JWKS (JSON text).
    pub jwks: Option<String>,
    /// JWKS file, relative to the config file.
    pub jwks_file: Option<PathBuf>,
    /// Inline HMAC secret.
    pub secret: Option<String>,
    /// File holding the HMAC secret (bytes as they are).
    pub secret_file: Option<PathBuf>,
    /// `kid` of the secret's key.
    pub kid: Option<String>,
}

/// One filter definition.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterConfig {
    /// The component (`.wasm`), relative to the config file.
    pub component: PathBuf,
    /// Inline configuration, handed to `configure` as JSON.
    pub config: Option<serde_json::Value>,
    /// Configuration file (JSON passed as is; YAML converted to JSON).
    pub config_file: Option<PathBuf>,
    /// `fail-closed` (default), `fail-open` or `reload`.
    #[serde(default)]
    pub failure_policy: FailurePolicy,
    /// Memory cap, e.g. `32MiB` (default 64MiB).
    pub memory_cap: Option<ByteSize>,
    /// CPU deadline per call, e.g. `5ms` (default 5ms).
    pub deadline: Option<Span>,
    /// CPU deadline of `configure` (default 1s; interpreted guests need more).
    pub configure_deadline: Option<Span>,
    /// Shared-state namespace (default: the filter's name).
    pub namespace: Option<String>,
    /// Run chains with this filter on the worker pool instead of inline on the
    /// proxy's shard (default false): for filters whose calls are slow by nature
    /// (Python, JavaScript), so the requests they do not concern are not held up.
    #[serde(default)]
    pub offload: bool,
    /// For a proxy-wasm plugin (a core module): its VM configuration, read in
    /// `proxy_on_vm_start` (a string is passed as is, anything else as JSON).
    pub vm_config: Option<serde_json::Value>,
    /// For a proxy-wasm plugin: its root id (`plugin_root_id`), which root context of
    /// a multi-plugin module runs.
    pub root_id: Option<String>,
}

/// A service: where routed requests go, and the chain they pass.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// The chain for requests to this service.
    pub chain: String,
    /// How long a request to it may take, retries included (default: the mesh's
    /// request timeout).
    pub timeout: Option<Span>,
    /// Retries of failed tries.
    pub retries: Option<RetryConfig>,
    /// How long a streamed answer may go with nothing moving (no part from the
    /// service, no part taken by the client) before it is aborted (default 5m).
    pub stream_idle_timeout: Option<Span>,
    /// Read request bodies whole at the ingress before sending them (up to its
    /// `max_body`, past it 413), so a request can be tried again; by default a body
    /// that does not come at once streams (default false).
    pub buffer_body: Option<bool>,
}

/// An upstream outside the mesh that filters' HTTP calls (proxy-wasm
/// `dispatch_http_call`) may name; mesh services are named by their service name.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// `host:port` (a name is resolved when a call connects), spoken to in HTTP/1.1.
    pub address: String,
}

/// Retrying a request whose try failed: a try that timed out, could not be delivered
/// (pod gone, ring full) or was answered with 502, 503 or 504. Only idempotent methods
/// (GET, HEAD, OPTIONS, PUT, DELETE, TRACE) whose body is still at hand are retried,
/// on the next pod (round robin); a local reply (a denial) never is.
///
/// `grpc_on` names gRPC statuses a gRPC call is retried on (`[unavailable]`). gRPC
/// calls are POSTs: a route that names statuses declares its calls safe to try again,
/// as gRPC's own retry policy does, so they are retried although POST is not
/// idempotent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Tries after the first.
    pub attempts: u32,
    /// Time one try may take (default: the whole timeout).
    pub per_try_timeout: Option<Span>,
    /// gRPC statuses a gRPC call is tried again on (default: none).
    #[serde(default)]
    pub grpc_on: crate::GrpcCodes,
}

/// A route: the first whose host and path prefix match picks the service.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Host to match (`api.example.com`, `*.example.com`); any host when absent.
    pub host: Option<String>,
    /// Path prefix (default `/`).
    #[serde(default = "root")]
    pub path_prefix: String,
    pub service: String,
    /// A chain overriding the service's.
    pub chain: Option<String>,
    /// A timeout overriding the service's.
    pub timeout: Option<Span>,
    /// Retries overriding the service's.
    pub retries: Option<RetryConfig>,
    /// A streamed answer's idle limit overriding the service's.
    pub stream_idle_timeout: Option<Span>,
    /// Whole request bodies (see the service's `buffer_body`), overriding the
    /// service's.
    pub buffer_body: Option<bool>,
    /// Cache its cacheable responses on the node (RFC 9111, shared cache) and answer
    /// from there; the node needs a `store` section in the mesh file.
    pub cache: Option<CacheConfig>,
}

/// A route's response cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    /// The largest body stored (default and at most 48KiB: a hit travels back in
    /// one fabric frame).
    pub max_object: Option<ByteSize>,
    /// Freshness for a response that states none, if its status is cacheable by
    /// default (e.g. `10s`; default: such responses are not stored).
    pub default_ttl: Option<Span>,
}

impl CacheConfig {
    /// The most `max_object` may be.
    pub const MAX_OBJECT: usize = 48 << 10;

    pub fn max_object(&self) -> usize {
        self.max_object.map_or(Self::MAX_OBJECT, |b| b.0)
    }
}

fn root() -> String {
    "/".to_owned()
}

/// `shared_state`: what bounds the filters' node-wide state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedStateConfig {
    /// Most live entries (a rate-limit subject's bucket is one; about 100 bytes
    /// each). Default 1 000 000. A full store refuses new keys until some expire: a
    /// rate limit lets such requests through, or denies them with
    /// `deny_on_state_error`. Changing it needs a restart.
    pub max_entries: Option<usize>,
}

impl SharedStateConfig {
    pub const DEFAULT_MAX_ENTRIES: usize = 1_000_000;

    pub fn max_entries(&self) -> usize {
        self.max_entries.unwrap_or(Self::DEFAULT_MAX_ENTRIES)
    }
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    /// Admin API address.
    pub admin: Option<SocketAddr>,
    /// A file holding the admin API's token (relative to this file): its mutations
    /// (`POST /reload`, `DELETE /store`, `DELETE /cache`) need it as a bearer token.
    /// Without one there are no mutations over the admin API (the file is watched:
    /// saving it reloads). A node of a mesh with identities uses the mesh's admin
    /// token instead (`dpumesh certs --admin-token`).
    pub admin_token_file: Option<PathBuf>,
    /// Loopback test listener address.
    pub listener: Option<SocketAddr>,
    /// Worker threads (default: available cores).
    pub workers: Option<usize>,
    #[serde(default)]
    pub log: LogConfig,
    /// `.cwasm` cache directory (default: the user cache dir).
    pub cache_dir: Option<PathBuf>,
    /// The node's shared state (rate-limit buckets, breaker counters): its size.
    #[serde(default)]
    pub shared_state: SharedStateConfig,
    /// Key sets by name.
    #[serde(default)]
    pub key_sets: BTreeMap<String, KeySetSource>,
    /// Filters by name.
    #[serde(default)]
    pub filters: BTreeMap<String, FilterConfig>,
    /// Chains by name: filter names in order.
    #[serde(default)]
    pub chains: BTreeMap<String, Vec<String>>,
    /// Whether chains of components run fused: composed into one component at load,
    /// so a request enters Wasm once per phase instead of once per filter (each
    /// filter keeps its identity, limits and failure policy; docs/proxy-config.md).
    /// Off trades that speed for loads that skip compiling each chain as a whole.
    #[serde(default = "fuse_by_default")]
    pub fuse_chains: bool,
    /// Services by name.
    #[serde(default)]
    pub services: BTreeMap<String, ServiceConfig>,
    /// Routes, in order.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// Upstreams outside the mesh that filters' HTTP calls may name.
    #[serde(default)]
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    /// A JSON line per request (sampled), with a configurable field list.
    pub access_log: Option<crate::access_log::AccessLogConfig>,
}

fn fuse_by_default() -> bool {
    true
}

/// A parsed and checked config, with the file it came from.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    pub file: PathBuf,
    /// Its text (for locating later errors).
    pub text: String,
    pub config: ProxyConfig,
}

impl LoadedConfig {
    /// Reads, parses and checks `file`.
    pub fn read(file: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(file)
            .map_err(|e| ConfigError::file(file, format!("cannot read: {e}")))?;
        Self::parse(file, text)
    }

    /// Parses and checks `text` as if read from `file`.
    pub fn parse(file: &Path, text: String) -> Result<Self, ConfigError> {
        let config: ProxyConfig = parse_yaml(file, &text)?;
        let loaded = Self {
            file: file.to_owned(),
            text,
            config,
        };
        loaded.check()?;
        Ok(loaded)
    }

    /// An error at key path `path`.
    pub fn error(&self, path: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError::at(&self.file, &self.text, path, message)
    }

    /// `path` relative to the config file's directory.
    pub fn resolve(&self, path: &Path) -> PathBuf {
        match self.file.parent() {
            Some(dir) if path.is_relative() => dir.join(path),
            _ => path.to_owned(),
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        let c = &self.config;
        if c.workers == Some(0) {
            return Err(self.error("workers", "must be at least 1"));
        }
        if c.shared_state.max_entries == Some(0) {
            return Err(self.error("shared_state.max_entries", "must be at least 1"));
        }
        if let Some(log) = &c.access_log {
            log.check().map_err(|e| self.error("access_log", e))?;
        }
        for (name, source) in &c.key_sets {
            let sources = [
                source.jwks.is_some(),
                source.jwks_file.is_some(),
                source.secret.is_some(),
                source.secret_file.is_some(),
            ];
            if sources.iter().filter(|s| **s).count() != 1 {
                return Err(self.error(
                    format!("key_sets.{name}"),
                    "give exactly one of jwks, jwks_file, secret, secret_file",
                ));
            }
        }
        for (name, filter) in &c.filters {
            if filter.config.is_some() && filter.config_file.is_some() {
                return Err(self.error(
                    format!("filters.{name}"),
                    "give config or config_file, not both",
                ));
            }
        }
        for (chain, filters) in &c.chains {
            for (i, filter) in filters.iter().enumerate() {
                if !c.filters.contains_key(filter) {
                    return Err(self.error(
                        format!("chains.{chain}[{i}]"),
                        format!("no filter named {filter:?} under filters"),
                    ));
                }
                if filters[..i].contains(filter) {
                    return Err(self.error(
                        format!("chains.{chain}[{i}]"),
                        format!("filter {filter:?} appears twice in the chain"),
                    ));
                }
            }
        }
        for (name, service) in &c.services {
            if !c.chains.contains_key(&service.chain) {
                return Err(self.error(
                    format!("services.{name}.chain"),
                    format!("no chain named {:?} under chains", service.chain),
                ));
            }
        }
        for (i, route) in c.routes.iter().enumerate() {
            if !c.services.contains_key(&route.service) {
                return Err(self.error(
                    format!("routes[{i}].service"),
                    format!("no service named {:?} under services", route.service),
                ));
            }
            if let Some(chain) = &route.chain
                && !c.chains.contains_key(chain)
            {
                return Err(self.error(
                    format!("routes[{i}].chain"),
                    format!("no chain named {chain:?} under chains"),
                ));
            }
            if !route.path_prefix.starts_with('/') {
                return Err(self.error(format!("routes[{i}].path_prefix"), "must start with /"));
            }
            if let Some(cache) = &route.cache
                && cache.max_object() > CacheConfig::MAX_OBJECT
            {
                return Err(self.error(
                    format!("routes[{i}].cache.max_object"),
                    format!(
                        "at most {} bytes (48KiB): a cached answer travels in one frame",
                        CacheConfig::MAX_OBJECT
                    ),
                ));
            }
        }
        for (name, upstream) in &c.upstreams {
            if c.services.contains_key(name) {
                return Err(self.error(
                    format!("upstreams.{name}"),
                    "a service has this name: a call naming it would be ambiguous",
                ));
            }
            let port = upstream
                .address
                .rsplit_once(':')
                .filter(|(host, _)| !host.is_empty())
                .and_then(|(_, port)| port.parse::<u16>().ok())
                .filter(|port| *port > 0);
            if port.is_none() {
                return Err(self.error(
                    format!("upstreams.{name}.address"),
                    format!("{:?} is not host:port", upstream.address),
                ));
            }
        }
        Ok(())
    }

    /// Every file the config names (components, config files, key files), resolved:
    /// what the watcher watches besides the config itself.
    pub fn referenced_files(&self) -> Vec<PathBuf> {
        let c = &self.config;
        let mut files = Vec::new();
        for filter in c.filters.values() {
            files.push(self.resolve(&filter.component));
            if let Some(f) = &filter.config_file {
                files.push(self.resolve(f));
            }
        }
        for source in c.key_sets.values() {
            for f in [&source.jwks_file, &source.secret_file]
                .into_iter()
                .flatten()
            {
                files.push(self.resolve(f));
            }
        }
        files
    }
}
#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn upstreams_are_host_and_port_and_not_services() {
        let dir = tempfile::tempdir().unwrap();
        let write = |text: &str| {
            let file = dir.path().join("p.yaml");
            std::fs::write(&file, text).unwrap();
            super::LoadedConfig::read(&file)
        };
        let base = "filters: {}\nchains: {api: []}\nservices: {items: {chain: api}}\n";
        let ok = write(&format!(
            "{base}upstreams: {{httpbin: {{address: \"httpbin.org:80\"}}}}\n"
        ))
        .unwrap();
        assert_eq!(ok.config.upstreams["httpbin"].address, "httpbin.org:80");
        let e = write(&format!(
            "{base}upstreams: {{items: {{address: \"a:1\"}}}}\n"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("ambiguous"), "{e}");
        let e = write(&format!(
            "{base}upstreams: {{x: {{address: \"nohost\"}}}}\n"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("not host:port"), "{e}");
        let e = write(&format!(
            "{base}upstreams: {{x: {{address: \"a:1\", tls: true}}}}\n"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("tls"), "{e}");
    }

    use super::*;
    use crate::error::locate;

    const GOOD: &str = r#"
admin: 127.0.0.1:9901
workers: 2
key_sets:
  shared: {secret: "s3cret"}
filters:
  guard:
    component: guard.wasm
    config: {rules: []}
    deadline: 5ms
    memory_cap: 32MiB
  trace:
    component: trace.wasm
chains:
  api: [trace, guard]
services:
  items:
    chain: api
routes:
  - host: api.example.com
    path_prefix: /api
    service: items
  - service: items
"#;

    fn parse(text: &str) -> Result<LoadedConfig, ConfigError> {
        LoadedConfig::parse(Path::new("/etc/dpumesh/proxy.yaml"), text.to_owned())
    }

    #[test]
    fn a_good_config_parses_into_checked_types() {
        let c = parse(GOOD).unwrap();
        let guard = &c.config.filters["guard"];
        assert_eq!(guard.deadline, Some(Span(Duration::from_millis(5))));
        assert_eq!(guard.memory_cap, Some(ByteSize(32 << 20)));
        assert_eq!(guard.failure_policy, FailurePolicy::FailClosed);
        assert_eq!(c.config.routes[1].path_prefix, "/");
        assert_eq!(
            c.resolve(&guard.component),
            PathBuf::from("/etc/dpumesh/guard.wasm")
        );
        assert_eq!(c.referenced_files().len(), 2);
    }

    #[test]
    fn the_shared_state_bound_is_checked() {
        assert_eq!(
            parse(GOOD).unwrap().config.shared_state.max_entries(),
            SharedStateConfig::DEFAULT_MAX_ENTRIES
        );
        let sized = parse(&format!("shared_state: {{max_entries: 5000}}\n{GOOD}")).unwrap();
        assert_eq!(sized.config.shared_state.max_entries(), 5000);
        let e = parse(&format!("shared_state: {{max_entries: 0}}\n{GOOD}")).unwrap_err();
        assert_eq!(e.path, "shared_state.max_entries");
        let e = parse(&format!("shared_state: {{entries: 10}}\n{GOOD}")).unwrap_err();
        assert!(e.to_string().contains("entries"), "{e}");
    }

    #[test]
    fn unknown_keys_are_refused_with_path_and_line() {
        let text = GOOD.replace("    deadline: 5ms", "    deadlien: 5ms");
        let e = parse(&text).unwrap_err();
        assert_eq!(e.path, "filters.guard.deadlien");
        assert_eq!(e.line, Some(10));
        assert!(e.message.contains("unknown field `deadlien`"), "{e}");
        assert!(
            e.to_string()
                .starts_with("/etc/dpumesh/proxy.yaml:10: filters.guard.deadlien: "),
            "{e}"
        );
    }

    #[test]
    fn bad_values_name_their_key() {
        let e = parse(&GOOD.replace("deadline: 5ms", "deadline: 5 parsecs")).unwrap_err();
        assert_eq!(e.path, "filters.guard.deadline");
        assert!(e.message.contains("unknown unit"), "{e}");
        let e = parse(
            &GOOD
                .replace("fail", "x")
                .replace("workers: 2", "workers: two"),
        )
        .unwrap_err();
        assert_eq!(e.path, "workers");
        assert_eq!(e.line, Some(3));
    }

    #[test]
    fn references_are_checked_with_the_line_of_the_reference() {
        let e = parse(&GOOD.replace("[trace, guard]", "[trace, gaurd]")).unwrap_err();
        assert_eq!(e.path, "chains.api[1]");
        assert_eq!(e.line, Some(15), "flow lists are located by their key");
        assert!(e.message.contains("no filter named \"gaurd\""), "{e}");

        let e = parse(&GOOD.replace("    chain: api", "    chain: apj")).unwrap_err();
        assert_eq!(
            (e.path.as_str(), e.line),
            ("services.items.chain", Some(18))
        );

        let e = parse(&GOOD.replace("  - service: items", "  - service: nope")).unwrap_err();
        assert_eq!((e.path.as_str(), e.line), ("routes[1].service", Some(23)));
    }

    #[test]
    fn key_sets_need_exactly_one_source() {
        let e = parse(&GOOD.replace("{secret: \"s3cret\"}", "{secret: a, jwks: b}")).unwrap_err();
        assert_eq!((e.path.as_str(), e.line), ("key_sets.shared", Some(5)));
    }

    #[test]
    fn malformed_yaml_names_the_line() {
        let e = parse("workers: [1,\nadmin: x").unwrap_err();
        assert!(e.line.is_some(), "{e}");
        let e = parse("admin: not-an-address").unwrap_err();
        assert_eq!(e.path, "admin");
    }

    proptest::proptest! {
        /// Whatever the text, parsing ends in a config or an error, never a panic; the
        /// locator never panics either.
        #[test]
        fn arbitrary_text_never_panics(text in "(?s).{0,400}") {
            let _ = parse(&text);
            let _ = locate(&text, "a.b[1].c");
        }

        /// Mutations of a good config (lines dropped, duplicated, re-indented).
        #[test]
        fn mangled_configs_never_panic(
            edits in proptest::collection::vec((0usize..30, 0u8..4), 1..6)
        ) {
            let mut lines: Vec<String> = GOOD.lines().map(str::to_owned).collect();
            for (at, edit) in edits {
                if lines.is_empty() {
                    break;
                }
                let at = at % lines.len();
                match edit {
                    0 => {
                        lines.remove(at);
                    }
                    1 => lines.insert(at, lines[at].clone()),
                    2 => lines[at] = format!("  {}", lines[at]),
                    _ => lines[at] = lines[at].trim_start().to_owned(),
                }
            }
            let text = lines.join("\n");
            if let Err(e) = parse(&text) {
                proptest::prop_assert!(!e.to_string().is_empty());
            }
        }
    }
}

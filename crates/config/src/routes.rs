//! Routing: host and path prefix → service and chain. First match wins, in config
//! order (found through `route_index`, not by a scan).

use crate::proxy::{CacheConfig, ProxyConfig, RetryConfig, ServiceConfig};
use crate::route_index::{HostKey, RouteIndex};
use crate::units::Span;

/// Timeout and retries of a route (or of a service, for mesh calls).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoutePolicy {
    /// Whole-request timeout (`None`: the mesh's default).
    pub timeout: Option<std::time::Duration>,
    /// Tries after the first.
    pub retries: u32,
    /// Time one try may take (`None`: the whole timeout).
    pub per_try_timeout: Option<std::time::Duration>,
    /// gRPC statuses a gRPC call is tried again on.
    pub grpc_retry_on: crate::GrpcCodes,
    /// The route's response cache (routes only; never a service's).
    pub cache: Option<CacheConfig>,
    /// How long a streamed answer may sit with nothing moving (`None`: the mesh's
    /// default).
    pub stream_idle: Option<std::time::Duration>,
    /// Request bodies are read whole at the ingress before they are sent (up to its
    /// `max_body`), rather than streamed when they do not come at once.
    pub buffer_body: bool,
}

impl RoutePolicy {
    /// From a route's (or service's) settings, each falling back to `fallback`'s.
    pub fn new(timeout: Option<Span>, retries: Option<RetryConfig>, fallback: RoutePolicy) -> Self {
        Self {
            timeout: timeout.map(|s| s.0).or(fallback.timeout),
            retries: retries.map_or(fallback.retries, |r| r.attempts),
            per_try_timeout: match retries {
                Some(r) => r.per_try_timeout.map(|s| s.0),
                None => fallback.per_try_timeout,
            },
            grpc_retry_on: retries.map_or(fallback.grpc_retry_on, |r| r.grpc_on),
            cache: None,
            stream_idle: fallback.stream_idle,
            buffer_body: fallback.buffer_body,
        }
    }

    /// A service's own policy.
    pub fn of_service(service: &ServiceConfig) -> Self {
        Self {
            stream_idle: service.stream_idle_timeout.map(|s| s.0),
            buffer_body: service.buffer_body.unwrap_or(false),
            ..Self::new(service.timeout, service.retries, Self::default())
        }
    }
}

/// One route, with its chain resolved to an index in the generation it was built for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Route {
    /// What metrics, logs and taps call it: its host pattern and path prefix
    /// (`*/api`, `hotel.example.com/`), bounded by the configuration.
    label: std::sync::Arc<str>,
    host: HostMatch,
    path_prefix: String,
    service: String,
    chain: usize,
    policy: RoutePolicy,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum HostMatch {
    Any,
    Exact(String),
    /// `*.example.com`: any subdomain (not the apex).
    Suffix(String),
}

impl HostMatch {
    fn new(host: Option<&str>) -> Self {
        match host.map(str::to_ascii_lowercase) {
            None => Self::Any,
            Some(h) if h == "*" => Self::Any,
            Some(h) => match h.strip_prefix('*') {
                Some(suffix) => Self::Suffix(suffix.to_owned()),
                None => Self::Exact(h),
            },
        }
    }

    /// Whether `host` matches (the index's oracle in tests: what a scan would ask).
    #[cfg(test)]
    fn matches(&self, host: &str) -> bool {
        match self {
            Self::Any => true,
            Self::Exact(h) => h.eq_ignore_ascii_case(host),
            Self::Suffix(s) => {
                host.len() > s.len()
                    && host
                        .get(host.len() - s.len()..)
                        .is_some_and(|end| end.eq_ignore_ascii_case(s))
            }
        }
    }
}

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteMatch<'a> {
    pub service: &'a str,
    /// The route's label (its host pattern and path prefix).
    pub label: &'a std::sync::Arc<str>,
    /// The chain's index in the generation.
    pub chain: usize,
    /// Timeout and retries.
    pub policy: RoutePolicy,
}

/// The routes of one generation.
#[derive(Debug, Clone, Default)]
pub struct RouteTable {
    routes: Vec<Route>,
    index: RouteIndex,
}

impl RouteTable {
    /// Builds the table; `chain_index` maps chain names to their index in the
    /// generation (a checked config names only existing chains).
    pub fn new(config: &ProxyConfig, chain_index: impl Fn(&str) -> Option<usize>) -> Self {
        let routes: Vec<Route> = config
            .routes
            .iter()
            .filter_map(|r| {
                let chain_name = r
                    .chain
                    .as_deref()
                    .or_else(|| config.services.get(&r.service).map(|s| s.chain.as_str()))?;
                let service = config
                    .services
                    .get(&r.service)
                    .map(RoutePolicy::of_service)
                    .unwrap_or_default();
                Some(Route {
                    label: format!("{}{}", r.host.as_deref().unwrap_or("*"), r.path_prefix).into(),
                    host: HostMatch::new(r.host.as_deref()),
                    path_prefix: r.path_prefix.clone(),
                    service: r.service.clone(),
                    chain: chain_index(chain_name)?,
                    policy: RoutePolicy {
                        cache: r.cache,
                        stream_idle: r.stream_idle_timeout.map(|s| s.0).or(service.stream_idle),
                        buffer_body: r.buffer_body.unwrap_or(service.buffer_body),
                        ..RoutePolicy::new(r.timeout, r.retries, service)
                    },
                })
            })
            .collect();
        let mut index = RouteIndex::default();
        for (number, r) in routes.iter().enumerate() {
            let host = match &r.host {
                HostMatch::Any => HostKey::Any,
                HostMatch::Exact(h) => HostKey::Exact(h),
                HostMatch::Suffix(s) => HostKey::Suffix(s),
            };
            // A policy of more than 4 billion routes is not one a file holds.
            index.add(host, &r.path_prefix, number as u32);
        }
        Self { routes, index }
    }

    /// The first route matching `host` (port ignored) and `path`.
    pub fn find(&self, host: &str, path: &str) -> Option<RouteMatch<'_>> {
        let number = self.index.find(strip_port(host), path)?;
        let r = &self.routes[number as usize];
        Some(RouteMatch {
            service: &r.service,
            label: &r.label,
            chain: r.chain,
            policy: r.policy,
        })
    }

    /// How many routes the table has.
    pub fn len(&self) -> usize {
        self.routes.len()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}

/// `host` without a `:port` (`[v6]:port` gives `v6`).
pub fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        // [v6]:port
        return host.split_once(']').map_or(host, |(h, _)| &h[1..]);
    }
    match host.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::proxy::LoadedConfig;

    #[test]
    fn first_match_wins_by_host_and_prefix() {
        let text = r#"
filters: {f: {component: f.wasm}}
chains: {a: [f], b: [f], c: [f]}
services: {api: {chain: a}, web: {chain: b}}
routes:
  - {host: api.example.com, path_prefix: /admin, service: api, chain: c}
  - {host: api.example.com, service: api}
  - {host: "*.example.com", service: web}
  - {path_prefix: /health, service: web}
"#;
        let c = LoadedConfig::parse(Path::new("p.yaml"), text.to_owned()).unwrap();
        let table = RouteTable::new(&c.config, |name| {
            ["a", "b", "c"].iter().position(|n| *n == name)
        });
        let find = |host, path| table.find(host, path).map(|m| (m.service, m.chain));
        assert_eq!(find("api.example.com", "/admin/x"), Some(("api", 2)));
        assert_eq!(find("API.example.com:8080", "/items"), Some(("api", 0)));
        assert_eq!(find("www.example.com", "/"), Some(("web", 1)));
        assert_eq!(
            find("example.com", "/"),
            None,
            "the apex is not a subdomain"
        );
        assert_eq!(find("other", "/healthz"), Some(("web", 1)));
        assert_eq!(find("[::1]:80", "/x"), None);
        let label = |host, path| table.find(host, path).map(|m| m.label.to_string());
        assert_eq!(
            label("api.example.com", "/admin/x").unwrap(),
            "api.example.com/admin"
        );
        assert_eq!(label("www.example.com", "/").unwrap(), "*.example.com/");
        assert_eq!(label("other", "/healthz").unwrap(), "*/health");
    }

    /// The index finds what a scan in config order finds, over random tables with
    /// shared, nested and multibyte prefixes and every kind of host pattern.
    #[test]
    fn the_index_finds_what_a_scan_finds() {
        let hosts = [
            "",
            "a.example.com",
            "*.example.com",
            "B.example.com",
            "*",
            "*ample.com",
        ];
        let prefixes = ["/", "/a", "/ab", "/a/b", "/é", "/éa", "/b"];
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for round in 0..200 {
            let mut text = String::from(
                "filters: {f: {component: f.wasm}}\nchains: {a: [f]}\nservices: {s: {chain: a}}\nroutes:\n",
            );
            for _ in 0..1 + next(12) {
                let host = hosts[next(hosts.len())];
                let host = if host.is_empty() {
                    String::new()
                } else {
                    format!("host: \"{host}\", ")
                };
                text += &format!(
                    "  - {{{host}path_prefix: \"{}\", service: s}}\n",
                    prefixes[next(prefixes.len())]
                );
            }
            let c = LoadedConfig::parse(Path::new("p.yaml"), text.clone()).unwrap();
            let table = RouteTable::new(&c.config, |_| Some(0));
            for host in [
                "a.example.com",
                "A.EXAMPLE.com:80",
                "b.example.com",
                "example.com",
                "xample.com",
                "other",
            ] {
                for path in ["/", "/a", "/ab/c", "/a/b", "/éa", "/é", "/x", ""] {
                    let scan = table
                        .routes
                        .iter()
                        .find(|r| {
                            r.host.matches(strip_port(host)) && path.starts_with(&r.path_prefix)
                        })
                        .map(|r| &r.label);
                    assert_eq!(
                        table.find(host, path).map(|m| m.label),
                        scan,
                        "round {round}, {host}{path} in\n{text}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_routes_stream_idle_limit_overrides_its_services() {
        let text = r#"
filters: {f: {component: f.wasm}}
chains: {a: [f]}
services: {api: {chain: a, stream_idle_timeout: 30s}, web: {chain: a}}
routes:
  - {path_prefix: /events, service: api, stream_idle_timeout: 2s}
  - {path_prefix: /api, service: api}
  - {service: web}
"#;
        let c = LoadedConfig::parse(Path::new("p.yaml"), text.to_owned()).unwrap();
        let table = RouteTable::new(&c.config, |_| Some(0));
        let idle = |path| table.find("h", path).and_then(|m| m.policy.stream_idle);
        assert_eq!(idle("/events"), Some(std::time::Duration::from_secs(2)));
        assert_eq!(idle("/api/x"), Some(std::time::Duration::from_secs(30)));
        assert_eq!(idle("/"), None, "the mesh's default");
    }
}

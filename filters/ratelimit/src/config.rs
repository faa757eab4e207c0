//! Configuration: raw serde types checked into [`Config`].

use serde::Deserialize;

/// A token bucket (Envoy `local_ratelimit` token_bucket).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bucket {
    /// Most tokens; the bucket starts full.
    pub max_tokens: u64,
    /// Tokens added per interval (defaults to `max_tokens`).
    #[serde(default)]
    pub tokens_per_fill: Option<u64>,
    /// Interval in milliseconds.
    pub fill_interval_ms: u64,
}

/// One part of a descriptor: a condition, a value source, or both.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Entry {
    /// The value of a request header; no match when absent.
    Header(String),
    /// The path must start with this (a condition; adds no value).
    PathPrefix(String),
    /// A verified JWT claim from metadata (`sub`, or nested `a.b.c`); no match when
    /// the request carries no verified token or the claim is absent.
    Claim(String),
    /// The source IP address.
    SourceIp,
    /// The calling workload's identity (its SPIFFE ID, which the mesh sets for
    /// requests from its pods); no match for requests from outside the mesh.
    SourceIdentity,
    /// The destination service: any (the value is the service) ...
    Destination,
    /// ... or only this one (a condition).
    DestinationIs(String),
    /// The method must be this (a condition).
    Method(String),
}

/// A rate-limit descriptor: all entries must match; the bucket is per distinct value.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDescriptor {
    /// Name (metrics, keys).
    pub name: String,
    /// Entries, all of which must match.
    pub entries: Vec<Entry>,
    /// The bucket for each distinct value.
    pub bucket: Bucket,
}

/// The configuration as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Descriptors, first full match wins.
    #[serde(default)]
    pub descriptors: Vec<RawDescriptor>,
    /// Bucket for requests no descriptor matches; none = unlimited.
    #[serde(default)]
    pub default_bucket: Option<Bucket>,
    /// Add `x-ratelimit-limit/remaining/reset` to 429 replies (Envoy's
    /// `enable_x_ratelimit_headers`).
    #[serde(default = "yes")]
    pub x_ratelimit_headers: bool,
    /// Count and log, never deny.
    #[serde(default)]
    pub shadow: bool,
    /// Status of a denial (429).
    #[serde(default = "too_many")]
    pub status: u16,
    /// Deny when the node's shared state is full (default: allow and count).
    #[serde(default)]
    pub deny_on_state_error: bool,
}

fn yes() -> bool {
    true
}

fn too_many() -> u16 {
    429
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckedBucket {
    /// Capacity.
    pub max_tokens: u64,
    /// Refill per interval.
    pub tokens_per_fill: u64,
    /// Interval, ms.
    pub fill_interval_ms: u64,
}

/// A checked descriptor.
#[derive(Debug, Clone)]
pub struct Descriptor {
    pub name: String,
    pub entries: Vec<Entry>,
    pub bucket: CheckedBucket,
}

/// The checked configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Descriptors in order.
    pub descriptors: Vec<Descriptor>,
    pub default_bucket: Option<CheckedBucket>,
    /// Headers on 429.
    pub x_ratelimit_headers: bool,
    /// Shadow mode.
    pub shadow: bool,
    /// Denial status.
    pub status: u16,
    /// Deny when state is full.
    pub deny_on_state_error: bool,
}

fn check_bucket(what: &str, b: Bucket) -> Result<CheckedBucket, String> {
    if b.max_tokens == 0 {
        return Err(format!("{what}: max_tokens must be at least 1"));
    }
    if b.fill_interval_ms < 1 {
        return Err(format!("{what}: fill_interval_ms must be at least 1"));
    }
    let tokens_per_fill = b.tokens_per_fill.unwrap_or(b.max_tokens);
    if tokens_per_fill == 0 {
        return Err(format!("{what}: tokens_per_fill must be at least 1"));
    }
    Ok(CheckedBucket {
        max_tokens: b.max_tokens,
        tokens_per_fill,
        fill_interval_ms: b.fill_interval_ms,
    })
}

impl TryFrom<RawConfig> for Config {
    type Error = String;

    fn try_from(raw: RawConfig) -> Result<Self, String> {
        if !(400..=599).contains(&raw.status) {
            return Err(format!("status must be a 4xx or 5xx, got {}", raw.status));
        }
        let mut names = std::collections::HashSet::new();
        let descriptors = raw
            .descriptors
            .into_iter()
            .map(|d| {
                if d.name.is_empty() || d.name.contains('|') {
                    return Err(format!(
                        "descriptor name {:?} must be non-empty without '|'",
                        d.name
                    ));
                }
                if !names.insert(d.name.clone()) {
                    return Err(format!("descriptor {} is defined twice", d.name));
                }
                if d.entries.is_empty() {
                    return Err(format!("descriptor {}: entries must not be empty", d.name));
                }
                for entry in &d.entries {
                    if let Entry::PathPrefix(p) = entry
                        && !p.starts_with('/')
                    {
                        return Err(format!(
                            "descriptor {}: path_prefix must start with '/'",
                            d.name
                        ));
                    }
                }
                Ok(Descriptor {
                    bucket: check_bucket(&format!("descriptor {}", d.name), d.bucket)?,
                    name: d.name,
                    entries: d.entries,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Self {
            descriptors,
            default_bucket: raw
                .default_bucket
                .map(|b| check_bucket("default_bucket", b))
                .transpose()?,
            x_ratelimit_headers: raw.x_ratelimit_headers,
            shadow: raw.shadow,
            status: raw.status,
            deny_on_state_error: raw.deny_on_state_error,
        })
    }
}

//! Configuration: providers, token sources and rules, checked at configure time.

use std::collections::BTreeMap;

use dpumesh_filter_sdk::crypto::Algorithm;
use serde::Deserialize;

/// A header a token may arrive in.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HeaderSource {
    /// Header name.
    pub name: String,
    /// Prefix before the token (case-insensitive), e.g. `Bearer `.
    #[serde(default)]
    pub prefix: String,
}

/// A claim copied into a request header.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ClaimToHeader {
    /// Claim, `a.b.c` for nested.
    pub claim: String,
    /// Header to set.
    pub header: String,
}

/// A provider (issuer) as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawProvider {
    /// Required `iss`.
    #[serde(default)]
    pub issuer: Option<String>,
    /// Accepted audiences (`aud` must contain one); empty = not checked.
    #[serde(default)]
    pub audiences: Vec<String>,
    /// Accepted algorithms.
    pub algorithms: Vec<String>,
    /// The host key set holding this issuer's keys.
    pub key_set: String,
    /// Headers to look in (default: `Authorization: Bearer`).
    #[serde(default)]
    pub from_headers: Option<Vec<HeaderSource>>,
    /// Query parameters to look in.
    #[serde(default)]
    pub from_params: Vec<String>,
    /// Cookies to look in.
    #[serde(default)]
    pub from_cookies: Vec<String>,
    /// Allowed clock skew for exp/nbf/iat.
    #[serde(default = "sixty")]
    pub clock_skew_secs: u64,
    /// Reject tokens without `exp`.
    #[serde(default)]
    pub require_expiration: bool,
    /// Reject tokens whose `exp - iat` is longer than this.
    #[serde(default)]
    pub max_lifetime_secs: Option<u64>,
    /// Accepted `typ` header values (case-insensitive); empty = not checked.
    #[serde(default)]
    pub typ: Vec<String>,
    /// Remove the token from the header it came in.
    #[serde(default)]
    pub strip_token: bool,
    /// Put the verified payload (base64url JSON) in this header.
    #[serde(default)]
    pub forward_payload_header: Option<String>,
    /// Copy claims into headers.
    #[serde(default)]
    pub claim_to_headers: Vec<ClaimToHeader>,
    /// Longest token accepted, in bytes.
    #[serde(default = "eight_k")]
    pub max_token_bytes: usize,
}

fn sixty() -> u64 {
    60
}

fn eight_k() -> usize {
    8 * 1024
}

/// What a rule requires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// A valid token is required.
    #[default]
    Required,
    /// No token is fine; a bad one is not.
    AllowMissing,
    /// No token or a bad one is fine (claims are only set when valid).
    AllowMissingOrFailed,
}

/// A rule as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRule {
    /// Path prefix (default `/`).
    #[serde(default = "slash")]
    pub path_prefix: String,
    /// Methods (any when empty).
    #[serde(default)]
    pub methods: Vec<String>,
    /// Provider required; `null` means no authentication for this rule.
    pub provider: Option<String>,
    /// How strict.
    #[serde(default)]
    pub mode: Mode,
}

fn slash() -> String {
    "/".to_owned()
}

/// The configuration as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Providers by name.
    pub providers: BTreeMap<String, RawProvider>,
    /// Rules, first match wins; no match = no requirement.
    pub rules: Vec<RawRule>,
    /// Verified-token cache size per instance (0 disables).
    #[serde(default = "thousand")]
    pub cache_entries: usize,
}

fn thousand() -> usize {
    1000
}

/// A checked provider.
#[derive(Debug, Clone)]
pub struct Provider {
    pub name: String,
    /// As written, with checked fields below.
    pub raw: RawProvider,
    /// Parsed algorithms.
    pub algorithms: Vec<Algorithm>,
    /// Token sources in order.
    pub headers: Vec<HeaderSource>,
}

/// A checked rule.
#[derive(Debug, Clone)]
pub struct Rule {
    pub path_prefix: String,
    pub methods: Vec<String>,
    /// Provider index.
    pub provider: Option<usize>,
    pub mode: Mode,
}

/// The checked configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub providers: Vec<Provider>,
    pub rules: Vec<Rule>,
    /// Cache size.
    pub cache_entries: usize,
}

impl TryFrom<RawConfig> for Config {
    type Error = String;

    fn try_from(raw: RawConfig) -> Result<Self, String> {
        let mut names = Vec::new();
        let mut providers = Vec::new();
        for (name, p) in raw.providers {
            if p.algorithms.is_empty() {
                return Err(format!("provider {name}: algorithms must not be empty"));
            }
            let algorithms = p
                .algorithms
                .iter()
                .map(|a| {
                    a.parse::<Algorithm>()
                        .map_err(|e| format!("provider {name}: {e}"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            // A provider mixing HMAC with public-key algorithms is the setup the
            // alg-confusion attack needs; refuse it outright.
            let hmac = algorithms
                .iter()
                .filter(|a| matches!(a, Algorithm::Hs256 | Algorithm::Hs384 | Algorithm::Hs512))
                .count();
            if hmac > 0 && hmac < algorithms.len() {
                return Err(format!(
                    "provider {name}: do not mix HMAC and public-key algorithms in one provider"
                ));
            }
            if p.max_token_bytes == 0 {
                return Err(format!(
                    "provider {name}: max_token_bytes must be at least 1"
                ));
            }
            let headers = p.from_headers.clone().unwrap_or_else(|| {
                if p.from_params.is_empty() && p.from_cookies.is_empty() {
                    vec![HeaderSource {
                        name: "authorization".to_owned(),
                        prefix: "Bearer ".to_owned(),
                    }]
                } else {
                    Vec::new()
                }
            });
            names.push(name.clone());
            providers.push(Provider {
                name,
                raw: p,
                algorithms,
                headers,
            });
        }
        let rules = raw
            .rules
            .into_iter()
            .map(|r| {
                if !r.path_prefix.starts_with('/') {
                    return Err(format!(
                        "rule path_prefix {:?} must start with '/'",
                        r.path_prefix
                    ));
                }
                let provider = r
                    .provider
                    .map(|p| {
                        names.iter().position(|n| *n == p).ok_or_else(|| {
                            format!("rule for {}: unknown provider {p:?}", r.path_prefix)
                        })
                    })
                    .transpose()?;
                Ok(Rule {
                    path_prefix: r.path_prefix,
                    methods: r.methods,
                    provider,
                    mode: r.mode,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Self {
            providers,
            rules,
            cache_entries: raw.cache_entries,
        })
    }
}

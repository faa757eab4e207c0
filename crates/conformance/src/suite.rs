//! The suite file format (YAML or JSON). See `crates/conformance/README.md`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A whole suite: one filter configuration, a fixed clock, key sets, tokens, cases.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Suite {
    /// Suite name, shown in reports.
    pub suite: String,
    /// What the suite checks.
    #[serde(default)]
    pub description: String,
    /// The filter configuration: any YAML value, passed to `configure` as JSON. A string
    /// is passed as is.
    #[serde(default)]
    pub config: Option<serde_json::Value>,
    /// Unix seconds the clock starts at (default 1 700 000 000).
    #[serde(default = "default_clock")]
    pub clock: u64,
    /// Key sets the host loads, by name.
    #[serde(default)]
    pub keys: BTreeMap<String, KeySource>,
    /// Tokens the runner signs before the cases, referenced as `${token.NAME}`.
    #[serde(default)]
    pub tokens: BTreeMap<String, TokenSpec>,
    /// The cases, run in order against one instance (state carries over).
    pub cases: Vec<Case>,
    /// Where the suite was loaded from (relative paths resolve against its folder).
    #[serde(skip)]
    pub path: PathBuf,
}

fn default_clock() -> u64 {
    1_700_000_000
}

/// Where a key set comes from: exactly one of `jwks`, `jwks_file`, `secret`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySource {
    /// A JWKS document, inline.
    #[serde(default)]
    pub jwks: Option<serde_json::Value>,
    /// A JWKS file, relative to the suite.
    #[serde(default)]
    pub jwks_file: Option<PathBuf>,
    /// One HMAC secret (its UTF-8 bytes).
    #[serde(default)]
    pub secret: Option<String>,
    /// The secret's key id.
    #[serde(default)]
    pub kid: Option<String>,
}

/// A token the runner signs (or a literal one, for hostile cases).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenSpec {
    /// Algorithm, e.g. `RS256`.
    #[serde(default)]
    pub alg: Option<String>,
    /// PEM private key file (RSA/EC/Ed25519), relative to the suite.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// HMAC secret (UTF-8 bytes).
    #[serde(default)]
    pub secret: Option<String>,
    /// Extra header fields (`kid`, `typ`, `crit`, ...), merged over `{alg, typ: JWT}`.
    #[serde(default)]
    pub header: serde_json::Map<String, serde_json::Value>,
    /// Claims. Strings of the form `now`, `now+N` or `now-N` become Unix seconds
    /// relative to the suite clock.
    #[serde(default)]
    pub claims: serde_json::Map<String, serde_json::Value>,
    /// A literal token, used as is (everything else ignored).
    #[serde(default)]
    pub raw: Option<String>,
    /// After signing, add `"tampered": true` to the payload and keep the signature (a
    /// token whose signature no longer verifies).
    #[serde(default)]
    pub tamper: bool,
    /// Add a claim `pad` of this many bytes (for size limits).
    #[serde(default)]
    pub pad_claim_bytes: usize,
}

/// One request and what must come of it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// Case name.
    pub name: String,
    /// Milliseconds to move the clock forward before the case.
    #[serde(default)]
    pub advance_ms: u64,
    /// How many times to send the request (the expectation applies to the last).
    #[serde(default = "one")]
    pub repeat: u32,
    /// The request.
    pub request: RequestSpec,
    /// What must happen.
    pub expect: Expect,
    /// A simulated response to run `on-response` with, after the request phase.
    #[serde(default)]
    pub response: Option<ResponseSpec>,
    /// Answers to the HTTP calls a filter makes while the request is paused
    /// (proxy-wasm `dispatch_http_call`), in the order the calls are made.
    #[serde(default)]
    pub calls: Vec<CallSpec>,
}

/// A simulated answer to one HTTP call a filter makes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallSpec {
    /// The upstream the call must name (any when absent).
    #[serde(default)]
    pub upstream: Option<String>,
    /// The call's `:path` must be this (any when absent).
    #[serde(default)]
    pub path: Option<String>,
    /// Response status (default 200).
    #[serde(default = "ok_status")]
    pub status: u16,
    /// Response headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Response body.
    #[serde(default)]
    pub body: String,
    /// The call fails instead (timeout, refused): the reason given.
    #[serde(default)]
    pub fail: Option<String>,
}

fn ok_status() -> u16 {
    200
}

fn one() -> u32 {
    1
}

/// A request head.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestSpec {
    /// Method (default `GET`).
    #[serde(default = "get")]
    pub method: String,
    /// Path with optional query, e.g. `/api?x=1`.
    #[serde(default = "slash")]
    pub path: String,
    /// Authority (default `example.com`).
    #[serde(default = "authority")]
    pub authority: String,
    /// Scheme (default `http`).
    #[serde(default = "http")]
    pub scheme: String,
    /// Headers in order, as `[name, value]` pairs; `${token.NAME}` is substituted.
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    /// Source `ip:port` (default `10.0.0.1:40000`).
    #[serde(default = "source")]
    pub source: String,
    /// Source workload identity.
    #[serde(default)]
    pub identity: Option<String>,
    /// Destination service.
    #[serde(default)]
    pub destination: Option<String>,
    /// Metadata as an earlier filter would have set it.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

fn get() -> String {
    "GET".to_owned()
}
fn slash() -> String {
    "/".to_owned()
}
fn authority() -> String {
    "example.com".to_owned()
}
fn http() -> String {
    "http".to_owned()
}
fn source() -> String {
    "10.0.0.1:40000".to_owned()
}

/// The expected verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Forward.
    Continue,
    /// Local reply.
    Deny,
}

/// What must come of a case. Only what is given is checked.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// Continue or deny.
    pub verdict: Verdict,
    /// Status of the local reply.
    #[serde(default)]
    pub status: Option<u16>,
    /// Headers of the local reply: a value must match exactly; `null` means absent.
    #[serde(default)]
    pub reply_headers: BTreeMap<String, Option<String>>,
    /// Substrings the local reply's headers must contain (`name: substring`).
    #[serde(default)]
    pub reply_headers_contain: BTreeMap<String, String>,
    /// A substring the local reply's body must contain.
    #[serde(default)]
    pub body_contains: Option<String>,
    /// Request headers after the filter: exact value, or `null` for absent.
    #[serde(default)]
    pub headers: BTreeMap<String, Option<String>>,
    /// Request headers that must match a pattern: the value must start with the given
    /// text (useful for generated ids).
    #[serde(default)]
    pub headers_start_with: BTreeMap<String, String>,
    /// Request headers that must end with the given text.
    #[serde(default)]
    pub headers_end_with: BTreeMap<String, String>,
    /// Request headers whose value must match the given length.
    #[serde(default)]
    pub header_lengths: BTreeMap<String, usize>,
    /// Metadata after the filter: exact value, or `null` for absent.
    #[serde(default)]
    pub metadata: BTreeMap<String, Option<String>>,
}

/// A simulated response for `on-response`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseSpec {
    /// Status.
    pub status: u16,
    /// `none`, `connect-failure`, `upstream-reset`, `timeout`, `local-reply`, `internal`.
    #[serde(default = "none")]
    pub failure: String,
    /// Latency in milliseconds.
    #[serde(default)]
    pub latency_ms: u64,
    /// Upstream endpoint.
    #[serde(default)]
    pub upstream: Option<String>,
}

fn none() -> String {
    "none".to_owned()
}

/// Why a suite could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SuiteError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid suite.
    #[error("{path}{}: {message}", location.map(|(l, c)| format!(":{l}:{c}")).unwrap_or_default())]
    Parse {
        /// The file.
        path: PathBuf,
        /// Line and column, when known.
        location: Option<(usize, usize)>,
        /// What is wrong.
        message: String,
    },
}

impl Suite {
    /// Loads a suite file (YAML, which includes JSON).
    pub fn load(path: &Path) -> Result<Self, SuiteError> {
        let text = std::fs::read_to_string(path).map_err(|source| SuiteError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses suite text; `path` names it in errors and anchors relative paths.
    pub fn parse(text: &str, path: &Path) -> Result<Self, SuiteError> {
        let mut suite: Suite = serde_norway::from_str(text).map_err(|e| SuiteError::Parse {
            path: path.to_owned(),
            location: e.location().map(|l| (l.line(), l.column())),
            message: e.to_string(),
        })?;
        suite.path = path.to_owned();
        Ok(suite)
    }

    /// Resolves `relative` against the suite's folder.
    pub fn resolve(&self, relative: &Path) -> PathBuf {
        match self.path.parent() {
            Some(dir) if relative.is_relative() => dir.join(relative),
            _ => relative.to_owned(),
        }
    }

    /// The configuration string passed to `configure`.
    pub fn config_string(&self) -> String {
        match &self.config {
            None => String::new(),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(value) => value.to_string(),
        }
    }
}

//! Verified JWT claims, parsed once and read by name.
//!
//! The JWT filter leaves the verified payload in request metadata (`jwt.payload`, JSON
//! text). Filters after it (RBAC, rate limit) used to parse that text again, each, on
//! every request. Now the proxy parses it once, keeps it parsed (a small cache keyed by
//! the text, so a token seen again is not parsed again), and hands a filter only the
//! claims it names, typed: a string, a list of strings, or anything else as JSON.
//!
//! The same types serve the filter SDK (guest side) and the mock proxy, so a filter's
//! native tests read claims exactly as it will in the proxy.

#![forbid(unsafe_code)]

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

/// The metadata key under which the JWT filter leaves the verified payload.
pub const PAYLOAD_KEY: &str = "jwt.payload";

/// One claim's value, as `request-head.claims` hands it to a filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// A string claim (`sub`, `scope`).
    Text(String),
    /// An array whose items are all strings (`roles`, `groups`, an `aud` list).
    TextList(Vec<String>),
    /// Any other value (number, boolean, null, object, mixed array) as compact JSON.
    Json(String),
}

impl Claim {
    /// The claim of a JSON value.
    pub fn of(value: &Value) -> Self {
        match value {
            Value::String(s) => Self::Text(s.clone()),
            Value::Array(items) if items.iter().all(Value::is_string) => Self::TextList(
                items
                    .iter()
                    .filter_map(|i| i.as_str().map(str::to_owned))
                    .collect(),
            ),
            other => Self::Json(other.to_string()),
        }
    }

    /// The claim as a string, if it is one.
    pub fn as_text(&self) -> Option<&str> {
        match self {
            Self::Text(s) => Some(s),
            _ => None,
        }
    }

    /// The claim as the JWT filter writes one to metadata (`jwt.claim.<name>`): strings
    /// as they are, everything else as compact JSON. Rate-limit bucket keys are made of
    /// this text, so it must not change between versions.
    pub fn render(&self) -> Cow<'_, str> {
        match self {
            Self::Text(s) => Cow::Borrowed(s),
            Self::TextList(items) => {
                Cow::Owned(serde_json::to_string(items).unwrap_or_else(|_| String::from("[]")))
            }
            Self::Json(json) => Cow::Borrowed(json),
        }
    }
}

/// A verified payload, parsed: a JSON object.
#[derive(Debug, Clone, PartialEq)]
pub struct Claims(serde_json::Map<String, Value>);

impl Claims {
    /// Parses a payload; `None` unless it is a JSON object (as RBAC always required:
    /// anything else counts as no verified token).
    pub fn parse(payload: &str) -> Option<Self> {
        match serde_json::from_str::<Value>(payload) {
            Ok(Value::Object(map)) => Some(Self(map)),
            _ => None,
        }
    }

    /// The value at `path`: a claim name, `a.b` walking into objects.
    pub fn value(&self, path: &str) -> Option<&Value> {
        let mut parts = path.split('.');
        let first = self.0.get(parts.next()?)?;
        parts.try_fold(first, |v, part| v.get(part))
    }

    /// The claim at `path`, typed.
    pub fn claim(&self, path: &str) -> Option<Claim> {
        self.value(path).map(Claim::of)
    }

    /// The claims at `paths`, in order.
    pub fn claims<S: AsRef<str>>(&self, paths: &[S]) -> Vec<Option<Claim>> {
        paths.iter().map(|p| self.claim(p.as_ref())).collect()
    }
}

/// Payloads longer than this are parsed each time rather than kept.
const MAX_CACHED_PAYLOAD: usize = 8 * 1024;
/// Distinct payloads kept at most; the memo starts over when full.
const MAX_ENTRIES: usize = 64;

/// Parsed payloads by their text, so the claims of a token seen again (the JWT
/// filter's memo of verified tokens hands out the same payload text for it) are not parsed again.
/// Bounded: at most 64 payloads of at most 8 KiB each are kept.
#[derive(Debug, Default)]
pub struct ParsedClaims {
    parsed: HashMap<Box<str>, Option<Arc<Claims>>>,
    parses: u64,
}

impl ParsedClaims {
    /// None parsed yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The claims of `payload`, parsed now or earlier; `None` if it is not a JSON
    /// object.
    pub fn get(&mut self, payload: &str) -> Option<Arc<Claims>> {
        if let Some(parsed) = self.parsed.get(payload) {
            return parsed.clone();
        }
        self.parses += 1;
        let parsed = Claims::parse(payload).map(Arc::new);
        if payload.len() <= MAX_CACHED_PAYLOAD {
            if self.parsed.len() >= MAX_ENTRIES {
                self.parsed.clear();
            }
            self.parsed.insert(payload.into(), parsed.clone());
        }
        parsed
    }

    /// How many payloads were parsed (not found in the cache) so far.
    pub fn parses(&self) -> u64 {
        self.parses
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAYLOAD: &str = r#"{"sub":"alice","roles":["user","admin"],"scope":"read write","exp":1700000000,"org":{"id":42,"name":"acme","tags":["a",1]},"admin":true,"n":null}"#;

    #[test]
    fn claims_are_typed() {
        let c = Claims::parse(PAYLOAD).unwrap();
        assert_eq!(c.claim("sub"), Some(Claim::Text("alice".into())));
        assert_eq!(
            c.claim("roles"),
            Some(Claim::TextList(vec!["user".into(), "admin".into()]))
        );
        assert_eq!(c.claim("exp"), Some(Claim::Json("1700000000".into())));
        assert_eq!(c.claim("admin"), Some(Claim::Json("true".into())));
        assert_eq!(c.claim("n"), Some(Claim::Json("null".into())));
        assert_eq!(c.claim("org.id"), Some(Claim::Json("42".into())));
        assert_eq!(c.claim("org.name"), Some(Claim::Text("acme".into())));
        assert_eq!(c.claim("org.tags"), Some(Claim::Json(r#"["a",1]"#.into())));
        assert_eq!(c.claim("org.missing"), None);
        assert_eq!(c.claim("sub.deeper"), None);
        assert_eq!(c.claim("roles.0"), None, "paths walk objects only");
        assert_eq!(c.claim("nope"), None);
        assert_eq!(
            c.claims(&["sub", "nope"]),
            vec![Some(Claim::Text("alice".into())), None]
        );
    }

    #[test]
    fn only_objects_are_claims() {
        for payload in ["", "[]", "\"x\"", "42", "{", "{\"a\":1", "null"] {
            assert_eq!(Claims::parse(payload), None, "{payload:?}");
        }
        assert!(Claims::parse("{}").is_some());
    }

    /// The text of a claim equals what the JWT filter writes to metadata and what rate
    /// limit built bucket keys from before claims were typed: strings raw, everything
    /// else `serde_json::Value::to_string`.
    #[test]
    fn rendering_equals_the_metadata_form() {
        let payload: Value = serde_json::from_str(PAYLOAD).unwrap();
        let c = Claims::parse(PAYLOAD).unwrap();
        for path in [
            "sub", "roles", "scope", "exp", "org", "org.id", "org.tags", "admin", "n",
        ] {
            let value = path
                .split('.')
                .try_fold(&payload, |v, part| v.get(part))
                .unwrap();
            let old = match value {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            assert_eq!(c.claim(path).unwrap().render(), old, "{path}");
        }
        let escaped = Claims::parse(r#"{"l":["a\"b","c\\d","\u00e9\n"]}"#).unwrap();
        assert_eq!(
            escaped.claim("l").unwrap().render(),
            r#"["a\"b","c\\d","é\n"]"#
        );
    }

    #[test]
    fn the_cache_parses_a_payload_once_and_stays_bounded() {
        let mut cache = ParsedClaims::new();
        let a = cache.get(PAYLOAD).unwrap();
        let b = cache.get(PAYLOAD).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(cache.parses(), 1);
        assert!(cache.get("not json").is_none());
        assert!(cache.get("not json").is_none());
        assert_eq!(cache.parses(), 2, "a refusal is kept too");
        for i in 0..(MAX_ENTRIES * 3) {
            let payload = format!("{{\"sub\":\"user-{i}\"}}");
            let claims = cache.get(&payload).unwrap();
            assert_eq!(claims.claim("sub"), Some(Claim::Text(format!("user-{i}"))));
            assert!(cache.parsed.len() <= MAX_ENTRIES);
        }
        let long = format!("{{\"sub\":\"{}\"}}", "x".repeat(MAX_CACHED_PAYLOAD));
        let before = cache.parses();
        assert!(cache.get(&long).is_some());
        assert!(cache.get(&long).is_some());
        assert_eq!(cache.parses(), before + 2, "long payloads are not kept");
    }
}

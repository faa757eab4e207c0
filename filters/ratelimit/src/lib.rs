//! `ratelimit`: node-wide token buckets, chosen by descriptor.
//!
//! Descriptors are checked in order; the first whose entries all match picks the
//! bucket, one bucket per distinct value (so `[{claim: sub}]` limits each subject).
//! Requests no descriptor matches use `default_bucket`, or are not limited. Every
//! worker shares each bucket through the host's atomic `token-bucket-take`, so the
//! limit holds for the node, not per worker. Buckets refill in whole intervals, as
//! Envoy's `local_ratelimit` does.
//!
//! Where we differ from Envoy: the `x-ratelimit-*` headers go on 429 replies only; the
//! filter world has no response-header mutation yet, so allowed responses carry none.
//! Metrics: `ratelimit_requests_total{descriptor, result=allowed|limited|shadow_limited}`.

#![forbid(unsafe_code)]

pub mod config;

use dpumesh_filter_sdk::metrics::Counter;
use dpumesh_filter_sdk::shared::{self, TokenBucket};
use dpumesh_filter_sdk::{Filter, Interest, LocalReply, Request, Verdict, export_filter, log};
use sha2::{Digest, Sha256};

use crate::config::{CheckedBucket, Config, Entry, RawConfig};

/// Keys longer than this are hashed (the host limits keys to 256 bytes).
const MAX_PLAIN_KEY: usize = 200;

/// The filter.
#[derive(Debug)]
pub struct RateLimit {
    config: Config,
    /// Counters per descriptor (the default bucket last), defined once at configure
    /// time so the request path never allocates for metrics.
    counters: Vec<Outcomes>,
}

/// The counters of one descriptor, by result.
#[derive(Debug)]
struct Outcomes {
    allowed: Counter,
    limited: Counter,
    shadow_limited: Counter,
    state_error: Counter,
}

impl Outcomes {
    fn new(descriptor: &str) -> Result<Self, String> {
        let counter = |result: &str| {
            Counter::new(
                "ratelimit_requests_total",
                &[("descriptor", descriptor), ("result", result)],
            )
            .map_err(|e| e.to_string())
        };
        Ok(Self {
            allowed: counter("allowed")?,
            limited: counter("limited")?,
            shadow_limited: counter("shadow_limited")?,
            state_error: counter("state_error")?,
        })
    }
}

/// A JWT claim as text (strings as they are, anything else as JSON): top-level claims
/// from the metadata the JWT filter leaves (`jwt.claim.<name>`, handed in with the
/// call), nested paths from the proxy, which keeps the verified payload parsed.
pub fn claim(req: &Request<'_>, path: &str) -> Option<String> {
    if !path.contains('.') {
        return req.metadata(&format!("jwt.claim.{path}"));
    }
    let claim = req.claims(&[path])?.pop()??;
    Some(claim.render().into_owned())
}

/// The values a descriptor's entries produce, or `None` if one does not match.
fn extract(entries: &[Entry], req: &Request<'_>) -> Option<Vec<String>> {
    let mut values = Vec::new();
    for entry in entries {
        match entry {
            Entry::Header(name) => values.push(req.header(name)?),
            Entry::PathPrefix(prefix) => {
                if !req.path().starts_with(prefix.as_str()) {
                    return None;
                }
            }
            Entry::Claim(path) => values.push(claim(req, path)?),
            Entry::SourceIp => values.push(req.source().address),
            Entry::SourceIdentity => values.push(req.source().identity?),
            Entry::Destination => values.push(req.destination()?),
            Entry::DestinationIs(service) => {
                if req.destination().as_deref() != Some(service.as_str()) {
                    return None;
                }
            }
            Entry::Method(method) => {
                if !req.method().eq_ignore_ascii_case(method) {
                    return None;
                }
            }
        }
    }
    Some(values)
}

/// The shared-state key of a bucket: descriptor name and values, hashed when long.
fn bucket_key(name: &str, values: &[String]) -> String {
    let plain = std::iter::once(name)
        .chain(values.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("|");
    if plain.len() <= MAX_PLAIN_KEY {
        plain
    } else {
        format!("{name}#{}", hex::encode(Sha256::digest(plain.as_bytes())))
    }
}

fn secs_ceil(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

impl RateLimit {
    /// `index` is the descriptor's position, or the number of descriptors for the
    /// default bucket.
    fn take(&self, index: usize, key: &str, bucket: CheckedBucket) -> Verdict {
        let counters = &self.counters[index];
        let descriptor = self
            .config
            .descriptors
            .get(index)
            .map_or("default", |d| d.name.as_str());
        let spec = TokenBucket {
            capacity: bucket.max_tokens,
            refill_tokens: bucket.tokens_per_fill,
            refill_interval_ms: bucket.fill_interval_ms,
        };
        let result = match shared::token_bucket_take(key, spec, 1) {
            Ok(result) => result,
            Err(e) => {
                counters.state_error.increment(1);
                log::warn(&format!(
                    "rate limit state unavailable ({e}); {}",
                    if self.config.deny_on_state_error {
                        "denying"
                    } else {
                        "allowing"
                    }
                ));
                return if self.config.deny_on_state_error {
                    LocalReply::new(503).body("rate limit unavailable\n").into()
                } else {
                    Verdict::Continue
                };
            }
        };
        if result.allowed {
            counters.allowed.increment(1);
            return Verdict::Continue;
        }
        if self.config.shadow {
            counters.shadow_limited.increment(1);
            dpumesh_filter_sdk::log!(
                log::Level::Info,
                "shadow: would rate-limit descriptor {descriptor}"
            );
            return Verdict::Continue;
        }
        counters.limited.increment(1);
        let reset = secs_ceil(result.reset_after_ms);
        let mut reply = LocalReply::new(self.config.status)
            .header("content-type", "text/plain")
            .header("retry-after", reset.to_string())
            .body("rate limited\n");
        if self.config.x_ratelimit_headers {
            reply = reply
                .header("x-ratelimit-limit", bucket.max_tokens.to_string())
                .header("x-ratelimit-remaining", result.remaining.to_string())
                .header("x-ratelimit-reset", reset.to_string());
        }
        reply.into()
    }
}

impl Filter for RateLimit {
    type Config = RawConfig;

    /// The headers and the top-level claims the descriptors name (as
    /// `jwt.claim.<name>`); nested claims are asked of the proxy when needed.
    fn interest(&self) -> Interest {
        let mut interest = Interest::default();
        for descriptor in &self.config.descriptors {
            for entry in &descriptor.entries {
                interest = match entry {
                    Entry::Header(name) => interest.header(name),
                    Entry::Claim(path) if path.contains('.') => interest,
                    Entry::Claim(path) => interest.metadata(format!("jwt.claim.{path}")),
                    _ => interest,
                };
            }
        }
        interest.headers.sort();
        interest.headers.dedup();
        interest.metadata.sort();
        interest.metadata.dedup();
        interest
    }

    fn new(raw: RawConfig) -> Result<Self, String> {
        let config = Config::try_from(raw)?;
        let counters = config
            .descriptors
            .iter()
            .map(|d| d.name.as_str())
            .chain(std::iter::once("default"))
            .map(Outcomes::new)
            .collect::<Result<_, _>>()?;
        Ok(Self { config, counters })
    }

    fn on_request(&mut self, req: &Request<'_>) -> Verdict {
        let descriptors = &self.config.descriptors;
        let matched = descriptors
            .iter()
            .enumerate()
            .find_map(|(i, d)| extract(&d.entries, req).map(|values| (i, d, values)));
        match matched {
            Some((index, descriptor, values)) => {
                let key = bucket_key(&descriptor.name, &values);
                self.take(index, &key, descriptor.bucket)
            }
            None => match self.config.default_bucket {
                Some(bucket) => self.take(descriptors.len(), "default", bucket),
                None => Verdict::Continue,
            },
        }
    }
}

export_filter!(RateLimit);

#[cfg(test)]
mod tests {
    use dpumesh_filter_sdk::mock::{MockProxy, MockRequest};

    use super::*;

    #[test]
    fn per_value_buckets_refill_on_the_clock() {
        let host = MockProxy::new().install();
        let mut f: RateLimit = host
            .configure(r#"{"descriptors": [{"name": "key", "entries": [{"header": "x-api-key"}], "bucket": {"max_tokens": 2, "fill_interval_ms": 1000}}]}"#)
            .unwrap();
        let a = || MockRequest::get("/").with_header("x-api-key", "a");
        assert!(host.on_request(&mut f, &a()).is_continue());
        assert!(host.on_request(&mut f, &a()).is_continue());
        let denied = host.on_request(&mut f, &a());
        let reply = denied.reply().unwrap();
        assert_eq!(reply.status, 429);
        assert_eq!(reply.header_value("retry-after"), Some("1"));
        assert_eq!(reply.header_value("x-ratelimit-remaining"), Some("0"));
        // Another key has its own bucket; no key is not limited.
        let b = MockRequest::get("/").with_header("x-api-key", "b");
        assert!(host.on_request(&mut f, &b).is_continue());
        assert!(
            host.on_request(&mut f, &MockRequest::get("/"))
                .is_continue()
        );
        host.advance_ms(1000);
        assert!(host.on_request(&mut f, &a()).is_continue());
        assert_eq!(
            host.metric(
                "ratelimit_requests_total",
                &[("descriptor", "key"), ("result", "limited")]
            ),
            1.0
        );
    }

    #[test]
    fn long_values_are_hashed_into_short_keys() {
        let key = bucket_key("d", &["x".repeat(1000)]);
        assert!(key.len() < 100, "{key}");
        assert_ne!(key, bucket_key("d", &["y".repeat(1000)]));
        assert_eq!(bucket_key("d", &["a".into(), "b".into()]), "d|a|b");
    }

    #[test]
    fn nested_claims_come_from_the_payload() {
        let host = MockProxy::new().install();
        let mut f: RateLimit = host
            .configure(r#"{"descriptors": [{"name": "org", "entries": [{"claim": "org.id"}], "bucket": {"max_tokens": 1, "fill_interval_ms": 60000}}]}"#)
            .unwrap();
        let req = || MockRequest::get("/").with_metadata("jwt.payload", r#"{"org": {"id": 42}}"#);
        assert!(host.on_request(&mut f, &req()).is_continue());
        assert!(!host.on_request(&mut f, &req()).is_continue());
        assert!(host.namespace().get("org|42").is_err());
    }

    #[test]
    fn configs_are_checked() {
        let host = MockProxy::new().install();
        for (config, needle) in [
            (r#"{"status": 200}"#, "4xx or 5xx"),
            (
                r#"{"default_bucket": {"max_tokens": 0, "fill_interval_ms": 1}}"#,
                "max_tokens",
            ),
            (
                r#"{"descriptors": [{"name": "a", "entries": [], "bucket": {"max_tokens": 1, "fill_interval_ms": 1}}]}"#,
                "entries",
            ),
            (
                r#"{"descriptors": [{"name": "a", "entries": [{"path_prefix": "x"}], "bucket": {"max_tokens": 1, "fill_interval_ms": 1}}]}"#,
                "path_prefix",
            ),
            (
                r#"{"descriptors": [{"name": "a", "entries": [{"bogus": 1}], "bucket": {"max_tokens": 1, "fill_interval_ms": 1}}]}"#,
                "unknown variant",
            ),
        ] {
            let err = host.configure::<RateLimit>(config).unwrap_err();
            assert!(err.contains(needle), "{config}: {err}");
        }
    }
}

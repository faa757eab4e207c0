//! `jwt`: JWT authentication, after Envoy's `jwt_authn`.
//!
//! For the first rule matching the request (path prefix, methods), the rule's provider
//! looks for a token in its sources (default `Authorization: Bearer`, then configured
//! headers with prefixes, query parameters, cookies), parses it strictly, checks the
//! header (`alg` in the provider's list — `none` never is —, no `crit`, `typ`), has the
//! host verify the signature with the provider's key set (natively; the key never
//! enters the filter, and HMAC-with-an-RSA-key confusion is impossible because keys
//! only serve their own algorithm family), then checks `iss`, `aud`, `exp`, `nbf`,
//! `iat` with clock skew, `require_expiration` and the maximum lifetime.
//!
//! On success the verified claims go into metadata (`jwt.payload`, `jwt.claim.<name>`,
//! `jwt.provider`) for RBAC and rate limits, configured claims are copied into headers,
//! the payload is forwarded if asked, and the token stripped if asked. On failure the
//! reply is 401 with `WWW-Authenticate: Bearer error="invalid_token",
//! error_description="…"` (RFC 6750); a missing token gets `Bearer` without `error`.
//! Verified tokens are cached (bounded, by token, until they expire, invalidated when
//! the key set changes).

#![forbid(unsafe_code)]

pub mod config;
pub mod extractor;
pub mod matcher;
pub mod token;
pub mod verified;
pub mod verifier;

use dpumesh_filter_sdk::metrics::Counter;
use dpumesh_filter_sdk::util::base64url_encode;
use dpumesh_filter_sdk::{
    Filter, Interest, LocalReply, Request, Verdict, crypto, export_filter, log,
};
use serde_json::Value;

use crate::config::{Config, Mode, Provider, RawConfig};
use crate::extractor::Location;
use crate::verified::{Verified, VerifiedTokens};
use crate::verifier::Failure;

/// The filter.
#[derive(Debug)]
pub struct Jwt {
    config: Config,
    cache: VerifiedTokens,
    verified: Counter,
    cache_hits: Counter,
    missing: Counter,
    failures: Vec<(&'static str, Counter)>,
    /// The headers this filter writes (`claim_to_headers`, `forward_payload_header`
    /// of every provider): removed from every request first, so a client's header of
    /// the same name never passes as one the filter set.
    owned_headers: Vec<String>,
}

/// A claim value as metadata: strings raw, everything else as JSON.
fn metadata_value(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn verify(token: &str, provider: &Provider, now: f64) -> Result<Verified, Failure> {
    let parsed = token::parse(token).map_err(Failure::Parse)?;
    let (alg, kid) = verifier::check_header(&parsed, provider)?;
    verifier::check_signature(&parsed, provider, alg, kid)?;
    let window = verifier::check_claims(&parsed, provider, now)?;
    Ok(Verified {
        provider: 0,
        key_version: 0,
        window,
        payload: String::from_utf8_lossy(&parsed.payload_json).into_owned(),
        claims: parsed
            .claims
            .iter()
            .map(|(k, v)| (format!("jwt.claim.{k}"), metadata_value(v)))
            .collect(),
        claim_headers: provider
            .raw
            .claim_to_headers
            .iter()
            .map(|c| {
                let mut parts = c.claim.split('.');
                let first = parts.next().and_then(|name| parsed.claims.get(name));
                let value = first.and_then(|v| parts.try_fold(v, |v, part| v.get(part)));
                value.filter(|v| !v.is_null()).map(metadata_value)
            })
            .collect(),
    })
}

fn unauthorized(failure: Option<Failure>) -> Verdict {
    let (challenge, body) = match failure {
        None => ("Bearer".to_owned(), "Jwt is missing".to_owned()),
        Some(f) => (
            format!("Bearer error=\"invalid_token\", error_description=\"{f}\""),
            f.to_string(),
        ),
    };
    LocalReply::new(401)
        .header("www-authenticate", challenge)
        .header("content-type", "text/plain")
        .body(format!("{body}\n"))
        .into()
}

impl Jwt {
    fn fail(&self, failure: Failure) {
        if let Some((_, counter)) = self.failures.iter().find(|(l, _)| *l == failure.label()) {
            counter.increment(1);
        }
        dpumesh_filter_sdk::log!(log::Level::Debug, "jwt rejected: {failure}");
    }

    fn apply(req: &Request<'_>, provider: &Provider, verified: &Verified, location: &Location) {
        req.set_metadata("jwt.provider", &provider.name);
        req.set_metadata("jwt.payload", &verified.payload);
        for (key, value) in &verified.claims {
            req.set_metadata(key, value);
        }
        for (c, value) in provider
            .raw
            .claim_to_headers
            .iter()
            .zip(&verified.claim_headers)
        {
            match value {
                Some(v) => {
                    let _ = req.set_header(&c.header, v);
                }
                // A forged header of the same name must not survive.
                None => {
                    let _ = req.remove_header(&c.header);
                }
            }
        }
        if let Some(header) = &provider.raw.forward_payload_header {
            let _ = req.set_header(header, &base64url_encode(verified.payload.as_bytes()));
        }
        if provider.raw.strip_token
            && let Location::Header(name) = location
        {
            let _ = req.remove_header(name);
        }
    }
}

impl Filter for Jwt {
    type Config = RawConfig;

    fn new(raw: RawConfig) -> Result<Self, String> {
        let config = Config::try_from(raw)?;
        let counter = |labels: &[(&str, &str)]| {
            Counter::new("jwt_requests_total", labels).map_err(|e| e.to_string())
        };
        let labels = [
            "too_large",
            "malformed",
            "algorithm",
            "header",
            "no_key",
            "signature",
            "time_claims",
            "expired",
            "not_yet_valid",
            "issuer",
            "audience",
        ];
        let mut owned_headers: Vec<String> = config
            .providers
            .iter()
            .flat_map(|p| {
                p.raw
                    .claim_to_headers
                    .iter()
                    .map(|c| c.header.to_ascii_lowercase())
                    .chain(
                        p.raw
                            .forward_payload_header
                            .iter()
                            .map(|h| h.to_ascii_lowercase()),
                    )
            })
            .collect();
        owned_headers.sort();
        owned_headers.dedup();
        Ok(Self {
            owned_headers,
            cache: VerifiedTokens::new(config.cache_entries),
            verified: counter(&[("result", "verified")])?,
            cache_hits: counter(&[("result", "cache_hit")])?,
            missing: counter(&[("result", "missing")])?,
            failures: labels
                .into_iter()
                .map(|l| counter(&[("result", l)]).map(|c| (l, c)))
                .collect::<Result<_, _>>()?,
            config,
        })
    }

    /// Every provider's token headers, and `cookie` when a provider reads cookies.
    fn interest(&self) -> Interest {
        let mut interest = Interest::default();
        for provider in &self.config.providers {
            for source in &provider.headers {
                interest = interest.header(&source.name);
            }
            if !provider.raw.from_cookies.is_empty() {
                interest = interest.header("cookie");
            }
        }
        interest.headers.sort();
        interest.headers.dedup();
        interest
    }

    fn on_request(&mut self, req: &Request<'_>) -> Verdict {
        for header in &self.owned_headers {
            let _ = req.remove_header(header);
        }
        let Some(rule) = matcher::find(&self.config.rules, req.method(), req.path()) else {
            return Verdict::Continue;
        };
        let (Some(index), mode) = (rule.provider, rule.mode) else {
            return Verdict::Continue;
        };
        let provider = &self.config.providers[index];
        let Some((token, location)) = extractor::extract(req, provider) else {
            self.missing.increment(1);
            return match mode {
                Mode::Required => unauthorized(None),
                Mode::AllowMissing | Mode::AllowMissingOrFailed => Verdict::Continue,
            };
        };
        // The time the chain started on this request (handed in with the call).
        let now = req.wall_ns() as f64 / 1e9;
        // Applied in place: a cache hit is used by reference, never copied per request.
        let result = if token.len() > provider.raw.max_token_bytes {
            Err(Failure::TooLarge)
        } else if token.is_empty() {
            Err(Failure::Parse(token::ParseError::Segments))
        } else {
            let key_version = crypto::key_set_version(&provider.raw.key_set);
            if let Some(hit) = self.cache.get(&token, index, key_version, now) {
                self.cache_hits.increment(1);
                Self::apply(req, provider, &hit, &location);
                Ok(())
            } else {
                verify(&token, provider, now).map(|mut verified| {
                    verified.provider = index;
                    verified.key_version = key_version;
                    Self::apply(req, provider, &verified, &location);
                    self.cache.insert(&token, verified, now);
                })
            }
        };
        match result {
            Ok(()) => {
                self.verified.increment(1);
                Verdict::Continue
            }
            Err(failure) => {
                self.fail(failure);
                match mode {
                    Mode::AllowMissingOrFailed => Verdict::Continue,
                    Mode::Required | Mode::AllowMissing => unauthorized(Some(failure)),
                }
            }
        }
    }
}

export_filter!(Jwt);

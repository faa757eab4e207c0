//! Verifying a parsed token: header rules, the signature (by the host, natively), and
//! the time, issuer and audience claims.

use std::fmt;

use dpumesh_filter_sdk::crypto::{self, Algorithm, VerifyError};
use serde_json::Value;

use crate::config::Provider;
use crate::token::{ParseError, Token};

/// Why a token was refused. Descriptions are fixed strings (RFC 6750
/// `error_description`), never echoing the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Longer than `max_token_bytes`.
    TooLarge,
    /// Malformed.
    Parse(ParseError),
    /// `alg` missing, `none`, or unknown.
    BadAlgorithm,
    /// `alg` known but not accepted by this provider.
    AlgorithmNotAllowed,
    /// `crit` lists extensions (we understand none), or is malformed.
    UnsupportedCritical,
    /// `typ` not accepted.
    BadType,
    /// `kid` is not a string.
    BadKid,
    /// No key fits the `kid`/`alg`.
    NoMatchingKey,
    /// The signature does not verify.
    BadSignature,
    /// A time claim is not a number.
    BadTimeClaim,
    /// No `exp` and the provider requires one.
    MissingExpiration,
    Expired,
    /// `nbf` in the future.
    NotYetValid,
    /// `iat` in the future.
    IssuedInFuture,
    /// `exp - iat` longer than allowed.
    LifetimeTooLong,
    /// `iss` is not the provider's issuer.
    BadIssuer,
    /// `aud` has none of the accepted audiences.
    BadAudience,
}

impl Failure {
    /// A short metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::TooLarge => "too_large",
            Self::Parse(_) => "malformed",
            Self::BadAlgorithm | Self::AlgorithmNotAllowed => "algorithm",
            Self::UnsupportedCritical | Self::BadType | Self::BadKid => "header",
            Self::NoMatchingKey => "no_key",
            Self::BadSignature => "signature",
            Self::BadTimeClaim | Self::MissingExpiration | Self::LifetimeTooLong => "time_claims",
            Self::Expired => "expired",
            Self::NotYetValid | Self::IssuedInFuture => "not_yet_valid",
            Self::BadIssuer => "issuer",
            Self::BadAudience => "audience",
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooLarge => f.write_str("Jwt is too large"),
            Self::Parse(e) => e.fmt(f),
            Self::BadAlgorithm => f.write_str("Jwt algorithm is missing or not supported"),
            Self::AlgorithmNotAllowed => f.write_str("Jwt algorithm is not allowed"),
            Self::UnsupportedCritical => {
                f.write_str("Jwt has unsupported critical header parameters")
            }
            Self::BadType => f.write_str("Jwt type is not allowed"),
            Self::BadKid => f.write_str("Jwt kid is not a string"),
            Self::NoMatchingKey => {
                f.write_str("Jwks doesn't have key to match kid or alg from Jwt")
            }
            Self::BadSignature => f.write_str("Jwt verification fails"),
            Self::BadTimeClaim => f.write_str("Jwt time claims are not numbers"),
            Self::MissingExpiration => f.write_str("Jwt has no expiration"),
            Self::Expired => f.write_str("Jwt is expired"),
            Self::NotYetValid => f.write_str("Jwt not yet valid"),
            Self::IssuedInFuture => f.write_str("Jwt issued in the future"),
            Self::LifetimeTooLong => f.write_str("Jwt lifetime is too long"),
            Self::BadIssuer => f.write_str("Jwt issuer is not configured"),
            Self::BadAudience => f.write_str("Audiences in Jwt are not allowed"),
        }
    }
}

/// Checks the JOSE header and returns the algorithm and key id.
pub fn check_header<'t>(
    token: &'t Token<'_>,
    provider: &Provider,
) -> Result<(Algorithm, Option<&'t str>), Failure> {
    let alg = token
        .header
        .get("alg")
        .and_then(Value::as_str)
        .ok_or(Failure::BadAlgorithm)?;
    // `none` never parses: it is not an Algorithm.
    let alg: Algorithm = alg.parse().map_err(|_| Failure::BadAlgorithm)?;
    if !provider.algorithms.contains(&alg) {
        return Err(Failure::AlgorithmNotAllowed);
    }
    if token.header.contains_key("crit") {
        return Err(Failure::UnsupportedCritical);
    }
    if !provider.raw.typ.is_empty() {
        let typ = token
            .header
            .get("typ")
            .and_then(Value::as_str)
            .ok_or(Failure::BadType)?;
        let typ = typ.strip_prefix("application/").unwrap_or(typ);
        if !provider.raw.typ.iter().any(|t| t.eq_ignore_ascii_case(typ)) {
            return Err(Failure::BadType);
        }
    }
    let kid = match token.header.get("kid") {
        None => None,
        Some(Value::String(kid)) => Some(kid.as_str()),
        Some(_) => return Err(Failure::BadKid),
    };
    Ok((alg, kid))
}

/// Verifies the signature with the provider's key set on the host.
pub fn check_signature(
    token: &Token<'_>,
    provider: &Provider,
    alg: Algorithm,
    kid: Option<&str>,
) -> Result<(), Failure> {
    crypto::verify(
        alg,
        &provider.raw.key_set,
        kid,
        token.signing_input.as_bytes(),
        &token.signature,
    )
    .map(drop)
    .map_err(|e| match e {
        VerifyError::InvalidSignature => Failure::BadSignature,
        VerifyError::UnknownKey
        | VerifyError::UnknownKeySet
        | VerifyError::KeyAlgorithmMismatch => Failure::NoMatchingKey,
    })
}

fn time_claim(claims: &serde_json::Map<String, Value>, name: &str) -> Result<Option<f64>, Failure> {
    match claims.get(name) {
        None => Ok(None),
        Some(Value::Number(n)) => n.as_f64().map(Some).ok_or(Failure::BadTimeClaim),
        Some(_) => Err(Failure::BadTimeClaim),
    }
}

/// The validity window of a verified token: (not before, expires), Unix seconds, with
/// the skew applied; cached with the token so a cache hit re-checks time only.
pub type Window = (f64, f64);

/// Checks issuer, audience and time claims at `now`; returns the validity window.
pub fn check_claims(token: &Token<'_>, provider: &Provider, now: f64) -> Result<Window, Failure> {
    let claims = &token.claims;
    let raw = &provider.raw;
    if let Some(issuer) = &raw.issuer
        && claims.get("iss").and_then(Value::as_str) != Some(issuer.as_str())
    {
        return Err(Failure::BadIssuer);
    }
    if !raw.audiences.is_empty() {
        let ok = match claims.get("aud") {
            Some(Value::String(a)) => raw.audiences.contains(a),
            Some(Value::Array(list)) => list
                .iter()
                .filter_map(Value::as_str)
                .any(|a| raw.audiences.iter().any(|want| want == a)),
            _ => false,
        };
        if !ok {
            return Err(Failure::BadAudience);
        }
    }
    let skew = raw.clock_skew_secs as f64;
    let exp = time_claim(claims, "exp")?;
    let nbf = time_claim(claims, "nbf")?;
    let iat = time_claim(claims, "iat")?;
    if exp.is_none() && (raw.require_expiration || raw.max_lifetime_secs.is_some()) {
        return Err(Failure::MissingExpiration);
    }
    if let (Some(max), Some(exp)) = (raw.max_lifetime_secs, exp) {
        let issued = iat.ok_or(Failure::MissingExpiration)?;
        if exp - issued > max as f64 {
            return Err(Failure::LifetimeTooLong);
        }
    }
    if let Some(iat) = iat
        && iat > now + skew
    {
        return Err(Failure::IssuedInFuture);
    }
    let not_before = nbf.map_or(f64::MIN, |nbf| nbf - skew);
    let expires = exp.map_or(f64::MAX, |exp| exp + skew);
    check_window((not_before, expires), now)?;
    Ok((not_before, expires))
}

/// Checks `now` against a validity window.
pub fn check_window((not_before, expires): Window, now: f64) -> Result<(), Failure> {
    if now >= expires {
        return Err(Failure::Expired);
    }
    if now < not_before {
        return Err(Failure::NotYetValid);
    }
    Ok(())
}

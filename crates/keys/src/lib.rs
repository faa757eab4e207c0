//! Key sets held by the host, and native signature verification.
//!
//! Filters verify signatures (JWT and the like) through the `crypto` WIT import: the
//! message and signature cross into the host, the key never crosses into the guest, and
//! the math runs natively (on BlueField-3 the host can hand it to the PKA engine). This
//! crate loads JSON Web Key Sets (RFC 7517), keeps them in a [`KeyStore`] that can be
//! replaced while requests are verifying against it, and verifies with
//! [`jsonwebtoken`]'s crypto providers (and RustCrypto's `p521` for ES512, which
//! jsonwebtoken lacks).
//!
//! Interoperable with Envoy's `jwt_verify_lib`: a key without a `kid` is a candidate
//! for any token, a token's `kid` only rules out keys carrying another one; a JWKS
//! with malformed or unsupported keys loads the good ones (the others are listed by
//! [`KeySet::skipped`]) and fails only when none is usable.
//!
//! Algorithm confusion is rejected by construction: every key has a family (HMAC secret,
//! RSA, EC curve, Ed25519) and is only ever used with algorithms of that family, so an
//! RSA public key can never be used as an HMAC secret.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use jsonwebtoken::crypto::rust_crypto::DEFAULT_PROVIDER;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm as JwtAlgorithm, DecodingKey};

pub use dpumesh_jose::{Algorithm, KeyKind, UnknownAlgorithm, VerifyError};

/// The `jsonwebtoken` algorithm that verifies `alg`.
fn to_jwt(alg: Algorithm) -> JwtAlgorithm {
    match alg {
        Algorithm::Hs256 => JwtAlgorithm::HS256,
        Algorithm::Hs384 => JwtAlgorithm::HS384,
        Algorithm::Hs512 => JwtAlgorithm::HS512,
        Algorithm::Rs256 => JwtAlgorithm::RS256,
        Algorithm::Rs384 => JwtAlgorithm::RS384,
        Algorithm::Rs512 => JwtAlgorithm::RS512,
        Algorithm::Ps256 => JwtAlgorithm::PS256,
        Algorithm::Ps384 => JwtAlgorithm::PS384,
        Algorithm::Ps512 => JwtAlgorithm::PS512,
        Algorithm::Es256 => JwtAlgorithm::ES256,
        Algorithm::Es384 => JwtAlgorithm::ES384,
        Algorithm::EdDsa => JwtAlgorithm::EdDSA,
        // Verified with `p521`, never through jsonwebtoken (which has no ES512).
        Algorithm::Es512 => JwtAlgorithm::ES384,
    }
}

/// Why a key set could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum KeySetError {
    /// The document is not a JSON Web Key Set.
    #[error("not a JSON Web Key Set: {0}")]
    Json(#[source] serde_json::Error),
    /// No key in the set can verify signatures.
    #[error("the key set has no usable signature key{}", if skipped.is_empty() { String::new() } else { format!(" (skipped: {})", skipped.join("; ")) })]
    NoUsableKeys {
        /// Each key skipped and why (malformed, encryption keys, unsupported types).
        skipped: Vec<String>,
    },
}

/// What verifies with a key.
#[derive(Clone)]
enum Verifier {
    Jwt(DecodingKey),
    P521(p521::ecdsa::VerifyingKey),
}

/// One verification key.
#[derive(Clone)]
struct Key {
    kid: Option<String>,
    kind: KeyKind,
    /// Restriction from the JWK's `alg`, when it names one.
    alg: Option<Algorithm>,
    verifier: Verifier,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key")
            .field("kid", &self.kid)
            .field("kind", &self.kind)
            .field("alg", &self.alg)
            .finish_non_exhaustive()
    }
}

impl Key {
    fn fits(&self, alg: Algorithm) -> bool {
        self.kind == alg.key_kind() && self.alg.is_none_or(|restricted| restricted == alg)
    }
}

/// A parsed key set (the keys of one JWKS).
#[derive(Debug, Clone)]
pub struct KeySet {
    keys: Vec<Key>,
    skipped: Vec<String>,
}

impl KeySet {
    /// Parses a JWKS document (`{"keys": [...]}`).
    ///
    /// Keys that cannot be used (malformed, meant for encryption, of unsupported
    /// types) are skipped and listed by [`KeySet::skipped`]; only a document that is
    /// not a JWKS, or a set with nothing usable, is an error.
    pub fn from_jwks(json: &str) -> Result<Self, KeySetError> {
        #[derive(serde::Deserialize)]
        struct RawSet {
            keys: Vec<serde_json::Value>,
        }
        let raw: RawSet = serde_json::from_str(json).map_err(KeySetError::Json)?;
        let mut keys = Vec::with_capacity(raw.keys.len());
        let mut skipped = Vec::new();
        for (index, value) in raw.keys.into_iter().enumerate() {
            let kid = value
                .get("kid")
                .and_then(|kid| kid.as_str())
                .map(str::to_owned);
            match parse_key(value) {
                Ok((kind, alg, verifier)) => keys.push(Key {
                    kid,
                    kind,
                    alg,
                    verifier,
                }),
                Err(reason) => skipped.push(format!(
                    "key #{index}{}: {reason}",
                    kid.map(|k| format!(" (kid {k:?})")).unwrap_or_default()
                )),
            }
        }
        if keys.is_empty() {
            return Err(KeySetError::NoUsableKeys { skipped });
        }
        Ok(Self { keys, skipped })
    }

    /// A set holding one HMAC secret (raw bytes), with an optional key id.
    pub fn from_secret(kid: Option<&str>, secret: &[u8]) -> Self {
        Self {
            keys: vec![Key {
                kid: kid.map(str::to_owned),
                kind: KeyKind::Secret,
                alg: None,
                verifier: Verifier::Jwt(DecodingKey::from_secret(secret)),
            }],
            skipped: Vec::new(),
        }
    }

    /// Number of usable keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the set holds no usable keys.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The keys skipped while loading and why, one line each (`key #2 (kid "a"): …`).
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// Verifies `signature` over `message` with `alg`, trying each key that may have
    /// signed it: with a `kid`, the keys with that id and those without any id (as
    /// Envoy does); without, every key. Only keys whose kind (and JWK `alg`) fit `alg`
    /// are tried. Returns the id of the key that verified (empty when it has none).
    pub fn verify(
        &self,
        alg: Algorithm,
        kid: Option<&str>,
        message: &[u8],
        signature: &[u8],
    ) -> Result<String, VerifyError> {
        // jsonwebtoken's verifiers take a `Vec`: one copy per verification.
        let signature = signature.to_vec();
        let mut candidates = self
            .keys
            .iter()
            .filter(|key| kid.is_none_or(|kid| key.kid.as_deref().is_none_or(|k| k == kid)))
            .peekable();
        if kid.is_some() && candidates.peek().is_none() {
            return Err(VerifyError::UnknownKey);
        }
        let mut fitting = candidates.filter(|key| key.fits(alg)).peekable();
        if fitting.peek().is_none() {
            return Err(VerifyError::KeyAlgorithmMismatch);
        }
        fitting
            .find(|key| verify_with(key, alg, message, &signature))
            .map(|key| key.kid.clone().unwrap_or_default())
            .ok_or(VerifyError::InvalidSignature)
    }
}

/// A JWK as a key we can verify with (its kind, `alg` restriction and verifier), or
/// why it is skipped.
fn parse_key(
    mut value: serde_json::Value,
) -> Result<(KeyKind, Option<Algorithm>, Verifier), String> {
    // The JWK's `alg` by our names: jsonwebtoken reads names it does not know (ES512)
    // as "unknown", so it is taken out before the JWK is parsed.
    let alg = match value.as_object_mut().and_then(|o| o.remove("alg")) {
        None => None,
        Some(serde_json::Value::String(name)) => match name.parse::<Algorithm>() {
            Ok(alg) => Some(alg),
            Err(_) => return Err(format!("not a signature algorithm we verify: alg {name:?}")),
        },
        Some(other) => return Err(format!("alg is not a string: {other}")),
    };
    let jwk: Jwk = serde_json::from_value(value).map_err(|e| e.to_string())?;
    if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)) {
        return Err("an encryption key (use: enc)".to_owned());
    }
    let kind = match &jwk.algorithm {
        AlgorithmParameters::OctetKey(_) => KeyKind::Secret,
        AlgorithmParameters::RSA(_) => KeyKind::Rsa,
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => KeyKind::P256,
            EllipticCurve::P384 => KeyKind::P384,
            EllipticCurve::P521 => KeyKind::P521,
            ref other => return Err(format!("unsupported EC curve {other:?}")),
        },
        AlgorithmParameters::OctetKeyPair(okp) => match okp.curve {
            EllipticCurve::Ed25519 => {
                // jsonwebtoken slices `x` to 32 bytes without checking.
                let x = base64url(&okp.x, "x")?;
                if x.len() != 32 {
                    return Err(format!(
                        "an Ed25519 public key is 32 bytes, x has {}",
                        x.len()
                    ));
                }
                KeyKind::Ed25519
            }
            ref other => return Err(format!("unsupported OKP curve {other:?}")),
        },
        _ => return Err("unsupported key type".to_owned()),
    };
    if let Some(alg) = alg
        && alg.key_kind() != kind
    {
        return Err(format!("alg {alg} does not fit a {kind:?} key"));
    }
    let verifier = match (&jwk.algorithm, kind) {
        (AlgorithmParameters::EllipticCurve(ec), KeyKind::P521) => {
            // SEC1 uncompressed point: 0x04 ‖ x ‖ y, each coordinate 66 bytes.
            let (x, y) = (base64url(&ec.x, "x")?, base64url(&ec.y, "y")?);
            if x.len() != 66 || y.len() != 66 {
                return Err(format!(
                    "a P-521 coordinate is 66 bytes, x has {} and y {}",
                    x.len(),
                    y.len()
                ));
            }
            let point = [&[4u8][..], &x, &y].concat();
            Verifier::P521(
                p521::ecdsa::VerifyingKey::from_sec1_bytes(&point)
                    .map_err(|_| "the point is not on P-521".to_owned())?,
            )
        }
        _ => {
            let decoding = DecodingKey::from_jwk(&jwk).map_err(|e| e.to_string())?;
            // Reject keys the crypto provider cannot use now, not at the first request.
            let probe = alg.unwrap_or(match kind {
                KeyKind::Secret => Algorithm::Hs256,
                KeyKind::Rsa => Algorithm::Rs256,
                KeyKind::P256 => Algorithm::Es256,
                KeyKind::P384 => Algorithm::Es384,
                KeyKind::P521 => Algorithm::Es512,
                KeyKind::Ed25519 => Algorithm::EdDsa,
            });
            guarded(|| (DEFAULT_PROVIDER.verifier_factory)(&to_jwt(probe), &decoding).map(drop))
                .ok_or_else(|| "the crypto provider cannot use this key".to_owned())?
                .map_err(|e| e.to_string())?;
            Verifier::Jwt(decoding)
        }
    };
    Ok((kind, alg, verifier))
}

fn base64url(text: &str, what: &str) -> Result<Vec<u8>, String> {
    base64::Engine::decode(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
        text.trim_end_matches('='),
    )
    .map_err(|e| format!("{what} is not base64url: {e}"))
}

fn verify_with(key: &Key, alg: Algorithm, message: &[u8], signature: &Vec<u8>) -> bool {
    match &key.verifier {
        Verifier::P521(verifying) => {
            use p521::ecdsa::signature::Verifier as _;
            // JWS carries r ‖ s (RFC 7518 §3.4), 66 bytes each.
            guarded(|| {
                p521::ecdsa::Signature::from_slice(signature)
                    .is_ok_and(|sig| verifying.verify(message, &sig).is_ok())
            })
            .unwrap_or(false)
        }
        // The verifier is built per call: jsonwebtoken's verifiers are not `Send`, and
        // building one only clones the key bytes.
        Verifier::Jwt(decoding) => {
            guarded(
                || match (DEFAULT_PROVIDER.verifier_factory)(&to_jwt(alg), decoding) {
                    Ok(verifier) => verifier.verify(message, signature).is_ok(),
                    Err(_) => false,
                },
            )
            .unwrap_or(false)
        }
    }
}

/// Runs crypto-provider code that must never take the proxy down: a panic inside it
/// (a library bug on hostile input) becomes `None`, i.e. "does not verify".
fn guarded<T>(f: impl FnOnce() -> T) -> Option<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).ok()
}

#[derive(Debug)]
struct Versioned {
    version: u64,
    set: KeySet,
}

/// Named key sets, replaceable while requests verify against them.
///
/// Readers take a snapshot without locking; a replacement is published atomically, so
/// a verification in flight finishes on the set it started with.
#[derive(Debug, Default)]
pub struct KeyStore {
    sets: ArcSwap<HashMap<String, Arc<Versioned>>>,
    next_version: AtomicU64,
}

impl KeyStore {
    /// An empty store.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Publishes `sets` as the complete new contents: sets not named are removed.
    pub fn replace_all(&self, sets: impl IntoIterator<Item = (String, KeySet)>) {
        let map = sets
            .into_iter()
            .map(|(name, set)| (name, self.versioned(set)))
            .collect();
        self.sets.store(Arc::new(map));
    }

    /// Adds or replaces one set.
    pub fn insert(&self, name: &str, set: KeySet) {
        let versioned = self.versioned(set);
        self.sets.rcu(|current| {
            let mut next = HashMap::clone(current);
            next.insert(name.to_owned(), Arc::clone(&versioned));
            next
        });
    }

    fn versioned(&self, set: KeySet) -> Arc<Versioned> {
        Arc::new(Versioned {
            version: self.next_version.fetch_add(1, Ordering::Relaxed) + 1,
            set,
        })
    }

    /// The version of set `name` (changes on every replacement), 0 when absent.
    pub fn version(&self, name: &str) -> u64 {
        self.sets.load().get(name).map_or(0, |v| v.version)
    }

    /// Names of the loaded sets, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<_> = self.sets.load().keys().cloned().collect();
        names.sort();
        names
    }

    /// Verifies against set `set`; see [`KeySet::verify`].
    pub fn verify(
        &self,
        alg: Algorithm,
        set: &str,
        kid: Option<&str>,
        message: &[u8],
        signature: &[u8],
    ) -> Result<String, VerifyError> {
        let sets = self.sets.load();
        let versioned = sets.get(set).ok_or(VerifyError::UnknownKeySet)?;
        versioned.set.verify(alg, kid, message, signature)
    }
}

#[cfg(test)]
mod tests;

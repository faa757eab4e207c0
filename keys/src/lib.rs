//! Key sets held by the host, and native signature verification.
//!
//! Filters verify signatures (JWT and the like) through the `crypto` WIT import: the
//! message and signature cross into the host, the key never crosses into the guest, and
//! the math runs natively (on BlueField-3 the host can hand it to the PKA engine). This
//! crate loads JSON Web Key Sets (RFC 7517), keeps them in a [`KeyStore`] that can be
//! replaced while requests are verifying against it, and verifies with
//! [`jsonwebtoken`]'s crypto providers.
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
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse};
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
    }
}

/// Our algorithm for a JWK's `alg`, when we support it.
fn from_key_algorithm(alg: &KeyAlgorithm) -> Option<Algorithm> {
    Some(match alg {
        KeyAlgorithm::HS256 => Algorithm::Hs256,
        KeyAlgorithm::HS384 => Algorithm::Hs384,
        KeyAlgorithm::HS512 => Algorithm::Hs512,
        KeyAlgorithm::RS256 => Algorithm::Rs256,
        KeyAlgorithm::RS384 => Algorithm::Rs384,
        KeyAlgorithm::RS512 => Algorithm::Rs512,
        KeyAlgorithm::PS256 => Algorithm::Ps256,
        KeyAlgorithm::PS384 => Algorithm::Ps384,
        KeyAlgorithm::PS512 => Algorithm::Ps512,
        KeyAlgorithm::ES256 => Algorithm::Es256,
        KeyAlgorithm::ES384 => Algorithm::Es384,
        KeyAlgorithm::EdDSA => Algorithm::EdDsa,
        _ => return None,
    })
}

/// Why a key set could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum KeySetError {
    /// The document is not a JSON Web Key Set.
    #[error("not a JSON Web Key Set: {0}")]
    Json(#[source] serde_json::Error),
    /// A key of a supported type has bad parameters.
    #[error("key #{index}{}: {reason}", kid.as_ref().map(|k| format!(" (kid {k:?})")).unwrap_or_default())]
    InvalidKey {
        /// Position in `keys`.
        index: usize,
        /// The key's `kid`, if any.
        kid: Option<String>,
        /// What is wrong.
        reason: String,
    },
    /// No key in the set can verify signatures.
    #[error("the key set has no usable signature keys ({skipped} skipped)")]
    NoUsableKeys {
        /// How many keys were skipped (encryption keys, unsupported types).
        skipped: usize,
    },
}

/// One verification key.
#[derive(Clone)]
struct Key {
    kid: Option<String>,
    kind: KeyKind,
    /// Restriction from the JWK's `alg`, when it names one.
    alg: Option<Algorithm>,
    decoding: DecodingKey,
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
    /// Keys meant for encryption (`"use": "enc"`) and of unsupported types are skipped
    /// and listed by [`KeySet::skipped`]; a supported key with bad parameters is an
    /// error, and so is a set with nothing usable.
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
            let invalid = |reason: String| KeySetError::InvalidKey {
                index,
                kid: kid.clone(),
                reason,
            };
            let jwk: Jwk = serde_json::from_value(value).map_err(|e| invalid(e.to_string()))?;
            let label = format!("#{index} {}", kid.as_deref().unwrap_or("(no kid)"));
            if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)) {
                skipped.push(format!("{label}: encryption key"));
                continue;
            }
            let kind = match &jwk.algorithm {
                AlgorithmParameters::OctetKey(_) => KeyKind::Secret,
                AlgorithmParameters::RSA(_) => KeyKind::Rsa,
                AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
                    EllipticCurve::P256 => KeyKind::P256,
                    EllipticCurve::P384 => KeyKind::P384,
                    ref other => {
                        skipped.push(format!("{label}: unsupported EC curve {other:?}"));
                        continue;
                    }
                },
                AlgorithmParameters::OctetKeyPair(okp) => match okp.curve {
                    EllipticCurve::Ed25519 => {
                        // jsonwebtoken slices `x` to 32 bytes without checking.
                        let x = base64::Engine::decode(
                            &base64::engine::general_purpose::URL_SAFE_NO_PAD,
                            okp.x.trim_end_matches('='),
                        )
                        .map_err(|e| invalid(format!("x is not base64url: {e}")))?;
                        if x.len() != 32 {
                            return Err(invalid(format!(
                                "an Ed25519 public key is 32 bytes, x has {}",
                                x.len()
                            )));
                        }
                        KeyKind::Ed25519
                    }
                    ref other => {
                        skipped.push(format!("{label}: unsupported OKP curve {other:?}"));
                        continue;
                    }
                },
                _ => {
                    skipped.push(format!("{label}: unsupported key type"));
                    continue;
                }
            };
            let alg = match &jwk.common.key_algorithm {
                None => None,
                Some(key_alg) => match from_key_algorithm(key_alg) {
                    Some(alg) if alg.key_kind() == kind => Some(alg),
                    Some(alg) => {
                        return Err(invalid(format!("alg {alg} does not fit a {kind:?} key")));
                    }
                    None => {
                        skipped.push(format!("{label}: non-signature alg {key_alg:?}"));
                        continue;
                    }
                },
            };
            let decoding = DecodingKey::from_jwk(&jwk).map_err(|e| invalid(e.to_string()))?;
            // Reject keys the crypto provider cannot use now, not at the first request.
            let probe = alg.unwrap_or(match kind {
                KeyKind::Secret => Algorithm::Hs256,
                KeyKind::Rsa => Algorithm::Rs256,
                KeyKind::P256 => Algorithm::Es256,
                KeyKind::P384 => Algorithm::Es384,
                KeyKind::Ed25519 => Algorithm::EdDsa,
            });
            guarded(|| (DEFAULT_PROVIDER.verifier_factory)(&to_jwt(probe), &decoding).map(drop))
                .ok_or_else(|| invalid("the crypto provider cannot use this key".to_owned()))?
                .map_err(|e| invalid(e.to_string()))?;
            keys.push(Key {
                kid,
                kind,
                alg,
                decoding,
            });
        }
        if keys.is_empty() {
            return Err(KeySetError::NoUsableKeys {
                skipped: skipped.len(),
            });
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
                decoding: DecodingKey::from_secret(secret),
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

    /// Why keys were skipped while loading, one line each.
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// Verifies `signature` over `message` with `alg` using key `kid`, or every key
    /// fitting `alg` when `kid` is `None`. Returns the id of the key that verified
    /// (empty when that key has none).
    pub fn verify(
        &self,
        alg: Algorithm,
        kid: Option<&str>,
        message: &[u8],
        signature: &[u8],
    ) -> Result<String, VerifyError> {
        let signature = signature.to_vec();
        if let Some(kid) = kid {
            let key = self
                .keys
                .iter()
                .find(|key| key.kid.as_deref() == Some(kid))
                .ok_or(VerifyError::UnknownKey)?;
            if !key.fits(alg) {
                return Err(VerifyError::KeyAlgorithmMismatch);
            }
            return if verify_with(key, alg, message, &signature) {
                Ok(kid.to_owned())
            } else {
                Err(VerifyError::InvalidSignature)
            };
        }
        let mut fitting = self.keys.iter().filter(|key| key.fits(alg)).peekable();
        if fitting.peek().is_none() {
            return Err(VerifyError::KeyAlgorithmMismatch);
        }
        fitting
            .find(|key| verify_with(key, alg, message, &signature))
            .map(|key| key.kid.clone().unwrap_or_default())
            .ok_or(VerifyError::InvalidSignature)
    }
}

fn verify_with(key: &Key, alg: Algorithm, message: &[u8], signature: &Vec<u8>) -> bool {
    // The verifier is built per call: jsonwebtoken's verifiers are not `Send`, and
    // building one only clones the key bytes.
    guarded(
        || match (DEFAULT_PROVIDER.verifier_factory)(&to_jwt(alg), &key.decoding) {
            Ok(verifier) => verifier.verify(message, signature).is_ok(),
            Err(_) => false,
        },
    )
    .unwrap_or(false)
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

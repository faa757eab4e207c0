//! Signature verification with keys the proxy holds. Key material never enters the
//! filter, and the math runs natively.

use std::fmt;
use std::str::FromStr;

/// Signature algorithms, by JOSE name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Algorithm {
    Hs256,
    Hs384,
    Hs512,
    Rs256,
    Rs384,
    Rs512,
    Ps256,
    Ps384,
    Ps512,
    Es256,
    Es384,
    EdDsa,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 12] = [
        Self::Hs256,
        Self::Hs384,
        Self::Hs512,
        Self::Rs256,
        Self::Rs384,
        Self::Rs512,
        Self::Ps256,
        Self::Ps384,
        Self::Ps512,
        Self::Es256,
        Self::Es384,
        Self::EdDsa,
    ];

    /// The JOSE name, e.g. `ES256`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hs256 => "HS256",
            Self::Hs384 => "HS384",
            Self::Hs512 => "HS512",
            Self::Rs256 => "RS256",
            Self::Rs384 => "RS384",
            Self::Rs512 => "RS512",
            Self::Ps256 => "PS256",
            Self::Ps384 => "PS384",
            Self::Ps512 => "PS512",
            Self::Es256 => "ES256",
            Self::Es384 => "ES384",
            Self::EdDsa => "EdDSA",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = String;

    /// Parses a JOSE name exactly (`none` and unknown names are errors).
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| format!("unsupported algorithm {s:?}"))
    }
}

/// Why a signature was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyError {
    /// No key set with that name is loaded.
    UnknownKeySet,
    /// The set has no key with that id.
    UnknownKey,
    /// The key does not fit the algorithm (algorithm confusion is refused here).
    KeyAlgorithmMismatch,
    /// No fitting key verified the signature.
    InvalidSignature,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::UnknownKeySet => "unknown key set",
            Self::UnknownKey => "unknown key id",
            Self::KeyAlgorithmMismatch => "key does not fit the algorithm",
            Self::InvalidSignature => "signature does not verify",
        })
    }
}

impl std::error::Error for VerifyError {}

/// Verifies `signature` over `message` with key `key_id` of `key_set` (or each fitting
/// key of the set when `key_id` is `None`); returns the id of the key that verified.
pub fn verify(
    alg: Algorithm,
    key_set: &str,
    key_id: Option<&str>,
    message: &[u8],
    signature: &[u8],
) -> Result<String, VerifyError> {
    #[cfg(target_arch = "wasm32")]
    {
        use crate::bindings::dpumesh::filter::crypto as wit;
        let alg = match alg {
            Algorithm::Hs256 => wit::Algorithm::Hs256,
            Algorithm::Hs384 => wit::Algorithm::Hs384,
            Algorithm::Hs512 => wit::Algorithm::Hs512,
            Algorithm::Rs256 => wit::Algorithm::Rs256,
            Algorithm::Rs384 => wit::Algorithm::Rs384,
            Algorithm::Rs512 => wit::Algorithm::Rs512,
            Algorithm::Ps256 => wit::Algorithm::Ps256,
            Algorithm::Ps384 => wit::Algorithm::Ps384,
            Algorithm::Ps512 => wit::Algorithm::Ps512,
            Algorithm::Es256 => wit::Algorithm::Es256,
            Algorithm::Es384 => wit::Algorithm::Es384,
            Algorithm::EdDsa => wit::Algorithm::Eddsa,
        };
        wit::verify(alg, key_set, key_id, message, signature).map_err(|e| match e {
            wit::VerifyError::UnknownKeySet => VerifyError::UnknownKeySet,
            wit::VerifyError::UnknownKey => VerifyError::UnknownKey,
            wit::VerifyError::KeyAlgorithmMismatch => VerifyError::KeyAlgorithmMismatch,
            wit::VerifyError::InvalidSignature => VerifyError::InvalidSignature,
        })
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        use dpumesh_keys::VerifyError as K;
        let alg: dpumesh_keys::Algorithm = alg
            .name()
            .parse()
            .map_err(|_| VerifyError::KeyAlgorithmMismatch)?;
        crate::mock::MockHost::current()
            .keys()
            .verify(alg, key_set, key_id, message, signature)
            .map_err(|e| match e {
                K::UnknownKeySet => VerifyError::UnknownKeySet,
                K::UnknownKey => VerifyError::UnknownKey,
                K::KeyAlgorithmMismatch => VerifyError::KeyAlgorithmMismatch,
                K::InvalidSignature => VerifyError::InvalidSignature,
            })
    }
}

/// A number that changes whenever `key_set` is replaced (0 if unknown): drop cached
/// verifications when it changes.
pub fn key_set_version(key_set: &str) -> u64 {
    #[cfg(target_arch = "wasm32")]
    {
        crate::bindings::dpumesh::filter::crypto::key_set_version(key_set)
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        crate::mock::MockHost::current().keys().version(key_set)
    }
}

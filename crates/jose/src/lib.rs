//! The signature vocabulary filters and the proxy share: JOSE algorithm names
//! (RFC 7518 §3.1), the kind of key each one needs, and why a verification failed.
//!
//! Filters name an algorithm (from a JWT header, a config) and the proxy verifies with
//! keys it holds; both sides parse and print the same names from this one table. It
//! has no dependencies, so it links into Wasm guests as it is.

#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;

/// Signature algorithms, by their JOSE names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// HMAC with SHA-256.
    Hs256,
    /// HMAC with SHA-384.
    Hs384,
    /// HMAC with SHA-512.
    Hs512,
    /// RSASSA-PKCS1-v1_5 with SHA-256.
    Rs256,
    /// RSASSA-PKCS1-v1_5 with SHA-384.
    Rs384,
    /// RSASSA-PKCS1-v1_5 with SHA-512.
    Rs512,
    /// RSASSA-PSS with SHA-256.
    Ps256,
    /// RSASSA-PSS with SHA-384.
    Ps384,
    /// RSASSA-PSS with SHA-512.
    Ps512,
    /// ECDSA on P-256 with SHA-256.
    Es256,
    /// ECDSA on P-384 with SHA-384.
    Es384,
    /// ECDSA on P-521 with SHA-512.
    Es512,
    /// Ed25519.
    EdDsa,
}

impl Algorithm {
    /// Every algorithm, in a stable order.
    pub const ALL: [Algorithm; 13] = [
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
        Self::Es512,
        Self::EdDsa,
    ];

    /// The JOSE name, e.g. `RS256`.
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
            Self::Es512 => "ES512",
            Self::EdDsa => "EdDSA",
        }
    }

    /// The kind of key this algorithm needs: a key is only ever used with algorithms
    /// of its kind, which rules out algorithm confusion (an RSA public key used as an
    /// HMAC secret).
    pub fn key_kind(self) -> KeyKind {
        match self {
            Self::Hs256 | Self::Hs384 | Self::Hs512 => KeyKind::Secret,
            Self::Rs256 | Self::Rs384 | Self::Rs512 | Self::Ps256 | Self::Ps384 | Self::Ps512 => {
                KeyKind::Rsa
            }
            Self::Es256 => KeyKind::P256,
            Self::Es384 => KeyKind::P384,
            Self::Es512 => KeyKind::P521,
            Self::EdDsa => KeyKind::Ed25519,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An algorithm name that is not one of ours (`none` is never one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownAlgorithm(pub String);

impl fmt::Display for UnknownAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unsupported signature algorithm {:?} (expected one of HS256/384/512, RS256/384/512, PS256/384/512, ES256/384/512, EdDSA)",
            self.0
        )
    }
}

impl std::error::Error for UnknownAlgorithm {}

impl FromStr for Algorithm {
    type Err = UnknownAlgorithm;

    /// Parses a JOSE name exactly: names are case-sensitive (RFC 7515 §4.1.1).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|alg| alg.name() == s)
            .ok_or_else(|| UnknownAlgorithm(s.to_owned()))
    }
}

/// The kind of a key: which algorithms it may serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyKind {
    /// A shared HMAC secret (`kty: oct`).
    Secret,
    /// An RSA public key.
    Rsa,
    /// An EC public key on P-256.
    P256,
    /// An EC public key on P-384.
    P384,
    /// An EC public key on P-521.
    P521,
    /// An Ed25519 public key (`kty: OKP`).
    Ed25519,
}

/// Why a signature was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VerifyError {
    /// No key set with that name is loaded.
    UnknownKeySet,
    /// The set has no key with that id.
    UnknownKey,
    /// The key (or every key of the set) does not fit the algorithm.
    KeyAlgorithmMismatch,
    /// No fitting key verified the signature.
    InvalidSignature,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::UnknownKeySet => "no key set with that name is loaded",
            Self::UnknownKey => "the key set has no key with that id",
            Self::KeyAlgorithmMismatch => "the key does not fit the algorithm",
            Self::InvalidSignature => "the signature does not verify",
        })
    }
}

impl std::error::Error for VerifyError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_and_nothing_else_does() {
        for alg in Algorithm::ALL {
            assert_eq!(alg.name().parse::<Algorithm>(), Ok(alg));
            assert_eq!(alg.to_string(), alg.name());
        }
        for bad in ["none", "hs256", "HS128", "", "ES512x", "ES521"] {
            let e = bad.parse::<Algorithm>().unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn each_family_needs_its_own_key_kind() {
        assert_eq!(Algorithm::Hs384.key_kind(), KeyKind::Secret);
        assert_eq!(Algorithm::Ps512.key_kind(), KeyKind::Rsa);
        assert_eq!(Algorithm::Es256.key_kind(), KeyKind::P256);
        assert_eq!(Algorithm::Es384.key_kind(), KeyKind::P384);
        assert_eq!(Algorithm::Es512.key_kind(), KeyKind::P521);
        assert_eq!(Algorithm::EdDsa.key_kind(), KeyKind::Ed25519);
    }
}

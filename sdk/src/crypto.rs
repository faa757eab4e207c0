//! Signature verification with keys the proxy holds. Key material never enters the
//! filter, and the math runs natively.

pub use dpumesh_jose::{Algorithm, UnknownAlgorithm, VerifyError};

/// Verifies `signature` over `message` with key `key_id` of `key_set` (or each fitting
/// key of the set when `key_id` is `None`); returns the id of the key that verified.
pub fn verify(
    alg: Algorithm,
    key_set: &str,
    key_id: Option<&str>,
    message: &[u8],
    signature: &[u8],
) -> Result<String, VerifyError> {
    crate::sys::verify(alg, key_set, key_id, message, signature)
}

/// A number that changes whenever `key_set` is replaced (0 if unknown): drop cached
/// verifications when it changes.
pub fn key_set_version(key_set: &str) -> u64 {
    crate::sys::key_set_version(key_set)
}

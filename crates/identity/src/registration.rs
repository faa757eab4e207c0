//! Registration tokens: what a pod shows its node to register as a service.
//!
//! A pod's requests carry its service's identity, so registering as a service must
//! be proven: the node holds the mesh's registration key (`registration.key` in the
//! certificate folder, owner-only) and accepts a registration for service `s` only
//! with `HMAC-SHA256(key, "dpumesh-registration/v1/" + s)`. `dpumesh up` hands each
//! pod its service's token as `DPUMESH_TOKEN`; on Kubernetes it comes from the
//! service's Secret (`dpumesh certs --secrets`). A token proves the service, not the pod: replicas share it, as
//! they share a service account.

use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::IdentityError;

/// The key's file in a certificate folder.
pub const KEY_FILE: &str = "registration.key";

const LABEL: &str = "dpumesh-registration/v1/";

/// What the names of secrets derived from the key start with ([`crate::admin`]): no
/// service has such a name (service names are DNS labels, without `:`), and no token
/// for one is ever accepted, so a service's token is never a derived secret.
pub(crate) const RESERVED_PREFIX: &str = "mesh:";

/// The mesh's registration key.
#[derive(Clone)]
pub struct RegistrationKey {
    key: [u8; 32],
}

impl std::fmt::Debug for RegistrationKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RegistrationKey(..)")
    }
}

fn key_path(dir: &Path) -> PathBuf {
    dir.join(KEY_FILE)
}

fn mac(key: &[u8; 32], service: &str) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(LABEL.as_bytes());
    mac.update(service.as_bytes());
    mac
}

impl RegistrationKey {
    /// The key in `dir`.
    pub fn load(dir: &Path) -> Result<Self, IdentityError> {
        let path = key_path(dir);
        let text = std::fs::read_to_string(&path).map_err(|e| IdentityError::File {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let bad = || IdentityError::File {
            path: path.clone(),
            reason: "not a registration key (64 hex digits)".into(),
        };
        let bytes = hex::decode(text.trim()).map_err(|_| bad())?;
        let key: [u8; 32] = bytes.try_into().map_err(|_| bad())?;
        Ok(Self { key })
    }

    /// The key in `dir`, made (from the OS's random source) if there is none.
    pub fn load_or_create(dir: &Path) -> Result<Self, IdentityError> {
        if key_path(dir).exists() {
            return Self::load(dir);
        }
        let mut key = [0u8; 32];
        getrandom::fill(&mut key)
            .map_err(|e| IdentityError::Issue(format!("no random bytes for a key: {e}")))?;
        std::fs::create_dir_all(dir).map_err(|e| IdentityError::File {
            path: dir.to_owned(),
            reason: e.to_string(),
        })?;
        let text = format!("{}\n", hex::encode(key));
        crate::ca::write_atomic(&key_path(dir), &text, true)?;
        Ok(Self { key })
    }

    /// The token of `service` (hex).
    pub fn token(&self, service: &str) -> String {
        hex::encode(mac(&self.key, service).finalize().into_bytes())
    }

    /// Whether `token` proves `service` (compared in constant time).
    pub fn verify(&self, service: &str, token: &str) -> bool {
        if service.starts_with(RESERVED_PREFIX) {
            return false;
        }
        match hex::decode(token) {
            Ok(bytes) if bytes.len() == 32 => mac(&self.key, service).verify_slice(&bytes).is_ok(),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_proves_its_service_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let key = RegistrationKey::load_or_create(dir.path()).unwrap();
        let token = key.token("frontend");
        assert!(key.verify("frontend", &token));
        assert!(!key.verify("user", &token));
        assert!(!key.verify("frontend", &token[..63]));
        assert!(!key.verify(
            "frontend",
            &token.replace(|c: char| c.is_ascii_digit(), "g")
        ));
        assert!(!key.verify("frontend", ""));
        // The same key comes back from the file; another mesh's key does not verify.
        let again = RegistrationKey::load(dir.path()).unwrap();
        assert!(again.verify("frontend", &token));
        let other = tempfile::tempdir().unwrap();
        let theirs = RegistrationKey::load_or_create(other.path()).unwrap();
        assert!(!theirs.verify("frontend", &token));
    }

    #[test]
    fn a_damaged_key_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(KEY_FILE), "xyz").unwrap();
        let e = RegistrationKey::load(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("registration.key") && e.contains("64 hex digits"),
            "{e}"
        );
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        RegistrationKey::load_or_create(dir.path()).unwrap();
        let mode = std::fs::metadata(dir.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}

//! The mesh CA: issues the certificates of nodes, the ingress and workloads.
//!
//! A certificate folder holds `ca.pem` (the trust bundle: every CA certificate
//! trusted, several while a CA rotates), `ca.key` (only where certificates are
//! issued: `dpumesh up`, `dpumesh certs`), and `<stem>.pem` / `<stem>.key` per
//! identity ([`SpiffeId::file_stem`]). On Kubernetes the same layout comes from a
//! Secret mounted as the folder. Every file is replaced by rename, so a reader (a
//! node reloading its certificate) never sees half a file.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::CertificateDer;
use time::OffsetDateTime;

use crate::{IdentityError, SpiffeId};

/// How long a CA certificate is valid.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How long a leaf certificate `dpumesh` issues is valid by default (Istio: 24 h).
pub const LEAF_VALIDITY: Duration = Duration::from_secs(24 * 3600);

/// The CA of a certificate folder.
pub struct Authority {
    cert: CertificateDer<'static>,
    key: KeyPair,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").finish_non_exhaustive()
    }
}

fn io(path: &Path, e: std::io::Error) -> IdentityError {
    IdentityError::File {
        path: path.to_owned(),
        reason: e.to_string(),
    }
}

fn issue_err(what: &str, e: rcgen::Error) -> IdentityError {
    IdentityError::Issue(format!("{what}: {e}"))
}

/// Writes `text` to `path` by rename; `secret` files are readable by the owner only.
pub(crate) fn write_atomic(path: &Path, text: &str, secret: bool) -> Result<(), IdentityError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension().and_then(|e| e.to_str()).unwrap_or("")
    ));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(|e| io(&tmp, e))?;
    file.write_all(text.as_bytes()).map_err(|e| io(&tmp, e))?;
    file.sync_all().map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))
}

/// Makes `path` a fresh secret (32 random bytes as 64 hex digits, no newline: an HMAC
/// key read "as the bytes are"), readable by the owner only, unless it exists. Returns
/// whether it was made. What a mesh's own keys are made with, so that no key written
/// in a repository is ever what a mesh accepts.
pub fn ensure_secret(path: &Path) -> Result<bool, IdentityError> {
    if path.exists() {
        return Ok(false);
    }
    let mut key = [0u8; 32];
    getrandom::fill(&mut key)
        .map_err(|e| IdentityError::Issue(format!("no random bytes for a key: {e}")))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    write_atomic(path, &hex::encode(key), true)?;
    Ok(true)
}

fn validity(params: &mut CertificateParams, valid_for: Duration) {
    let now = OffsetDateTime::now_utc();
    // A minute back: clocks of two hosts differ a little.
    params.not_before = now - time::Duration::minutes(1);
    params.not_after = now + time::Duration::seconds(valid_for.as_secs() as i64);
}

impl Authority {
    /// A new CA for `trust_domain`, and its certificate as PEM.
    fn create(trust_domain: &str) -> Result<(Self, String), IdentityError> {
        let key = KeyPair::generate().map_err(|e| issue_err("CA key", e))?;
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "DPUmesh");
        dn.push(DnType::CommonName, format!("DPUmesh CA for {trust_domain}"));
        params.distinguished_name = dn;
        validity(&mut params, CA_VALIDITY);
        let cert = params
            .self_signed(&key)
            .map_err(|e| issue_err("CA certificate", e))?;
        let pem = cert.pem();
        Ok((
            Self {
                cert: cert.der().clone(),
                key,
            },
            pem,
        ))
    }

    /// The CA whose `ca.pem` (first certificate) and `ca.key` are in `dir`.
    pub fn load(dir: &Path) -> Result<Self, IdentityError> {
        let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
        let bundle = std::fs::read_to_string(&cert_path).map_err(|e| io(&cert_path, e))?;
        let key_pem = std::fs::read_to_string(&key_path).map_err(|e| io(&key_path, e))?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| IdentityError::File {
            path: key_path.clone(),
            reason: format!("not a private key: {e}"),
        })?;
        // The issuing CA is the bundle's first certificate.
        let cert = crate::tls::read_certs(&cert_path, &bundle)?.swap_remove(0);
        let ca = Self { cert, key };
        ca.issuer().map_err(|e| IdentityError::File {
            path: cert_path,
            reason: format!("not a CA certificate this key signs with: {e}"),
        })?;
        Ok(ca)
    }

    /// The CA in `dir`, created (with `ca.pem` and `ca.key`) if there is none.
    pub fn load_or_create(dir: &Path, trust_domain: &str) -> Result<Self, IdentityError> {
        if dir.join("ca.key").exists() {
            return Self::load(dir);
        }
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let (ca, pem) = Self::create(trust_domain)?;
        write_atomic(&dir.join("ca.key"), &ca.key.serialize_pem(), true)?;
        write_atomic(&dir.join("ca.pem"), &pem, false)?;
        Ok(ca)
    }

    fn issuer(&self) -> Result<Issuer<'static, &KeyPair>, rcgen::Error> {
        Issuer::from_ca_cert_der(&self.cert, &self.key)
    }

    /// A certificate (PEM) and its key (PEM) for `id`, valid for `valid_for`.
    pub fn issue(
        &self,
        id: &SpiffeId,
        valid_for: Duration,
    ) -> Result<(String, String), IdentityError> {
        let key = KeyPair::generate().map_err(|e| issue_err("key", e))?;
        let mut params = CertificateParams::default();
        let uri = id
            .to_string()
            .try_into()
            .map_err(|e| issue_err("SPIFFE URI", e))?;
        params.subject_alt_names = vec![SanType::URI(uri)];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        // Both ends of a mutual TLS connection present it.
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "DPUmesh");
        dn.push(DnType::CommonName, id.to_string());
        params.distinguished_name = dn;
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, valid_for);
        let issuer = self
            .issuer()
            .map_err(|e| issue_err("the CA certificate", e))?;
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(|e| issue_err("certificate", e))?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// Issues `id`'s files into `dir`.
    pub fn issue_into(
        &self,
        dir: &Path,
        id: &SpiffeId,
        valid_for: Duration,
    ) -> Result<(), IdentityError> {
        let (cert, key) = self.issue(id, valid_for)?;
        let (cert_path, key_path) = files(dir, id);
        // Key first: a reader that sees the new certificate finds its key.
        write_atomic(&key_path, &key, true)?;
        write_atomic(&cert_path, &cert, false)
    }
}

/// The certificate and key files of `id` in `dir`.
pub fn files(dir: &Path, id: &SpiffeId) -> (PathBuf, PathBuf) {
    let stem = id.file_stem();
    (
        dir.join(format!("{stem}.pem")),
        dir.join(format!("{stem}.key")),
    )
}

/// Makes sure `dir` has a CA and a certificate for each of `ids` that is valid for
/// at least a third of its life more; issues what is missing or ageing, or every
/// one with `rotate`. Returns the identities issued.
pub fn ensure(
    dir: &Path,
    trust_domain: &str,
    ids: &[SpiffeId],
    valid_for: Duration,
    rotate: bool,
) -> Result<Vec<SpiffeId>, IdentityError> {
    let ca = Authority::load_or_create(dir, trust_domain)?;
    let mut issued = Vec::new();
    for id in ids {
        let (cert_path, key_path) = files(dir, id);
        let fresh = !rotate
            && key_path.exists()
            && std::fs::read_to_string(&cert_path)
                .ok()
                .and_then(|pem| crate::tls::not_after(&cert_path, &pem).ok())
                .is_some_and(|end| {
                    let left = end - OffsetDateTime::now_utc();
                    left > time::Duration::seconds(valid_for.as_secs() as i64 / 3)
                });
        if !fresh {
            ca.issue_into(dir, id, valid_for)?;
            issued.push(id.clone());
        }
    }
    Ok(issued)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_made_once_fresh_and_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys/demo.key");
        assert!(ensure_secret(&path).unwrap());
        let first = std::fs::read_to_string(&path).unwrap();
        assert_eq!(first.len(), 64);
        assert!(first.bytes().all(|b| b.is_ascii_hexdigit()));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!ensure_secret(&path).unwrap(), "kept");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), first);
        let other = dir.path().join("other.key");
        ensure_secret(&other).unwrap();
        assert_ne!(
            std::fs::read_to_string(&other).unwrap(),
            first,
            "one per mesh"
        );
    }

    #[test]
    fn ensure_issues_once_and_keeps_what_is_fresh() {
        let dir = tempfile::tempdir().unwrap();
        let ids = [
            SpiffeId::node("td", "n1").unwrap(),
            SpiffeId::ingress("td").unwrap(),
        ];
        let first = ensure(dir.path(), "td", &ids, LEAF_VALIDITY, false).unwrap();
        assert_eq!(first.len(), 2);
        let again = ensure(dir.path(), "td", &ids, LEAF_VALIDITY, false).unwrap();
        assert!(again.is_empty(), "fresh certificates are kept");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("node-n1.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "keys are the owner's alone");
        // The CA is loaded back, not made anew.
        let ca_before = std::fs::read_to_string(dir.path().join("ca.pem")).unwrap();
        std::fs::remove_file(dir.path().join("ingress.pem")).unwrap();
        assert_eq!(
            ensure(dir.path(), "td", &ids, LEAF_VALIDITY, false)
                .unwrap()
                .len(),
            1
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("ca.pem")).unwrap(),
            ca_before
        );
    }

    #[test]
    fn certificates_close_to_their_end_are_issued_again() {
        let dir = tempfile::tempdir().unwrap();
        let ids = [SpiffeId::node("td", "n1").unwrap()];
        let ca = Authority::load_or_create(dir.path(), "td").unwrap();
        ca.issue_into(dir.path(), &ids[0], Duration::from_secs(60))
            .unwrap();
        assert_eq!(
            ensure(dir.path(), "td", &ids, LEAF_VALIDITY, false)
                .unwrap()
                .len(),
            1
        );
    }
}

//! HTTPS at the ingress: which certificates it serves (chosen by SNI), which TLS
//! versions it speaks, whether it asks clients for certificates, and how often it
//! looks at the files for a rotation.
//!
//! ```yaml
//! ingress:
//!   listen: 0.0.0.0:8443
//!   tls:
//!     certificates:                    # the first is served to a client naming no host
//!       - {cert: tls/www.pem, key: tls/www.key}
//!       - {cert: tls/api.pem, key: tls/api.key}
//!     strict_sni: false                # true: an unknown name fails the handshake
//!     min_version: "1.2"               # or "1.3"
//!     client_ca: tls/clients.pem       # ask for client certificates signed by these
//!     client_certs: optional           # optional | required (needs client_ca)
//!     reload: 5s                       # how often the files are checked for a change
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::units::Span;

/// `ingress.tls`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngressTls {
    /// Certificate chains (PEM, leaf first) and their keys; the first is the default.
    pub certificates: Vec<CertificateFiles>,
    /// Refuse the handshake of a client whose SNI names no certificate (HAProxy's
    /// `strict-sni`); by default it gets the first certificate.
    #[serde(default)]
    pub strict_sni: bool,
    /// The oldest TLS version spoken (default 1.2).
    #[serde(default)]
    pub min_version: TlsVersion,
    /// Trust anchors for client certificates (PEM); none: no certificate is asked for.
    pub client_ca: Option<PathBuf>,
    /// Whether a client must show a certificate (default optional, with `client_ca`).
    pub client_certs: Option<ClientCerts>,
    /// How often the files are checked for a change (default 5 s).
    pub reload: Option<Span>,
}

/// One certificate chain and its private key.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertificateFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The oldest TLS version the ingress speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum TlsVersion {
    #[default]
    #[serde(rename = "1.2")]
    Tls12,
    #[serde(rename = "1.3")]
    Tls13,
}

/// Whether a client must show a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientCerts {
    /// Asked for; a client without one is served, without a principal.
    Optional,
    /// A client without a valid one fails the handshake.
    Required,
}

impl IngressTls {
    /// How often the files are checked for a change.
    pub fn reload(&self) -> Duration {
        self.reload.map_or(Duration::from_secs(5), |s| s.0)
    }

    /// Checks what serde cannot: the key path and what is wrong.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.certificates.is_empty() {
            return Err((
                "ingress.tls.certificates",
                "HTTPS needs at least one certificate".into(),
            ));
        }
        if self.client_certs.is_some() && self.client_ca.is_none() {
            return Err((
                "ingress.tls.client_certs",
                "client certificates are checked against `client_ca`, which is missing".into(),
            ));
        }
        if self.reload() < Duration::from_millis(100) {
            return Err((
                "ingress.tls.reload",
                "check the files at most every 100ms".into(),
            ));
        }
        Ok(())
    }

    /// The same with every path resolved against `dir` (the mesh file's folder).
    pub fn resolved(mut self, dir: &Path) -> Self {
        for c in &mut self.certificates {
            c.cert = dir.join(&c.cert);
            c.key = dir.join(&c.key);
        }
        self.client_ca = self.client_ca.map(|p| dir.join(p));
        self
    }

    /// Whether a client must show a certificate.
    pub fn client_certs(&self) -> Option<ClientCerts> {
        match (&self.client_ca, self.client_certs) {
            (None, _) => None,
            (Some(_), c) => Some(c.unwrap_or(ClientCerts::Optional)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<IngressTls, String> {
        let tls: IngressTls = serde_norway::from_str(text).map_err(|e| e.to_string())?;
        tls.check().map_err(|(k, m)| format!("{k}: {m}"))?;
        Ok(tls)
    }

    #[test]
    fn a_full_section_reads_and_resolves_against_the_mesh_file() {
        let tls = parse(
            "certificates: [{cert: a.pem, key: a.key}, {cert: b.pem, key: b.key}]\nstrict_sni: true\nmin_version: \"1.3\"\nclient_ca: ca.pem\nclient_certs: required\nreload: 2s\n",
        )
        .unwrap()
        .resolved(Path::new("/etc/mesh"));
        assert_eq!(tls.certificates[1].key, Path::new("/etc/mesh/b.key"));
        assert_eq!(
            tls.client_ca.as_deref(),
            Some(Path::new("/etc/mesh/ca.pem"))
        );
        assert_eq!(tls.min_version, TlsVersion::Tls13);
        assert_eq!(tls.client_certs(), Some(ClientCerts::Required));
        assert_eq!(tls.reload(), Duration::from_secs(2));
    }

    #[test]
    fn defaults_and_refusals() {
        let tls = parse("certificates: [{cert: a.pem, key: a.key}]\nclient_ca: ca.pem\n").unwrap();
        assert_eq!(tls.min_version, TlsVersion::Tls12);
        assert!(!tls.strict_sni);
        assert_eq!(tls.client_certs(), Some(ClientCerts::Optional));
        let no_ca = parse("certificates: [{cert: a.pem, key: a.key}]\n").unwrap();
        assert_eq!(no_ca.client_certs(), None);
        assert!(
            parse("certificates: []\n")
                .unwrap_err()
                .contains("at least one")
        );
        assert!(
            parse("certificates: [{cert: a.pem, key: a.key}]\nclient_certs: required\n")
                .unwrap_err()
                .contains("client_ca")
        );
        assert!(
            parse("certificates: [{cert: a.pem, key: a.key}]\nmin_version: \"1.1\"\n").is_err()
        );
        assert!(
            parse("certificates: [{cert: a.pem}]\n").is_err(),
            "a key is needed"
        );
        assert!(parse("certificates: [{cert: a.pem, key: a.key, typo: 1}]\n").is_err());
    }
}

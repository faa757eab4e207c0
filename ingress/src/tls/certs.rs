//! The certificates the ingress serves, and which one a client gets: the one whose
//! names match the SNI it sent (exact names before wildcards), else the first, or none
//! under `strict_sni`.

use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::CertificateDer;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use super::TlsError;
use dpumesh_config::ingress_tls::CertificateFiles;

/// One certificate as served: the chain with its key, and the names it answers for.
#[derive(Debug)]
pub(crate) struct Served {
    pub(crate) key: Arc<CertifiedKey>,
    /// DNS names (lowercase; `*.example.com` for a wildcard), from the subject
    /// alternative names, else the subject's common name.
    pub(crate) names: Vec<String>,
}

/// The certificates in configuration order (the first is the default).
#[derive(Debug)]
pub(crate) struct CertSet {
    pub(crate) served: Vec<Served>,
}

/// Which certificate a client gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Choice {
    /// One whose names match the SNI.
    Named(usize),
    /// The SNI named none (or there was none): the first, unless strict.
    Unknown,
}

/// The certificate for `sni` among `names` (one list per certificate, lowercase). An
/// exact name wins over a wildcard; a wildcard stands for one leftmost label.
pub(crate) fn choose<N: AsRef<[S]>, S: AsRef<str>>(names: &[N], sni: Option<&str>) -> Choice {
    let Some(sni) = sni.map(|s| s.trim_end_matches('.').to_ascii_lowercase()) else {
        return Choice::Unknown;
    };
    let exact = names
        .iter()
        .position(|n| n.as_ref().iter().any(|n| n.as_ref() == sni));
    if let Some(i) = exact {
        return Choice::Named(i);
    }
    let Some((label, parent)) = sni.split_once('.') else {
        return Choice::Unknown;
    };
    if label.is_empty() || parent.is_empty() {
        return Choice::Unknown;
    }
    names
        .iter()
        .position(|n| {
            n.as_ref()
                .iter()
                .any(|n| n.as_ref().strip_prefix("*.") == Some(parent))
        })
        .map_or(Choice::Unknown, Choice::Named)
}

fn file_error(path: &Path, reason: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

/// Reads one chain and its key, and checks that they belong together and that the
/// leaf is valid at `now` (an expired certificate is refused, not served).
pub(crate) fn load_one(
    files: &CertificateFiles,
    provider: &CryptoProvider,
    now: SystemTime,
) -> Result<Served, TlsError> {
    let pem = std::fs::read(&files.cert).map_err(|e| file_error(&files.cert, e))?;
    let chain: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|e| file_error(&files.cert, format!("not PEM: {e}")))?;
    let Some(leaf) = chain.first() else {
        return Err(file_error(&files.cert, "no certificate in it"));
    };
    let names = validity_and_names(&files.cert, leaf, now)?;
    let key_pem = std::fs::read(&files.key).map_err(|e| file_error(&files.key, e))?;
    let key = rustls_pemfile::private_key(&mut key_pem.as_slice())
        .map_err(|e| file_error(&files.key, format!("not PEM: {e}")))?
        .ok_or_else(|| file_error(&files.key, "no private key in it"))?;
    let key = CertifiedKey::from_der(chain, key, provider).map_err(|e| {
        file_error(
            &files.key,
            format!("does not go with {}: {e}", files.cert.display()),
        )
    })?;
    Ok(Served {
        key: Arc::new(key),
        names,
    })
}

/// The leaf's names, once its validity period is checked against `now`.
fn validity_and_names(
    path: &Path,
    leaf: &CertificateDer<'_>,
    now: SystemTime,
) -> Result<Vec<String>, TlsError> {
    let (_, cert) = x509_parser::parse_x509_certificate(leaf)
        .map_err(|e| file_error(path, format!("not a certificate: {e}")))?;
    let now = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let validity = cert.validity();
    if now > validity.not_after.timestamp() {
        return Err(file_error(
            path,
            format!("the certificate expired on {}", validity.not_after),
        ));
    }
    if now < validity.not_before.timestamp() {
        return Err(file_error(
            path,
            format!(
                "the certificate is not valid before {}",
                validity.not_before
            ),
        ));
    }
    let mut names: Vec<String> = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    x509_parser::extensions::GeneralName::DNSName(d) => {
                        Some(d.to_ascii_lowercase())
                    }
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    if names.is_empty() {
        names.extend(
            cert.subject()
                .iter_common_name()
                .filter_map(|cn| cn.as_str().ok())
                .map(str::to_ascii_lowercase),
        );
    }
    Ok(names)
}

impl CertSet {
    pub(crate) fn load(
        files: &[CertificateFiles],
        provider: &CryptoProvider,
        now: SystemTime,
    ) -> Result<Self, TlsError> {
        let served = files
            .iter()
            .map(|f| load_one(f, provider, now))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { served })
    }

    fn pick(&self, sni: Option<&str>, strict: bool) -> Option<&Served> {
        let names: Vec<&[String]> = self.served.iter().map(|s| s.names.as_slice()).collect();
        match choose(&names, sni) {
            Choice::Named(i) => self.served.get(i),
            Choice::Unknown if strict => None,
            Choice::Unknown => self.served.first(),
        }
    }
}

/// rustls's certificate choice over one set (a reload builds a new config with a new
/// resolver).
#[derive(Debug)]
pub(crate) struct SniResolver {
    pub(crate) set: CertSet,
    pub(crate) strict: bool,
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let chosen = self.set.pick(hello.server_name(), self.strict);
        if chosen.is_none() {
            // The handshake fails with an alert; the count says why.
            metrics::counter!("dpumesh_ingress_tls_handshake_failures_total", "reason" => "unknown_sni")
                .increment(1);
        }
        chosen.map(|s| s.key.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sni_chooses_exact_names_before_wildcards_and_falls_back_to_unknown() {
        let names = vec![
            vec!["www.example.com"],
            vec!["*.example.com"],
            vec!["api.example.com", "api.internal"],
        ];
        let cases: &[(Option<&str>, Choice)] = &[
            (Some("www.example.com"), Choice::Named(0)),
            (Some("WWW.Example.COM."), Choice::Named(0)),
            (Some("api.example.com"), Choice::Named(2)),
            (Some("shop.example.com"), Choice::Named(1)),
            (Some("api.internal"), Choice::Named(2)),
            // A wildcard stands for exactly one label.
            (Some("a.b.example.com"), Choice::Unknown),
            (Some("example.com"), Choice::Unknown),
            (Some(".example.com"), Choice::Unknown),
            (Some("other.org"), Choice::Unknown),
            (None, Choice::Unknown),
        ];
        for (sni, want) in cases {
            assert_eq!(choose(&names, *sni), *want, "sni {sni:?}");
        }
    }
}

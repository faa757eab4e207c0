//! Client certificates: checked against the configured client CA, and named by the
//! principal filters see as the request's source (`source.principal`, as Envoy names
//! it). The ingress vouches for clients, never for the mesh's own workloads: a client
//! certificate naming an identity in the mesh's trust domain is refused, whoever
//! signed it, so that an outside CA cannot mint a workload's name.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};

use super::TlsError;
use dpumesh_config::ClientCerts;

/// Who a client certificate names: its URI SAN (a SPIFFE ID, say), else its first DNS
/// SAN, else its subject's common name.
pub fn principal_of(cert: &CertificateDer<'_>) -> Option<String> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) = x509_parser::parse_x509_certificate(cert).ok()?;
    let names: Vec<GeneralName<'_>> = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| san.value.general_names.clone())
        .unwrap_or_default();
    let uri = names.iter().find_map(|n| match n {
        GeneralName::URI(u) => Some(u.to_string()),
        _ => None,
    });
    let dns = || {
        names.iter().find_map(|n| match n {
            GeneralName::DNSName(d) => Some(d.to_string()),
            _ => None,
        })
    };
    let cn = || {
        cert.subject()
            .iter_common_name()
            .find_map(|cn| cn.as_str().ok().map(str::to_owned))
    };
    uri.or_else(dns).or_else(cn)
}

pub use dpumesh_identity::spiffe::in_trust_domain as in_mesh_domain;

/// The client CA's verifier, with the mesh's names kept out.
#[derive(Debug)]
pub(crate) struct ClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    trust_domain: String,
}

impl ClientVerifier {
    pub(crate) fn load(
        ca: &Path,
        mode: ClientCerts,
        trust_domain: &str,
        provider: Arc<CryptoProvider>,
    ) -> Result<Self, TlsError> {
        let file = |reason: String| TlsError::File {
            path: ca.to_owned(),
            reason,
        };
        let pem = std::fs::read(ca).map_err(|e| file(e.to_string()))?;
        let mut roots = RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
            let cert = cert.map_err(|e| file(format!("not PEM: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| file(format!("not a CA certificate: {e}")))?;
        }
        if roots.is_empty() {
            return Err(file("no certificate in it".into()));
        }
        let builder = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
        let builder = match mode {
            ClientCerts::Optional => builder.allow_unauthenticated(),
            ClientCerts::Required => builder,
        };
        let inner = builder
            .build()
            .map_err(|e| file(format!("cannot verify with it: {e}")))?;
        Ok(Self {
            inner,
            trust_domain: trust_domain.to_owned(),
        })
    }
}

impl ClientCertVerifier for ClientVerifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)
            .inspect_err(|_| {
                metrics::counter!("dpumesh_ingress_tls_handshake_failures_total", "reason" => "client_cert")
                    .increment(1);
            })?;
        if let Some(p) = principal_of(end_entity)
            && in_mesh_domain(&p, &self.trust_domain)
        {
            metrics::counter!("dpumesh_ingress_tls_handshake_failures_total", "reason" => "mesh_identity")
                .increment(1);
            tracing::warn!(principal = %p, "a client certificate named a mesh identity: refused (the ingress vouches for clients, not workloads)");
            return Err(rustls::Error::General(format!(
                "client certificate names {p}, an identity of the mesh: refused"
            )));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mesh_domain_is_matched_by_whole_authority() {
        assert!(in_mesh_domain(
            "spiffe://dpumesh.local/ns/a/sa/b",
            "dpumesh.local"
        ));
        assert!(in_mesh_domain("spiffe://dpumesh.local", "dpumesh.local"));
        assert!(!in_mesh_domain(
            "spiffe://dpumesh.local.evil/ns/a",
            "dpumesh.local"
        ));
        assert!(!in_mesh_domain(
            "spiffe://partners.example/ns/a",
            "dpumesh.local"
        ));
        assert!(!in_mesh_domain("client.example.com", "dpumesh.local"));
    }
}

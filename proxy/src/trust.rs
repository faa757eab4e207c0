//! This process's place in the mesh's trust: its certificates (from the mesh file's
//! `identity` section), the certificates `dpumesh up` issues, and the handshake
//! counts the admin API shows.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use dpumesh_config::{MeshFile, Mtls};
use dpumesh_identity::registration::RegistrationKey;
use dpumesh_identity::{MeshTls, SpiffeId, TlsFiles, ca};

/// The certificate folder of a mesh file.
pub fn certs_dir(mesh: &MeshFile) -> PathBuf {
    mesh.config
        .identity
        .certs
        .clone()
        .unwrap_or_else(|| PathBuf::from(".dpumesh/certs"))
}

/// A node's identity.
pub fn node_id(mesh: &MeshFile, name: &str) -> Result<SpiffeId> {
    SpiffeId::node(mesh.config.identity.trust_domain(), name)
        .with_context(|| format!("node {name:?} cannot have a SPIFFE ID"))
}

/// The ingress's identity.
pub fn ingress_id(mesh: &MeshFile) -> Result<SpiffeId> {
    SpiffeId::ingress(mesh.config.identity.trust_domain())
        .context("the ingress cannot have a SPIFFE ID")
}

/// The identity of a service's pods: what RBAC principals and rate-limit
/// descriptors see as the source of the requests they make.
pub fn workload_id(trust_domain: &str, namespace: &str, service: &str) -> String {
    match SpiffeId::workload(trust_domain, namespace, service) {
        Ok(id) => id.to_string(),
        // A service name SPIFFE does not allow (upper case, say) still names a
        // distinct source, unmistakably not a valid ID.
        Err(_) => format!("spiffe://{trust_domain}/ns/{namespace}/sa/{service}"),
    }
}

/// Every identity of the mesh file: its nodes, its ingress and its services.
pub fn all_ids(mesh: &MeshFile) -> Result<Vec<SpiffeId>> {
    let td = mesh.config.identity.trust_domain();
    let ns = mesh.config.identity.namespace();
    let mut ids = vec![ingress_id(mesh)?];
    for name in mesh.config.nodes.keys() {
        ids.push(node_id(mesh, name)?);
    }
    for service in mesh.config.services.keys() {
        if let Ok(id) = SpiffeId::workload(td, ns, service) {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// Issues what the certificate folder lacks (`dpumesh up`, `dpumesh certs`):
/// the CA on first use, then a certificate per identity that has none or whose end
/// is near. Returns the identities issued.
pub fn issue(mesh: &MeshFile) -> Result<Vec<SpiffeId>> {
    if mesh.config.identity.mtls == Mtls::Off {
        return Ok(Vec::new());
    }
    let dir = certs_dir(mesh);
    RegistrationKey::load_or_create(&dir)
        .with_context(|| format!("cannot make the registration key in {}", dir.display()))?;
    ca::ensure(
        &dir,
        mesh.config.identity.trust_domain(),
        &all_ids(mesh)?,
        ca::LEAF_VALIDITY,
    )
    .with_context(|| {
        format!(
            "cannot issue the mesh's certificates into {}",
            dir.display()
        )
    })
}

/// The key a node checks pods' registrations with (`None` without mutual TLS).
pub fn registration_key(mesh: &MeshFile) -> Result<Option<RegistrationKey>> {
    if mesh.config.identity.mtls == Mtls::Off {
        return Ok(None);
    }
    let dir = certs_dir(mesh);
    RegistrationKey::load(&dir).map(Some).with_context(|| {
        format!(
            "no registration key in {} (`dpumesh up` and `dpumesh certs` make it)",
            dir.display()
        )
    })
}

/// The token `service`'s pods register with (`None` without mutual TLS).
pub fn registration_token(mesh: &MeshFile, service: &str) -> Result<Option<String>> {
    Ok(registration_key(mesh)?.map(|k| k.token(service)))
}

/// `id`'s certificates, or `None` when the mesh runs without mutual TLS.
pub fn load(mesh: &MeshFile, id: &SpiffeId) -> Result<Option<Arc<MeshTls>>> {
    if mesh.config.identity.mtls == Mtls::Off {
        tracing::warn!(
            "identity.mtls is off: fabric links are not authenticated, and any process that reaches a fabric address can send requests as already policed"
        );
        return Ok(None);
    }
    let dir = certs_dir(mesh);
    let tls = MeshTls::load(TlsFiles::in_dir(&dir, id), mesh.config.identity.trust_domain())
        .with_context(|| {
            format!(
                "no usable certificate for {id} in {} (`dpumesh up` and `dpumesh certs` issue them; on Kubernetes mount the mesh's Secret there)",
                dir.display()
            )
        })?;
    dpumesh_identity::metrics::publish_from(&tls);
    Ok(Some(tls))
}

//! This process's place in the mesh's trust: its certificates (from the mesh file's
//! `identity` section), the certificates `dpumesh up` issues, and the handshake
//! counts the admin API shows.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use dpumesh_config::{MeshFile, Mtls};
use dpumesh_identity::registration::RegistrationKey;
use dpumesh_identity::{MeshTls, SpiffeId, TlsFiles, ca};

/// The certificate folder of a mesh file.
pub fn certs_dir(mesh: &MeshFile) -> &Path {
    mesh.config.identity.certs()
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

/// The Pingmesh controller and analyzer's identity.
pub fn pingmesh_id(mesh: &MeshFile) -> Result<SpiffeId> {
    SpiffeId::pingmesh(mesh.config.identity.trust_domain())
        .context("the Pingmesh server cannot have a SPIFFE ID")
}

/// What a service's name is appended to for its pods' identity (the source that
/// RBAC principals and rate-limit descriptors see): `spiffe://<td>/ns/<ns>/sa/`.
pub fn workload_prefix(mesh: &MeshFile) -> String {
    let identity = &mesh.config.identity;
    SpiffeId::workload_prefix(identity.trust_domain(), identity.namespace())
}

/// Every identity of the mesh file: its nodes, its ingress, its services and its
/// Pingmesh server.
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
    if mesh.config.pingmesh.as_ref().is_some_and(|p| p.tls()) {
        ids.push(pingmesh_id(mesh)?);
    }
    Ok(ids)
}

/// Issues what the certificate folder lacks (`dpumesh up`, `dpumesh certs`):
/// the CA and the registration key on first use, then a certificate per identity
/// that has none or whose end is near (every one with `rotate`). Returns the
/// identities issued.
pub fn issue(mesh: &MeshFile, rotate: bool) -> Result<Vec<SpiffeId>> {
    if mesh.config.identity.mtls == Mtls::Off {
        return Ok(Vec::new());
    }
    let dir = certs_dir(mesh);
    RegistrationKey::load_or_create(dir)
        .with_context(|| format!("cannot make the registration key in {}", dir.display()))?;
    ca::ensure(
        dir,
        mesh.config.identity.trust_domain(),
        &all_ids(mesh)?,
        ca::LEAF_VALIDITY,
        rotate,
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
    RegistrationKey::load(dir).map(Some).with_context(|| {
        format!(
            "no registration key in {} (`dpumesh up` and `dpumesh certs` make it)",
            dir.display()
        )
    })
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
    let tls = MeshTls::load(TlsFiles::in_dir(dir, id), mesh.config.identity.trust_domain())
        .with_context(|| {
            format!(
                "no usable certificate for {id} in {} (`dpumesh up` and `dpumesh certs` issue them; on Kubernetes mount the mesh's Secret there)",
                dir.display()
            )
        })?;
    dpumesh_identity::metrics::publish_from(&tls);
    Ok(Some(tls))
}

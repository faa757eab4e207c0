//! `dpumesh certs --secrets DIR`: the mesh's certificates as Kubernetes Secrets, so
//! a deployment takes them from the cluster instead of a host folder.
//!
//! Each Secret's keys are the certificate folder's file names, so a Secret mounted
//! as a volume at the mesh file's `identity.certs` path is that folder: the node or
//! ingress reads it unchanged, and a rotated Secret (the kubelet swaps the volume's
//! `..data` link) is loaded without a restart like a rotated file. Written:
//! - `dpumesh-node-<name>`: the CA certificate, the node's pair and the
//!   registration key (nodes check pods' tokens with it);
//! - `dpumesh-ingress`: the CA certificate and the ingress's pair;
//! - `dpumesh-token-<service>` in the workloads' namespace: the service's
//!   registration token (key `token`), for the pods' `DPUMESH_TOKEN`;
//! - `kustomization.yaml` listing them.
//!
//! The CA's key is never written: it stays where certificates are issued.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use base64::Engine;
use dpumesh_config::MeshFile;
use dpumesh_identity::registration::{KEY_FILE, RegistrationKey};
use dpumesh_identity::{SpiffeId, TlsFiles};
use serde::Serialize;

/// Where the mesh's own components run (node and ingress Secrets).
pub const SYSTEM_NAMESPACE: &str = "dpumesh-system";

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Secret {
    api_version: &'static str,
    kind: &'static str,
    metadata: Metadata,
    #[serde(rename = "type")]
    kind_of_secret: &'static str,
    data: BTreeMap<String, String>,
}

#[derive(Serialize)]
struct Metadata {
    name: String,
    namespace: String,
    labels: BTreeMap<&'static str, String>,
}

/// A Kubernetes object name (RFC 1123 label: what a Secret's name must be here
/// so that it also works as a volume name).
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if !ok {
        bail!(
            "{name:?} is not a Kubernetes name (lower-case letters, digits and '-', at most 63, \
             starting and ending alphanumeric)"
        );
    }
    Ok(())
}

/// An Opaque Secret of the mesh, labelled with its role (and more `labels`).
fn secret(
    name: String,
    namespace: &str,
    role: &str,
    labels: &[(&'static str, String)],
    data: BTreeMap<String, String>,
) -> Result<Secret> {
    check_name(&name)?;
    let mut all = BTreeMap::from([
        ("app.kubernetes.io/part-of", "dpumesh".to_owned()),
        ("dpumesh.io/role", role.to_owned()),
    ]);
    all.extend(labels.iter().cloned());
    Ok(Secret {
        api_version: "v1",
        kind: "Secret",
        metadata: Metadata {
            name,
            namespace: namespace.to_owned(),
            labels: all,
        },
        kind_of_secret: "Opaque",
        data,
    })
}

fn base64(bytes: impl AsRef<[u8]>) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Files as a Secret's data: each under its file name.
fn files_data(files: &[PathBuf]) -> Result<BTreeMap<String, String>> {
    let mut data = BTreeMap::new();
    for path in files {
        let bytes = std::fs::read(path).with_context(|| {
            format!("cannot read {} (run `dpumesh certs` first)", path.display())
        })?;
        let key = path
            .file_name()
            .and_then(|n| n.to_str())
            .context("a certificate file without a name")?;
        data.insert(key.to_owned(), base64(bytes));
    }
    Ok(data)
}

/// The Secrets of `mesh`'s certificate folder, by file name.
fn render(mesh: &MeshFile, system_namespace: &str) -> Result<Vec<(String, Secret)>> {
    use dpumesh_proxy::trust;
    let dir = trust::certs_dir(mesh);
    let mut out = Vec::new();
    for name in mesh.config.nodes.keys() {
        let files = TlsFiles::in_dir(dir, &trust::node_id(mesh, name)?);
        let secret_name = format!("dpumesh-node-{name}");
        let data = files_data(&[files.ca, files.cert, files.key, dir.join(KEY_FILE)])?;
        out.push(secret(secret_name, system_namespace, "node", &[], data)?);
    }
    let files = TlsFiles::in_dir(dir, &trust::ingress_id(mesh)?);
    let data = files_data(&[files.ca, files.cert, files.key])?;
    out.push(secret(
        "dpumesh-ingress".into(),
        system_namespace,
        "ingress",
        &[],
        data,
    )?);
    let key = RegistrationKey::load(dir)?;
    let workloads = mesh.config.identity.namespace();
    for service in mesh.config.services.keys() {
        // Only services that can have an identity (the node refuses the others).
        let Ok(id) = SpiffeId::workload(mesh.config.identity.trust_domain(), workloads, service)
        else {
            continue;
        };
        // The registration token, and the workload's certificate for a control
        // channel on TCP (mutual TLS: mounted as DPUMESH_CERTS, under the names the
        // host library reads).
        let files = TlsFiles::in_dir(dir, &id);
        let mut data = BTreeMap::from([("token".to_owned(), base64(key.token(service)))]);
        for (name, path) in [
            ("ca.pem", &files.ca),
            (dpumesh_identity::tls::WORKLOAD_CERT, &files.cert),
            (dpumesh_identity::tls::WORKLOAD_KEY, &files.key),
        ] {
            let bytes = std::fs::read(path).with_context(|| {
                format!("cannot read {} (run `dpumesh certs` first)", path.display())
            })?;
            data.insert(name.to_owned(), base64(bytes));
        }
        out.push(secret(
            format!("dpumesh-token-{service}"),
            workloads,
            "workload",
            &[("dpumesh.io/service", service.clone())],
            data,
        )?);
    }
    Ok(out
        .into_iter()
        .map(|s| (format!("{}.yaml", s.metadata.name), s))
        .collect())
}

/// Writes the Secrets and their kustomization into `out` (owner-only: they hold
/// private keys). Returns the files written.
pub fn write(mesh: &MeshFile, out: &Path, system_namespace: &str) -> Result<Vec<PathBuf>> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    check_name(system_namespace)?;
    let secrets = render(mesh, system_namespace)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(out)
        .with_context(|| format!("cannot make {}", out.display()))?;
    let mut written = Vec::new();
    let mut put = |name: &str, text: String| -> Result<()> {
        use std::io::Write;
        let path = out.join(name);
        let _ = std::fs::remove_file(&path);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .with_context(|| format!("cannot write {}", path.display()))?;
        written.push(path);
        Ok(())
    };
    let mut resources = Vec::new();
    for (file, secret) in &secrets {
        put(file, serde_norway::to_string(secret)?)?;
        resources.push(file.clone());
    }
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Kustomization {
        api_version: &'static str,
        kind: &'static str,
        resources: Vec<String>,
    }
    put(
        "kustomization.yaml",
        serde_norway::to_string(&Kustomization {
            api_version: "kustomize.config.k8s.io/v1beta1",
            kind: "Kustomization",
            resources,
        })?,
    )?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_names_are_checked() {
        for good in ["dpumesh-node-a", "n1", "a-b-9"] {
            check_name(good).unwrap();
        }
        for bad in ["", "Node", "a_b", "-a", "a-", "a.b", &"x".repeat(64)] {
            let e = check_name(bad).unwrap_err().to_string();
            assert!(e.contains("not a Kubernetes name"), "{e}");
        }
    }
}

//! A node certificate for tests of links that take TLS (this crate's, and the control
//! channel's): made once per test process, in a directory removed after loading.

use std::sync::Arc;

/// A node's certificates from a test CA (one per test process).
pub fn test_tls() -> Arc<dpumesh_identity::MeshTls> {
    use dpumesh_identity::{MeshTls, SpiffeId, TlsFiles, ca};
    static TLS: std::sync::OnceLock<Arc<MeshTls>> = std::sync::OnceLock::new();
    TLS.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("dpumesh-test-certs-{}", std::process::id()));
        let id = SpiffeId::node("test.mesh", "n1").unwrap();
        ca::ensure(
            &dir,
            "test.mesh",
            std::slice::from_ref(&id),
            ca::LEAF_VALIDITY,
            false,
        )
        .unwrap();
        let tls = MeshTls::load(TlsFiles::in_dir(&dir, &id), "test.mesh").unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        tls
    })
    .clone()
}

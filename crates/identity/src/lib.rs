//! Who is who in the mesh, and proof of it.
//!
//! - [`spiffe`]: the SPIFFE IDs of nodes, the ingress and workloads.
//! - [`ca`]: the mesh CA and the certificate folder it issues into.
//! - [`tls`]: mutual TLS configs from a folder, peer checks, hot reload, counts.
//! - [`wire`]: a TLS session driven by a non-blocking event loop (the TCP fabric).
//! - [`registration`]: the tokens pods register with.
//! - [`relay`]: a TLS connection as a plain stream (the control channel over TCP).
//! - [`admin`]: who may use an admin API (the token of mutations, the `Host` check).

use std::path::PathBuf;

pub mod admin;
pub mod ca;
pub mod metrics;
pub mod registration;
pub mod relay;
pub mod spiffe;
pub mod tls;
pub mod wire;

pub use spiffe::{Role, SpiffeId};
pub use tls::{HandshakeStats, MeshTls, Peers, TlsFiles, spiffe_of};
pub use wire::TlsSession;

/// The rustls connection type the handshakes return.
pub use rustls::Connection;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("bad identity: {0}")]
    BadId(String),
    #[error("{}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
    #[error("cannot issue a certificate: {0}")]
    Issue(String),
    #[error("handshake refused: {0}")]
    Refused(String),
}

#[cfg(test)]
mod tests;

//! Mutual TLS between the parts of the mesh: rustls configs built from a certificate
//! folder, peers checked against the mesh CA and named by their SPIFFE ID, and the
//! files watched so a rotated certificate is used without a restart.
//!
//! Names are not what is checked: a node connects to an address, and a peer proves
//! who it is with the SPIFFE URI in a certificate the mesh CA signed (as Istio and
//! SPIFFE's own libraries do), so the client side verifies the chain without a
//! DNS-name match and both sides then read the peer's URI.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{ClientConfig, ClientConnection, DigitallySignedStruct, RootCertStore, ServerConfig};
use rustls::{Connection, ServerConnection, SignatureScheme};

use crate::{IdentityError, SpiffeId};

/// How often at most the files are looked at for a change.
const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// Where a holder's trust bundle, certificate chain and key are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// A workload's files as its Secret mounts them: `ca.pem`, `workload.pem`,
    /// `workload.key` (`dpumesh certs --secrets` writes them for each service).
    pub fn workload(dir: &Path) -> Self {
        Self {
            ca: dir.join("ca.pem"),
            cert: dir.join(WORKLOAD_CERT),
            key: dir.join(WORKLOAD_KEY),
        }
    }

    /// `id`'s files in a certificate folder (see [`crate::ca`]).
    pub fn in_dir(dir: &Path, id: &SpiffeId) -> Self {
        let (cert, key) = crate::ca::files(dir, id);
        Self {
            ca: dir.join("ca.pem"),
            cert,
            key,
        }
    }

    /// What tells a changed file: its time, size and inode, through symlinks. A
    /// Kubernetes Secret volume swaps a `..data` symlink to a new folder, so a
    /// rotated file is a new inode even where a copy kept time and size.
    fn stamp(&self) -> Vec<Option<Stamp>> {
        use std::os::unix::fs::MetadataExt;
        [&self.ca, &self.cert, &self.key]
            .iter()
            .map(|p| {
                std::fs::metadata(p)
                    .ok()
                    .and_then(|m| Some((m.modified().ok()?, m.len(), m.ino())))
            })
            .collect()
    }
}

/// A file's modification time, size and inode.
type Stamp = (SystemTime, u64, u64);

/// Handshake counts, for the metrics.
#[derive(Debug, Default)]
pub struct HandshakeStats {
    pub accepted: AtomicU64,
    pub refused: AtomicU64,
    /// Times the certificate files were loaded again after a change.
    pub reloads: AtomicU64,
}

struct Loaded {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    id: SpiffeId,
    stamp: Vec<Option<Stamp>>,
}

/// One holder's mutual TLS: its identity, whom it trusts, and its handshakes.
pub struct MeshTls {
    files: TlsFiles,
    trust_domain: String,
    current: ArcSwap<Loaded>,
    checked: Mutex<Instant>,
    pub stats: HandshakeStats,
}

impl std::fmt::Debug for MeshTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshTls")
            .field("id", &self.identity().to_string())
            .finish_non_exhaustive()
    }
}

fn file_err(path: &Path, reason: impl Into<String>) -> IdentityError {
    IdentityError::File {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// A workload's certificate in its Secret (see [`TlsFiles::workload`]).
pub const WORKLOAD_CERT: &str = "workload.pem";
/// A workload's key in its Secret.
pub const WORKLOAD_KEY: &str = "workload.key";

/// The certificates in a PEM text.
pub(crate) fn read_certs(
    path: &Path,
    pem: &str,
) -> Result<Vec<CertificateDer<'static>>, IdentityError> {
    let certs = rustls_pemfile::certs(&mut pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(path, format!("not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(file_err(path, "no certificate in it"));
    }
    Ok(certs)
}

/// When the first certificate of a PEM text ends.
pub(crate) fn not_after(path: &Path, pem: &str) -> Result<time::OffsetDateTime, IdentityError> {
    let certs = read_certs(path, pem)?;
    let (_, cert) = x509_parser::parse_x509_certificate(&certs[0])
        .map_err(|e| file_err(path, format!("not a certificate: {e}")))?;
    Ok(cert.validity().not_after.to_datetime())
}

/// The SPIFFE ID a certificate names: its one `spiffe://` URI SAN.
pub fn spiffe_of(cert: &CertificateDer<'_>) -> Result<SpiffeId, IdentityError> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert)
        .map_err(|e| IdentityError::BadId(format!("unreadable certificate: {e}")))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| IdentityError::BadId(format!("unreadable subject alternative names: {e}")))?
        .ok_or_else(|| IdentityError::BadId("the certificate has no SPIFFE ID".into()))?;
    let mut uris = san.value.general_names.iter().filter_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(u) if u.starts_with("spiffe://") => Some(*u),
        _ => None,
    });
    let (Some(uri), None) = (uris.next(), uris.next()) else {
        return Err(IdentityError::BadId(
            "a certificate must name exactly one SPIFFE ID".into(),
        ));
    };
    SpiffeId::parse(uri)
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Checks a server's chain against the mesh CA, not its name (see the module note).
#[derive(Debug)]
struct MeshServerVerifier {
    roots: Arc<RootCertStore>,
    algs: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for MeshServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algs.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

fn load(files: &TlsFiles, trust_domain: &str) -> Result<Loaded, IdentityError> {
    let stamp = files.stamp();
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| file_err(p, e.to_string()));
    let ca_pem = read(&files.ca)?;
    let chain = read_certs(&files.cert, &read(&files.cert)?)?;
    let key_pem = read(&files.key)?;
    let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut key_pem.as_bytes())
        .map_err(|e| file_err(&files.key, format!("not PEM: {e}")))?
        .ok_or_else(|| file_err(&files.key, "no private key in it"))?;
    let id = spiffe_of(&chain[0]).map_err(|e| file_err(&files.cert, e.to_string()))?;
    if id.trust_domain != trust_domain {
        return Err(file_err(
            &files.cert,
            format!("{id} is not of the mesh's trust domain {trust_domain}"),
        ));
    }
    let mut roots = RootCertStore::empty();
    for ca in read_certs(&files.ca, &ca_pem)? {
        roots
            .add(ca)
            .map_err(|e| file_err(&files.ca, format!("not a CA certificate: {e}")))?;
    }
    let roots = Arc::new(roots);
    let provider = provider();
    let tls_err = |what: &str, e: rustls::Error| file_err(&files.cert, format!("{what}: {e}"));
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| file_err(&files.ca, format!("cannot verify clients with it: {e}")))?;
    let mut server = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_err("TLS 1.3", e))?
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| tls_err("certificate and key do not match", e))?;
    // Links live long: no tickets (nothing is written after the handshake but data).
    server.send_tls13_tickets = 0;
    let verifier = Arc::new(MeshServerVerifier {
        roots,
        algs: provider.signature_verification_algorithms,
    });
    let mut client = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_err("TLS 1.3", e))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(chain, key)
        .map_err(|e| tls_err("certificate and key do not match", e))?;
    client.resumption = rustls::client::Resumption::disabled();
    Ok(Loaded {
        server: Arc::new(server),
        client: Arc::new(client),
        id,
        stamp,
    })
}

fn refused(e: impl std::fmt::Display) -> IdentityError {
    IdentityError::Refused(e.to_string())
}

/// Moves a blocking handshake on until it is done.
fn handshake<D>(
    conn: &mut rustls::ConnectionCommon<D>,
    sock: &mut (impl Read + Write),
) -> Result<(), IdentityError> {
    while conn.is_handshaking() {
        conn.complete_io(sock).map_err(refused)?;
    }
    Ok(())
}

/// Whom a handshake accepts as the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peers {
    /// Nodes and the ingress (fabric links).
    MeshComponents,
    /// Any identity of the trust domain, workloads too (the control channel, where
    /// pods call their node).
    TrustDomain,
    /// Nodes only (the Pingmesh server, whose callers are the nodes' agents).
    Nodes,
    /// The Pingmesh controller and analyzer only (what its agents dial).
    Pingmesh,
}

/// The name a client asks for: servers are told apart by their SPIFFE IDs, which
/// the caller checks, not by DNS names.
pub const SERVER_NAME: &str = "dpumesh.mesh";

/// The byte a server sends (encrypted) once it accepted the client's certificate.
const ACCEPTED: u8 = 0xA5;

impl MeshTls {
    /// Loads `files`; the certificate must name an identity of `trust_domain`.
    pub fn load(files: TlsFiles, trust_domain: &str) -> Result<Arc<Self>, IdentityError> {
        let loaded = load(&files, trust_domain)?;
        Ok(Arc::new(Self {
            files,
            trust_domain: trust_domain.to_owned(),
            current: ArcSwap::from_pointee(loaded),
            checked: Mutex::new(Instant::now()),
            stats: HandshakeStats::default(),
        }))
    }

    /// A workload's certificates from its Secret's folder ([`TlsFiles::workload`]), of
    /// the trust domain its certificate names.
    pub fn load_workload(dir: &Path) -> Result<Arc<Self>, IdentityError> {
        let files = TlsFiles::workload(dir);
        let pem = std::fs::read_to_string(&files.cert)
            .map_err(|e| file_err(&files.cert, e.to_string()))?;
        let id = spiffe_of(&read_certs(&files.cert, &pem)?[0])?;
        let trust_domain = id.trust_domain.clone();
        Self::load(files, &trust_domain)
    }

    /// Whom this side presents itself as.
    pub fn identity(&self) -> SpiffeId {
        self.current.load().id.clone()
    }

    /// Loads the files again if they changed since they were last read (looked at
    /// once a second at most). A broken new file keeps the old certificate in use
    /// and says why. Returns whether a new certificate or bundle is now in use.
    pub fn refresh(&self) -> bool {
        {
            let mut checked = self.checked.lock();
            if checked.elapsed() < RELOAD_CHECK {
                return false;
            }
            *checked = Instant::now();
        }
        self.reload()
    }

    /// [`Self::refresh`] without the once-a-second limit.
    pub fn reload(&self) -> bool {
        if self.files.stamp() == self.current.load().stamp {
            return false;
        }
        match load(&self.files, &self.trust_domain) {
            Ok(loaded) => {
                tracing::info!(id = %loaded.id, cert = %self.files.cert.display(), "loaded a new certificate");
                self.current.store(Arc::new(loaded));
                self.stats.reloads.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "kept the certificate in use: the new files do not load");
                false
            }
        }
    }

    /// A peer is accepted when the mesh CA vouches for it as one of `peers` of this
    /// trust domain.
    fn check_peer(
        &self,
        certs: Option<&[CertificateDer<'_>]>,
        peers: Peers,
    ) -> Result<SpiffeId, IdentityError> {
        let cert = certs
            .and_then(|c| c.first())
            .ok_or_else(|| IdentityError::Refused("the peer presented no certificate".into()))?;
        let id = spiffe_of(cert).map_err(refused)?;
        if id.trust_domain != self.trust_domain {
            return Err(IdentityError::Refused(format!(
                "{id} is not of trust domain {}",
                self.trust_domain
            )));
        }
        let refused = |why: &str| Err(IdentityError::Refused(format!("{id} {why}")));
        match peers {
            Peers::MeshComponents if !id.is_mesh_component() => {
                return refused("is not a node or the ingress: only they open fabric links");
            }
            Peers::Nodes if !id.is_node() => {
                return refused("is not a node: only nodes' agents call Pingmesh");
            }
            Peers::Pingmesh if id.role != crate::Role::Pingmesh => {
                return refused("is not the Pingmesh controller");
            }
            _ => {}
        }
        Ok(id)
    }

    fn counted<T>(&self, r: Result<T, IdentityError>) -> Result<T, IdentityError> {
        let counter = if r.is_ok() {
            &self.stats.accepted
        } else {
            &self.stats.refused
        };
        counter.fetch_add(1, Ordering::Relaxed);
        r
    }

    /// The accepting side's TLS for an asynchronous handshake (tokio-rustls),
    /// offering `alpn` (`h2` for gRPC). Call [`Self::verify_peer`] once the handshake
    /// is done: the configuration checks the chain, not the SPIFFE ID.
    pub fn server_config(&self, alpn: &[&[u8]]) -> Arc<ServerConfig> {
        self.refresh();
        let mut config = (*self.current.load().server).clone();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }

    /// The connecting side's TLS for an asynchronous handshake, offering `alpn`;
    /// dial with [`SERVER_NAME`] and call [`Self::verify_peer`] after the handshake.
    pub fn client_config(&self, alpn: &[&[u8]]) -> Arc<ClientConfig> {
        self.refresh();
        let mut config = (*self.current.load().client).clone();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }

    /// Who the peer of a finished asynchronous handshake is, when the mesh CA vouches
    /// for it as one of `peers` (counted in the handshake statistics).
    pub fn verify_peer(
        &self,
        certs: Option<&[CertificateDer<'_>]>,
        peers: Peers,
    ) -> Result<SpiffeId, IdentityError> {
        let r = self.check_peer(certs, peers);
        self.counted(r)
    }

    /// The connecting side's handshake on a blocking socket (with timeouts set):
    /// returns the session and who the peer is once the peer has accepted this
    /// side's certificate too.
    pub fn connect<S: Read + Write>(
        &self,
        sock: &mut S,
    ) -> Result<(Connection, SpiffeId), IdentityError> {
        self.connect_to(sock, Peers::MeshComponents)
    }

    /// [`Self::connect`] accepting `peers`.
    pub fn connect_to<S: Read + Write>(
        &self,
        sock: &mut S,
        peers: Peers,
    ) -> Result<(Connection, SpiffeId), IdentityError> {
        self.refresh();
        let config = self.current.load().client.clone();
        let r = (|| {
            let name = ServerName::try_from(SERVER_NAME).expect("a valid name");
            let mut conn = ClientConnection::new(config, name).map_err(refused)?;
            handshake(&mut conn, sock)?;
            let id = self.check_peer(conn.peer_certificates(), peers)?;
            let mut byte = [0u8; 1];
            rustls::Stream::new(&mut conn, sock)
                .read_exact(&mut byte)
                .map_err(|e| {
                    IdentityError::Refused(format!("the peer refused this side's certificate: {e}"))
                })?;
            if byte[0] != ACCEPTED {
                return Err(IdentityError::Refused(
                    "the peer's confirmation is wrong".into(),
                ));
            }
            Ok((Connection::from(conn), id))
        })();
        self.counted(r)
    }

    /// The accepting side's handshake on a blocking socket (with timeouts set).
    pub fn accept<S: Read + Write>(
        &self,
        sock: &mut S,
    ) -> Result<(Connection, SpiffeId), IdentityError> {
        self.accept_from(sock, Peers::MeshComponents)
    }

    /// [`Self::accept`] accepting `peers`.
    pub fn accept_from<S: Read + Write>(
        &self,
        sock: &mut S,
        peers: Peers,
    ) -> Result<(Connection, SpiffeId), IdentityError> {
        self.refresh();
        let config = self.current.load().server.clone();
        let r = (|| {
            let mut conn = ServerConnection::new(config).map_err(refused)?;
            handshake(&mut conn, sock)?;
            let id = self.check_peer(conn.peer_certificates(), peers)?;
            let mut stream = rustls::Stream::new(&mut conn, sock);
            stream
                .write_all(&[ACCEPTED])
                .and_then(|()| stream.flush())
                .map_err(refused)?;
            Ok((Connection::from(conn), id))
        })();
        self.counted(r)
    }
}

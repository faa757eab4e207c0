//! HTTPS at the ingress: rustls terminates TLS 1.2 and 1.3 with ALPN (h2 and
//! http/1.1), chooses among several certificates by SNI, resumes sessions (tickets
//! and a session cache shared by every shard thread and kept across reloads), asks
//! for client certificates when a client CA is configured, and picks up rotated
//! files without a restart. A file that cannot be used (unreadable, a key that is not
//! the certificate's, an expired certificate) is refused with its path and reason: at
//! start the ingress does not start; on a reload the certificates in use stay.

mod certs;
mod client;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::server::{ProducesTickets, ServerSessionMemoryCache, StoresServerSessions};

use dpumesh_config::{IngressTls, TlsVersion};

pub use client::{in_mesh_domain, principal_of};

/// What the ingress's TLS needs: the `ingress.tls` section and the mesh's trust
/// domain (whose identities no client certificate may claim).
#[derive(Debug, Clone)]
pub struct TlsSettings {
    pub files: IngressTls,
    pub trust_domain: String,
}

/// Why TLS cannot be set up (or reloaded).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
    #[error("TLS setup: {0}")]
    Setup(String),
}

/// Sessions remembered for resumption by ID (TLS 1.2 clients without tickets).
const SESSION_CACHE: usize = 16 * 1024;

/// A file's modification time, size and inode: a Secret volume swaps a symlink to a
/// new folder, so a rotated file is a new inode even where a copy kept time and size.
type Stamp = Option<(SystemTime, u64, u64)>;

fn stamp(path: &Path) -> Stamp {
    std::fs::metadata(path)
        .ok()
        .and_then(|m| Some((m.modified().ok()?, m.len(), m.ino())))
}

/// The TLS side of the ingress: the server config every shard accepts with, swapped
/// whole when the files change.
pub struct Terminator {
    settings: TlsSettings,
    provider: Arc<CryptoProvider>,
    config: ArcSwap<ServerConfig>,
    /// Kept across reloads: a client resumes after a rotation.
    sessions: Arc<dyn StoresServerSessions>,
    tickets: Arc<dyn ProducesTickets>,
    stamps: Mutex<Vec<Stamp>>,
}

impl std::fmt::Debug for Terminator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Terminator")
            .field("certificates", &self.settings.files.certificates.len())
            .finish_non_exhaustive()
    }
}

impl Terminator {
    /// Reads the files and builds the server config, checking validity at `now`.
    pub fn load(settings: TlsSettings, now: SystemTime) -> Result<Arc<Self>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tickets = rustls::crypto::ring::Ticketer::new()
            .map_err(|e| TlsError::Setup(format!("session tickets: {e}")))?;
        let sessions: Arc<dyn StoresServerSessions> = ServerSessionMemoryCache::new(SESSION_CACHE);
        let stamps = files(&settings.files).iter().map(|p| stamp(p)).collect();
        let config = build(&settings, &provider, &sessions, &tickets, now)?;
        Ok(Arc::new(Self {
            settings,
            provider,
            config: ArcSwap::from(config),
            sessions,
            tickets,
            stamps: Mutex::new(stamps),
        }))
    }

    /// The config a new connection is accepted with.
    pub fn config(&self) -> Arc<ServerConfig> {
        self.config.load_full()
    }

    /// How often the files are looked at.
    pub fn reload_every(&self) -> Duration {
        self.settings.files.reload()
    }

    /// Looks at the files; when one changed, builds a new config from them and swaps
    /// it in. `Ok(true)`: reloaded; an error leaves the config in use as it was (and
    /// is retried at the next change).
    pub fn reload_if_changed(&self, now: SystemTime) -> Result<bool, TlsError> {
        let current: Vec<Stamp> = files(&self.settings.files)
            .iter()
            .map(|p| stamp(p))
            .collect();
        {
            let mut seen = self.stamps.lock();
            if *seen == current {
                return Ok(false);
            }
            // Seen even if it fails: the error is said once per change, not per look.
            *seen = current;
        }
        let result = build(
            &self.settings,
            &self.provider,
            &self.sessions,
            &self.tickets,
            now,
        );
        match result {
            Ok(config) => {
                self.config.store(config);
                metrics::counter!("dpumesh_ingress_tls_reloads_total", "result" => "ok")
                    .increment(1);
                Ok(true)
            }
            Err(e) => {
                metrics::counter!("dpumesh_ingress_tls_reloads_total", "result" => "refused")
                    .increment(1);
                Err(e)
            }
        }
    }
}

/// Every file the config is built from.
fn files(tls: &IngressTls) -> Vec<PathBuf> {
    tls.certificates
        .iter()
        .flat_map(|c| [c.cert.clone(), c.key.clone()])
        .chain(tls.client_ca.clone())
        .collect()
}

fn build(
    settings: &TlsSettings,
    provider: &Arc<CryptoProvider>,
    sessions: &Arc<dyn StoresServerSessions>,
    tickets: &Arc<dyn ProducesTickets>,
    now: SystemTime,
) -> Result<Arc<ServerConfig>, TlsError> {
    let tls = &settings.files;
    let set = certs::CertSet::load(&tls.certificates, provider, now)?;
    let resolver = Arc::new(certs::SniResolver {
        set,
        strict: tls.strict_sni,
    });
    let versions: &[&rustls::SupportedProtocolVersion] = match tls.min_version {
        TlsVersion::Tls12 => &[&rustls::version::TLS13, &rustls::version::TLS12],
        TlsVersion::Tls13 => &[&rustls::version::TLS13],
    };
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)
        .map_err(|e| TlsError::Setup(e.to_string()))?;
    let builder = match (&tls.client_ca, tls.client_certs()) {
        (Some(ca), Some(mode)) => builder.with_client_cert_verifier(Arc::new(
            client::ClientVerifier::load(ca, mode, &settings.trust_domain, provider.clone())?,
        )),
        _ => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config.session_storage = sessions.clone();
    config.ticketer = tickets.clone();
    Ok(Arc::new(config))
}

/// What the handshake established, as the request path reads it.
#[derive(Debug, Clone, Default)]
pub struct Session {
    /// The verified client certificate's principal ([`principal_of`]).
    pub principal: Option<Arc<str>>,
    /// ALPN's choice.
    pub alpn: Alpn,
}

/// The application protocol ALPN chose.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Alpn {
    H2,
    Http1,
    /// The client offered none: the connection's first bytes tell.
    #[default]
    None,
}

impl Session {
    /// Reads a completed handshake.
    pub fn of(conn: &rustls::ServerConnection) -> Self {
        let alpn = match conn.alpn_protocol() {
            Some(b"h2") => Alpn::H2,
            Some(b"http/1.1") => Alpn::Http1,
            _ => Alpn::None,
        };
        let principal = conn
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(principal_of)
            .map(Arc::from);
        let version = match conn.protocol_version() {
            Some(rustls::ProtocolVersion::TLSv1_3) => "1.3",
            Some(rustls::ProtocolVersion::TLSv1_2) => "1.2",
            _ => "other",
        };
        let resumed = matches!(conn.handshake_kind(), Some(rustls::HandshakeKind::Resumed));
        metrics::counter!("dpumesh_ingress_tls_handshakes_total", "version" => version, "resumed" => if resumed { "true" } else { "false" })
            .increment(1);
        Self { principal, alpn }
    }
}

/// Looks at the files every `reload_every` until stopped; a refused reload is logged
/// with its reason and the certificates in use stay.
pub(crate) fn spawn_reloader(
    terminator: Arc<Terminator>,
) -> std::io::Result<(crossbeam_channel::Sender<()>, std::thread::JoinHandle<()>)> {
    let (stop, stopped) = crossbeam_channel::bounded::<()>(1);
    let every = terminator.reload_every();
    let handle = std::thread::Builder::new()
        .name("dpumesh-ingress-tls".into())
        .spawn(move || {
            while let Err(crossbeam_channel::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(every)
            {
                match terminator.reload_if_changed(SystemTime::now()) {
                    Ok(true) => tracing::info!("ingress certificates reloaded"),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::error!(error = %e, "ingress certificates not reloaded: the ones in use stay")
                    }
                }
            }
        })?;
    Ok((stop, handle))
}

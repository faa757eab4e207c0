//! HTTPS at the ingress, driven as a platform team would: curl over TLS with HTTP/2
//! and HTTP/1.1, certificates chosen by SNI (a wildcard among them), TLS 1.2 and 1.3,
//! session resumption, client certificates whose principal the chain and the service
//! see, certificates rotated on disk without a restart, and bad input (TLS garbage,
//! plaintext on the TLS port, an unknown SNI, expired or mesh-named certificates)
//! answered with a failed handshake while the ingress serves on.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::mesh::{Mesh, admin_get, mesh_files_with};
use common::token;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A test CA that signs server and client certificates.
struct Pki {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

impl Pki {
    fn new(name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        Self {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf for `dns` names and `uri` SANs, valid now unless `expired`: (cert, key).
    fn leaf(&self, dns: &[&str], uri: Option<&str>, expired: bool) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(dns.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        if let Some(uri) = uri {
            params
                .subject_alt_names
                .push(SanType::URI(uri.try_into().unwrap()));
        }
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

fn write(dir: &Path, name: &str, text: &str) {
    // Through a rename, as a Secret volume's swap is atomic.
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(tmp, dir.join(name)).unwrap();
}

/// A TLS client: which handshake it had, and what it read.
struct Tls {
    config: Arc<rustls::ClientConfig>,
}

struct Handshake {
    version: Option<rustls::ProtocolVersion>,
    kind: Option<rustls::HandshakeKind>,
    alpn: Option<Vec<u8>>,
    leaf: CertificateDer<'static>,
    stream: rustls::StreamOwned<rustls::ClientConnection, TcpStream>,
}

impl Tls {
    fn new(
        ca: &str,
        versions: &[&'static rustls::SupportedProtocolVersion],
        client: Option<(&str, &str)>,
    ) -> Self {
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_certs(ca) {
            roots.add(c).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(roots);
        let mut config = match client {
            Some((cert, key)) => builder
                .with_client_auth_cert(rustls_certs(cert), rustls_key(key))
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Self {
            config: Arc::new(config),
        }
    }

    fn connect(&self, at: SocketAddr, name: &str) -> Result<Handshake, String> {
        let name = ServerName::try_from(name.to_owned()).unwrap();
        let conn = rustls::ClientConnection::new(self.config.clone(), name).unwrap();
        let tcp = TcpStream::connect(at).map_err(|e| e.to_string())?;
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut stream = rustls::StreamOwned::new(conn, tcp);
        while stream.conn.is_handshaking() {
            stream
                .conn
                .complete_io(&mut stream.sock)
                .map_err(|e| e.to_string())?;
        }
        // TLS 1.3 tells a client certificate's refusal after the client's Finished:
        // a first read hears it.
        Ok(Handshake {
            version: stream.conn.protocol_version(),
            kind: stream.conn.handshake_kind(),
            alpn: stream.conn.alpn_protocol().map(<[u8]>::to_vec),
            leaf: stream.conn.peer_certificates().unwrap()[0]
                .clone()
                .into_owned(),
            stream,
        })
    }
}

impl Handshake {
    /// An HTTP/1.1 GET on this connection (ALPN must have said http/1.1): its status
    /// line and body, or the error the connection ended with.
    fn get(&mut self, path: &str, host: &str, token: &str) -> Result<(u16, String), String> {
        let req = format!(
            "GET {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {token}\r\nconnection: close\r\n\r\n"
        );
        self.stream
            .write_all(req.as_bytes())
            .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        match self.stream.read_to_end(&mut out) {
            Ok(_) => {}
            Err(e) if out.is_empty() => return Err(e.to_string()),
            Err(_) => {}
        }
        let text = String::from_utf8_lossy(&out).into_owned();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("no status in {text:?}"))?;
        let body = text
            .split_once("\r\n\r\n")
            .map_or("", |(_, b)| b)
            .to_owned();
        Ok((status, body))
    }
}

impl Handshake {
    /// An HTTP/1.1 GET that keeps the connection: its status and body (read to its
    /// `content-length`).
    fn get_kept(&mut self, path: &str, host: &str, token: &str) -> (u16, String) {
        let req =
            format!("GET {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {token}\r\n\r\n");
        self.stream.write_all(req.as_bytes()).unwrap();
        let (status, _, body) =
            common::mesh::read_response(&mut self.stream).expect("an answer within 10 s");
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}

fn rustls_certs(pem: &str) -> Vec<CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap()
}

fn rustls_key(pem: &str) -> PrivateKeyDer<'static> {
    use rustls::pki_types::pem::PemObject;
    PrivateKeyDer::from_pem_slice(pem.as_bytes()).unwrap()
}

/// `curl` over TLS: (HTTP version, status, body).
fn curl(ingress: SocketAddr, host: &str, args: &[&str], dir: &Path) -> (String, u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20", "--cacert"])
        .arg(dir.join("tls/ca.pem"))
        .args([
            "--resolve",
            &format!("{host}:{}:127.0.0.1", ingress.port()),
            "-w",
            "\n%{http_version} %{http_code}",
        ])
        .args(args)
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, tail) = text.rsplit_once('\n').unwrap_or(("", &text));
    let mut tail = tail.split(' ');
    let version = tail.next().unwrap_or_default().to_owned();
    let status = tail.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    assert!(
        out.status.success() || status != 0,
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (version, status, body.to_owned())
}

const PARTNER: &str = "spiffe://partners.example/client-a";

#[test]
fn https_at_the_ingress() {
    let dir = tempfile::tempdir().unwrap();
    let edit_mesh = |m: String| {
        m.replace(
            "  max_body: 8MiB",
            "  max_body: 8MiB\n  tls:\n    certificates:\n      - {cert: tls/www.pem, key: tls/www.key}\n      - {cert: tls/api.pem, key: tls/api.key}\n    strict_sni: true\n    client_ca: tls/clients.pem\n    reload: 200ms",
        )
    };
    // A chain that only the partner's client certificate passes (no token).
    let edit_policy = |p: String| {
        let p = p.replacen(
            "filters:\n",
            &format!(
                "filters:\n  partners:\n    component: {}\n    config:\n      action: ALLOW\n      policies:\n        - name: partner\n          permissions: [{{path: {{prefix: /partners}}}}]\n          principals: [{{identity: {{exact: \"{PARTNER}\"}}}}]\n",
                dpumesh_test_artifacts::FILTER_RBAC
            ),
            1,
        );
        let p = p.replacen("chains:\n", "chains:\n  partners: [partners]\n", 1);
        p.replacen(
            "routes:\n",
            "routes:\n  - {path_prefix: /partners, service: frontend, chain: partners}\n",
            1,
        )
    };
    let (file, ingress) = mesh_files_with(dir.path(), edit_mesh, edit_policy);
    let tls_dir = dir.path().join("tls");
    std::fs::create_dir_all(&tls_dir).unwrap();
    let servers = Pki::new("server CA");
    let clients = Pki::new("client CA");
    let (www, www_key) = servers.leaf(&["www.test"], None, false);
    let (api, api_key) = servers.leaf(&["*.api.test"], None, false);
    write(&tls_dir, "ca.pem", &servers.pem);
    write(&tls_dir, "www.pem", &www);
    write(&tls_dir, "www.key", &www_key);
    write(&tls_dir, "api.pem", &api);
    write(&tls_dir, "api.key", &api_key);
    write(&tls_dir, "clients.pem", &clients.pem);
    let mesh = Mesh::start(dir, &file, ingress);
    let dir = mesh._dir.path();
    assert!(
        mesh.banner.contains(&format!("https://{ingress}/")),
        "{}",
        mesh.banner
    );
    let alice = token("alice", &["user"]);
    let auth = format!("authorization: Bearer {alice}");

    // curl, HTTP/2 by ALPN, to the first certificate's name: curl checks the name,
    // so a success is the right certificate.
    let (version, status, body) = curl(
        ingress,
        "www.test",
        &[
            "--http2",
            "-H",
            &auth,
            &format!("https://www.test:{}/headers", ingress.port()),
        ],
        dir,
    );
    assert_eq!((version.as_str(), status), ("2", 200), "{body}");
    let seen: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(seen["headers"]["x-forwarded-proto"][0], "https", "{seen}");
    assert_eq!(
        seen["caller"]["identity"],
        serde_json::Value::Null,
        "no client certificate, no principal: {seen}"
    );
    // HTTP/1.1 over TLS 1.2, to a name only the wildcard certificate has.
    let (version, status, _) = curl(
        ingress,
        "shop.api.test",
        &[
            "--http1.1",
            "--tls-max",
            "1.2",
            "-H",
            &auth,
            &format!("https://shop.api.test:{}/hotels?user=7", ingress.port()),
        ],
        dir,
    );
    assert_eq!((version.as_str(), status), ("1.1", 200));

    // ALPN offers h2 first.
    let h2 = Tls::new(&servers.pem, &[&rustls::version::TLS13], None);
    let shaken = h2.connect(ingress, "www.test").unwrap();
    assert_eq!(shaken.alpn.as_deref(), Some(&b"h2"[..]));
    drop(shaken);
    // TLS 1.3 and 1.2 both, each resumed on the next connection (a TLS 1.3 ticket
    // comes after the handshake: the first connection is used, so it is read).
    for (version, want) in [
        (&rustls::version::TLS13, rustls::ProtocolVersion::TLSv1_3),
        (&rustls::version::TLS12, rustls::ProtocolVersion::TLSv1_2),
    ] {
        let mut client = Tls::new(&servers.pem, &[version], None);
        Arc::get_mut(&mut client.config).unwrap().alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut first = client.connect(ingress, "www.test").unwrap();
        assert_eq!(first.version, Some(want));
        assert_eq!(first.kind, Some(rustls::HandshakeKind::Full));
        assert_eq!(first.alpn.as_deref(), Some(&b"http/1.1"[..]));
        assert_eq!(first.get("/ping", "www.test", &alice).unwrap().0, 200);
        let again = client.connect(ingress, "www.test").unwrap();
        assert_eq!(
            again.kind,
            Some(rustls::HandshakeKind::Resumed),
            "{want:?} resumes"
        );
    }

    // strict_sni: a name no certificate has fails the handshake.
    let client = Tls::new(&servers.pem, &[&rustls::version::TLS13], None);
    let e = client
        .connect(ingress, "other.test")
        .err()
        .expect("unknown SNI refused");
    assert!(!e.is_empty());

    // A partner's client certificate: the chain's identity rule and the service see
    // its principal.
    let (partner, partner_key) = clients.leaf(&["client-a.partners.example"], Some(PARTNER), false);
    let mut h1 = Tls::new(
        &servers.pem,
        &[&rustls::version::TLS13],
        Some((&partner, &partner_key)),
    );
    Arc::get_mut(&mut h1.config).unwrap().alpn_protocols = vec![b"http/1.1".to_vec()];
    let (status, body) = h1
        .connect(ingress, "www.test")
        .unwrap()
        .get("/headers", "www.test", &alice)
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let seen: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(seen["caller"]["identity"], PARTNER, "{seen}");
    let (status, _) = h1
        .connect(ingress, "www.test")
        .unwrap()
        .get("/partners", "www.test", "-")
        .unwrap();
    assert_ne!(status, 403, "the partner passes the identity rule");
    // A kept-alive HTTPS connection quiet past `park_after` (250 ms) is parked and
    // taken up again: served, with its TLS session's identity still its own.
    let parks = || {
        common::mesh::metric_sum(
            mesh.ingress_admin.unwrap(),
            "dpumesh_ingress_connections_parked_total",
        )
    };
    let parked_before = parks();
    let mut kept = h1.connect(ingress, "www.test").unwrap();
    for _ in 0..2 {
        let (status, body) = kept.get_kept("/headers", "www.test", &alice);
        assert_eq!(status, 200, "{body}");
        let seen: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(seen["caller"]["identity"], PARTNER, "{seen}");
        std::thread::sleep(Duration::from_millis(600));
    }
    let parked = parks();
    assert!(
        parked >= parked_before + 2.0,
        "parked after each answer: {parked_before} then {parked}"
    );
    drop(kept);
    // Without it, the rule denies.
    let (_, status, _) = curl(
        ingress,
        "www.test",
        &[&format!("https://www.test:{}/partners", ingress.port())],
        dir,
    );
    assert_eq!(status, 403);
    // A client certificate naming a mesh workload, or expired, is refused.
    for (cert, key) in [
        clients.leaf(
            &[],
            Some("spiffe://dpumesh.local/ns/default/sa/frontend"),
            false,
        ),
        clients.leaf(
            &["client-b.partners.example"],
            Some("spiffe://partners.example/client-b"),
            true,
        ),
    ] {
        let mut c = Tls::new(
            &servers.pem,
            &[&rustls::version::TLS13],
            Some((&cert, &key)),
        );
        Arc::get_mut(&mut c.config).unwrap().alpn_protocols = vec![b"http/1.1".to_vec()];
        let refused = c
            .connect(ingress, "www.test")
            .and_then(|mut h| h.get("/headers", "www.test", &alice));
        assert!(refused.is_err(), "refused: {refused:?}");
    }

    // gRPC over TLS: the mesh's own answers are trailers-only gRPC responses.
    let grpc = |extra: &[&str]| -> Vec<(String, String)> {
        let mut args = vec![
            "--http2",
            "-i",
            "-o",
            "-",
            "-X",
            "POST",
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            "--data-binary",
            "",
        ];
        args.extend_from_slice(extra);
        let url = format!("https://www.test:{}/hotel.Hotels/Get", ingress.port());
        args.push(&url);
        let (version, status, body) = curl(ingress, "www.test", &args, dir);
        assert_eq!((version.as_str(), status), ("2", 200), "{body}");
        body.lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect()
    };
    let get = |h: &[(String, String)], k: &str| {
        h.iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no {k} in {h:?}"))
    };
    let no_token = grpc(&[]);
    assert_eq!(
        get(&no_token, "grpc-status"),
        "16",
        "UNAUTHENTICATED: {no_token:?}"
    );
    assert_eq!(get(&no_token, "content-type"), "application/grpc");
    assert!(!get(&no_token, "grpc-message").is_empty());
    let guest = format!("authorization: Bearer {}", token("guest", &["guest"]));
    let denied = grpc(&["-H", &guest]);
    assert_eq!(
        get(&denied, "grpc-status"),
        "7",
        "PERMISSION_DENIED: {denied:?}"
    );
    let bad_timeout = grpc(&["-H", &auth, "-H", "grpc-timeout: soon"]);
    assert_eq!(get(&bad_timeout, "grpc-status"), "13", "{bad_timeout:?}");
    assert!(get(&bad_timeout, "grpc-message").contains("grpc-timeout"));

    // TLS garbage and plaintext HTTP on the TLS port: closed, nothing served.
    for junk in [
        &b"\x16\x03\x01\x00\x05hello-this-is-not-tls"[..],
        b"GET /hotels HTTP/1.1\r\nhost: www.test\r\n\r\n",
    ] {
        let mut s = TcpStream::connect(ingress).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(junk).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        assert!(!String::from_utf8_lossy(&out).contains("200 OK"));
    }

    // Rotation: a new certificate on disk is served without a restart.
    let (www2, www2_key) = servers.leaf(&["www.test"], None, false);
    write(&tls_dir_of(dir), "www.key", &www2_key);
    write(&tls_dir_of(dir), "www.pem", &www2);
    let new_leaf = rustls_certs(&www2).remove(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.connect(ingress, "www.test").unwrap().leaf != new_leaf {
        assert!(
            Instant::now() < deadline,
            "the rotated certificate was never served"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // An expired one is refused, and the one in use stays.
    let (old, old_key) = servers.leaf(&["www.test"], None, true);
    let refused_before = reloads_refused(&mesh);
    write(&tls_dir_of(dir), "www.key", &old_key);
    write(&tls_dir_of(dir), "www.pem", &old);
    let deadline = Instant::now() + Duration::from_secs(30);
    while reloads_refused(&mesh) <= refused_before {
        assert!(
            Instant::now() < deadline,
            "the expired certificate was never looked at"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(client.connect(ingress, "www.test").unwrap().leaf, new_leaf);
    let (version, status, _) = curl(
        ingress,
        "www.test",
        &[
            "--http2",
            "-H",
            &auth,
            &format!("https://www.test:{}/hotels?user=7", ingress.port()),
        ],
        dir,
    );
    assert_eq!(
        (version.as_str(), status),
        ("2", 200),
        "the ingress serves on"
    );
}

fn tls_dir_of(dir: &Path) -> std::path::PathBuf {
    dir.join("tls")
}

/// `dpumesh_ingress_tls_reloads_total{result="refused"}` on the ingress's admin API.
fn reloads_refused(mesh: &Mesh) -> u64 {
    let admin = mesh
        .ingress_admin
        .expect("the sample's ingress has an admin API");
    let (_, text) = admin_get(admin, "/metrics");
    text.lines()
        .filter(|l| l.starts_with("dpumesh_ingress_tls_reloads_total") && l.contains("refused"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

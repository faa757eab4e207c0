//! Handshakes between certificates of one CA, another CA, and the wrong roles.

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::*;

fn folder(td: &str, ids: &[SpiffeId]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    ca::ensure(dir.path(), td, ids, ca::LEAF_VALIDITY, false).unwrap();
    dir
}

/// A node `n1` and the ingress of trust domain `td`, with their certificates.
struct Mesh {
    dir: tempfile::TempDir,
    n1: SpiffeId,
    ing: SpiffeId,
    node: std::sync::Arc<MeshTls>,
    ingress: std::sync::Arc<MeshTls>,
}

impl Mesh {
    fn new() -> Self {
        let (n1, ing) = (
            SpiffeId::node("td", "n1").unwrap(),
            SpiffeId::ingress("td").unwrap(),
        );
        let dir = folder("td", &[n1.clone(), ing.clone()]);
        let node = MeshTls::load(TlsFiles::in_dir(dir.path(), &n1), "td").unwrap();
        let ingress = MeshTls::load(TlsFiles::in_dir(dir.path(), &ing), "td").unwrap();
        Self {
            dir,
            n1,
            ing,
            node,
            ingress,
        }
    }
}

/// Runs `accept` on one end of a TCP connection and `connect` on the other.
fn pair(
    server: &MeshTls,
    client: &MeshTls,
) -> (
    Result<SpiffeId, IdentityError>,
    Result<SpiffeId, IdentityError>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let accepted = s.spawn(|| {
            let (mut sock, _) = listener.accept().unwrap();
            sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            server.accept(&mut sock).map(|(_, id)| id)
        });
        let mut sock = TcpStream::connect(addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let connected = client.connect(&mut sock).map(|(_, id)| id);
        drop(sock);
        (dpumesh_test_support::joined(accepted), connected)
    })
}

#[test]
fn two_parts_of_one_mesh_learn_each_others_identity() {
    let Mesh {
        dir: _dir,
        n1,
        ing,
        node,
        ingress,
    } = Mesh::new();
    let (server_saw, client_saw) = pair(&node, &ingress);
    assert_eq!(server_saw.unwrap(), ing);
    assert_eq!(client_saw.unwrap(), n1);
    assert_eq!(node.stats.accepted.load(Ordering::Relaxed), 1);
    assert_eq!(ingress.stats.accepted.load(Ordering::Relaxed), 1);
}

#[test]
fn a_certificate_of_another_ca_is_refused_and_counted() {
    let n1 = SpiffeId::node("td", "n1").unwrap();
    let ours = folder("td", std::slice::from_ref(&n1));
    let theirs = folder("td", &[SpiffeId::ingress("td").unwrap()]);
    let node = MeshTls::load(TlsFiles::in_dir(ours.path(), &n1), "td").unwrap();
    let rogue = MeshTls::load(
        TlsFiles::in_dir(theirs.path(), &SpiffeId::ingress("td").unwrap()),
        "td",
    )
    .unwrap();
    let (server_saw, client_saw) = pair(&node, &rogue);
    assert!(server_saw.is_err());
    // The rogue does not trust the node's CA either.
    assert!(client_saw.is_err(), "{client_saw:?}");
    assert_eq!(node.stats.refused.load(Ordering::Relaxed), 1);
    assert_eq!(node.stats.accepted.load(Ordering::Relaxed), 0);
}

#[test]
fn a_workload_certificate_cannot_open_a_link() {
    let n1 = SpiffeId::node("td", "n1").unwrap();
    let w = SpiffeId::workload("td", "default", "frontend").unwrap();
    let dir = folder("td", &[n1.clone(), w.clone()]);
    let node = MeshTls::load(TlsFiles::in_dir(dir.path(), &n1), "td").unwrap();
    let pod = MeshTls::load(TlsFiles::in_dir(dir.path(), &w), "td").unwrap();
    let (server_saw, client_saw) = pair(&node, &pod);
    let e = server_saw.unwrap_err().to_string();
    assert!(e.contains("only they open fabric links"), "{e}");
    let e = client_saw.unwrap_err().to_string();
    assert!(e.contains("refused this side's certificate"), "{e}");
}

#[test]
fn another_trust_domain_is_refused() {
    let n1 = SpiffeId::node("td", "n1").unwrap();
    let dir = folder("td", std::slice::from_ref(&n1));
    // The same CA signs for another trust domain: the name decides.
    let other = SpiffeId::node("other", "n2").unwrap();
    ca::Authority::load(dir.path())
        .unwrap()
        .issue_into(dir.path(), &other, ca::LEAF_VALIDITY)
        .unwrap();
    let node = MeshTls::load(TlsFiles::in_dir(dir.path(), &n1), "td").unwrap();
    let e = MeshTls::load(TlsFiles::in_dir(dir.path(), &other), "td").unwrap_err();
    assert!(
        e.to_string().contains("not of the mesh's trust domain"),
        "{e}"
    );
    let stranger = MeshTls::load(TlsFiles::in_dir(dir.path(), &other), "other").unwrap();
    let (server_saw, _) = pair(&node, &stranger);
    let e = server_saw.unwrap_err().to_string();
    assert!(e.contains("not of trust domain td"), "{e}");
}

#[test]
fn a_rotated_certificate_is_used_without_a_restart_and_a_broken_one_is_not() {
    let Mesh {
        dir,
        n1,
        node,
        ingress,
        ..
    } = Mesh::new();
    let files = TlsFiles::in_dir(dir.path(), &n1);
    let before = std::fs::read(&files.cert).unwrap();
    assert!(!node.reload(), "nothing changed");
    ca::Authority::load(dir.path())
        .unwrap()
        .issue_into(dir.path(), &n1, ca::LEAF_VALIDITY)
        .unwrap();
    assert_ne!(std::fs::read(&files.cert).unwrap(), before);
    assert!(node.reload());
    assert_eq!(node.stats.reloads.load(Ordering::Relaxed), 1);
    let (server_saw, client_saw) = pair(&node, &ingress);
    assert!(server_saw.is_ok() && client_saw.is_ok());
    // A half-written or wrong file keeps the certificate in use.
    std::fs::write(&files.key, "not a key").unwrap();
    assert!(!node.reload());
    let (server_saw, client_saw) = pair(&node, &ingress);
    assert!(server_saw.is_ok() && client_saw.is_ok());
}

/// Lays `files` out as a Kubernetes Secret volume does: the files in a timestamped
/// folder, `..data` a symlink to it, each file a symlink through `..data`. Writing
/// again swaps `..data` atomically. Every copy keeps the time `mtime` so only the
/// inode tells a new file.
fn kubelet_write(mount: &std::path::Path, generation: u32, files: &[(String, Vec<u8>)]) {
    use std::os::unix::fs::symlink;
    let mtime = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let folder = format!("..2026_11_24_{generation}");
    std::fs::create_dir_all(mount.join(&folder)).unwrap();
    for (name, bytes) in files {
        let path = mount.join(&folder).join(name);
        std::fs::write(&path, bytes).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        let link = mount.join(name);
        if std::fs::symlink_metadata(&link).is_err() {
            symlink(format!("..data/{name}"), &link).unwrap();
        }
    }
    let tmp = mount.join("..data_tmp");
    symlink(&folder, &tmp).unwrap();
    std::fs::rename(&tmp, mount.join("..data")).unwrap();
}

/// The files of `files` as (name, bytes).
fn contents(files: &TlsFiles) -> Vec<(String, Vec<u8>)> {
    [&files.ca, &files.cert, &files.key]
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(p).unwrap())
        })
        .to_vec()
}

#[test]
fn a_secret_volume_rotated_by_the_kubelet_is_reloaded() {
    let Mesh {
        dir, n1, ingress, ..
    } = Mesh::new();
    let files = TlsFiles::in_dir(dir.path(), &n1);
    let mount = tempfile::tempdir().unwrap();
    let first = contents(&files);
    kubelet_write(mount.path(), 1, &first);
    let node = MeshTls::load(TlsFiles::in_dir(mount.path(), &n1), "td").unwrap();
    assert!(pair(&node, &ingress).0.is_ok());
    assert!(!node.reload(), "nothing changed");

    ca::Authority::load(dir.path())
        .unwrap()
        .issue_into(dir.path(), &n1, ca::LEAF_VALIDITY)
        .unwrap();
    let second = contents(&files);
    assert_ne!(first[1].1, second[1].1, "a new certificate was issued");
    kubelet_write(mount.path(), 2, &second);
    assert!(node.reload(), "the swapped Secret volume is read again");
    assert_eq!(node.stats.reloads.load(Ordering::Relaxed), 1);
    let (server_saw, client_saw) = pair(&node, &ingress);
    assert_eq!(server_saw.unwrap(), SpiffeId::ingress("td").unwrap());
    assert_eq!(client_saw.unwrap(), n1);
}

#[test]
fn bad_files_are_named_in_the_error() {
    let n1 = SpiffeId::node("td", "n1").unwrap();
    let dir = folder("td", std::slice::from_ref(&n1));
    let files = TlsFiles::in_dir(dir.path(), &n1);
    std::fs::write(&files.cert, "garbage").unwrap();
    let e = MeshTls::load(files.clone(), "td").unwrap_err().to_string();
    assert!(
        e.contains("node-n1.pem") && e.contains("no certificate"),
        "{e}"
    );
    let missing = TlsFiles::in_dir(dir.path(), &SpiffeId::node("td", "n9").unwrap());
    let e = MeshTls::load(missing, "td").unwrap_err().to_string();
    assert!(e.contains("node-n9.pem"), "{e}");
}

#[test]
fn a_session_carries_data_over_non_blocking_sockets() {
    use std::io::IoSlice;
    let Mesh {
        dir: _dir,
        node,
        ingress,
        ..
    } = Mesh::new();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (server, mut ssock) = std::thread::scope(|s| {
        let t = s.spawn(|| {
            let (mut sock, _) = listener.accept().unwrap();
            let (conn, _) = node.accept(&mut sock).unwrap();
            (TlsSession::new(conn), sock)
        });
        let mut csock = TcpStream::connect(addr).unwrap();
        let (conn, _) = ingress.connect(&mut csock).unwrap();
        let client = TlsSession::new(conn);
        csock.set_nonblocking(true).unwrap();
        let (server, ssock) = dpumesh_test_support::joined(t);
        ssock.set_nonblocking(true).unwrap();
        // 4 MiB one way: more than both socket buffers and the session's limit.
        let data: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8).collect();
        let mut sent = 0;
        let mut got = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        let mut ssock_r = &ssock;
        while got.len() < data.len() {
            if sent < data.len() {
                match client.write_vectored(&mut &csock, &[IoSlice::new(&data[sent..])]) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("{e}"),
                }
            } else if client.pending() {
                let _ = client.push(&mut &csock);
            }
            match server.read(&mut ssock_r, &mut buf) {
                Ok(0) => panic!("early end"),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert!(got == data, "every byte arrives in order");
        drop(csock);
        (server, ssock)
    });
    // The peer closed without a close_notify: an error, not a clean end.
    let mut buf = [0u8; 16];
    let end = loop {
        match server.read(&mut ssock, &mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            other => break other,
        }
    };
    assert!(end.is_err() || end.unwrap() == 0);
}

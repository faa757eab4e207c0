//! What a link's mutual TLS handshake costs when it is made (once per link): a node
//! accepting the ingress over loopback TCP, against plain TCP doing the same connect
//! and one-byte exchange in the same run. `cargo bench -p dpumesh-identity`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use dpumesh_identity::{MeshTls, SpiffeId, TlsFiles, ca};

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let (node, ingress) = (
        SpiffeId::node("td", "n1").unwrap(),
        SpiffeId::ingress("td").unwrap(),
    );
    ca::ensure(
        dir.path(),
        "td",
        &[node.clone(), ingress.clone()],
        ca::LEAF_VALIDITY,
        false,
    )
    .unwrap();
    let server: Arc<MeshTls> = MeshTls::load(TlsFiles::in_dir(dir.path(), &node), "td").unwrap();
    let client = MeshTls::load(TlsFiles::in_dir(dir.path(), &ingress), "td").unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut group = c.benchmark_group("link setup");
    group.bench_function("plain TCP connect + 1 byte each way", |b| {
        b.iter(|| {
            std::thread::scope(|s| {
                s.spawn(|| {
                    let (mut sock, _) = listener.accept().unwrap();
                    let mut byte = [0u8; 1];
                    sock.read_exact(&mut byte).unwrap();
                    sock.write_all(&byte).unwrap();
                });
                let mut sock = TcpStream::connect(addr).unwrap();
                sock.write_all(b"x").unwrap();
                let mut byte = [0u8; 1];
                sock.read_exact(&mut byte).unwrap();
            });
        })
    });
    group.bench_function("mutual TLS 1.3 handshake (ECDSA P-256)", |b| {
        b.iter(|| {
            std::thread::scope(|s| {
                s.spawn(|| {
                    let (mut sock, _) = listener.accept().unwrap();
                    server.accept(&mut sock).unwrap();
                });
                let mut sock = TcpStream::connect(addr).unwrap();
                client.connect(&mut sock).unwrap();
            });
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

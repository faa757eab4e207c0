use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proptest::prelude::*;

use super::transport::{ControlClient, ControlServer, Endpoint, Handler, Peer};
use super::*;

fn export(id: u16) -> RegionExport {
    RegionExport {
        id,
        path: format!("/dev/shm/x-{id}").into(),
        len: 4096,
        kind: RegionKind::Pool {
            slot_size: 1024,
            slot_count: 4,
        },
        hw_export: vec![],
    }
}

fn exports() -> PodExports {
    PodExports {
        pod_id: 3,
        tx_header: export(1),
        tx_body: export(2),
        rx_header: export(3),
        rx_body: export(4),
        lanes: vec![
            LaneExport {
                tx_sq: RegionExport {
                    kind: RegionKind::Ring { capacity: 64 },
                    ..export(5)
                },
                rx_sq: export(6),
                bell: RegionExport {
                    kind: RegionKind::Bell,
                    ..export(7)
                },
            };
            2
        ],
        bell: RegionExport {
            kind: RegionKind::Bell,
            ..export(8)
        },
    }
}

#[test]
fn frames_round_trip() {
    for frame in [
        Frame::Request(
            1,
            Request::Hello {
                role: Role::Host,
                name: "pod-a".into(),
            },
        ),
        Frame::Request(
            2,
            Request::RegisterPod {
                name: "a".into(),
                service: "users".into(),
                pid: 77,
                token: Some("ab".repeat(32)),
            },
        ),
        Frame::Response(2, Response::PodRegistered(Box::new(exports()))),
        Frame::Response(
            9,
            Response::Error {
                code: ErrorCode::AlreadyRegistered,
                message: "x".into(),
            },
        ),
    ] {
        assert_eq!(decode(&encode(&frame)).unwrap(), frame);
        assert_eq!(read_frame(&mut &encode(&frame)[..]).unwrap(), frame);
    }
}

#[test]
fn bad_frames_are_refused_with_the_reason() {
    let mut bytes = encode(&Frame::Request(1, Request::Ping));
    bytes[0] = b'X';
    assert!(matches!(decode(&bytes), Err(ControlError::Magic { .. })));

    let mut bytes = encode(&Frame::Request(1, Request::Ping));
    bytes[4..6].copy_from_slice(&99u16.to_le_bytes());
    let err = decode(&bytes).unwrap_err().to_string();
    assert!(
        err.contains(&format!(
            "this side speaks version {PROTOCOL_VERSION}, the peer speaks version 99"
        )),
        "{err}"
    );

    let mut bytes = encode(&Frame::Request(1, Request::Ping));
    bytes[6..8].copy_from_slice(&42u16.to_le_bytes());
    assert!(matches!(decode(&bytes), Err(ControlError::Kind(42))));

    let mut bytes = encode(&Frame::Request(1, Request::Ping));
    bytes[12..16].copy_from_slice(&(MAX_BODY + 1).to_le_bytes());
    assert!(matches!(decode(&bytes), Err(ControlError::TooLarge(_))));

    let mut bytes = encode(&Frame::Request(1, Request::Ping));
    bytes[16] = 200; // no such Request variant
    assert!(matches!(decode(&bytes), Err(ControlError::Body(_))));
}

#[derive(Default)]
struct Echo {
    gone: AtomicUsize,
}

impl Handler for Echo {
    fn node_name(&self) -> String {
        "node-test".into()
    }

    fn handle(&self, _peer: &Peer, request: Request) -> Response {
        match request {
            Request::Ping => Response::Pong,
            Request::RegisterPod { name, .. } if name == "taken" => Response::Error {
                code: ErrorCode::AlreadyRegistered,
                message: "a pod named taken is registered".into(),
            },
            Request::RegisterPod { .. } => Response::PodRegistered(Box::new(exports())),
            Request::Resolve { service } if service == "panic" => panic!("a handler bug"),
            _ => Response::Ok,
        }
    }

    fn disconnected(&self, _peer: &Peer) {
        self.gone.fetch_add(1, Ordering::SeqCst);
    }
}

fn socket() -> (tempfile::TempDir, Endpoint) {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = Endpoint::Unix(dir.path().join("control.sock"));
    (dir, endpoint)
}

#[test]
fn a_handler_panic_closes_that_connection_reclaims_its_peer_and_the_rest_serve_on() {
    let (_dir, endpoint) = socket();
    let handler = Arc::new(Echo::default());
    let _server = ControlServer::start(&endpoint, handler.clone()).unwrap();
    let mut other = ControlClient::connect(&endpoint, Role::Host, "pod-b").unwrap();
    let mut client = ControlClient::connect(&endpoint, Role::Host, "pod-a").unwrap();
    assert!(
        client.resolve("panic").is_err(),
        "no answer: the connection closed"
    );
    for _ in 0..400 {
        if handler.gone.load(Ordering::SeqCst) == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        handler.gone.load(Ordering::SeqCst),
        1,
        "the peer of the connection whose thread panicked was let go of"
    );
    other.ping().expect("the other connection serves on");
}

#[test]
fn a_client_registers_and_the_server_learns_when_it_goes() {
    let (_dir, endpoint) = socket();
    let handler = Arc::new(Echo::default());
    let server = ControlServer::start(&endpoint, handler.clone()).unwrap();
    let mut client = ControlClient::connect(&endpoint, Role::Host, "pod-a").unwrap();
    assert_eq!(client.node(), "node-test");
    client.ping().unwrap();
    assert_eq!(client.register_pod("a", "users", None).unwrap(), exports());
    let err = client
        .register_pod("taken", "users", None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("AlreadyRegistered: a pod named taken is registered"),
        "{err}"
    );
    assert_eq!(server.peers(), 1);
    drop(client);
    for _ in 0..200 {
        if handler.gone.load(Ordering::SeqCst) == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(handler.gone.load(Ordering::SeqCst), 1);
}

#[test]
fn tcp_without_certificates_is_refused_at_the_start() {
    let handler = Arc::new(Echo::default());
    let e = ControlServer::start(&Endpoint::Tcp("127.0.0.1:0".parse().unwrap()), handler)
        .unwrap_err()
        .to_string();
    assert!(e.contains("mutual TLS only"), "{e}");
}

#[test]
fn requests_before_hello_are_refused() {
    let (_dir, endpoint) = socket();
    let _server = ControlServer::start(&endpoint, Arc::new(Echo::default())).unwrap();
    let Endpoint::Unix(path) = &endpoint else {
        unreachable!()
    };
    let mut raw = UnixStream::connect(path).unwrap();
    write_frame(&mut raw, &Frame::Request(5, Request::Ping)).unwrap();
    match read_frame(&mut raw).unwrap() {
        Frame::Response(5, Response::Error { code, message }) => {
            assert_eq!(code, ErrorCode::BadRequest);
            assert!(message.contains("Hello first"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_peer_of_another_version_is_told_so_on_both_sides() {
    // A newer client talks to this server: it gets our version back and the reason.
    let (_dir, endpoint) = socket();
    let _server = ControlServer::start(&endpoint, Arc::new(Echo::default())).unwrap();
    let Endpoint::Unix(path) = &endpoint else {
        unreachable!()
    };
    let mut raw = UnixStream::connect(path).unwrap();
    let mut hello = encode(&Frame::Request(
        1,
        Request::Hello {
            role: Role::Host,
            name: "future".into(),
        },
    ));
    hello[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    raw.write_all(&hello).unwrap();
    let mut reply = Vec::new();
    raw.read_to_end(&mut reply).unwrap();
    assert_eq!(u16::from_le_bytes([reply[4], reply[5]]), PROTOCOL_VERSION);
    let text = String::from_utf8_lossy(&reply[16..]);
    assert!(
        text.contains(&format!(
            "DPU speaks version {PROTOCOL_VERSION}, this peer sent version {}",
            PROTOCOL_VERSION + 1
        )),
        "{text}"
    );

    // This client talks to a newer server: the error names both versions.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("future.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut header = [0u8; 16];
        s.read_exact(&mut header).unwrap();
        let len = u32::from_le_bytes(header[12..16].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).unwrap();
        let mut answer = encode(&Frame::Response(1, Response::Hello { node: "n".into() }));
        answer[4..6].copy_from_slice(&(PROTOCOL_VERSION + 2).to_le_bytes());
        s.write_all(&answer).unwrap();
    });
    let err = ControlClient::connect(&Endpoint::Unix(path), Role::Host, "pod")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!(
            "this side speaks version {PROTOCOL_VERSION}, the peer speaks version {}",
            PROTOCOL_VERSION + 2
        )),
        "{err}"
    );
    dpumesh_test_support::joined(fake);
}

#[test]
fn stopping_the_server_tears_clients_down() {
    let (_dir, endpoint) = socket();
    let server = ControlServer::start(&endpoint, Arc::new(Echo::default())).unwrap();
    let mut client = ControlClient::connect(&endpoint, Role::Host, "pod").unwrap();
    drop(server);
    let err = client.ping().unwrap_err().to_string();
    assert!(
        err.contains("shutting down") || err.contains("closed"),
        "{err}"
    );
}

#[test]
fn endpoints_parse() {
    assert_eq!(
        "unix:/run/dpumesh.sock".parse::<Endpoint>().unwrap(),
        Endpoint::Unix("/run/dpumesh.sock".into())
    );
    assert_eq!(
        "tcp:127.0.0.1:18517".parse::<Endpoint>().unwrap(),
        Endpoint::Tcp("127.0.0.1:18517".parse().unwrap())
    );
    assert!("nonsense".parse::<Endpoint>().is_err());
}

proptest! {
    #[test]
    fn decoding_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode(&bytes);
        let _ = read_frame(&mut &bytes[..]);
    }

    #[test]
    fn mangled_frames_never_panic(flip in 0usize..800, id in any::<u32>()) {
        let mut bytes = encode(&Frame::Response(id, Response::PodRegistered(Box::new(exports()))));
        let bit = flip % (bytes.len() * 8);
        bytes[bit / 8] ^= 1 << (bit % 8);
        let _ = decode(&bytes);
    }
}

#[test]
fn over_tcp_with_certificates_only_a_proven_peer_is_heard() {
    let tls = dpumesh_fabric::test_tls::test_tls();
    let handler = Arc::new(Echo::default());
    let server = ControlServer::start_with_tls(
        &Endpoint::Tcp("127.0.0.1:0".parse().unwrap()),
        handler.clone(),
        Some(tls.clone()),
    )
    .unwrap();
    // With the mesh's certificate: the protocol runs as on a Unix socket.
    let mut client =
        ControlClient::connect_with_tls(server.endpoint(), Role::Host, "pod-a", Some(&tls))
            .unwrap();
    assert_eq!(client.node(), "node-test");
    client.ping().unwrap();
    assert_eq!(client.register_pod("a", "users", None).unwrap(), exports());
    // Without one: the connection ends before a frame is read.
    let plain = ControlClient::connect(server.endpoint(), Role::Host, "rogue");
    assert!(plain.is_err(), "{plain:?}");
    assert_eq!(server.peers(), 1, "only the proven client is a peer");
    drop(client);
    for _ in 0..200 {
        if handler.gone.load(Ordering::SeqCst) == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        handler.gone.load(Ordering::SeqCst),
        1,
        "a closed TLS peer is gone"
    );
}

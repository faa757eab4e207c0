use super::*;
use crate::fabric::soft::SoftFabric;

fn echo_server(config: RpcConfig) -> RpcServer {
    RpcServer::start(
        SoftFabric::new(),
        "127.0.0.1:0".parse().unwrap(),
        config,
        Arc::new(|req: &[u8]| {
            if req == b"fail" {
                return Err("asked to fail".to_owned());
            }
            if req == b"panic" {
                panic!("handler panic");
            }
            let mut out = req.to_vec();
            out.reverse();
            Ok(out)
        }),
    )
    .unwrap()
}

#[test]
fn small_and_large_calls_round_trip() {
    let config = RpcConfig {
        max_request: 4 << 20,
        max_response: 4 << 20,
        ..RpcConfig::default()
    };
    let server = echo_server(config);
    let client = RpcClient::connect(&SoftFabric::new(), server.local_addr(), config).unwrap();
    for len in [0usize, 1, 100, 4096, 65536, 65537, (3 << 20) + 7] {
        let req: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
        let mut want = req.clone();
        want.reverse();
        let got = client.call(&req).unwrap();
        assert_eq!(crc32fast::hash(&got), crc32fast::hash(&want), "len {len}");
        assert_eq!(got.len(), len);
    }
    // 5 inline (up to 64 KiB), 2 read.
    assert_eq!(server.stats().inline.load(Ordering::Relaxed), 5);
    assert_eq!(server.stats().read.load(Ordering::Relaxed), 2);
}

#[test]
fn handler_errors_and_panics_reach_the_caller_and_the_server_lives_on() {
    let server = echo_server(RpcConfig::default());
    let client = RpcClient::connect(
        &SoftFabric::new(),
        server.local_addr(),
        RpcConfig::default(),
    )
    .unwrap();
    let err = client.call(b"fail").unwrap_err().to_string();
    assert!(err.contains("asked to fail"), "{err}");
    let err = client.call(b"panic").unwrap_err().to_string();
    assert!(err.contains("panicked"), "{err}");
    assert_eq!(client.call(b"abc").unwrap(), b"cba");
    let big = vec![0u8; (1 << 20) + 1];
    assert!(matches!(
        client.call(&big),
        Err(RpcError::RequestTooLarge { .. })
    ));
}

#[test]
fn many_threads_keep_many_calls_in_flight_on_one_connection_and_many_connections_share_a_poller() {
    let config = RpcConfig {
        max_request: 2 << 20,
        max_response: 2 << 20,
        ..RpcConfig::default()
    };
    let server = echo_server(config);
    let clients: Vec<_> = (0..3)
        .map(|_| {
            Arc::new(RpcClient::connect(&SoftFabric::new(), server.local_addr(), config).unwrap())
        })
        .collect();
    let threads: Vec<_> = (0..12)
        .map(|t| {
            let client = clients[t % 3].clone();
            std::thread::spawn(move || {
                for i in 0..60usize {
                    // Every tenth call carries more than a megabyte.
                    let len = if i % 10 == 0 {
                        (1 << 20) + t * 1000 + i
                    } else {
                        16 + i
                    };
                    let req: Vec<u8> = (0..len).map(|k| (k ^ t ^ i) as u8).collect();
                    let got = client.call(&req).unwrap();
                    assert_eq!(got.len(), len);
                    assert!(got.iter().rev().eq(req.iter()), "thread {t} call {i}");
                }
            })
        })
        .collect();
    for t in threads {
        dpumesh_test_support::joined(t);
    }
    assert_eq!(server.stats().calls.load(Ordering::Relaxed), 12 * 60);
    assert_eq!(server.stats().connections.load(Ordering::Relaxed), 3);
}

#[test]
fn a_server_that_goes_away_fails_calls_instead_of_hanging() {
    let config = RpcConfig {
        timeout: Duration::from_secs(5),
        ..RpcConfig::default()
    };
    let server = echo_server(config);
    let client = RpcClient::connect(&SoftFabric::new(), server.local_addr(), config).unwrap();
    assert_eq!(client.call(b"x").unwrap(), b"x");
    drop(server);
    let started = Instant::now();
    let err = client.call(b"y").unwrap_err();
    assert!(
        !matches!(err, RpcError::Timeout(_)),
        "failed fast, not by timing out: {err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

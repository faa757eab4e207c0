//! The attacks of "No open door", tried as an attacker would: `dpumesh up` (the hotel
//! sample) and raw sockets, each attack sent as it was sent against the old main and
//! refused now, with the status it gets (docs/threat-model.md lists them).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

mod common;
use common::mesh::*;
use common::token;

/// The status of `request` sent as it is on a fresh connection (0: no answer).
fn status(mesh: &Mesh, request: &str) -> u16 {
    mesh.client().try_raw(request.as_bytes()).map_or(0, |r| r.0)
}

/// Two requests on one connection: both answers' statuses.
fn two_on_one_connection(addr: SocketAddr, first: &str, second: &str) -> (u16, u16) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(first.as_bytes()).unwrap();
    let a = read_response(&mut s).map_or(0, |r| r.0);
    // Written after the first answer: hyper reads it as the next request.
    if s.write_all(second.as_bytes()).is_err() {
        return (a, 0);
    }
    (a, read_response(&mut s).map_or(0, |r| r.0))
}

#[test]
fn a_host_naming_a_service_is_no_way_in_only_routes_are() {
    let mesh = Mesh::up();
    // `Host: user` used to reach the user service with its own chain (trace only):
    // 200 and the user's JSON, with no token. Now the routes decide: the `/` route
    // runs the frontend's chain, whose JWT filter wants a token.
    for request in [
        "GET /user?id=1 HTTP/1.1\r\nhost: user\r\nconnection: close\r\n\r\n",
        "GET /user?id=1 HTTP/1.1\r\nhost: user:80\r\nconnection: close\r\n\r\n",
        "GET /user?id=1 HTTP/1.1\r\nhost: USER\r\nconnection: close\r\n\r\n",
        // Absolute form: its authority is the host (RFC 9112 §3.2.2), routed the same.
        "GET http://reservation/reservations?user=7 HTTP/1.1\r\nhost: reservation\r\nconnection: close\r\n\r\n",
    ] {
        assert_eq!(status(&mesh, request), 401, "{request}");
    }
    // With a token, the route sends it to the frontend, which serves no /user: the
    // user service is never reached from outside.
    let alice = token("alice", &["user"]);
    let (code, _, body) = mesh.raw(
        format!("GET /user?id=1 HTTP/1.1\r\nhost: user\r\nauthorization: Bearer {alice}\r\nconnection: close\r\n\r\n")
            .as_bytes(),
    );
    assert_ne!(code, 200, "{}", String::from_utf8_lossy(&body));
    // CONNECT is a tunnel to what the route names, never to the host the client
    // names: without a token the `/` route's chain refuses it, and the connection
    // closes (what the client sends next is not read as requests).
    let ping = "GET /ping HTTP/1.1\r\nhost: hotel\r\nconnection: close\r\n\r\n";
    assert_eq!(
        two_on_one_connection(
            mesh.ingress,
            "CONNECT user:80 HTTP/1.1\r\nhost: user:80\r\n\r\n",
            ping
        ),
        (401, 0)
    );
    // With a token it reaches the frontend, which opens no tunnel: not the user
    // service, not a port on the ingress's host (the mesh is no open proxy).
    for target in ["user:80", "127.0.0.1:22", "localhost:18090"] {
        let (code, _, body) = mesh.raw(
            format!("CONNECT {target} HTTP/1.1\r\nhost: {target}\r\nauthorization: Bearer {alice}\r\n\r\n")
                .as_bytes(),
        );
        assert!(
            !(200..300).contains(&code),
            "{target}: {code} {}",
            String::from_utf8_lossy(&body)
        );
    }
    // A CONNECT that names no port: 400.
    assert_eq!(
        status(&mesh, "CONNECT user HTTP/1.1\r\nhost: user\r\n\r\n"),
        400
    );
    // `Host: frontend` used to run the frontend's own chain on `/limited` (1e9/s);
    // the route's chain is `strict` (3 a minute): the fourth is 429.
    let mallory = token("mallory-limited", &["user"]);
    let limited = format!(
        "GET /limited HTTP/1.1\r\nhost: frontend\r\nauthorization: Bearer {mallory}\r\nconnection: close\r\n\r\n"
    );
    let seen: Vec<u16> = (0..5).map(|_| status(&mesh, &limited)).collect();
    assert_eq!(seen, [200, 200, 200, 429, 429]);
}

#[test]
fn ambiguous_framing_is_refused_on_every_request_of_a_connection() {
    let mesh = Mesh::up();
    let alice = token("alice", &["user"]);
    let both = format!(
        "POST /echo HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
    );
    // After an HTTP/1.0 keep-alive request, and after one asking for an upgrade, the
    // tracker used to stop watching: the second request was served (200 200).
    for first in [
        format!(
            "GET /ping HTTP/1.0\r\nhost: hotel\r\nconnection: keep-alive\r\nauthorization: Bearer {alice}\r\n\r\n"
        ),
        format!(
            "GET /ping HTTP/1.1\r\nhost: hotel\r\nupgrade: websocket\r\nconnection: upgrade\r\nauthorization: Bearer {alice}\r\n\r\n"
        ),
        format!("GET /ping HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\n\r\n"),
    ] {
        assert_eq!(
            two_on_one_connection(mesh.ingress, &first, &both),
            (200, 400),
            "after {first:?}"
        );
    }
    // Pipelined: both in one write.
    let mut s = TcpStream::connect(mesh.ingress).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let ping =
        format!("GET /ping HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\n\r\n");
    s.write_all(format!("{ping}{both}").as_bytes()).unwrap();
    // Both answers may come in one read: read until the ingress closes (it does after
    // a framing refusal) and take every status line.
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    let statuses: Vec<&str> = String::from_utf8_lossy(&all)
        .match_indices("HTTP/1.1 ")
        .map(|(at, _)| &all[at + 9..at + 12])
        .map(|b| std::str::from_utf8(b).unwrap())
        .collect();
    assert_eq!(statuses, ["200", "400"]);
}

#[test]
fn paths_a_backend_reads_another_way_are_refused() {
    let mesh = Mesh::up();
    let alice = token("alice", &["user", "admin"]);
    for (path, want) in [
        // Tomcat reads `..;` as `..`: /admin to it, under /ping to a proxy.
        ("/ping/..;/admin", 400),
        // IIS reads `\` as `/`.
        ("/ping\\..\\admin", 400),
        // A backend that decodes twice reads %2e%2e, then `..`.
        ("/ping/%252e%252e/admin", 400),
        ("/ping/%2e%2e/admin", 200),
    ] {
        let request = format!(
            "GET {path} HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\nconnection: close\r\n\r\n"
        );
        // `/ping/../admin` normalizes to /admin, which the frontend does not serve:
        // what counts is that the policy saw /admin (an admin's token is allowed).
        let got = status(&mesh, &request);
        if want == 200 {
            assert_ne!(got, 400, "{path}: normalized, not refused");
        } else {
            assert_eq!(got, want, "{path}");
        }
    }
    // The harness reads a good answer.
    assert_eq!(h2_status(mesh.ingress, "/ping", &alice), Ok(200));
    // HTTP/2 `:path: admin` (no slash) missed the `/` JWT rule. Now it is refused:
    // by the HTTP/2 layer, which resets such a stream as malformed (PROTOCOL_ERROR,
    // RFC 9113 §8.1.1), or by the ingress's own check (400) where a path without a
    // slash gets through to it (`*` with another method than OPTIONS).
    for path in ["admin", "ping/../admin", "*"] {
        let got = h2_status(mesh.ingress, path, &alice);
        assert!(matches!(got, Ok(400) | Err(1)), "{path}: {got:?}");
    }
}

#[test]
fn a_clients_reserved_headers_are_removed_and_the_service_learns_the_caller_from_the_mesh() {
    let mesh = Mesh::up();
    let alice = token("alice", &["user"]);
    let (code, _, body) = mesh.raw(
        format!(
            "GET http://hotel/headers HTTP/1.1\r\nhost: evil.example\r\nauthorization: Bearer {alice}\r\nx-dpumesh-generation: 99\r\nX-Dpumesh-Circuit: closed\r\nx-forwarded-for: 203.0.113.9\r\nx-forwarded-proto: https\r\nconnection: close\r\n\r\n"
        )
        .as_bytes(),
    );
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let seen: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let headers = &seen["headers"];
    for reserved in ["x-dpumesh-generation", "x-dpumesh-circuit"] {
        assert!(headers.get(reserved).is_none(), "{reserved}: {seen:#}");
    }
    // The client's forwarded-for stays, this hop is appended; the scheme is the mesh's.
    assert_eq!(
        headers["x-forwarded-for"],
        serde_json::json!(["203.0.113.9, 127.0.0.1"])
    );
    assert_eq!(headers["x-forwarded-proto"], serde_json::json!(["http"]));
    // One host, the absolute form's, not the `Host` beside it.
    assert_eq!(headers["host"], serde_json::json!(["hotel"]));
    // The caller as the mesh says it: the client's connection, no workload.
    let caller = &seen["caller"];
    assert!(
        caller["addr"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{seen:#}"
    );
    assert_eq!(caller["identity"], serde_json::Value::Null);
}

#[test]
fn admin_mutations_need_the_token_and_the_admin_address() {
    let mesh = Mesh::up();
    let node1 = mesh.admins()[0];
    let token = mesh.admin_token();
    let here = node1.to_string();
    let evil = format!("evil.example:{}", node1.port());
    let call = |method, path, host: &str, token: Option<&str>| {
        try_admin_request(node1, method, path, host, token)
            .unwrap()
            .0
    };
    // Reads stay open.
    assert_eq!(call("GET", "/filters", &here, None), 200);
    // Mutations without the token: refused (they used to need nothing).
    for (method, path) in [
        ("POST", "/reload"),
        ("DELETE", "/cache?prefix=hotel"),
        ("DELETE", "/store?prefix=http-cache"),
    ] {
        assert_eq!(call(method, path, &here, None), 401, "{method} {path}");
        assert_eq!(
            call(method, path, &here, Some("guess")),
            401,
            "{method} {path}"
        );
    }
    // DNS rebinding: a page's request carries the page's host, token or not.
    assert_eq!(call("POST", "/reload", &evil, Some(&token)), 421);
    assert_eq!(call("GET", "/metrics", &evil, None), 421);
    // The operator, with the token the banner prints.
    assert!(mesh.banner.contains(&token), "{}", mesh.banner);
    assert_eq!(call("POST", "/reload", &here, Some(&token)), 200);
    // The ingress's admin API and the dashboard check the host too.
    for api in [mesh.ingress_admin.unwrap(), mesh.pingmesh.unwrap()] {
        let evil = format!("evil.example:{}", api.port());
        assert_eq!(
            try_admin_request(api, "GET", "/metrics", &evil, None)
                .unwrap()
                .0,
            421
        );
    }
}

#[test]
fn a_fresh_mesh_makes_its_own_key_and_refuses_tokens_without_expiry() {
    let dir = tempfile::tempdir().unwrap();
    let (file, ingress) = mesh_files(dir.path(), |m| m);
    // As a user starts the sample: no key yet (the tests' one removed).
    let key = dir.path().join(".dpumesh/certs/demo-jwt.key");
    std::fs::remove_file(&key).unwrap();
    let mesh = Mesh::start(dir, &file, ingress);
    let made = std::fs::read(&key).expect("up made a key");
    assert_eq!(made.len(), 64);
    // The banner's token is signed with it and works.
    let banner_token = mesh
        .banner
        .lines()
        .find(|l| l.trim_start().starts_with("curl"))
        .and_then(|l| l.split("Bearer ").nth(1))
        .and_then(|t| t.split('\'').next())
        .expect("the banner's curl has a token");
    assert_eq!(mesh.get("/ping", Some(banner_token)).0, 200);
    // The secret the repository used to ship is no key of this mesh.
    let sign = |secret: &[u8], exp: bool| {
        let mut claims = serde_json::json!({
            "iss": "dpumesh-demo", "aud": "hotel", "sub": "mallory", "roles": ["user", "admin"],
        });
        if exp {
            claims["exp"] = (std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
                + 3600)
                .into();
        }
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(secret),
        )
        .unwrap()
    };
    let old = sign(b"dpumesh-demo-hs256-secret-0123456789", true);
    assert_eq!(mesh.get("/ping", Some(&old)).0, 401);
    // A token that never expires is refused, even signed with the mesh's own key.
    assert_eq!(mesh.get("/ping", Some(&sign(&made, false))).0, 401);
    assert_eq!(
        mesh.get("/ping", Some(&sign(&made, true))).0,
        200,
        "signed with the mesh's key, with an expiry"
    );
}

/// A TCP connection to `to` from the loopback address `from` (another client).
fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    let local: SocketAddr = format!("{from}:0").parse().unwrap();
    bind(&fd, &local).unwrap();
    connect(&fd, &to).unwrap();
    TcpStream::from(fd)
}

#[test]
fn slow_uploads_from_one_client_cannot_hold_every_slot() {
    let mesh = Mesh::up_with(|m| {
        m.replace(
            "  max_body: 8MiB",
            "  max_body: 8MiB\n  slots_per_client: 2",
        )
    });
    let alice = token("alice", &["user"]);
    // Two uploads that never finish (the slowloris of bodies): each holds a slot until
    // `body_timeout`.
    let slow = format!(
        "POST /echo HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\ncontent-length: 100000\r\n\r\npartial"
    );
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = connect_from("127.0.0.1", mesh.ingress);
        s.write_all(slow.as_bytes()).unwrap();
        held.push(s);
    }
    let admin = mesh.ingress_admin.unwrap();
    wait("both uploads hold a slot", Duration::from_secs(30), &|| {
        metric(admin, "dpumesh_ingress_requests_in_flight") == 2.0
    });
    let ping = format!(
        "GET /ping HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\nconnection: close\r\n\r\n"
    );
    let from = |addr: &str| {
        let mut s = connect_from(addr, mesh.ingress);
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(ping.as_bytes()).unwrap();
        read_response(&mut s)
    };
    // This client's next request is refused at once...
    let (status, headers, body) = from("127.0.0.1").unwrap();
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("slots_per_client"));
    assert_eq!(header(&headers, "retry-after"), Some("1"));
    // ...while another client is served.
    assert_eq!(from("127.0.0.2").map(|r| r.0), Some(200));
    // The slow ones give up: their share comes back, nothing is lost.
    drop(held);
    wait("the share comes back", Duration::from_secs(30), &|| {
        from("127.0.0.1").is_some_and(|r| r.0 == 200)
    });
    // Streamed answers the client does not read hold its share too (each holds a
    // slot until its body is done with): two paused downloads, and its next request
    // is refused.
    let mut paused = Vec::new();
    for _ in 0..2 {
        let mut s = connect_from("127.0.0.1", mesh.ingress);
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "GET /download?bytes={} HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\nconnection: close\r\n\r\n",
            1u64 << 30
        )
        .unwrap();
        let mut head = [0u8; 12];
        s.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"HTTP/1.1 200");
        paused.push(s);
    }
    let (status, _, body) = from("127.0.0.1").unwrap();
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&body));
    drop(paused);
    wait(
        "the share comes back after the downloads",
        Duration::from_secs(30),
        &|| from("127.0.0.1").is_some_and(|r| r.0 == 200),
    );
}

/// The status an HTTP/2 (prior knowledge) request for `path` gets, or the error code
/// its stream was reset with: frames written by hand, as a client that sends a `:path`
/// without its slash does (hyper's own client would not send one).
fn h2_status(addr: SocketAddr, path: &str, token: &str) -> Result<u16, u32> {
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        f
    }
    // HPACK literal fields without indexing, new names, no Huffman (RFC 7541 §6.2.2);
    // lengths as 7-bit-prefix integers (§5.1).
    let mut block = Vec::new();
    for (name, value) in [
        (":method", "GET"),
        (":scheme", "http"),
        (":authority", "hotel"),
        (":path", path),
        ("authorization", &format!("Bearer {token}")),
    ] {
        block.push(0);
        for text in [name, value] {
            let mut n = text.len();
            if n < 127 {
                block.push(n as u8);
            } else {
                block.push(127);
                n -= 127;
                while n >= 128 {
                    block.push((n % 128) as u8 | 0x80);
                    n /= 128;
                }
                block.push(n as u8);
            }
            block.extend(text.as_bytes());
        }
    }
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(4, 0, 0, &[]));
    // HEADERS, END_STREAM | END_HEADERS, stream 1.
    out.extend(frame(1, 0x5, 1, &block));
    s.write_all(&out).unwrap();
    loop {
        let mut head = [0u8; 9];
        if s.read_exact(&mut head).is_err() {
            return Err(u32::MAX);
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).unwrap();
        if kind == 4 && flags & 1 == 0 {
            s.write_all(&frame(4, 1, 0, &[])).unwrap();
        }
        if kind == 1 && stream == 1 {
            let mut at = 0;
            if flags & 0x8 != 0 {
                at += 1;
            }
            if flags & 0x20 != 0 {
                at += 5;
            }
            // `:status` as an indexed field of HPACK's static table (2.2 of RFC 7541:
            // 8 is 200, 12 is 400, 13 is 404, 14 is 500).
            return Ok(match payload[at] {
                0x88 => 200,
                0x8c => 400,
                0x8d => 404,
                0x8e => 500,
                other => panic!("a :status this harness does not read: {other:#04x}"),
            });
        }
        if kind == 3 && stream == 1 {
            return Err(u32::from_be_bytes(payload[..4].try_into().unwrap()));
        }
    }
}

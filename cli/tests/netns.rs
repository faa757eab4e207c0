//! The hotel mesh across network namespaces: node1 and node2 each in their own
//! namespace with their own address on a bridge, the ingress in the test's namespace,
//! so the fabric between the ingress and the nodes, and between the two nodes (the
//! frontend's call to reservation), crosses a real network boundary. Where namespaces
//! cannot be created (no root, no CAP_SYS_ADMIN, no iproute2) it fails in CI and
//! skips elsewhere, saying why.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dpumesh_test_support::joined;

mod common;

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two namespaces on a bridge: the test's side 10.77.<n>.1, node1 .11, node2 .12.
struct Hosts {
    tag: String,
    subnet: u8,
}

impl Hosts {
    fn create() -> Result<Self, String> {
        let tag = format!("{}", std::process::id() % 100_000);
        let subnet = (std::process::id() % 200) as u8 + 20;
        let hosts = Self { tag, subnet };
        let br = hosts.name("br");
        ip(&["link", "add", &br, "type", "bridge"])?;
        ip(&["addr", "add", &format!("10.77.{subnet}.1/24"), "dev", &br])?;
        ip(&["link", "set", &br, "up"])?;
        for (i, host) in [(11, "n1"), (12, "n2")] {
            let ns = hosts.ns(host);
            let (outside, inside) = (
                hosts.name(&format!("{host}o")),
                hosts.name(&format!("{host}i")),
            );
            ip(&["netns", "add", &ns])?;
            ip(&[
                "link", "add", &outside, "type", "veth", "peer", "name", &inside,
            ])?;
            ip(&["link", "set", &inside, "netns", &ns])?;
            ip(&["link", "set", &outside, "master", &br])?;
            ip(&["link", "set", &outside, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("10.77.{subnet}.{i}/24"),
                "dev",
                &inside,
            ])?;
            ip(&["-n", &ns, "link", "set", &inside, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    fn name(&self, what: &str) -> String {
        format!("dm{}{what}", self.tag)
    }

    fn ns(&self, host: &str) -> String {
        format!("dpumesh-{}-{host}", self.tag)
    }

    fn addr(&self, host: u8) -> String {
        format!("10.77.{}.{host}", self.subnet)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for host in ["n1", "n2"] {
            let _ = ip(&["netns", "del", &self.ns(host)]);
            let _ = ip(&["link", "del", &self.name(&format!("{host}o"))]);
        }
        let _ = ip(&["link", "del", &self.name("br")]);
    }
}

/// GET `path`: the status (0 if the exchange failed at any step) and the body.
fn get(addr: SocketAddr, path: &str, token: &str) -> (u16, String) {
    let exchange = || -> std::io::Result<String> {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {token}\r\nconnection: close\r\n\r\n"
        )?;
        let mut all = String::new();
        s.read_to_string(&mut all)?;
        Ok(all)
    };
    let all = match exchange() {
        Ok(all) => all,
        Err(e) => return (0, format!("no answer: {e}")),
    };
    let status = all
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = all
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        common::stop(&mut self.0);
    }
}

#[test]
fn the_mesh_works_across_network_namespaces() {
    let hosts = match Hosts::create() {
        Ok(h) => h,
        Err(e) => {
            dpumesh_test_support::cannot_run(
                "network namespaces (iproute2's `ip netns`, as root)",
                &e,
            );
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    common::write_policy_with(dir.path(), |p| p);
    let ingress_port = common::free_port();
    let (n1, n2) = (hosts.addr(11), hosts.addr(12));
    let mesh = format!(
        "policy: policy.yaml
transport: tcp
ingress: {{listen: 127.0.0.1:{ingress_port}, request_timeout: 5s}}
nodes:
  node1: {{fabric: {n1}:7101, admin: {n1}:9101, netns: {ns1}}}
  node2: {{fabric: {n2}:7102, admin: {n2}:9102, netns: {ns2}}}
services:
  frontend: {{nodes: [node1], command: [hotel, frontend]}}
  user: {{nodes: [node1], command: [hotel, user]}}
  reservation: {{nodes: [node2], command: [hotel, reservation]}}
",
        ns1 = hosts.ns("n1"),
        ns2 = hosts.ns("n2"),
    );
    let file = dir.path().join("mesh.yaml");
    std::fs::write(&file, mesh).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
        .args(["up", "--config"])
        .arg(&file)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let up = Up(child);
    common::banner(out);

    // The nodes really live on their own hosts: their fabric ports are not on this
    // host's loopback, only on their addresses.
    assert!(TcpStream::connect("127.0.0.1:7101").is_err());
    assert!(TcpStream::connect(format!("{n1}:7101")).is_ok());

    // frontend (node1) calls user (node1) and reservation (node2, across the bridge).
    let ingress: SocketAddr = format!("127.0.0.1:{ingress_port}").parse().unwrap();
    let token = common::token("alice", &["user"]);
    let (status, body) = get(ingress, "/hotels?user=5", &token);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["user"]["id"], "5");
    assert_eq!(v["reservations"][1]["hotel"], "old-town");
    // Many more, to cross the boundary with requests in flight at once.
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let token = token.clone();
            std::thread::spawn(move || {
                (0..25)
                    .map(|j| get(ingress, &format!("/hotels?user={i}{j}"), &token).0)
                    .filter(|s| *s != 200)
                    .count()
            })
        })
        .collect();
    let failed: usize = threads.into_iter().map(joined).sum();
    assert_eq!(failed, 0, "all 100 requests across namespaces succeeded");
    drop(up);
    drop(hosts);
}

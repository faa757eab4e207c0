//! BlueCache through a real node process: `dpumesh store put|get|ls|stat|rm` over the
//! node's control channel; a client killed mid-transfer (its slots come back, no
//! partial object) and a node killed mid-write (after its restart, no torn object,
//! the committed ones still there).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::mesh::*;

/// A node of the sample mesh with a store; its control endpoint and admin address.
struct Node {
    child: Child,
    control: String,
    admin: SocketAddr,
    store_dir: PathBuf,
    /// The token of [`SERVICE`], whose objects the tests' clients handle.
    token: String,
}

/// The service the tests' store clients act for (their keys are its).
const SERVICE: &str = "user";

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The mesh files (with `store` as given) in `dir`, certificates issued.
fn mesh(dir: &Path, store: &str) -> PathBuf {
    // The sample's own `store` section (at the file's end) replaced by this one.
    let (mesh, _) = mesh_files(dir, |m| {
        let sample = m.find("\nstore:\n").map_or(m.as_str(), |at| &m[..at]);
        format!("{sample}\nstore:\n{store}")
    });
    let out = certs(&mesh, &[]);
    assert!(out.status.success(), "{out:?}");
    mesh
}

fn start(dir: &Path, mesh: &Path) -> Node {
    let admin: SocketAddr = format!("127.0.0.1:{}", common::free_port())
        .parse()
        .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
        .args(["node", "--name", "node1"])
        .arg("--mesh")
        .arg(mesh)
        .arg("--run-dir")
        .arg(dir.join("run"))
        .arg("--admin")
        .arg(admin.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    assert!(ready.contains("node node1"), "{ready}");
    // The operator's way to a service's token: `dpumesh certs --token SERVICE`.
    let out = certs(mesh, &["--token".as_ref(), SERVICE.as_ref()]);
    assert!(out.status.success(), "{out:?}");
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let key =
        dpumesh_identity::registration::RegistrationKey::load(&dir.join(".dpumesh/certs")).unwrap();
    assert_eq!(token, key.token(SERVICE), "stdout holds the token alone");
    Node {
        child,
        control: format!("unix:{}", dir.join("run/node1.sock").display()),
        admin,
        store_dir: dir.join("store/node1"),
        token,
    }
}

fn store(node: &Node, args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
        .arg("store")
        .arg("--control")
        .arg(&node.control)
        .args(["--service", SERVICE])
        .env("DPUMESH_TOKEN", &node.token)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn data(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as u8)
        .collect()
}

fn files_in(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

fn wait_until(what: &str, within: Duration, done: impl Fn() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn operators_put_get_list_and_remove_objects_on_a_node() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = mesh(
        dir.path(),
        "  dir: store\n  capacity: 64MiB\n  queue_depth: 8\n  slot_size: 64KiB\n",
    );
    let node = start(dir.path(), &mesh);
    // Larger than the 512 KiB staging buffer, from a file; and a small one from stdin.
    let big = data(3 << 20, 1);
    let file = dir.path().join("big.bin");
    std::fs::write(&file, &big).unwrap();
    let out = store(&node, &["put", "objects/big", file.to_str().unwrap()], b"");
    ok(&out);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!("{} bytes, crc32 {:08x}", big.len(), crc32(&big))),
        "{said}"
    );
    ok(&store(&node, &["put", "objects/small"], b"hello, DPU\n"));
    ok(&store(&node, &["put", "other/x"], b""));

    let back = dir.path().join("back.bin");
    ok(&store(
        &node,
        &["get", "objects/big", back.to_str().unwrap()],
        b"",
    ));
    assert!(
        std::fs::read(&back).unwrap() == big,
        "the same bytes came back"
    );
    assert_eq!(
        ok(&store(&node, &["get", "objects/small"], b"")),
        "hello, DPU\n"
    );
    assert_eq!(ok(&store(&node, &["get", "other/x"], b"")), "");

    let listed = ok(&store(&node, &["ls", "objects/"], b""));
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 2, "{listed}");
    assert!(lines[0].ends_with(" objects/big"), "{listed}");
    assert!(
        lines[0].trim_start().starts_with(&big.len().to_string()),
        "{listed}"
    );
    let stat = ok(&store(&node, &["stat", "objects/small"], b""));
    assert!(
        stat.contains(&format!("{:08x}", crc32(b"hello, DPU\n"))),
        "{stat}"
    );

    ok(&store(&node, &["rm", "objects/small"], b""));
    let out = store(&node, &["get", "objects/small"], b"");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("objects/small: no such object"),
        "{out:?}"
    );
    let out = store(&node, &["rm", "objects/small"], b"");
    assert!(!out.status.success(), "removing what is not there fails");

    // The admin API counts and purges by prefix.
    let (status, body) = admin_get(node.admin, "/store");
    assert_eq!(status, 200, "{body}");
    let stats: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(stats["objects"], 2, "{body}");
    assert_eq!(stats["free_slots"], 8, "{body}");
    assert_eq!(
        admin_delete(
            node.admin,
            "/store?prefix=user%2Fobjects%2F",
            &admin_token_of(dir.path())
        ),
        (200, "{\"removed\":1}".to_owned())
    );
    assert_eq!(ok(&store(&node, &["ls"], b"")).lines().count(), 1);
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(bytes);
    h.finalize()
}

/// Small slots, one at a time: a 48 MiB transfer takes long enough to be caught in
/// the middle.
const SLOW: &str =
    "  dir: store\n  capacity: 256MiB\n  queue_depth: 2\n  slot_size: 4KiB\n  pipelined: false\n";

#[test]
fn a_client_killed_mid_push_leaves_no_object_and_gives_its_slots_back() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = mesh(dir.path(), SLOW);
    let node = start(dir.path(), &mesh);
    let file = dir.path().join("huge.bin");
    std::fs::write(&file, data(48 << 20, 2)).unwrap();
    let mut put = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
        .args([
            "store",
            "--control",
            &node.control,
            "--service",
            SERVICE,
            "put",
            "huge",
        ])
        .env("DPUMESH_TOKEN", &node.token)
        .arg(&file)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let tmp = node.store_dir.join("tmp");
    wait_until("the push is under way", Duration::from_secs(20), || {
        files_in(&tmp) > 0
    });
    put.kill().unwrap();
    put.wait().unwrap();
    wait_until(
        "the cancelled push is cleaned up",
        Duration::from_secs(20),
        || {
            let (_, body) = admin_get(node.admin, "/store");
            files_in(&tmp) == 0 && body.contains("\"free_slots\":2")
        },
    );
    let (_, body) = admin_get(node.admin, "/store");
    assert!(body.contains("\"objects\":0"), "{body}");
    assert!(body.contains("\"cancelled\":1"), "{body}");
    assert_eq!(files_in(&node.store_dir.join("objects")), 0);
    // The agent still serves.
    ok(&store(&node, &["put", "after"], b"fine"));
    assert_eq!(ok(&store(&node, &["get", "after"], b"")), "fine");
}

#[test]
fn a_node_killed_mid_write_keeps_what_was_committed_and_serves_no_torn_object() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = mesh(dir.path(), SLOW);
    let mut node = start(dir.path(), &mesh);
    ok(&store(
        &node,
        &["put", "kept"],
        b"committed before the crash",
    ));
    let file = dir.path().join("huge.bin");
    std::fs::write(&file, data(48 << 20, 3)).unwrap();
    let put = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
        .args([
            "store",
            "--control",
            &node.control,
            "--service",
            SERVICE,
            "put",
            "torn",
        ])
        .env("DPUMESH_TOKEN", &node.token)
        .arg(&file)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let tmp = node.store_dir.join("tmp");
    wait_until("the write is under way", Duration::from_secs(20), || {
        files_in(&tmp) > 0
    });
    node.child.kill().unwrap();
    node.child.wait().unwrap();
    let out = put.wait_with_output().unwrap();
    assert!(!out.status.success(), "the client is told");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("control channel"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        files_in(&tmp),
        1,
        "the interrupted write's temporary is left"
    );

    let node = start(dir.path(), &mesh);
    assert_eq!(files_in(&tmp), 0, "removed at start");
    let listed = ok(&store(&node, &["ls"], b""));
    assert_eq!(listed.lines().count(), 1, "{listed}");
    assert!(listed.contains(" kept"), "{listed}");
    assert_eq!(
        ok(&store(&node, &["get", "kept"], b"")),
        "committed before the crash"
    );
    assert!(!store(&node, &["get", "torn"], b"").status.success());
}

#[test]
fn python_clients_put_and_get_objects_too() {
    let probe = Command::new("python3")
        .args(["-c", "import dpumesh.store"])
        .output()
        .expect("python3 runs");
    assert!(
        probe.status.success(),
        "the dpumesh Python package must be installed for python3: run ./scripts/install-python.sh\n{}",
        String::from_utf8_lossy(&probe.stderr)
    );
    let dir = tempfile::tempdir().unwrap();
    let mesh = mesh(dir.path(), "  dir: store\n  slot_size: 64KiB\n");
    let node = start(dir.path(), &mesh);
    let script = r#"
import sys
from dpumesh.store import StoreClient
s = StoreClient(sys.argv[1], "pytest")
data = bytes(range(256)) * 4096
crc = s.put("py/one", data)
assert s.get("py/one") == data
assert s.get("py/none") is None
assert s.stat(["py/one", "py/none"]) == {"py/one": (len(data), crc), "py/none": None}
buf = s.register(3 * 1024)
assert len(buf) == 3 * 1024
buf.write(0, b"a" * 1024 + b"b" * 1024 + b"c" * 1024)
t = s.put_batch([("py/a", buf, 0, 1024), ("py/b", buf, 1024, 1024), ("py/c", buf, 2048, 1024)])
assert [r["status"] for r in t.wait()] == ["Ok"] * 3
assert t.done()
out = s.register(2048)
t = s.get_batch([("py/c", out, 0, 1024), ("py/missing", out, 1024, 1024)])
r = t.wait()
assert (r[0]["status"], r[1]["status"]) == ("Ok", "NotFound"), r
assert out.read(0, 1024) == b"c" * 1024
assert [k for k, _, _ in s.list("py/")] == ["py/a", "py/b", "py/c", "py/one"]
assert s.delete(["py/a", "py/zz"]) == [True, False]
try:
    t.wait()
    raise AssertionError("a transfer waited for twice")
except ValueError:
    pass
print("ok")
"#;
    let out = Command::new("python3")
        .args(["-c", script, &node.control])
        .env("DPUMESH_SERVICE", SERVICE)
        .env("DPUMESH_TOKEN", &node.token)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "ok",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // What Python stored, the CLI sees.
    let listed = ok(&store(&node, &["ls", "py/"], b""));
    assert_eq!(listed.lines().count(), 3, "{listed}");
}

#[test]
fn a_store_client_reaches_only_the_objects_of_the_service_it_proves() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = mesh(dir.path(), "  dir: store\n  capacity: 16MiB\n");
    let node = start(dir.path(), &mesh);
    ok(&store(&node, &["put", "secret", "-"], b"user's own\n"));
    let key =
        dpumesh_identity::registration::RegistrationKey::load(&dir.path().join(".dpumesh/certs"))
            .unwrap();
    let as_service = |service: &str, token: Option<&str>, args: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dpumesh"));
        cmd.args(["store", "--control", &node.control, "--service", service])
            .args(args)
            .env_remove("DPUMESH_TOKEN")
            .stdin(Stdio::null());
        if let Some(token) = token {
            cmd.env("DPUMESH_TOKEN", token);
        }
        cmd.output().unwrap()
    };
    // Another service, with its own token: none of user's objects, by any name.
    let frontend = key.token("frontend");
    for name in ["secret", "user/secret", "../user/secret"] {
        let out = as_service("frontend", Some(&frontend), &["get", name, "-"]);
        assert!(!out.status.success(), "{name}: {out:?}");
    }
    let listed = as_service("frontend", Some(&frontend), &["ls"]);
    assert_eq!(String::from_utf8_lossy(&listed.stdout), "", "{listed:?}");
    // No token, or another service's, proves nothing: refused before any key.
    for token in [None, Some(frontend.as_str())] {
        let out = as_service("user", token, &["ls"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("cannot act as user"),
            "{token:?}: {err}"
        );
    }
    // The service itself still has it.
    assert_eq!(
        ok(&store(&node, &["get", "secret", "-"], b"")),
        "user's own\n"
    );
}

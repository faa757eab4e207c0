//! Who may talk to a node (`dpumesh up` on the hotel sample, mutual TLS by default):
//! a process with no certificate or one from another CA cannot open a fabric link,
//! and a request that claims to be "already policed" (or to come from a workload) is
//! believed only from another node. Without mutual TLS, the same forged request
//! skips the chain: that is what the first test guards against.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dpumesh_dpa::fabric::shm::ShmFabric;
use dpumesh_dpa::fabric::{
    Access, CompletionQueue, Fabric, MemoryRegion, QpCaps, RemoteAddr, WorkCompletion,
};
use dpumesh_dpa::frame::{Message, RemoteBuf, Request, RequestFlags};
use dpumesh_dpa::link::{Link, LinkEvent};
use dpumesh_dpa::shm::SharedRegion;
use dpumesh_head::RequestHead;
use dpumesh_head::wire;
use dpumesh_identity::{MeshTls, SpiffeId, TlsFiles, ca};

use dpumesh_test_support::joined;

mod common;
use common::mesh::*;
use common::token;

const TD: &str = "dpumesh.local";

/// Sends node `node` a request for the frontend (whose chain wants a JWT) that says
/// the chain already ran and that the user service's pod sent it; returns the status
/// answered.
fn forged<F: Fabric>(fabric: F, node: SocketAddr) -> Result<u16, String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let pd = fabric.alloc_pd().map_err(|x| e(&x))?;
    let cq = fabric.create_cq(256).map_err(|x| e(&x))?;
    let qp = fabric
        .connect(&pd, node, &cq, QpCaps::default())
        .map_err(|x| e(&x))?;
    let mut link = Link::new(&fabric, &pd, qp).map_err(|x| e(&x))?;
    let region = Arc::new(SharedRegion::create_unique("dpumesh-test-rogue", 1 << 20).unwrap());
    let mr = fabric
        .register(
            &pd,
            &region,
            0,
            1 << 20,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
        .unwrap();
    let mut head = RequestHead::new("GET", "/ping");
    head.authority = "frontend".into();
    head.destination = Some("frontend".into());
    head.source.identity = Some(format!("spiffe://{TD}/ns/default/sa/user"));
    link.send(Message::Request(Request {
        xid: 1,
        flags: RequestFlags {
            policed: true,
            ..RequestFlags::default()
        },
        deadline_ms: 5000,
        body: None,
        reply: RemoteBuf {
            at: RemoteAddr {
                addr: mr.addr(),
                rkey: mr.rkey(),
            },
            len: 1 << 20,
        },
        head: wire::encode_request(&head).unwrap(),
    }))
    .map_err(|x| e(&x))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut completions: Vec<WorkCompletion> = Vec::new();
    while Instant::now() < deadline {
        completions.clear();
        cq.poll(&mut completions, 16);
        for wc in &completions {
            match link.on_completion(wc) {
                Ok(Some(LinkEvent::Message(Message::Response(r)))) => {
                    return Ok(wire::decode_response(&r.head).unwrap().status);
                }
                Ok(_) => {}
                Err(x) => return Err(e(&x)),
            }
        }
        if link.is_down() {
            return Err("the node closed the link".into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Err("no answer in 10 s".into())
}

/// Node1 runs the frontend.
fn node1_fabric(mesh: &Mesh) -> SocketAddr {
    let file = dpumesh_config::MeshFile::read(&mesh._dir.path().join("mesh.yaml")).unwrap();
    file.config.nodes["node1"].fabric
}

fn metric_or_zero(admin: SocketAddr, name: &str) -> f64 {
    let v = metric(admin, name);
    if v.is_nan() { 0.0 } else { v }
}

#[test]
fn strangers_cannot_link_and_a_forged_policed_request_is_policed_anyway() {
    let mesh = Mesh::up();
    assert!(
        mesh.log.lock().unwrap().contains("issued"),
        "`dpumesh up` issued the mesh's certificates"
    );
    let node1 = node1_fabric(&mesh);
    let admin1 = mesh.admins[0];
    let refused = "dpumesh_tls_handshakes_total{result=\"refused\"}";
    let before = metric_or_zero(admin1, refused);

    // No certificate at all.
    let e = forged(ShmFabric::new(), node1).unwrap_err();
    assert!(!e.is_empty());
    // A certificate of the right name from another CA.
    let other = tempfile::tempdir().unwrap();
    let ingress = SpiffeId::ingress(TD).unwrap();
    ca::ensure(
        other.path(),
        TD,
        std::slice::from_ref(&ingress),
        ca::LEAF_VALIDITY,
        false,
    )
    .unwrap();
    let stranger = MeshTls::load(TlsFiles::in_dir(other.path(), &ingress), TD).unwrap();
    let e = forged(ShmFabric::new().with_tls(Some(stranger)), node1).unwrap_err();
    assert!(e.contains("refused"), "{e}");
    wait("both refusals counted", Duration::from_secs(5), &|| {
        metric_or_zero(admin1, refused) >= before + 2.0
    });

    // The mesh's own ingress certificate: the link opens, but the ingress polices
    // nothing and knows no workload, so the node runs the chain (the JWT filter
    // wants a token: 401) and drops the claimed identity.
    let certs = mesh._dir.path().join(".dpumesh/certs");
    let ours = MeshTls::load(TlsFiles::in_dir(&certs, &ingress), TD).unwrap();
    assert_eq!(
        forged(ShmFabric::new().with_tls(Some(ours)), node1),
        Ok(401)
    );
    let claims = |claim: &str| {
        metric_or_zero(
            admin1,
            &format!("dpumesh_untrusted_claims_total{{claim=\"{claim}\"}}"),
        )
    };
    assert_eq!(claims("policed"), 1.0);
    assert_eq!(claims("identity"), 1.0);
    // The mesh itself serves on, across the fabric too.
    let alice = token("alice", &["user"]);
    let (status, _, body) = mesh.get("/hotels?user=7", Some(&alice));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(
        metric_or_zero(admin1, "dpumesh_tls_handshakes_total{result=\"accepted\"}") >= 2.0,
        "this test's link and the ingress's were accepted"
    );
}

#[test]
fn without_mutual_tls_a_forged_policed_request_skips_the_chain() {
    let mesh = Mesh::up_with(|m| format!("{m}identity: {{mtls: off}}\n"));
    assert_eq!(forged(ShmFabric::new(), node1_fabric(&mesh)), Ok(200));
}

#[test]
fn a_pod_registers_only_with_its_services_token() {
    use dpumesh_dpa::control::transport::{ControlClient, Endpoint};
    use dpumesh_dpa::control::{ControlError, ErrorCode, Role};
    let mesh = Mesh::up();
    // node1's control socket: in the run folder `up` gave it.
    let node1 = the_one(&mesh.child.id().to_string(), "dpumesh node .*--name node1");
    let args = std::fs::read(format!("/proc/{node1}/cmdline")).unwrap();
    let args: Vec<String> = args
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let run = &args[args.iter().position(|a| a == "--run-dir").unwrap() + 1];
    let socket = Endpoint::Unix(std::path::Path::new(run).join("node1.sock"));
    let register = |pod: &str, service: &str, token: Option<&str>| {
        let mut c = ControlClient::connect(&socket, Role::Host, pod).unwrap();
        c.register_pod(pod, service, token).map(|_| ())
    };
    let refused = |r: Result<(), ControlError>| match r {
        Err(ControlError::Refused { code, message }) => {
            assert_eq!(code, ErrorCode::Unauthorized, "{message}");
            message
        }
        other => panic!("registered without proof: {other:?}"),
    };
    let why = refused(register("rogue-0", "frontend", None));
    assert!(why.contains("no registration token"), "{why}");
    let key = dpumesh_identity::registration::RegistrationKey::load(
        &mesh._dir.path().join(".dpumesh/certs"),
    )
    .unwrap();
    // The user service's token does not make a frontend.
    let why = refused(register("rogue-1", "frontend", Some(&key.token("user"))));
    assert!(why.contains("does not prove"), "{why}");
    // The frontend's token does.
    register("extra-frontend-0", "frontend", Some(&key.token("frontend"))).unwrap();
}

#[test]
fn certificates_rotate_under_a_running_mesh() {
    let mesh = Mesh::up();
    let node1 = node1_fabric(&mesh);
    let admin1 = mesh.admins[0];
    let folder = mesh._dir.path().join(".dpumesh/certs");
    let ingress = SpiffeId::ingress(TD).unwrap();
    let before = std::fs::read(folder.join("ingress.pem")).unwrap();
    let out = certs(&mesh._dir.path().join("mesh.yaml"), &["--rotate".as_ref()]);
    assert!(out.status.success(), "{out:?}");
    assert_ne!(std::fs::read(folder.join("ingress.pem")).unwrap(), before);
    // The node looks at its files (at most once a second) when it next accepts a link.
    std::thread::sleep(Duration::from_millis(1100));
    let fresh = MeshTls::load(TlsFiles::in_dir(&folder, &ingress), TD).unwrap();
    assert_eq!(
        forged(ShmFabric::new().with_tls(Some(fresh)), node1),
        Ok(401)
    );
    assert!(
        metric_or_zero(admin1, "dpumesh_tls_certificate_reloads_total") >= 1.0,
        "node1 took its new certificate without a restart"
    );
    // Links made before keep serving.
    let alice = token("alice", &["user"]);
    assert_eq!(mesh.get("/hotels?user=7", Some(&alice)).0, 200);
}

/// The internal services let in only the frontend's pods, by SPIFFE ID.
fn only_the_frontend(policy: String) -> String {
    let component = rbac_component(&policy);
    let filter = format!(
        "  only-frontend:\n    deadline: 100ms\n    component: {component}\n    config:\n      action: ALLOW\n      policies:\n        - {{name: frontend, permissions: [{{any: true}}], principals: [{{identity: {{exact: \"spiffe://{TD}/ns/default/sa/frontend\"}}}}]}}\n"
    );
    let policy = policy
        .replace("\nchains:\n", &format!("{filter}\nchains:\n"))
        .replace("  internal: [trace]", "  internal: [trace, only-frontend]");
    // Reachable from outside too (a virtual host), to show RBAC refuse it there.
    common::expose(policy, "reservation")
}

#[test]
fn rbac_sees_the_calling_pods_workload_identity() {
    let mesh = Mesh::up_edited(|m| m, only_the_frontend);
    let alice = token("alice", &["user"]);
    // The frontend's pod calls user (same node) and reservation (node2): allowed.
    let (status, _, body) = mesh.get("/hotels?user=7", Some(&alice));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // From outside (the ingress: no workload identity), the same services say no.
    let (status, _, _) = mesh.client().raw(
        b"GET /reservations?user=3 HTTP/1.1\r\nhost: reservation\r\nconnection: close\r\n\r\n",
    );
    assert_eq!(status, 403);
}

/// What a volume of Secret `file` holds: its data, decoded, as files in `mount`.
fn mount_secret(file: &std::path::Path, mount: &std::path::Path) -> serde_json::Value {
    use base64::Engine;
    let secret: serde_json::Value =
        serde_norway::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    std::fs::create_dir_all(mount).unwrap();
    for (name, value) in secret["data"].as_object().unwrap() {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(value.as_str().unwrap())
            .unwrap();
        std::fs::write(mount.join(name), bytes).unwrap();
    }
    secret
}

#[test]
fn a_node_and_the_ingress_take_their_certificates_from_kubernetes_secrets() {
    use dpumesh_identity::registration::RegistrationKey;
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (mesh_file, _) = mesh_files(dir.path(), |m| m);
    let out = dir.path().join("secrets");
    let run = certs(&mesh_file, &["--secrets".as_ref(), out.as_os_str()]);
    assert!(run.status.success(), "{run:?}");
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "dpumesh-ingress.yaml",
            "dpumesh-node-node1.yaml",
            "dpumesh-node-node2.yaml",
            "dpumesh-token-flaky.yaml",
            "dpumesh-token-frontend.yaml",
            "dpumesh-token-reservation.yaml",
            "dpumesh-token-user.yaml",
            "kustomization.yaml",
        ]
    );
    for f in &files {
        let mode = std::fs::metadata(out.join(f)).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{f} holds keys: owner-only");
        let text = std::fs::read_to_string(out.join(f)).unwrap();
        assert!(!text.contains("ca.key"), "the CA's key never leaves: {f}");
    }

    // Mounted as volumes, the Secrets are certificate folders: the node and the
    // ingress prove themselves to each other from them.
    let mounts = dir.path().join("mounts");
    let node = mount_secret(&out.join("dpumesh-node-node1.yaml"), &mounts.join("node1"));
    assert_eq!(node["metadata"]["namespace"], "dpumesh-system");
    assert_eq!(node["type"], "Opaque");
    mount_secret(&out.join("dpumesh-ingress.yaml"), &mounts.join("ingress"));
    let (n1, ing) = (
        SpiffeId::node(TD, "node1").unwrap(),
        SpiffeId::ingress(TD).unwrap(),
    );
    let node_tls = MeshTls::load(TlsFiles::in_dir(&mounts.join("node1"), &n1), TD).unwrap();
    let ingress_tls = MeshTls::load(TlsFiles::in_dir(&mounts.join("ingress"), &ing), TD).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut sock, _) = listener.accept().unwrap();
        node_tls.accept(&mut sock).map(|(_, id)| id).unwrap()
    });
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    let (_, node_seen) = ingress_tls.connect(&mut sock).unwrap();
    assert_eq!(node_seen, n1);
    assert_eq!(joined(server), ing);

    // The node checks a pod's token from its Secret with the key in its own.
    let key = RegistrationKey::load(&mounts.join("node1")).unwrap();
    let token = mount_secret(&out.join("dpumesh-token-user.yaml"), &mounts.join("user"));
    assert_eq!(token["metadata"]["namespace"], "default");
    let user = std::fs::read_to_string(mounts.join("user/token")).unwrap();
    assert!(key.verify("user", &user));
    assert!(!key.verify("frontend", &user));

    // kustomize (kubectl's, offline) takes the folder as it is.
    match std::process::Command::new("kubectl")
        .args(["kustomize"])
        .arg(&out)
        .output()
    {
        Ok(built) => {
            assert!(built.status.success(), "{built:?}");
            let text = String::from_utf8(built.stdout).unwrap();
            assert_eq!(text.matches("kind: Secret").count(), 7, "{text}");
        }
        Err(e) => dpumesh_test_support::cannot_run("kubectl (its kustomize)", &e),
    }

    // A mesh whose names Kubernetes cannot take says so.
    let bad = std::fs::read_to_string(&mesh_file)
        .unwrap()
        .replace("node1", "node_1");
    std::fs::write(&mesh_file, bad).unwrap();
    let run = certs(
        &mesh_file,
        &["--secrets".as_ref(), dir.path().join("bad").as_os_str()],
    );
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        !run.status.success() && err.contains("not a Kubernetes name"),
        "{err}"
    );
}

/// A workload's Secret as it is mounted: `ca.pem`, `workload.pem`, `workload.key`.
fn workload_secret(
    certs: &std::path::Path,
    mesh: &dpumesh_config::MeshFile,
    service: &str,
) -> tempfile::TempDir {
    let id = SpiffeId::workload(
        mesh.config.identity.trust_domain(),
        mesh.config.identity.namespace(),
        service,
    )
    .unwrap();
    let files = TlsFiles::in_dir(certs, &id);
    let mount = tempfile::tempdir().unwrap();
    std::fs::copy(&files.ca, mount.path().join("ca.pem")).unwrap();
    std::fs::copy(&files.cert, mount.path().join("workload.pem")).unwrap();
    std::fs::copy(&files.key, mount.path().join("workload.key")).unwrap();
    mount
}

#[test]
fn over_tcp_the_control_channel_runs_mutual_tls_and_a_pod_registers_only_as_its_workload() {
    use dpumesh_dpa::control::Role;
    use dpumesh_dpa::control::transport::{ControlClient, Endpoint};
    let dir = tempfile::tempdir().unwrap();
    let (file, _) = mesh_files(dir.path(), |m| m);
    assert!(certs(&file, &[]).status.success());
    let certs_dir = dir.path().join(".dpumesh/certs");
    let mesh = dpumesh_config::MeshFile::read(&file).unwrap();
    let key = dpumesh_identity::registration::RegistrationKey::load(&certs_dir).unwrap();
    let port = common::free_port();
    let mut node = dpumesh_test_support::Reaped(
        std::process::Command::new(env!("CARGO_BIN_EXE_dpumesh"))
            .args(["node", "--name", "node1", "--mesh"])
            .arg(&file)
            .arg("--run-dir")
            .arg(dir.path().join("run"))
            .env("DPUMESH_NODE_CONTROL", format!("tcp:127.0.0.1:{port}"))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(node.stdout.take().unwrap()),
        &mut ready,
    )
    .unwrap();
    let endpoint = Endpoint::Tcp(format!("127.0.0.1:{port}").parse().unwrap());
    // Plaintext: the registration token would cross in clear; the node speaks TLS
    // only, and nothing is heard.
    let plain = ControlClient::connect_with_tls(&endpoint, Role::Host, "rogue", None);
    assert!(plain.is_err(), "{plain:?}");
    // The frontend's workload, with the user's token: it proves the frontend, and
    // acts for the frontend only.
    let frontend = workload_secret(&certs_dir, &mesh, "frontend");
    let tls = dpumesh_identity::MeshTls::load_workload(frontend.path()).unwrap();
    let mut client =
        ControlClient::connect_with_tls(&endpoint, Role::Host, "user-0", Some(&tls)).unwrap();
    let e = client
        .register_pod("user-0", "user", Some(&key.token("user")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not the workload of user"), "{e}");
    // As its own workload, with its token: registered (over TCP no memory can be
    // passed, so a software pod maps nothing: the registration is what is shown).
    let registered = client.register_pod("frontend-0", "frontend", Some(&key.token("frontend")));
    assert!(registered.is_ok(), "{registered:?}");
    let _ = node.kill();
    let _ = node.wait();
}

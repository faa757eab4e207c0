//! A mesh that heals, through real processes: under continuous load, each node of the
//! hotel sample and then its ingress are killed with SIGKILL. `dpumesh up` starts the
//! dead process again; the pods of a restarted node register again by themselves; the
//! ingress reconnects; and the mesh serves again. Every request is answered (none
//! hangs past its timeout), no region of a killed process stays in /dev/shm, and no
//! pool slot is held once the mesh is idle. A node that cannot even start is given up
//! on while the rest of the mesh serves.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dpumesh_test_support::joined;

mod common;
use common::mesh::*;
use common::token;

/// The mesh file's request timeout (see `mesh_files`).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

#[test]
fn killed_nodes_and_ingress_are_started_again_and_the_mesh_serves_again() {
    let mesh = Mesh::up();
    let alice = token("alice", &["user"]);
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicUsize::new(0));
    // /hotels crosses both nodes: frontend and user on node1, reservation on node2.
    let clients = load(&mesh, "/hotels?user=3", &alice, 3, &stop, &served);
    let more_served = |n: usize| {
        let served = served.clone();
        let from = served.load(Ordering::Relaxed);
        move || served.load(Ordering::Relaxed) >= from + n
    };
    wait(
        "the load is flowing",
        Duration::from_secs(60),
        &more_served(20),
    );
    let up = mesh.child.id().to_string();
    let mut healed = Vec::new();
    let mut killed = Vec::new();
    // The ingress first: the one started again then sees both nodes go and come back.
    for (what, pattern) in [
        ("ingress", "dpumesh ingress"),
        ("node1", "dpumesh node .*--name node1"),
        ("node2", "dpumesh node .*--name node2"),
    ] {
        let pid = the_one(&up, pattern);
        let at = Instant::now();
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
        killed.push((what, pid));
        // `up` starts it again...
        wait(
            &format!("{what} is started again"),
            Duration::from_secs(30),
            &|| pids_of(&up, pattern).iter().any(|p| *p != pid),
        );
        // ...and the mesh serves a fresh request again.
        wait(
            &format!("the mesh serves again after {what} was killed"),
            Duration::from_secs(30),
            &|| mesh.client().status("/hotels?user=3", Some(&alice)) == 200,
        );
        healed.push((what, at.elapsed()));
        wait(
            &format!("the load flows again after {what}"),
            Duration::from_secs(30),
            &more_served(20),
        );
    }
    eprintln!("from kill to serving again: {healed:?}");
    stop.store(true, Ordering::Relaxed);
    let (mut ok, mut failed, mut slowest) = (0, Vec::new(), Duration::ZERO);
    for c in clients {
        let (o, f, s) = joined(c);
        ok += o;
        failed.extend(f);
        slowest = slowest.max(s);
    }
    let mut by_status = std::collections::BTreeMap::new();
    for (_, status) in &failed {
        *by_status.entry(*status).or_insert(0usize) += 1;
    }
    eprintln!(
        "{ok} served; failures by status (0 = no answer): {by_status:?}; slowest {slowest:?}"
    );
    // What failed was answered as a failure of the mesh's side (or not let in at all
    // while the ingress was down): never a hang past the timeout.
    assert!(
        by_status.keys().all(|s| matches!(s, 0 | 502 | 503 | 504)),
        "{by_status:?}"
    );
    assert!(
        slowest <= REQUEST_TIMEOUT + Duration::from_secs(3),
        "a request took {slowest:?}"
    );
    // The restarted processes took their predecessors' regions with them.
    for (what, pid) in &killed {
        let left = regions_of(*pid);
        assert!(left.is_empty(), "{what} (pid {pid}) left {left:?}");
    }
    // Idle, every pod is back and nothing is held: node1 runs frontend, flaky and two
    // users, node2 reservation.
    let admins = mesh.admins();
    wait(
        "both nodes idle with all their pods",
        Duration::from_secs(20),
        &|| {
            let idle = |admin| {
                [
                    "dpumesh_exchanges_in_flight",
                    "dpumesh_pool_slots_in_use{pool=\"dpu_tx_header\"}",
                    "dpumesh_pool_slots_in_use{pool=\"dpu_rx_header\"}",
                    "dpumesh_pool_slots_in_use{pool=\"pod_bodies\"}",
                ]
                .iter()
                .all(|m| metric(admin, m) == 0.0)
            };
            idle(admins[0])
                && idle(admins[1])
                && metric(admins[0], "dpumesh_pods") == 4.0
                && metric(admins[1], "dpumesh_pods") == 1.0
        },
    );
    // The ingress saw its nodes go and come back, and says so.
    let admin = mesh
        .ingress_admin
        .expect("the sample's ingress has an admin API");
    wait(
        "the ingress is ready again",
        Duration::from_secs(20),
        &|| admin_get(admin, "/readyz").0 == 200,
    );
    let (_, metrics) = admin_get(admin, "/metrics");
    let counted = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(
        counted("dpumesh_ingress_links_lost_total") >= 1.0
            && counted("dpumesh_ingress_reconnects_total") >= 1.0,
        "{metrics}"
    );
    let log = mesh.log.lock().unwrap().clone();
    for (what, _) in &killed {
        let name = if *what == "ingress" {
            "ingress".to_owned()
        } else {
            format!("node {what}")
        };
        assert!(
            log.contains(&format!("dpumesh up: {name} exited (signal: 9")),
            "up says {name} was killed: {log}"
        );
    }
}

#[test]
fn a_node_that_cannot_start_is_given_up_on_while_the_rest_serves() {
    // node2's admin API wants an address this machine does not have: it dies at every
    // start.
    let mesh = Mesh::up_edited(
        |m| {
            let at = m.find("node2: {fabric:").unwrap();
            let admin = at + m[at..].find("admin: ").unwrap() + "admin: ".len();
            let end = admin + m[admin..].find('}').unwrap();
            format!("{}192.0.2.1:9{}", &m[..admin], &m[end..])
        },
        |p| common::expose(p, "reservation"),
    );
    wait("up gives node2 up", Duration::from_secs(60), &|| {
        mesh.log
            .lock()
            .unwrap()
            .contains("node node2 died 5 times right after starting")
    });
    let log = mesh.log.lock().unwrap().clone();
    let report = &log[log.find("node node2 died 5 times").unwrap()..];
    assert!(report.contains("left down"), "{report}");
    assert!(
        report.contains("    Error: cannot listen on 192.0.2.1:9"),
        "its last lines say why: {report}"
    );
    assert!(pids_of(&mesh.child.id().to_string(), "--name node2").is_empty());
    // The rest serves: /ping needs node1 only; /hotels needs node2 and is refused at
    // once.
    let alice = token("alice", &["user"]);
    assert_eq!(mesh.get("/ping", Some(&alice)).0, 200);
    let began = Instant::now();
    let (status, _, _) = mesh.get("/hotels?user=3", Some(&alice));
    assert!(matches!(status, 502 | 503), "{status}");
    assert!(began.elapsed() < REQUEST_TIMEOUT, "refused, not timed out");
    // A request the ingress sends to node2 itself (reservation's virtual host) finds
    // it down: the ingress's /readyz says which node and why, and /nodes lists it.
    let admin = mesh
        .ingress_admin
        .expect("the sample's ingress has an admin API");
    assert_eq!(admin_get(admin, "/readyz").0, 200, "no node tried yet");
    let request = format!(
        "GET /reservations?user=3 HTTP/1.1\r\nhost: reservation\r\nauthorization: Bearer {alice}\r\nconnection: close\r\n\r\n"
    );
    assert_eq!(mesh.raw(request.as_bytes()).0, 502);
    let (status, why) = admin_get(admin, "/readyz");
    assert_eq!(status, 503, "{why}");
    assert!(why.contains("unreachable for"), "{why}");
    let (_, nodes) = admin_get(admin, "/nodes");
    assert_eq!(nodes.matches(" down for ").count(), 1, "{nodes}");
}

/// Processes a test started itself, killed when it ends.
struct Started(Vec<std::process::Child>);

impl Drop for Started {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `dpumesh <args>` and waits for its ready line.
fn role(args: &[&std::ffi::OsStr]) -> std::process::Child {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if line.starts_with("dpumesh-ready") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("dpumesh {args:?} ready within 60 s"));
    child
}

#[test]
fn without_up_killed_processes_started_again_by_hand_are_taken_back() {
    // What an orchestrator does (a DaemonSet restarting a node, a Deployment its
    // ingress): kill with SIGKILL and start the same command again. The pods are not
    // restarted: they register again with their node by themselves.
    let dir = tempfile::tempdir().unwrap();
    let (file, ingress) = mesh_files(dir.path(), |m| m);
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let file = file.as_os_str().to_owned();
    // What the orchestrator's Secret would hold: the mesh's certificates.
    let issued = certs(std::path::Path::new(&file), &[]);
    assert!(issued.status.success(), "{issued:?}");
    let node = |name: &str| {
        role(&[
            "node".as_ref(),
            "--mesh".as_ref(),
            &file,
            "--name".as_ref(),
            name.as_ref(),
            "--run-dir".as_ref(),
            run.as_os_str(),
        ])
    };
    let ingress_role = || role(&["ingress".as_ref(), "--mesh".as_ref(), &file]);
    let hotel = std::path::Path::new(env!("CARGO_BIN_EXE_dpumesh"))
        .parent()
        .unwrap()
        .join("hotel");
    // And what the service's Secret would hold: its registration token.
    let key =
        dpumesh_identity::registration::RegistrationKey::load(&dir.path().join(".dpumesh/certs"))
            .unwrap();
    let pod = |service: &str, node: &str| {
        Command::new(&hotel)
            .arg(service)
            .env("DPUMESH_TOKEN", key.token(service))
            .env("DPUMESH_CONTROL", run.join(format!("{node}.sock")))
            .env("DPUMESH_SERVICE", service)
            .env("DPUMESH_POD", format!("{service}-{node}-0"))
            .spawn()
            .unwrap()
    };
    let mut procs = Started(vec![node("node1"), node("node2")]);
    let pods = [
        pod("frontend", "node1"),
        pod("user", "node1"),
        pod("reservation", "node2"),
    ];
    let pod_pids: Vec<u32> = pods.iter().map(|p| p.id()).collect();
    procs.0.extend(pods);
    procs.0.push(ingress_role());
    let alice = token("alice", &["user"]);
    let client = Client(ingress);
    let serves = || client.status("/hotels?user=3", Some(&alice)) == 200;
    wait("the mesh serves", Duration::from_secs(60), &serves);
    let mut healed = Vec::new();
    let mut killed = Vec::new();
    // procs: [node1, node2, frontend, user, reservation, ingress]
    for (what, index) in [("node2", 1), ("ingress", 5), ("node1", 0)] {
        let pid = procs.0[index].id();
        procs.0[index].kill().unwrap();
        procs.0[index].wait().unwrap();
        let at = Instant::now();
        killed.push((what, pid));
        procs.0[index] = match what {
            "ingress" => ingress_role(),
            name => node(name),
        };
        wait(
            &format!("the mesh serves again after {what} was started again"),
            Duration::from_secs(30),
            &serves,
        );
        healed.push((what, at.elapsed()));
    }
    eprintln!("from kill to serving again (restarted by hand): {healed:?}");
    // The pods never restarted: each registered again with its new node.
    for (p, pid) in procs.0[2..5].iter_mut().zip(&pod_pids) {
        assert!(p.try_wait().unwrap().is_none(), "pod {pid} still runs");
    }
    for (what, pid) in &killed {
        let left = regions_of(*pid);
        assert!(left.is_empty(), "{what} (pid {pid}) left {left:?}");
    }
}

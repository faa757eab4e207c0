//! The roles as a container runs them: `dpumesh node` configured from the environment
//! (what a Kubernetes manifest sets from the Downward API), logging JSON lines to a
//! pipe, stopped by SIGTERM; a bad setting refused with a precise error.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use dpumesh_test_support::joined;

mod common;
use common::free_port;
use common::mesh::*;

#[test]
fn a_node_runs_from_its_environment_and_logs_json_lines_off_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let (mesh, _) = mesh_files(dir.path(), |m| m);
    let out = certs(&mesh, &[]);
    assert!(out.status.success(), "{out:?}");
    // The certificates where the node's Secret is mounted, not where the file says.
    let secret = dir.path().join("secret");
    std::fs::rename(dir.path().join(".dpumesh/certs"), &secret).unwrap();
    // The policy's key set reads its key where the policy says (the node's certificates
    // alone moved).
    common::write_demo_key(dir.path());
    let (fabric, admin) = (free_port(), free_port());
    let mut node = dpumesh_test_support::Reaped(
        Command::new(env!("CARGO_BIN_EXE_dpumesh"))
            .arg("node")
            .env("DPUMESH_MESH", &mesh)
            .env("DPUMESH_NODE_NAME", "node2")
            .env("DPUMESH_RUN_DIR", dir.path().join("run"))
            .env("DPUMESH_FABRIC_LISTEN", format!("0.0.0.0:{fabric}"))
            .env("DPUMESH_ADMIN", format!("127.0.0.1:{admin}"))
            .env("DPUMESH_TRANSPORT", "tcp")
            .env("DPUMESH_CERTS", &secret)
            .env("DPUMESH_LOG", "info")
            .env_remove("DPUMESH_LOG_FORMAT")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stderr = node.stderr.take().unwrap();
    let logs = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
    });
    let mut ready = String::new();
    BufReader::new(node.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    assert!(
        ready.contains(&format!("node node2 fabric 0.0.0.0:{fabric}")),
        "binds the fabric address from the environment: {ready}"
    );
    assert!(
        ready.contains(&format!(
            "control unix:{}",
            dir.path().join("run").display()
        )),
        "{ready}"
    );
    assert!(
        ready.contains(&format!("admin 127.0.0.1:{admin}")),
        "{ready}"
    );
    let admin = format!("127.0.0.1:{admin}").parse().unwrap();
    assert_eq!(admin_get(admin, "/healthz").0, 200);
    // Its pod (reservation) has not registered: the node is Ready (it can serve;
    // under DPF the host's pods may wait for it), and the answer names the pod.
    let (status, body) = admin_get(admin, "/readyz");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("waiting: 0 of 1 pods of \"reservation\" registered"),
        "{body}"
    );

    // SIGTERM (what the kubelet sends) ends it cleanly.
    Command::new("kill")
        .args(["-TERM", &node.id().to_string()])
        .status()
        .unwrap();
    let status = wait_exit(&mut node, Duration::from_secs(30));
    assert!(status.success(), "{status:?}");
    let lines = joined(logs);
    assert!(!lines.is_empty(), "it logged at info");
    for line in &lines {
        assert!(
            !line.contains('\x1b'),
            "no ANSI escapes off a terminal: {line:?}"
        );
        let event: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(event["level"].is_string(), "{line}");
        assert!(event["timestamp"].is_string(), "{line}");
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains("\"starting\"") && l.contains("\"node2\"")),
        "{lines:#?}"
    );
}

#[test]
fn bad_settings_from_the_environment_are_refused_with_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let (mesh, _) = mesh_files(dir.path(), |m| m);
    let run = |envs: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
            .arg("node")
            .env("DPUMESH_MESH", &mesh)
            .env("DPUMESH_RUN_DIR", dir.path().join("run"))
            .envs(envs.iter().copied())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&[
        ("DPUMESH_NODE_NAME", "node1"),
        ("DPUMESH_TRANSPORT", "rdma"),
    ]);
    assert!(err.contains("\"rdma\" is not a fabric backend"), "{err}");
    assert!(
        err.contains("DPUMESH_TRANSPORT"),
        "names the variable: {err}"
    );
    let err = run(&[("DPUMESH_NODE_NAME", "node1"), ("DPUMESH_ADMIN", "9101")]);
    assert!(err.contains("DPUMESH_ADMIN"), "{err}");
    let err = run(&[("DPUMESH_NODE_NAME", "node1"), ("DPUMESH_NODE_CONTROL", "")]);
    assert!(err.contains("DPUMESH_NODE_CONTROL"), "{err}");
    let err = run(&[
        ("DPUMESH_NODE_NAME", "node1"),
        ("DPUMESH_COLOCATED_NODES", "0"),
    ]);
    assert!(err.contains("DPUMESH_COLOCATED_NODES"), "{err}");
    assert!(err.contains("1..=4096"), "says the range: {err}");
    // The chart's `dataPath.backend: doca` on a build without DOCA: refused, saying
    // what build it needs (never a silent software path on a DPU).
    let err = run(&[
        ("DPUMESH_NODE_NAME", "node1"),
        ("DPUMESH_DATA_PATH", "doca"),
    ]);
    assert!(err.contains("DPUMESH_DATA_PATH"), "{err}");
    assert!(err.contains("--features doca"), "{err}");
    // A Downward-API name the mesh file does not list.
    let err = run(&[("DPUMESH_NODE_NAME", "dpu-worker-7")]);
    assert!(err.contains("\"dpu-worker-7\" is not in"), "{err}");
    let err = run(&[]);
    assert!(err.contains("--name"), "{err}");
}

fn wait_exit(child: &mut std::process::Child, within: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The mesh and policy `deploy/` ships (read by the ingress and every DPU proxy), as a
/// node loads them: components from the image's folder, here this build's.
fn run_shipped(name: &str, files: &[(&str, String)]) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    for (file, text) in files {
        let mut text = text
            .replace("/var/cache/dpumesh", &format!("{d}/cache"))
            .replace("/etc/dpumesh/certs", &format!("{d}/certs"));
        for (filter, path) in [
            ("trace", dpumesh_test_artifacts::FILTER_TRACE),
            ("jwt", dpumesh_test_artifacts::FILTER_JWT),
            ("rbac", dpumesh_test_artifacts::FILTER_RBAC),
            ("ratelimit", dpumesh_test_artifacts::FILTER_RATELIMIT),
            (
                "circuit-breaker",
                dpumesh_test_artifacts::FILTER_CIRCUIT_BREAKER,
            ),
        ] {
            text = text.replace(&format!("/usr/share/dpumesh/filters/{filter}.wasm"), path);
        }
        assert!(!text.contains("/usr/share/dpumesh"), "{name}: {text}");
        std::fs::write(dir.path().join(file), text).unwrap();
    }
    let mesh = dir.path().join("mesh.yaml");
    let out = certs(&mesh, &[]);
    assert!(out.status.success(), "{name}: {out:?}");
    let admin = free_port();
    let mut node = dpumesh_test_support::Reaped(
        Command::new(env!("CARGO_BIN_EXE_dpumesh"))
            .args(["node", "--name", "dpu-worker-1", "--mesh"])
            .arg(&mesh)
            .env("DPUMESH_RUN_DIR", dir.path().join("run"))
            .env(
                "DPUMESH_FABRIC_LISTEN",
                format!("127.0.0.1:{}", free_port()),
            )
            .env("DPUMESH_ADMIN", format!("127.0.0.1:{admin}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let mut ready = String::new();
    BufReader::new(node.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    let admin = format!("127.0.0.1:{admin}").parse().unwrap();
    let filters = (!ready.is_empty()).then(|| admin_get(admin, "/filters"));
    let _ = node.kill();
    let _ = node.wait();
    assert!(ready.contains("node dpu-worker-1"), "{name}: {ready}");
    let (status, filters) = filters.unwrap();
    assert_eq!(status, 200, "{name}: {filters}");
    assert!(
        filters.contains("\"api\""),
        "{name}: the api chain: {filters}"
    );
}

#[test]
fn the_mesh_and_policy_deploy_ships_load_in_a_node() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let k8s = root.join("deploy/k8s/mesh");
    let read = |f: &str| std::fs::read_to_string(k8s.join(f)).unwrap();
    run_shipped(
        "deploy/k8s/mesh (= the DPF configuration's)",
        &[
            ("mesh.yaml", read("mesh.yaml")),
            ("policy.yaml", read("policy.yaml")),
            ("jwks.json", read("jwks.json")),
        ],
    );
    // The chart's defaults.
    let values: serde_norway::Value = serde_norway::from_str(
        &std::fs::read_to_string(root.join("deploy/helm/dpumesh-node/values.yaml")).unwrap(),
    )
    .unwrap();
    let mesh = &values["mesh"];
    let text = |v: &serde_norway::Value| v.as_str().unwrap().to_owned();
    let mut files = vec![
        ("mesh.yaml", text(&mesh["file"])),
        ("policy.yaml", text(&mesh["policy"])),
    ];
    for (name, body) in mesh["files"].as_mapping().unwrap() {
        files.push((name.as_str().unwrap(), text(body)));
    }
    run_shipped("the chart's values.yaml", &files);
}

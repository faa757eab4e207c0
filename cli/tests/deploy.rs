//! The roles as a container runs them: `dpumesh node` configured from the environment
//! (what a Kubernetes manifest sets from the Downward API), logging JSON lines to a
//! pipe, stopped by SIGTERM; a bad setting refused with a precise error.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

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
    let (fabric, admin) = (free_port(), free_port());
    let mut node = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
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
        .unwrap();
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
    // Its pod (reservation) has not registered: not ready, and the answer says why.
    let (status, body) = admin_get(admin, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("reservation"), "{body}");

    // SIGTERM (what the kubelet sends) ends it cleanly.
    Command::new("kill")
        .args(["-TERM", &node.id().to_string()])
        .status()
        .unwrap();
    let status = wait_exit(&mut node, Duration::from_secs(30));
    assert!(status.success(), "{status:?}");
    let lines = logs.join().unwrap();
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

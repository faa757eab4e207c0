//! The proxy's config as Kubernetes mounts a ConfigMap: every key a symbolic link
//! through `..data` into a timestamped folder, and an update that writes a new folder
//! and swaps `..data` to it in one rename (the kubelet's atomic writer). The watcher
//! must see that swap, including one that changes only a file the config names and
//! keeps its size and modification time, and the switch must fail no request.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dpumesh_proxy::{Options, Proxy};
use dpumesh_test_artifacts as artifacts;

/// A ConfigMap volume: `..data` points at the current timestamped folder.
struct Volume {
    dir: PathBuf,
    version: usize,
}

impl Volume {
    /// Mounts `files` as version 1, with a link per key as the kubelet makes them.
    fn mount(dir: &Path, files: &[(&str, String)]) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let mut volume = Self {
            dir: dir.to_owned(),
            version: 0,
        };
        volume.update(files);
        for (name, _) in files {
            symlink(Path::new("..data").join(name), dir.join(name)).unwrap();
        }
        volume
    }

    fn folder(&self, version: usize) -> String {
        format!("..2026_11_24_12_00_00.{version:09}")
    }

    /// Writes the next version's folder, points `..data_tmp` at it, renames that over
    /// `..data` and removes the old folder: exactly the kubelet's order.
    fn update(&mut self, files: &[(&str, String)]) {
        self.update_then(files, |_| {});
    }

    /// [`Volume::update`] with `prepare` run on the new folder before the swap.
    fn update_then(&mut self, files: &[(&str, String)], prepare: impl FnOnce(&Path)) {
        let old = self.version;
        self.version += 1;
        let folder = self.dir.join(self.folder(self.version));
        std::fs::create_dir(&folder).unwrap();
        for (name, text) in files {
            std::fs::write(folder.join(name), text).unwrap();
        }
        prepare(&folder);
        let tmp = self.dir.join("..data_tmp");
        symlink(self.folder(self.version), &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
        if old > 0 {
            std::fs::remove_dir_all(self.dir.join(self.folder(old))).unwrap();
        }
    }

    /// The current version's copy of `name` (to give a new copy the old one's time).
    fn current(&self, name: &str) -> PathBuf {
        self.dir.join(self.folder(self.version)).join(name)
    }
}

/// The proxy config: the `api` chain runs `main` (its own text given), with the
/// components and the cache outside the volume, as the image and an emptyDir hold
/// them in the chart.
fn proxy_yaml(outside: &Path, main: &str) -> String {
    let o = outside.display();
    format!(
        r#"admin: 127.0.0.1:0
listener: 127.0.0.1:0
workers: 2
cache_dir: {o}/cache
filters:
{main}
chains:
  api: [main]
services:
  api: {{chain: api}}
routes:
  - {{service: api}}
"#
    )
}

fn tagged_by_file(outside: &Path) -> String {
    format!(
        "  main:\n    component: {}/test.wasm\n    deadline: 250ms\n    config_file: main.yaml",
        outside.display()
    )
}

fn guard(outside: &Path) -> String {
    format!(
        "  main:\n    component: {}/guard.wasm\n    deadline: 250ms\n    config: {{rules: [{{name: no-delete, methods: [DELETE], action: deny}}], default: allow}}",
        outside.display()
    )
}

fn main_yaml(version: usize) -> String {
    format!("request:\n  - set_header: [x-version, \"{version}\"]\n")
}

/// Status and body of one request.
/// One exchange: the status and the whole response; status 0 (and why) when any
/// step failed, which the load counts as a failed request rather than panicking.
fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let exchange = || -> std::io::Result<String> {
        let mut stream = TcpStream::connect(addr)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nhost: api.test\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        )?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw)?;
        Ok(raw)
    };
    let raw = match exchange() {
        Ok(raw) => raw,
        Err(e) => return (0, format!("no answer: {e}")),
    };
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, raw)
}

fn wait_for(what: &str, done: &dyn Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_configmap_update_by_data_link_swap_takes_effect_with_no_failed_request() {
    let root = tempfile::tempdir().unwrap();
    let outside = root.path().join("image");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::copy(artifacts::TEST_FILTER, outside.join("test.wasm")).unwrap();
    std::fs::copy(artifacts::SAMPLE_GUARD, outside.join("guard.wasm")).unwrap();
    let config = |main: String, version: usize| {
        vec![
            ("proxy.yaml", proxy_yaml(&outside, &main)),
            ("main.yaml", main_yaml(version)),
        ]
    };
    let mut volume = Volume::mount(
        &root.path().join("config"),
        &config(tagged_by_file(&outside), 1),
    );
    let proxy = Proxy::start(
        &volume.dir.join("proxy.yaml"),
        Options {
            watch: Some(Duration::from_millis(20)),
        },
    )
    .expect("the proxy starts from the mounted ConfigMap");
    let addr = proxy.listener_addr().unwrap();
    assert!(http(addr, "GET", "/").1.contains("[\"x-version\",\"1\"]"));

    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicUsize::new(0));
    let load: Vec<_> = (0..4)
        .map(|_| {
            let (stop, served) = (stop.clone(), served.clone());
            std::thread::spawn(move || {
                let mut failures = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let (status, raw) = http(addr, "GET", "/items");
                    if status != 200 {
                        failures.push(raw);
                    }
                    served.fetch_add(1, Ordering::Relaxed);
                }
                failures
            })
        })
        .collect();

    // 1. The policy itself changes: the guard replaces the tagging filter.
    volume.update(&config(guard(&outside), 1));
    wait_for("the guard serves after the swap", &|| {
        http(addr, "DELETE", "/items/1").0 == 403
    });
    assert!(!http(addr, "GET", "/").1.contains("x-version"));

    // 2. Back to the tagging filter, version 2.
    volume.update(&config(tagged_by_file(&outside), 2));
    wait_for("version 2 serves", &|| {
        http(addr, "GET", "/").1.contains("[\"x-version\",\"2\"]")
    });
    let generation = proxy.policy().snapshot().generation.number();

    // 3. Only the filter's config file changes, to text of the same size, and the new
    //    copy keeps the old one's modification time: only its identity tells.
    let mtime = std::fs::metadata(volume.current("main.yaml"))
        .unwrap()
        .modified()
        .unwrap();
    volume.update_then(&config(tagged_by_file(&outside), 3), |folder| {
        std::fs::File::options()
            .write(true)
            .open(folder.join("main.yaml"))
            .unwrap()
            .set_modified(mtime)
            .unwrap();
    });
    wait_for("version 3 serves", &|| {
        http(addr, "GET", "/").1.contains("[\"x-version\",\"3\"]")
    });
    assert_eq!(
        proxy.policy().snapshot().generation.number(),
        generation + 1,
        "one swap, one reload"
    );

    stop.store(true, Ordering::Relaxed);
    let failures: Vec<String> = load
        .into_iter()
        .flat_map(dpumesh_test_support::joined)
        .collect();
    assert!(failures.is_empty(), "failed requests: {failures:?}");
    assert!(served.load(Ordering::Relaxed) > 20, "the load kept flowing");
    assert!(
        proxy.policy().last_error().is_none(),
        "no swap was seen half-done: {:?}",
        proxy.policy().last_error()
    );
}

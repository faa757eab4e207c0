//! One policy, four languages: the API-key sample built from `samples/filters/{rust,
//! python,js,c}` with `dpumesh filter build`, then measured in one run with Rust as the
//! baseline: component size, build time, precompile time, load from the `.cwasm` cache,
//! instance creation (instantiation from the pool, then `configure`, apart), and
//! `on-request` latency.
//!
//! `cargo bench -p dpumesh --bench languages` (needs the toolchains of
//! `scripts/install-toolchain.sh`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dpumesh_runtime::{
    ChainRunner, FilterChain, FilterSettings, RequestHead, Runtime, RuntimeConfig,
};

const CONFIG: &str = r#"{"keys": {"alice": "key-alice-123", "bob": "key-bob-456"}}"#;

struct Row {
    lang: &'static str,
    size: usize,
    build: Duration,
    precompile: Duration,
    load: Duration,
    instantiate: Duration,
    configure: Duration,
    request: Duration,
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Copies a sample into `work` (its build folder is not the repo's) and builds it.
fn build(lang: &'static str, work: &Path) -> (PathBuf, Duration) {
    let samples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../samples/filters");
    let dir = work.join(lang);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(samples.join(lang)).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    if lang == "rust" {
        // The Rust sample is a workspace member: build the scaffolded twin instead.
        std::fs::remove_dir_all(&dir).unwrap();
        let status = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
            .args(["filter", "new", "rust", "--lang", "rust", "--dir"])
            .arg(work)
            .status()
            .unwrap();
        assert!(status.success());
    }
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
        .args(["filter", "build"])
        .arg(&dir)
        .env(
            "CARGO_TARGET_DIR",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/filter-projects"),
        )
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{lang}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    (
        dir.join("build").join(format!("{lang}.wasm")),
        started.elapsed(),
    )
}

fn request() -> RequestHead {
    let mut head = RequestHead::new("GET", "/orders");
    head.authority = "api.example.com".to_owned();
    head.append_received("x-api-key", "key-bob-456").unwrap();
    head.append_received("user-agent", "bench").unwrap();
    head
}

fn measure(lang: &'static str, component: &Path, build: Duration, cache: &Path) -> Row {
    let bytes = std::fs::read(component).unwrap();
    let runtime = || {
        Runtime::new(RuntimeConfig {
            cache_dir: Some(cache.to_owned()),
            max_instances: 64,
            ..RuntimeConfig::default()
        })
        .unwrap()
    };
    let settings = || {
        FilterSettings::new(lang, CONFIG)
            .deadline(Duration::from_secs(2))
            .configure_deadline(Duration::from_secs(10))
    };
    // Precompile (fills the cache), then load from the cache in fresh runtimes.
    let started = Instant::now();
    runtime().precompile(lang, &bytes).unwrap();
    let precompile = started.elapsed();
    let load = median(
        (0..5)
            .map(|_| {
                let rt = runtime();
                let started = Instant::now();
                rt.load_filter(settings(), &bytes).unwrap();
                started.elapsed()
            })
            .collect(),
    );
    let rt = runtime();
    let filter = rt.load_filter(settings(), &bytes).unwrap();
    let startups: Vec<_> = (0..20)
        .map(|_| filter.instantiate().unwrap().startup())
        .collect();
    let instantiate = median(startups.iter().map(|s| s.instantiate).collect());
    let configure = median(startups.iter().map(|s| s.configure).collect());
    let mut runner = ChainRunner::new(Arc::new(FilterChain::new(lang, vec![filter])));
    let template = request();
    for _ in 0..200 {
        runner.on_request(template.clone());
    }
    let request = median(
        (0..5_000)
            .map(|_| {
                let head = template.clone();
                let started = Instant::now();
                let outcome = runner.on_request(head);
                let elapsed = started.elapsed();
                assert!(
                    outcome.decision.reply().is_none(),
                    "{lang}: {:?}",
                    outcome.decision
                );
                elapsed
            })
            .collect(),
    );
    Row {
        lang,
        size: bytes.len(),
        build,
        precompile,
        load,
        instantiate,
        configure,
        request,
    }
}

fn main() {
    // `cargo bench` passes flags such as `--bench`; this harness takes none.
    let work = tempfile::tempdir().unwrap();
    let cache = work.path().join("cwasm");
    let mut rows = Vec::new();
    for lang in ["rust", "python", "js", "c"] {
        let (component, build_time) = build(lang, work.path());
        rows.push(measure(lang, &component, build_time, &cache));
    }
    let base = &rows[0];
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!(
        "| language | component | build | precompile | load from .cwasm (+configure) | instantiate | configure | on-request p50 |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for row in &rows {
        println!(
            "| {} | {:.0} KiB ({:.1}×) | {:.1} s | {:.0} ms ({:.1}×) | {:.2} ms ({:.1}×) | {:.1} µs ({:.1}×) | {:.1} µs ({:.1}×) | {:.2} µs ({:.1}×) |",
            row.lang,
            row.size as f64 / 1024.0,
            row.size as f64 / base.size as f64,
            row.build.as_secs_f64(),
            row.precompile.as_secs_f64() * 1e3,
            ratio(row.precompile, base.precompile),
            row.load.as_secs_f64() * 1e3,
            ratio(row.load, base.load),
            row.instantiate.as_secs_f64() * 1e6,
            ratio(row.instantiate, base.instantiate),
            row.configure.as_secs_f64() * 1e6,
            ratio(row.configure, base.configure),
            row.request.as_secs_f64() * 1e6,
            ratio(row.request, base.request),
        );
    }
}

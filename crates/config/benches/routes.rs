//! What finding a request's route costs as the policy grows (issue 49's "route lookup
//! adds ≤ 1 µs per request at 50 000 routes against 100"), in one run: tables of 100
//! to 50 000 routes shaped as `bench/scale.sh routes` makes them (a tenth of the
//! routes on hosts of their own, the rest on any host under `/sN/rM` prefixes,
//! `/ping` last), looked up for
//! - `last`: `/ping`, the last route (a scan in config order passed every other);
//! - `host`: a route on a host of its own;
//! - `miss`: a path no route has (404);
//! - `scan, last`: the baseline, `/ping` found as the table found it before its index
//!   (every route's host and prefix compared in config order).
//!
//! `cargo bench -p dpumesh-config --bench routes`

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, criterion_group, criterion_main};
use dpumesh_config::RouteTable;
use dpumesh_config::proxy::LoadedConfig;

/// A policy's routes section with `n` routes over `n / 50` services (at least 1).
fn policy(n: usize) -> String {
    let services = (n / 50).max(1);
    let mut text = String::from("filters: {f: {component: f.wasm}}\nchains: {a: [f]}\nservices:\n");
    for s in 0..services {
        text += &format!("  s{s}: {{chain: a}}\n");
    }
    text += "routes:\n";
    for r in 0..n - 1 {
        let s = r % services;
        if r % 10 == 0 {
            text += &format!("  - {{host: h{r}.example.com, path_prefix: /, service: s{s}}}\n");
        } else {
            text += &format!("  - {{path_prefix: /s{s}/r{r}, service: s{s}}}\n");
        }
    }
    text += "  - {path_prefix: /ping, service: s0}\n";
    text
}

fn lookup(c: &mut Criterion) {
    let mut group = c.benchmark_group("route lookup");
    for n in [100, 1_000, 10_000, 50_000] {
        let loaded = LoadedConfig::parse(Path::new("p.yaml"), policy(n)).unwrap();
        let table = RouteTable::new(&loaded.config, |_| Some(0));
        assert_eq!(table.len(), n);
        assert_eq!(
            table.find("hotel", "/ping").unwrap().label.as_ref(),
            "*/ping"
        );
        group.bench_function(format!("{n} routes, last"), |b| {
            b.iter(|| {
                table
                    .find(black_box("hotel"), black_box("/ping"))
                    .map(|m| m.chain)
            })
        });
        let routes = &loaded.config.routes;
        group.bench_function(format!("{n} routes, scan, last"), |b| {
            b.iter(|| {
                let (host, path) = (black_box("hotel"), black_box("/ping"));
                routes.iter().position(|r| {
                    r.host
                        .as_deref()
                        .is_none_or(|h| h.eq_ignore_ascii_case(host))
                        && path.starts_with(&r.path_prefix)
                })
            })
        });
        let host = format!("h{}.example.com", (n / 2) / 10 * 10);
        assert!(table.find(&host, "/x").is_some());
        group.bench_function(format!("{n} routes, host"), |b| {
            b.iter(|| {
                table
                    .find(black_box(&host), black_box("/x"))
                    .map(|m| m.chain)
            })
        });
        group.bench_function(format!("{n} routes, miss"), |b| {
            b.iter(|| {
                table
                    .find(black_box("hotel"), black_box("/nowhere/at/all"))
                    .map(|m| m.chain)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, lookup);
criterion_main!(benches);

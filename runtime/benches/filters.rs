//! The built-in filters as Wasm components vs the same crates compiled natively (the
//! SDK's mock proxy), the full chain trace → jwt(HS256) → rbac → ratelimit →
//! circuit-breaker with p50/p99, and JWT verification through the crypto import vs
//! `jsonwebtoken` called directly — all in one run.
//!
//! `cargo bench -p dpumesh-runtime --bench filters`

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_main};
use dpumesh_filter_sdk::Filter;
use dpumesh_filter_sdk::mock::{MockProxy, MockRequest};
use dpumesh_runtime::{
    ChainRunner, FilterChain, FilterSettings, RequestHead, Runtime, RuntimeConfig,
};
use dpumesh_test_artifacts as artifacts;
use jsonwebtoken::{Algorithm, EncodingKey, Header, Validation};

const KEYS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/keys");
const SECRET: &[u8] = b"bench-hmac-secret-0123456789abcdef";

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{KEYS}/{name}")).unwrap()
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn token(alg: Algorithm, kid: Option<&str>, key: &EncodingKey) -> String {
    let mut header = Header::new(alg);
    header.kid = kid.map(str::to_owned);
    let claims = serde_json::json!({
        "iss": "https://issuer.example", "aud": "api", "sub": "alice",
        "roles": ["reader"], "iat": now(), "exp": now() + 3600
    });
    jsonwebtoken::encode(&header, &claims, key).unwrap()
}

fn jwt_config(algs: &[&str], key_set: &str, cache_entries: usize) -> String {
    serde_json::json!({
        "providers": {"p": {"issuer": "https://issuer.example", "audiences": ["api"],
            "algorithms": algs, "key_set": key_set}},
        "rules": [{"path_prefix": "/", "provider": "p"}],
        "cache_entries": cache_entries,
    })
    .to_string()
}

const RBAC: &str = r#"{"action": "ALLOW", "policies": [
  {"name": "admins", "permissions": [{"path": {"prefix": "/admin"}}], "principals": [{"claim": {"name": "roles", "contains": "admin"}}]},
  {"name": "readers", "permissions": [{"and": [{"method": "GET"}, {"path": {"prefix": "/api/"}}]}], "principals": [{"claim": {"name": "roles", "contains": "reader"}}]}
]}"#;
const RATELIMIT: &str = r#"{"descriptors": [{"name": "per-user", "entries": [{"claim": "sub"}], "bucket": {"max_tokens": 1000000000, "fill_interval_ms": 1000}}]}"#;
const BREAKER: &str = r#"{"consecutive_failures": 5}"#;
const TRACE: &str = "{}";

fn head(token: &str) -> RequestHead {
    let mut head = RequestHead::new("GET", "/api/v1/items");
    head.authority = "api.example.com".to_owned();
    head.destination = Some("items".to_owned());
    for (n, v) in [
        ("authorization", format!("Bearer {token}")),
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        ),
        (
            "x-request-id",
            "7b0e4c6a-1d3c-4c43-9d7e-6c1f5d1b2a90".to_owned(),
        ),
        ("user-agent", "wrk".to_owned()),
        ("accept", "*/*".to_owned()),
    ] {
        head.append_received(n, &v).unwrap();
    }
    // What the JWT filter leaves for RBAC and rate limit when they run alone.
    head.set_metadata("jwt.payload", r#"{"sub":"alice","roles":["reader"]}"#);
    head.set_metadata("jwt.claim.sub", "alice");
    head
}

struct Setup {
    rt: Runtime,
    host: MockProxy,
    hs_token: String,
    rs_token: String,
    es_token: String,
}

fn setup() -> Setup {
    let rt = Runtime::new(RuntimeConfig {
        max_instances: 64,
        ..RuntimeConfig::default()
    })
    .unwrap();
    let jwks = String::from_utf8(fixture("jwks.json")).unwrap();
    rt.keys()
        .insert("idp", dpumesh_keys::KeySet::from_jwks(&jwks).unwrap());
    rt.keys()
        .insert("shared", dpumesh_keys::KeySet::from_secret(None, SECRET));
    let host = MockProxy::new()
        .at_unix_secs(now())
        .with_jwks("idp", &jwks)
        .unwrap()
        .with_secret("shared", None, SECRET)
        .install();
    Setup {
        hs_token: token(Algorithm::HS256, None, &EncodingKey::from_secret(SECRET)),
        rs_token: token(
            Algorithm::RS256,
            Some("rsa-1"),
            &EncodingKey::from_rsa_pem(&fixture("rsa.pem")).unwrap(),
        ),
        es_token: token(
            Algorithm::ES256,
            Some("ec-p256"),
            &EncodingKey::from_ec_pem(&fixture("p256.pem")).unwrap(),
        ),
        rt,
        host,
    }
}

fn wasm(rt: &Runtime, name: &str, component: &str, config: &str) -> ChainRunner {
    let filter = rt
        .load_filter(
            FilterSettings::new(name, config).deadline(Duration::from_secs(1)),
            &artifacts::read(component),
        )
        .unwrap();
    ChainRunner::new(Arc::new(FilterChain::new(name, vec![filter])))
}

fn pair<F: Filter>(
    c: &mut Criterion,
    s: &Setup,
    name: &str,
    component: &str,
    config: &str,
    template: &RequestHead,
) {
    let mut group = c.benchmark_group(format!("filter/{name}"));
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    let mut native: F = s.host.configure(config).unwrap();
    group.bench_function("native", |b| {
        b.iter(|| {
            let req = MockRequest::from_head(template.clone());
            assert!(s.host.on_request(&mut native, &req).is_continue());
            req
        })
    });
    let mut runner = wasm(&s.rt, name, component, config);
    group.bench_function("wasm", |b| {
        b.iter(|| {
            let outcome = runner.on_request(template.clone());
            assert!(outcome.decision.reply().is_none(), "{:?}", outcome.decision);
            outcome
        })
    });
    group.finish();
}

fn filters(c: &mut Criterion) {
    let s = setup();
    let hs = head(&s.hs_token);
    let rs = head(&s.rs_token);
    let es = head(&s.es_token);
    pair::<dpumesh_filter_trace::Trace>(c, &s, "trace", artifacts::FILTER_TRACE, TRACE, &hs);
    pair::<dpumesh_filter_jwt::Jwt>(
        c,
        &s,
        "jwt_hs256_cached",
        artifacts::FILTER_JWT,
        &jwt_config(&["HS256"], "shared", 1000),
        &hs,
    );
    pair::<dpumesh_filter_jwt::Jwt>(
        c,
        &s,
        "jwt_hs256_uncached",
        artifacts::FILTER_JWT,
        &jwt_config(&["HS256"], "shared", 0),
        &hs,
    );
    pair::<dpumesh_filter_jwt::Jwt>(
        c,
        &s,
        "jwt_rs256_uncached",
        artifacts::FILTER_JWT,
        &jwt_config(&["RS256"], "idp", 0),
        &rs,
    );
    pair::<dpumesh_filter_jwt::Jwt>(
        c,
        &s,
        "jwt_rs256_cached",
        artifacts::FILTER_JWT,
        &jwt_config(&["RS256"], "idp", 1000),
        &rs,
    );
    pair::<dpumesh_filter_jwt::Jwt>(
        c,
        &s,
        "jwt_es256_uncached",
        artifacts::FILTER_JWT,
        &jwt_config(&["ES256"], "idp", 0),
        &es,
    );
    pair::<dpumesh_filter_rbac::Rbac>(c, &s, "rbac", artifacts::FILTER_RBAC, RBAC, &hs);
    pair::<dpumesh_filter_ratelimit::RateLimit>(
        c,
        &s,
        "ratelimit",
        artifacts::FILTER_RATELIMIT,
        RATELIMIT,
        &hs,
    );
    pair::<dpumesh_filter_circuit_breaker::CircuitBreaker>(
        c,
        &s,
        "circuit_breaker",
        artifacts::FILTER_CIRCUIT_BREAKER,
        BREAKER,
        &hs,
    );

    // The crypto crate called directly: full decode (parse, verify, validate claims).
    let mut group = c.benchmark_group("jwt_direct");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    let jwks: jsonwebtoken::jwk::JwkSet = serde_json::from_slice(&fixture("jwks.json")).unwrap();
    for (name, tok, alg, kid) in [
        ("rs256", &s.rs_token, Algorithm::RS256, "rsa-1"),
        ("es256", &s.es_token, Algorithm::ES256, "ec-p256"),
    ] {
        let key = jsonwebtoken::DecodingKey::from_jwk(jwks.find(kid).unwrap()).unwrap();
        let mut validation = Validation::new(alg);
        validation.set_audience(&["api"]);
        validation.set_issuer(&["https://issuer.example"]);
        group.bench_function(name, |b| {
            b.iter(|| jsonwebtoken::decode::<serde_json::Value>(tok, &key, &validation).unwrap())
        });
    }
    group.finish();
}

/// The full chain, timed per request for percentiles (criterion reports means).
fn full_chain(c: &mut Criterion) {
    let s = setup();
    let load = |name: &str, component: &str, config: &str| {
        s.rt.load_filter(
            FilterSettings::new(name, config).deadline(Duration::from_secs(1)),
            &artifacts::read(component),
        )
        .unwrap()
    };
    let chain = Arc::new(FilterChain::new(
        "full",
        vec![
            load("trace", artifacts::FILTER_TRACE, TRACE),
            load(
                "jwt",
                artifacts::FILTER_JWT,
                &jwt_config(&["HS256"], "shared", 1000),
            ),
            load("rbac", artifacts::FILTER_RBAC, RBAC),
            load("ratelimit", artifacts::FILTER_RATELIMIT, RATELIMIT),
            load("breaker", artifacts::FILTER_CIRCUIT_BREAKER, BREAKER),
        ],
    ));
    let started = Instant::now();
    let fused = Arc::new(
        FilterChain::new("full", chain.filters().to_vec())
            .fuse()
            .unwrap(),
    );
    println!(
        "full_chain fused: composed and compiled in {:?} (a hit of the compile cache when it is warm)",
        started.elapsed()
    );
    let mut runner = ChainRunner::new(chain);
    let mut fused_runner = ChainRunner::new(fused);
    let mut template = head(&s.hs_token);
    // In the chain, JWT sets these itself.
    template = {
        let mut h = RequestHead::new(&template.method, &template.path);
        h.authority = template.authority.clone();
        h.destination = template.destination.clone();
        h.set_headers(template.headers().clone());
        h
    };
    // The same five crates compiled natively, one after another on the mock proxy.
    let mut trace: dpumesh_filter_trace::Trace = s.host.configure(TRACE).unwrap();
    let mut jwt: dpumesh_filter_jwt::Jwt = s
        .host
        .configure(&jwt_config(&["HS256"], "shared", 1000))
        .unwrap();
    let mut rbac: dpumesh_filter_rbac::Rbac = s.host.configure(RBAC).unwrap();
    let mut ratelimit: dpumesh_filter_ratelimit::RateLimit = s.host.configure(RATELIMIT).unwrap();
    let mut breaker: dpumesh_filter_circuit_breaker::CircuitBreaker =
        s.host.configure(BREAKER).unwrap();
    let mut native = |head: RequestHead| {
        let req = MockRequest::from_head(head);
        let continues = s.host.on_request(&mut trace, &req).is_continue()
            && s.host.on_request(&mut jwt, &req).is_continue()
            && s.host.on_request(&mut rbac, &req).is_continue()
            && s.host.on_request(&mut ratelimit, &req).is_continue()
            && s.host.on_request(&mut breaker, &req).is_continue();
        (continues, req)
    };

    let mut group = c.benchmark_group("full_chain");
    group
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    group.bench_function("native", |b| {
        b.iter(|| {
            let (continues, req) = native(template.clone());
            assert!(continues);
            req
        })
    });
    group.bench_function("wasm", |b| {
        b.iter(|| {
            let outcome = runner.on_request(template.clone());
            assert!(outcome.decision.reply().is_none(), "{:?}", outcome.decision);
            outcome
        })
    });
    group.bench_function("wasm_fused", |b| {
        b.iter(|| {
            let outcome = fused_runner.on_request(template.clone());
            assert!(outcome.decision.reply().is_none(), "{:?}", outcome.decision);
            outcome
        })
    });
    group.finish();

    // Percentiles (head clones outside the timed part), Wasm and native requests
    // alternating so that drift of this shared machine hits both alike.
    let (wasm_samples, native_samples) = interleaved(
        20_000,
        &template,
        |head| runner.on_request(head),
        &mut native,
    );
    for (name, samples) in [("wasm", &wasm_samples), ("native", &native_samples)] {
        println!(
            "full_chain {name} percentiles over {} requests (one core, head clone excluded): p50 {:?}  p99 {:?}  p99.9 {:?}",
            samples.len(),
            pct(samples, 0.50),
            pct(samples, 0.99),
            pct(samples, 0.999)
        );
    }
    println!(
        "full_chain wasm/native: p50 {:.2}x  p99 {:.2}x",
        pct(&wasm_samples, 0.5).as_secs_f64() / pct(&native_samples, 0.5).as_secs_f64(),
        pct(&wasm_samples, 0.99).as_secs_f64() / pct(&native_samples, 0.99).as_secs_f64()
    );
    // The same five components fused into one (one entry per request).
    let (fused_samples, native_samples) = interleaved(
        20_000,
        &template,
        |head| {
            let outcome = fused_runner.on_request(head);
            assert!(outcome.decision.reply().is_none(), "{:?}", outcome.decision);
            outcome
        },
        &mut native,
    );
    println!(
        "full_chain fused: p50 {:?}  p99 {:?}  p99.9 {:?}; native p50 {:?}  p99 {:?}; fused/native: p50 {:.2}x  p99 {:.2}x",
        pct(&fused_samples, 0.5),
        pct(&fused_samples, 0.99),
        pct(&fused_samples, 0.999),
        pct(&native_samples, 0.5),
        pct(&native_samples, 0.99),
        pct(&fused_samples, 0.5).as_secs_f64() / pct(&native_samples, 0.5).as_secs_f64(),
        pct(&fused_samples, 0.99).as_secs_f64() / pct(&native_samples, 0.99).as_secs_f64()
    );

    // The floor of five components: five filters that do nothing (entry, exit, the
    // request line lowered), separate and fused, alternating with the real chain.
    let noop = |i: usize| load(&format!("noop-{i}"), artifacts::TEST_FILTER, "{}");
    let empty_chain = FilterChain::new("empty", (0..5).map(noop).collect());
    let mut empty_fused = ChainRunner::new(Arc::new(
        FilterChain::new("empty", empty_chain.filters().to_vec())
            .fuse()
            .unwrap(),
    ));
    let mut empty = ChainRunner::new(Arc::new(empty_chain));
    let mut group = c.benchmark_group("full_chain");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    group.bench_function("empty_separate", |b| {
        b.iter(|| empty.on_request(template.clone()))
    });
    group.bench_function("empty_fused", |b| {
        b.iter(|| empty_fused.on_request(template.clone()))
    });
    group.finish();
    let (empty_samples, chain_samples) = interleaved(
        20_000,
        &template,
        |head| empty.on_request(head),
        |head| runner.on_request(head),
    );
    let (e, w) = (pct(&empty_samples, 0.5), pct(&chain_samples, 0.5));
    println!(
        "full_chain five empty filters: p50 {e:?} against the chain's {w:?} ({:.0} %)",
        100.0 * e.as_secs_f64() / w.as_secs_f64()
    );
    let (separate, fused) = interleaved(
        20_000,
        &template,
        |head| empty.on_request(head),
        |head| empty_fused.on_request(head),
    );
    let (e, f) = (pct(&separate, 0.5), pct(&fused, 0.5));
    println!(
        "full_chain five empty filters, separate vs fused: p50 {e:?} vs {f:?} ({:.2}x; per filter {:?} vs {:?})",
        f.as_secs_f64() / e.as_secs_f64(),
        e / 5,
        f / 5
    );
}

/// Whether a report that is not a criterion benchmark (so criterion's filter does not
/// reach it) was asked for: no filter given, or one that is part of `name`.
fn wanted(name: &str) -> bool {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()))
}

/// Each filter of the chain alone, Wasm against native, alternating requests: where
/// the chain's extra time goes (the table in docs/benchmarks.md).
fn breakdown(_: &mut Criterion) {
    if !wanted("breakdown") {
        return;
    }
    let s = setup();
    let head = head(&s.hs_token);
    let jwt = jwt_config(&["HS256"], "shared", 1000);
    println!("per-filter p50 over 20000 alternating requests (one core, head clone excluded):");
    println!("  filter      wasm      native    extra     ratio");
    let row = |name: &str, wasm_p50: Duration, native_p50: Duration| {
        println!(
            "  {name:<10} {:>7.2}µs {:>7.2}µs {:>7.2}µs {:>6.2}x",
            wasm_p50.as_secs_f64() * 1e6,
            native_p50.as_secs_f64() * 1e6,
            (wasm_p50.as_secs_f64() - native_p50.as_secs_f64()) * 1e6,
            wasm_p50.as_secs_f64() / native_p50.as_secs_f64()
        );
    };
    macro_rules! measure {
        ($name:literal, $ty:ty, $component:expr, $config:expr) => {{
            let mut runner = wasm(&s.rt, $name, $component, $config);
            let mut native: $ty = s.host.configure($config).unwrap();
            let (w, n) = interleaved(
                20_000,
                &head,
                |h| runner.on_request(h),
                |h| {
                    let req = MockRequest::from_head(h);
                    let _ = s.host.on_request(&mut native, &req);
                    req
                },
            );
            row($name, pct(&w, 0.5), pct(&n, 0.5));
        }};
    }
    measure!(
        "trace",
        dpumesh_filter_trace::Trace,
        artifacts::FILTER_TRACE,
        TRACE
    );
    measure!("jwt", dpumesh_filter_jwt::Jwt, artifacts::FILTER_JWT, &jwt);
    measure!(
        "rbac",
        dpumesh_filter_rbac::Rbac,
        artifacts::FILTER_RBAC,
        RBAC
    );
    measure!(
        "ratelimit",
        dpumesh_filter_ratelimit::RateLimit,
        artifacts::FILTER_RATELIMIT,
        RATELIMIT
    );
    measure!(
        "breaker",
        dpumesh_filter_circuit_breaker::CircuitBreaker,
        artifacts::FILTER_CIRCUIT_BREAKER,
        BREAKER
    );
}

/// A verified payload as identity providers issue them (OIDC profile claims, groups,
/// an organization object): what RBAC and rate limit used to parse per request.
fn oidc_payload() -> String {
    serde_json::json!({
        "iss": "https://issuer.example", "aud": "api", "sub": "alice",
        "iat": now(), "exp": now() + 3600, "nbf": now(), "jti": "3f9a1c0e-77d2-4b1e-9c43-0a1d2b3c4d5e",
        "name": "Alice Example", "email": "alice@example.com", "email_verified": true,
        "roles": ["reader", "writer", "auditor"],
        "groups": ["eng", "platform", "oncall", "security-champions"],
        "scope": "openid profile email items.read items.write",
        "org": {"id": 4242, "name": "acme", "tier": "gold"}
    })
    .to_string()
}

/// Typed claims (WIT 0.1.2) against the same filters built for 0.1.1, which parse
/// `jwt.payload` themselves: each pair alternating on the same heads, p50s.
fn claims_ab(_: &mut Criterion) {
    if !wanted("claims_ab") {
        return;
    }
    let s = setup();
    let fixture = |name: &str| {
        std::fs::read(format!(
            "{}/../tests/fixtures/components/{name}-wit-0.1.1.wasm",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    };
    let runner = |name: &str, bytes: &[u8], config: &str| {
        let filter =
            s.rt.load_filter(
                FilterSettings::new(name, config).deadline(Duration::from_secs(1)),
                bytes,
            )
            .unwrap();
        ChainRunner::new(Arc::new(FilterChain::new(name, vec![filter])))
    };
    let mut small = head(&s.hs_token);
    let mut large = small.clone();
    large.set_metadata("jwt.payload", &oidc_payload());
    large.set_metadata("jwt.claim.sub", "alice");
    small.set_metadata("jwt.claim.sub", "alice");
    const NESTED: &str = r#"{"descriptors": [{"name": "per-org", "entries": [{"claim": "org.id"}], "bucket": {"max_tokens": 1000000000, "fill_interval_ms": 1000}}]}"#;
    println!("typed claims vs 0.1.1 (parse in the guest), p50 over 20000 alternating requests:");
    println!("  case                      0.1.1     0.1.2     new/old");
    let cases: [(&str, &str, &str, &RequestHead); 4] = [
        ("rbac, 2-claim payload", "rbac", RBAC, &small),
        ("rbac, OIDC payload", "rbac", RBAC, &large),
        ("ratelimit org.id, OIDC", "ratelimit", NESTED, &large),
        ("ratelimit sub (no parse)", "ratelimit", RATELIMIT, &large),
    ];
    for (label, filter, config, head) in cases {
        let current = match filter {
            "rbac" => artifacts::FILTER_RBAC,
            _ => artifacts::FILTER_RATELIMIT,
        };
        let mut old = runner(filter, &fixture(filter), config);
        let mut new = runner(filter, &artifacts::read(current), config);
        let (o, n) = interleaved(20_000, head, |h| old.on_request(h), |h| new.on_request(h));
        let (o, n) = (pct(&o, 0.5), pct(&n, 0.5));
        println!(
            "  {label:<24} {:>7.2}µs {:>7.2}µs {:>7.2}x",
            o.as_secs_f64() * 1e6,
            n.as_secs_f64() * 1e6,
            n.as_secs_f64() / o.as_secs_f64()
        );
    }
    // The whole chain, with jwt, rbac and ratelimit as built for 0.1.1 or now, a token
    // with the OIDC payload.
    let oidc: serde_json::Value = serde_json::from_str(&oidc_payload()).unwrap();
    let token = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &oidc,
        &EncodingKey::from_secret(SECRET),
    )
    .unwrap();
    let mut chain_head = RequestHead::new("GET", "/api/v1/items");
    chain_head.authority = "api.example.com".to_owned();
    chain_head.destination = Some("items".to_owned());
    chain_head.set_headers(head(&token).headers().clone());
    let jwt = jwt_config(&["HS256"], "shared", 1000);
    let chain = |old: bool| {
        let pick = |name: &str, current: &str| {
            if old {
                fixture(name)
            } else {
                artifacts::read(current)
            }
        };
        let load = |name: &str, bytes: Vec<u8>, config: &str| {
            s.rt.load_filter(
                FilterSettings::new(name, config).deadline(Duration::from_secs(1)),
                &bytes,
            )
            .unwrap()
        };
        ChainRunner::new(Arc::new(FilterChain::new(
            "full",
            vec![
                load("trace", artifacts::read(artifacts::FILTER_TRACE), TRACE),
                load("jwt", pick("jwt", artifacts::FILTER_JWT), &jwt),
                load("rbac", pick("rbac", artifacts::FILTER_RBAC), RBAC),
                load(
                    "ratelimit",
                    pick("ratelimit", artifacts::FILTER_RATELIMIT),
                    NESTED,
                ),
                load(
                    "breaker",
                    artifacts::read(artifacts::FILTER_CIRCUIT_BREAKER),
                    BREAKER,
                ),
            ],
        )))
    };
    let (mut old, mut new) = (chain(true), chain(false));
    let (o, n) = interleaved(
        20_000,
        &chain_head,
        |h| {
            let out = old.on_request(h);
            assert!(out.decision.reply().is_none(), "{:?}", out.decision);
            out
        },
        |h| {
            let out = new.on_request(h);
            assert!(out.decision.reply().is_none(), "{:?}", out.decision);
            out
        },
    );
    for (label, p) in [("p50", 0.5), ("p99", 0.99)] {
        let (o, n) = (pct(&o, p), pct(&n, p));
        println!(
            "  full chain (OIDC, org.id) {label} {:>7.2}µs {:>7.2}µs {:>7.2}x",
            o.as_secs_f64() * 1e6,
            n.as_secs_f64() * 1e6,
            n.as_secs_f64() / o.as_secs_f64()
        );
    }
}

/// `n` timed calls of `a` and of `b` on a copy of `head` (copied outside the timed
/// part), alternating; each set sorted.
fn interleaved<A, B>(
    n: usize,
    head: &RequestHead,
    mut a: impl FnMut(RequestHead) -> A,
    mut b: impl FnMut(RequestHead) -> B,
) -> (Vec<Duration>, Vec<Duration>) {
    let mut time_a = Vec::with_capacity(n);
    let mut time_b = Vec::with_capacity(n);
    for _ in 0..n {
        let copy = head.clone();
        let t = Instant::now();
        let out = a(copy);
        time_a.push(t.elapsed());
        drop(out);
        let copy = head.clone();
        let t = Instant::now();
        let out = b(copy);
        time_b.push(t.elapsed());
        drop(out);
    }
    time_a.sort();
    time_b.sort();
    (time_a, time_b)
}

fn pct(samples: &[Duration], p: f64) -> Duration {
    samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)]
}

#[allow(missing_docs, reason = "criterion-generated")]
mod group {
    use super::{breakdown, claims_ab, filters, full_chain};
    criterion::criterion_group!(benches, filters, full_chain, breakdown, claims_ab);
}
criterion_main!(group::benches);

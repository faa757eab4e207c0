//! WIT 0.1.2 next to 0.1.1: the built-in JWT, RBAC and rate limit as built for 0.1.1
//! (kept as built: that RBAC and rate limit parse `jwt.payload` themselves) load, and
//! every mix of old and current components in a chain decides exactly as the current
//! chain does — so typed claims changed no decision, and a node can take the new
//! filters one at a time.

use std::sync::Arc;
use std::time::Duration;

use dpumesh_runtime::{ChainRunner, Decision, FilterChain, FilterSettings, RequestHead, Runtime};
use dpumesh_test_artifacts as artifacts;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::json;

use crate::support::{get, runtime};

const SECRET: &[u8] = b"compat-hmac-secret-0123456789abcdef";

fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/../tests/fixtures/components/{name}-wit-0.1.1.wasm",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn token(claims: serde_json::Value) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut claims = claims;
    claims["iss"] = json!("https://issuer.example");
    claims["aud"] = json!("api");
    claims["exp"] = json!(now + 3600);
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(SECRET),
    )
    .unwrap()
}

fn configs() -> [String; 3] {
    let jwt = json!({
        "providers": {"p": {"issuer": "https://issuer.example", "audiences": ["api"],
            "algorithms": ["HS256"], "key_set": "shared",
            "claim_to_headers": [
                {"claim": "sub", "header": "x-sub"},
                {"claim": "org.name", "header": "x-org"},
                {"claim": "roles", "header": "x-roles"}
            ]}},
        "rules": [
            {"path_prefix": "/public", "provider": "p", "mode": "allow_missing"},
            {"path_prefix": "/", "provider": "p"}
        ]
    });
    let rbac = json!({"action": "ALLOW", "policies": [
        {"name": "admins", "permissions": [{"path": {"prefix": "/admin"}}],
         "principals": [{"claim": {"name": "roles", "contains": "admin"}}]},
        {"name": "readers", "permissions": [{"and": [{"method": "GET"}, {"path": {"prefix": "/api/"}}]}],
         "principals": [{"claim": {"name": "scope", "contains": "read"}}]},
        {"name": "acme", "permissions": [{"path": {"prefix": "/org"}}],
         "principals": [{"and": [
            {"claim": {"name": "org.name", "equals": "acme"}},
            {"claim": {"name": "tier", "in": ["gold", "silver"]}}]}]},
        {"name": "me", "permissions": [{"path": {"exact": "/me"}}],
         "principals": [{"authenticated": true}]},
        {"name": "public", "permissions": [{"path": {"prefix": "/public"}}],
         "principals": [{"not": {"authenticated": true}}]}
    ]});
    let ratelimit = json!({"descriptors": [
        {"name": "per-org", "entries": [{"claim": "org.id"}],
         "bucket": {"max_tokens": 2, "fill_interval_ms": 600000}},
        {"name": "per-user", "entries": [{"claim": "sub"}],
         "bucket": {"max_tokens": 4, "fill_interval_ms": 600000}}
    ]});
    [jwt.to_string(), rbac.to_string(), ratelimit.to_string()]
}

/// The requests, in order (the rate limit's buckets carry over between them).
fn requests() -> Vec<RequestHead> {
    let admin = token(json!({"sub": "ann", "roles": ["user", "admin"],
        "org": {"id": 1, "name": "acme"}, "tier": "gold"}));
    let reader = token(json!({"sub": "rob", "scope": "read write",
        "org": {"id": 2, "name": "other"}, "tier": "bronze"}));
    // An array with a number in it: RBAC's `contains` still finds the string item.
    let mixed = token(json!({"sub": "max", "roles": ["x", 1, "admin"], "org": {"id": "1"}}));
    let plain = token(json!({"sub": "pat"}));
    let with = |path: &str, method: &str, token: Option<&str>| {
        let mut head = get(path);
        head.method = method.to_owned();
        if let Some(t) = token {
            head.append_received("authorization", &format!("Bearer {t}"))
                .unwrap();
        }
        // A forged claim header must not survive JWT.
        head.append_received("x-org", "forged").unwrap();
        head
    };
    vec![
        with("/admin/x", "GET", Some(&admin)),
        with("/admin/x", "GET", Some(&reader)),
        with("/admin/x", "GET", Some(&mixed)),
        with("/api/items", "GET", Some(&reader)),
        with("/api/items", "POST", Some(&reader)),
        // RBAC allows it, but org 1 has spent its two tokens: ann, then max (whose
        // org id is the text "1", the same bucket key as the number 1).
        with("/org/1", "GET", Some(&admin)),
        with("/org/2", "GET", Some(&reader)),
        with("/me", "GET", Some(&plain)),
        with("/me", "GET", None),
        with("/public/x", "GET", None),
        with("/public/x", "GET", Some(&plain)),
        with("/admin/y", "GET", Some("not.a.token")),
        with("/admin/z", "GET", Some(&admin)),
        // pat's own bucket (4 tokens): these are his 2nd to 5th requests to reach
        // the rate limit (RBAC denied the one to /public first), so the last is 429.
        with("/me", "GET", Some(&plain)),
        with("/me", "GET", Some(&plain)),
        with("/me", "GET", Some(&plain)),
        with("/me", "GET", Some(&plain)),
    ]
}

/// What a client would see of one request: the status and the claim headers.
type Seen = (u16, Option<String>, Option<String>, Option<String>);

fn run(rt: &Runtime, mix: [bool; 3], namespace: &str) -> Vec<Seen> {
    let [jwt, rbac, ratelimit] = configs();
    let load = |name: &str, old: bool, current: &str, config: &str| {
        let bytes = if old {
            fixture(name)
        } else {
            artifacts::read(current)
        };
        rt.load_filter(
            FilterSettings::new(name, config)
                .namespace(namespace)
                .deadline(Duration::from_secs(1)),
            &bytes,
        )
        .unwrap_or_else(|e| panic!("{name} (0.1.1: {old}): {e}"))
    };
    let chain = FilterChain::new(
        "compat",
        vec![
            load("jwt", mix[0], artifacts::FILTER_JWT, &jwt),
            load("rbac", mix[1], artifacts::FILTER_RBAC, &rbac),
            load("ratelimit", mix[2], artifacts::FILTER_RATELIMIT, &ratelimit),
        ],
    );
    let mut runner = ChainRunner::new(Arc::new(chain));
    requests()
        .into_iter()
        .map(|head| {
            let outcome = runner.on_request(head);
            assert!(outcome.faults.is_empty(), "{mix:?}: {:?}", outcome.faults);
            let status = match &outcome.decision {
                Decision::Continue => 200,
                Decision::Deny { reply, .. } => reply.status,
                Decision::Pause { .. } => panic!("a component never pauses"),
            };
            let h = |name: &str| outcome.head.header(name);
            (status, h("x-sub"), h("x-org"), h("x-roles"))
        })
        .collect()
}

#[test]
fn every_mix_of_0_1_1_and_current_builtins_decides_alike() {
    let rt = runtime();
    rt.keys()
        .insert("shared", dpumesh_keys::KeySet::from_secret(None, SECRET));
    let current = run(&rt, [false; 3], "mix-current");
    let statuses: Vec<u16> = current.iter().map(|s| s.0).collect();
    assert_eq!(
        statuses,
        [
            200, 403, 200, 200, 403, 429, 403, 200, 401, 200, 403, 401, 429, 200, 200, 200, 429
        ],
        "{current:#?}"
    );
    assert_eq!(
        current[0],
        (
            200,
            Some("ann".into()),
            Some("acme".into()),
            Some(r#"["user","admin"]"#.into())
        )
    );
    assert_eq!(current[3].2, Some("other".into()));
    assert_eq!(current[7].2, None, "the forged x-org is removed");
    for (i, mix) in (1..8)
        .map(|bits: u8| [bits & 1 != 0, bits & 2 != 0, bits & 4 != 0])
        .enumerate()
    {
        let seen = run(&rt, mix, &format!("mix-{i}"));
        if !mix[0] {
            assert_eq!(seen, current, "jwt/rbac/ratelimit built for 0.1.1: {mix:?}");
            continue;
        }
        // The 0.1.1 JWT build leaves a client's header of a claim it maps on a request
        // it does not verify (the current build removes the headers it writes before
        // anything else): decisions and verified claims alike, that header aside.
        let without_org = |v: &[Seen]| -> Vec<(u16, Option<String>, Option<String>)> {
            v.iter()
                .map(|(status, sub, _, roles)| (*status, sub.clone(), roles.clone()))
                .collect()
        };
        assert_eq!(without_org(&seen), without_org(&current), "{mix:?}");
        for (old, new) in seen.iter().zip(&current) {
            assert!(
                old.2 == new.2 || (new.2.is_none() && old.2.as_deref() == Some("forged")),
                "{mix:?}: {old:?} against {new:?}"
            );
        }
    }
}

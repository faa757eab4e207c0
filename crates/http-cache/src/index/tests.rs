use super::*;
use crate::policy::Rule;

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (n, v) in pairs {
        h.append(
            HeaderName::from_bytes(n.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    h
}

fn t(s: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + s)
}

fn entry(response: &[(&str, &str)], request: &[(&str, &str)], key: &str, at: u64) -> Entry {
    let response = headers(response);
    let rule = Rule {
        max_object: 1 << 20,
        default_ttl: None,
    };
    let lifetime = policy::storable(&rule, "GET", &headers(request), 200, &response, 5).unwrap();
    Entry::new(
        200,
        &response,
        &headers(request),
        key.into(),
        5,
        lifetime,
        t(at),
        t(at),
    )
}

#[test]
fn fresh_then_stale_with_age() {
    let mut index = Index::new();
    let e = entry(
        &[("cache-control", "max-age=10"), ("age", "2")],
        &[],
        "b1",
        0,
    );
    assert!(index.insert("h/a", e).is_none());
    let req = HeaderMap::new();
    let Lookup::Fresh(found) = index.lookup("h/a", &req, t(5)) else {
        panic!()
    };
    assert_eq!(found.served_headers(t(5))["age"], "7");
    assert!(matches!(index.lookup("h/a", &req, t(8)), Lookup::Stale(_)));
    assert_eq!(index.lookup("h/b", &req, t(1)), Lookup::Miss);
    assert_eq!((index.len(), index.bytes()), (1, 5));
}

#[test]
fn variants_by_vary_values() {
    let mut index = Index::new();
    let vary = [("cache-control", "max-age=60"), ("vary", "accept-language")];
    index.insert("h/p", entry(&vary, &[("accept-language", "fr")], "fr", 0));
    index.insert("h/p", entry(&vary, &[("accept-language", "de")], "de", 0));
    let fr = headers(&[("accept-language", "fr")]);
    let Lookup::Fresh(e) = index.lookup("h/p", &fr, t(1)) else {
        panic!()
    };
    assert_eq!(e.body_key, "fr");
    let none = HeaderMap::new();
    assert_eq!(index.lookup("h/p", &none, t(1)), Lookup::Miss);
    // The same variant again replaces it.
    let replaced = index.insert("h/p", entry(&vary, &[("accept-language", "fr")], "fr2", 1));
    assert_eq!(replaced.unwrap().body_key, "fr");
    assert_eq!(index.len(), 2);
}

#[test]
fn request_directives_ask_for_revalidation_or_accept_staleness() {
    let mut index = Index::new();
    index.insert(
        "h/a",
        entry(&[("cache-control", "max-age=10")], &[], "b", 0),
    );
    let stale = |req: &[(&str, &str)], at| {
        matches!(index.lookup("h/a", &headers(req), t(at)), Lookup::Stale(_))
    };
    assert!(stale(&[("cache-control", "no-cache")], 1));
    assert!(stale(&[("cache-control", "max-age=0")], 1));
    assert!(stale(&[("cache-control", "min-fresh=9")], 2));
    assert!(!stale(&[("cache-control", "max-stale=5")], 12));
    assert!(stale(&[("cache-control", "max-stale=5")], 16));
    // must-revalidate: no staleness accepted.
    index.insert(
        "h/m",
        entry(
            &[("cache-control", "max-age=1, must-revalidate")],
            &[],
            "m",
            0,
        ),
    );
    assert!(matches!(
        index.lookup("h/m", &headers(&[("cache-control", "max-stale")]), t(5)),
        Lookup::Stale(_)
    ));
}

#[test]
fn a_304_refreshes_an_entry() {
    let rule = Rule {
        max_object: 100,
        default_ttl: None,
    };
    let e = entry(
        &[("cache-control", "max-age=10"), ("etag", "\"1\"")],
        &[],
        "b",
        0,
    );
    let r = e.refreshed(
        &rule,
        &headers(&[("cache-control", "max-age=30")]),
        t(20),
        t(20),
    );
    assert_eq!(r.lifetime, Duration::from_secs(30));
    assert_eq!(r.age(t(25)), Duration::from_secs(5));
    assert_eq!(r.body_key, "b");
    assert_eq!(r.headers["etag"], "\"1\"");
}

#[test]
fn invalidation_and_purge_by_prefix() {
    let mut index = Index::new();
    for k in ["h/a", "h/a/b", "h/b", "g/a"] {
        index.insert(k, entry(&[("cache-control", "max-age=10")], &[], k, 0));
    }
    assert_eq!(index.invalidate("h/b").len(), 1);
    let purged: Vec<String> = index
        .purge_prefix("h/a")
        .iter()
        .map(|e| e.body_key.clone())
        .collect();
    assert_eq!(purged, ["h/a", "h/a/b"]);
    assert_eq!(index.len(), 1);
    assert!(index.forget("g/a", "g/a"));
    assert!(index.is_empty());
    assert_eq!(index.bytes(), 0);
    assert_eq!(
        primary_key("Hotel:8000", "/x", Some("q=1")),
        "hotel:8000/x?q=1"
    );
}

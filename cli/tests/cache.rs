//! The DPU's HTTP response cache through `dpumesh up` (the hotel mesh, whose
//! `/catalog` route caches): hits answered by the node without reaching the service
//! (its own count proves it), misses, `no-store` and `private`, `Vary`, revalidation
//! with a 304 from the service, a client's conditional request answered 304 from the
//! cache, the chain before the cache, and purges through the admin API.

mod common;
use common::mesh::*;
use common::token;

fn get(mesh: &Mesh, path: &str, token: &str, extra: &str) -> Reply {
    mesh.raw(
        format!(
            "GET {path} HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {token}\r\n{extra}connection: close\r\n\r\n"
        )
        .as_bytes(),
    )
}

/// `/catalog` requests the frontend served.
fn served(mesh: &Mesh, token: &str) -> u64 {
    let (status, _, body) = get(mesh, "/catalog-count", token, "");
    assert_eq!(status, 200);
    String::from_utf8_lossy(&body).trim().parse().unwrap()
}

fn hit(headers: &[(String, String)]) -> bool {
    header(headers, "x-cache") == Some("HIT")
}

/// Waits until the response to `path` is cached (stored by the node's store workers
/// just after the first answer went back).
fn until_cached(mesh: &Mesh, path: &str, token: &str, extra: &str) -> Reply {
    for _ in 0..200 {
        let reply = get(mesh, path, token, extra);
        if hit(&reply.1) {
            return reply;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let (_, cache) = admin_get(mesh.admins()[0], "/cache");
    let (_, store) = admin_get(mesh.admins()[0], "/metrics");
    let store: String = store
        .lines()
        .filter(|l| l.contains("cache"))
        .collect::<Vec<_>>()
        .join("\n");
    panic!("{path} was never answered from the cache: {cache} {store}");
}

#[test]
fn the_node_answers_cacheable_responses_without_the_service() {
    let mesh = Mesh::up();
    let alice = token("alice", &["user"]);
    let node1 = mesh.admins()[0];

    // A miss: the service answers, and the node stores its response.
    let (status, headers, body) = get(&mesh, "/catalog?mode=fresh", &alice, "");
    assert_eq!(status, 200);
    assert!(!hit(&headers));
    let first = String::from_utf8_lossy(&body).into_owned();
    assert!(first.contains("catalog (fresh, en)"), "{first}");
    let (_, headers, body) = until_cached(&mesh, "/catalog?mode=fresh", &alice, "");
    // The stored body is the first answer's, or a later miss's if it came before the
    // store workers had written the first (each answer counts itself).
    let stored = String::from_utf8_lossy(&body).into_owned();
    assert!(
        stored.starts_with("catalog (fresh, en) served as #"),
        "the stored body: {stored} (first: {first})"
    );
    assert!(header(&headers, "age").is_some(), "{headers:?}");
    assert_eq!(header(&headers, "etag"), Some("\"catalog-v1\""));
    // Hits never reach the service: its count stays.
    let before = served(&mesh, &alice);
    for _ in 0..20 {
        let (status, headers, body) = get(&mesh, "/catalog?mode=fresh", &alice, "");
        assert_eq!((status, hit(&headers)), (200, true));
        assert_eq!(String::from_utf8_lossy(&body), stored);
    }
    assert_eq!(served(&mesh, &alice), before, "hits reached the service");
    // A client that holds the same version is told so by the node.
    let (status, headers, body) = get(
        &mesh,
        "/catalog?mode=fresh",
        &alice,
        "if-none-match: \"catalog-v1\"\r\n",
    );
    assert_eq!((status, body.len(), hit(&headers)), (304, 0, true));
    assert_eq!(served(&mesh, &alice), before);

    // The chain runs first: without a token, 401, cached or not.
    assert_eq!(mesh.get("/catalog?mode=fresh", None).0, 401);

    // no-store and private are never stored: each request reaches the service.
    for mode in ["nostore", "private"] {
        let before = served(&mesh, &alice);
        for _ in 0..3 {
            let (status, headers, _) = get(&mesh, &format!("/catalog?mode={mode}"), &alice, "");
            assert_eq!((status, hit(&headers)), (200, false), "{mode}");
        }
        assert_eq!(served(&mesh, &alice), before + 3, "{mode}");
    }

    // Vary: one stored response per language.
    let fr = "accept-language: fr\r\n";
    let de = "accept-language: de\r\n";
    get(&mesh, "/catalog?mode=vary", &alice, fr);
    let (_, _, body) = until_cached(&mesh, "/catalog?mode=vary", &alice, fr);
    assert!(String::from_utf8_lossy(&body).contains("(vary, fr)"));
    let (_, headers, body) = get(&mesh, "/catalog?mode=vary", &alice, de);
    assert!(!hit(&headers), "another language is another variant");
    assert!(String::from_utf8_lossy(&body).contains("(vary, de)"));
    let (_, _, body) = until_cached(&mesh, "/catalog?mode=vary", &alice, de);
    assert!(String::from_utf8_lossy(&body).contains("(vary, de)"));
    let (_, headers, body) = get(&mesh, "/catalog?mode=vary", &alice, fr);
    assert!(hit(&headers) && String::from_utf8_lossy(&body).contains("(vary, fr)"));

    // Revalidation: stored with max-age=0 and an ETag, so every use asks the service,
    // which answers 304; the node then serves its stored body.
    // As above, the stored body is the first miss's or, when the store workers had not
    // written it yet, a later miss's: whichever it is, every hit serves it again.
    get(&mesh, "/catalog?mode=revalidate", &alice, "");
    let (status, headers, body) = until_cached(&mesh, "/catalog?mode=revalidate", &alice, "");
    assert_eq!(status, 200);
    let stored = String::from_utf8_lossy(&body).into_owned();
    assert!(
        stored.starts_with("catalog (revalidate, en) served as #"),
        "{stored}"
    );
    assert!(header(&headers, "x-served").is_some());
    let before = served(&mesh, &alice);
    let (status, headers, body) = get(&mesh, "/catalog?mode=revalidate", &alice, "");
    assert_eq!((status, hit(&headers)), (200, true));
    assert_eq!(
        String::from_utf8_lossy(&body),
        stored,
        "the stored body, revalidated"
    );
    assert_eq!(
        served(&mesh, &alice),
        before + 1,
        "the service was asked (and said 304)"
    );
    let (_, body) = admin_get(node1, "/cache");
    let stats: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(stats["revalidated"].as_u64().unwrap() >= 2, "{body}");
    assert!(stats["hits"].as_u64().unwrap() >= 20, "{body}");
    assert!(stats["entries"].as_u64().unwrap() >= 4, "{body}");
    assert!(metric_sum(node1, "dpumesh_http_cache_hits_total") >= 20.0);

    // Purge by prefix through the admin API: the next request is a miss.
    let (status, removed) = admin_delete(
        node1,
        "/cache?prefix=hotel/catalog%3Fmode%3Dfresh",
        &mesh.admin_token(),
    );
    assert_eq!((status, removed.as_str()), (200, "{\"removed\":1}"));
    let before = served(&mesh, &alice);
    let (_, headers, _) = get(&mesh, "/catalog?mode=fresh", &alice, "");
    assert!(!hit(&headers));
    assert_eq!(served(&mesh, &alice), before + 1);
    // And by key.
    until_cached(&mesh, "/catalog?mode=fresh", &alice, "");
    let (status, removed) = admin_delete(
        node1,
        "/cache?key=hotel/catalog%3Fmode%3Dfresh",
        &mesh.admin_token(),
    );
    assert_eq!((status, removed.as_str()), (200, "{\"removed\":1}"));
    let (_, headers, _) = get(&mesh, "/catalog?mode=fresh", &alice, "");
    assert!(!hit(&headers));
}

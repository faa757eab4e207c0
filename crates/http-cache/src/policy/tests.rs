use super::*;
use test_case::test_case;

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

const RULE: Rule = Rule {
    max_object: 1000,
    default_ttl: None,
};

#[test_case(&[("cache-control", "max-age=60")], Ok(60); "max-age")]
#[test_case(&[("cache-control", "max-age=60, s-maxage=10")], Ok(10); "s-maxage wins for a shared cache")]
#[test_case(&[("cache-control", "no-store, max-age=60")], Err(NotStored::NoStore); "no-store")]
#[test_case(&[("cache-control", "private, max-age=60")], Err(NotStored::Private); "private")]
#[test_case(&[], Err(NotStored::NoFreshness); "no freshness")]
#[test_case(&[("cache-control", "max-age=60"), ("vary", "*")], Err(NotStored::VaryAny); "vary star")]
#[test_case(&[("cache-control", "max-age=60"), ("set-cookie", "a=b")], Err(NotStored::SetCookie); "cookie")]
#[test_case(&[("cache-control", "max-age=0")], Err(NotStored::NoValidator); "stale without validator")]
#[test_case(&[("cache-control", "max-age=0"), ("etag", "\"v1\"")], Ok(0); "stale with validator")]
#[test_case(&[("date", "Sun, 06 Nov 1994 08:49:37 GMT"), ("expires", "Sun, 06 Nov 1994 08:50:37 GMT")], Ok(60); "expires minus date")]
fn what_is_stored(response: &[(&str, &str)], want: Result<u64, NotStored>) {
    let got = storable(&RULE, "GET", &HeaderMap::new(), 200, &headers(response), 10);
    assert_eq!(got, want.map(Duration::from_secs));
}

#[test]
fn requests_and_statuses_that_are_not_stored() {
    let fresh = headers(&[("cache-control", "max-age=60")]);
    let get = HeaderMap::new();
    assert_eq!(
        storable(&RULE, "POST", &get, 200, &fresh, 1),
        Err(NotStored::Method)
    );
    let no_store = headers(&[("cache-control", "no-store")]);
    assert_eq!(
        storable(&RULE, "GET", &no_store, 200, &fresh, 1),
        Err(NotStored::RequestNoStore)
    );
    assert_eq!(
        storable(&RULE, "GET", &get, 206, &fresh, 1),
        Err(NotStored::Status(206))
    );
    assert_eq!(
        storable(&RULE, "GET", &get, 200, &fresh, 1001),
        Err(NotStored::TooLarge(1001))
    );
    // Credentials: only when the response says it may be shared.
    let auth = headers(&[("authorization", "Bearer x")]);
    assert_eq!(
        storable(&RULE, "GET", &auth, 200, &fresh, 1),
        Err(NotStored::Authorization)
    );
    let public = headers(&[("cache-control", "public, max-age=60")]);
    assert!(storable(&RULE, "GET", &auth, 200, &public, 1).is_ok());
    // A default TTL only for statuses cacheable by default.
    let rule = Rule {
        default_ttl: Some(Duration::from_secs(5)),
        ..RULE
    };
    assert_eq!(
        storable(&rule, "GET", &get, 200, &HeaderMap::new(), 1),
        Ok(Duration::from_secs(5))
    );
    assert_eq!(
        storable(&rule, "GET", &get, 500, &HeaderMap::new(), 1),
        Err(NotStored::NoFreshness)
    );
}

#[test]
fn conditional_requests_compare_etags_weakly_then_dates() {
    let stored = headers(&[
        ("etag", "W/\"v2\""),
        ("last-modified", "Sun, 06 Nov 1994 08:49:37 GMT"),
    ]);
    assert!(not_modified(
        &headers(&[("if-none-match", "\"v1\", \"v2\"")]),
        &stored
    ));
    assert!(not_modified(&headers(&[("if-none-match", "*")]), &stored));
    assert!(!not_modified(
        &headers(&[("if-none-match", "\"v3\"")]),
        &stored
    ));
    // If-None-Match decides alone when present.
    assert!(!not_modified(
        &headers(&[
            ("if-none-match", "\"v3\""),
            ("if-modified-since", "Sun, 06 Nov 1994 09:00:00 GMT")
        ]),
        &stored
    ));
    assert!(not_modified(
        &headers(&[("if-modified-since", "Sun, 06 Nov 1994 09:00:00 GMT")]),
        &stored
    ));
    assert!(!not_modified(
        &headers(&[("if-modified-since", "Sun, 06 Nov 1994 08:00:00 GMT")]),
        &stored
    ));
    assert!(!not_modified(&HeaderMap::new(), &stored));
}

#[test]
fn age_counts_the_age_header_the_trip_and_the_date() {
    let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
    let h = headers(&[("age", "30")]);
    assert_eq!(
        initial_age(&h, t0, t0 + Duration::from_secs(2)),
        Duration::from_secs(32)
    );
    let date = httpdate::fmt_http_date(t0);
    let h = headers(&[("date", &date)]);
    assert_eq!(
        initial_age(&h, t0, t0 + Duration::from_secs(100)),
        Duration::from_secs(100)
    );
}

#[test]
fn a_304_updates_the_stored_headers_but_not_the_framing() {
    let stored = headers(&[
        ("content-type", "text/plain"),
        ("cache-control", "max-age=1"),
        ("etag", "\"a\""),
        ("x-old", "1"),
    ]);
    let fresh = headers(&[
        ("cache-control", "max-age=99"),
        ("content-type", "x/y"),
        ("age", "3"),
    ]);
    let h = refreshed_headers(&stored, &fresh);
    assert_eq!(h["cache-control"], "max-age=99");
    assert_eq!(h["content-type"], "text/plain");
    assert_eq!(h["x-old"], "1");
    assert!(!h.contains_key("age"));
    let nm = not_modified_headers(&h);
    assert!(nm.contains_key("etag") && !nm.contains_key("content-type"));
}

#[test]
fn vary_names_and_values() {
    let r = headers(&[
        ("vary", "Accept-Language, accept-encoding"),
        ("vary", "accept-language"),
    ]);
    let names = vary_names(&r).unwrap();
    assert_eq!(names, ["accept-language", "accept-encoding"]);
    let req = headers(&[("accept-language", "fr"), ("accept-language", " de ")]);
    assert_eq!(vary_values(&req, &names), [Some("fr, de".to_owned()), None]);
}

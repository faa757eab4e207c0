use super::*;

fn n(path: &str) -> Result<String, PathError> {
    normalize(path, &PathConfig::default()).map(Cow::into_owned)
}

#[test]
fn bypass_vectors_become_the_path_a_backend_would_serve() {
    for (input, want) in [
        ("/ping/../admin", "/admin"),
        ("/ping/./../admin", "/admin"),
        ("/%61dmin", "/admin"),
        ("/%2e%2e/admin", "/admin"),
        ("/ping/%2E%2E/admin", "/admin"),
        ("//admin", "/admin"),
        ("/./admin", "/admin"),
        ("/admin/.", "/admin/"),
        ("/a/b/..", "/a/"),
        ("/../../admin", "/admin"),
        ("/a//../admin", "/admin"),
        ("/%7Euser/%41", "/~user/A"),
        ("/caf%c3%a9", "/caf%C3%A9"),
        ("/100%25", "/100%25"),
        ("/100%25x", "/100%25x"),
    ] {
        assert_eq!(n(input).as_deref(), Ok(want), "{input}");
        // Canonical: normalizing again changes nothing.
        assert_eq!(n(want).as_deref(), Ok(want), "{want} again");
    }
}

#[test]
fn clean_paths_are_borrowed_asterisk_kept_and_others_refused() {
    let c = PathConfig::default();
    assert!(matches!(normalize("/hotels/7", &c), Ok(Cow::Borrowed(_))));
    assert!(matches!(normalize("/a.b/..c", &c), Ok(Cow::Borrowed(_))));
    assert_eq!(normalize("*", &c).unwrap(), "*");
    // HTTP/2's `:path: admin`: no slash for a `/` rule to match, one a service adds.
    for p in ["admin", "", "ping/../admin", "http://x/"] {
        assert_eq!(normalize(p, &c), Err(PathError::NotOriginForm), "{p:?}");
    }
}

#[test]
fn bad_escapes_and_escaped_slashes_are_refused_by_default() {
    assert_eq!(n("/a%2"), Err(PathError::InvalidEscape { at: 2 }));
    assert_eq!(n("/a%zz"), Err(PathError::InvalidEscape { at: 2 }));
    assert_eq!(n("/%"), Err(PathError::InvalidEscape { at: 1 }));
    assert_eq!(n("/admin%00"), Err(PathError::ControlByte { byte: 0 }));
    assert_eq!(n("/a%0d%0a"), Err(PathError::ControlByte { byte: 0x0d }));
    // Raw ones never pass either (a pod's head is not parsed by hyper).
    assert_eq!(
        n("/a\x12b"),
        Err(PathError::RawControl { at: 2, byte: 0x12 })
    );
    assert_eq!(n("/a b"), Err(PathError::RawControl { at: 2, byte: b' ' }));
    for v in ["/admin%2Fx", "/admin%2fx", "/admin%5Cx", "/admin%5cx"] {
        assert!(
            matches!(n(v), Err(PathError::EscapedSlash { .. })),
            "{v}: {:?}",
            n(v)
        );
    }
}

#[test]
fn paths_backends_read_another_way_are_refused_by_default() {
    // Tomcat's `..;`, IIS's backslash, a double decoder's `%252e`.
    assert_eq!(n("/ping/..;/admin"), Err(PathError::Semicolon { at: 8 }));
    assert_eq!(n("/a;jsessionid=1"), Err(PathError::Semicolon { at: 2 }));
    assert_eq!(n("/ping\\..\\admin"), Err(PathError::Backslash { at: 5 }));
    assert_eq!(
        n("/%252e%252e/admin"),
        Err(PathError::DoubleEscape { at: 1 })
    );
    assert_eq!(n("/a/%252F"), Err(PathError::DoubleEscape { at: 3 }));
    // The digits after `%25` may themselves be escaped: `%25%32%65` decodes once to
    // `%2e` (found by the `path` fuzz target: normalizing made `%252e` of it).
    assert_eq!(
        n("/%25%32%65%25%32%65/admin"),
        Err(PathError::DoubleEscape { at: 1 })
    );
    assert_eq!(n("/%25%66f"), Err(PathError::DoubleEscape { at: 1 }));
    assert_eq!(
        n("/%25%2F"),
        Err(PathError::EscapedSlash {
            escape: "%2F".into()
        })
    );
    // `%25` before anything but two hex digits is a plain percent sign.
    assert_eq!(n("/50%25off").as_deref(), Ok("/50%25off"));
}

#[test]
fn each_refusal_has_its_option() {
    let c = PathConfig {
        semicolons: Semicolons::Keep,
        backslashes: Backslashes::Keep,
        double_escapes: DoubleEscapes::Keep,
        ..PathConfig::default()
    };
    assert_eq!(normalize("/a;v=1/b", &c).unwrap(), "/a;v=1/b");
    assert_eq!(normalize("/a\\b", &c).unwrap(), "/a\\b");
    assert_eq!(normalize("/%252e", &c).unwrap(), "/%252e");
    let slash = PathConfig {
        backslashes: Backslashes::Slash,
        ..PathConfig::default()
    };
    assert_eq!(normalize("/ping\\..\\admin", &slash).unwrap(), "/admin");
    assert_eq!(normalize("\\admin", &slash), Err(PathError::NotOriginForm));
}

#[test]
fn the_escaped_slash_action_and_each_step_follow_the_config() {
    let with = |escaped_slashes, normalize_on, merge| PathConfig {
        normalize: normalize_on,
        merge_slashes: merge,
        escaped_slashes,
        ..PathConfig::default()
    };
    let unescape = with(EscapedSlashes::Unescape, true, true);
    assert_eq!(
        normalize("/ping%2F..%2Fadmin", &unescape).unwrap(),
        "/admin"
    );
    assert_eq!(normalize("/a%5Cb", &unescape).unwrap(), "/a/b");
    let keep = with(EscapedSlashes::Keep, true, true);
    assert_eq!(normalize("/a%2fb", &keep).unwrap(), "/a%2Fb");
    let no_merge = with(EscapedSlashes::Reject, true, false);
    assert_eq!(normalize("/a//b/../c", &no_merge).unwrap(), "/a//c");
    let raw = with(EscapedSlashes::Reject, false, false);
    assert_eq!(normalize("/a/../%61", &raw).unwrap(), "/a/../%61");
    assert!(
        normalize("/a%2", &raw).is_err(),
        "bad escapes are always refused"
    );
}

#[test]
fn the_config_reads_its_keys_and_refuses_unknown_ones() {
    let c: PathConfig = serde_json::from_str(
        r#"{"semicolons": "keep", "backslashes": "slash", "double_escapes": "keep"}"#,
    )
    .unwrap();
    assert_eq!(c.semicolons, Semicolons::Keep);
    assert_eq!(c.backslashes, Backslashes::Slash);
    assert_eq!(c.double_escapes, DoubleEscapes::Keep);
    assert!(
        c.normalize && c.merge_slashes,
        "the rest keeps its defaults"
    );
    assert!(serde_json::from_str::<PathConfig>(r#"{"semicolon": "keep"}"#).is_err());
}

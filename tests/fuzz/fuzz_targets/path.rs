//! Request paths as the mesh normalizes them: never a panic; what comes out starts
//! with `/`, is canonical (normalizing it again changes nothing) and, with every step
//! on, has no dot segment, no `//` and no escaped unreserved character.
#![no_main]

use dpumesh_head::path::{
    Backslashes, DoubleEscapes, EscapedSlashes, PathConfig, Semicolons, normalize,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&knobs, rest)) = data.split_first() else {
        return;
    };
    let Some((&more, rest)) = rest.split_first() else {
        return;
    };
    let Ok(path) = std::str::from_utf8(rest) else {
        return;
    };
    let config = PathConfig {
        normalize: knobs & 1 != 0,
        merge_slashes: knobs & 2 != 0,
        escaped_slashes: match (knobs >> 2) % 3 {
            0 => EscapedSlashes::Reject,
            1 => EscapedSlashes::Keep,
            _ => EscapedSlashes::Unescape,
        },
        semicolons: if more & 1 == 0 {
            Semicolons::Reject
        } else {
            Semicolons::Keep
        },
        backslashes: match (more >> 1) % 3 {
            0 => Backslashes::Reject,
            1 => Backslashes::Keep,
            _ => Backslashes::Slash,
        },
        double_escapes: if more & 8 == 0 {
            DoubleEscapes::Reject
        } else {
            DoubleEscapes::Keep
        },
    };
    let Ok(out) = normalize(path, &config) else {
        assert!(path != "*");
        return;
    };
    if path == "*" {
        assert_eq!(out, "*");
        return;
    }
    assert!(out.starts_with('/'), "{path:?} -> {out:?}");
    if config.normalize && config.merge_slashes {
        assert_eq!(
            normalize(&out, &config).unwrap(),
            out,
            "canonical: {path:?}"
        );
        assert!(!out.contains("//"), "{path:?} -> {out:?}");
        assert!(
            !out.split('/').any(|s| s == "." || s == ".."),
            "{path:?} -> {out:?}"
        );
        let escapes = out.match_indices('%').map(|(i, _)| &out[i + 1..i + 3]);
        for hex in escapes {
            let b = u8::from_str_radix(hex, 16).unwrap();
            assert!(
                !(b.is_ascii_alphanumeric() || b"-._~".contains(&b)),
                "{path:?} -> {out:?}"
            );
        }
    }
});

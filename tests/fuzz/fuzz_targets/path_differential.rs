//! The mesh's path normalizer against an independent RFC 3986 §6 normalizer
//! (iri-string): for every ASCII origin-form path both accept, with the mesh's
//! refusals and slash merging off, both must produce the same path. A difference is
//! a path the proxy reads one way and an RFC-following backend another.
#![no_main]

use dpumesh_head::path::{
    Backslashes, DoubleEscapes, EscapedSlashes, PathConfig, Semicolons, normalize,
};
use iri_string::types::UriStr;
use libfuzzer_sys::fuzz_target;

/// Only RFC 3986 §6 steps: nothing refused that the RFC allows, no `//` merging
/// (which the RFC does not do).
const RFC: PathConfig = PathConfig {
    normalize: true,
    merge_slashes: false,
    escaped_slashes: EscapedSlashes::Keep,
    semicolons: Semicolons::Keep,
    backslashes: Backslashes::Reject,
    double_escapes: DoubleEscapes::Keep,
};

fuzz_target!(|data: &[u8]| {
    let Ok(path) = std::str::from_utf8(data) else {
        return;
    };
    // The head carries the path without its query; a URI path has no '?' or '#'.
    if !path.starts_with('/') || path.contains(['?', '#']) {
        return;
    }
    let uri = format!("http://h{path}");
    let Ok(reference) = UriStr::new(&uri) else {
        // Not a URI path (a raw space, a non-ASCII byte, a bad escape...): the
        // reference has no opinion.
        return;
    };
    let Ok(ours) = normalize(path, &RFC) else {
        // The mesh refuses decoded control bytes, which RFC 3986 allows.
        return;
    };
    let theirs = reference.normalize().to_string();
    let theirs = theirs.strip_prefix("http://h").expect("same authority");
    assert_eq!(ours, theirs, "{path:?}");
});

//! Bearer tokens as the JWT filter parses them (segments, base64url, JSON header and
//! claims): any string is a token or a typed error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = dpumesh_filter_jwt::token::parse(text);
    }
});

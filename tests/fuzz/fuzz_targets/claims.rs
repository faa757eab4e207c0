//! Verified-claims payloads (any JSON text a filter may leave in `jwt.payload`) read
//! by arbitrary claim paths, as the proxy does for `request-head.claims`: no panic, a
//! string claim renders as itself, the cache answers as a fresh parse does.
#![no_main]

use dpumesh_claims::{Claim, Claims, ParsedClaims};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (String, Vec<String>)| {
    let (payload, paths) = input;
    let parsed = Claims::parse(&payload);
    let mut cache = ParsedClaims::new();
    let cached = cache.get(&payload);
    assert_eq!(parsed.is_some(), cached.is_some());
    let (Some(parsed), Some(cached)) = (parsed, cached) else {
        return;
    };
    let claims = parsed.claims(&paths);
    assert_eq!(claims, cached.claims(&paths));
    for claim in claims.into_iter().flatten() {
        let text = claim.render();
        if let Claim::Text(s) = &claim {
            assert_eq!(text, s.as_str());
        }
    }
});

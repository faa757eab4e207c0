//! JWKS documents: any input is a key set or a typed error, never a panic; a loaded
//! set verifies garbage as an error, never a panic.
#![no_main]

use dpumesh_keys::{Algorithm, KeySet};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(set) = KeySet::from_jwks(text) {
        for alg in Algorithm::ALL {
            let _ = set.verify(alg, None, data, data);
        }
    }
});

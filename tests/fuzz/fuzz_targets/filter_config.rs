//! Filter configuration strings: parsed into a config or refused with a message.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = dpumesh_filter_sdk::configure::<dpumesh_sample_guard::Guard>(text);
});

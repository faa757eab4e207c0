//! Proxy config files: parsed and checked, or refused with an error naming a place.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = std::path::Path::new("proxy.yaml");
    if let Err(e) = dpumesh_config::LoadedConfig::parse(path, text.to_owned()) {
        let _ = e.to_string();
    }
    let _ = dpumesh_config::error::locate(text, "filters.a.config[2].b");
});

//! Component bytes: anything is loaded or refused with a typed error, never a panic.
#![no_main]

use std::sync::OnceLock;

use dpumesh_runtime::{FilterSettings, Runtime, RuntimeConfig};
use libfuzzer_sys::fuzz_target;

fn runtime() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        Runtime::new(RuntimeConfig {
            cache_dir: None,
            max_instances: 4,
            ..RuntimeConfig::default()
        })
        .expect("runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    let _ = runtime().load_filter(FilterSettings::new("fuzz", ""), data);
});

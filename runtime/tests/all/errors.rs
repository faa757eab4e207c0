//! Load errors: wrong package version or world, missing or mistyped exports, bad
//! bytes, rejected configuration, and the compile cache.

use std::time::Duration;

use dpumesh_runtime::{FaultKind, FilterSettings, LoadError, Runtime, RuntimeConfig};
use dpumesh_test_artifacts as artifacts;
use serde_json::json;

use crate::support::{runtime, settings};

fn load_wat(rt: &Runtime, wat: &str) -> LoadError {
    let bytes = wat::parse_str(wat).expect("valid WAT");
    rt.load_filter(FilterSettings::new("w", ""), &bytes)
        .expect_err("must be refused")
}

#[test]
fn a_component_for_another_package_version_is_refused_naming_both_versions() {
    let err = load_wat(
        &runtime(),
        r#"(component
            (import "dpumesh:filter/log@0.2.0" (instance
                (export "log" (func (param "message" string)))))
        )"#,
    );
    assert!(matches!(err, LoadError::WrongVersion { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("dpumesh:filter/log@0.2.0"), "{msg}");
    let serves = format!("serves dpumesh:filter@{}", dpumesh_runtime::WIT_VERSION);
    assert!(msg.contains(&serves), "{msg}");
}

#[test]
fn a_component_for_another_world_is_refused_naming_the_import() {
    let err = load_wat(
        &runtime(),
        r#"(component
            (import "acme:proxy/host@1.0.0" (instance
                (export "ping" (func))))
        )"#,
    );
    assert!(matches!(err, LoadError::UnknownImport { .. }), "{err:?}");
    assert!(err.to_string().contains("acme:proxy/host@1.0.0"));
}

#[test]
fn a_missing_on_request_export_is_named() {
    let err = load_wat(&runtime(), "(component)");
    assert!(
        matches!(
            err,
            LoadError::MissingExport {
                export: "on-request",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_mistyped_export_is_named() {
    let err = load_wat(
        &runtime(),
        r#"(component
            (core module $m (func (export "f")))
            (core instance $i (instantiate $m))
            (func $f (canon lift (core func $i "f")))
            (export "on-request" (func $f))
        )"#,
    );
    assert!(
        matches!(
            err,
            LoadError::ExportType {
                export: "on-request",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn core_modules_and_garbage_are_not_components() {
    let rt = runtime();
    let core = wat::parse_str("(module)").unwrap();
    let err = rt
        .load_filter(FilterSettings::new("core", ""), &core)
        .unwrap_err();
    assert!(err.to_string().contains("core Wasm module"), "{err}");
    let err = rt
        .load_filter(FilterSettings::new("junk", ""), b"not wasm at all")
        .unwrap_err();
    assert!(matches!(err, LoadError::NotAComponent { .. }), "{err:?}");
    assert!(err.to_string().contains("filter junk"), "{err}");
}

#[test]
fn a_rejected_configuration_carries_the_filters_message() {
    let rt = runtime();
    let err = rt
        .load_filter(
            settings("picky", json!({"reject": "max_age must be positive"})),
            &artifacts::read(artifacts::TEST_FILTER),
        )
        .unwrap_err();
    assert!(matches!(err, LoadError::Configure { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "filter picky: configuration rejected: max_age must be positive"
    );
    let err = rt
        .load_filter(
            FilterSettings::new("guard", r#"{"rulez": []}"#).deadline(Duration::from_secs(2)),
            &artifacts::read(artifacts::SAMPLE_GUARD),
        )
        .unwrap_err();
    assert!(err.to_string().contains("unknown field `rulez`"), "{err}");
    let err = rt
        .load_filter(
            FilterSettings::new("guard", "{not json"),
            &artifacts::read(artifacts::SAMPLE_GUARD),
        )
        .unwrap_err();
    assert!(err.to_string().contains("invalid config"), "{err}");
}

#[test]
fn a_configure_that_never_returns_is_interrupted() {
    let rt = runtime();
    let mut s = settings("slow", json!({"spin_in_configure": true}));
    s.configure_deadline = Duration::from_millis(50);
    let err = rt
        .load_filter(s, &artifacts::read(artifacts::TEST_FILTER))
        .unwrap_err();
    assert!(
        matches!(
            &err,
            LoadError::ConfigureFault {
                fault: FaultKind::Deadline(_),
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_memory_cap_above_the_runtime_maximum_is_refused() {
    let rt = runtime();
    let s = settings("big", json!({})).memory_cap(1 << 40);
    let err = rt
        .load_filter(s, &artifacts::read(artifacts::TEST_FILTER))
        .unwrap_err();
    assert!(
        err.to_string().contains("exceeds the runtime maximum"),
        "{err}"
    );
}

#[test]
fn compiled_artifacts_are_cached_on_disk_and_bad_ones_are_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let new_runtime = || {
        Runtime::new(RuntimeConfig {
            cache_dir: Some(dir.path().to_owned()),
            max_instances: 8,
            ..RuntimeConfig::default()
        })
        .unwrap()
    };
    let bytes = artifacts::read(artifacts::SAMPLE_GUARD);
    new_runtime()
        .load_filter(FilterSettings::new("guard", ""), &bytes)
        .unwrap();
    let mut artifacts: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    // The component and, since it runs as a core instance, its core module.
    artifacts.sort_by_key(|p| p.to_string_lossy().contains("-core-"));
    assert_eq!(artifacts.len(), 2, "{artifacts:?}");
    assert!(artifacts.iter().all(|p| p.extension().unwrap() == "cwasm"));
    assert!(
        artifacts[1].to_string_lossy().contains("-core-"),
        "{artifacts:?}"
    );
    // A fresh runtime loads from the artifact; a corrupt artifact is discarded and
    // the component recompiled.
    new_runtime()
        .load_filter(FilterSettings::new("guard", ""), &bytes)
        .unwrap();
    std::fs::write(&artifacts[0], b"garbage").unwrap();
    let loaded = new_runtime()
        .load_filter(FilterSettings::new("guard", ""), &bytes)
        .unwrap();
    assert_eq!(loaded.version_hash().len(), 64);
    assert_ne!(std::fs::read(&artifacts[0]).unwrap(), b"garbage");
}

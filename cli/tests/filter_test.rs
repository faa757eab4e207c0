//! `dpumesh filter test` as a user runs it: the built-in filters pass their suites
//! through the command, a wrong implementation fails with a readable diff and a failing
//! exit code, and `--json` reports the same totals.

use std::path::PathBuf;
use std::process::{Command, Output};

use dpumesh_test_artifacts as artifacts;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn dpumesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dpumesh"))
        .args(args)
        .current_dir(workspace())
        // A private compile cache, so tests never share one with a user's.
        .env(
            "DPUMESH_CACHE_DIR",
            PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli-cwasm"),
        )
        .output()
        .expect("run dpumesh")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn the_built_in_filters_pass_their_suites_through_the_cli() {
    for (name, component) in artifacts::BUILTIN_FILTERS {
        let suites = format!("tests/conformance/{name}");
        let output = dpumesh(&["filter", "test", component, &suites]);
        let out = stdout(&output);
        assert!(
            output.status.success(),
            "{name}:\n{out}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let total = out.lines().last().unwrap_or_default();
        assert!(total.ends_with(" passed, 0 failed"), "{name}: {total}");
        let passed: usize = total
            .trim_start_matches("total: ")
            .split(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(passed >= 25, "{name}: only {passed} cases");
    }
}

#[test]
fn a_wrong_implementation_fails_with_a_readable_diff() {
    // The test filter does nothing by default: every trace expectation is missed.
    let output = dpumesh(&[
        "filter",
        "test",
        artifacts::TEST_FILTER,
        "tests/conformance/trace/defaults.yaml",
    ]);
    let out = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{out}");
    assert!(out.contains("... FAILED"), "{out}");
    assert!(
        out.contains("request header x-request-id: expected 36 characters, got (absent)"),
        "{out}"
    );
    let last = out.lines().last().unwrap();
    assert!(
        last.contains(" passed, ") && !last.ends_with(" 0 failed"),
        "{last}"
    );
}

#[test]
fn json_output_carries_the_same_totals() {
    let output = dpumesh(&[
        "filter",
        "test",
        "--json",
        artifacts::TEST_FILTER,
        "tests/conformance/trace/defaults.yaml",
    ]);
    assert_eq!(output.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let cases = report["suites"][0]["cases"].as_array().unwrap();
    let failed = cases
        .iter()
        .filter(|c| !c["failures"].as_array().unwrap().is_empty())
        .count();
    assert_eq!(report["failed"], failed);
    assert_eq!(report["passed"], cases.len() - failed);
    assert!(failed > 0);
}

#[test]
fn missing_files_are_named() {
    let output = dpumesh(&["filter", "test", "nope.wasm", "tests/conformance/trace"]);
    assert!(!output.status.success());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(err.contains("nope.wasm"), "{err}");

    let output = dpumesh(&[
        "filter",
        "test",
        artifacts::FILTER_TRACE,
        "no-such-suite.yaml",
    ]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stdout(&output).contains("no-such-suite.yaml"),
        "{}",
        stdout(&output)
    );
}

#[test]
fn the_rust_sample_passes_the_shared_policy_suite() {
    let output = dpumesh(&[
        "filter",
        "test",
        artifacts::SAMPLE_APIKEY,
        "samples/filters/apikey.suite.yaml",
    ]);
    let out = stdout(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.ends_with("8 passed, 0 failed\n"), "{out}");
}

#[test]
fn new_build_test_works_end_to_end_for_rust() {
    let dir = tempfile::tempdir().unwrap();
    let parent = dir.path().to_str().unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dpumesh"))
            .args(args)
            .current_dir(dir.path())
            // Shared across runs so the SDK's dependencies are compiled once.
            .env(
                "CARGO_TARGET_DIR",
                workspace().join("target/filter-projects"),
            )
            .env(
                "DPUMESH_CACHE_DIR",
                PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli-cwasm"),
            )
            .output()
            .expect("run dpumesh")
    };
    let created = run(&[
        "filter",
        "new",
        "edge-auth",
        "--lang",
        "rust",
        "--dir",
        parent,
    ]);
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    for file in ["Cargo.toml", "src/lib.rs", "suite.yaml", "README.md"] {
        assert!(dir.path().join("edge-auth").join(file).is_file(), "{file}");
    }

    let built = run(&["filter", "build", "edge-auth"]);
    assert!(
        built.status.success(),
        "{}{}",
        stdout(&built),
        String::from_utf8_lossy(&built.stderr)
    );
    let component = dir.path().join("edge-auth/build/edge-auth.wasm");
    assert!(component.is_file());
    assert!(dir.path().join("edge-auth/build/edge-auth.cwasm").is_file());

    let tested = run(&[
        "filter",
        "test",
        component.to_str().unwrap(),
        "edge-auth/suite.yaml",
    ]);
    let out = stdout(&tested);
    assert!(tested.status.success(), "{out}");
    assert!(out.starts_with("suite edge-auth\n"), "{out}");
    assert!(out.ends_with("8 passed, 0 failed\n"), "{out}");

    // Scaffolding over an existing project, bad names and non-projects are refused.
    let again = run(&["filter", "new", "edge-auth", "--dir", parent]);
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    let bad = run(&["filter", "new", "Bad Name", "--dir", parent]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a valid filter name"));
    let none = run(&["filter", "build", "."]);
    assert!(String::from_utf8_lossy(&none.stderr).contains("is not a filter project"));
}

/// `filter new` → `filter build` → `filter test` for a language whose toolchain the
/// install script provides.
fn end_to_end(lang: &str) {
    let dir = tempfile::tempdir().unwrap();
    let parent = dir.path().to_str().unwrap();
    let name = format!("{lang}-auth");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dpumesh"))
            .args(args)
            .current_dir(dir.path())
            .env(
                "DPUMESH_CACHE_DIR",
                PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli-cwasm"),
            )
            .output()
            .expect("run dpumesh")
    };
    let created = run(&["filter", "new", &name, "--lang", lang, "--dir", parent]);
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let built = run(&["filter", "build", &name]);
    assert!(
        built.status.success(),
        "{}{}",
        stdout(&built),
        String::from_utf8_lossy(&built.stderr)
    );
    let build = dir.path().join(&name).join("build");
    assert!(build.join(format!("{name}.cwasm")).is_file());
    let tested = run(&[
        "filter",
        "test",
        build.join(format!("{name}.wasm")).to_str().unwrap(),
        &format!("{name}/suite.yaml"),
    ]);
    let out = stdout(&tested);
    assert!(tested.status.success(), "{out}");
    assert!(out.ends_with("8 passed, 0 failed\n"), "{out}");
}

#[test]
fn new_build_test_works_end_to_end_for_python() {
    end_to_end("python");
}

#[test]
fn new_build_test_works_end_to_end_for_javascript() {
    end_to_end("js");
}

#[test]
fn new_build_test_works_end_to_end_for_c() {
    end_to_end("c");
}

#[test]
fn a_wrong_api_key_implementation_fails_the_shared_suite_with_diffs() {
    // The C sample with three plausible bugs: 403 instead of 401, keys compared
    // without case, and the key left on the request going upstream.
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join("wrong-auth");
    std::fs::create_dir_all(&project).unwrap();
    let source = std::fs::read_to_string(workspace().join("samples/filters/c/filter.c")).unwrap();
    let mut wrong = source.clone();
    for (right, bug) in [
        ("ret->val.deny.status = 401;", "ret->val.deny.status = 403;"),
        (
            "memcmp(clients[i].key, value.ptr, value.len) == 0",
            "strncasecmp(clients[i].key, (const char *)value.ptr, value.len) == 0",
        ),
        (
            "  dpumesh_filter_types_method_request_head_remove_header(head, &name, &header_error);\n",
            "",
        ),
    ] {
        assert!(wrong.contains(right), "the C sample changed: {right}");
        wrong = wrong.replacen(right, bug, 1);
    }
    wrong = wrong.replacen(
        "#include <string.h>",
        "#include <string.h>\n#include <strings.h>",
        1,
    );
    std::fs::write(project.join("filter.c"), wrong).unwrap();

    let built = dpumesh(&["filter", "build", project.to_str().unwrap()]);
    assert!(
        built.status.success(),
        "{}{}",
        stdout(&built),
        String::from_utf8_lossy(&built.stderr)
    );
    let component = project.join("build/wrong-auth.wasm");
    let output = dpumesh(&[
        "filter",
        "test",
        component.to_str().unwrap(),
        "samples/filters/apikey.suite.yaml",
    ]);
    let out = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{out}");
    // Each bug shows up as expected-vs-got under the case it breaks.
    for line in [
        "a missing key is refused ... FAILED",
        "status: expected 401, got 403",
        "the key is compared exactly (case matters) ... FAILED",
        "verdict: expected Deny, got Continue",
        "a known key passes and names the client ... FAILED",
        "request header x-api-key: expected (absent), got \"key-alice-123\"",
    ] {
        assert!(out.contains(line), "missing {line:?} in:\n{out}");
    }
    // The cases no bug touches still pass.
    assert!(
        out.contains("another known key names its own client ... ok"),
        "{out}"
    );
    assert!(out.ends_with("3 passed, 5 failed\n"), "{out}");
}

#[test]
fn a_proxy_wasm_plugin_passes_a_suite_through_the_cli_like_a_component() {
    let output = dpumesh(&[
        "filter",
        "test",
        artifacts::PROXY_WASM_TEST,
        "tests/programs/proxy-wasm-test/suite.yaml",
    ]);
    let out = stdout(&output);
    assert!(
        output.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        out.lines().last().unwrap().ends_with("6 passed, 0 failed"),
        "{out}"
    );
    // A case that does not answer the plugin's call fails, saying which call.
    let dir = tempfile::tempdir().unwrap();
    let suite =
        std::fs::read_to_string(workspace().join("tests/programs/proxy-wasm-test/suite.yaml"))
            .unwrap()
            .replace("    calls:\n      - {upstream: auth, status: 401}\n", "");
    let file = dir.path().join("suite.yaml");
    std::fs::write(&file, suite).unwrap();
    let output = dpumesh(&[
        "filter",
        "test",
        artifacts::PROXY_WASM_TEST,
        file.to_str().unwrap(),
    ]);
    let out = stdout(&output);
    assert!(!output.status.success(), "{out}");
    assert!(
        out.contains(r#"the filter called upstream "auth" (path "/check/secure/b") and the case gives no answer"#),
        "{out}"
    );
    // And fails it when it does something else: the component-only test filter.
    let output = dpumesh(&[
        "filter",
        "test",
        artifacts::TEST_FILTER,
        "tests/programs/proxy-wasm-test/suite.yaml",
    ]);
    assert!(!output.status.success(), "{}", stdout(&output));
}

//! Runs every conformance suite under `tests/conformance/<filter>/` against the
//! built-in filter of that name, and checks that the runner reports failures readably.

use std::path::{Path, PathBuf};

use dpumesh_conformance::{RunOptions, Suite, format_report, run_suite};
use dpumesh_test_artifacts as artifacts;

fn suites_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/conformance")
}

fn options() -> RunOptions {
    RunOptions {
        cache_dir: Some(PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cwasm-cache")),
        ..RunOptions::default()
    }
}

/// Suites of behaviour the built-ins gained after their WIT 0.1.1 builds (security
/// fixes that are the filters', not the proxy's): those builds, kept as built, are
/// not held to them.
const AFTER_0_1_1: [&str; 2] = ["jwt/owned-headers.yaml", "rbac/repeated-headers.yaml"];

/// Runs every suite of `filter` against `bytes`, as a core instance and through
/// component calls; returns the number of cases.
fn pass_suites(filter: &str, bytes: &[u8]) -> usize {
    let cases = pass_suites_with(filter, bytes, true, &[]);
    assert_eq!(pass_suites_with(filter, bytes, false, &[]), cases);
    cases
}

fn pass_suites_with(filter: &str, bytes: &[u8], core_calls: bool, skip: &[&str]) -> usize {
    let dir = suites_dir().join(filter);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "json"))
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            !skip.contains(&format!("{filter}/{name}").as_str())
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no suites for {filter}");
    let mut cases = 0;
    for file in files {
        let suite = Suite::load(&file).unwrap_or_else(|e| panic!("{e}"));
        let options = RunOptions {
            core_calls,
            ..options()
        };
        let report = run_suite(&suite, bytes, &options);
        print!("{}", format_report(&report));
        assert!(report.ok(), "{}", format_report(&report));
        // The built-ins are Rust components of one core module each.
        assert_eq!(report.core, core_calls, "{filter}: ran as a core instance");
        cases += report.cases.len();
    }
    cases
}

#[test]
fn builtin_filters_pass_their_suites() {
    let mut summary = Vec::new();
    for (filter, component) in artifacts::BUILTIN_FILTERS {
        let cases = pass_suites(filter, &artifacts::read(component));
        summary.push((filter, cases));
    }
    for (filter, cases) in summary {
        assert!(cases >= 25, "{filter} has only {cases} conformance cases");
    }
}

/// The built-ins as built for WIT 0.1.1 (before typed claims), kept as built, still
/// pass today's suites on today's proxy (but those of behaviour they predate,
/// [`AFTER_0_1_1`]): the suites did not move with the filters.
#[test]
fn the_0_1_1_builds_of_jwt_rbac_and_ratelimit_pass_the_same_suites() {
    for filter in ["jwt", "rbac", "ratelimit"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
            "../../tests/fixtures/components/{filter}-wit-0.1.1.wasm"
        ));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let cases = pass_suites_with(filter, &bytes, true, &AFTER_0_1_1);
        assert_eq!(pass_suites_with(filter, &bytes, false, &AFTER_0_1_1), cases);
        assert!(cases >= 25, "{filter}");
    }
}

const WRONG: &str = r#"
suite: deliberately-wrong
config: {}
cases:
  - name: expects a denial from a filter that never denies
    request:
      headers: [[x-request-id, "abc"]]
    expect:
      verdict: deny
      status: 401
      headers: {x-request-id: "xyz"}
      metadata: {trace.request_id: null}
  - name: this one is right
    request: {}
    expect: {verdict: continue}
"#;

#[test]
fn a_wrong_expectation_fails_with_a_readable_diff() {
    let suite = Suite::parse(WRONG, Path::new("wrong.yaml")).unwrap();
    let report = run_suite(
        &suite,
        &artifacts::read(artifacts::FILTER_TRACE),
        &options(),
    );
    assert_eq!((report.passed(), report.failed()), (1, 1));
    let text = format_report(&report);
    assert!(
        text.contains("expects a denial from a filter that never denies ... FAILED"),
        "{text}"
    );
    assert!(
        text.contains("verdict: expected Deny, got Continue"),
        "{text}"
    );
    assert!(
        text.contains("reply: expected a local reply, got none"),
        "{text}"
    );
    assert!(
        text.contains("request header x-request-id: expected \"xyz\", got \"abc\""),
        "{text}"
    );
    assert!(
        text.contains("metadata trace.request_id: expected (absent), got \"abc\""),
        "{text}"
    );
    assert!(text.trim_end().ends_with("1 passed, 1 failed"), "{text}");
}

#[test]
fn a_rejected_configuration_fails_every_case_with_the_reason() {
    let text = "suite: bad-config\nconfig: {max_request_id_len: 0}\ncases:\n  - {name: one, request: {}, expect: {verdict: continue}}\n";
    let suite = Suite::parse(text, Path::new("bad.yaml")).unwrap();
    let report = run_suite(
        &suite,
        &artifacts::read(artifacts::FILTER_TRACE),
        &options(),
    );
    let error = report.error.clone().unwrap();
    assert!(
        error.contains("max_request_id_len must be at least 1"),
        "{error}"
    );
    assert_eq!(report.failed(), 1);
}

#[test]
fn suite_errors_name_file_line_and_field() {
    let text = "suite: x\ncases:\n  - name: a\n    request: {}\n    expect: {verdict: maybe}\n";
    let err = Suite::parse(text, Path::new("s.yaml"))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("s.yaml:5:"), "{err}");
    assert!(err.contains("unknown variant `maybe`"), "{err}");
    let err = Suite::parse("suite: x\ncases: []\nbogus: 1\n", Path::new("t.yaml"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown field `bogus`"), "{err}");
}

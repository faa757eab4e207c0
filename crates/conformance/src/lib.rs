//! The DPUmesh filter conformance kit.
//!
//! A suite is data (YAML or JSON): a filter configuration, a fixed clock, key sets,
//! tokens the runner signs, and cases — a request head in, the expected verdict,
//! status, reply headers, request-header edits and metadata out. [`run_suite`] runs a
//! suite against any filter component, whatever language it was written in, in the
//! real runtime; [`format_report`] prints it like a test runner.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod runner;
mod suite;
mod tokens;

pub use runner::{CaseReport, RunOptions, SuiteReport, run_suite};
pub use suite::{
    Case, Expect, KeySource, RequestSpec, ResponseSpec, Suite, SuiteError, TokenSpec, Verdict,
};
pub use tokens::{TokenError, mint_all, substitute};

/// Prints a report like a test runner: one line per case, the mismatches under a
/// failing case, and a closing `N passed, N failed` line.
pub fn format_report(report: &SuiteReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "suite {}", report.suite);
    if let Some(error) = &report.error {
        let _ = writeln!(out, "  error: {error}");
    }
    for case in &report.cases {
        let _ = writeln!(
            out,
            "  {} ... {}",
            case.name,
            if case.passed() { "ok" } else { "FAILED" }
        );
        if report.error.is_none() {
            for failure in &case.failures {
                let _ = writeln!(out, "      {failure}");
            }
        }
    }
    let _ = writeln!(
        out,
        "{} passed, {} failed",
        report.passed(),
        report.failed()
    );
    out
}

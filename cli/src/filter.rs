//! `dpumesh filter …`: the conformance kit on the command line.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use dpumesh_conformance::{RunOptions, Suite, SuiteReport, format_report, run_suite};

/// The suite files named: files as given, directories expanded to their `.yaml`,
/// `.yml` and `.json` files in name order.
fn suite_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(path)
                .with_context(|| format!("reading {}", path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.extension()
                        .is_some_and(|e| e == "yaml" || e == "yml" || e == "json")
                })
                .collect();
            found.sort();
            if found.is_empty() {
                bail!(
                    "{} holds no suite files (.yaml, .yml, .json)",
                    path.display()
                );
            }
            files.extend(found);
        } else {
            files.push(path.clone());
        }
    }
    Ok(files)
}

/// Runs every suite against `component`; prints like a test runner (or JSON) and
/// fails the exit code when any case failed or any suite could not run.
pub fn test(component: &Path, suites: &[PathBuf], json: bool) -> Result<ExitCode> {
    let bytes = std::fs::read(component)
        .with_context(|| format!("reading the component {}", component.display()))?;
    let options = RunOptions::default();
    let mut reports: Vec<SuiteReport> = Vec::new();
    for file in suite_files(suites)? {
        let report = match Suite::load(&file) {
            Ok(suite) => run_suite(&suite, &bytes, &options),
            Err(e) => SuiteReport {
                suite: file.display().to_string(),
                error: Some(e.to_string()),
                cases: Vec::new(),
                core: false,
            },
        };
        if !json {
            print!("{}", format_report(&report));
        }
        reports.push(report);
    }
    let passed: usize = reports.iter().map(SuiteReport::passed).sum();
    let failed: usize = reports.iter().map(SuiteReport::failed).sum();
    let broken = reports.iter().filter(|r| r.error.is_some()).count();
    if json {
        let out = serde_json::json!({
            "component": component.display().to_string(),
            "suites": reports,
            "passed": passed,
            "failed": failed,
            "suites_not_run": broken,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else if reports.len() > 1 || broken > 0 {
        println!(
            "total: {passed} passed, {failed} failed{}",
            if broken > 0 {
                format!(", {broken} suites could not run")
            } else {
                String::new()
            }
        );
    }
    Ok(if failed == 0 && broken == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

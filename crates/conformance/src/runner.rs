//! Runs a suite against a filter component in the real runtime, on a fixed clock, with
//! fresh shared state and the suite's keys.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use dpumesh_clock::{ManualClock, SharedClock};
use dpumesh_keys::KeySet;
use dpumesh_runtime::{
    CalloutReply, ChainOutcome, ChainRunner, Decision, DenyCause, FailureKind, FilterChain,
    FilterSettings, RequestHead, ResponseInfo, Runtime, RuntimeConfig,
};

use crate::suite::{Case, Expect, RequestSpec, Suite, Verdict};
use crate::tokens;

/// The result of one case.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CaseReport {
    /// The case's name.
    pub name: String,
    /// Each mismatch, as "what: expected X, got Y". Empty when the case passed.
    pub failures: Vec<String>,
}

impl CaseReport {
    /// Whether the case passed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The result of a suite.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SuiteReport {
    /// The suite's name.
    pub suite: String,
    /// Why the suite could not run at all (bad keys, tokens, or a filter that does not
    /// load or rejects the configuration).
    pub error: Option<String>,
    /// One report per case, in order.
    pub cases: Vec<CaseReport>,
    /// Whether the filter ran as a core instance (the proxy's cheaper way to run a
    /// component that is one core module) rather than through component calls.
    pub core: bool,
}

impl SuiteReport {
    /// Cases that passed.
    pub fn passed(&self) -> usize {
        self.cases.iter().filter(|c| c.passed()).count()
    }

    /// Cases that failed (a suite that could not run counts every case as failed).
    pub fn failed(&self) -> usize {
        self.cases.len() - self.passed()
    }

    /// Whether everything passed.
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.failed() == 0
    }
}

/// How the runner treats the filter.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// CPU deadline per call (generous: interpreted guests and loaded CI machines).
    pub deadline: Duration,
    /// Compile cache directory (`None`: in memory).
    pub cache_dir: Option<std::path::PathBuf>,
    /// Whether a component that can run as a core instance does (as the proxy runs
    /// it); `false` runs it through wasmtime's component calls.
    pub core_calls: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            deadline: Duration::from_secs(2),
            cache_dir: dpumesh_runtime::default_cache_dir(),
            core_calls: RuntimeConfig::default().core_calls,
        }
    }
}

fn setup_error(suite: &Suite, error: String) -> SuiteReport {
    SuiteReport {
        suite: suite.suite.clone(),
        core: false,
        error: Some(error.clone()),
        cases: suite
            .cases
            .iter()
            .map(|case| CaseReport {
                name: case.name.clone(),
                failures: vec![format!("suite did not run: {error}")],
            })
            .collect(),
    }
}

/// Runs `suite` against the component `component` (its bytes).
pub fn run_suite(suite: &Suite, component: &[u8], options: &RunOptions) -> SuiteReport {
    let clock = ManualClock::at_unix_secs(suite.clock);
    let shared: SharedClock = clock.clone();
    let runtime = match Runtime::new(RuntimeConfig {
        cache_dir: options.cache_dir.clone(),
        max_instances: 8,
        clock: shared,
        core_calls: options.core_calls,
        ..RuntimeConfig::default()
    }) {
        Ok(runtime) => runtime,
        Err(e) => return setup_error(suite, e.to_string()),
    };
    for (name, source) in &suite.keys {
        let set = match (&source.jwks, &source.jwks_file, &source.secret) {
            (Some(doc), None, None) => KeySet::from_jwks(&doc.to_string()),
            (None, Some(file), None) => {
                let path = suite.resolve(file);
                match std::fs::read_to_string(&path) {
                    Ok(text) => KeySet::from_jwks(&text),
                    Err(e) => {
                        return setup_error(
                            suite,
                            format!("key set {name}: {}: {e}", path.display()),
                        );
                    }
                }
            }
            (None, None, Some(secret)) => Ok(KeySet::from_secret(
                source.kid.as_deref(),
                secret.as_bytes(),
            )),
            _ => {
                return setup_error(
                    suite,
                    format!("key set {name}: give exactly one of jwks, jwks_file, secret"),
                );
            }
        };
        match set {
            Ok(set) => runtime.keys().insert(name, set),
            Err(e) => return setup_error(suite, format!("key set {name}: {e}")),
        }
    }
    let tokens = match tokens::mint_all(suite) {
        Ok(tokens) => tokens,
        Err(e) => return setup_error(suite, e.to_string()),
    };
    let settings =
        FilterSettings::new("under-test", suite.config_string()).deadline(options.deadline);
    let filter = match runtime.load_filter(settings, component) {
        Ok(filter) => filter,
        Err(e) => return setup_error(suite, e.to_string()),
    };
    let core = filter.runs_as_core();
    let mut runner = ChainRunner::new(Arc::new(FilterChain::new(
        suite.suite.clone(),
        vec![filter],
    )));
    let cases = suite
        .cases
        .iter()
        .map(|case| {
            clock.advance_ms(case.advance_ms);
            run_case(&mut runner, case, &tokens)
        })
        .collect();
    SuiteReport {
        suite: suite.suite.clone(),
        error: None,
        cases,
        core,
    }
}

fn build_head(
    spec: &RequestSpec,
    tokens: &BTreeMap<String, String>,
) -> Result<RequestHead, String> {
    let mut head = RequestHead::new(&spec.method, &tokens::substitute(&spec.path, tokens)?);
    head.authority = spec.authority.clone();
    head.scheme = spec.scheme.clone();
    head.source.addr = spec
        .source
        .parse()
        .map_err(|_| format!("source {:?} is not ip:port", spec.source))?;
    head.source.identity = spec.identity.clone();
    head.destination = spec.destination.clone();
    for (name, value) in &spec.headers {
        let value = tokens::substitute(value, tokens)?;
        head.append_received(name, &value)
            .map_err(|e| format!("request header {name:?}: {e}"))?;
    }
    for (k, v) in &spec.metadata {
        head.set_metadata(k, v);
    }
    Ok(head)
}

fn failure_kind(name: &str) -> Result<FailureKind, String> {
    Ok(match name {
        "none" => FailureKind::None,
        "connect-failure" => FailureKind::ConnectFailure,
        "upstream-reset" => FailureKind::UpstreamReset,
        "timeout" => FailureKind::Timeout,
        "local-reply" => FailureKind::LocalReply,
        "internal" => FailureKind::Internal,
        other => return Err(format!("unknown failure kind {other:?}")),
    })
}

fn run_case(
    runner: &mut ChainRunner,
    case: &Case,
    tokens: &BTreeMap<String, String>,
) -> CaseReport {
    let report = |failures| CaseReport {
        name: case.name.clone(),
        failures,
    };
    let head = match build_head(&case.request, tokens) {
        Ok(head) => head,
        Err(e) => return report(vec![format!("bad case: {e}")]),
    };
    let info = match &case.response {
        None => None,
        Some(response) => match failure_kind(&response.failure) {
            Ok(failure) => Some(ResponseInfo {
                status: response.status,
                latency_ns: response.latency_ms.saturating_mul(1_000_000),
                upstream: response.upstream.clone(),
                failure,
            }),
            Err(e) => return report(vec![format!("bad case: {e}")]),
        },
    };
    let mut last = None;
    let mut response_faults = Vec::new();
    for _ in 0..case.repeat.max(1) {
        let mut outcome = runner.on_request(head.clone());
        runner.repair();
        // A paused request gets the case's answers to its calls, in the order made.
        let mut answers = case.calls.iter();
        let mut queue = std::collections::VecDeque::new();
        while let Decision::Pause { park, callouts } = &outcome.decision {
            let park = *park;
            queue.extend(callouts.iter().cloned());
            let give_up = |runner: &mut ChainRunner, failure: String| {
                runner.abandon(park);
                report(vec![failure])
            };
            let Some(callout) = queue.pop_front() else {
                let failure = "the request stayed paused with no HTTP call to wait for".to_owned();
                return give_up(runner, failure);
            };
            let path = callout.header(":path").unwrap_or("").to_owned();
            let Some(spec) = answers.next() else {
                let failure = format!(
                    "the filter called upstream {:?} (path {path:?}) and the case gives no answer (`calls:`)",
                    callout.upstream
                );
                return give_up(runner, failure);
            };
            if let Some(want) = spec.upstream.as_ref().filter(|w| **w != callout.upstream) {
                let failure = format!(
                    "call: expected upstream {want:?}, got {:?}",
                    callout.upstream
                );
                return give_up(runner, failure);
            }
            if let Some(want) = spec.path.as_ref().filter(|w| **w != path) {
                return give_up(
                    runner,
                    format!("call: expected path {want:?}, got {path:?}"),
                );
            }
            let reply = match &spec.fail {
                Some(reason) => CalloutReply::Failed {
                    reason: reason.clone(),
                },
                None => CalloutReply::Response {
                    status: spec.status,
                    headers: spec
                        .headers
                        .iter()
                        .map(|(k, v)| (k.to_ascii_lowercase(), v.clone().into_bytes()))
                        .collect(),
                    body: spec.body.clone().into_bytes(),
                },
            };
            let Some(resumed) = runner.resume(park, callout.token, &reply) else {
                return report(vec!["the paused request was lost".to_owned()]);
            };
            runner.repair();
            outcome = resumed;
        }
        // Each request gets its response phase, as in the proxy: the upstream's answer
        // when it was forwarded, the local reply when a filter denied it.
        if let Some(info) = &info {
            let info = match outcome.decision.reply() {
                Some(reply) => ResponseInfo {
                    status: reply.status,
                    latency_ns: 0,
                    upstream: None,
                    failure: FailureKind::LocalReply,
                },
                None => info.clone(),
            };
            let (head, faults) = runner.on_response(outcome.head, &info, outcome.ran);
            runner.repair();
            outcome.head = head;
            response_faults.extend(faults);
        }
        last = Some(outcome);
    }
    let Some(outcome) = last else {
        return report(vec!["no request was sent".to_owned()]);
    };
    let mut failures = check(&case.expect, &outcome);
    failures.extend(
        response_faults
            .iter()
            .map(|f| format!("on-response fault: {f}")),
    );
    report(failures)
}

fn check(expect: &Expect, outcome: &ChainOutcome) -> Vec<String> {
    let mut failures = Vec::new();
    let got_verdict = match &outcome.decision {
        Decision::Continue => Verdict::Continue,
        Decision::Deny { .. } => Verdict::Deny,
        Decision::Pause { .. } => {
            failures.push("the request is still paused".to_owned());
            return failures;
        }
    };
    if got_verdict != expect.verdict {
        let detail = match &outcome.decision {
            Decision::Continue | Decision::Pause { .. } => String::new(),
            Decision::Deny { reply, cause, .. } => match cause {
                DenyCause::Policy => format!(" ({} {:?})", reply.status, reply.body.trim()),
                DenyCause::Fault(fault) => format!(" (fault: {fault})"),
            },
        };
        failures.push(format!(
            "verdict: expected {:?}, got {got_verdict:?}{detail}",
            expect.verdict
        ));
    }
    for fault in &outcome.faults {
        if !matches!(&outcome.decision, Decision::Deny { cause: DenyCause::Fault(f), .. } if f == fault)
        {
            failures.push(format!("fault: {fault}"));
        }
    }
    if let Some(reply) = outcome.decision.reply() {
        if let Some(status) = expect.status
            && status != reply.status
        {
            failures.push(format!("status: expected {status}, got {}", reply.status));
        }
        for (name, want) in &expect.reply_headers {
            let got = reply.header(name);
            if got != want.as_deref() {
                failures.push(format!(
                    "reply header {name}: expected {}, got {}",
                    shown(want.as_deref()),
                    shown(got)
                ));
            }
        }
        for (name, part) in &expect.reply_headers_contain {
            let got = reply.header(name);
            if !got.is_some_and(|v| v.contains(part.as_str())) {
                failures.push(format!(
                    "reply header {name}: expected to contain {part:?}, got {}",
                    shown(got)
                ));
            }
        }
        if let Some(part) = &expect.body_contains
            && !reply.body.contains(part.as_str())
        {
            failures.push(format!(
                "body: expected to contain {part:?}, got {:?}",
                reply.body
            ));
        }
    } else if expect.status.is_some() || !expect.reply_headers.is_empty() {
        failures.push("reply: expected a local reply, got none".to_owned());
    }
    for (name, want) in &expect.headers {
        let got = outcome.head.header(name);
        if got.as_deref() != want.as_deref() {
            failures.push(format!(
                "request header {name}: expected {}, got {}",
                shown(want.as_deref()),
                shown(got.as_deref())
            ));
        }
    }
    for (name, prefix) in &expect.headers_start_with {
        let got = outcome.head.header(name);
        if !got
            .as_deref()
            .is_some_and(|v| v.starts_with(prefix.as_str()))
        {
            failures.push(format!(
                "request header {name}: expected to start with {prefix:?}, got {}",
                shown(got.as_deref())
            ));
        }
    }
    for (name, suffix) in &expect.headers_end_with {
        let got = outcome.head.header(name);
        if !got.as_deref().is_some_and(|v| v.ends_with(suffix.as_str())) {
            failures.push(format!(
                "request header {name}: expected to end with {suffix:?}, got {}",
                shown(got.as_deref())
            ));
        }
    }
    for (name, len) in &expect.header_lengths {
        let got = outcome.head.header(name);
        if got.as_ref().map(String::len) != Some(*len) {
            failures.push(format!(
                "request header {name}: expected {len} characters, got {}",
                shown(got.as_deref())
            ));
        }
    }
    for (key, want) in &expect.metadata {
        let got = outcome.head.metadata(key);
        if got != want.as_deref() {
            failures.push(format!(
                "metadata {key}: expected {}, got {}",
                shown(want.as_deref()),
                shown(got)
            ));
        }
    }
    failures
}

fn shown(value: Option<&str>) -> String {
    match value {
        Some(v) => format!("{v:?}"),
        None => "(absent)".to_owned(),
    }
}

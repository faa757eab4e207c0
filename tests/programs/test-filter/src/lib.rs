//! A filter whose behaviour is chosen by its configuration, for runtime tests and
//! benches: header edits, metadata, denials, shared-state counters, and misbehaviour
//! (infinite loops, memory bombs, panics, invalid replies).
//!
//! ```json
//! {"tag": "a", "request": [{"append_header": ["x-order", "a"]}], "response": [{"record_order": "seq"}]}
//! ```

#![forbid(unsafe_code)]

use dpumesh_filter_sdk::{
    Claim, Filter, Interest, LocalReply, Request, ResponseInfo, Verdict, export_filter, shared,
};
use serde::Deserialize;

/// One step the filter performs.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Action {
    /// Replace a header.
    SetHeader(String, String),
    /// Append a header value.
    AppendHeader(String, String),
    /// Remove a header.
    RemoveHeader(String),
    SetMetadata(String, String),
    /// Copy metadata `key` into header `name` (or `-` when absent).
    MetadataToHeader(String, String),
    /// Deny unconditionally.
    Deny(u16, String),
    /// Deny with `status` when header `name` is present.
    DenyIfHeader(String, u16),
    /// Deny with 403 unless metadata `key` is present.
    RequireMetadata(String),
    /// Increment shared counter `key`.
    Increment(String),
    /// Loop forever.
    Spin,
    /// Compute for this many loop iterations (about a nanosecond each), then go on: a
    /// call that needs real CPU time.
    Work(u64),
    /// Allocate and touch this many MiB.
    AllocMib(u32),
    /// Allocate and touch this many MiB when header `name` is present.
    AllocMibIfHeader(String, u32),
    /// Panic with this message.
    Panic(String),
    /// Panic when header `name` is present.
    PanicIfHeader(String),
    /// Panic on this instance's `n`th request (1-based): a fault tied to instance
    /// state, which a fresh instance does not repeat.
    PanicOnCall(u32),
    /// Loop forever when header `name` is present.
    SpinIfHeader(String),
    /// Sleep this many milliseconds (`std::thread::sleep`: a WASI clock subscription
    /// and a block on it), then put how long the sleep took, as the guest's monotonic
    /// clock saw it, in `x-slept-ms`.
    Sleep(u64),
    /// Write to stderr.
    Stderr(String),
    /// Record the response-phase order: `seq` += 1, then `<key>-<tag>` = seq.
    RecordOrder(String),
    /// Put the query, source and destination into headers `x-query`, `x-source`,
    /// `x-identity`, `x-destination`.
    Describe,
    /// Put the result of editing `name` into `x-edit-result`.
    TrySetHeader(String, String),
    /// Read several headers in one call into `x-joined` (comma-joined, `-` for absent).
    JoinHeaders(Vec<String>),
    /// Read these verified claims in one call into `x-claims`: `none` without claims,
    /// else `;`-joined, each `-` (absent), `text:<s>`, `list:<a>|<b>` or `json:<j>`.
    Claims(Vec<String>),
}

/// Configuration.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Tag used in `record_order` keys.
    #[serde(default)]
    pub tag: String,
    /// Steps for `on_request`.
    #[serde(default)]
    pub request: Vec<Action>,
    /// Steps for `on_response`.
    #[serde(default)]
    pub response: Vec<Action>,
    /// Refuse the configuration with this message.
    pub reject: Option<String>,
    /// Spin in configure.
    #[serde(default)]
    pub spin_in_configure: bool,
    /// Headers to declare (WIT 0.1.1 `interest`): with any, the proxy uses the batched
    /// call for this filter.
    #[serde(default)]
    pub interest: Vec<String>,
}

#[derive(Debug)]
pub struct TestFilter {
    config: Config,
    /// Keeps allocations alive so the memory bomb is not optimized away.
    hoard: Vec<Vec<u8>>,
    /// Requests this instance has seen.
    calls: u32,
}

fn spin() -> ! {
    let mut n: u64 = 0;
    loop {
        n = std::hint::black_box(n.wrapping_add(1));
    }
}

impl TestFilter {
    fn alloc(&mut self, mib: u32) {
        for _ in 0..mib {
            let mut block = vec![0u8; 1 << 20];
            block[0] = 1;
            self.hoard.push(std::hint::black_box(block));
        }
    }

    fn run(&mut self, req: &Request<'_>, actions: &[Action]) -> Verdict {
        for action in actions {
            match action {
                Action::SetHeader(n, v) => {
                    req.set_header(n, v).expect("set_header");
                }
                Action::AppendHeader(n, v) => {
                    req.append_header(n, v).expect("append_header");
                }
                Action::RemoveHeader(n) => {
                    req.remove_header(n).expect("remove_header");
                }
                Action::SetMetadata(k, v) => req.set_metadata(k, v),
                Action::MetadataToHeader(k, n) => {
                    let value = req.metadata(k).unwrap_or_else(|| "-".to_owned());
                    req.set_header(n, &value).expect("set_header");
                }
                Action::Deny(status, body) => {
                    return LocalReply::new(*status)
                        .header("x-denied-by", self.config.tag.clone())
                        .body(body.clone())
                        .into();
                }
                Action::DenyIfHeader(n, status) => {
                    if req.header(n).is_some() {
                        return LocalReply::new(*status)
                            .header("x-denied-by", self.config.tag.clone())
                            .into();
                    }
                }
                Action::RequireMetadata(k) => {
                    if req.metadata(k).is_none() {
                        return LocalReply::new(403).body(format!("missing {k}")).into();
                    }
                }
                Action::Increment(k) => {
                    shared::increment(k, 1, 0).expect("increment");
                }
                Action::Spin => spin(),
                Action::Work(n) => {
                    let mut x: u64 = 0;
                    for i in 0..*n {
                        x = std::hint::black_box(x.wrapping_add(i));
                    }
                }
                Action::SpinIfHeader(n) => {
                    if req.header(n).is_some() {
                        spin()
                    }
                }
                Action::Sleep(ms) => {
                    let start = std::time::Instant::now();
                    std::thread::sleep(std::time::Duration::from_millis(*ms));
                    let slept = start.elapsed().as_millis().to_string();
                    req.set_header("x-slept-ms", &slept).expect("set_header");
                }
                Action::AllocMib(mib) => self.alloc(*mib),
                Action::AllocMibIfHeader(n, mib) => {
                    if req.header(n).is_some() {
                        self.alloc(*mib);
                    }
                }
                Action::Panic(message) => panic!("{message}"),
                Action::PanicOnCall(n) => {
                    if self.calls == *n {
                        panic!("instance fault on call {n}");
                    }
                }
                Action::PanicIfHeader(n) => {
                    if req.header(n).is_some() {
                        panic!("header {n} present");
                    }
                }
                Action::Stderr(text) => eprintln!("{text}"),
                Action::RecordOrder(key) => {
                    let seq = shared::increment("seq", 1, 0).expect("increment");
                    let key = format!("{key}-{}", self.config.tag);
                    shared::increment(&key, seq, 0).expect("increment");
                }
                Action::Describe => {
                    let source = req.source();
                    req.set_header("x-query", &req.query().unwrap_or_default())
                        .unwrap();
                    req.set_header("x-source", &format!("{}:{}", source.address, source.port))
                        .unwrap();
                    req.set_header("x-identity", &source.identity.unwrap_or_default())
                        .unwrap();
                    req.set_header("x-destination", &req.destination().unwrap_or_default())
                        .unwrap();
                    req.set_header(
                        "x-line",
                        &format!(
                            "{} {} {} {}",
                            req.method(),
                            req.scheme(),
                            req.authority(),
                            req.path()
                        ),
                    )
                    .unwrap();
                }
                Action::TrySetHeader(n, v) => {
                    let result = match req.set_header(n, v) {
                        Ok(()) => "ok".to_owned(),
                        Err(e) => format!("{e:?}"),
                    };
                    req.set_header("x-edit-result", &result).unwrap();
                }
                Action::JoinHeaders(names) => {
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    let joined: Vec<String> = req
                        .headers(&names)
                        .into_iter()
                        .map(|v| v.unwrap_or_else(|| "-".to_owned()))
                        .collect();
                    req.set_header("x-joined", &joined.join(",")).unwrap();
                }
                Action::Claims(names) => {
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    let text = match req.claims(&names) {
                        None => "none".to_owned(),
                        Some(claims) => claims
                            .iter()
                            .map(|c| match c {
                                None => "-".to_owned(),
                                Some(Claim::Text(s)) => format!("text:{s}"),
                                Some(Claim::TextList(items)) => format!("list:{}", items.join("|")),
                                Some(Claim::Json(json)) => format!("json:{json}"),
                            })
                            .collect::<Vec<_>>()
                            .join(";"),
                    };
                    req.set_header("x-claims", &text).unwrap();
                }
            }
        }
        Verdict::Continue
    }
}

impl Filter for TestFilter {
    type Config = Config;

    fn interest(&self) -> Interest {
        Interest {
            headers: self.config.interest.clone(),
            metadata: Vec::new(),
        }
    }

    fn new(config: Config) -> Result<Self, String> {
        if let Some(message) = &config.reject {
            return Err(message.clone());
        }
        if config.spin_in_configure {
            spin();
        }
        Ok(Self {
            config,
            hoard: Vec::new(),
            calls: 0,
        })
    }

    fn on_request(&mut self, req: &Request<'_>) -> Verdict {
        self.calls += 1;
        // Taken out and put back rather than cloned, so benches measure host calls.
        let actions = std::mem::take(&mut self.config.request);
        let verdict = self.run(req, &actions);
        self.config.request = actions;
        verdict
    }

    fn on_response(&mut self, req: &Request<'_>, _info: &ResponseInfo) {
        let actions = std::mem::take(&mut self.config.response);
        let _ = self.run(req, &actions);
        self.config.response = actions;
    }
}

export_filter!(TestFilter);

#[cfg(test)]
mod tests {
    use dpumesh_filter_sdk::mock::{MockProxy, MockRequest};

    use super::*;

    #[test]
    fn actions_run_in_order_against_the_mock() {
        let host = MockProxy::new().install();
        let mut f: TestFilter = host
            .configure(r#"{"tag":"t","request":[{"set_metadata":["k","v"]},{"metadata_to_header":["k","x-k"]},{"deny_if_header":["x-stop",418]}]}"#)
            .unwrap();
        let req = MockRequest::get("/");
        assert!(host.on_request(&mut f, &req).is_continue());
        assert_eq!(req.header("x-k").as_deref(), Some("v"));
        let stop = MockRequest::get("/").with_header("x-stop", "1");
        assert_eq!(host.on_request(&mut f, &stop).reply().unwrap().status, 418);
    }

    #[test]
    fn reject_refuses_configuration() {
        let host = MockProxy::new().install();
        let err = host
            .configure::<TestFilter>(r#"{"reject":"nope"}"#)
            .unwrap_err();
        assert_eq!(err, "nope");
    }
}

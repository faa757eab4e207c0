use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    /// A request header to set on every request.
    add_header: Option<(String, String)>,
    /// Requests whose path starts with this get a local reply.
    deny_prefix: Option<String>,
    deny_status: u32,
    /// Copies these properties (dotted paths) into `x-prop-<last segment>` headers.
    properties: Vec<String>,
    /// Counts requests in shared data under this key (compare-and-swap) and says the
    /// count in `x-count`.
    shared_counter: Option<String>,
    /// A counter metric incremented per request.
    metric: Option<String>,
    /// Sets property `my.flag` to this for the filters after it.
    set_property: Option<String>,
    /// Paths that misbehave: panic, spin forever, sleep a second (WASI
    /// `poll_oneoff`), pause, pass a bad pointer.
    panic_prefix: Option<String>,
    spin_prefix: Option<String>,
    sleep_prefix: Option<String>,
    pause_prefix: Option<String>,
    bad_pointer_prefix: Option<String>,
    /// Refuse the configuration (`on_configure` returns false).
    refuse: bool,
    /// Asks for `proxy_on_tick` every this many ms; each tick counts in shared data
    /// under `ticks`.
    tick_ms: u32,
    /// Requests whose path starts with `prefix` wait for an HTTP call to `upstream`
    /// at `path` (the request's path appended): a 200 lets them through with the
    /// answer's body in `x-auth` (and its `x-user` header in `x-user`), a failed call
    /// gets a 503, any other status a 403 saying it.
    auth: Option<Auth>,
    /// A response header to set, and one to remove, in `on_http_response_headers`.
    response_header: Option<(String, String)>,
    remove_response_header: Option<String>,
    /// No logs in the response phase (benches measure the ABI, not logging).
    quiet: bool,
    /// `on_tick` never returns.
    spin_tick: bool,
    /// Each tick dispatches an HTTP call to this upstream (from the root context); the
    /// last answer (`STATUS BODY`) is stored in `root-answer-last` and every response
    /// says it in `x-root-answer`.
    tick_call: Option<String>,
    /// Registers this shared queue: what arrives is counted in shared data
    /// (`queue-items`, and the last item in `queue-last`) when the host says it is
    /// ready; a request with `x-enqueue: V` enqueues V, and every request and response
    /// says the count in `x-queue-items`.
    queue: Option<String>,
}

impl Config {
    /// Whether any option looks at the request's path.
    fn reads_path(&self) -> bool {
        [
            &self.deny_prefix,
            &self.panic_prefix,
            &self.spin_prefix,
            &self.sleep_prefix,
            &self.pause_prefix,
            &self.bad_pointer_prefix,
        ]
        .iter()
        .any(|p| p.is_some())
            || self.auth.is_some()
    }
}

#[derive(Debug, Default, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Auth {
    prefix: String,
    upstream: String,
    path: String,
    timeout_ms: u64,
    /// Makes this many calls at once and waits for all of them.
    calls: u32,
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root { config: Rc::new(Config::default()), metric: None })
    });
}}

struct Root {
    config: Rc<Config>,
    metric: Option<u32>,
}

impl Context for Root {
    /// The root is done when its instance is retired: counted in `root-done`.
    fn on_done(&mut self) -> bool {
        add_shared("root-done", 1);
        true
    }

    /// A tick's call came back: its status (or `none`) stored, then counted in
    /// `root-answers`.
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, size: usize, _t: usize) {
        let status = self
            .get_http_call_response_header(":status")
            .unwrap_or_else(|| "none".to_string());
        let body = self
            .get_http_call_response_body(0, size)
            .unwrap_or_default();
        let last = format!("{status} {}", String::from_utf8_lossy(&body).trim());
        let last = last.trim_end();
        self.set_shared_data("root-answer-last", Some(last.as_bytes()), None)
            .ok();
        add_shared("root-answers", 1);
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        proxy_wasm::hostcalls::log(LogLevel::Info, "vm started").is_ok()
    }

    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        let config: Config = if bytes.is_empty() {
            Config::default()
        } else {
            match serde_json::from_slice(&bytes) {
                Ok(c) => c,
                Err(e) => {
                    proxy_wasm::hostcalls::log(LogLevel::Error, &format!("bad configuration: {e}"))
                        .ok();
                    return false;
                }
            }
        };
        if config.refuse {
            proxy_wasm::hostcalls::log(LogLevel::Error, "configuration refused on purpose").ok();
            return false;
        }
        if let Some(name) = &config.metric {
            self.metric = proxy_wasm::hostcalls::define_metric(MetricType::Counter, name).ok();
        }
        if config.tick_ms > 0 {
            self.set_tick_period(std::time::Duration::from_millis(u64::from(config.tick_ms)));
        }
        if let Some(name) = &config.queue
            && proxy_wasm::hostcalls::register_shared_queue(name).is_err()
        {
            return false;
        }
        self.config = Rc::new(config);
        true
    }

    fn on_tick(&mut self) {
        if self.config.spin_tick {
            spin();
        }
        if let Some(upstream) = &self.config.tick_call {
            let headers = vec![(":method", "GET"), (":path", "/tick"), (":authority", "x")];
            let made = self.dispatch_http_call(
                upstream,
                headers,
                None,
                vec![],
                std::time::Duration::from_secs(1),
            );
            if made.is_err() {
                add_shared("tick-call-refused", 1);
            }
        }
        add_shared("ticks", 1);
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(item)) = proxy_wasm::hostcalls::dequeue_shared_queue(queue_id) {
            // The item first, then the count others wait for.
            self.set_shared_data("queue-last", Some(&item), None).ok();
            add_shared("queue-items", 1);
        }
    }

    fn create_http_context(&self, id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            id,
            config: self.config.clone(),
            metric: self.metric,
            waiting: 0,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    id: u32,
    config: Rc<Config>,
    metric: Option<u32>,
    /// HTTP calls still to answer.
    waiting: u32,
}

impl Context for Request {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, size: usize, _t: usize) {
        self.waiting = self.waiting.saturating_sub(1);
        let status = self.get_http_call_response_header(":status");
        let body = self
            .get_http_call_response_body(0, size)
            .unwrap_or_default();
        match status.as_deref() {
            None => {
                self.send_http_response(
                    503,
                    vec![("x-auth-failed", "no answer")],
                    Some(b"auth unavailable\n"),
                );
            }
            Some("200") => {
                let body = String::from_utf8_lossy(&body).into_owned();
                self.set_http_request_header("x-auth", Some(body.trim()));
                if let Some(user) = self.get_http_call_response_header("x-user") {
                    self.set_http_request_header("x-user", Some(&user));
                }
                if self.waiting == 0 {
                    self.resume_http_request();
                }
            }
            Some(other) => {
                let message = format!("auth said {other}\n");
                self.send_http_response(403, vec![], Some(message.as_bytes()));
            }
        }
    }
}

impl Request {
    /// Starts the auth calls for `path`; whether the request must wait for them.
    fn call_auth(&mut self, auth: &Auth, path: &str) -> bool {
        let target = format!("{}{path}", auth.path);
        for _ in 0..auth.calls.max(1) {
            let dispatched = self.dispatch_http_call(
                &auth.upstream,
                vec![
                    (":method", "GET"),
                    (":path", &target),
                    (":authority", "auth.local"),
                    ("x-asked-by", "proxy-wasm-test"),
                ],
                None,
                vec![],
                std::time::Duration::from_millis(auth.timeout_ms.max(1)),
            );
            match dispatched {
                Ok(_) => self.waiting += 1,
                Err(e) => {
                    let message = format!("cannot call {}: {e:?}\n", auth.upstream);
                    self.send_http_response(500, vec![], Some(message.as_bytes()));
                    return true;
                }
            }
        }
        true
    }
}

/// Adds `n` to the number in shared data under `key` (compare-and-swap until it
/// sticks); the new value.
fn add_shared(key: &str, n: u64) -> u64 {
    loop {
        let (value, cas) = proxy_wasm::hostcalls::get_shared_data(key).unwrap_or((None, None));
        let next = value
            .and_then(|v| String::from_utf8(v).ok())
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0)
            + n;
        if proxy_wasm::hostcalls::set_shared_data(key, Some(next.to_string().as_bytes()), cas)
            .is_ok()
        {
            return next;
        }
    }
}

fn starts(path: &str, prefix: &Option<String>) -> bool {
    prefix.as_deref().is_some_and(|p| path.starts_with(p))
}

/// A hand-made host call with a pointer far outside memory: what a hostile or broken
/// module does, which the host must turn into a fault.
#[allow(unsafe_code, clashing_extern_declarations)]
fn bad_pointer() {
    unsafe extern "C" {
        fn proxy_log(level: u32, ptr: *const u8, len: usize) -> u32;
    }
    // SAFETY: none; the host checks the range and traps the call.
    unsafe { proxy_log(2, 0x7fff_fff0 as *const u8, 4096) };
}

fn spin() -> ! {
    let mut n: u64 = 0;
    loop {
        n = std::hint::black_box(n.wrapping_add(1));
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _n: usize, _eos: bool) -> Action {
        let c = self.config.clone();
        let path = if c.reads_path() {
            self.get_http_request_header(":path").unwrap_or_default()
        } else {
            String::new()
        };
        if starts(&path, &c.panic_prefix) {
            panic!("asked to panic on {path}");
        }
        if starts(&path, &c.spin_prefix) {
            spin();
        }
        if starts(&path, &c.sleep_prefix) {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
        if starts(&path, &c.bad_pointer_prefix) {
            bad_pointer();
        }
        if starts(&path, &c.pause_prefix) {
            return Action::Pause;
        }
        if let Some(auth) = c.auth.as_ref().filter(|a| path.starts_with(&a.prefix))
            && self.call_auth(auth, &path)
        {
            return Action::Pause;
        }
        if let Some(id) = self.metric {
            proxy_wasm::hostcalls::increment_metric(id, 1).ok();
        }
        if let Some((name, value)) = &c.add_header {
            self.set_http_request_header(name, Some(value));
        }
        for path in &c.properties {
            let segments: Vec<&str> = path.split('.').collect();
            let value = self.get_property(segments.clone());
            let shown = match value {
                None => "-".to_owned(),
                Some(bytes) if bytes.len() == 8 && path.ends_with("port") => {
                    i64::from_le_bytes(bytes.try_into().unwrap()).to_string()
                }
                Some(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            };
            let last = segments.last().copied().unwrap_or("none");
            self.set_http_request_header(&format!("x-prop-{last}"), Some(&shown));
        }
        if let Some(key) = &c.shared_counter {
            // Compare-and-swap until it sticks: concurrent workers race here.
            let count = loop {
                let (value, cas) = self.get_shared_data(key);
                let n = value
                    .and_then(|v| String::from_utf8(v).ok())
                    .and_then(|s| s.parse::<u64>().ok())
                    .unwrap_or(0)
                    + 1;
                if self
                    .set_shared_data(key, Some(n.to_string().as_bytes()), cas)
                    .is_ok()
                {
                    break n;
                }
            };
            self.set_http_request_header("x-count", Some(&count.to_string()));
        }
        if let Some(name) = &c.queue {
            if let Some(item) = self.get_http_request_header("x-enqueue")
                && let Ok(Some(id)) = proxy_wasm::hostcalls::resolve_shared_queue("", name)
            {
                proxy_wasm::hostcalls::enqueue_shared_queue(id, Some(item.as_bytes())).ok();
            }
            let (count, _) = self.get_shared_data("queue-items");
            let count = count.map_or("0".to_owned(), |v| String::from_utf8_lossy(&v).into_owned());
            self.set_http_request_header("x-queue-items", Some(&count));
        }
        if let Some(value) = &c.set_property {
            self.set_property(vec!["my", "flag"], Some(value.as_bytes()));
        }
        if starts(&path, &c.deny_prefix) {
            self.send_http_response(
                c.deny_status,
                vec![
                    ("x-denied-by", "proxy-wasm"),
                    ("x-context", &self.id.to_string()),
                ],
                Some(format!("denied {path}\n").as_bytes()),
            );
            return Action::Pause;
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _n: usize, _eos: bool) -> Action {
        if self.config.quiet && self.config.response_header.is_none() {
            return Action::Continue;
        }
        let status = self.get_http_response_header(":status").unwrap_or_default();
        if !self.config.quiet {
            proxy_wasm::hostcalls::log(LogLevel::Info, &format!("#{} status {status}", self.id))
                .ok();
        }
        if let Some((name, value)) = &self.config.response_header {
            self.set_http_response_header(name, Some(&format!("{value} ({status})")));
        }
        if let Some(name) = &self.config.remove_response_header {
            self.set_http_response_header(name, None);
        }
        if self.config.queue.is_some() {
            let (count, _) = self.get_shared_data("queue-items");
            let count = count.map_or("0".to_owned(), |v| String::from_utf8_lossy(&v).into_owned());
            self.set_http_response_header("x-queue-items", Some(&count));
        }
        if self.config.tick_call.is_some() {
            let (last, _) = self.get_shared_data("root-answer-last");
            let last = last.map_or("none".to_owned(), |v| {
                String::from_utf8_lossy(&v).into_owned()
            });
            self.set_http_response_header("x-root-answer", Some(&last));
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if self.config.quiet {
            return;
        }
        proxy_wasm::hostcalls::log(LogLevel::Info, &format!("#{} completed", self.id)).ok();
    }
}

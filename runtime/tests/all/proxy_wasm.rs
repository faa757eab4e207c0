//! proxy-wasm plugins (core modules built with the proxy-wasm crate, as for Envoy) run
//! as filters: lifecycle, header edits, local replies, properties, shared data across
//! instances, metrics, chains mixed with components, and hostile behaviour turned into
//! faults under the failure policy.

use std::sync::Arc;
use std::time::Duration;

use dpumesh_runtime::{
    ChainRunner, Decision, DenyCause, FailureKind, FailurePolicy, FilterChain, FilterSettings,
    LoadError, LoadedFilter, ResponseInfo, Runtime,
};
use dpumesh_test_artifacts as artifacts;
use serde_json::json;

use crate::support::{get, load, runtime, settings};

fn plugin_settings(name: &str, config: serde_json::Value) -> FilterSettings {
    FilterSettings::new(name, config.to_string())
        .namespace("pw-test")
        .deadline(Duration::from_millis(200))
}

fn plugin(rt: &Runtime, name: &str, config: serde_json::Value) -> Arc<LoadedFilter> {
    rt.load_filter(
        plugin_settings(name, config),
        &artifacts::read(artifacts::PROXY_WASM_TEST),
    )
    .expect("the proxy-wasm plugin loads")
}

fn runner(filters: Vec<Arc<LoadedFilter>>) -> ChainRunner {
    ChainRunner::new(Arc::new(FilterChain::new("pw-chain", filters)))
}

fn response(status: u16) -> ResponseInfo {
    ResponseInfo {
        status,
        latency_ns: 1000,
        upstream: None,
        failure: FailureKind::None,
    }
}

#[test]
fn a_plugin_edits_headers_reads_properties_and_replies_locally() {
    let rt = runtime();
    let filter = plugin(
        &rt,
        "pw",
        json!({
            "add_header": ["x-added", "by-plugin"],
            "properties": ["request.path", "source.address", "source.port", "plugin_name", "request.nothing"],
            "deny_prefix": "/admin",
            "deny_status": 403,
        }),
    );
    assert!(filter.is_proxy_wasm());
    assert!(filter.has_response_phase());
    let mut runner = runner(vec![filter]);

    let mut head = get("/items?page=2");
    head.source.addr = "10.0.0.7:4242".parse().unwrap();
    let outcome = runner.on_request(head);
    assert_eq!(outcome.decision, Decision::Continue);
    let head = &outcome.head;
    assert_eq!(head.header("x-added").as_deref(), Some("by-plugin"));
    assert_eq!(head.header("x-prop-path").as_deref(), Some("/items?page=2"));
    assert_eq!(
        head.header("x-prop-address").as_deref(),
        Some("10.0.0.7:4242")
    );
    assert_eq!(head.header("x-prop-port").as_deref(), Some("4242"));
    assert_eq!(head.header("x-prop-plugin_name").as_deref(), Some("pw"));
    assert_eq!(head.header("x-prop-nothing").as_deref(), Some("-"));
    // The response phase finishes the request's context (log, done, delete).
    let ran = outcome.ran;
    let (_, faults) = runner.on_response(outcome.head, &response(200), ran);
    assert!(faults.is_empty(), "{faults:?}");

    let outcome = runner.on_request(get("/admin/users"));
    let Decision::Deny {
        filter,
        reply,
        cause,
    } = &outcome.decision
    else {
        panic!(
            "expected the plugin's local reply, got {:?}",
            outcome.decision
        );
    };
    assert_eq!(&**filter, "pw");
    assert_eq!(*cause, DenyCause::Policy);
    assert_eq!(reply.status, 403);
    assert_eq!(reply.header("x-denied-by"), Some("proxy-wasm"));
    assert_eq!(reply.body, "denied /admin/users\n");
    // Contexts count from 2 (the root is 1), as Envoy numbers them.
    assert!(reply.header("x-context").unwrap().parse::<u32>().unwrap() >= 2);
}

#[test]
fn plugins_and_components_share_one_chain_in_either_order() {
    let rt = runtime();
    let before = load(
        &rt,
        settings(
            "component-before",
            json!({"request": [{"set_header": ["x-from-component", "yes"]}]}),
        ),
    );
    let pw = plugin(
        &rt,
        "pw",
        json!({"properties": ["request.headers.x-from-component"], "set_property": "on"}),
    );
    let after = load(
        &rt,
        settings(
            "component-after",
            json!({"request": [
                {"metadata_to_header": ["wasm.my.flag", "x-flag"]},
                {"deny_if_header": ["x-prop-x-from-component", 418]}
            ]}),
        ),
    );
    let mut runner = runner(vec![before, pw, after]);
    let outcome = runner.on_request(get("/"));
    // The plugin saw the component's edit; the component after it saw the plugin's
    // header edit and its property (as request metadata `wasm.my.flag`).
    let Decision::Deny { filter, reply, .. } = &outcome.decision else {
        panic!(
            "expected the last component to deny, got {:?}",
            outcome.decision
        );
    };
    assert_eq!(&**filter, "component-after");
    assert_eq!(reply.status, 418);
    assert_eq!(
        outcome.head.header("x-prop-x-from-component").as_deref(),
        Some("yes")
    );
    assert_eq!(outcome.head.header("x-flag").as_deref(), Some("on"));
}

#[test]
fn shared_data_compare_and_swap_counts_across_instances() {
    let rt = runtime();
    let filter = plugin(&rt, "pw", json!({"shared_counter": "hits"}));
    // Two runners: two instances, as two workers have.
    let mut a = runner(vec![filter.clone()]);
    let mut b = runner(vec![filter]);
    let mut seen = Vec::new();
    for i in 0..10 {
        let runner = if i % 2 == 0 { &mut a } else { &mut b };
        let outcome = runner.on_request(get("/"));
        seen.push(
            outcome
                .head
                .header("x-count")
                .unwrap()
                .parse::<u32>()
                .unwrap(),
        );
    }
    assert_eq!(seen, (1..=10).collect::<Vec<_>>());
}

#[test]
fn a_refused_configuration_fails_the_load_with_what_the_plugin_said() {
    let rt = runtime();
    let e = rt
        .load_filter(
            plugin_settings("pw", json!({"refuse": true})),
            &artifacts::read(artifacts::PROXY_WASM_TEST),
        )
        .unwrap_err();
    let LoadError::Configure { message, .. } = &e else {
        panic!("{e:?}");
    };
    assert!(
        message.contains("proxy_on_configure returned false"),
        "{message}"
    );
    assert!(
        message.contains("configuration refused on purpose"),
        "{message}"
    );
    let e = rt
        .load_filter(
            plugin_settings("pw", json!({"no_such_key": 1})),
            &artifacts::read(artifacts::PROXY_WASM_TEST),
        )
        .unwrap_err();
    assert!(e.to_string().contains("bad configuration"), "{e}");
}

#[test]
fn hostile_plugins_fault_under_the_failure_policy_and_the_next_request_is_served() {
    let rt = runtime();
    let filter = plugin(
        &rt,
        "pw",
        json!({
            "panic_prefix": "/panic",
            "spin_prefix": "/spin",
            "sleep_prefix": "/sleep",
            "bad_pointer_prefix": "/pointer",
            "add_header": ["x-ok", "1"],
        }),
    );
    let mut runner = runner(vec![filter]);
    for (path, said) in [
        ("/panic", "asked to panic on /panic"),
        ("/spin", "deadline"),
        // A sleep would hold a thread that serves other requests: it traps.
        ("/sleep", "poll_oneoff"),
        ("/pointer", "outside the module's memory"),
    ] {
        let outcome = runner.on_request(get(path));
        let Decision::Deny { reply, cause, .. } = &outcome.decision else {
            panic!("{path}: expected a fault, got {:?}", outcome.decision);
        };
        let DenyCause::Fault(fault) = cause else {
            panic!("{path}: expected a fault, got {cause:?}");
        };
        assert_eq!(reply.status, 500, "{path}");
        assert!(fault.to_string().contains(said), "{path}: {fault}");
        // A faulted instance is replaced: the next request is served.
        runner.repair();
        let outcome = runner.on_request(get("/fine"));
        assert_eq!(outcome.decision, Decision::Continue, "after {path}");
        assert_eq!(outcome.head.header("x-ok").as_deref(), Some("1"));
    }
    // Fail-open skips the plugin instead.
    let open = rt
        .load_filter(
            plugin_settings("pw-open", json!({"panic_prefix": "/panic"}))
                .failure_policy(FailurePolicy::FailOpen),
            &artifacts::read(artifacts::PROXY_WASM_TEST),
        )
        .unwrap();
    let outcome = runner_for(open).on_request(get("/panic"));
    assert_eq!(outcome.decision, Decision::Continue);
}

fn runner_for(filter: Arc<LoadedFilter>) -> ChainRunner {
    runner(vec![filter])
}

/// A core module exporting one empty function named `export`.
fn module_exporting(export: &str) -> Vec<u8> {
    let mut m = b"\0asm\x01\0\0\0".to_vec();
    m.extend([0x01, 0x04, 0x01, 0x60, 0x00, 0x00]); // type: () -> ()
    m.extend([0x03, 0x02, 0x01, 0x00]); // one function of type 0
    let mut export_section = vec![0x01, export.len() as u8];
    export_section.extend(export.as_bytes());
    export_section.extend([0x00, 0x00]); // function 0
    m.push(0x07);
    m.push(export_section.len() as u8);
    m.extend(export_section);
    m.extend([0x0a, 0x04, 0x01, 0x02, 0x00, 0x0b]); // body: end
    m
}

#[test]
fn modules_that_are_not_proxy_wasm_0_2_are_refused_by_name() {
    let rt = runtime();
    let load = |bytes: Vec<u8>| {
        rt.load_filter(FilterSettings::new("m", ""), &bytes)
            .unwrap_err()
            .to_string()
    };
    let e = load(module_exporting("run"));
    assert!(e.contains("not a proxy-wasm plugin"), "{e}");
    let e = load(module_exporting("proxy_abi_version_0_1_0"));
    assert!(e.contains("ABI 0.1.0"), "{e}");
    let e = load(module_exporting("proxy_abi_version_0_2_1"));
    assert!(e.contains("exports no memory"), "{e}");
    let e = load(b"\0asm\x01\0\0\0\xff\xff".to_vec());
    assert!(e.contains("compile"), "{e}");
}

#[test]
fn ticks_run_at_the_plugins_period_between_requests_on_the_owning_thread() {
    let rt = runtime();
    let filter = plugin(&rt, "pw-ticks", json!({"tick_ms": 20}));
    let ticks = || {
        rt.services()
            .state
            .namespace("pw-test")
            .get_bytes("ticks")
            .unwrap()
            .map_or(0, |(v, _)| {
                std::str::from_utf8(&v).unwrap().parse::<u64>().unwrap()
            })
    };
    let mut runner = runner(vec![filter]);
    let start = std::time::Instant::now();
    let first = runner.tick(start).expect("the plugin asked for ticks");
    // The first is due one period after the instance started ticking.
    assert!(first > start && first <= start + Duration::from_millis(20));
    assert_eq!(ticks(), 0);
    // Driven as a worker drives them: wait until due, tick, repeat.
    let mut due = first;
    for _ in 0..5 {
        std::thread::sleep(due.saturating_duration_since(std::time::Instant::now()));
        due = runner.tick(std::time::Instant::now()).unwrap();
    }
    assert_eq!(ticks(), 5);
    // A tick not yet due runs nothing.
    runner.tick(std::time::Instant::now());
    assert_eq!(ticks(), 5);
    // Requests are served between ticks.
    assert_eq!(runner.on_request(get("/")).decision, Decision::Continue);
}

#[test]
fn an_idle_pool_worker_runs_its_plugins_ticks() {
    let rt = runtime();
    let filter = plugin(&rt, "pw-ticks", json!({"tick_ms": 10}));
    let chain = Arc::new(FilterChain::new("ticking", vec![filter]));
    let generation = dpumesh_runtime::Generation::new(1, vec![chain]);
    let pool = dpumesh_runtime::WorkerPool::start(generation, 1).expect("pool starts");
    let ticks = || {
        rt.services()
            .state
            .namespace("pw-test")
            .get_bytes("ticks")
            .unwrap()
            .map_or(0, |(v, _)| {
                std::str::from_utf8(&v).unwrap().parse::<u64>().unwrap()
            })
    };
    // No request at all: the worker's wait is bounded by the next tick.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while ticks() < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "only {} ticks",
            ticks()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(pool);
}

#[test]
fn a_plugin_edits_the_response_headers_it_is_given() {
    let rt = runtime();
    let filter = plugin(
        &rt,
        "pw",
        json!({"response_header": ["powered-by", "proxy-wasm"], "remove_response_header": "server"}),
    );
    let chain = FilterChain::new("pw-chain", vec![filter]);
    assert!(chain.edits_responses());
    let mut runner = ChainRunner::new(Arc::new(chain));
    let outcome = runner.on_request(get("/"));
    let mut headers = dpumesh_runtime::ResponseHeaders {
        fields: vec![
            ("server".into(), b"hotel".to_vec()),
            ("content-type".into(), b"text/plain".to_vec()),
        ],
        edited: false,
    };
    let (_, faults) = runner.on_response_editing(
        outcome.head,
        &response(201),
        outcome.ran,
        Some(&mut headers),
    );
    assert!(faults.is_empty(), "{faults:?}");
    assert!(headers.edited);
    assert_eq!(
        headers.fields,
        vec![
            ("content-type".to_owned(), b"text/plain".to_vec()),
            ("powered-by".to_owned(), b"proxy-wasm (201)".to_vec()),
        ]
    );
    // Without headers to edit (a response phase that cannot change the response),
    // the plugin's edit is a no-op for the proxy, not a fault.
    let outcome = runner.on_request(get("/"));
    let (_, faults) = runner.on_response(outcome.head, &response(200), outcome.ran);
    assert!(faults.is_empty(), "{faults:?}");
}

fn shared_count(rt: &Runtime, key: &str) -> u64 {
    rt.services()
        .state
        .namespace("pw-test")
        .get_bytes(key)
        .unwrap()
        .map_or(0, |(v, _)| {
            std::str::from_utf8(&v).unwrap().parse::<u64>().unwrap()
        })
}

#[test]
fn an_endless_on_tick_is_a_fault_and_the_instance_is_replaced() {
    let rt = runtime();
    let filter = plugin(&rt, "pw-spin", json!({"tick_ms": 10, "spin_tick": true}));
    let mut runner = runner(vec![filter]);
    let due = runner
        .tick(std::time::Instant::now())
        .expect("ticks asked for");
    std::thread::sleep(due.saturating_duration_since(std::time::Instant::now()));
    let started = std::time::Instant::now();
    // The endless tick is stopped at the filter's 200 ms CPU deadline.
    runner.tick(std::time::Instant::now());
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(runner.instances(), 0, "the faulted instance is gone");
    runner.repair();
    assert_eq!(runner.instances(), 1);
    assert_eq!(runner.on_request(get("/")).decision, Decision::Continue);
}

#[test]
fn a_retired_runner_ends_its_plugins_roots_and_a_faulted_instance_is_not_reentered() {
    let rt = runtime();
    let filter = plugin(&rt, "pw", json!({"panic_prefix": "/panic"}));
    let runner1 = runner(vec![filter.clone()]);
    assert_eq!(shared_count(&rt, "root-done"), 0);
    drop(runner1);
    assert_eq!(shared_count(&rt, "root-done"), 1);

    let mut runner2 = runner(vec![filter]);
    let outcome = runner2.on_request(get("/panic"));
    assert!(outcome.decision.reply().is_some());
    // The trapped instance was dropped without running guest code again.
    drop(runner2);
    assert_eq!(shared_count(&rt, "root-done"), 1);
}

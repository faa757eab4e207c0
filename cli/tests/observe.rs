//! What an operator sees of the hotel mesh under `dpumesh up`: the golden metrics per
//! edge against the load generator's own counts, `dpumesh tap` showing a 5xx as it
//! happens, the access log's lines, and the tap's door (token, redaction).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;
use common::mesh::*;
use common::token;

/// The sum of `dpumesh_requests_total` samples over every node whose labels
/// include all of `labels`.
fn edge_count(admins: &[SocketAddr], labels: &[(&str, &str)]) -> f64 {
    admins
        .iter()
        .map(|admin| {
            let (_, text) = admin_get(*admin, "/metrics");
            text.lines()
                .filter(|l| l.starts_with("dpumesh_requests_total{"))
                .filter(|l| {
                    labels
                        .iter()
                        .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
        })
        .sum()
}

#[test]
fn golden_metrics_match_the_load_tap_shows_a_5xx_within_a_second_and_the_access_log_has_each_request()
 {
    let mesh = Mesh::up_edited(
        |m| m,
        |p| format!("{p}\naccess_log: {{path: 'access-{{node}}.jsonl', sample: 1}}\n"),
    );
    let dir = mesh._dir.path().to_owned();
    let user = token("alice", &["user"]);

    // The tap first: 5xx only, from every node of the mesh file.
    let mut tap = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
        .args(["tap", "--json", "--status", "5xx", "--mesh"])
        .arg(dir.join("mesh.yaml"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("dpumesh tap starts");
    let (lines_tx, lines) = mpsc::channel::<(Instant, String)>();
    let out = tap.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = lines_tx.send((Instant::now(), line));
        }
    });
    let admins = mesh.admins();
    wait(
        "the tap to open on every node",
        Duration::from_secs(20),
        &|| {
            admins
                .iter()
                .all(|a| metric_sum(*a, "dpumesh_taps_open") >= 1.0)
        },
    );

    // The load: hotels (ingress → frontend, and frontend's calls to user and
    // reservation), denials (no token), one failing request.
    let client = mesh.client();
    let (mut hotels, mut denied) = (0, 0);
    for i in 0..150 {
        if client.status(&format!("/hotels?user={}", i % 7), Some(&user)) == 200 {
            hotels += 1;
        }
        if i % 3 == 0 && client.status("/hotels?user=1", None) == 401 {
            denied += 1;
        }
    }
    assert_eq!(hotels, 150);
    assert_eq!(denied, 50);
    let (status, _, _) = client.get("/flaky?fail=1&access_token=leaked", Some(&user));
    let answered = Instant::now();
    assert_eq!(status, 500);

    // The 5xx on the tap, within a second of its answer, with nothing secret in it.
    let (at, line) = loop {
        let (at, line) = lines
            .recv_timeout(Duration::from_secs(5))
            .expect("the 5xx reaches the tap");
        if !line.trim().is_empty() {
            break (at, line);
        }
    };
    assert!(
        at.saturating_duration_since(answered) < Duration::from_secs(1),
        "the tap showed it {:?} after the answer",
        at - answered
    );
    let record: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(record["status"], 500, "{record}");
    assert_eq!(record["service"], "flaky");
    assert_eq!(record["source"], "ingress");
    assert_eq!(record["verdict"], "allowed");
    assert_eq!(record["path"], "/flaky?fail=1&access_token=[redacted]");
    assert!(
        !line.contains(&user),
        "the token leaked into the tap: {line}"
    );
    assert!(!line.contains("leaked"), "{line}");
    let filters: Vec<&str> = record["filters"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f["filter"].as_str())
        .collect();
    assert_eq!(filters, ["trace", "jwt", "rbac", "ratelimit", "breaker"]);
    // Only the 5xx matched.
    assert!(lines.try_iter().all(|(_, l)| l.trim().is_empty()));
    let _ = tap.kill();
    let _ = tap.wait();
    wait("the tap to close", Duration::from_secs(10), &|| {
        admins
            .iter()
            .all(|a| metric_sum(*a, "dpumesh_taps_open") == 0.0)
    });

    // Each edge counted as the load generator counted it (within 2 %: here exactly).
    let within = |got: f64, want: f64| (got - want).abs() <= want * 0.02;
    let into_frontend_ok = edge_count(
        &admins,
        &[
            ("source", "ingress"),
            ("destination", "frontend"),
            ("class", "2xx"),
        ],
    );
    let into_frontend_denied = edge_count(
        &admins,
        &[
            ("source", "ingress"),
            ("destination", "frontend"),
            ("class", "4xx"),
        ],
    );
    let to_user = edge_count(&admins, &[("source", "frontend"), ("destination", "user")]);
    let to_reservation = edge_count(
        &admins,
        &[("source", "frontend"), ("destination", "reservation")],
    );
    let flaky = edge_count(
        &admins,
        &[
            ("source", "ingress"),
            ("destination", "flaky"),
            ("class", "5xx"),
        ],
    );
    assert!(within(into_frontend_ok, 150.0), "{into_frontend_ok}");
    assert!(within(into_frontend_denied, 50.0), "{into_frontend_denied}");
    assert!(within(to_user, 150.0), "frontend → user: {to_user}");
    assert!(
        within(to_reservation, 150.0),
        "frontend → reservation: {to_reservation}"
    );
    assert_eq!(flaky, 1.0);
    // Mesh calls name their route `call`; the ingress's, their route.
    assert!(edge_count(&admins, &[("destination", "user"), ("route", "call")]) >= 150.0);
    assert!(edge_count(&admins, &[("destination", "frontend"), ("route", "*/")]) >= 200.0);

    // The access log: a line per request where its chain ran (node1), none secret.
    let log = dir.join("access-node1.jsonl");
    let mut text = String::new();
    wait("the access log", Duration::from_secs(10), &|| {
        let t = std::fs::read_to_string(&log).unwrap_or_default();
        t.lines().count() >= 150 + 50 + 1 + 300
    });
    text.push_str(&std::fs::read_to_string(&log).unwrap());
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    let count = |f: &dyn Fn(&serde_json::Value) -> bool| lines.iter().filter(|l| f(l)).count();
    assert_eq!(
        count(&|l| l["service"] == "frontend" && l["response_code"] == 200),
        150
    );
    assert_eq!(
        count(&|l| l["response_code"] == 401 && l["denied_by"] == "jwt"),
        50
    );
    assert_eq!(count(&|l| l["service"] == "user"), 150);
    assert!(!text.contains(&user), "a token in the access log");
    assert!(
        lines
            .iter()
            .all(|l| l["start_time"].as_str().is_some_and(|t| t.ends_with('Z')))
    );
}

#[test]
fn a_tap_needs_the_admin_token_and_refuses_bad_queries() {
    let mesh = Mesh::up();
    let admin = mesh.admins()[0];
    let (status, body) = admin_get(admin, "/tap");
    assert_eq!(status, 401, "{body}");
    let token = mesh.admin_token();
    let call = |path: &str| try_admin_call_with_token(admin, path, &token);
    let (status, body) = call("/tap?status=6xx");
    assert_eq!(status, 400);
    assert!(body.contains("status"), "{body}");
    let (status, body) = call("/tap?colour=red");
    assert_eq!(status, 400);
    assert!(body.contains("colour"), "{body}");
}

/// GET `path` with the admin token, the whole answer (not a stream).
fn try_admin_call_with_token(admin: SocketAddr, path: &str, token: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(admin).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: {admin}\r\nauthorization: Bearer {token}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// The dashboard under load, in headless Chromium: the service graph with the
/// ingress → frontend edge, a chart per service with points, and a tap stream of 5xx.
#[test]
fn the_dashboard_draws_the_graph_the_charts_and_a_tap_stream_under_load() {
    let mesh = Mesh::up();
    let pm = mesh.pingmesh.expect("the hotel mesh runs the dashboard");
    let user = token("bob", &["user"]);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let load = load(&mesh, "/hotels?user=3", &user, 2, &stop, &served);
    // 5xx beside it: the flaky service failing (then its breaker answering 503).
    let failing = {
        let (client, stop, user) = (mesh.client(), stop.clone(), user.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = client.try_raw(
                    format!("GET /flaky?fail=1 HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {user}\r\nconnection: close\r\n\r\n").as_bytes(),
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    // The tap the page will show, opened through the dashboard's API first so its
    // records are there when the page loads.
    let dashboard = |path: &str| {
        let (status, body) = common::http_get(pm, path);
        assert_eq!(status, 200, "{path}: {body}");
        serde_json::from_str::<serde_json::Value>(&body).unwrap()
    };
    wait(
        "5xx on the dashboard's tap",
        Duration::from_secs(20),
        &|| {
            dashboard("/v1/tap?status=5xx")["records"]
                .as_array()
                .is_some_and(|r| !r.is_empty())
        },
    );
    wait(
        "a few samples for the charts",
        Duration::from_secs(30),
        &|| {
            dashboard("/v1/history")["services"]["frontend"]
                .as_array()
                .is_some_and(|p| p.len() >= 3)
        },
    );
    let url = format!("http://{pm}/?tap=1&status=5xx");
    let dom = common::browser_dom(&url, 3_000);
    let shot = common::browser_screenshot(&url, 3_000);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut ok = 0;
    for l in load {
        let (n, failed, _) = l.join().unwrap();
        assert!(failed.is_empty(), "{failed:?}");
        ok += n;
    }
    let _ = failing.join();
    // The graph's edge counts what the load generator counted (within 2 %), once the
    // dashboard looked again after the load stopped.
    let edge = |graph: &serde_json::Value| {
        graph["graph"]["edges"]
            .as_array()
            .and_then(|edges| {
                edges
                    .iter()
                    .find(|e| e["source"] == "ingress" && e["destination"] == "frontend")
            })
            .and_then(|e| e["requests_total"].as_f64())
            .unwrap_or(0.0)
    };
    wait(
        "the graph to count every request",
        Duration::from_secs(20),
        &|| (edge(&dashboard("/v1/mesh")) - ok as f64).abs() <= ok as f64 * 0.02,
    );
    let Some(dom) = dom else {
        return;
    };
    assert!(dom.contains("data-errors=\"0\""), "no script errors: {dom}");
    let rps: f64 = dom
        .split("class=\"edge\" data-src=\"ingress\" data-dst=\"frontend\" data-rps=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next()?.parse().ok())
        .unwrap_or_else(|| panic!("the graph has ingress → frontend: {dom}"));
    assert!(rps > 0.0, "{dom}");
    assert!(dom.contains("data-node=\"reservation\""), "{dom}");
    assert!(
        dom.contains("class=\"chart-row\" data-service=\"frontend\""),
        "a chart row for frontend: {dom}"
    );
    assert!(
        dom.contains("data-status=\"50"),
        "a 5xx in the tap table: {dom}"
    );
    if let Some(png) = shot {
        assert!(png.len() > 10_000, "a screenshot of the page");
        let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
        std::fs::write(&out, png).unwrap();
        eprintln!("dashboard screenshot: {}", out.display());
    }
}

/// Spans received, with their resource's `service.name`.
type Received =
    std::sync::Arc<std::sync::Mutex<Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)>>>;

/// A minimal OTLP/HTTP receiver: decodes each `POST /v1/traces` body as an
/// `ExportTraceServiceRequest` and keeps its spans.
fn otlp_receiver() -> (SocketAddr, Received) {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message;
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let spans = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = spans.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let kept = kept.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut length = 0;
                let mut request_line = String::new();
                reader.read_line(&mut request_line).unwrap();
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).unwrap();
                let mut conn = conn;
                let decoded = ExportTraceServiceRequest::decode(&body[..]);
                let status = if request_line.starts_with("POST /v1/traces ") && decoded.is_ok() {
                    "200 OK"
                } else {
                    "400 Bad Request"
                };
                let _ = conn.write_all(
                    format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n").as_bytes(),
                );
                if let Ok(request) = decoded {
                    for rs in request.resource_spans {
                        let service = rs
                            .resource
                            .iter()
                            .flat_map(|r| &r.attributes)
                            .find(|a| a.key == "service.name")
                            .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                                opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s) => Some(s.clone()),
                                _ => None,
                            })
                            .unwrap_or_default();
                        for ss in rs.scope_spans {
                            for span in ss.spans {
                                kept.lock().unwrap().push((service.clone(), span));
                            }
                        }
                    }
                }
            });
        }
    });
    (addr, spans)
}

#[test]
fn a_hotel_request_leaves_one_span_tree_from_the_ingress_through_proxies_and_services() {
    let (collector, spans) = otlp_receiver();
    let dir = tempfile::tempdir().unwrap();
    let (file, ingress) = mesh_files(dir.path(), |m| m);
    let endpoint = format!("http://{collector}");
    let mesh = Mesh::start_env(
        dir,
        &file,
        ingress,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            // New traces unsampled: only the client's sampled trace is exported.
            ("OTEL_TRACES_SAMPLER_ARG", "0"),
        ],
    );
    let user = token("carol", &["user"]);
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let request = format!(
        "GET /hotels?user=4 HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {user}\r\ntraceparent: 00-{trace}-{client_span}-01\r\nconnection: close\r\n\r\n"
    );
    let (status, _, _) = mesh.raw(request.as_bytes());
    assert_eq!(status, 200);
    // Unsampled traffic beside it leaves no span.
    for _ in 0..20 {
        assert_eq!(mesh.client().status("/hotels?user=5", Some(&user)), 200);
    }
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let want = [
        "dpumesh.ingress GET",
        "dpumesh.proxy frontend */",
        "GET /hotels",
        "dpumesh.proxy user call",
        "dpumesh.proxy reservation call",
        "GET /user",
        "GET /reservations",
    ];
    wait(
        "the request's spans at the collector",
        Duration::from_secs(20),
        &|| {
            let got = spans.lock().unwrap();
            want.iter().all(|w| got.iter().any(|(_, s)| s.name == *w))
        },
    );
    std::thread::sleep(Duration::from_secs(1));
    let got = spans.lock().unwrap().clone();
    assert!(
        got.iter().all(|(_, s)| hex(&s.trace_id) == trace),
        "only the sampled trace is exported: {:?}",
        got.iter()
            .map(|(_, s)| (&s.name, hex(&s.trace_id)))
            .collect::<Vec<_>>()
    );
    let find = |name: &str| {
        got.iter()
            .find(|(_, s)| s.name == name)
            .map(|(svc, s)| (svc.clone(), s.clone()))
            .unwrap_or_else(|| {
                panic!(
                    "no span {name}: {:?}",
                    got.iter().map(|(_, s)| &s.name).collect::<Vec<_>>()
                )
            })
    };
    let (ingress_svc, ingress) = find("dpumesh.ingress GET");
    let (node_svc, proxy) = find("dpumesh.proxy frontend */");
    let (frontend_svc, frontend) = find("GET /hotels");
    assert_eq!(ingress_svc, "dpumesh-ingress");
    assert_eq!(node_svc, "dpumesh-node");
    assert_eq!(frontend_svc, "frontend");
    assert_eq!(hex(&ingress.parent_span_id), client_span);
    assert_eq!(proxy.parent_span_id, ingress.span_id);
    assert_eq!(frontend.parent_span_id, proxy.span_id);
    // The chain's filters are events of the proxy's span.
    let events: Vec<&str> = proxy.events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        events,
        [
            "filter trace",
            "filter jwt",
            "filter rbac",
            "filter ratelimit",
            "filter breaker"
        ]
    );
    // Each call: the frontend's client span → the node's span for it → the service.
    for (call, server) in [("user", "GET /user"), ("reservation", "GET /reservations")] {
        let (_, hop) = find(&format!("dpumesh.proxy {call} call"));
        let egress = got
            .iter()
            .map(|(_, s)| s)
            .find(|s| s.span_id == hop.parent_span_id)
            .unwrap_or_else(|| panic!("the {call} hop's parent is a span of the trace"));
        assert!(egress.name.starts_with("egress"), "{}", egress.name);
        assert_eq!(egress.parent_span_id, frontend.span_id);
        let (svc, served) = find(server);
        assert_eq!(svc, call);
        assert_eq!(served.parent_span_id, hop.span_id);
    }
    // The frontend's internal step (the merge) is a child of its span too.
    assert!(
        got.iter()
            .any(|(_, s)| s.name.starts_with("internal") && s.parent_span_id == frontend.span_id),
        "an internal step span"
    );
}

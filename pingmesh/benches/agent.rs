//! What an agent costs (issue 20's goal: ≤ 1 % of a core per node at 10 probes/s per
//! target with 50 targets).
//!
//! Two measurements from /proc over 20 s each, the measured agent in a child process
//! (this program again): (1) the prober — its pinglist is 50 responder-only agents
//! (one 5-tuple each, every 100 ms: 500 probes/s), its CPU is sending, ACKs and
//! uploads; (2) the responder — one agent alone with the server in this process,
//! probed along many 5-tuples; its CPU over its idle CPU, per answer. A node that
//! probes 50 targets and answers 50 probers costs the first plus 500 answers/s plus
//! its idle share (the idle figure includes the server's, so it is an upper bound).
//!
//! `cargo bench -p dpumesh-pingmesh --bench agent`

use std::sync::Arc;
use std::time::{Duration, Instant};

use dpumesh_clock::SystemClock;
use dpumesh_dpa::fabric::soft::SoftFabric;
use dpumesh_pingmesh::agent::{Agent, AgentConfig};
use dpumesh_pingmesh::analyzer::AnalyzerPolicy;
use dpumesh_pingmesh::pinglist::PinglistPolicy;
use dpumesh_pingmesh::server::{Server, ServerConfig};

const TARGETS: usize = 50;
const ROLE: &str = "DPUMESH_BENCH_AGENT_CONTROLLER";
const TWO_ACKS: &str = "DPUMESH_BENCH_AGENT_TWO_ACKS";

fn agent(
    controller: &str,
    name: &str,
    tor: &str,
    bind: &str,
    probe: bool,
    two_acks: bool,
) -> Agent {
    Agent::start(
        SoftFabric::new(),
        AgentConfig {
            agent_id: name.into(),
            tor_id: tor.into(),
            bind: bind.parse().unwrap(),
            agent_ip: "127.0.0.1".into(),
            controller: controller.into(),
            analyzer: controller.into(),
            tls: None,
            refresh_every: Duration::from_secs(2),
            upload_every: Duration::from_secs(1),
            connections: None,
            trace_every: None,
            probe,
            two_acks,
            clock: Arc::new(SystemClock::new()),
        },
    )
    .unwrap()
}

/// CPU seconds (user + system) of process `pid` ("self" for this one).
fn cpu(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command's closing parenthesis; utime and stime are 14 and 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

fn server(inter_tor_targets: usize, ecmp_paths: u32) -> Server {
    Server::start(ServerConfig {
        grpc: "127.0.0.1:0".parse().unwrap(),
        http: "127.0.0.1:0".parse().unwrap(),
        registry: None,
        pinglist: PinglistPolicy {
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(500),
            inter_tor_targets,
            ecmp_paths,
            coverage: 0.5,
            rotate_every: Duration::from_secs(3600),
        },
        ttl: Duration::from_secs(30),
        analyzer: AnalyzerPolicy {
            window: Duration::from_secs(120),
            ..AnalyzerPolicy::default()
        },
        nodes: Vec::new(),
        tls: None,
        clock: Arc::new(SystemClock::new()),
    })
    .unwrap()
}

/// Runs the measured prober in a child process for 20 s against `server`; its CPU
/// share, this process's CPU share meanwhile, and the probes completed per second.
fn measure(server: &Server, two_acks: bool) -> (f64, f64, f64) {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .env(ROLE, server.grpc_url())
        .env(TWO_ACKS, if two_acks { "1" } else { "0" })
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    std::thread::sleep(Duration::from_secs(6));
    let probes0 = server.analyzer().report().probes;
    let (p0, s0, t0) = (cpu(&pid), cpu("self"), Instant::now());
    std::thread::sleep(Duration::from_secs(20));
    let secs = t0.elapsed().as_secs_f64();
    let (p1, s1) = (cpu(&pid), cpu("self"));
    // The last second's results are uploaded a second later.
    std::thread::sleep(Duration::from_millis(1500));
    let probes = server.analyzer().report().probes - probes0;
    let _ = child.kill();
    let _ = child.wait();
    ((p1 - p0) / secs, (s1 - s0) / secs, probes as f64 / secs)
}

/// What one way of answering costs.
struct Figures {
    rate: f64,
    prober: f64,
    per_answer: f64,
    answers: f64,
    idle: f64,
    node: f64,
}

fn run(two_acks: bool) -> Figures {
    // The prober: 50 targets, one 5-tuple each.
    let wide = server(TARGETS, 1);
    let url = wide.grpc_url();
    let responders: Vec<Agent> = (1..=TARGETS)
        .map(|i| {
            agent(
                &url,
                &format!("r{i}"),
                "tor-r",
                &format!("127.0.3.{i}:0"),
                false,
                two_acks,
            )
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    let (prober, _, rate) = measure(&wide, two_acks);
    drop(responders);
    drop(wide);

    // The responder: one agent answering one prober's many 5-tuples (formula (1) for
    // 64 paths at coverage 0.5), alone in this process with the server.
    let narrow = server(1, 64);
    let one = agent(
        &narrow.grpc_url(),
        "r",
        "tor-r",
        "127.0.4.1:0",
        false,
        two_acks,
    );
    std::thread::sleep(Duration::from_secs(3));
    let (c0, t0) = (cpu("self"), Instant::now());
    std::thread::sleep(Duration::from_secs(10));
    let idle = (cpu("self") - c0) / t0.elapsed().as_secs_f64();
    let (_, busy, answers) = measure(&narrow, two_acks);
    drop(one);
    let per_answer = (busy - idle).max(0.0) / answers.max(1.0);
    Figures {
        rate,
        prober,
        per_answer,
        answers,
        idle,
        node: prober + 500.0 * per_answer + idle,
    }
}

fn main() {
    if let Ok(controller) = std::env::var(ROLE) {
        let two_acks = std::env::var(TWO_ACKS).is_ok_and(|v| v == "1");
        let _a = agent(
            &controller,
            "measured",
            "tor-m",
            "127.0.2.1:0",
            true,
            two_acks,
        );
        std::thread::sleep(Duration::from_secs(3600));
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // Both ways in one run: the paper's two ACKs (what a NIC's fabric needs) as the
    // baseline, then one ACK carrying the delay (the software fabric's default).
    for (name, two_acks) in [("two ACKs (baseline)", true), ("one ACK", false)] {
        let f = run(two_acks);
        println!("agent overhead, {name}, {TARGETS} targets at 100 ms (500 probes/s):");
        println!("  probes completed      {:.0}/s", f.rate);
        println!(
            "  prober process        {:.3} % of a core (sending, ACKs, uploads)",
            f.prober * 100.0
        );
        println!(
            "  answering             {:.2} µs CPU per answer ({:.0} answers/s measured; idle agent + server {:.3} %)",
            f.per_answer * 1e6,
            f.answers,
            f.idle * 100.0
        );
        println!(
            "  a node that probes 50 targets and answers 50 probers (500/s each way): {:.3} % of a core (goal ≤ 1 %)",
            f.node * 100.0
        );
    }
}

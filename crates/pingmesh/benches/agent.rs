//! What an agent costs (issue 20's goal: ≤ 1 % of a core per node at 10 probes/s per
//! target with 50 targets).
//!
//! Two measurements from /proc over 20 s each, the measured agent alone in a child
//! process (this program again), the server and the other agents in this one:
//! (1) the prober — its pinglist is 50 responder-only agents (one 5-tuple each, every
//! 100 ms: 500 probes/s); its CPU is sending, reading the ACKs, uploading, and its
//! idle work (registration, pinglists); (2) the responder — a responder-only agent
//! probed by one prober here along many 5-tuples (thousands of probes a second); its
//! CPU per answer, its idle work included. A node that probes 50 targets and answers
//! 50 probers costs the first plus 500 answers a second at the second's price.
//!
//! Both ACK schemes in one run: the paper's two ACKs (the baseline: what a NIC's
//! fabric needs) and one ACK carrying the responder's delay.
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
const PART: &str = "DPUMESH_BENCH_AGENT_PART";

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
            ..PinglistPolicy::default()
        },
        ttl: Duration::from_secs(30),
        analyzer: AnalyzerPolicy {
            window: Duration::from_secs(120),
            ..AnalyzerPolicy::default()
        },
        nodes: Vec::new(),
        admin_token: None,
        tls: None,
        known: Default::default(),
        clock: Arc::new(SystemClock::new()),
    })
    .unwrap()
}

/// The measured agent's part.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Prober,
    Responder,
}

/// Runs the measured agent in a child process for 20 s against `server`; its CPU
/// share, the probes completed per second (as the analyzer counted them), and this
/// process's CPU share meanwhile (the server and the agents on the other side).
fn measure(server: &Server, part: Part, two_acks: bool) -> (f64, f64, f64) {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .env(ROLE, server.grpc_url())
        .env(TWO_ACKS, if two_acks { "1" } else { "0" })
        .env(
            PART,
            if part == Part::Prober {
                "prober"
            } else {
                "responder"
            },
        )
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    std::thread::sleep(Duration::from_secs(6));
    let probes0 = server.analyzer().report().probes;
    let (p0, here0, t0) = (cpu(&pid), cpu("self"), Instant::now());
    std::thread::sleep(Duration::from_secs(20));
    let secs = t0.elapsed().as_secs_f64();
    let (p1, here1) = (cpu(&pid), cpu("self"));
    // The last second's results are uploaded a second later.
    std::thread::sleep(Duration::from_millis(1500));
    let probes = server.analyzer().report().probes - probes0;
    let _ = child.kill();
    let _ = child.wait();
    (
        (p1 - p0) / secs,
        probes as f64 / secs,
        (here1 - here0) / secs,
    )
}

/// What one way of answering costs.
struct Figures {
    rate: f64,
    prober: f64,
    /// The 50 responders probed by the measured prober, and the server.
    others: f64,
    per_answer: f64,
    answers: f64,
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
    let (prober, rate, others) = measure(&wide, Part::Prober, two_acks);
    drop(responders);
    drop(wide);

    // The responder: probed by one prober here along many 5-tuples (formula (1) for
    // 64 paths at coverage 0.5).
    let narrow = server(1, 64);
    let prober_here = agent(
        &narrow.grpc_url(),
        "p",
        "tor-p",
        "127.0.4.1:0",
        true,
        two_acks,
    );
    let (responder, answers, _) = measure(&narrow, Part::Responder, two_acks);
    drop(prober_here);
    let per_answer = responder / answers.max(1.0);
    Figures {
        rate,
        prober,
        others,
        per_answer,
        answers,
        node: prober + 500.0 * per_answer,
    }
}

fn main() {
    if let Ok(controller) = std::env::var(ROLE) {
        let two_acks = std::env::var(TWO_ACKS).is_ok_and(|v| v == "1");
        let prober = std::env::var(PART).is_ok_and(|v| v == "prober");
        let _a = if prober {
            agent(
                &controller,
                "measured",
                "tor-m",
                "127.0.2.1:0",
                true,
                two_acks,
            )
        } else {
            agent(
                &controller,
                "measured",
                "tor-m",
                "127.0.2.2:0",
                false,
                two_acks,
            )
        };
        std::thread::sleep(Duration::from_secs(3600));
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    for (name, two_acks) in [("two ACKs (baseline)", true), ("one ACK", false)] {
        let f = run(two_acks);
        println!("agent overhead, {name}, {TARGETS} targets at 100 ms (500 probes/s):");
        println!("  probes completed      {:.0}/s", f.rate);
        println!(
            "  prober process        {:.3} % of a core (sending, ACKs, uploads, idle work)",
            f.prober * 100.0
        );
        // On loopback the kernel charges waking a receiver to the sender's `sendto`:
        // a prober whose responders sleep until a probe comes pays their wake-ups.
        println!(
            "  its 50 responders and the server, meanwhile: {:.3} % of a core (the prober pays their wake-ups on loopback)",
            f.others * 100.0
        );
        println!(
            "  responder process     {:.2} µs CPU per answer ({:.0} answers/s measured)",
            f.per_answer * 1e6,
            f.answers,
        );
        println!(
            "  a node that probes 50 targets and answers 50 probers (500/s each way): {:.3} % of a core (goal ≤ 1 %)",
            f.node * 100.0
        );
    }
}

//! The `dpumesh` command: one binary for every role and tool.
//!
//! - `up` starts a whole local mesh (nodes, services, ingress) as processes; `node` and
//!   `ingress` run one role each (what `up` starts).
//! - `proxy` runs the DPU proxy's policy on its own, from a config file, with the admin
//!   API and a loopback listener.
//! - `filter new|build|test`: write, build and prove a filter in Rust, Python, JS or C.
//! - `bench dpa`: the data path against its baselines; `check` and `demo`: load a
//!   filter component and run it.

#![forbid(unsafe_code)]

// The proxy and the ingress allocate and free small heads, frames and guest strings on
// every request from one thread each; glibc's malloc spent ~9 % of the data plane's
// time (consolidating fastbins among other things) where mimalloc's thread-local pages
// cost a fraction. Envoy makes the same choice with tcmalloc.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A line to stdout that a full disk or a closed pipe loses, without a panic: the
/// mesh's processes must keep serving when their logs cannot be written
/// (`println!` panics on a write error).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// [`say!`] to stderr.
macro_rules! say_err {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod bench;
mod filter;
mod progress;
mod roles;
mod scaffold;
mod secrets;
mod store;
mod tap;
mod up;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use dpumesh_config::Transport;
use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_runtime::{
    Decision, FilterChain, FilterSettings, Generation, RequestHead, Runtime, RuntimeConfig,
    WorkerPool,
};

#[derive(Debug, Parser)]
#[command(
    name = "dpumesh",
    version,
    about = "DPUmesh: a service mesh whose L7 policy runs as Wasm filters on the DPU"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Load a filter and run sample requests through it on a pool of workers.
    Demo {
        /// The filter component (`.wasm`).
        #[arg(
            long,
            default_value = "target/wasm32-wasip2/release/dpumesh_sample_guard.wasm"
        )]
        filter: PathBuf,
        /// The filter's configuration (JSON).
        #[arg(long, default_value = DEMO_CONFIG)]
        config: String,
        /// Worker threads.
        #[arg(long, default_value_t = 2)]
        workers: usize,
        /// Requests for the throughput run.
        #[arg(long, default_value_t = 20_000)]
        requests: usize,
    },
    /// Run the DPU proxy from a config file: workers, hot reload (the file is watched;
    /// `POST /reload` on the admin API), admin API, loopback listener.
    Proxy {
        /// The proxy config (YAML); see samples/proxy/proxy.yaml.
        #[arg(long)]
        config: PathBuf,
        /// Do not watch the config and the files it names.
        #[arg(long)]
        no_watch: bool,
    },
    /// Start a whole local mesh: nodes (DPU proxy + DMA manager), the services and
    /// the ingress, as processes; Ctrl-C stops everything.
    Up {
        /// The mesh file (samples/hotel/mesh.yaml when neither this nor `--config`
        /// names one).
        #[arg(value_name = "MESH_FILE", conflicts_with = "config")]
        file: Option<PathBuf>,
        /// The mesh file, as a flag.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Join an unmodified server to the mesh: run as the service's pod (with
    /// `DPUMESH_CONTROL`, `DPUMESH_SERVICE`, `DPUMESH_POD`, as `dpumesh up` starts
    /// it for `services.<name>.bridge`) and forward the mesh's requests to the server.
    Bridge {
        /// The server's `host:port`.
        #[arg(long)]
        to: String,
        /// What it speaks: http1, h2c or grpc.
        #[arg(long, default_value = "http1", value_parser = ["http1", "h2c", "grpc"])]
        protocol: String,
        /// A local port for the server's own calls through the mesh (an HTTP proxy).
        #[arg(long)]
        egress: Option<SocketAddr>,
        /// Seconds to wait for the server to accept connections before joining.
        #[arg(long)]
        wait: Option<u64>,
    },
    /// The host agent of the BlueField split: this host's pods register on its socket
    /// (where they look for their node); it makes their memory and registers them
    /// with the node, which reaches that memory only by DMA (`dpumesh node
    /// --data-path split` here).
    Host {
        /// The node's control socket, or on a BlueField (`doca` builds)
        /// `comch:PCI,SERVER`: the host's BlueField function and the node's Comch
        /// server.
        #[arg(long, env = "DPUMESH_HOST_NODE")]
        node: String,
        /// Where this host's pods register (their `DPUMESH_CONTROL`).
        #[arg(long, env = "DPUMESH_HOST_LISTEN")]
        listen: PathBuf,
        /// A name for logs and memory names.
        #[arg(long, env = "DPUMESH_HOST_NAME", default_value = "host")]
        name: String,
    },
    /// Run one worker node of a mesh (what `dpumesh up` starts, and the DPU proxy's
    /// container runs). Every flag has an environment variable, so a Kubernetes
    /// manifest can set them from the Downward API (`--name $(NODE_NAME)` works too).
    Node {
        /// The mesh file.
        #[arg(long, env = "DPUMESH_MESH")]
        mesh: PathBuf,
        /// The node's name in it.
        #[arg(long, env = "DPUMESH_NODE_NAME")]
        name: String,
        /// Where the node's control socket goes.
        #[arg(long, env = "DPUMESH_RUN_DIR", default_value = "/run/dpumesh")]
        run_dir: PathBuf,
        /// Where pods register instead (`unix:PATH` or `tcp:HOST:PORT`).
        #[arg(long, env = "DPUMESH_NODE_CONTROL")]
        control: Option<Endpoint>,
        /// The fabric address to bind instead of the entry's (e.g. `0.0.0.0:7101`).
        #[arg(long, env = "DPUMESH_FABRIC_LISTEN")]
        fabric_listen: Option<SocketAddr>,
        /// The admin API's address instead of the entry's.
        #[arg(long, env = "DPUMESH_ADMIN")]
        admin: Option<SocketAddr>,
        /// The fabric backend instead of the mesh file's `transport` (`tcp` or `shm`).
        #[arg(long, env = "DPUMESH_TRANSPORT", value_parser = parse_transport)]
        transport: Option<Transport>,
        /// The certificate folder instead of the mesh file's `identity.certs` (where
        /// the role's Secret is mounted).
        #[arg(long, env = "DPUMESH_CERTS")]
        certs: Option<PathBuf>,
        /// Nodes (this one included) that share this machine's cores: a node without
        /// `cores:` runs the machine's cores divided by this many shards (`dpumesh up`
        /// passes its node count).
        #[arg(
            long,
            env = "DPUMESH_COLOCATED_NODES",
            default_value_t = 1,
            value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096)
        )]
        colocated: usize,
        /// How the node reaches its pods' memory: `software` (shared memory on this
        /// kernel, descriptors passed on the Unix control socket), `split` (the
        /// BlueField split in software: the node touches its pods' rings and pools
        /// only through a DMA engine, as a DPU reaches host memory, and takes pods a
        /// `dpumesh host` agent registers) or `doca` (DOCA DMA from a BlueField to its
        /// host: builds with the `doca` feature only).
        #[arg(
            long,
            env = "DPUMESH_DATA_PATH",
            default_value = "software",
            value_parser = parse_data_path
        )]
        data_path: String,
        /// With `--data-path doca`: the Comch server host agents register pods with,
        /// `PCI,REP_PCI,NAME` (the DPU's device, the host function's representor, the
        /// server's name).
        #[arg(long, env = "DPUMESH_COMCH")]
        comch: Option<String>,
    },
    /// R-Pingmesh: `server` runs the controller and analyzer of a mesh (what `dpumesh
    /// up` starts when the mesh file has a `pingmesh` section); `agent` runs an agent
    /// alone (every node runs one itself; this is for hosts outside the mesh and tests).
    Pingmesh {
        #[command(subcommand)]
        command: PingmeshCommand,
    },
    /// Run a mesh's ingress (what `dpumesh up` starts, and the ingress container runs).
    Ingress {
        /// The mesh file.
        #[arg(long, env = "DPUMESH_MESH")]
        mesh: PathBuf,
        /// The address to listen on instead of `ingress.listen`.
        #[arg(long, env = "DPUMESH_INGRESS_LISTEN")]
        listen: Option<SocketAddr>,
        /// The admin API's address instead of `ingress.admin`.
        #[arg(long, env = "DPUMESH_ADMIN")]
        admin: Option<SocketAddr>,
        /// The fabric backend instead of the mesh file's `transport` (`tcp` or `shm`).
        #[arg(long, env = "DPUMESH_TRANSPORT", value_parser = parse_transport)]
        transport: Option<Transport>,
        /// The certificate folder instead of the mesh file's `identity.certs` (where
        /// the role's Secret is mounted).
        #[arg(long, env = "DPUMESH_CERTS")]
        certs: Option<PathBuf>,
    },
    /// Issue the mesh's certificates (the CA on first use, then every node, the
    /// ingress and every service) into its certificate folder; running parts load
    /// new ones without a restart. `dpumesh up` does this by itself.
    Certs {
        /// The mesh file.
        #[arg(long, default_value = "samples/hotel/mesh.yaml")]
        config: PathBuf,
        /// Issue every certificate again, fresh or not (rotation).
        #[arg(long)]
        rotate: bool,
        /// Also write them as Kubernetes Secrets (and a kustomization) into this
        /// folder: one per node and for the ingress, to mount as the certificate
        /// folder, and each service's registration token. Never the CA's key.
        #[arg(long, value_name = "DIR")]
        secrets: Option<PathBuf>,
        /// The namespace of the nodes' and the ingress's Secrets (the tokens go to
        /// the workloads' namespace, `identity.namespace`).
        #[arg(long, default_value = secrets::SYSTEM_NAMESPACE, requires = "secrets")]
        system_namespace: String,
        /// Print the nodes' admin token (the bearer token of `POST /reload`,
        /// `DELETE /store`, `DELETE /cache`), derived from the mesh's registration key.
        #[arg(long)]
        admin_token: bool,
        /// Print the registration token of this service (what its pods and
        /// `dpumesh store --service` prove it with).
        #[arg(long, value_name = "SERVICE", conflicts_with = "admin_token")]
        token: Option<String>,
    },
    /// Filter development: the conformance kit.
    Filter {
        #[command(subcommand)]
        command: FilterCommand,
    },
    /// Benchmarks with their baselines measured in the same run.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
    /// A node's BlueCache object store: put, get, ls, stat, rm.
    Store {
        /// The node's control channel (`unix:PATH` or `tcp:HOST:PORT`; a pod has it
        /// in `DPUMESH_CONTROL`).
        #[arg(long, env = "DPUMESH_CONTROL")]
        control: Endpoint,
        /// The service whose objects these are: a store client acts for one service
        /// and sees only its keys (a pod has it in `DPUMESH_SERVICE`).
        #[arg(long, env = "DPUMESH_SERVICE")]
        service: String,
        /// The service's registration token (`DPUMESH_TOKEN`; the service's Secret,
        /// or `dpumesh certs` has the key that makes it).
        #[arg(long, env = "DPUMESH_TOKEN", hide_env_values = true)]
        token: Option<String>,
        #[command(subcommand)]
        command: store::StoreCommand,
    },
    /// Stream the live requests of every node that match a query (service, path,
    /// status, method, source, route), with their filters' times and verdicts.
    Tap(tap::TapArgs),
    /// Load a filter component and validate its configuration.
    Check {
        /// The filter component (`.wasm`).
        filter: PathBuf,
        /// The filter's configuration (JSON); empty means defaults.
        #[arg(long, default_value = "")]
        config: String,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The data path (FreeFlow's table): ring round trips in busy-poll and event mode,
    /// Unix socket and TCP baselines, fabric RPC vs plain TCP, DMA copy vs memcpy, for
    /// 2 B to 8 MiB messages.
    Dpa {
        /// Fewer iterations (a smoke run).
        #[arg(long)]
        quick: bool,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// Only the paths whose names contain this (ring, unix, tcp, rpc, copy).
        #[arg(long)]
        only: Option<String>,
    },
    /// The echo peer of `bench dpa` (started by it in a second process).
    #[command(hide = true)]
    DpaPeer {
        /// Which path.
        role: String,
        /// Its arguments (region paths, addresses).
        args: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum FilterCommand {
    /// Create a filter project that builds and passes its own suite out of the box.
    New {
        /// The project (and package) name.
        name: String,
        /// The language.
        #[arg(long, value_enum, default_value = "rust")]
        lang: scaffold::Lang,
        /// Where to create it.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// The filter SDK to depend on (default: the one this binary was built with).
        #[arg(long)]
        sdk: Option<PathBuf>,
    },
    /// Build a filter project into `build/NAME.wasm` and a precompiled `build/NAME.cwasm`.
    Build {
        /// The project directory.
        #[arg(default_value = ".")]
        dir: PathBuf,
    },
    /// Run conformance suites against a component (any language): prints each case,
    /// `N passed, N failed`, and exits non-zero on any failure.
    Test {
        /// The filter component (`.wasm`).
        component: PathBuf,
        /// Suite files, or directories of them.
        #[arg(required = true)]
        suites: Vec<PathBuf>,
        /// Print one JSON document instead.
        #[arg(long)]
        json: bool,
    },
}

const DEMO_CONFIG: &str = r#"{"rules": [
  {"name": "health", "path_prefix": "/healthz", "action": "allow"},
  {"name": "admin", "path_prefix": "/admin", "header": {"name": "x-role", "value": "admin"}, "action": "allow"},
  {"name": "admin-other", "path_prefix": "/admin", "action": "deny"},
  {"name": "no-delete", "methods": ["DELETE"], "action": "deny"}
], "default": "allow"}"#;

fn main() -> Result<ExitCode> {
    dpumesh_supervise::parent::die_with_parent();
    let cli = Cli::try_parse().unwrap_or_else(|e| {
        let _ = e.print();
        if let Some(var) = from_environment(&e) {
            say_err!("note: the value came from the environment variable {var}");
        }
        std::process::exit(e.exit_code());
    });
    if let Command::Proxy { config, no_watch } = &cli.command {
        return proxy(config, *no_watch).map(|()| ExitCode::SUCCESS);
    }
    // Tools say little (warn); the roles an orchestrator runs log JSON off a terminal.
    // A node logs at its policy's `log.level` (plugins' log lines need `info`);
    // `DPUMESH_LOG` overrides either. The format stays the role's: JSON off a
    // terminal (what a collector reads), unless `DPUMESH_LOG_FORMAT` says otherwise.
    let log = match &cli.command {
        Command::Node { mesh, .. } => node_log(mesh),
        _ => None,
    };
    dpumesh_proxy::logging::init(&log.unwrap_or(dpumesh_config::proxy::LogConfig {
        level: "warn".to_owned(),
        format: dpumesh_config::proxy::LogFormat::Auto,
    }));
    match cli.command {
        Command::Demo {
            filter,
            config,
            workers,
            requests,
        } => demo(&filter, &config, workers, requests).map(|()| ExitCode::SUCCESS),
        Command::Check { filter, config } => check(&filter, &config).map(|()| ExitCode::SUCCESS),
        Command::Store {
            control,
            service,
            token,
            command,
        } => store::run(&control, &service, token.as_deref(), command),
        Command::Tap(args) => tap::run(args),
        Command::Bench { command } => match command {
            BenchCommand::Dpa { quick, json, only } => {
                bench::dpa::run(quick, json, only.as_deref()).map(|()| ExitCode::SUCCESS)
            }
            BenchCommand::DpaPeer { role, args } => {
                bench::dpa::peer(&role, &args).map(|()| ExitCode::SUCCESS)
            }
        },
        Command::Filter { command } => match command {
            FilterCommand::Test {
                component,
                suites,
                json,
            } => filter::test(&component, &suites, json),
            FilterCommand::New {
                name,
                lang,
                dir,
                sdk,
            } => {
                let project = scaffold::new(&name, lang, &dir, sdk.as_deref())?;
                println!(
                    "created {}
next: dpumesh filter build {0} && dpumesh filter test {0}/build/{name}.wasm {0}/suite.yaml",
                    project.display()
                );
                Ok(ExitCode::SUCCESS)
            }
            FilterCommand::Build { dir } => scaffold::build(&dir).map(|_| ExitCode::SUCCESS),
        },
        Command::Proxy { .. } => Ok(ExitCode::SUCCESS),
        Command::Up { file, config } => {
            let file = file
                .or(config)
                .unwrap_or_else(|| PathBuf::from("samples/hotel/mesh.yaml"));
            up::up(&file).map(|()| ExitCode::SUCCESS)
        }
        Command::Node {
            mesh,
            name,
            run_dir,
            control,
            fabric_listen,
            admin,
            transport,
            certs,
            colocated,
            data_path,
            comch,
        } => {
            let comch = match (data_path.as_str(), comch) {
                ("doca", Some(address)) => Some(address),
                ("doca", None) => anyhow::bail!(
                    "--data-path doca takes its pods from the host agent over Comch: give --comch PCI,REP_PCI,NAME (DPUMESH_COMCH)"
                ),
                (_, Some(_)) => anyhow::bail!("--comch goes with --data-path doca"),
                (_, None) => None,
            };
            let options = dpumesh_proxy::node::NodeOptions {
                run_dir,
                control,
                fabric_listen,
                admin,
                transport,
                colocated,
                across_pcie: data_path != "software",
                comch,
            };
            roles::node(&mesh, &name, certs, &options).map(|()| ExitCode::SUCCESS)
        }
        Command::Ingress {
            mesh,
            listen,
            admin,
            transport,
            certs,
        } => {
            let options = roles::IngressOptions {
                listen,
                admin,
                transport,
                certs,
            };
            roles::ingress(&mesh, &options).map(|()| ExitCode::SUCCESS)
        }
        Command::Host { node, listen, name } => {
            roles::host(&node, &listen, &name).map(|()| ExitCode::SUCCESS)
        }
        Command::Bridge {
            to,
            protocol,
            egress,
            wait,
        } => {
            let protocol = match protocol.as_str() {
                "h2c" => dpumesh_config::BridgeProtocol::H2c,
                "grpc" => dpumesh_config::BridgeProtocol::Grpc,
                _ => dpumesh_config::BridgeProtocol::Http1,
            };
            let env = dpumesh_host::datapath::PodEnv::read(None).map_err(anyhow::Error::msg)?;
            let settings = dpumesh_bridge::Settings {
                to,
                protocol,
                egress,
                wait: wait.map(std::time::Duration::from_secs),
            };
            dpumesh_bridge::run(&env, settings).map(|()| ExitCode::SUCCESS)
        }
        Command::Pingmesh {
            command: PingmeshCommand::Server { mesh, listen, http },
        } => roles::pingmesh(&mesh, listen, http).map(|()| ExitCode::SUCCESS),
        Command::Pingmesh {
            command: PingmeshCommand::Agent(args),
        } => roles::pingmesh_agent(&args).map(|()| ExitCode::SUCCESS),
        Command::Certs {
            config,
            rotate,
            secrets,
            system_namespace,
            admin_token,
            token,
        } => roles::certs(
            &config,
            rotate,
            secrets.as_deref(),
            &system_namespace,
            match (admin_token, token) {
                (true, _) => Some(roles::PrintToken::Admin),
                (false, Some(service)) => Some(roles::PrintToken::Service(service)),
                (false, None) => None,
            },
        )
        .map(|()| ExitCode::SUCCESS),
    }
}

#[derive(Debug, Subcommand)]
enum PingmeshCommand {
    /// The controller and analyzer: gRPC for the agents, the JSON API and the
    /// dashboard over HTTP.
    Server {
        /// The mesh file (its `pingmesh` section).
        #[arg(long, env = "DPUMESH_MESH")]
        mesh: PathBuf,
        /// The gRPC address instead of `pingmesh.listen`.
        #[arg(long, env = "DPUMESH_PINGMESH_LISTEN")]
        listen: Option<SocketAddr>,
        /// The HTTP address instead of `pingmesh.http`.
        #[arg(long, env = "DPUMESH_PINGMESH_HTTP")]
        http: Option<SocketAddr>,
    },
    /// One agent: registers its RNIC, probes its pinglists, answers probes, uploads.
    Agent(roles::AgentArgs),
}

/// The environment variable a refused value came from, if it did: clap names the flag
/// only, and a container's settings are environment variables.
fn from_environment(error: &clap::Error) -> Option<String> {
    use clap::CommandFactory;
    use clap::error::{ContextKind, ContextValue};
    let Some(ContextValue::String(arg)) = error.get(ContextKind::InvalidArg) else {
        return None;
    };
    let long = arg.strip_prefix("--")?.split(' ').next()?;
    let command = Cli::command();
    let in_argv =
        std::env::args().any(|a| a == format!("--{long}") || a.starts_with(&format!("--{long}=")));
    if in_argv {
        return None;
    }
    let sub = std::env::args().nth(1)?;
    let sub = command.find_subcommand(&sub)?;
    let var = sub
        .get_arguments()
        .find(|a| a.get_long() == Some(long))?
        .get_env()?
        .to_string_lossy()
        .into_owned();
    std::env::var_os(&var).map(|_| var)
}

/// `--transport`: the mesh file's names for the fabric backends.
fn parse_data_path(s: &str) -> Result<String, String> {
    match s {
        "software" | "split" => Ok(s.to_owned()),
        "doca" if cfg!(feature = "doca") => Ok(s.to_owned()),
        "doca" => Err(
            "this build has no DOCA data path: build dpumesh with `--features doca` on a machine with the DOCA SDK (BlueField images), or use `software`"
                .to_owned(),
        ),
        other => Err(format!(
            "{other:?} is not a data path: software, split or doca"
        )),
    }
}

fn parse_transport(s: &str) -> Result<Transport, String> {
    match s {
        "tcp" => Ok(Transport::Tcp),
        "shm" => Ok(Transport::Shm),
        other => Err(format!("{other:?} is not a fabric backend: tcp or shm")),
    }
}

/// A node's log settings: its policy's level, when the mesh file and its policy read
/// (the node itself reports a file that does not, once logging is up).
fn node_log(mesh: &Path) -> Option<dpumesh_config::proxy::LogConfig> {
    let mesh = dpumesh_config::MeshFile::read(mesh).ok()?;
    let policy = dpumesh_config::LoadedConfig::read(&mesh.config.policy).ok()?;
    Some(dpumesh_config::proxy::LogConfig {
        level: policy.config.log.level,
        format: dpumesh_config::proxy::LogFormat::Auto,
    })
}

fn proxy(config: &Path, no_watch: bool) -> Result<()> {
    // Log settings come from the file; read it once for them (the proxy re-reads it).
    let log = dpumesh_config::LoadedConfig::read(config)
        .map(|c| c.config.log)
        .unwrap_or_default();
    dpumesh_proxy::logging::init(&log);
    let options = dpumesh_proxy::Options {
        watch: (!no_watch).then(|| Duration::from_millis(250)),
    };
    let proxy = dpumesh_proxy::Proxy::start(config, options)?;
    let snapshot = proxy.policy().snapshot();
    println!(
        "dpumesh proxy: generation {} with {} chains on {} workers",
        snapshot.generation.number(),
        snapshot.generation.chains().len(),
        proxy.policy().pool().workers()
    );
    if let Some(addr) = proxy.admin_addr() {
        println!(
            "  admin API   http://{addr}/  (/healthz /readyz /metrics /filters, POST /reload)"
        );
    }
    if let Some(addr) = proxy.listener_addr() {
        println!("  listener    http://{addr}/  (runs the routed chain, answers the verdict)");
    }
    println!(
        "  config      {} ({})",
        config.display(),
        if no_watch { "not watched" } else { "watched" }
    );
    proxy.wait()
}

fn load(
    runtime: &Runtime,
    path: &Path,
    config: &str,
) -> Result<Arc<dpumesh_runtime::LoadedFilter>> {
    if !path.is_file() {
        bail!(
            "{} not found: build the sample filter first (cargo build --release --target wasm32-wasip2 -p dpumesh-sample-guard), or run ./scripts/setup.sh",
            path.display()
        );
    }
    let name = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("filter")
        .to_owned();
    let started = Instant::now();
    let filter = runtime
        .load_filter_file(FilterSettings::new(name, config), path)
        .with_context(|| format!("loading {}", path.display()))?;
    println!(
        "loaded {} (version {}) in {:.1} ms",
        filter.name(),
        &filter.version_hash()[..12],
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(filter)
}

fn check(path: &Path, config: &str) -> Result<()> {
    let runtime = Runtime::new(RuntimeConfig::default())?;
    let filter = load(&runtime, path, config)?;
    println!(
        "ok: targets dpumesh:filter@{}; response phase: {}",
        dpumesh_runtime::WIT_VERSION,
        if filter.has_response_phase() {
            "yes"
        } else {
            "no"
        }
    );
    Ok(())
}

fn sample_requests() -> Vec<(String, RequestHead)> {
    let mk = |method: &str, target: &str, headers: &[(&str, &str)]| {
        let mut head = RequestHead::new(method, target);
        head.authority = "api.example.com".to_owned();
        for (n, v) in headers {
            head.append_received(n, v).expect("valid sample header");
        }
        let shown = headers
            .iter()
            .map(|(n, v)| format!(" {n}: {v}"))
            .collect::<String>();
        (format!("{method} {target}{shown}"), head)
    };
    vec![
        mk("GET", "/healthz", &[]),
        mk("GET", "/admin/users", &[("x-role", "admin")]),
        mk("GET", "/admin/users", &[("x-role", "guest")]),
        mk("DELETE", "/items/7", &[]),
        mk("GET", "/items?page=2", &[]),
    ]
}

fn demo(path: &Path, config: &str, workers: usize, requests: usize) -> Result<()> {
    let runtime = Runtime::new(RuntimeConfig::default())?;
    let filter = load(&runtime, path, config)?;
    let chain = Arc::new(FilterChain::new("demo", vec![filter]));
    let pool = Arc::new(WorkerPool::start(Generation::new(1, vec![chain]), workers)?);
    println!("\nsample requests through {workers} workers:");
    for (label, head) in sample_requests() {
        let done = pool.on_request(0, head)?;
        match &done.outcome.decision {
            Decision::Continue => println!(
                "  {label:<40} -> forward (x-guard: {})",
                done.outcome
                    .head
                    .header("x-guard")
                    .unwrap_or_else(|| "-".into())
            ),
            Decision::Deny { filter, reply, .. } => println!(
                "  {label:<40} -> {} from {filter}: {}",
                reply.status,
                reply.body.trim()
            ),
            Decision::Pause { park, callouts } => {
                let upstream = callouts.first().map_or("-", |c| c.upstream.as_str());
                println!(
                    "  {label:<40} -> paused for an HTTP call to {upstream} (the demo makes no calls)"
                );
                let info = dpumesh_runtime::ResponseInfo {
                    status: 502,
                    latency_ns: 0,
                    upstream: None,
                    failure: dpumesh_runtime::FailureKind::LocalReply,
                };
                pool.abandon_with(done.ticket.clone(), *park, info, |_| {})?;
            }
        }
    }

    // Throughput: clients on as many threads as workers, each waiting for its reply.
    let per_client = requests / workers.max(1);
    let started = Instant::now();
    let clients: Vec<_> = (0..workers)
        .map(|_| {
            let pool = pool.clone();
            std::thread::spawn(move || -> Result<Vec<Duration>> {
                let mut latencies = Vec::with_capacity(per_client);
                let template = sample_requests();
                for i in 0..per_client {
                    let head = template[i % template.len()].1.clone();
                    let t = Instant::now();
                    pool.on_request(0, head)?;
                    latencies.push(t.elapsed());
                }
                Ok(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for client in clients {
        latencies.extend(
            client
                .join()
                .map_err(|_| anyhow::anyhow!("client panicked"))??,
        );
    }
    let elapsed = started.elapsed();
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];
    println!(
        "\n{} requests in {:.2} s: {:.0} req/s; round trip through the pool p50 {:?}, p99 {:?}",
        latencies.len(),
        elapsed.as_secs_f64(),
        latencies.len() as f64 / elapsed.as_secs_f64(),
        pct(0.50),
        pct(0.99)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up_file(args: &[&str]) -> Result<Option<PathBuf>, clap::Error> {
        match Cli::try_parse_from(args)?.command {
            Command::Up { file, config } => Ok(file.or(config)),
            _ => panic!("not up"),
        }
    }

    #[test]
    fn up_takes_the_mesh_file_as_an_argument_or_a_flag_but_not_both() {
        let want = Some(PathBuf::from("m.yaml"));
        assert_eq!(up_file(&["dpumesh", "up", "m.yaml"]).unwrap(), want);
        assert_eq!(
            up_file(&["dpumesh", "up", "--config", "m.yaml"]).unwrap(),
            want
        );
        assert_eq!(up_file(&["dpumesh", "up"]).unwrap(), None);
        let both = up_file(&["dpumesh", "up", "a.yaml", "--config", "b.yaml"]).unwrap_err();
        assert_eq!(both.kind(), clap::error::ErrorKind::ArgumentConflict);
    }

    #[test]
    fn a_node_logs_at_its_policys_level() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("policy.yaml"),
            "log: {level: info, format: json}\n",
        )
        .unwrap();
        let mesh = std::fs::read_to_string("../samples/hotel/mesh.yaml").unwrap();
        std::fs::write(dir.path().join("mesh.yaml"), mesh).unwrap();
        let log = node_log(&dir.path().join("mesh.yaml")).expect("the policy reads");
        assert_eq!(log.level, "info");
        // The format is the role's (JSON off a terminal), not the policy's.
        assert_eq!(log.format, dpumesh_config::proxy::LogFormat::Auto);
        assert!(node_log(&dir.path().join("missing.yaml")).is_none());
    }
}

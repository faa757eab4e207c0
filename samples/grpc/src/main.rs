//! `grpc-interop pod | serve ADDR | client [options] CASE...`: gRPC's interop test
//! service as a mesh pod (`dpumesh up` starts it with `DPUMESH_CONTROL`,
//! `DPUMESH_SERVICE`, `DPUMESH_POD`), the same service on TCP, or the interop client.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, Result, bail};
use dpumesh_host::datapath::PodEnv;
use dpumesh_host::{EventLoop, LoopConfig};
use dpumesh_sample_grpc::client::{CASES, Client};

const USAGE: &str = "usage: grpc-interop pod
       grpc-interop serve HOST:PORT
       grpc-interop client --server http://HOST:PORT [--authority NAME] [--token JWT] CASE...|all";

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DPUMESH_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("pod") => pod(),
        Some("serve") => serve(args.get(1).context(USAGE)?),
        Some("client") => client(&args[1..]),
        _ => bail!("{USAGE}"),
    }
}

/// A tokio runtime: the TCP server's and client's, and in a pod the one the service's
/// futures use for their timers (the interop streams' intervals). It is entered on
/// the loop's thread, where the host library polls them; its own thread drives them.
fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?)
}

fn pod() -> Result<()> {
    let env = PodEnv::read(Some("grpc")).map_err(anyhow::Error::msg)?;
    let transport = env
        .connect()
        .with_context(|| format!("cannot register {} with its node", env.pod))?;
    let runtime = runtime()?;
    let _entered = runtime.enter();
    let handler = dpumesh_host::tower::handler(dpumesh_sample_grpc::service());
    // tonic reads request streams as they come (client and bidirectional streaming).
    let mut service_loop = EventLoop::new(transport, handler, LoopConfig::streaming())?;
    service_loop
        .run(&Arc::new(AtomicBool::new(false)))
        .map_err(|e| anyhow::anyhow!("{}: {e}", env.service))
}

fn serve(addr: &str) -> Result<()> {
    let addr = addr
        .parse()
        .with_context(|| format!("{addr:?} is not HOST:PORT"))?;
    runtime()?.block_on(async {
        tonic::transport::Server::builder()
            .add_service(dpumesh_sample_grpc::service())
            .serve(addr)
            .await
    })?;
    Ok(())
}

fn client(args: &[String]) -> Result<()> {
    let (mut server, mut authority, mut token, mut cases) = (None, None, None, Vec::new());
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--server" => server = it.next().cloned(),
            "--authority" => authority = it.next().cloned(),
            "--token" => token = it.next().cloned(),
            "all" => cases.extend(CASES.iter().map(|c| c.to_string())),
            case => cases.push(case.to_owned()),
        }
    }
    let server = server.context(USAGE)?;
    if cases.is_empty() {
        bail!("{USAGE}");
    }
    let failed = runtime()?.block_on(async {
        let mut client = Client::connect(&server, authority.as_deref(), token).await?;
        let mut failed = 0;
        for case in &cases {
            match client.run(case).await {
                Ok(()) => println!("{case}: ok"),
                Err(why) => {
                    failed += 1;
                    println!("{case}: FAILED: {why}");
                }
            }
        }
        anyhow::Ok(failed)
    })?;
    if failed > 0 {
        bail!("{failed} of {} cases failed", cases.len());
    }
    Ok(())
}

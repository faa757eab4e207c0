//! `dpumesh bench dpa`: the FreeFlow table for our data paths. Every path runs
//! between this process and an echo peer in a second process (this binary again,
//! `dpumesh bench dpa-peer`), for message sizes from 2 B to 8 MiB, and reports
//! round-trip latency (average, typical = median, p99, p99.9) and windowed
//! throughput, with the baselines measured in the same run:
//!
//! - shared-memory ring round trip, busy-poll mode and event mode (payload copied
//!   into a pool slot, descriptor through an SPSC ring, copied back by the peer);
//! - Unix socket and TCP loopback round trips (length-prefixed echo);
//! - fabric RPC over the TCP software fabric (peers on other hosts) and over the
//!   shared-memory fabric (peers on one host, what `dpumesh up` uses) against the
//!   plain TCP request/response above;
//! - DMA engine copy throughput against `memcpy`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dpumesh_dpa::dma::{CopyJob, DmaEngine, SoftwareDma};
use dpumesh_dpa::fabric::Fabric;
use dpumesh_dpa::fabric::shm::ShmFabric;
use dpumesh_dpa::fabric::soft::SoftFabric;
use dpumesh_dpa::rpc::{RpcClient, RpcConfig, RpcServer};
use dpumesh_dpa::{
    Buffer, BufferPool, Case, Descriptor, Destination, OwnerId, PoolLayout, Ring, SharedRegion,
    WakeMode,
};

/// Message sizes of the table (rings also run a descriptor-only row, size 0).
const SIZES: [usize; 8] = [
    2,
    64,
    1 << 10,
    4 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    8 << 20,
];
/// Largest message.
const MAX: usize = 8 << 20;
/// Messages in flight for throughput.
const WINDOW: usize = 16;
const PARENT: OwnerId = OwnerId(1);
const PEER: OwnerId = OwnerId(2);

/// One row: a path at one size.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub path: String,
    /// Message size in bytes.
    pub size: usize,
    /// Average round trip (µs).
    pub avg_us: f64,
    /// Median round trip (µs).
    pub p50_us: f64,
    /// 99th percentile (µs).
    pub p99_us: f64,
    /// 99.9th percentile (µs).
    pub p999_us: f64,
    /// Windowed throughput (MB/s of payload one way).
    pub mb_s: f64,
}

fn iterations(size: usize, quick: bool) -> usize {
    let n = match size {
        0..=4096 => 10_000,
        4097..=65536 => 2_000,
        65537..=1048576 => 300,
        _ => 40,
    };
    if quick { (n / 10).max(10) } else { n }
}

fn row(path: &str, size: usize, mut samples: Vec<Duration>, mb_s: f64) -> Row {
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let pct = |p: f64| us(samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)]);
    Row {
        path: path.to_owned(),
        size,
        avg_us: us(samples.iter().sum::<Duration>()) / samples.len() as f64,
        p50_us: pct(0.5),
        p99_us: pct(0.99),
        p999_us: pct(0.999),
        mb_s,
    }
}

fn mb_s(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e6
}

fn payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 131 % 251) as u8).collect()
}

// === the echo peer (a second process) ===

/// Runs the echo side of one path; called by `dpumesh bench dpa-peer`.
pub fn peer(role: &str, args: &[String]) -> Result<()> {
    match role {
        "ring-poll" | "ring-event" | "ring-futex" => {
            let mode = match role {
                "ring-poll" => WakeMode::Poll,
                "ring-event" => WakeMode::LOW_CPU,
                _ => WakeMode::Event {
                    spin: Duration::ZERO,
                },
            };
            let open = |p: &String| -> Result<Arc<SharedRegion>> {
                Ok(Arc::new(SharedRegion::open(Path::new(p))?))
            };
            let mut rx = Ring::attach(open(&args[0])?)?.consumer();
            let mut tx = Ring::attach(open(&args[1])?)?.producer();
            let theirs = BufferPool::attach(open(&args[2])?)?;
            let mine = BufferPool::attach(open(&args[3])?)?;
            let mut dma = SoftwareDma;
            loop {
                let Some(d) = rx.pop_wait(mode, Duration::from_secs(30))? else {
                    bail!("the benchmark went quiet");
                };
                if d.req_id == u32::MAX {
                    return Ok(());
                }
                if d.body.is_none() {
                    // Descriptor only: straight back.
                    let reply =
                        Descriptor::request(Case::PodToPod, d.req_id, 0, 2, Destination::Pod(1));
                    while tx.push(&reply).is_err() {
                        std::hint::spin_loop();
                    }
                    continue;
                }
                // One copy, pool to pool, by the DMA engine (as the DMA manager
                // moves a body between two pods' pools).
                let slot = mine.alloc(PEER)?;
                let body = mine.buffer(slot, d.body.len)?;
                dma.copy(&[CopyJob {
                    src: theirs.region(),
                    src_offset: theirs.offset_of(d.body)?,
                    dst: mine.region(),
                    dst_offset: mine.offset_of(body)?,
                    len: u64::from(d.body.len),
                }])?;
                theirs.release(theirs.slot_of(d.body)?, PEER)?;
                mine.transfer(slot, PEER, PARENT)?;
                let reply =
                    Descriptor::request(Case::PodToPod, d.req_id, 0, 2, Destination::Pod(1))
                        .with_body(body);
                while tx.push(&reply).is_err() {
                    std::hint::spin_loop();
                }
            }
        }
        "unix" => echo_stream(UnixStream::connect(&args[0])?),
        "tcp" => {
            let s = TcpStream::connect(&args[0])?;
            s.set_nodelay(true)?;
            echo_stream(s)
        }
        "rpc" => serve_rpc(SoftFabric::new()),
        "rpc-shm" => serve_rpc(ShmFabric::new()),
        other => bail!("unknown peer role {other}"),
    }
}

/// Serves echo RPCs on `fabric` until the parent closes this process's stdin.
fn serve_rpc<F: Fabric + Send + Sync + 'static>(fabric: F) -> Result<()> {
    let server = RpcServer::start(
        fabric,
        "127.0.0.1:0".parse()?,
        rpc_config(),
        Arc::new(|req: &[u8]| Ok(req.to_vec())),
    )?;
    // Tell the parent where, then serve until it closes our stdin.
    println!("{}", server.local_addr());
    std::io::stdout().flush()?;
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    Ok(())
}

/// Echoes length-prefixed frames, each answered with one write (a plain, fair
/// request/response server: one system call per message each way).
fn echo_stream(mut s: impl Read + Write) -> Result<()> {
    let mut buf = vec![0u8; MAX + 4];
    loop {
        if s.read_exact(&mut buf[..4]).is_err() {
            return Ok(());
        }
        let n = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        s.read_exact(&mut buf[4..4 + n])?;
        s.write_all(&buf[..4 + n])?;
    }
}

/// A length-prefixed frame.
fn frame(data: &[u8]) -> Vec<u8> {
    let mut f = (data.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(data);
    f
}

fn rpc_config() -> RpcConfig {
    RpcConfig {
        slots: WINDOW as u32,
        max_request: MAX as u32,
        max_response: MAX as u32,
        ..RpcConfig::default()
    }
}

struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(role: &str, args: &[&str], stdout: bool) -> Result<Peer> {
    let exe = std::env::current_exe()?;
    let child = Command::new(exe)
        .args(["bench", "dpa-peer", role])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(if stdout {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .spawn()
        .context("starting the echo peer")?;
    Ok(Peer(child))
}

// === the paths ===

fn ring(mode: WakeMode, name: &str, quick: bool) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    // Size 0: the descriptor alone, no slot and no copy (the ring itself).
    for size in std::iter::once(0).chain(SIZES) {
        rows.push(ring_size(mode, name, size, quick)?);
    }
    Ok(rows)
}

/// One size of the ring rows, with its own rings, pools and peer. The pools'
/// slots are sized for the message, as a deployment sizes its pods' slots for
/// their bodies: slots of the largest size everywhere put every in-flight
/// buffer 8 MiB apart, on the same cache sets and each on its own pages.
fn ring_size(mode: WakeMode, name: &str, size: usize, quick: bool) -> Result<Row> {
    let to_peer = Ring::create_in_shm("dpumesh-bench-ring", 64)?;
    let from_peer = Ring::create_in_shm("dpumesh-bench-ring", 64)?;
    let slot_size = (size.max(64) as u32).next_multiple_of(64);
    let layout = PoolLayout::new(slot_size, (WINDOW * 2) as u32);
    let mine = BufferPool::create_in_shm("dpumesh-bench-pool", 1, layout)?;
    let theirs = BufferPool::create_in_shm("dpumesh-bench-pool", 2, layout)?;
    let path = |r: &Arc<SharedRegion>| r.path().display().to_string();
    let role = match mode {
        WakeMode::Poll => "ring-poll",
        WakeMode::Event { spin } if spin.is_zero() => "ring-futex",
        WakeMode::Event { .. } => "ring-event",
    };
    let args = [
        path(to_peer.region()),
        path(from_peer.region()),
        path(mine.region()),
        path(theirs.region()),
    ];
    let _peer = spawn(
        role,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        false,
    )?;
    let mut tx = to_peer.producer();
    let mut rx = from_peer.consumer();
    // The receiver copies each answer out, as a socket's reader does.
    let mut scratch = vec![0u8; size];
    let send = |tx: &mut dpumesh_dpa::Producer, data: &[u8], id: u32| -> Result<()> {
        if data.is_empty() {
            tx.push(&Descriptor::request(
                Case::PodToPod,
                id,
                0,
                1,
                Destination::Pod(2),
            ))?;
            return Ok(());
        }
        let slot = mine.alloc(PARENT)?;
        let body = mine.write(slot, data)?;
        mine.transfer(slot, PARENT, PEER)?;
        tx.push(
            &Descriptor::request(Case::PodToPod, id, 0, 1, Destination::Pod(2)).with_body(body),
        )?;
        Ok(())
    };
    let receive = |rx: &mut dpumesh_dpa::Consumer, scratch: &mut [u8]| -> Result<Descriptor> {
        let d = rx
            .pop_wait(mode, Duration::from_secs(30))?
            .context("the echo peer stopped answering")?;
        if d.body.is_none() {
            return Ok(d);
        }
        theirs.read_into(d.body, &mut scratch[..d.body.len as usize])?;
        theirs.release(theirs.slot_of(d.body)?, PARENT)?;
        Ok(d)
    };
    let data = payload(size);
    let n = iterations(size, quick);
    for _ in 0..n.min(2000) {
        send(&mut tx, &data, 1)?;
        receive(&mut rx, &mut scratch)?;
    }
    let samples = (0..n)
        .map(|_| {
            let started = Instant::now();
            send(&mut tx, &data, 1)?;
            receive(&mut rx, &mut scratch)?;
            Ok(started.elapsed())
        })
        .collect::<Result<Vec<_>>>()?;
    let mut windowed = |n: usize| -> Result<Duration> {
        let started = Instant::now();
        let (mut sent, mut got) = (0, 0);
        while got < n {
            while sent < n && sent - got < WINDOW {
                send(&mut tx, &data, 1)?;
                sent += 1;
            }
            receive(&mut rx, &mut scratch)?;
            got += 1;
        }
        Ok(started.elapsed())
    };
    // Once untimed: the serial loop above touched one slot of each pool, and
    // the first touch of the other slots' pages is the kernel's, not the ring's.
    windowed(WINDOW * 4)?;
    let elapsed = windowed(n)?;
    let row = row(name, size, samples, mb_s(size * n, elapsed));
    tx.push(
        &Descriptor::request(Case::PodToPod, u32::MAX, 0, 1, Destination::Pod(2))
            .with_body(Buffer::NONE),
    )?;
    Ok(row)
}

fn stream_rows<S: Read + Write + Send + 'static>(
    name: &str,
    mut s: S,
    mut clone: impl FnMut(&S) -> std::io::Result<S>,
    quick: bool,
) -> Result<Vec<Row>> {
    let mut buf = vec![0u8; MAX + 4];
    let mut rows = Vec::new();
    for size in SIZES {
        let data = frame(&payload(size));
        let n = iterations(size, quick);
        let round = |s: &mut S, buf: &mut [u8]| -> Result<()> {
            s.write_all(&data)?;
            s.read_exact(&mut buf[..4 + size])?;
            Ok(())
        };
        for _ in 0..n.min(100) {
            round(&mut s, &mut buf)?;
        }
        let samples = (0..n)
            .map(|_| {
                let started = Instant::now();
                round(&mut s, &mut buf)?;
                Ok(started.elapsed())
            })
            .collect::<Result<Vec<_>>>()?;
        // Throughput: a writer thread keeps messages coming while this one reads.
        let mut writer = clone(&s)?;
        let wdata = data.clone();
        let started = Instant::now();
        let w = std::thread::spawn(move || -> std::io::Result<()> {
            for _ in 0..n {
                writer.write_all(&wdata)?;
            }
            Ok(())
        });
        for _ in 0..n {
            s.read_exact(&mut buf[..4 + size])?;
        }
        w.join().map_err(|_| anyhow::anyhow!("writer panicked"))??;
        rows.push(row(name, size, samples, mb_s(size * n, started.elapsed())));
    }
    Ok(rows)
}

fn unix(quick: bool) -> Result<Vec<Row>> {
    let dir = tempfile_dir()?;
    let path = dir.join("echo.sock");
    let listener = UnixListener::bind(&path)?;
    let _peer = spawn("unix", &[&path.display().to_string()], false)?;
    let (s, _) = listener.accept()?;
    let rows = stream_rows("Unix socket", s, UnixStream::try_clone, quick);
    let _ = std::fs::remove_dir_all(&dir);
    rows
}

fn tcp(quick: bool) -> Result<Vec<Row>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let _peer = spawn("tcp", &[&addr], false)?;
    let (s, _) = listener.accept()?;
    s.set_nodelay(true)?;
    stream_rows(
        "TCP loopback (plain request/response)",
        s,
        TcpStream::try_clone,
        quick,
    )
}

/// Echo RPCs on `fabric` against a peer serving them on the same kind (`role`).
fn rpc<F: Fabric + Send + Sync + 'static>(
    fabric: F,
    role: &str,
    name: &str,
    quick: bool,
) -> Result<Vec<Row>> {
    let mut peer = spawn(role, &[], true)?;
    let mut line = String::new();
    {
        let stdout = peer.0.stdout.as_mut().context("peer stdout")?;
        let mut byte = [0u8; 1];
        while stdout.read(&mut byte)? == 1 && byte[0] != b'\n' {
            line.push(byte[0] as char);
        }
    }
    let addr = line
        .trim()
        .parse()
        .with_context(|| format!("the RPC peer said {line:?}"))?;
    let client = Arc::new(RpcClient::connect(&fabric, addr, rpc_config())?);
    let mut rows = Vec::new();
    for size in SIZES {
        let data = Arc::new(payload(size));
        let n = iterations(size, quick);
        for _ in 0..n.min(100) {
            client.call(&data)?;
        }
        let samples = (0..n)
            .map(|_| {
                let started = Instant::now();
                client.call(&data)?;
                Ok(started.elapsed())
            })
            .collect::<Result<Vec<_>>>()?;
        // Throughput: calls from 4 threads share the connection's contexts.
        let started = Instant::now();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let client = client.clone();
                let data = data.clone();
                std::thread::spawn(move || -> Result<()> {
                    for _ in 0..n / 4 {
                        client.call(&data)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for t in threads {
            t.join().map_err(|_| anyhow::anyhow!("caller panicked"))??;
        }
        rows.push(row(
            name,
            size,
            samples,
            mb_s(size * (n / 4) * 4, started.elapsed()),
        ));
    }
    Ok(rows)
}

/// DMA engine copy vs `memcpy`: MB/s for each size, both in this run.
fn copies(quick: bool) -> Result<Vec<(usize, f64, f64)>> {
    let src = SharedRegion::create_unique("dpumesh-bench-dma", MAX)?;
    let dst = SharedRegion::create_unique("dpumesh-bench-dma", MAX)?;
    src.write(0, &payload(MAX))?;
    dst.fill(0, MAX as u64, 1)?;
    let a = payload(MAX);
    let mut b = vec![1u8; MAX];
    let mut engine = SoftwareDma;
    let mut out = Vec::new();
    for size in [4 << 10, 64 << 10, 256 << 10, 1 << 20, 8 << 20] {
        let n = if quick { 20 } else { (256 << 20) / size }.max(10);
        let job = CopyJob {
            src: &src,
            src_offset: 0,
            dst: &dst,
            dst_offset: 0,
            len: size as u64,
        };
        let mut best_dma = f64::MAX;
        let mut best_memcpy = f64::MAX;
        // Alternate the two, best of three, so drift hits both alike.
        for _ in 0..3 {
            let started = Instant::now();
            for _ in 0..n {
                engine.copy(&[job])?;
            }
            best_dma = best_dma.min(started.elapsed().as_secs_f64());
            let started = Instant::now();
            for _ in 0..n {
                b[..size].copy_from_slice(std::hint::black_box(&a[..size]));
                std::hint::black_box(&mut b);
            }
            best_memcpy = best_memcpy.min(started.elapsed().as_secs_f64());
        }
        let bytes = (size * n) as f64;
        out.push((size, bytes / best_dma / 1e6, bytes / best_memcpy / 1e6));
    }
    Ok(out)
}

fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("dpumesh-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn size_name(size: usize) -> String {
    match size {
        0 => "descriptor only".to_owned(),
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// Runs the paths whose names contain `only` (all when `None`) and prints the table
/// (or JSON).
pub fn run(quick: bool, json: bool, only: Option<&str>) -> Result<()> {
    let wanted = |name: &str| only.is_none_or(|o| name.contains(o));
    let mut rows = Vec::new();
    if wanted("ring") {
        eprintln!("shared-memory ring, busy-poll ...");
        rows.extend(ring(WakeMode::Poll, "ring round trip (poll)", quick)?);
        eprintln!("shared-memory ring, event mode (20 µs spin, then futex) ...");
        rows.extend(ring(WakeMode::LOW_CPU, "ring round trip (event)", quick)?);
        eprintln!("shared-memory ring, event mode (futex at once) ...");
        rows.extend(ring(
            WakeMode::Event {
                spin: Duration::ZERO,
            },
            "ring round trip (event, no spin)",
            quick,
        )?);
    }
    if wanted("unix") {
        eprintln!("Unix socket ...");
        rows.extend(unix(quick)?);
    }
    if wanted("tcp") || wanted("rpc") {
        eprintln!("TCP loopback ...");
        rows.extend(tcp(quick)?);
    }
    if wanted("rpc") {
        eprintln!("fabric RPC, TCP software fabric ...");
        rows.extend(rpc(
            SoftFabric::new(),
            "rpc",
            "fabric RPC (TCP software fabric)",
            quick,
        )?);
        eprintln!("fabric RPC, shared-memory fabric ...");
        rows.extend(rpc(
            ShmFabric::new(),
            "rpc-shm",
            "fabric RPC (shared-memory fabric)",
            quick,
        )?);
    }
    let copy = if wanted("copy") {
        eprintln!("DMA copy vs memcpy ...");
        copies(quick)?
    } else {
        Vec::new()
    };
    if json {
        let copy: Vec<_> = copy
            .iter()
            .map(|(size, dma, memcpy)| serde_json::json!({"size": size, "dma_mb_s": dma, "memcpy_mb_s": memcpy}))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({"rows": rows, "copy": copy}))?
        );
        return Ok(());
    }
    println!("| path | size | avg µs | typical (p50) µs | p99 µs | p99.9 µs | throughput MB/s |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} |",
            r.path,
            size_name(r.size),
            r.avg_us,
            r.p50_us,
            r.p99_us,
            r.p999_us,
            r.mb_s
        );
    }
    if rows.iter().any(|r| r.path.starts_with("fabric RPC")) {
        println!();
        println!("| fabric RPC / plain TCP | size | p50 ratio | throughput ratio |");
        println!("| --- | --- | --- | --- |");
    }
    for fabric in ["fabric RPC (TCP", "fabric RPC (shared-memory"] {
        for size in SIZES {
            let find = |prefix: &str| {
                rows.iter()
                    .find(|r| r.path.starts_with(prefix) && r.size == size)
            };
            if let (Some(rpc), Some(tcp)) = (find(fabric), find("TCP loopback")) {
                println!(
                    "| {} | {} | {:.2}× | {:.2}× |",
                    rpc.path,
                    size_name(size),
                    rpc.p50_us / tcp.p50_us,
                    rpc.mb_s / tcp.mb_s
                );
            }
        }
    }
    if !copy.is_empty() {
        println!();
        println!("| copy | size | DMA engine MB/s | memcpy MB/s | ratio |");
        println!("| --- | --- | --- | --- | --- |");
    }
    for (size, dma, memcpy) in copy {
        println!(
            "| software DMA | {} | {dma:.0} | {memcpy:.0} | {:.2}× |",
            size_name(size),
            dma / memcpy
        );
    }
    Ok(())
}

//! BlueCache PUSH and PULL against their baselines, in the same run: writing and
//! reading the same bytes as a plain file in the same directory (one `write_all`, one
//! `read_exact`). PUSH/PULL go through the whole agent (control message decoded, DMA
//! into staging slots, checksum, storage, atomic rename); PULL is measured pipelined
//! (storage reads overlapped with DMA back) and not.
//!
//! `cargo bench -p dpumesh-store --bench transfer`

use std::io::{Read, Write};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dpumesh_dpa::SharedRegion;
use dpumesh_dpa::dma::SoftwareDma;
use dpumesh_store::protocol::{self, Message, Request, Response, Segment, Status};
use dpumesh_store::{Agent, AgentConfig, PosixBackend, PosixOptions};

const SIZES: [usize; 3] = [64 << 10, 1 << 20, 8 << 20];

struct Client {
    agent: Agent,
    buffer: u32,
    region: SharedRegion,
}

fn ask(agent: &Agent, request: Request, fds: Vec<std::os::fd::OwnedFd>) -> Response {
    let (tx, rx) = crossbeam_channel::bounded(1);
    agent.handle(
        1,
        &dpumesh_store::namespace::Namespace::service("bench").unwrap(),
        &protocol::encode(&Message::Request(1, request)),
        fds,
        Box::new(move |b| {
            let _ = tx.send(b);
        }),
    );
    match protocol::decode(&rx.recv().unwrap()).unwrap() {
        Message::Response(_, r) => r,
        other => panic!("{other:?}"),
    }
}

fn client(dir: &std::path::Path, pipelined: bool, verify: bool) -> Client {
    let agent = Agent::start(
        AgentConfig {
            pipelined,
            verify_reads: verify,
            ..AgentConfig::default()
        },
        Box::new(PosixBackend::open(dir, PosixOptions::default()).unwrap()),
        Box::new(SoftwareDma),
    )
    .unwrap();
    let region = SharedRegion::create_sealed("dpumesh-bench-store", 8 << 20).unwrap();
    let data: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
    region.write(0, &data).unwrap();
    let Response::Registered { buffer } = ask(
        &agent,
        Request::Register {
            len: region.len() as u64,
            hw_export: vec![],
        },
        vec![region.fd().try_clone_to_owned().unwrap()],
    ) else {
        panic!()
    };
    Client {
        agent,
        buffer,
        region,
    }
}

impl Client {
    fn transfer(&self, push: bool, key: &str, len: usize) {
        let segments = vec![Segment {
            key: key.to_owned(),
            buffer: self.buffer,
            offset: 0,
            len: len as u64,
        }];
        let request = if push {
            Request::PushBatch { segments }
        } else {
            Request::PullBatch { segments }
        };
        match ask(&self.agent, request, Vec::new()) {
            Response::Batch { results } if results[0].status == Status::Ok => {}
            other => panic!("{other:?}"),
        }
    }
}

fn drop_cache(f: &std::fs::File) {
    rustix::fs::fadvise(f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
}

fn transfers(c: &mut Criterion) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let pipelined = client(&dir.path().join("pipelined"), true, true);
    let serial = client(&dir.path().join("serial"), false, true);
    let unchecked = client(&dir.path().join("unchecked"), true, false);
    // The same directory's files, to drop from the page cache.
    let objects =
        PosixBackend::open(&dir.path().join("pipelined"), PosixOptions::default()).unwrap();
    let plain = dir.path().join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    let data: Vec<u8> = pipelined.region.read_vec(0, 8 << 20).unwrap();
    let mut back = vec![0u8; 8 << 20];

    let mut group = c.benchmark_group("store");
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    for size in SIZES {
        group.throughput(Throughput::Bytes(size as u64));
        let key = format!("obj-{size}");
        let file = plain.join(&key);
        group.bench_function(BenchmarkId::new("file_write", size), |b| {
            b.iter(|| {
                let mut f = std::fs::File::create(&file).unwrap();
                f.write_all(&data[..size]).unwrap();
            });
        });
        group.bench_function(BenchmarkId::new("push", size), |b| {
            b.iter(|| pipelined.transfer(true, &key, size));
        });
        // What the reads read, whichever benches the filter keeps.
        std::fs::write(&file, &data[..size]).unwrap();
        pipelined.transfer(true, &key, size);
        serial.transfer(true, &key, size);
        unchecked.transfer(true, &key, size);
        group.bench_function(BenchmarkId::new("file_read", size), |b| {
            b.iter(|| {
                let mut f = std::fs::File::open(&file).unwrap();
                f.read_exact(&mut back[..size]).unwrap();
            });
        });
        group.bench_function(BenchmarkId::new("pull_pipelined", size), |b| {
            b.iter(|| pipelined.transfer(false, &key, size));
        });
        group.bench_function(BenchmarkId::new("pull_serial", size), |b| {
            b.iter(|| serial.transfer(false, &key, size));
        });
        group.bench_function(BenchmarkId::new("pull_unverified", size), |b| {
            b.iter(|| unchecked.transfer(false, &key, size));
        });
        // From the disk itself: each read starts with the file out of the page cache.
        group.bench_function(BenchmarkId::new("file_read_cold", size), |b| {
            b.iter(|| {
                let mut f = std::fs::File::open(&file).unwrap();
                drop_cache(&f);
                f.read_exact(&mut back[..size]).unwrap();
            });
        });
        let object = objects.object_path(&key);
        group.bench_function(BenchmarkId::new("pull_cold", size), |b| {
            b.iter(|| {
                drop_cache(&std::fs::File::open(&object).unwrap());
                pipelined.transfer(false, &key, size);
            });
        });
    }
    group.finish();
}

criterion_group!(benches, transfers);
criterion_main!(benches);

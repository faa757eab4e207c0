use std::time::Duration;

use dpumesh_dpa::dma::{CopyJob, DmaError, SoftwareDma};

use super::*;
use crate::backend::{MemoryBackend, PosixBackend, PosixOptions};

/// A client in the test: a peer id and a buffer it registered.
struct Client<'a> {
    agent: &'a Agent,
    peer: u64,
    region: SharedRegion,
    buffer: u32,
}

/// The namespace the tests' clients act in.
fn tests() -> Namespace {
    Namespace::service("tests").unwrap()
}

fn ask(agent: &Agent, peer: u64, request: Request) -> Response {
    ask_with(agent, peer, request, Vec::new())
}

fn ask_with(
    agent: &Agent,
    peer: u64,
    request: Request,
    fds: Vec<std::os::fd::OwnedFd>,
) -> Response {
    let (tx, rx) = crossbeam_channel::bounded(1);
    agent.handle(
        peer,
        &tests(),
        &protocol::encode(&Message::Request(9, request)),
        fds,
        Box::new(move |bytes| {
            let _ = tx.send(bytes);
        }),
    );
    match protocol::decode(&rx.recv_timeout(Duration::from_secs(30)).expect("an answer")) {
        Ok(Message::Response(9, r)) => r,
        other => panic!("{other:?}"),
    }
}

impl<'a> Client<'a> {
    fn new(agent: &'a Agent, peer: u64, len: usize) -> Self {
        let region = SharedRegion::create_sealed("dpumesh-test-bluecache", len).unwrap();
        let Response::Registered { buffer } = ask_with(
            agent,
            peer,
            Request::Register {
                len: len as u64,
                hw_export: vec![],
            },
            vec![region.fd().try_clone_to_owned().unwrap()],
        ) else {
            panic!("registered")
        };
        Self {
            agent,
            peer,
            region,
            buffer,
        }
    }

    fn batch(&self, push: bool, segs: &[(&str, u64, u64)]) -> Vec<SegmentResult> {
        let segments = segs
            .iter()
            .map(|(key, offset, len)| Segment {
                key: (*key).into(),
                buffer: self.buffer,
                offset: *offset,
                len: *len,
            })
            .collect();
        let request = if push {
            Request::PushBatch { segments }
        } else {
            Request::PullBatch { segments }
        };
        match ask(self.agent, self.peer, request) {
            Response::Batch { results } => results,
            other => panic!("{other:?}"),
        }
    }

    fn put(&self, key: &str, bytes: &[u8]) -> SegmentResult {
        self.region.write(0, bytes).unwrap();
        self.batch(true, &[(key, 0, bytes.len() as u64)]).remove(0)
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, SegmentResult> {
        self.region.fill(0, self.region.len() as u64, 0xEE).unwrap();
        let r = self
            .batch(false, &[(key, 0, self.region.len() as u64)])
            .remove(0);
        if r.status != Status::Ok {
            return Err(r);
        }
        Ok(self.region.read_vec(0, r.size as usize).unwrap())
    }
}

/// The node's own put, waited for.
fn put_local(agent: &Agent, key: &str, bytes: Vec<u8>) -> Result<crate::ObjectMeta, PutError> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    agent.put_bytes(
        key.into(),
        bytes,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    rx.recv().unwrap()
}

fn small_agent(backend: Box<dyn Backend>, capacity: u64) -> Agent {
    Agent::start(
        AgentConfig {
            capacity,
            queue_depth: 4,
            slot_size: 4096,
            io_threads: 2,
            pipelined: true,
            verify_reads: true,
            memory: 1 << 20,
        },
        backend,
        Box::new(SoftwareDma),
    )
    .unwrap()
}

fn data(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) as u8)
        .collect()
}

#[test]
fn push_and_pull_every_size_with_checksums() {
    let dir = tempfile::tempdir().unwrap();
    for backend in [
        Box::new(MemoryBackend::new()) as Box<dyn Backend>,
        Box::new(PosixBackend::open(dir.path(), PosixOptions::default()).unwrap()),
    ] {
        let agent = small_agent(backend, 1 << 30);
        let client = Client::new(&agent, 1, 200_000);
        // 0 B, 1 B, one slot, one slot and a byte, many slots, more than the whole
        // 16 KiB staging buffer.
        for len in [0usize, 1, 4096, 4097, 40_000, 100_003] {
            let bytes = data(len, len as u32);
            let key = format!("obj/{len}");
            let put = client.put(&key, &bytes);
            assert_eq!(put.status, Status::Ok, "{put:?}");
            assert_eq!((put.size, put.crc32), (len as u64, crc32fast::hash(&bytes)));
            let got = client.get(&key).unwrap();
            assert_eq!(got.len(), len);
            assert!(got == bytes, "{len} bytes read back differ");
        }
        assert_eq!(agent.stats().objects, 6);
        // Every slot came back.
        assert_eq!(agent.stats().free_slots, 4);
    }
}

#[test]
fn a_batch_moves_many_objects_and_reports_each() {
    let agent = small_agent(Box::new(MemoryBackend::new()), 1 << 30);
    let client = Client::new(&agent, 1, 64 << 10);
    let bytes = data(64 << 10, 7);
    client.region.write(0, &bytes).unwrap();
    let segs: Vec<(String, u64, u64)> = (0..16)
        .map(|i| (format!("b/{i}"), i * 4000, 4000))
        .collect();
    let refs: Vec<(&str, u64, u64)> = segs.iter().map(|(k, o, l)| (k.as_str(), *o, *l)).collect();
    let results = client.batch(true, &refs);
    assert!(results.iter().all(|r| r.status == Status::Ok));
    // One bad segment fails alone.
    let results = client.batch(
        true,
        &[
            ("ok", 0, 10),
            ("", 0, 10),
            ("out", (64 << 10) - 5, 10),
            ("ok2", 10, 10),
        ],
    );
    let statuses: Vec<_> = results.iter().map(|r| r.status).collect();
    assert_eq!(
        statuses,
        [Status::Ok, Status::BadKey, Status::BadBuffer, Status::Ok]
    );
    // Pulled back in one batch into other places.
    client.region.fill(0, 64 << 10, 0).unwrap();
    let results = client.batch(
        false,
        &[("b/3", 0, 4000), ("b/9", 8000, 4000), ("nope", 0, 1)],
    );
    assert_eq!(results[2].status, Status::NotFound);
    assert_eq!(
        client.region.read_vec(0, 4000).unwrap(),
        bytes[12_000..16_000]
    );
    assert_eq!(
        client.region.read_vec(8000, 4000).unwrap(),
        bytes[36_000..40_000]
    );
    // A range too small for the object.
    let results = client.batch(false, &[("b/3", 0, 3999)]);
    assert_eq!(results[0].status, Status::TooSmall);
    // Info, list, delete.
    let Response::Info { objects } = ask(
        &agent,
        1,
        Request::PullInfo {
            keys: vec!["b/1".into(), "zz".into()],
        },
    ) else {
        panic!()
    };
    assert_eq!(objects[0].as_ref().unwrap().size, 4000);
    assert!(objects[1].is_none());
    let Response::Listed { objects, more } = ask(
        &agent,
        1,
        Request::List {
            prefix: "b/1".into(),
            after: None,
            limit: 100,
        },
    ) else {
        panic!()
    };
    let keys: Vec<_> = objects.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(
        (keys, more),
        (
            vec!["b/1", "b/10", "b/11", "b/12", "b/13", "b/14", "b/15"],
            false
        )
    );
    let Response::Batch { results } = ask(
        &agent,
        1,
        Request::Delete {
            keys: vec!["b/1".into(), "b/1".into()],
        },
    ) else {
        panic!()
    };
    assert_eq!(results[0].status, Status::Ok);
    assert_eq!(results[1].status, Status::NotFound);
}

#[test]
fn concurrent_clients_each_get_their_own_bytes() {
    let agent = small_agent(Box::new(MemoryBackend::new()), 1 << 30);
    std::thread::scope(|s| {
        for peer in 1..=4u64 {
            let agent = &agent;
            s.spawn(move || {
                let client = Client::new(agent, peer, 50_000);
                for round in 0..10u32 {
                    let bytes = data(30_000 + round as usize * 1000, peer as u32 * 100 + round);
                    let key = format!("c/{peer}/{round}");
                    assert_eq!(client.put(&key, &bytes).status, Status::Ok);
                    assert!(client.get(&key).unwrap() == bytes);
                }
            });
        }
    });
    assert_eq!(agent.stats().objects, 40);
    assert_eq!(agent.stats().free_slots, 4);
}

#[test]
fn the_least_recently_used_objects_are_evicted_first() {
    let agent = small_agent(Box::new(MemoryBackend::new()), 10_000);
    let client = Client::new(&agent, 1, 20_000);
    for key in ["a", "b", "c"] {
        assert_eq!(client.put(key, &data(3000, 1)).status, Status::Ok);
    }
    client.get("a").unwrap();
    // Room for 3000 more: b (the least recently used) goes; then c.
    assert_eq!(client.put("d", &data(3000, 2)).status, Status::Ok);
    assert_eq!(client.get("b").unwrap_err().status, Status::NotFound);
    assert_eq!(client.put("e", &data(3000, 3)).status, Status::Ok);
    assert_eq!(client.get("c").unwrap_err().status, Status::NotFound);
    assert!(client.get("a").is_ok());
    assert_eq!(agent.stats().evictions, 2);
    let too_big = client.put("huge", &data(10_001, 4));
    assert_eq!(too_big.status, Status::TooLarge, "{too_big:?}");
    assert!(too_big.message.contains("capacity"), "{}", too_big.message);
}

/// An engine that takes its time per copy, so a transfer is still running when its
/// client goes away.
struct SlowDma;

impl DmaEngine for SlowDma {
    fn name(&self) -> &'static str {
        "slow"
    }
    fn copy(&mut self, jobs: &[CopyJob<'_>]) -> Result<(), DmaError> {
        std::thread::sleep(Duration::from_millis(5) * jobs.len() as u32);
        SoftwareDma.copy(jobs)
    }
}

#[test]
fn a_client_that_goes_away_mid_push_leaves_no_object_and_its_slots_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(
        AgentConfig {
            queue_depth: 4,
            slot_size: 4096,
            ..AgentConfig::default()
        },
        Box::new(PosixBackend::open(dir.path(), PosixOptions::default()).unwrap()),
        Box::new(SlowDma),
    )
    .unwrap();
    let client = Client::new(&agent, 7, 4 << 20);
    let (tx, rx) = crossbeam_channel::bounded(1);
    let push = Request::PushBatch {
        segments: vec![Segment {
            key: "partial".into(),
            buffer: client.buffer,
            offset: 0,
            len: 4 << 20,
        }],
    };
    agent.handle(
        7,
        &tests(),
        &protocol::encode(&Message::Request(1, push)),
        Vec::new(),
        Box::new(move |b| {
            let _ = tx.send(b);
        }),
    );
    // Mid-transfer (1024 chunks at ≥ 5 ms per batch): the client's connection closes.
    std::thread::sleep(Duration::from_millis(100));
    assert!(agent.stats().free_slots < 4, "the transfer is running");
    assert_eq!(
        std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
        1
    );
    agent.disconnected(7);
    let answer = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let Ok(Message::Response(1, Response::Batch { results })) = protocol::decode(&answer) else {
        panic!()
    };
    assert_eq!(results[0].status, Status::Cancelled);
    let stats = agent.stats();
    assert_eq!(
        (stats.free_slots, stats.objects, stats.cancelled),
        (4, 0, 1)
    );
    assert_eq!(
        std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
        0
    );
    assert_eq!(
        std::fs::read_dir(dir.path().join("objects"))
            .unwrap()
            .count(),
        0
    );
}

#[test]
fn a_client_of_another_version_is_told_and_bad_messages_are_named() {
    let agent = small_agent(Box::new(MemoryBackend::new()), 1 << 20);
    let send = |bytes: Vec<u8>| {
        let (tx, rx) = crossbeam_channel::bounded(1);
        agent.handle(
            1,
            &tests(),
            &bytes,
            Vec::new(),
            Box::new(move |b| {
                let _ = tx.send(b);
            }),
        );
        rx.recv().unwrap()
    };
    let older = protocol::encode_as(
        &Message::Request(5, Request::PullInfo { keys: vec![] }),
        protocol::VERSION + 1,
    );
    let err = protocol::decode(&send(older)).unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "the agent speaks version {}, this client sent version {}",
            protocol::VERSION,
            protocol::VERSION + 1
        )),
        "{err}"
    );
    let mut cut = protocol::encode(&Message::Request(5, Request::PullInfo { keys: vec![] }));
    cut.pop();
    let answer = protocol::decode(&send(cut)).unwrap();
    assert!(
        matches!(&answer, Message::Response(_, Response::Error { status: Status::BadRequest, message }) if message.contains("declared")),
        "{answer:?}"
    );
    // A buffer registers with its memory as a descriptor, never by a name: none, or
    // a plain file's (what a symlink in /dev/shm leads to), is refused, and the
    // answer says nothing of any other file.
    let answer = ask(
        &agent,
        1,
        Request::Register {
            len: 10,
            hw_export: vec![],
        },
    );
    assert!(
        matches!(&answer, Response::Error { status: Status::BadBuffer, message } if message.contains("exactly one descriptor")),
        "{answer:?}"
    );
    let file = tempfile::tempfile().unwrap();
    file.set_len(10).unwrap();
    let answer = ask_with(
        &agent,
        1,
        Request::Register {
            len: 10,
            hw_export: vec![],
        },
        vec![file.into()],
    );
    assert!(
        matches!(&answer, Response::Error { status: Status::BadBuffer, message } if message.contains("not sealed")),
        "{answer:?}"
    );
}

#[test]
fn a_restarted_agent_finds_its_objects_and_drops_a_corrupted_one_on_read() {
    let dir = tempfile::tempdir().unwrap();
    let backend = || Box::new(PosixBackend::open(dir.path(), PosixOptions::default()).unwrap());
    {
        let agent = small_agent(backend(), 1 << 30);
        let client = Client::new(&agent, 1, 10_000);
        assert_eq!(client.put("keep", &data(9000, 1)).status, Status::Ok);
        assert_eq!(client.put("rot", &data(9000, 2)).status, Status::Ok);
    }
    // A bit flips on disk.
    let path = PosixBackend::open(dir.path(), PosixOptions::default())
        .unwrap()
        .object_path("tests/rot");
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&path, bytes).unwrap();

    let agent = small_agent(backend(), 1 << 30);
    assert_eq!(agent.stats().objects, 2);
    let client = Client::new(&agent, 1, 10_000);
    assert!(client.get("keep").unwrap() == data(9000, 1));
    let err = client.get("rot").unwrap_err();
    assert_eq!(err.status, Status::Corrupt, "{err:?}");
    assert_eq!(client.get("rot").unwrap_err().status, Status::NotFound);
}

#[test]
fn the_node_stores_and_reads_its_own_bytes_through_the_same_catalog() {
    let dir = tempfile::tempdir().unwrap();
    let agent = small_agent(
        Box::new(PosixBackend::open(dir.path(), PosixOptions::default()).unwrap()),
        10_000,
    );
    let put = |key: &str, bytes: Vec<u8>| put_local(&agent, key, bytes);
    let meta = put("http/a", data(6000, 1)).unwrap();
    assert_eq!(
        (meta.size, meta.crc32),
        (6000, crc32fast::hash(&data(6000, 1)))
    );
    assert!(agent.get_bytes("http/a").unwrap().unwrap() == data(6000, 1));
    assert_eq!(agent.get_bytes("http/none").unwrap(), None);
    // The capacity counts them: the next evicts the first.
    put("http/b", data(6000, 2)).unwrap();
    assert_eq!(agent.get_bytes("http/a").unwrap(), None);
    assert!(
        put("", vec![1])
            .unwrap_err()
            .to_string()
            .contains("empty key")
    );
    let too_big = put("big", data(10_001, 3)).unwrap_err();
    assert!(too_big.to_string().contains("capacity"), "{too_big}");
    // A client of a service acts in its own namespace: the node's objects (its
    // cached response bodies, under `.node/`) are out of its reach, by any key.
    let node_key = crate::namespace::Namespace::node().key("http/c");
    put(&node_key, data(100, 3)).unwrap();
    let client = Client::new(&agent, 1, 8000);
    for key in ["http/c", ".node/http/c", "../.node/http/c"] {
        assert_eq!(
            client.get(key).unwrap_err().status,
            Status::NotFound,
            "{key}"
        );
    }
    assert_eq!(client.put(".node/http/c", b"poison").status, Status::Ok);
    assert!(agent.get_bytes(&node_key).unwrap().unwrap() == data(100, 3));
    let Response::Listed { objects, .. } = ask(
        &agent,
        1,
        Request::List {
            prefix: String::new(),
            after: None,
            limit: 100,
        },
    ) else {
        panic!()
    };
    let keys: Vec<_> = objects.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(keys, [".node/http/c"], "only its own, as it named it");
    assert_eq!(agent.purge_key("http/b"), 1);
    assert_eq!(agent.get_bytes("http/b").unwrap(), None);
}

#[test]
fn the_memory_copy_never_outlives_the_stored_object() {
    let agent = small_agent(Box::new(MemoryBackend::new()), 10_000);
    let put = |key: &str, bytes: Vec<u8>| put_local(&agent, key, bytes).unwrap();
    put("k", b"first".to_vec());
    assert_eq!(agent.get_bytes("k").unwrap().unwrap(), b"first");
    assert_eq!(agent.stats().memory_bytes, 5);
    // A client replaces it (the object of its namespace): the node reads the new
    // version.
    put("tests/k", b"first".to_vec());
    let client = Client::new(&agent, 1, 100);
    assert_eq!(client.put("k", b"second").status, Status::Ok);
    assert_eq!(agent.get_bytes("tests/k").unwrap().unwrap(), b"second");
    // Evicted by a larger object: gone from memory too.
    put("big", data(9_996, 1));
    assert_eq!(agent.get_bytes("tests/k").unwrap(), None);
    // Deleted by a client.
    put("tests/d", b"x".to_vec());
    let Response::Batch { results } = ask(
        &agent,
        1,
        Request::Delete {
            keys: vec!["d".into()],
        },
    ) else {
        panic!()
    };
    assert_eq!(results[0].status, Status::Ok);
    assert_eq!(agent.get_bytes("tests/d").unwrap(), None);
}

#[test]
fn the_agent_may_be_dropped_by_its_own_worker() {
    let agent = Arc::new(small_agent(Box::new(MemoryBackend::new()), 1 << 20));
    let (tx, rx) = crossbeam_channel::bounded(1);
    let (done_tx, done_rx) = crossbeam_channel::bounded(1);
    let held = agent.clone();
    agent.put_bytes(
        "k".into(),
        b"v".to_vec(),
        Box::new(move |r| {
            // Wait until the test let go, so that this drop is the last.
            let _ = rx.recv();
            drop(held);
            let _ = done_tx.send(r.is_ok());
        }),
    );
    drop(agent);
    tx.send(()).unwrap();
    // The worker drops the agent (without joining itself) and goes on.
    assert_eq!(done_rx.recv_timeout(Duration::from_secs(5)), Ok(true));
}

use std::fs::OpenOptions;

use super::*;

fn region(bytes: &[u8]) -> SharedRegion {
    let r = SharedRegion::create_unique("dpumesh-test-store", bytes.len().max(1) + 64).unwrap();
    r.write(0, bytes).unwrap();
    r
}

fn store(backend: &dyn Backend, key: &str, bytes: &[u8]) {
    let staging = region(bytes);
    let mut w = backend.create(key).unwrap();
    let half = bytes.len() / 2;
    w.append(&staging, 0, half).unwrap();
    w.append(&staging, half as u64, bytes.len() - half).unwrap();
    let meta = ObjectMeta {
        key: key.into(),
        size: bytes.len() as u64,
        crc32: crc32fast::hash(bytes),
    };
    w.commit(&meta).unwrap();
}

fn load(backend: &dyn Backend, key: &str) -> Option<Vec<u8>> {
    let mut r = backend.open(key).unwrap()?;
    let size = r.meta().size as usize;
    let staging = SharedRegion::create_unique("dpumesh-test-store", size + 1).unwrap();
    r.read_next(&staging, 0, size).unwrap();
    assert!(r.read_next(&staging, 0, 1).is_err(), "nothing past the end");
    Some(staging.read_vec(0, size).unwrap())
}

fn both() -> Vec<(Box<dyn Backend>, Option<tempfile::TempDir>)> {
    let dir = tempfile::tempdir().unwrap();
    let posix = PosixBackend::open(dir.path(), PosixOptions { fsync: true }).unwrap();
    vec![
        (Box::new(MemoryBackend::new()), None),
        (Box::new(posix), Some(dir)),
    ]
}

#[test]
fn objects_are_stored_replaced_and_removed() {
    for (backend, _dir) in both() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
        store(&*backend, "a/1", &data);
        store(&*backend, "a/empty", b"");
        assert_eq!(load(&*backend, "a/1").unwrap(), data, "{}", backend.name());
        assert_eq!(load(&*backend, "a/empty").unwrap(), b"");
        store(&*backend, "a/1", b"second");
        assert_eq!(load(&*backend, "a/1").unwrap(), b"second");
        let mut found = backend.recover().unwrap();
        found.sort_by(|a, b| a.key.cmp(&b.key));
        let keys: Vec<_> = found.iter().map(|m| m.key.as_str()).collect();
        assert_eq!(keys, ["a/1", "a/empty"]);
        assert_eq!(found[0].crc32, crc32fast::hash(b"second"));
        backend.remove("a/1").unwrap();
        backend.remove("never").unwrap();
        assert!(load(&*backend, "a/1").is_none());
    }
}

#[test]
fn an_uncommitted_write_leaves_nothing_and_a_reader_keeps_its_version() {
    for (backend, dir) in both() {
        store(&*backend, "k", b"old bytes");
        let mut reader = backend.open("k").unwrap().unwrap();
        let staging = region(b"new bytes, never committed");
        let mut w = backend.create("k").unwrap();
        w.append(&staging, 0, 9).unwrap();
        drop(w);
        assert_eq!(load(&*backend, "k").unwrap(), b"old bytes");
        if let Some(dir) = &dir {
            assert_eq!(
                std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
                0
            );
        }
        // Replaced and removed under an open reader: it reads what it opened.
        store(&*backend, "k", b"replaced!");
        backend.remove("k").unwrap();
        let out = SharedRegion::create_unique("dpumesh-test-store", 16).unwrap();
        reader.read_next(&out, 0, 9).unwrap();
        assert_eq!(out.read_vec(0, 9).unwrap(), b"old bytes");
    }
}

#[test]
fn a_restart_removes_interrupted_writes_and_damaged_objects() {
    let dir = tempfile::tempdir().unwrap();
    let backend = PosixBackend::open(dir.path(), PosixOptions::default()).unwrap();
    store(&backend, "whole", b"whole object");
    // A crash mid-write: a temporary that was never renamed.
    let staging = region(b"partial");
    let mut w = backend.create("torn").unwrap();
    w.append(&staging, 0, 7).unwrap();
    std::mem::forget(w);
    // A file cut short (a disk that lost its tail) and one that is not ours.
    let good = backend.object_path("whole");
    let cut = backend.object_path("cut");
    std::fs::copy(&good, &cut).unwrap();
    let len = std::fs::metadata(&cut).unwrap().len();
    OpenOptions::new()
        .write(true)
        .open(&cut)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    std::fs::write(backend.object_path("junk"), b"junk").unwrap();

    let again = PosixBackend::open(dir.path(), PosixOptions::default()).unwrap();
    let found = again.recover().unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].key, "whole");
    assert!(again.open("torn").unwrap().is_none());
    assert_eq!(
        std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
        0
    );
    assert_eq!(
        std::fs::read_dir(dir.path().join("objects"))
            .unwrap()
            .count(),
        1
    );
}

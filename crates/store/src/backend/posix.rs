//! Objects as files in a directory on the DPU's storage.
//!
//! `DIR/objects/<sha256 of the key>` holds one object: a header (magic `DPMO`,
//! version, size, CRC-32, key length), the key, then the bytes. A write goes to
//! `DIR/tmp/` and is renamed into `objects/` once whole, so a reader (or a restart)
//! never sees a torn object: a crash mid-write leaves only a temporary, which the next
//! start removes. With `fsync`, the data and the directory are synced before the
//! object counts as stored (survives power loss, at a cost); without it, a process
//! crash still loses nothing committed.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use dpumesh_dpa::SharedRegion;
use sha2::Digest;

use super::{Backend, ObjectMeta, ObjectReader, ObjectWriter, StorageError};

const MAGIC: [u8; 4] = *b"DPMO";
const FORMAT: u16 = 1;
/// magic, format, reserved, size, crc, key length.
const FIXED: usize = 4 + 2 + 2 + 8 + 4 + 4;

/// How the POSIX backend writes.
#[derive(Debug, Clone, Copy, Default)]
pub struct PosixOptions {
    /// Sync data and directory before an object counts as stored.
    pub fsync: bool,
}

/// Objects as files under a directory.
#[derive(Debug)]
pub struct PosixBackend {
    objects: PathBuf,
    tmp: PathBuf,
    options: PosixOptions,
    next: AtomicU64,
}

impl PosixBackend {
    /// Uses (and creates) `dir`.
    pub fn open(dir: &Path, options: PosixOptions) -> Result<Self, StorageError> {
        let objects = dir.join("objects");
        let tmp = dir.join("tmp");
        for d in [&objects, &tmp] {
            std::fs::create_dir_all(d).map_err(|e| StorageError::io(d.display(), e))?;
        }
        Ok(Self {
            objects,
            tmp,
            options,
            next: AtomicU64::new(0),
        })
    }

    /// The file that holds `key`'s object (when it exists).
    pub fn object_path(&self, key: &str) -> PathBuf {
        self.objects
            .join(hex::encode(sha2::Sha256::digest(key.as_bytes())))
    }
}

fn data_offset(key: &str) -> u64 {
    (FIXED + key.len()) as u64
}

fn encode_header(meta: &ObjectMeta) -> Vec<u8> {
    let mut h = Vec::with_capacity(FIXED + meta.key.len());
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&FORMAT.to_le_bytes());
    h.extend_from_slice(&0u16.to_le_bytes());
    h.extend_from_slice(&meta.size.to_le_bytes());
    h.extend_from_slice(&meta.crc32.to_le_bytes());
    h.extend_from_slice(&(meta.key.len() as u32).to_le_bytes());
    h.extend_from_slice(meta.key.as_bytes());
    h
}

/// Reads and checks a file's header; the file is left at the object's first byte.
fn read_header(file: &mut File, what: &Path) -> Result<ObjectMeta, StorageError> {
    let damaged = |why: String| StorageError::Damaged {
        what: what.display().to_string(),
        why,
    };
    let mut fixed = [0u8; FIXED];
    file.read_exact(&mut fixed)
        .map_err(|e| damaged(format!("no header: {e}")))?;
    if fixed[0..4] != MAGIC {
        return Err(damaged("not a BlueCache object (bad magic)".into()));
    }
    let format = u16::from_le_bytes([fixed[4], fixed[5]]);
    if format != FORMAT {
        return Err(damaged(format!(
            "object format {format}, expected {FORMAT}"
        )));
    }
    let size = u64::from_le_bytes(fixed[8..16].try_into().expect("8 bytes"));
    let crc32 = u32::from_le_bytes(fixed[16..20].try_into().expect("4 bytes"));
    let key_len = u32::from_le_bytes(fixed[20..24].try_into().expect("4 bytes")) as usize;
    if key_len > crate::protocol::MAX_KEY {
        return Err(damaged(format!("a key of {key_len} bytes")));
    }
    let mut key = vec![0u8; key_len];
    file.read_exact(&mut key)
        .map_err(|e| damaged(format!("no key: {e}")))?;
    let key = String::from_utf8(key).map_err(|_| damaged("a key that is not UTF-8".into()))?;
    let len = file
        .metadata()
        .map_err(|e| StorageError::io(what.display(), e))?
        .len();
    if len != data_offset(&key) + size {
        return Err(damaged(format!(
            "{len} bytes on disk for a {size}-byte object"
        )));
    }
    Ok(ObjectMeta { key, size, crc32 })
}

impl Backend for PosixBackend {
    fn name(&self) -> &'static str {
        "posix"
    }

    fn create(&self, key: &str) -> Result<Box<dyn ObjectWriter>, StorageError> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let tmp = self.tmp.join(format!("{}-{n}", std::process::id()));
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| StorageError::io(tmp.display(), e))?;
        file.seek(SeekFrom::Start(data_offset(key)))
            .map_err(|e| StorageError::io(tmp.display(), e))?;
        Ok(Box::new(Writer {
            file: Some(file),
            tmp,
            target: self.object_path(key),
            options: self.options,
        }))
    }

    fn open(&self, key: &str) -> Result<Option<Box<dyn ObjectReader>>, StorageError> {
        let path = self.object_path(key);
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StorageError::io(path.display(), e)),
        };
        let meta = read_header(&mut file, &path)?;
        if meta.key != key {
            // Two keys with one SHA-256: never seen, but never served as the other.
            return Ok(None);
        }
        Ok(Some(Box::new(Reader { file, path, meta })))
    }

    fn remove(&self, key: &str) -> Result<(), StorageError> {
        let path = self.object_path(key);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StorageError::io(path.display(), e)),
        }
    }

    fn recover(&self) -> Result<Vec<ObjectMeta>, StorageError> {
        let read = |d: &Path| std::fs::read_dir(d).map_err(|e| StorageError::io(d.display(), e));
        for entry in read(&self.tmp)?.flatten() {
            tracing::info!(file = %entry.path().display(), "removing an interrupted write");
            let _ = std::fs::remove_file(entry.path());
        }
        let mut found = Vec::new();
        for entry in read(&self.objects)?.flatten() {
            let path = entry.path();
            let header = File::open(&path)
                .map_err(|e| StorageError::io(path.display(), e))
                .and_then(|mut f| read_header(&mut f, &path));
            match header {
                Ok(meta) if self.object_path(&meta.key) == path => found.push(meta),
                Ok(meta) => {
                    tracing::warn!(file = %path.display(), key = meta.key, "removing an object stored under another key's name");
                    let _ = std::fs::remove_file(&path);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "removing a damaged object");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Ok(found)
    }
}

struct Writer {
    file: Option<File>,
    tmp: PathBuf,
    target: PathBuf,
    options: PosixOptions,
}

impl ObjectWriter for Writer {
    fn append(
        &mut self,
        region: &SharedRegion,
        offset: u64,
        len: usize,
    ) -> Result<(), StorageError> {
        let file = self.file.as_ref().expect("open until commit");
        let mut done = 0;
        while done < len {
            // Straight from the staging buffer to the file: no bounce copy.
            match region.write_to(file.as_fd(), offset + done as u64, len - done) {
                Ok(0) => {
                    return Err(StorageError::io(
                        self.tmp.display(),
                        std::io::ErrorKind::WriteZero.into(),
                    ));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(StorageError::io(self.tmp.display(), e)),
            }
        }
        Ok(())
    }

    fn append_bytes(&mut self, bytes: &[u8]) -> Result<(), StorageError> {
        use std::io::Write;
        let mut file = self.file.as_ref().expect("open until commit");
        file.write_all(bytes)
            .map_err(|e| StorageError::io(self.tmp.display(), e))
    }

    fn commit(mut self: Box<Self>, meta: &ObjectMeta) -> Result<(), StorageError> {
        let file = self.file.take().expect("open until commit");
        let io = |e| StorageError::io(self.tmp.display(), e);
        file.write_all_at(&encode_header(meta), 0).map_err(io)?;
        if self.options.fsync {
            file.sync_all().map_err(io)?;
        }
        drop(file);
        std::fs::rename(&self.tmp, &self.target).map_err(io)?;
        if self.options.fsync
            && let Some(dir) = self.target.parent()
        {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| StorageError::io(dir.display(), e))?;
        }
        Ok(())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Not committed: the temporary goes.
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

struct Reader {
    file: File,
    path: PathBuf,
    meta: ObjectMeta,
}

impl ObjectReader for Reader {
    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    fn read_bytes(&mut self, out: &mut [u8]) -> Result<(), StorageError> {
        self.file.read_exact(out).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => StorageError::Damaged {
                what: self.path.display().to_string(),
                why: "shorter than its header says".into(),
            },
            _ => StorageError::io(self.path.display(), e),
        })
    }

    fn read_next(
        &mut self,
        region: &SharedRegion,
        offset: u64,
        len: usize,
    ) -> Result<(), StorageError> {
        let mut done = 0;
        while done < len {
            match region.read_from(self.file.as_fd(), offset + done as u64, len - done) {
                Ok(0) => {
                    return Err(StorageError::Damaged {
                        what: self.path.display().to_string(),
                        why: "shorter than its header says".into(),
                    });
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(StorageError::io(self.path.display(), e)),
            }
        }
        Ok(())
    }
}

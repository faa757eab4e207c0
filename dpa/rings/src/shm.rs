//! Shared memory regions: a file in `/dev/shm` mapped `MAP_SHARED` by every process
//! of a node that takes part in the data path (FreeFlow names its regions the same
//! way, so `ls /dev/shm` shows what is mapped). Pools and rings live in regions; the
//! control channel exports a region by its path, size and id.
//!
//! This module is one of the few with `unsafe`: it owns the mapping and is the only
//! code that reads or writes its bytes. Every access is bounds-checked; bytes are
//! copied with raw pointers (never through `&[u8]`, since another process may write
//! them at any time), and the atomics that rings and pools use are handed out only at
//! aligned, in-bounds offsets.
//!
//! **Trust.** Payload bytes are plain data that another process (or another thread
//! here) may be writing while they are copied: the protocols on top (ring publication,
//! slot ownership) decide when bytes are meaningful, and a racing copy yields torn bytes,
//! never a memory-safety problem in the copying code.
//!
//! What a pod shares with its node is a **sealed** region ([`SharedRegion::create_sealed`],
//! [`SharedRegion::from_fd`]): an anonymous memfd, sealed against shrinking and growing,
//! passed as a descriptor over the Unix control socket (`SCM_RIGHTS`). It has no name
//! another process could open, so a pod maps only what it was given (its own regions
//! and its node's); and no process can truncate it, so the SIGBUS that a truncated
//! mapping deals on the next access cannot happen to the node. A region received from
//! another process is mapped only if it carries the shrink seal. Named regions in
//! [`shm_dir`] remain for the mesh's own processes (the ingress and the nodes' fabric).
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// Why a region could not be created, opened or accessed.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// The file could not be created or opened.
    #[error("cannot open shared memory {path}: {source}")]
    Open {
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file could not be sized or mapped.
    #[error("cannot map shared memory {path} ({len} bytes): {source}")]
    Map {
        path: PathBuf,
        len: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A region must hold at least one byte.
    #[error("shared memory {0} is empty")]
    Empty(PathBuf),
    /// An access outside the region.
    #[error("access of {len} bytes at offset {offset} is outside the {size}-byte region {name}")]
    OutOfBounds {
        /// The region's name.
        name: String,
        /// Where the access started.
        offset: u64,
        len: u64,
        /// The region's size.
        size: usize,
    },
    /// A name that is not a plain file name.
    #[error("{0:?} is not a usable region name (letters, digits, '-', '_', '.')")]
    Name(String),
    /// A region received from another process that could still be truncated under
    /// this one.
    #[error(
        "region {0} is not sealed against shrinking: only a memfd with F_SEAL_SHRINK is mapped from another process"
    )]
    NotSealed(String),
}

/// The directory regions are created in: `$DPUMESH_SHM_DIR`, else `/dev/shm`, else the
/// temporary directory (still shared between processes, but backed by disk).
pub fn shm_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("DPUMESH_SHM_DIR") {
        return PathBuf::from(dir);
    }
    let dev_shm = Path::new("/dev/shm");
    if dev_shm.is_dir() {
        dev_shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

/// The process that created a region named by [`SharedRegion::create_unique`]
/// (`prefix-PID-N`), read back from the name.
fn creator(name: &str) -> Option<u32> {
    let mut parts = name.rsplitn(3, '-');
    let n = parts.next()?;
    let pid = parts.next()?;
    parts.next()?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// Removes the regions in [`shm_dir`] that a dead process of this user left behind (a
/// process killed with SIGKILL never unlinks its regions). Every role calls it as it
/// starts, so a process that crashed and was started again, by `dpumesh up` or an
/// orchestrator, takes its predecessor's leftovers with it. Returns how many it
/// removed.
///
/// Mappings others still hold stay valid: only the names go. A region goes when the
/// pid in its name is gone (`/proc/PID`) *and* no process holds the shared `flock`
/// its creator takes on it for its life (the kernel drops it when the creator dies,
/// however it dies). The lock is what makes a directory shared across pid namespaces
/// (a host's `/dev/shm` mounted into a container) safe to sweep: a pid from another
/// namespace looks dead here, its lock does not. A creator locks its file before it
/// sizes it, so an empty file younger than [`SWEEP_MIN_AGE`] is left alone (its
/// creator may not have locked it yet).
pub fn sweep_orphans() -> usize {
    sweep_orphans_in(&shm_dir())
}

/// How old an empty region file must be before a sweep may take it (see
/// [`sweep_orphans`]).
pub const SWEEP_MIN_AGE: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether some process holds `path`'s creator lock (or it cannot be checked).
fn held(path: &Path) -> bool {
    use rustix::fs::{FlockOperation, flock};
    let Ok(file) = File::open(path) else {
        return true;
    };
    // The lock is released when `file` closes, right after.
    flock(&file, FlockOperation::NonBlockingLockExclusive).is_err()
}

fn sweep_orphans_in(dir: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let me = rustix::process::geteuid().as_raw();
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("dpumesh-") {
            continue;
        }
        let Some(pid) = creator(name) else { continue };
        let alive = Path::new("/proc").join(pid.to_string()).exists();
        let mine = entry.metadata().is_ok_and(|m| {
            m.uid() == me
                && m.is_file()
                && (m.len() > 0
                    || m.modified()
                        .ok()
                        .and_then(|t| t.elapsed().ok())
                        .is_some_and(|age| age >= SWEEP_MIN_AGE))
        });
        if !alive && mine && !held(&entry.path()) && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::info!(removed, dir = %dir.display(), "removed shared regions of dead processes");
    }
    removed
}

/// A mapped shared memory region.
pub struct SharedRegion {
    ptr: NonNull<u8>,
    len: usize,
    path: PathBuf,
    name: String,
    /// The creator removes the file when it drops the region; mappings that others
    /// hold stay valid (the kernel keeps the pages until the last unmap).
    unlink_on_drop: bool,
    _file: File,
}

// SAFETY: the region is plain shared memory; every access goes through bounds-checked
// raw copies or atomics, which are sound from any thread.
unsafe impl Send for SharedRegion {}
// SAFETY: as above; no method hands out non-atomic references into the mapping.
unsafe impl Sync for SharedRegion {}

impl std::fmt::Debug for SharedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRegion")
            .field("path", &self.path)
            .field("len", &self.len)
            .finish()
    }
}

fn check_name(name: &str) -> Result<(), ShmError> {
    let ok = !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ShmError::Name(name.to_owned()))
    }
}

impl SharedRegion {
    /// Creates region `name` of `len` bytes (zeroed) in [`shm_dir`]. Fails if it exists.
    pub fn create(name: &str, len: usize) -> Result<Self, ShmError> {
        check_name(name)?;
        let path = shm_dir().join(name);
        if len == 0 {
            return Err(ShmError::Empty(path));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|source| ShmError::Open {
                path: path.clone(),
                source,
            })?;
        // The creator's lock, held while `file` is open (the region's life): what a
        // sweep in another pid namespace sees (see `sweep_orphans`). A filesystem
        // without flock leaves it off; the pid check still applies there.
        let _ = rustix::fs::flock(&file, rustix::fs::FlockOperation::LockShared);
        let map_err = |source: std::io::Error| ShmError::Map {
            path: path.clone(),
            len,
            source,
        };
        if let Err(e) = file.set_len(len as u64) {
            let _ = std::fs::remove_file(&path);
            return Err(map_err(e));
        }
        match Self::map(file, len, path.clone(), true) {
            Ok(region) => Ok(region),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Creates a region with a name unique to this process: `prefix-PID-N`.
    pub fn create_unique(prefix: &str, len: usize) -> Result<Self, ShmError> {
        use std::sync::atomic::Ordering;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let name = format!("{prefix}-{}-{n}", std::process::id());
            match Self::create(&name, len) {
                Err(ShmError::Open { source, .. })
                    if source.kind() == std::io::ErrorKind::AlreadyExists => {}
                other => return other,
            }
        }
    }

    /// Creates an anonymous region `name` (a memfd) of `len` bytes, zeroed, sealed
    /// against shrinking and growing (and against more seals). It is shared by passing
    /// [`Self::fd`]; its [`Self::path`] is `/proc/PID/fd/N`, which only processes
    /// allowed to look into this one (its user's, while it is dumpable) can open: what
    /// the software fabric's peers, the mesh's own processes, map it through.
    pub fn create_sealed(name: &str, len: usize) -> Result<Self, ShmError> {
        use rustix::fs::{MemfdFlags, SealFlags, fcntl_add_seals, memfd_create};
        use std::os::fd::AsRawFd;
        check_name(name)?;
        let shown = PathBuf::from(format!("memfd:{name}"));
        if len == 0 {
            return Err(ShmError::Empty(shown));
        }
        let err = |source: std::io::Error| ShmError::Map {
            path: shown.clone(),
            len,
            source,
        };
        let fd =
            memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).map_err(|e| {
                ShmError::Open {
                    path: shown.clone(),
                    source: e.into(),
                }
            })?;
        let file = File::from(fd);
        file.set_len(len as u64).map_err(err)?;
        fcntl_add_seals(&file, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| err(e.into()))?;
        let path = PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            file.as_raw_fd()
        ));
        let mut region = Self::map(file, len, path, false)?;
        region.name = name.to_owned();
        Ok(region)
    }

    /// Maps a region another process passed as a descriptor (`name` for messages),
    /// at its whole size. It must be sealed against shrinking: otherwise the sender
    /// could truncate it and this process would die of SIGBUS at its next access.
    pub fn from_fd(fd: std::os::fd::OwnedFd, name: &str) -> Result<Self, ShmError> {
        use rustix::fs::{SealFlags, fcntl_get_seals};
        let path = PathBuf::from(format!("memfd:{name}"));
        let sealed = fcntl_get_seals(&fd).is_ok_and(|s| s.contains(SealFlags::SHRINK));
        if !sealed {
            return Err(ShmError::NotSealed(name.to_owned()));
        }
        let file = File::from(fd);
        let len = file
            .metadata()
            .map_err(|source| ShmError::Open {
                path: path.clone(),
                source,
            })?
            .len() as usize;
        if len == 0 {
            return Err(ShmError::Empty(path));
        }
        // Reachable by the software fabric's peers as a region this process made is
        // (a host agent's pod pools, which a split node registers with its fabric).
        let path = PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            std::os::fd::AsRawFd::as_raw_fd(&file)
        ));
        let mut region = Self::map(file, len, path, false)?;
        region.name = name.to_owned();
        Ok(region)
    }

    /// The descriptor of the region's memory, to pass to the process it is shared
    /// with.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self._file.as_fd()
    }

    /// Maps an existing region by path (what the control channel exports).
    pub fn open(path: &Path) -> Result<Self, ShmError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| ShmError::Open {
                path: path.to_owned(),
                source,
            })?;
        let len = file
            .metadata()
            .map_err(|source| ShmError::Open {
                path: path.to_owned(),
                source,
            })?
            .len() as usize;
        if len == 0 {
            return Err(ShmError::Empty(path.to_owned()));
        }
        Self::map(file, len, path.to_owned(), false)
    }

    fn map(file: File, len: usize, path: PathBuf, unlink_on_drop: bool) -> Result<Self, ShmError> {
        use rustix::mm::{MapFlags, ProtFlags, mmap};
        // SAFETY: a fresh shared mapping of a file we hold open, at an address the
        // kernel picks; nothing else refers to it until this struct hands it out.
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &file,
                0,
            )
        }
        .map_err(|e| ShmError::Map {
            path: path.clone(),
            len,
            source: e.into(),
        })?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Self {
            ptr: NonNull::new(ptr.cast()).ok_or_else(|| ShmError::Map {
                path: path.clone(),
                len,
                source: std::io::Error::other("mmap returned null"),
            })?,
            len,
            path,
            name,
            unlink_on_drop,
            _file: file,
        })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty; here for clippy's sake.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file backing the region (what another process opens).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where this process mapped the region (what a verbs MR registers, and the base
    /// of the virtual addresses the software fabric hands out). Only for address
    /// arithmetic and registration; never dereferenced outside this module.
    pub fn base_addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    fn check(&self, offset: u64, len: u64) -> Result<usize, ShmError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(offset as usize),
            _ => Err(ShmError::OutOfBounds {
                name: self.name.clone(),
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), ShmError> {
        let at = self.check(offset, src.len() as u64)?;
        // SAFETY: [at, at + len) is inside the mapping (checked); `src` is a distinct
        // Rust slice, so the ranges cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(at), src.len());
        }
        Ok(())
    }

    /// Copies from the region at `offset` into `dst`.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), ShmError> {
        let at = self.check(offset, dst.len() as u64)?;
        // SAFETY: as in `write`, in the other direction.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(at), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// `len` bytes at `offset` as a new vector (not zeroed first: every head and
    /// frame a shard or pod receives comes through here).
    pub fn read_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, ShmError> {
        let at = self.check(offset, len as u64)?;
        let mut out = Vec::with_capacity(len);
        // SAFETY: [at, at + len) is inside the mapping (checked), whose bytes are always
        // initialised (a mapped file; a peer writing them meanwhile only changes what
        // is copied, as in `read`); `out` owns room for `len` bytes, a fresh allocation
        // that cannot overlap the mapping, and the copy initialises all of them before
        // `set_len` says so.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(at), out.as_mut_ptr(), len);
            out.set_len(len);
        }
        Ok(out)
    }

    /// Fills `len` bytes at `offset` with `byte`.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<(), ShmError> {
        let at = self.check(offset, len)?;
        // SAFETY: in bounds (checked).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(at), byte, len as usize) };
        Ok(())
    }

    /// Copies `len` bytes from `src` at `src_offset` to this region at `dst_offset`
    /// (the software DMA engine's copy). The same region is allowed; overlapping
    /// ranges are copied as `memmove` would.
    pub fn copy_from(
        &self,
        dst_offset: u64,
        src: &SharedRegion,
        src_offset: u64,
        len: u64,
    ) -> Result<(), ShmError> {
        let to = self.check(dst_offset, len)?;
        let from = src.check(src_offset, len)?;
        // SAFETY: both ranges are inside their mappings (checked); `copy` tolerates
        // overlap when both are the same region.
        unsafe {
            std::ptr::copy(
                src.ptr.as_ptr().add(from),
                self.ptr.as_ptr().add(to),
                len as usize,
            );
        }
        Ok(())
    }

    /// A CRC-free checksum helper for tests and checks: calls `f` with the bytes at
    /// `offset` copied out in chunks of at most 64 KiB.
    pub fn for_each_chunk(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&[u8]),
    ) -> Result<(), ShmError> {
        self.check(offset, len)?;
        let mut buf = vec![0u8; len.min(64 << 10) as usize];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            self.read(offset + done, &mut buf[..n])?;
            f(&buf[..n]);
            done += n as u64;
        }
        Ok(())
    }

    /// One `write(2)` of up to `len` bytes at `offset` to `fd`, straight from the
    /// mapping (the software fabric sends payloads this way, with no bounce buffer).
    pub fn write_to(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
    ) -> std::io::Result<usize> {
        use std::os::fd::AsRawFd;
        let at = self
            .check(offset, len as u64)
            .map_err(std::io::Error::other)?;
        // SAFETY: the range is inside the mapping (checked); the kernel only reads it,
        // and no Rust reference to the shared bytes is formed.
        let n = unsafe { libc::write(fd.as_raw_fd(), self.ptr.as_ptr().add(at).cast(), len) };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    /// One `read(2)` of up to `len` bytes from `fd` into the mapping at `offset` (the
    /// software fabric lands payloads this way, as a NIC writes registered memory).
    pub fn read_from(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
    ) -> std::io::Result<usize> {
        use std::os::fd::AsRawFd;
        let at = self
            .check(offset, len as u64)
            .map_err(std::io::Error::other)?;
        // SAFETY: the range is inside the mapping (checked); the kernel writes it, and
        // no Rust reference to the shared bytes is formed.
        let n = unsafe { libc::read(fd.as_raw_fd(), self.ptr.as_ptr().add(at).cast(), len) };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    /// `count` `AtomicU64`s starting at `offset` (8-byte aligned).
    pub fn atomic_u64s(&self, offset: u64, count: usize) -> Result<&[AtomicU64], ShmError> {
        let at = self.check(offset, count as u64 * 8)?;
        if at % 8 != 0 {
            return Err(ShmError::OutOfBounds {
                name: format!("{} (misaligned atomic)", self.name),
                offset,
                len: 8,
                size: self.len,
            });
        }
        // SAFETY: in bounds and aligned (checked above; the mapping is page-aligned).
        // The memory is only ever accessed atomically at these offsets by our code in
        // every process, and stays mapped for as long as `self` is borrowed.
        Ok(unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().add(at).cast::<AtomicU64>(), count)
        })
    }

    /// `count` `AtomicU32`s starting at `offset` (4-byte aligned).
    pub fn atomic_u32s(&self, offset: u64, count: usize) -> Result<&[AtomicU32], ShmError> {
        let at = self.check(offset, count as u64 * 4)?;
        if at % 4 != 0 {
            return Err(ShmError::OutOfBounds {
                name: format!("{} (misaligned atomic)", self.name),
                offset,
                len: 4,
                size: self.len,
            });
        }
        // SAFETY: as in `atomic_u64s`.
        Ok(unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().add(at).cast::<AtomicU32>(), count)
        })
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `map` with this pointer and length, and no
        // borrow of it outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        if self.unlink_on_drop {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_sealed_region_is_shared_by_its_descriptor_and_cannot_be_truncated() {
        let region = SharedRegion::create_sealed("dpumesh-test-sealed", 8192).unwrap();
        assert_eq!(region.len(), 8192);
        // What the other process receives: a duplicate of the descriptor.
        let theirs = SharedRegion::from_fd(
            region.fd().try_clone_to_owned().unwrap(),
            "dpumesh-test-sealed",
        )
        .unwrap();
        theirs.write(100, b"from the pod").unwrap();
        let mut got = [0u8; 12];
        region.read(100, &mut got).unwrap();
        assert_eq!(&got, b"from the pod");
        // Neither side can shrink (or grow) it: no SIGBUS for the other.
        let file = File::from(region.fd().try_clone_to_owned().unwrap());
        let e = file.set_len(0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        assert!(file.set_len(1 << 20).is_err());
        assert_eq!(theirs.len(), 8192);
        // No name in the shared-memory folder.
        assert!(!shm_dir().join("dpumesh-test-sealed").exists());
    }

    #[test]
    fn a_region_that_could_be_truncated_is_not_mapped_from_another_process() {
        use rustix::fs::{MemfdFlags, memfd_create};
        let unsealed = memfd_create("dpumesh-test-unsealed", MemfdFlags::CLOEXEC).unwrap();
        File::from(unsealed.try_clone().unwrap())
            .set_len(4096)
            .unwrap();
        assert!(matches!(
            SharedRegion::from_fd(unsealed, "unsealed"),
            Err(ShmError::NotSealed(name)) if name == "unsealed"
        ));
        // A plain file (what a symlink in /dev/shm would lead to) is refused the same.
        let dir = tempfile::tempdir().unwrap();
        let file = File::create(dir.path().join("f")).unwrap();
        file.set_len(4096).unwrap();
        assert!(matches!(
            SharedRegion::from_fd(file.into(), "file"),
            Err(ShmError::NotSealed(_))
        ));
    }

    #[test]
    fn a_region_name_tells_its_creator() {
        assert_eq!(creator("dpumesh-node1-77-pod3-txh-4242-17"), Some(4242));
        assert_eq!(creator("dpumesh-link-9-0"), Some(9));
        assert_eq!(creator("dpumesh-link-x-0"), None);
        assert_eq!(creator("dpumesh-link-9-"), None);
        assert_eq!(creator("something"), None);
    }

    #[test]
    fn the_sweep_removes_only_regions_of_dead_processes() {
        let dir = tempfile::tempdir().unwrap();
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id();
        dead.wait().unwrap();
        let live_pid = std::process::id();
        let names = [
            format!("dpumesh-link-{dead_pid}-0"),
            format!("dpumesh-node1-{dead_pid}-pod1-rxb-{dead_pid}-3"),
            format!("dpumesh-link-{live_pid}-0"),
            format!("other-{dead_pid}-0"),
            "dpumesh-no-pid".to_owned(),
        ];
        for n in &names {
            write_old(&dir.path().join(n));
        }
        // Empty and young: its creator may not have locked it yet.
        let young = format!("dpumesh-link-{dead_pid}-1");
        std::fs::write(dir.path().join(&young), b"").unwrap();
        assert_eq!(sweep_orphans_in(dir.path()), 2);
        std::fs::remove_file(dir.path().join(&young)).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want = names[2..].to_vec();
        want.sort();
        assert_eq!(left, want);
    }

    /// A region file as a sweep finds it a while after its creation (sized: a
    /// region is never empty once made).
    fn write_old(path: &Path) {
        std::fs::write(path, b"x").unwrap();
        let then = std::time::SystemTime::now() - SWEEP_MIN_AGE * 2;
        File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(then)
            .unwrap();
    }

    #[test]
    fn a_region_whose_creator_lives_in_another_pid_namespace_is_kept() {
        // Its pid means nothing here (it looks dead), but its creator holds the lock.
        let dir = tempfile::tempdir().unwrap();
        let mut other = std::process::Command::new("true").spawn().unwrap();
        let pid = other.id();
        other.wait().unwrap();
        let path = dir.path().join(format!("dpumesh-pod-{pid}-0"));
        write_old(&path);
        let creator = File::open(&path).unwrap();
        rustix::fs::flock(&creator, rustix::fs::FlockOperation::LockShared).unwrap();
        assert_eq!(sweep_orphans_in(dir.path()), 0);
        assert!(path.exists());
        // The creator dies (its descriptor closes): the next sweep takes it.
        drop(creator);
        assert_eq!(sweep_orphans_in(dir.path()), 1);
        assert!(!path.exists());
    }

    #[test]
    fn a_created_region_is_held_while_it_lives() {
        let region = SharedRegion::create_unique("dpumesh-test-held", 4096).unwrap();
        assert!(held(region.path()));
        let path = region.path().to_owned();
        let kept = File::open(&path).unwrap();
        drop(region);
        // Unlinked by its creator; a descriptor still open elsewhere holds no lock.
        rustix::fs::flock(&kept, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
    }

    use super::*;

    #[test]
    fn two_mappings_see_each_others_writes() {
        let a = SharedRegion::create_unique("dpumesh-test-shm", 8192).unwrap();
        let b = SharedRegion::open(a.path()).unwrap();
        assert_eq!(b.len(), 8192);
        a.write(100, b"hello").unwrap();
        assert_eq!(b.read_vec(100, 5).unwrap(), b"hello");
        a.atomic_u64s(8, 1).unwrap()[0].store(77, std::sync::atomic::Ordering::Release);
        assert_eq!(
            b.atomic_u64s(8, 1).unwrap()[0].load(std::sync::atomic::Ordering::Acquire),
            77
        );
    }

    #[test]
    fn out_of_bounds_and_misaligned_accesses_are_refused() {
        let r = SharedRegion::create_unique("dpumesh-test-shm", 4096).unwrap();
        assert!(r.write(4090, &[0; 7]).is_err());
        assert!(r.read(u64::MAX, &mut [0; 1]).is_err());
        assert!(r.read_vec(4090, 7).is_err());
        // Refused before anything is allocated for it.
        assert!(r.read_vec(0, usize::MAX).is_err());
        assert!(r.atomic_u64s(4, 1).is_err());
        assert!(r.atomic_u64s(4088, 2).is_err());
        assert!(r.fill(0, 4097, 0).is_err());
        let other = SharedRegion::create_unique("dpumesh-test-shm", 64).unwrap();
        assert!(r.copy_from(0, &other, 32, 64).is_err());
        let err = r.write(4090, &[0; 7]).unwrap_err().to_string();
        assert!(err.contains("7 bytes at offset 4090"), "{err}");
    }

    #[test]
    fn the_creator_removes_the_file_and_names_are_checked() {
        let path = {
            let r = SharedRegion::create_unique("dpumesh-test-shm", 64).unwrap();
            r.path().to_owned()
        };
        assert!(!path.exists());
        assert!(matches!(
            SharedRegion::create("../etc", 64),
            Err(ShmError::Name(_))
        ));
        assert!(SharedRegion::open(Path::new("/dev/shm/dpumesh-no-such-region")).is_err());
    }
}

//! Where objects live on the DPU: a storage backend behind a trait. POSIX files (a
//! directory on the DPU's storage) are the default; memory is for tests and caches
//! that need not survive a restart.
//!
//! An object is visible only once its write is committed: writers fill a private
//! temporary and publish it whole ([`ObjectWriter::commit`]), and dropping a writer
//! uncommitted leaves nothing behind. A reader opened before a replacement or removal
//! keeps reading the bytes it opened.

mod memory;
mod posix;

pub use memory::MemoryBackend;
pub use posix::{PosixBackend, PosixOptions};

use dpumesh_dpa::SharedRegion;

/// An object's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub key: String,
    pub size: u64,
    /// CRC-32 (IEEE) of its bytes, computed as they were stored.
    pub crc32: u32,
}

/// Why storage failed.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("storage I/O on {what}: {source}")]
    Io {
        /// Which file or operation.
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("stored object {what} is damaged: {why}")]
    Damaged { what: String, why: String },
}

impl StorageError {
    pub(crate) fn io(what: impl std::fmt::Display, source: std::io::Error) -> Self {
        Self::Io {
            what: what.to_string(),
            source,
        }
    }
}

/// A storage backend.
pub trait Backend: Send + Sync + 'static {
    /// A name for logs and metrics.
    fn name(&self) -> &'static str;

    /// Starts writing a new version of `key`; nothing is visible until it commits.
    fn create(&self, key: &str) -> Result<Box<dyn ObjectWriter>, StorageError>;

    /// Opens `key` for reading, if it exists.
    fn open(&self, key: &str) -> Result<Option<Box<dyn ObjectReader>>, StorageError>;

    /// Removes `key` (no error if it is not there).
    fn remove(&self, key: &str) -> Result<(), StorageError>;

    /// Every committed object, found at start; what interrupted writes left behind is
    /// removed, and damaged objects are removed and named in the log.
    fn recover(&self) -> Result<Vec<ObjectMeta>, StorageError>;
}

/// An object being written. Dropped without [`ObjectWriter::commit`]: nothing of it
/// remains.
pub trait ObjectWriter: Send {
    /// Appends `len` bytes taken from `region` at `offset` (the staging buffer).
    fn append(
        &mut self,
        region: &SharedRegion,
        offset: u64,
        len: usize,
    ) -> Result<(), StorageError>;

    /// Appends bytes the node holds itself (the HTTP cache's bodies).
    fn append_bytes(&mut self, bytes: &[u8]) -> Result<(), StorageError>;

    /// Publishes the object whole under its key, replacing any older version.
    fn commit(self: Box<Self>, meta: &ObjectMeta) -> Result<(), StorageError>;
}

/// An object being read, front to back.
pub trait ObjectReader: Send {
    fn meta(&self) -> &ObjectMeta;

    /// Reads its next `out.len()` bytes into `out`.
    fn read_bytes(&mut self, out: &mut [u8]) -> Result<(), StorageError>;

    /// Reads its next `len` bytes into `region` at `offset` (the staging buffer).
    fn read_next(
        &mut self,
        region: &SharedRegion,
        offset: u64,
        len: usize,
    ) -> Result<(), StorageError>;
}

#[cfg(test)]
mod tests;

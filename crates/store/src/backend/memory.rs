//! Objects in memory: for tests, and for a cache that need not survive a restart.

use std::collections::HashMap;
use std::sync::Arc;

use dpumesh_dpa::SharedRegion;
use parking_lot::Mutex;

use super::{Backend, ObjectMeta, ObjectReader, ObjectWriter, StorageError};

type Stored = Arc<(ObjectMeta, Vec<u8>)>;

/// Objects in a map.
#[derive(Debug, Default, Clone)]
pub struct MemoryBackend {
    objects: Arc<Mutex<HashMap<String, Stored>>>,
}

impl MemoryBackend {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Backend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn create(&self, key: &str) -> Result<Box<dyn ObjectWriter>, StorageError> {
        Ok(Box::new(Writer {
            key: key.to_owned(),
            bytes: Vec::new(),
            objects: self.objects.clone(),
        }))
    }

    fn open(&self, key: &str) -> Result<Option<Box<dyn ObjectReader>>, StorageError> {
        Ok(self.objects.lock().get(key).map(|stored| {
            Box::new(Reader {
                stored: stored.clone(),
                at: 0,
            }) as Box<dyn ObjectReader>
        }))
    }

    fn remove(&self, key: &str) -> Result<(), StorageError> {
        self.objects.lock().remove(key);
        Ok(())
    }

    fn recover(&self) -> Result<Vec<ObjectMeta>, StorageError> {
        Ok(self.objects.lock().values().map(|s| s.0.clone()).collect())
    }
}

struct Writer {
    key: String,
    bytes: Vec<u8>,
    objects: Arc<Mutex<HashMap<String, Stored>>>,
}

impl ObjectWriter for Writer {
    fn append(
        &mut self,
        region: &SharedRegion,
        offset: u64,
        len: usize,
    ) -> Result<(), StorageError> {
        let start = self.bytes.len();
        self.bytes.resize(start + len, 0);
        region
            .read(offset, &mut self.bytes[start..])
            .map_err(|e| StorageError::io("the staging buffer", std::io::Error::other(e)))
    }

    fn append_bytes(&mut self, bytes: &[u8]) -> Result<(), StorageError> {
        self.bytes.extend_from_slice(bytes);
        Ok(())
    }

    fn commit(self: Box<Self>, meta: &ObjectMeta) -> Result<(), StorageError> {
        let Writer {
            key,
            bytes,
            objects,
        } = *self;
        objects.lock().insert(key, Arc::new((meta.clone(), bytes)));
        Ok(())
    }
}

struct Reader {
    stored: Stored,
    at: usize,
}

impl ObjectReader for Reader {
    fn meta(&self) -> &ObjectMeta {
        &self.stored.0
    }

    fn read_bytes(&mut self, out: &mut [u8]) -> Result<(), StorageError> {
        let end = self.at + out.len();
        let Some(chunk) = self.stored.1.get(self.at..end) else {
            return Err(StorageError::Damaged {
                what: self.stored.0.key.clone(),
                why: format!("read past its end ({end} of {} bytes)", self.stored.1.len()),
            });
        };
        out.copy_from_slice(chunk);
        self.at = end;
        Ok(())
    }

    fn read_next(
        &mut self,
        region: &SharedRegion,
        offset: u64,
        len: usize,
    ) -> Result<(), StorageError> {
        let bytes = &self.stored.1;
        let end = self.at + len;
        let Some(chunk) = bytes.get(self.at..end) else {
            return Err(StorageError::Damaged {
                what: self.stored.0.key.clone(),
                why: format!("read past its end ({end} of {} bytes)", bytes.len()),
            });
        };
        region
            .write(offset, chunk)
            .map_err(|e| StorageError::io("the staging buffer", std::io::Error::other(e)))?;
        self.at = end;
        Ok(())
    }
}

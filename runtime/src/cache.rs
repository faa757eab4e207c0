//! Compiling components once: an in-memory map and an on-disk `.cwasm` cache.
//!
//! A cache entry is keyed by the SHA-256 of the component bytes and by the engine's
//! compatibility hash (wasmtime version, target, compiler settings), so a cached
//! artifact is only ever loaded by an engine that produced an identical one.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// The content hash of a component, hex.
pub(crate) fn content_hash(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Compiles components at most once per content hash.
#[derive(Debug)]
pub(crate) struct CompileCache {
    dir: Option<PathBuf>,
    engine_hash: String,
    memory: Mutex<HashMap<String, Component>>,
}

/// Why a component could not be compiled (the cache itself never fails a load: a bad
/// or unwritable cache falls back to compiling).
#[derive(Debug)]
pub(crate) enum CompileError {
    NotAComponent(String),
    Compile(String),
}

impl CompileCache {
    pub(crate) fn new(engine: &Engine, dir: Option<PathBuf>) -> Self {
        let mut hasher = DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        Self {
            dir,
            engine_hash: format!("{:016x}", hasher.finish()),
            memory: Mutex::new(HashMap::new()),
        }
    }

    /// Where the artifact for `hash` lives on disk, if there is a cache directory.
    pub(crate) fn artifact_path(&self, hash: &str) -> Option<PathBuf> {
        self.dir
            .as_ref()
            .map(|dir| dir.join(format!("{hash}-{}.cwasm", self.engine_hash)))
    }

    /// The compiled component for `bytes`, whose content hash is `hash`.
    pub(crate) fn get_or_compile(
        &self,
        engine: &Engine,
        hash: &str,
        bytes: &[u8],
    ) -> Result<Component, CompileError> {
        if let Some(component) = self.lock().get(hash) {
            return Ok(component.clone());
        }
        let path = self.artifact_path(hash);
        if let Some(component) = path.as_deref().and_then(|p| load_artifact(engine, p)) {
            self.lock().insert(hash.to_owned(), component.clone());
            return Ok(component);
        }
        if !wasmparser_is_component(bytes) {
            return Err(CompileError::NotAComponent(describe_non_component(bytes)));
        }
        let component =
            Component::new(engine, bytes).map_err(|e| CompileError::Compile(format!("{e:#}")))?;
        if let Some(path) = path {
            store_artifact(&component, &path);
        }
        self.lock().insert(hash.to_owned(), component.clone());
        Ok(component)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Component>> {
        self.memory.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A component's preamble: `\0asm`, then version 0x0d and layer 1.
fn wasmparser_is_component(bytes: &[u8]) -> bool {
    bytes.len() >= 8 && bytes[..4] == *b"\0asm" && bytes[4..8] == [0x0d, 0x00, 0x01, 0x00]
}

fn describe_non_component(bytes: &[u8]) -> String {
    if bytes.len() >= 8 && bytes[..4] == *b"\0asm" && bytes[4..8] == [1, 0, 0, 0] {
        "this is a core Wasm module; build a component (cargo build --target wasm32-wasip2, or wasm-tools component new)".to_owned()
    } else if bytes.len() >= 4 && bytes[..4] == *b"\0asm" {
        "unsupported Wasm binary version".to_owned()
    } else {
        format!("missing the \\0asm magic ({} bytes)", bytes.len())
    }
}

fn load_artifact(engine: &Engine, path: &Path) -> Option<Component> {
    if !path.is_file() {
        return None;
    }
    // SAFETY: the artifact was written by `store_artifact` into our own cache directory
    // under a name that binds it to the exact content hash and engine compatibility
    // hash; wasmtime additionally checks the header and refuses artifacts from another
    // engine configuration.
    #[allow(unsafe_code)]
    let loaded = unsafe { Component::deserialize_file(engine, path) };
    match loaded {
        Ok(component) => Some(component),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "discarding unusable cached artifact");
            let _ = std::fs::remove_file(path);
            None
        }
    }
}

fn store_artifact(component: &Component, path: &Path) {
    let result = (|| -> std::io::Result<()> {
        let bytes = component
            .serialize()
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // Write then rename, so a concurrent reader never sees half an artifact.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let unique = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp.{}.{unique}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        tracing::warn!(path = %path.display(), error = %e, "could not write compile cache");
    }
}

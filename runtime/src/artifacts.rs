//! Compiling components once: compiled artifacts in memory and on disk (`.cwasm`
//! files in the artifact directory, `cache_dir` in the runtime's settings, a name kept
//! for compatibility; in this code "cache" means the HTTP response cache alone).
//!
//! An artifact is keyed by the SHA-256 of the component bytes and by the engine's
//! compatibility hash (wasmtime version, target, compiler settings), so a stored
//! artifact is only ever loaded by an engine that produced an identical one.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::{Engine, Module};

/// The content hash of a component, hex.
pub(crate) fn content_hash(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Compiles components at most once per content hash.
#[derive(Debug)]
pub(crate) struct ArtifactStore {
    dir: Option<PathBuf>,
    engine_hash: String,
    memory: Mutex<HashMap<String, Component>>,
    /// Core modules (proxy-wasm plugins), by the same content hash.
    modules: Mutex<HashMap<String, Module>>,
}

/// What the cache keeps: a component or a core module, both serialized the same way.
#[allow(unsafe_code)]
trait Artifact: Clone + Sized {
    /// # Safety
    /// `path` must hold an artifact this engine's configuration serialized.
    unsafe fn deserialize_file(engine: &Engine, path: &Path) -> wasmtime::Result<Self>;
    fn serialize(&self) -> wasmtime::Result<Vec<u8>>;
}

#[allow(unsafe_code)]
impl Artifact for Component {
    unsafe fn deserialize_file(engine: &Engine, path: &Path) -> wasmtime::Result<Self> {
        // SAFETY: passed on from the caller.
        unsafe { Component::deserialize_file(engine, path) }
    }

    fn serialize(&self) -> wasmtime::Result<Vec<u8>> {
        Component::serialize(self)
    }
}

#[allow(unsafe_code)]
impl Artifact for Module {
    unsafe fn deserialize_file(engine: &Engine, path: &Path) -> wasmtime::Result<Self> {
        // SAFETY: passed on from the caller.
        unsafe { Module::deserialize_file(engine, path) }
    }

    fn serialize(&self) -> wasmtime::Result<Vec<u8>> {
        Module::serialize(self)
    }
}

/// Why a component could not be compiled (the cache itself never fails a load: a bad
/// or unwritable cache falls back to compiling).
#[derive(Debug)]
pub(crate) enum CompileError {
    NotAComponent(String),
    Compile(String),
}

impl ArtifactStore {
    pub(crate) fn new(engine: &Engine, dir: Option<PathBuf>) -> Self {
        let mut hasher = DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        Self {
            dir,
            engine_hash: format!("{:016x}", hasher.finish()),
            memory: Mutex::new(HashMap::new()),
            modules: Mutex::new(HashMap::new()),
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
        self.get_or(&self.memory, hash, engine, || {
            if !wasmparser_is_component(bytes) {
                return Err(CompileError::NotAComponent(describe_non_component(bytes)));
            }
            Component::new(engine, bytes).map_err(|e| CompileError::Compile(format!("{e:#}")))
        })
    }

    /// The compiled core module (a proxy-wasm plugin) for `bytes`.
    pub(crate) fn get_or_compile_module(
        &self,
        engine: &Engine,
        hash: &str,
        bytes: &[u8],
    ) -> Result<Module, CompileError> {
        self.get_or(&self.modules, hash, engine, || {
            Module::new(engine, bytes).map_err(|e| CompileError::Compile(format!("{e:#}")))
        })
    }

    fn get_or<T: Artifact>(
        &self,
        memory: &Mutex<HashMap<String, T>>,
        hash: &str,
        engine: &Engine,
        compile: impl FnOnce() -> Result<T, CompileError>,
    ) -> Result<T, CompileError> {
        let lock = || memory.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(artifact) = lock().get(hash) {
            return Ok(artifact.clone());
        }
        let path = self.artifact_path(hash);
        if let Some(artifact) = path.as_deref().and_then(|p| load_artifact::<T>(engine, p)) {
            lock().insert(hash.to_owned(), artifact.clone());
            return Ok(artifact);
        }
        let artifact = compile()?;
        if let Some(path) = path {
            store_artifact(&artifact, &path);
        }
        lock().insert(hash.to_owned(), artifact.clone());
        Ok(artifact)
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

fn load_artifact<T: Artifact>(engine: &Engine, path: &Path) -> Option<T> {
    if !path.is_file() {
        return None;
    }
    // SAFETY: the artifact was written by `store_artifact` into our own cache directory
    // under a name that binds it to the exact content hash and engine compatibility
    // hash; wasmtime additionally checks the header and refuses artifacts from another
    // engine configuration.
    #[allow(unsafe_code)]
    let loaded = unsafe { T::deserialize_file(engine, path) };
    match loaded {
        Ok(artifact) => Some(artifact),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "discarding unusable cached artifact");
            let _ = std::fs::remove_file(path);
            None
        }
    }
}

fn store_artifact<T: Artifact>(artifact: &T, path: &Path) {
    let result = (|| -> std::io::Result<()> {
        let bytes = artifact
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

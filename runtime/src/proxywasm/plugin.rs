//! Loading a proxy-wasm module: the ABI marker, the exports the host calls, every
//! import checked against what the host provides (so a module built for another host
//! is refused at load with the import named, not at its first call).

use std::sync::Arc;

use wasmtime::{ExternType, InstancePre, Linker, Module};

use super::abi::AbiVersion;
use super::state::{PluginConfig, PwState};
use crate::error::LoadError;

/// WASI preview 1 functions a proxy-wasm module may import (the spec's subset and what
/// Rust's std pulls in); wasmtime-wasi defines them, with no files, sockets or
/// environment behind them.
const WASI: &str = "wasi_snapshot_preview1";

/// A module checked and ready to instantiate on any worker.
pub(crate) struct Plugin {
    pub(crate) pre: InstancePre<PwState>,
    pub(crate) abi: AbiVersion,
    pub(crate) config: Arc<PluginConfig>,
}

/// Whether `bytes` are a core Wasm module (what proxy-wasm plugins are) rather than a
/// component.
pub fn is_core_module(bytes: &[u8]) -> bool {
    bytes.len() >= 8 && bytes[..4] == *b"\0asm" && bytes[4..8] == [1, 0, 0, 0]
}

/// Checks `module` and prepares it with `linker`.
pub(crate) fn prepare(
    filter: &str,
    module: &Module,
    linker: &Linker<PwState>,
    config: PluginConfig,
) -> Result<Plugin, LoadError> {
    let settings = |detail: String| LoadError::Settings {
        filter: filter.to_owned(),
        detail,
    };
    let mut abi = None;
    let mut has_memory = false;
    let mut allocator = false;
    let mut functions = std::collections::HashSet::new();
    for export in module.exports() {
        let name = export.name();
        match export.ty() {
            ExternType::Func(_) => {
                functions.insert(name.to_owned());
                if let Some(version) = AbiVersion::from_export(name) {
                    abi = abi.or(Some(version));
                }
                allocator |= matches!(name, "proxy_on_memory_allocate" | "malloc");
            }
            ExternType::Memory(_) if name == "memory" => has_memory = true,
            _ => {}
        }
    }
    let Some(abi) = abi else {
        let old = functions.contains("proxy_abi_version_0_1_0");
        return Err(settings(if old {
            "a proxy-wasm module of ABI 0.1.0: this proxy serves 0.2.0 and 0.2.1 (rebuild it with proxy-wasm 0.2)".to_owned()
        } else {
            "a core Wasm module that is not a proxy-wasm plugin (no proxy_abi_version_0_2_x export); filters are components of dpumesh:filter or proxy-wasm 0.2 modules".to_owned()
        }));
    };
    if !has_memory {
        return Err(settings(
            "the proxy-wasm module exports no memory".to_owned(),
        ));
    }
    if !allocator {
        return Err(settings(
            "the proxy-wasm module exports no allocator (proxy_on_memory_allocate or malloc)"
                .to_owned(),
        ));
    }
    for required in ["proxy_on_context_create", "proxy_on_request_headers"] {
        if !functions.contains(required) {
            return Err(LoadError::MissingExport {
                filter: filter.to_owned(),
                export: required,
            });
        }
    }
    for import in module.imports() {
        if import.module() != "env" && import.module() != WASI {
            return Err(LoadError::UnknownImport {
                filter: filter.to_owned(),
                import: format!("{}::{}", import.module(), import.name()),
            });
        }
    }
    // An `env` or WASI function the host does not define (or defines with another
    // type) is named by the linker.
    let pre = linker
        .instantiate_pre(module)
        .map_err(|e| LoadError::Instantiate {
            filter: filter.to_owned(),
            detail: format!("{e:#}"),
        })?;
    Ok(Plugin {
        pre,
        abi,
        config: Arc::new(config),
    })
}

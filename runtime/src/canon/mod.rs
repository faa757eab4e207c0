//! Components run as core instances: the canonical ABI of the filter world done by
//! hand, for components whose code is one core module that imports nothing but the
//! world and the WASI functions a standard library uses (what `wit-bindgen` and
//! `cargo build --target wasm32-wasip2` produce).
//!
//! Why: wasmtime's component calls are generic. Entering a filter costs ~0.4–0.5 µs
//! and each host call 0.12–0.25 µs, mostly bookkeeping of the head's borrow handle,
//! lifting through type-generic code and trap catching per layer (docs/benchmarks.md).
//! The same module entered as a core instance costs ~13 ns and a host call a few
//! tens of nanoseconds, and a chain makes five entries and about twenty host calls
//! per request.
//!
//! What stays the same: each filter's store, memory cap, CPU deadline, identity,
//! stderr tail and fault classification, and every host function (the imports here
//! lift and lower, then call the implementations in [`crate::imports`]). The checks
//! the component model makes at the boundary are made here too: bounds, alignment,
//! UTF-8, enum and option discriminants, handles. A component this does not
//! recognise (several modules with code, a nested component, UTF-16 strings, an
//! import not defined here) takes the component path, as does every filter when
//! [`crate::RuntimeConfig::core_calls`] is off (`DPUMESH_CORE_CALLS=off`).

pub(crate) mod abi;
pub(crate) mod calls;
mod wasi;
mod world;

use wasmparser::{CanonicalFunction, CanonicalOption, Parser, Payload};
use wasmtime::{Engine, Linker, Module, ValType};

use crate::imports::StoreState;

pub(crate) use world::HEAD;

/// The linker every core filter is prepared with: the world and WASI.
pub(crate) fn linker(engine: &Engine) -> wasmtime::Result<Linker<StoreState>> {
    let mut linker = Linker::new(engine);
    world::add_to_linker(&mut linker)?;
    wasi::add_to_linker(&mut linker)?;
    Ok(linker)
}

/// A filter's core module, ready to instantiate.
pub(crate) struct CoreFilter {
    pub(crate) pre: wasmtime::InstancePre<StoreState>,
    /// Whether it exports `configure` / `on-response` / `_initialize` /
    /// `on-request-head` (called instead of `on-request`: the line is not lowered).
    pub(crate) configure: bool,
    pub(crate) on_response: bool,
    pub(crate) initialize: bool,
    pub(crate) on_request_head: bool,
}

/// Why a component takes the component path (logged at debug level).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unsupported {
    #[error("core calls are off (RuntimeConfig::core_calls, DPUMESH_CORE_CALLS=off)")]
    Off,
    #[error("{0}")]
    Layout(String),
    #[error("its core module does not compile alone: {0}")]
    Compile(String),
    #[error("its core module imports what the core path does not define: {0}")]
    Imports(String),
    #[error("export {name:?} has core type {found}, not the world's {expected}")]
    ExportType {
        name: &'static str,
        found: String,
        expected: String,
    },
}

/// Prepares `bytes` (a component, content hash `hash`) for core calls.
pub(crate) fn prepare(
    engine: &Engine,
    base: &Linker<StoreState>,
    cache: &crate::artifacts::ArtifactStore,
    hash: &str,
    bytes: &[u8],
    enabled: bool,
) -> Result<CoreFilter, Unsupported> {
    if !enabled {
        return Err(Unsupported::Off);
    }
    let main = main_module(bytes)?;
    let module = cache
        .get_or_compile_module(engine, &format!("{hash}-core"), main)
        .map_err(|e| Unsupported::Compile(format!("{e:?}")))?;
    check_exports(&module)?;
    let mut linker = base.clone();
    link_versions(&mut linker, &module).map_err(|e| Unsupported::Imports(format!("{e:#}")))?;
    let pre = linker
        .instantiate_pre(&module)
        .map_err(|e| Unsupported::Imports(format!("{e:#}")))?;
    let has = |name: &str| module.get_export(name).is_some();
    Ok(CoreFilter {
        configure: has("configure"),
        on_response: has("on-response"),
        initialize: has("_initialize"),
        on_request_head: has("on-request-head"),
        pre,
    })
}

/// Serves a module that imports another patch version of WASI 0.2 or of the filter
/// world 0.1 with the functions defined for ours (as the component linker does by
/// semver); a function whose type differs still fails the instantiation check.
fn link_versions(linker: &mut Linker<StoreState>, module: &Module) -> wasmtime::Result<()> {
    let mut aliased = std::collections::HashSet::new();
    for import in module.imports() {
        let name = import.module();
        let Some((iface, version)) = name.rsplit_once('@') else {
            continue;
        };
        let ours = if iface.starts_with("wasi:") && version.starts_with("0.2.") {
            wasi::VERSION
        } else if iface.starts_with("dpumesh:filter/") && version.starts_with("0.1.") {
            crate::bindings::WIT_VERSION
        } else {
            continue;
        };
        if version != ours && aliased.insert(name.to_owned()) {
            linker.alias_module(&format!("{iface}@{ours}"), name)?;
        }
    }
    Ok(())
}

/// The component's one core module with code: the one exporting `memory`,
/// `cabi_realloc` and `on-request`. Any other module must be the lowering shims
/// `wit-component` adds (no memory, no data): a module with state of its own (a
/// preview 1 adapter, an interpreter's libraries) means the component is more than
/// one module calling our imports.
pub(crate) fn main_module(bytes: &[u8]) -> Result<&[u8], Unsupported> {
    let layout = |s: &str| Unsupported::Layout(s.to_owned());
    let mut modules = Vec::new();
    for payload in Parser::new(0).parse_all(bytes) {
        match payload.map_err(|e| Unsupported::Layout(format!("unparsable: {e}")))? {
            Payload::ModuleSection {
                unchecked_range, ..
            } => modules.push(unchecked_range),
            Payload::ComponentSection { .. } => return Err(layout("it nests a component")),
            Payload::ComponentCanonicalSection(section) => {
                for canon in section {
                    let canon =
                        canon.map_err(|e| Unsupported::Layout(format!("unparsable: {e}")))?;
                    let options = match &canon {
                        CanonicalFunction::Lift { options, .. }
                        | CanonicalFunction::Lower { options, .. } => options,
                        _ => continue,
                    };
                    if options.iter().any(|o| {
                        matches!(o, CanonicalOption::UTF16 | CanonicalOption::CompactUTF16)
                    }) {
                        return Err(layout("its strings are not UTF-8"));
                    }
                }
            }
            _ => {}
        }
    }
    let mut main = None;
    for range in modules {
        let module = &bytes[range.start as usize..range.end as usize];
        let shape = shape(module).map_err(|e| Unsupported::Layout(format!("unparsable: {e}")))?;
        if shape.is_main {
            if main.is_some() {
                return Err(layout("two modules export the filter world"));
            }
            main = Some(module);
        } else if shape.has_state {
            return Err(layout("a second module has memory or data of its own"));
        }
    }
    main.ok_or_else(|| layout("no module exports memory, cabi_realloc and on-request"))
}

struct Shape {
    is_main: bool,
    has_state: bool,
}

fn shape(module: &[u8]) -> Result<Shape, wasmparser::BinaryReaderError> {
    let mut exports = Vec::new();
    let mut has_state = false;
    for payload in Parser::new(0).parse_all(module) {
        match payload? {
            Payload::ExportSection(reader) => {
                for export in reader {
                    exports.push(export?.name.to_owned());
                }
            }
            Payload::MemorySection(r) if r.count() > 0 => has_state = true,
            Payload::DataSection(r) if r.count() > 0 => has_state = true,
            Payload::ImportSection(reader) => {
                for import in reader.into_imports() {
                    if matches!(import?.ty, wasmparser::TypeRef::Memory(_)) {
                        has_state = true;
                    }
                }
            }
            _ => {}
        }
    }
    let exports_ = |n: &str| exports.iter().any(|e| e == n);
    Ok(Shape {
        is_main: exports_("memory") && exports_("cabi_realloc") && exports_("on-request"),
        has_state,
    })
}

/// The world's exports as the canonical ABI flattens them.
fn check_exports(module: &Module) -> Result<(), Unsupported> {
    use ValType::{I32, I64};
    let expected: [(&'static str, &[ValType], &[ValType], bool); 8] = [
        (
            "on-request",
            &[I32, I32, I32, I32, I32, I32, I32, I32, I32],
            &[I32],
            true,
        ),
        ("on-request-head", &[I32], &[I32], false),
        (
            "on-response",
            &[I32, I32, I64, I32, I32, I32, I32],
            &[],
            false,
        ),
        ("configure", &[I32, I32], &[I32], false),
        ("cabi_realloc", &[I32, I32, I32, I32], &[I32], true),
        ("cabi_post_on-request", &[I32], &[], false),
        ("cabi_post_on-request-head", &[I32], &[], false),
        ("cabi_post_configure", &[I32], &[], false),
    ];
    for (name, params, results, required) in expected {
        let Some(export) = module.get_export(name) else {
            if required {
                return Err(Unsupported::Layout(format!("no export {name:?}")));
            }
            continue;
        };
        let found = export.func().map(|f| {
            (
                f.params().map(|t| format!("{t}")).collect::<Vec<_>>(),
                f.results().map(|t| format!("{t}")).collect::<Vec<_>>(),
            )
        });
        let want = (
            params.iter().map(|t| format!("{t}")).collect::<Vec<_>>(),
            results.iter().map(|t| format!("{t}")).collect::<Vec<_>>(),
        );
        if found.as_ref() != Some(&want) {
            return Err(Unsupported::ExportType {
                name,
                found: format!("{found:?}"),
                expected: format!("{want:?}"),
            });
        }
    }
    Ok(())
}

//! The chain driver: a component generated for one chain's shape that calls the
//! chain's filters in order from inside Wasm.
//!
//! Its core module is written here in WAT, not compiled from a language: it only
//! passes the flat canonical-ABI values it was given on to each filter's import, so
//! the request line lowered into it once reaches every filter through the adapters
//! wasmtime compiles between components (a copy into each filter's memory, no host
//! entry). Memory is a bump allocator that `cabi_post_run-request` (and the end of
//! `run-response`) resets: nothing it holds outlives a call.
//!
//! ```wit
//! world driver {
//!   use dpumesh:filter/types@0.1.3.{request-line, request-head, verdict, response-info};
//!   import enter-filter: func(index: u32);
//!   import on-request-K: func(line: request-line, head: borrow<request-head>) -> verdict;
//!   import on-response-K: func(head: borrow<request-head>, info: response-info);
//!   export run-request: func(line: request-line, head: borrow<request-head>, skip: u32)
//!       -> tuple<u32, verdict>;
//!   export run-response: func(head: borrow<request-head>, info: response-info, ran: u32,
//!       skip: u32);
//! }
//! ```
//!
//! `run-request` calls `enter-filter(K)` and then filter K's `on-request`, for every K
//! whose bit in `skip` is clear, and stops at the first `deny`, answering the index
//! of the filter that decided (the chain's length when all continued). `run-response`
//! does the same in reverse for the first `ran` filters that have a response phase.

use std::fmt::Write as _;

use wasmtime::StoreContextMut;
use wit_component::{ComponentEncoder, StringEncoding};
use wit_parser::Resolve;

use crate::imports::StoreState;

/// The host function the driver calls before each filter: how the host knows which
/// filter runs (its limits, its imports' identity, its time and its faults).
pub(crate) const ENTER: &str = "enter-filter";
/// The driver's request-phase export.
pub(crate) const RUN_REQUEST: &str = "run-request";
/// The driver's response-phase export.
pub(crate) const RUN_RESPONSE: &str = "run-response";

/// Most filters one driver calls: the skip mask is a `u32`.
pub(crate) const MAX_FILTERS: usize = 32;

/// The filter contract the driver's types come from.
const FILTER_WIT: &str = include_str!("../../../wit/filter.wit");

/// Where the result of `run-request` is written: `tuple<u32, verdict>`, the verdict
/// at +4 (its alignment is 4).
const RET: u32 = 8;
const VERDICT: u32 = RET + 4;
/// Where the bump allocator starts.
const HEAP: u32 = 64;

/// Why a driver could not be built (a bug here, never the filters' doing).
#[derive(Debug, thiserror::Error)]
#[error("cannot build the chain driver: {0:#}")]
pub(crate) struct DriverError(anyhow::Error);

/// The driver component for a chain of `response.len()` filters, where
/// `response[K]` says whether filter K has a response phase.
pub(crate) fn component(response: &[bool]) -> Result<Vec<u8>, DriverError> {
    assert!(
        !response.is_empty() && response.len() <= MAX_FILTERS,
        "a fused chain has 1..={MAX_FILTERS} filters"
    );
    let mut resolve = Resolve::default();
    resolve
        .push_str("filter.wit", FILTER_WIT)
        .map_err(DriverError)?;
    let package = resolve
        .push_str("driver.wit", &world(response))
        .map_err(DriverError)?;
    let world = resolve
        .select_world(&[package], Some("driver"))
        .map_err(DriverError)?;
    let mut module = wat::parse_str(core_module(response)).map_err(|e| DriverError(e.into()))?;
    wit_component::embed_component_metadata(&mut module, &resolve, world, StringEncoding::UTF8)
        .map_err(DriverError)?;
    ComponentEncoder::default()
        .validate(true)
        .module(&module)
        .and_then(|encoder| encoder.encode())
        .map_err(DriverError)
}

/// The driver's world (see the module docs).
fn world(response: &[bool]) -> String {
    let version = crate::bindings::WIT_VERSION;
    let mut wit = format!(
        "package dpumesh:chain-driver;\n\
         world driver {{\n\
         use dpumesh:filter/types@{version}.{{request-line, request-head, verdict, response-info}};\n\
         import {ENTER}: func(index: u32);\n"
    );
    for (k, has_response) in response.iter().enumerate() {
        let _ = writeln!(
            wit,
            "import on-request-{k}: func(line: request-line, head: borrow<request-head>) -> verdict;"
        );
        if *has_response {
            let _ = writeln!(
                wit,
                "import on-response-{k}: func(head: borrow<request-head>, info: response-info);"
            );
        }
    }
    let _ = write!(
        wit,
        "export {RUN_REQUEST}: func(line: request-line, head: borrow<request-head>, skip: u32) -> tuple<u32, verdict>;\n\
         export {RUN_RESPONSE}: func(head: borrow<request-head>, info: response-info, ran: u32, skip: u32);\n\
         }}\n"
    );
    wit
}

/// The flat parameters of `request-line` then the head: the method's discriminant and
/// `other` string, the scheme, the authority, the path, the head's handle.
const LINE_AND_HEAD: [&str; 9] = [
    "$md", "$mp", "$ml", "$sc", "$ap", "$al", "$pp", "$pl", "$head",
];
/// The flat parameters of the head then `response-info`: status, latency, upstream's
/// option and string, the failure kind.
const HEAD_AND_INFO: [(&str, &str); 7] = [
    ("$head", "i32"),
    ("$status", "i32"),
    ("$latency", "i64"),
    ("$ud", "i32"),
    ("$up", "i32"),
    ("$ul", "i32"),
    ("$failure", "i32"),
];

/// The driver's core module (see the module docs for what it does).
fn core_module(response: &[bool]) -> String {
    let n = response.len();
    let mut wat = String::from("(module\n");
    let version = crate::bindings::WIT_VERSION;
    let _ = writeln!(
        wat,
        "(import \"$root\" \"{ENTER}\" (func $enter (param i32)))\n\
         (import \"dpumesh:filter/types@{version}\" \"[resource-drop]request-head\" (func $drop_head (param i32)))"
    );
    for (k, has_response) in response.iter().enumerate() {
        // 9 flat parameters and the pointer the verdict is written to.
        let _ = writeln!(
            wat,
            "(import \"$root\" \"on-request-{k}\" (func $request_{k} (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32)))"
        );
        if *has_response {
            let _ = writeln!(
                wat,
                "(import \"$root\" \"on-response-{k}\" (func $response_{k} (param i32 i32 i64 i32 i32 i32 i32)))"
            );
        }
    }
    let _ = writeln!(
        wat,
        "(memory (export \"memory\") 1)\n\
         (global $bump (mut i32) (i32.const {HEAP}))"
    );
    // cabi_realloc: a bump allocator. Memories are capped far below 4 GiB (the
    // runtime's largest is 256 MiB), so `memory.size << 16` does not wrap.
    wat.push_str(
        "(func (export \"cabi_realloc\") (param $old i32) (param $old_size i32) (param $align i32) (param $size i32) (result i32)\n\
         (local $ptr i32) (local $end i32) (local $have i32)\n\
         (local.set $ptr (i32.and (i32.add (global.get $bump) (i32.sub (local.get $align) (i32.const 1)))\n\
                                  (i32.sub (i32.const 0) (local.get $align))))\n\
         (local.set $end (i32.add (local.get $ptr) (local.get $size)))\n\
         (if (i32.lt_u (local.get $end) (local.get $ptr)) (then unreachable))\n\
         (local.set $have (i32.shl (memory.size) (i32.const 16)))\n\
         (if (i32.gt_u (local.get $end) (local.get $have))\n\
           (then (if (i32.eq (memory.grow (i32.shr_u (i32.add (i32.sub (local.get $end) (local.get $have)) (i32.const 65535)) (i32.const 16)))\n\
                             (i32.const -1))\n\
                   (then unreachable))))\n\
         (if (local.get $old)\n\
           (then (memory.copy (local.get $ptr) (local.get $old)\n\
                   (select (local.get $old_size) (local.get $size) (i32.lt_u (local.get $old_size) (local.get $size))))))\n\
         (global.set $bump (local.get $end))\n\
         (local.get $ptr))\n",
    );

    // run-request
    let _ = write!(wat, "(func (export \"{RUN_REQUEST}\")");
    for param in LINE_AND_HEAD {
        let _ = write!(wat, " (param {param} i32)");
    }
    wat.push_str(" (param $skip i32) (result i32)\n");
    let args: String = LINE_AND_HEAD
        .iter()
        .map(|p| format!("(local.get {p}) "))
        .collect();
    for k in 0..n {
        let bit = 1u32 << k;
        let _ = writeln!(
            wat,
            "(if (i32.eqz (i32.and (local.get $skip) (i32.const {bit})))\n\
               (then (call $enter (i32.const {k}))\n\
                     (call $request_{k} {args}(i32.const {VERDICT}))\n\
                     (if (i32.load8_u (i32.const {VERDICT}))\n\
                       (then (i32.store (i32.const {RET}) (i32.const {k}))\n\
                             (call $drop_head (local.get $head))\n\
                             (return (i32.const {RET}))))))"
        );
    }
    let _ = writeln!(
        wat,
        "(i32.store (i32.const {RET}) (i32.const {n}))\n\
         (i32.store8 (i32.const {VERDICT}) (i32.const 0))\n\
         (call $drop_head (local.get $head))\n\
         (i32.const {RET}))"
    );
    let _ = writeln!(
        wat,
        "(func (export \"cabi_post_{RUN_REQUEST}\") (param i32) (global.set $bump (i32.const {HEAP})))"
    );

    // run-response: last filter first.
    let _ = write!(wat, "(func (export \"{RUN_RESPONSE}\")");
    for (param, ty) in HEAD_AND_INFO {
        let _ = write!(wat, " (param {param} {ty})");
    }
    wat.push_str(" (param $ran i32) (param $skip i32)\n");
    let args: String = HEAD_AND_INFO
        .iter()
        .map(|(p, _)| format!("(local.get {p}) "))
        .collect();
    for k in (0..n).rev().filter(|&k| response[k]) {
        let bit = 1u32 << k;
        let _ = writeln!(
            wat,
            "(if (i32.and (i32.lt_u (i32.const {k}) (local.get $ran))\n\
                          (i32.eqz (i32.and (local.get $skip) (i32.const {bit}))))\n\
               (then (call $enter (i32.const {k})) (call $response_{k} {args})))"
        );
    }
    let _ = writeln!(
        wat,
        "(call $drop_head (local.get $head))\n\
         (global.set $bump (i32.const {HEAP})))"
    );
    wat.push_str(")\n");
    wat
}

/// The host side of the driver's `enter-filter`: the store acts for filter `index`
/// from now on (its identity, memory cap and CPU deadline), and the time is marked.
pub(crate) fn enter_filter(
    mut store: StoreContextMut<'_, StoreState>,
    (index,): (u32,),
) -> wasmtime::Result<()> {
    let ticks = store.data_mut().enter(index as usize)?;
    store.set_epoch_deadline(ticks);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_compiles_for_every_chain_length() {
        let engine = wasmtime::Engine::default();
        for n in [1, 2, 5, MAX_FILTERS] {
            let response: Vec<bool> = (0..n).map(|k| k % 2 == 0).collect();
            // The encoder validates; compiling checks what wasmtime makes of it.
            let bytes = component(&response).unwrap();
            wasmtime::component::Component::new(&engine, &bytes).unwrap();
        }
    }

    #[test]
    fn the_world_imports_each_filter_and_only_the_response_phases_that_exist() {
        let wit = world(&[true, false]);
        assert!(wit.contains("import on-request-0:"));
        assert!(wit.contains("import on-request-1:"));
        assert!(wit.contains("import on-response-0:"));
        assert!(!wit.contains("import on-response-1:"));
    }
}

//! The WASI 0.2 functions a filter's standard library imports, as core functions,
//! with what the component path gives a filter: no environment, no terminal, stdin
//! empty, stdout discarded, stderr kept as the tail quoted in fault reports, the
//! node's clocks, and the store's random sources.
//!
//! Streams and pollables are fixed handles (stdio has no state of its own here); a
//! handle the guest was not given traps, as an unknown handle does in the component
//! model. A clock subscription is the one ready pollable, as on the component path
//! (`crate::imports::clocks`): a filter's sleep returns at once and never holds the
//! thread. Anything else WASI offers (files, sockets) is not defined, so a component
//! that imports it takes the component path.

use wasmtime::{Linker, Result, format_err};
use wasmtime_wasi::p2::bindings::random::{insecure, insecure_seed, random};

use super::abi::{Cx, Record, alloc, byte_list, put, ret_area};
use crate::imports::StoreState;

/// The version the functions are defined under; components that import another
/// 0.2.x are served the same functions (see [`super::link_versions`]).
pub(crate) const VERSION: &str = "0.2.0";

const STDIN: i32 = 1;
const STDOUT: i32 = 2;
const STDERR: i32 = 3;
/// The one pollable: stdio streams are always ready.
const READY: i32 = 4;

fn output(handle: i32) -> Result<i32> {
    match handle {
        STDOUT | STDERR => Ok(handle),
        _ => Err(format_err!("unknown output-stream handle {handle}")),
    }
}

fn known(handle: i32, valid: &[i32], kind: &str) -> Result<()> {
    if valid.contains(&handle) {
        Ok(())
    } else {
        Err(format_err!("unknown {kind} handle {handle}"))
    }
}

/// `result<_, stream-error>` succeeded: 12 bytes, align 4.
fn stream_ok(cx: &mut Cx<'_>, ret: i32) -> Result<()> {
    ret_area(cx, ret, 12, 4)?;
    put(cx, ret, Record::new(12).bytes())
}

fn module(iface: &str) -> String {
    format!("wasi:{iface}@{VERSION}")
}

pub(crate) fn add_to_linker(linker: &mut Linker<StoreState>) -> Result<()> {
    let streams = module("io/streams");
    let poll = module("io/poll");
    linker.func_wrap(
        &module("io/error"),
        "[resource-drop]error",
        |_: Cx<'_>, h: i32| Err::<(), _>(format_err!("unknown error handle {h}")),
    )?;
    linker.func_wrap(&poll, "[resource-drop]pollable", |_: Cx<'_>, h: i32| {
        known(h, &[READY], "pollable")
    })?;
    linker.func_wrap(&poll, "[method]pollable.block", |_: Cx<'_>, h: i32| {
        known(h, &[READY], "pollable")
    })?;
    linker.func_wrap(&poll, "[method]pollable.ready", |_: Cx<'_>, h: i32| {
        known(h, &[READY], "pollable").map(|()| 1i32)
    })?;
    linker.func_wrap(
        &streams,
        "[resource-drop]input-stream",
        |_: Cx<'_>, h: i32| known(h, &[STDIN], "input-stream"),
    )?;
    linker.func_wrap(
        &streams,
        "[resource-drop]output-stream",
        |_: Cx<'_>, h: i32| output(h).map(drop),
    )?;
    linker.func_wrap(
        &streams,
        "[method]output-stream.check-write",
        |mut cx: Cx<'_>, h: i32, ret: i32| {
            output(h)?;
            // result<u64, stream-error>: 16 bytes, the count at 8. A sink takes
            // anything; 4 KiB is what wasmtime's stdio streams advertise.
            ret_area(&cx, ret, 16, 8)?;
            put(&mut cx, ret, Record::new(16).u64(8, 4096).bytes())
        },
    )?;
    let write = |mut cx: Cx<'_>, h: i32, p: i32, l: i32, ret: i32| -> Result<()> {
        if output(h)? == STDERR {
            let bytes = byte_list(&cx, p, l)?;
            cx.data().stderr.push(&bytes);
        } else {
            byte_list(&cx, p, l)?;
        }
        stream_ok(&mut cx, ret)
    };
    linker.func_wrap(&streams, "[method]output-stream.write", write)?;
    linker.func_wrap(
        &streams,
        "[method]output-stream.blocking-write-and-flush",
        write,
    )?;
    let flush = |mut cx: Cx<'_>, h: i32, ret: i32| -> Result<()> {
        output(h)?;
        stream_ok(&mut cx, ret)
    };
    linker.func_wrap(&streams, "[method]output-stream.flush", flush)?;
    linker.func_wrap(&streams, "[method]output-stream.blocking-flush", flush)?;
    linker.func_wrap(
        &streams,
        "[method]output-stream.subscribe",
        |_: Cx<'_>, h: i32| output(h).map(|_| READY),
    )?;
    linker.func_wrap(&module("cli/stdin"), "get-stdin", |_: Cx<'_>| Ok(STDIN))?;
    linker.func_wrap(&module("cli/stdout"), "get-stdout", |_: Cx<'_>| Ok(STDOUT))?;
    linker.func_wrap(&module("cli/stderr"), "get-stderr", |_: Cx<'_>| Ok(STDERR))?;
    for (iface, name) in [
        ("cli/terminal-stdin", "get-terminal-stdin"),
        ("cli/terminal-stdout", "get-terminal-stdout"),
        ("cli/terminal-stderr", "get-terminal-stderr"),
    ] {
        // option<own<terminal-…>>: none (no filter runs on a terminal).
        linker.func_wrap(&module(iface), name, |mut cx: Cx<'_>, ret: i32| {
            ret_area(&cx, ret, 8, 4)?;
            put(&mut cx, ret, Record::new(8).bytes())
        })?;
    }
    for (iface, resource) in [
        ("cli/terminal-input", "terminal-input"),
        ("cli/terminal-output", "terminal-output"),
    ] {
        linker.func_wrap(
            &module(iface),
            &format!("[resource-drop]{resource}"),
            |_: Cx<'_>, h: i32| Err::<(), _>(format_err!("unknown terminal handle {h}")),
        )?;
    }
    let empty_list = |mut cx: Cx<'_>, ret: i32| -> Result<()> {
        ret_area(&cx, ret, 8, 4)?;
        // An empty list still points into the guest's memory, as the canonical ABI
        // allocates it.
        let p = alloc(&mut cx, 4, 0)?;
        put(&mut cx, ret, Record::new(8).i32(0, p).bytes())
    };
    let environment = module("cli/environment");
    linker.func_wrap(&environment, "get-environment", empty_list)?;
    linker.func_wrap(&environment, "get-arguments", empty_list)?;
    linker.func_wrap(&environment, "initial-cwd", |mut cx: Cx<'_>, ret: i32| {
        ret_area(&cx, ret, 12, 4)?;
        put(&mut cx, ret, Record::new(12).bytes())
    })?;
    linker.func_wrap(&module("cli/exit"), "exit", |_: Cx<'_>, status: i32| {
        let code = match status {
            0 => 0,
            1 => 1,
            v => return Err(format_err!("invalid result discriminant {v}")),
        };
        Err::<(), _>(wasmtime_wasi::I32Exit(code).into())
    })?;
    add_clocks_and_random(linker)
}

fn add_clocks_and_random(linker: &mut Linker<StoreState>) -> Result<()> {
    let monotonic = module("clocks/monotonic-clock");
    linker.func_wrap(&monotonic, "now", |cx: Cx<'_>| {
        Ok(cx.data().clock().monotonic_ns() as i64)
    })?;
    linker.func_wrap(&monotonic, "resolution", |_: Cx<'_>| Ok(1i64))?;
    // Ready at once: no filter sleeps on a thread that serves other requests.
    linker.func_wrap(&monotonic, "subscribe-duration", |_: Cx<'_>, _: i64| {
        Ok(READY)
    })?;
    linker.func_wrap(&monotonic, "subscribe-instant", |_: Cx<'_>, _: i64| {
        Ok(READY)
    })?;
    let wall = module("clocks/wall-clock");
    linker.func_wrap(&wall, "now", |mut cx: Cx<'_>, ret: i32| {
        ret_area(&cx, ret, 16, 8)?;
        let now = std::time::Duration::from_nanos(cx.data().clock().wall_ns());
        let record = Record::new(16)
            .u64(0, now.as_secs())
            .i32(8, now.subsec_nanos() as i32);
        put(&mut cx, ret, record.bytes())
    })?;
    linker.func_wrap(&wall, "resolution", |mut cx: Cx<'_>, ret: i32| {
        ret_area(&cx, ret, 16, 8)?;
        put(&mut cx, ret, Record::new(16).i32(8, 1).bytes())
    })?;
    let bytes_to_guest = |cx: &mut Cx<'_>, ret: i32, bytes: Vec<u8>| -> Result<()> {
        ret_area(cx, ret, 8, 4)?;
        let p = alloc(cx, 1, bytes.len())?;
        put(cx, p, &bytes)?;
        put(
            cx,
            ret,
            Record::new(8).i32(0, p).i32(4, bytes.len() as i32).bytes(),
        )
    };
    let random_module = module("random/random");
    linker.func_wrap(
        &random_module,
        "get-random-bytes",
        move |mut cx: Cx<'_>, len: i64, ret: i32| {
            let bytes = random::Host::get_random_bytes(cx.data_mut().random(), len as u64)?;
            bytes_to_guest(&mut cx, ret, bytes)
        },
    )?;
    linker.func_wrap(&random_module, "get-random-u64", |mut cx: Cx<'_>| {
        Ok(random::Host::get_random_u64(cx.data_mut().random())? as i64)
    })?;
    let insecure_module = module("random/insecure");
    linker.func_wrap(
        &insecure_module,
        "get-insecure-random-bytes",
        move |mut cx: Cx<'_>, len: i64, ret: i32| {
            let bytes =
                insecure::Host::get_insecure_random_bytes(cx.data_mut().random(), len as u64)?;
            bytes_to_guest(&mut cx, ret, bytes)
        },
    )?;
    linker.func_wrap(
        &insecure_module,
        "get-insecure-random-u64",
        |mut cx: Cx<'_>| {
            Ok(insecure::Host::get_insecure_random_u64(cx.data_mut().random())? as i64)
        },
    )?;
    linker.func_wrap(
        &module("random/insecure-seed"),
        "insecure-seed",
        |mut cx: Cx<'_>, ret: i32| {
            ret_area(&cx, ret, 16, 8)?;
            let (a, b) = insecure_seed::Host::insecure_seed(cx.data_mut().random())?;
            put(&mut cx, ret, Record::new(16).u64(0, a).u64(8, b).bytes())
        },
    )?;
    Ok(())
}

//! Callouts: `proxy_http_call` (and its older name `proxy_dispatch_http_call`) records
//! the call for the chain's owner to perform and hands the plugin a token; the answer
//! comes back through `proxy_on_http_call_response` on the same instance
//! ([`super::instance::PwInstance::on_callout`]). gRPC calls are refused with
//! `Unimplemented`.

use std::time::Duration;

use wasmtime::{Caller, Linker};

use super::abi::{self, Status};
use super::state::{self, PwState};
use crate::callout::{Callout, MAX_CALLOUT_BYTES};

type Ret = wasmtime::Result<i32>;

/// Most calls one instance may have under way (a plugin calling in a loop gets
/// `InternalFailure` past it rather than growing the proxy's memory).
const MAX_PENDING: usize = 1024;
/// Longest wait a call may ask for.
const MAX_TIMEOUT: Duration = Duration::from_secs(300);

/// The checked parts of a call, before it gets a token.
fn checked(
    caller: &mut Caller<'_, PwState>,
    upstream: (i32, i32),
    headers: (i32, i32),
    body: (i32, i32),
    timeout_ms: i32,
) -> wasmtime::Result<Result<Callout, Status>> {
    let upstream = state::read_str(caller, upstream.0, upstream.1, "the call's upstream name")?;
    let headers = abi::parse_pairs(&state::read(caller, headers.0, headers.1)?)
        .map_err(|e| wasmtime::format_err!("the call's headers: {e}"))?;
    let body = state::read(caller, body.0, body.1)?;
    let size = body.len()
        + headers
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>();
    if size > MAX_CALLOUT_BYTES {
        tracing::warn!(target: "dpumesh::filter", upstream, size, "proxy_http_call refused: the request is larger than {MAX_CALLOUT_BYTES} bytes");
        return Ok(Err(Status::BadArgument));
    }
    if !caller.data().services.callouts.allows(&upstream) {
        tracing::warn!(target: "dpumesh::filter", upstream, "proxy_http_call refused: no mesh service or configured upstream has this name");
        return Ok(Err(Status::BadArgument));
    }
    let call = Callout {
        token: 0,
        upstream,
        headers,
        body,
        timeout: Duration::from_millis(u64::from(timeout_ms.max(1) as u32)).min(MAX_TIMEOUT),
    };
    // Envoy refuses a call without these (it could not route it).
    for required in [":method", ":path", ":authority"] {
        if call.header(required).is_none_or(str::is_empty) {
            tracing::warn!(target: "dpumesh::filter", upstream = call.upstream, "proxy_http_call refused: no {required} header");
            return Ok(Err(Status::BadArgument));
        }
    }
    Ok(Ok(call))
}

#[allow(clippy::too_many_arguments)]
fn http_call(
    mut caller: Caller<'_, PwState>,
    up: i32,
    up_len: i32,
    hp: i32,
    hl: i32,
    bp: i32,
    bl: i32,
    _tp: i32,
    _tl: i32,
    timeout_ms: i32,
    ret_token: i32,
) -> Ret {
    let mut call = match checked(&mut caller, (up, up_len), (hp, hl), (bp, bl), timeout_ms)? {
        Ok(call) => call,
        Err(status) => return Ok(status.code()),
    };
    let data = caller.data_mut();
    if data.contexts.pending.len() >= MAX_PENDING {
        tracing::warn!(target: "dpumesh::filter", "proxy_http_call refused: {MAX_PENDING} calls are under way in this instance");
        return Ok(Status::InternalFailure.code());
    }
    // Tokens start at 1 and skip those under way (after wrapping).
    let mut token = data.contexts.last_token;
    loop {
        token = token.wrapping_add(1).max(1);
        if !data.contexts.pending.contains_key(&token) {
            break;
        }
    }
    data.contexts.last_token = token;
    data.contexts.pending.insert(token, data.contexts.effective);
    call.token = token;
    data.call.callouts.push(call);
    state::write_u32(&mut caller, ret_token, token)?;
    Ok(Status::Ok.code())
}

/// Defines the callout functions on `linker`.
pub(crate) fn define(linker: &mut Linker<PwState>) -> wasmtime::Result<()> {
    // 0.2.1 calls it `proxy_http_call`; 0.2.0-era hosts also offered the older name.
    for name in ["proxy_http_call", "proxy_dispatch_http_call"] {
        linker.func_wrap("env", name, http_call)?;
    }
    linker.func_wrap(
        "env",
        "proxy_grpc_call",
        |_c: Caller<'_, PwState>,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32|
         -> Ret {
            tracing::warn!(target: "dpumesh::filter", "proxy_grpc_call: gRPC calls are not implemented by this proxy (Unimplemented)");
            Ok(Status::Unimplemented.code())
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_grpc_stream",
        |_c: Caller<'_, PwState>,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32|
         -> Ret {
            tracing::warn!(target: "dpumesh::filter", "proxy_grpc_stream: gRPC calls are not implemented by this proxy (Unimplemented)");
            Ok(Status::Unimplemented.code())
        },
    )?;
    for name in ["proxy_grpc_cancel", "proxy_grpc_close"] {
        linker.func_wrap("env", name, |_c: Caller<'_, PwState>, _token: i32| -> Ret {
            Ok(Status::NotFound.code())
        })?;
    }
    linker.func_wrap(
        "env",
        "proxy_grpc_send",
        |_c: Caller<'_, PwState>, _: i32, _: i32, _: i32, _: i32| -> Ret {
            Ok(Status::NotFound.code())
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_status",
        |mut caller: Caller<'_, PwState>, ret_code: i32, ret_ptr: i32, ret_len: i32| -> Ret {
            state::write_u32(&mut caller, ret_code, 0)?;
            state::give(&mut caller, &[], ret_ptr, ret_len)?;
            Ok(Status::Ok.code())
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_call_foreign_function",
        |_c: Caller<'_, PwState>, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32| -> Ret {
            Ok(Status::NotFound.code())
        },
    )?;
    Ok(())
}

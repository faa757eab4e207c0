//! The filter world's imports (`dpumesh:filter@0.1.3`) as core functions: each lifts
//! its arguments from the guest's memory, calls the same host implementation the
//! component path calls (`crate::imports`), and lowers the answer into a return area
//! the guest passed. Layouts follow the canonical ABI's flattening: at most one flat
//! result, else a trailing return-area pointer.

use wasmtime::component::Resource;
use wasmtime::{Linker, Result, format_err};

use super::abi::{
    Cx, Record, byte_list, lower_str, put, ret_area, ret_option_string, ret_string, ret_strings,
    string, string_pairs, with_str, with_str_list, with_str_pairs, with_strs,
};
use crate::bindings::dpumesh::filter::{clock, crypto, log, metrics, shared_state, types};
use crate::imports::{HeadHandle, StoreState, header_error};

const TYPES: &str = "dpumesh:filter/types@0.1.3";
const LOG: &str = "dpumesh:filter/log@0.1.3";
const CLOCK: &str = "dpumesh:filter/clock@0.1.3";
const METRICS: &str = "dpumesh:filter/metrics@0.1.3";
const STATE: &str = "dpumesh:filter/shared-state@0.1.3";
const CRYPTO: &str = "dpumesh:filter/crypto@0.1.3";

/// The handle a call lends the head under (the component model numbers handles
/// from 1): any other value is a handle the guest was never given.
pub(crate) const HEAD: i32 = 1;

/// The head lent to the call; `handle` must be the one the call gave, not yet
/// dropped.
fn lent(state: &mut StoreState, handle: i32) -> Result<&mut dpumesh_head::RequestHead> {
    check(state, handle)?;
    state
        .head
        .as_deref_mut()
        .ok_or_else(|| format_err!("request-head used outside of a call that lent it (a host bug)"))
}

/// Whether `handle` is the head's borrow, lent and not dropped: a guest's handle
/// table holds it from the call's start until the guest drops it.
fn check(state: &StoreState, handle: i32) -> Result<()> {
    let lent = state.core.as_ref().is_some_and(|g| g.lent);
    if handle == HEAD && lent {
        Ok(())
    } else {
        Err(format_err!("unknown handle index {handle}"))
    }
}

/// The host state, after checking `handle` (see [`check`]).
fn checked<'a>(cx: &'a mut Cx<'_>, handle: i32) -> Result<&'a mut StoreState> {
    check(cx.data(), handle)?;
    Ok(cx.data_mut())
}

/// The stand-in resource the host implementations take (they work on the lent head).
fn borrow() -> Resource<HeadHandle> {
    Resource::new_borrow(0)
}

fn host<'a>(cx: &'a mut Cx<'_>) -> &'a mut StoreState {
    cx.data_mut()
}

pub(crate) fn add_to_linker(linker: &mut Linker<StoreState>) -> Result<()> {
    add_head(linker)?;
    add_services(linker)?;
    add_state(linker)?;
    add_crypto(linker)
}

/// The `method` variant's case.
pub(super) fn method_case(method: &types::Method) -> u8 {
    use types::Method as M;
    match method {
        M::Get => 0,
        M::Head => 1,
        M::Post => 2,
        M::Put => 3,
        M::Delete => 4,
        M::Connect => 5,
        M::Options => 6,
        M::Trace => 7,
        M::Patch => 8,
        M::Other(_) => 9,
    }
}

fn method_record(cx: &mut Cx<'_>, ret: i32, method: types::Method) -> Result<()> {
    use types::Method as M;
    let case = method_case(&method);
    let mut record = Record::new(12).u8(0, case);
    if let M::Other(text) = &method {
        let (p, l) = lower_str(cx, text)?;
        record = record.i32(4, p).i32(8, l);
    }
    put(cx, ret, record.bytes())
}

fn header_result(cx: &mut Cx<'_>, ret: i32, r: Result<(), types::HeaderError>) -> Result<()> {
    ret_area(cx, ret, 2, 1)?;
    let record = match r {
        Ok(()) => Record::new(2),
        Err(e) => Record::new(2).u8(0, 1).u8(1, e as u8),
    };
    put(cx, ret, record.bytes())
}

fn claim_record(cx: &mut Cx<'_>, claim: Option<types::Claim>) -> Result<Record> {
    let Some(claim) = claim else {
        return Ok(Record::new(16));
    };
    let (case, (p, l)) = match &claim {
        types::Claim::Text(s) => (0, lower_str(cx, s)?),
        types::Claim::TextList(items) => (1, super::abi::lower_strings(cx, items)?),
        types::Claim::Json(s) => (2, lower_str(cx, s)?),
    };
    Ok(Record::new(16).u8(0, 1).u8(4, case).i32(8, p).i32(12, l))
}

fn add_head(linker: &mut Linker<StoreState>) -> Result<()> {
    use types::HostRequestHead as H;
    linker.func_wrap(
        TYPES,
        "[resource-drop]request-head",
        |mut cx: Cx<'_>, h: i32| {
            check(cx.data(), h)?;
            if let Some(guest) = cx.data_mut().core.as_mut() {
                guest.lent = false;
            }
            Ok(())
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.method",
        |mut cx: Cx<'_>, h: i32, ret: i32| {
            ret_area(&cx, ret, 12, 4)?;
            let method = H::method(checked(&mut cx, h)?, borrow())?;
            method_record(&mut cx, ret, method)
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.scheme",
        |mut cx: Cx<'_>, h: i32| Ok(H::scheme(checked(&mut cx, h)?, borrow())? as i32),
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.authority",
        |mut cx: Cx<'_>, h: i32, ret: i32| {
            let v = H::authority(checked(&mut cx, h)?, borrow())?;
            ret_string(&mut cx, ret, &v)
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.path",
        |mut cx: Cx<'_>, h: i32, ret: i32| {
            let v = H::path(checked(&mut cx, h)?, borrow())?;
            ret_string(&mut cx, ret, &v)
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.query",
        |mut cx: Cx<'_>, h: i32, ret: i32| {
            let v = H::query(checked(&mut cx, h)?, borrow())?;
            ret_option_string(&mut cx, ret, v.as_deref())
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.header",
        |mut cx: Cx<'_>, h: i32, p: i32, l: i32, ret: i32| {
            let v = with_str(
                &mut cx,
                p,
                l,
                |state, name| Ok(lent(state, h)?.header(name)),
            )?;
            ret_option_string(&mut cx, ret, v.as_deref())
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.header-all",
        |mut cx: Cx<'_>, h: i32, p: i32, l: i32, ret: i32| {
            let name = string(&cx, p, l)?;
            let v = H::header_all(checked(&mut cx, h)?, borrow(), name)?;
            ret_strings(&mut cx, ret, &v)
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.headers",
        |mut cx: Cx<'_>, h: i32, p: i32, l: i32, ret: i32| {
            ret_area(&cx, ret, 8, 4)?;
            let values = with_str_list(&mut cx, p, l, |state, names| {
                check(state, h)?;
                state.headers_named(names)
            })?;
            let table = super::abi::alloc(&mut cx, 4, values.len() * 12)?;
            let mut bytes = Vec::with_capacity(values.len() * 12);
            for value in &values {
                let record = match value {
                    None => Record::new(12),
                    Some(s) => {
                        let (p, l) = lower_str(&mut cx, s)?;
                        Record::new(12).u8(0, 1).i32(4, p).i32(8, l)
                    }
                };
                bytes.extend_from_slice(record.bytes());
            }
            put(&mut cx, table, &bytes)?;
            let list = Record::new(8).i32(0, table).i32(4, values.len() as i32);
            put(&mut cx, ret, list.bytes())
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.header-names",
        |mut cx: Cx<'_>, h: i32, ret: i32| {
            let v = H::header_names(checked(&mut cx, h)?, borrow())?;
            ret_strings(&mut cx, ret, &v)
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.source",
        |mut cx: Cx<'_>, h: i32, ret: i32| {
            ret_area(&cx, ret, 24, 4)?;
            let peer = H::source(checked(&mut cx, h)?, borrow())?;
            let (ap, al) = lower_str(&mut cx, &peer.address)?;
            let mut record = Record::new(24).i32(0, ap).i32(4, al).u16(8, peer.port);
            if let Some(identity) = &peer.identity {
                let (p, l) = lower_str(&mut cx, identity)?;
                record = record.u8(12, 1).i32(16, p).i32(20, l);
            }
            put(&mut cx, ret, record.bytes())
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.destination",
        |mut cx: Cx<'_>, h: i32, ret: i32| {
            let v = H::destination(checked(&mut cx, h)?, borrow())?;
            ret_option_string(&mut cx, ret, v.as_deref())
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.set-header",
        |mut cx: Cx<'_>, h: i32, np: i32, nl: i32, vp: i32, vl: i32, ret: i32| {
            let r = with_strs(&mut cx, (np, nl), (vp, vl), |state, name, value| {
                Ok(lent(state, h)?.set_header(name, value))
            })?;
            header_result(&mut cx, ret, r.map_err(header_error))
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.append-header",
        |mut cx: Cx<'_>, h: i32, np: i32, nl: i32, vp: i32, vl: i32, ret: i32| {
            let r = with_strs(&mut cx, (np, nl), (vp, vl), |state, name, value| {
                Ok(lent(state, h)?.append_header(name, value))
            })?;
            header_result(&mut cx, ret, r.map_err(header_error))
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.remove-header",
        |mut cx: Cx<'_>, h: i32, p: i32, l: i32, ret: i32| {
            let r = with_str(&mut cx, p, l, |state, name| {
                Ok(lent(state, h)?.remove_header(name))
            })?;
            header_result(&mut cx, ret, r.map_err(header_error))
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.metadata",
        |mut cx: Cx<'_>, h: i32, p: i32, l: i32, ret: i32| {
            let v = with_str(&mut cx, p, l, |state, key| {
                Ok(lent(state, h)?.metadata(key).map(str::to_owned))
            })?;
            ret_option_string(&mut cx, ret, v.as_deref())
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.set-metadata",
        |mut cx: Cx<'_>, h: i32, kp: i32, kl: i32, vp: i32, vl: i32| {
            let (key, value) = (string(&cx, kp, kl)?, string(&cx, vp, vl)?);
            H::set_metadata(checked(&mut cx, h)?, borrow(), key, value)
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.set-metadata-batch",
        |mut cx: Cx<'_>, h: i32, p: i32, l: i32| {
            with_str_pairs(&mut cx, p, l, |state, entries| {
                check(state, h)?;
                state.set_metadata_entries(entries.iter().copied())
            })
        },
    )?;
    linker.func_wrap(
        TYPES,
        "[method]request-head.claims",
        |mut cx: Cx<'_>, h: i32, p: i32, l: i32, ret: i32| {
            ret_area(&cx, ret, 12, 4)?;
            let claims = with_str_list(&mut cx, p, l, |state, names| {
                check(state, h)?;
                state.claims_named(names)
            })?;
            let Some(claims) = claims else {
                return put(&mut cx, ret, Record::new(12).bytes());
            };
            let table = super::abi::alloc(&mut cx, 4, claims.len() * 16)?;
            let mut bytes = Vec::with_capacity(claims.len() * 16);
            let n = claims.len() as i32;
            for claim in claims {
                bytes.extend_from_slice(claim_record(&mut cx, claim)?.bytes());
            }
            put(&mut cx, table, &bytes)?;
            put(
                &mut cx,
                ret,
                Record::new(12).u8(0, 1).i32(4, table).i32(8, n).bytes(),
            )
        },
    )?;
    Ok(())
}

fn level(v: i32) -> Result<log::Level> {
    use log::Level as L;
    Ok(match v {
        0 => L::Trace,
        1 => L::Debug,
        2 => L::Info,
        3 => L::Warn,
        4 => L::Error,
        _ => return Err(format_err!("invalid enum discriminant {v} for log level")),
    })
}

/// A `result<u32, metric-error>` in a return area (8 bytes, align 4).
fn metric_result(cx: &mut Cx<'_>, ret: i32, r: Result<u32, metrics::MetricError>) -> Result<()> {
    ret_area(cx, ret, 8, 4)?;
    let record = match r {
        Ok(id) => Record::new(8).i32(4, id as i32),
        Err(e) => Record::new(8).u8(0, 1).u8(4, e as u8),
    };
    put(cx, ret, record.bytes())
}

fn add_services(linker: &mut Linker<StoreState>) -> Result<()> {
    use clock::Host as C;
    use log::Host as L;
    use metrics::Host as M;
    linker.func_wrap(LOG, "enabled", |mut cx: Cx<'_>, v: i32| {
        Ok(L::enabled(host(&mut cx), level(v)?)? as i32)
    })?;
    linker.func_wrap(LOG, "log", |mut cx: Cx<'_>, v: i32, p: i32, l: i32| {
        let message = string(&cx, p, l)?;
        L::log(host(&mut cx), level(v)?, message)
    })?;
    linker.func_wrap(CLOCK, "wall-ns", |mut cx: Cx<'_>| {
        Ok(C::wall_ns(host(&mut cx))? as i64)
    })?;
    linker.func_wrap(CLOCK, "monotonic-ns", |mut cx: Cx<'_>| {
        Ok(C::monotonic_ns(host(&mut cx))? as i64)
    })?;
    type Define = fn(
        &mut StoreState,
        String,
        Vec<(String, String)>,
    ) -> Result<Result<u32, metrics::MetricError>>;
    let defines: [(&str, Define); 3] = [
        ("counter", M::counter),
        ("gauge", M::gauge),
        ("histogram", M::histogram),
    ];
    for (name, define) in defines {
        linker.func_wrap(
            METRICS,
            name,
            move |mut cx: Cx<'_>, np: i32, nl: i32, lp: i32, ll: i32, ret: i32| {
                let (name, labels) = (string(&cx, np, nl)?, string_pairs(&cx, lp, ll)?);
                let r = define(host(&mut cx), name, labels)?;
                metric_result(&mut cx, ret, r)
            },
        )?;
    }
    linker.func_wrap(METRICS, "increment", |mut cx: Cx<'_>, id: i32, d: i64| {
        M::increment(host(&mut cx), id as u32, d as u64)
    })?;
    linker.func_wrap(
        METRICS,
        "increment-batch",
        |mut cx: Cx<'_>, p: i32, l: i32| {
            let raw = byte_list(
                &cx,
                p,
                l.checked_mul(16)
                    .ok_or_else(|| format_err!("list too long"))?,
            )?;
            super::abi::aligned(p, 8)?;
            let deltas = raw
                .chunks_exact(16)
                .map(|e| {
                    let id = u32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                    let mut d = [0; 8];
                    d.copy_from_slice(&e[8..16]);
                    (id, u64::from_le_bytes(d))
                })
                .collect();
            M::increment_batch(host(&mut cx), deltas)
        },
    )?;
    linker.func_wrap(METRICS, "gauge-set", |mut cx: Cx<'_>, id: i32, v: f64| {
        M::gauge_set(host(&mut cx), id as u32, v)
    })?;
    linker.func_wrap(METRICS, "gauge-add", |mut cx: Cx<'_>, id: i32, v: f64| {
        M::gauge_add(host(&mut cx), id as u32, v)
    })?;
    linker.func_wrap(METRICS, "observe", |mut cx: Cx<'_>, id: i32, v: f64| {
        M::observe(host(&mut cx), id as u32, v)
    })?;
    Ok(())
}

/// A `result<T, state-error>` whose `T` is eight-byte aligned: the case at 0, the
/// payload (or the error's case) at 8.
fn state_record(size: usize, r: &Result<(), shared_state::StateError>) -> Record {
    match r {
        Ok(()) => Record::new(size),
        Err(e) => Record::new(size).u8(0, 1).u8(8, *e as u8),
    }
}

fn add_state(linker: &mut Linker<StoreState>) -> Result<()> {
    use shared_state::Host as S;
    linker.func_wrap(
        STATE,
        "increment",
        |mut cx: Cx<'_>, kp: i32, kl: i32, delta: i64, ttl: i64, ret: i32| {
            let key = string(&cx, kp, kl)?;
            ret_area(&cx, ret, 16, 8)?;
            let record = match S::increment(host(&mut cx), key, delta, ttl as u64)? {
                Ok(v) => Record::new(16).u64(8, v as u64),
                Err(e) => state_record(16, &Err(e)),
            };
            put(&mut cx, ret, record.bytes())
        },
    )?;
    linker.func_wrap(
        STATE,
        "get",
        |mut cx: Cx<'_>, kp: i32, kl: i32, ret: i32| {
            let key = string(&cx, kp, kl)?;
            ret_area(&cx, ret, 24, 8)?;
            let record = match S::get(host(&mut cx), key)? {
                Ok(None) => Record::new(24),
                Ok(Some(v)) => Record::new(24).u8(8, 1).u64(16, v as u64),
                Err(e) => state_record(24, &Err(e)),
            };
            put(&mut cx, ret, record.bytes())
        },
    )?;
    linker.func_wrap(
        STATE,
        "compare-and-swap",
        |mut cx: Cx<'_>,
         kp: i32,
         kl: i32,
         has_expected: i32,
         expected: i64,
         desired: i64,
         ttl: i64,
         ret: i32| {
            let key = string(&cx, kp, kl)?;
            ret_area(&cx, ret, 32, 8)?;
            let expected = match has_expected {
                0 => None,
                1 => Some(expected),
                v => return Err(format_err!("invalid option discriminant {v}")),
            };
            let record =
                match S::compare_and_swap(host(&mut cx), key, expected, desired, ttl as u64)? {
                    Ok(Ok(())) => Record::new(32),
                    Ok(Err(None)) => Record::new(32).u8(8, 1),
                    Ok(Err(Some(current))) => {
                        Record::new(32).u8(8, 1).u8(16, 1).u64(24, current as u64)
                    }
                    Err(e) => state_record(32, &Err(e)),
                };
            put(&mut cx, ret, record.bytes())
        },
    )?;
    linker.func_wrap(
        STATE,
        "delete",
        |mut cx: Cx<'_>, kp: i32, kl: i32, ret: i32| {
            let key = string(&cx, kp, kl)?;
            ret_area(&cx, ret, 2, 1)?;
            let record = match S::delete(host(&mut cx), key)? {
                Ok(existed) => Record::new(2).u8(1, existed as u8),
                Err(e) => Record::new(2).u8(0, 1).u8(1, e as u8),
            };
            put(&mut cx, ret, record.bytes())
        },
    )?;
    linker.func_wrap(
        STATE,
        "token-bucket-take",
        |mut cx: Cx<'_>,
         kp: i32,
         kl: i32,
         capacity: i64,
         refill: i64,
         interval: i64,
         cost: i64,
         ret: i32| {
            let key = string(&cx, kp, kl)?;
            ret_area(&cx, ret, 32, 8)?;
            let taken = S::token_bucket_take(
                host(&mut cx),
                key,
                capacity as u64,
                refill as u64,
                interval as u64,
                cost as u64,
            )?;
            let record = match taken {
                Ok(b) => Record::new(32)
                    .u8(8, b.allowed as u8)
                    .u64(16, b.remaining)
                    .u64(24, b.reset_after_ms),
                Err(e) => state_record(32, &Err(e)),
            };
            put(&mut cx, ret, record.bytes())
        },
    )?;
    Ok(())
}

fn algorithm(v: i32) -> Result<crypto::Algorithm> {
    use crypto::Algorithm as A;
    const ALL: [A; 12] = [
        A::Hs256,
        A::Hs384,
        A::Hs512,
        A::Rs256,
        A::Rs384,
        A::Rs512,
        A::Ps256,
        A::Ps384,
        A::Ps512,
        A::Es256,
        A::Es384,
        A::Eddsa,
    ];
    usize::try_from(v)
        .ok()
        .and_then(|i| ALL.get(i).copied())
        .ok_or_else(|| format_err!("invalid enum discriminant {v} for algorithm"))
}

fn option_string(cx: &Cx<'_>, case: i32, p: i32, l: i32) -> Result<Option<String>> {
    match case {
        0 => Ok(None),
        1 => string(cx, p, l).map(Some),
        v => Err(format_err!("invalid option discriminant {v}")),
    }
}

fn verify_result(cx: &mut Cx<'_>, ret: i32, r: Result<String, crypto::VerifyError>) -> Result<()> {
    ret_area(cx, ret, 12, 4)?;
    let record = match r {
        Ok(claims) => {
            let (p, l) = lower_str(cx, &claims)?;
            Record::new(12).i32(4, p).i32(8, l)
        }
        Err(e) => Record::new(12).u8(0, 1).u8(4, e as u8),
    };
    put(cx, ret, record.bytes())
}

fn add_crypto(linker: &mut Linker<StoreState>) -> Result<()> {
    use crypto::Host as K;
    linker.func_wrap(
        CRYPTO,
        "verify",
        |mut cx: Cx<'_>,
         alg: i32,
         ksp: i32,
         ksl: i32,
         kid_case: i32,
         kidp: i32,
         kidl: i32,
         mp: i32,
         ml: i32,
         sp: i32,
         sl: i32,
         ret: i32| {
            let key_set = string(&cx, ksp, ksl)?;
            let kid = option_string(&cx, kid_case, kidp, kidl)?;
            let (message, signature) = (byte_list(&cx, mp, ml)?, byte_list(&cx, sp, sl)?);
            let r = K::verify(
                host(&mut cx),
                algorithm(alg)?,
                key_set,
                kid,
                message,
                signature,
            )?;
            verify_result(&mut cx, ret, r)
        },
    )?;
    linker.func_wrap(
        CRYPTO,
        "verify-named",
        |mut cx: Cx<'_>,
         ap: i32,
         al: i32,
         ksp: i32,
         ksl: i32,
         kid_case: i32,
         kidp: i32,
         kidl: i32,
         mp: i32,
         ml: i32,
         sp: i32,
         sl: i32,
         ret: i32| {
            let (alg, key_set) = (string(&cx, ap, al)?, string(&cx, ksp, ksl)?);
            let kid = option_string(&cx, kid_case, kidp, kidl)?;
            let (message, signature) = (byte_list(&cx, mp, ml)?, byte_list(&cx, sp, sl)?);
            let r = K::verify_named(host(&mut cx), alg, key_set, kid, message, signature)?;
            verify_result(&mut cx, ret, r)
        },
    )?;
    linker.func_wrap(
        CRYPTO,
        "key-set-version",
        |mut cx: Cx<'_>, p: i32, l: i32| {
            let key_set = string(&cx, p, l)?;
            Ok(K::key_set_version(host(&mut cx), key_set)? as i64)
        },
    )?;
    Ok(())
}

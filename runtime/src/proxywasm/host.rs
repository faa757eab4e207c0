//! The host functions of the proxy-wasm ABI (module `env`), as the proxy-wasm Rust
//! SDK 0.2.x links them. A call with a bad pointer, a size over the limit or data that
//! does not parse traps (the filter's failure policy applies); statuses are only ever
//! those the SDK knows.

use std::sync::Arc;

use dpumesh_head::RequestHead;
use wasmtime::{Caller, Linker};

use super::abi::{self, BufferType, LogLevel, MapType, MetricType, Status};
use super::properties;
use super::state::{self, CallState, LocalResponse, Metric, PwState};

/// Most metrics, shared queues one instance may define.
const MAX_METRICS: usize = 1024;

type Ret = wasmtime::Result<i32>;

fn ok() -> Ret {
    Ok(Status::Ok.code())
}

/// A request header map as the ABI shows it: pseudo-headers first, names lower-case.
fn request_pairs(head: &RequestHead) -> Vec<(String, Vec<u8>)> {
    let path = match &head.query {
        Some(q) => format!("{}?{q}", head.path),
        None => head.path.clone(),
    };
    let mut pairs = vec![
        (":authority".to_owned(), head.authority.clone().into_bytes()),
        (":method".to_owned(), head.method.clone().into_bytes()),
        (":path".to_owned(), path.into_bytes()),
        (":scheme".to_owned(), head.scheme.clone().into_bytes()),
    ];
    for (name, value) in head.headers() {
        pairs.push((name.as_str().to_owned(), value.as_bytes().to_vec()));
    }
    pairs
}

/// The pairs of `map` in this callback; maps not available here are empty (Envoy
/// answers BadArgument, which the Rust SDK turns into a panic).
fn pairs(call: &CallState, map: MapType) -> Vec<(String, Vec<u8>)> {
    match map {
        MapType::RequestHeaders => call.head.as_deref().map(request_pairs).unwrap_or_default(),
        MapType::ResponseHeaders => call
            .response
            .as_ref()
            .map(|(status, headers)| {
                let mut all = vec![(":status".to_owned(), status.to_string().into_bytes())];
                all.extend(headers.iter().cloned());
                all
            })
            .unwrap_or_default(),
        MapType::HttpCallResponseHeaders => call.call_response.clone().unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// An edit of a header map, checked as the filter world's edits are.
enum Edit {
    Replace(String, String),
    Add(String, String),
    Remove(String),
}

fn edit(call: &mut CallState, map: MapType, edit: Edit) -> wasmtime::Result<()> {
    let name = match &edit {
        Edit::Replace(n, _) | Edit::Add(n, _) | Edit::Remove(n) => n.to_ascii_lowercase(),
    };
    if name.starts_with(':') {
        wasmtime::bail!("pseudo-header {name} is read-only on this proxy");
    }
    match map {
        MapType::RequestHeaders => {}
        MapType::ResponseHeaders => return edit_response(call, name, edit),
        other => wasmtime::bail!("header map {other:?} cannot be edited here"),
    }
    let head = call
        .head
        .as_mut()
        .ok_or_else(|| wasmtime::format_err!("no request in this callback"))?;
    let result = match &edit {
        Edit::Replace(_, v) => head.set_header(&name, v),
        Edit::Add(_, v) => head.append_header(&name, v),
        Edit::Remove(_) => head.remove_header(&name),
    };
    result.map_err(|e| wasmtime::format_err!("header edit of {name:?} refused: {e}"))
}

/// An edit of the response's headers (in `proxy_on_response_headers`), checked as
/// HTTP; the proxy applies the edited map to the response it sends.
fn edit_response(call: &mut CallState, name: String, edit: Edit) -> wasmtime::Result<()> {
    let Some((_, headers)) = call.response.as_mut() else {
        wasmtime::bail!("no response in this callback (edit of {name:?})");
    };
    http::HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| wasmtime::format_err!("response header name {name:?} is not valid HTTP"))?;
    if let Edit::Replace(_, v) | Edit::Add(_, v) = &edit {
        http::HeaderValue::from_str(v).map_err(|_| {
            wasmtime::format_err!("the value of response header {name:?} is not valid HTTP")
        })?;
    }
    match edit {
        Edit::Replace(_, v) => {
            headers.retain(|(k, _)| !k.eq_ignore_ascii_case(&name));
            headers.push((name, v.into_bytes()));
        }
        Edit::Add(_, v) => headers.push((name, v.into_bytes())),
        Edit::Remove(_) => headers.retain(|(k, _)| !k.eq_ignore_ascii_case(&name)),
    }
    call.response_edited = true;
    Ok(())
}

fn map_type(value: i32) -> wasmtime::Result<MapType> {
    MapType::from_i32(value).ok_or_else(|| wasmtime::format_err!("unknown header map type {value}"))
}

fn value_str(bytes: Vec<u8>, name: &str) -> wasmtime::Result<String> {
    String::from_utf8(bytes)
        .map_err(|_| wasmtime::format_err!("value of header {name:?} is not UTF-8"))
}

/// Defines every `env` function of ABI 0.2.1 on `linker`.
pub(crate) fn define(linker: &mut Linker<PwState>) -> wasmtime::Result<()> {
    logging(linker)?;
    buffers(linker)?;
    header_maps(linker)?;
    stream(linker)?;
    properties_and_shared(linker)?;
    metrics(linker)?;
    super::calls::define(linker)?;
    Ok(())
}

fn logging(linker: &mut Linker<PwState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_log",
        |mut caller: Caller<'_, PwState>, level: i32, ptr: i32, len: i32| -> Ret {
            let message = state::read(&mut caller, ptr, len)?;
            let message = String::from_utf8_lossy(&message);
            let filter = caller.data().config.name.as_str();
            match LogLevel::from_i32(level).unwrap_or(LogLevel::Info) {
                LogLevel::Trace => tracing::trace!(target: "dpumesh::filter", filter, "{message}"),
                LogLevel::Debug => tracing::debug!(target: "dpumesh::filter", filter, "{message}"),
                LogLevel::Info => tracing::info!(target: "dpumesh::filter", filter, "{message}"),
                LogLevel::Warn => tracing::warn!(target: "dpumesh::filter", filter, "{message}"),
                LogLevel::Error | LogLevel::Critical => {
                    // A Rust guest's panic message arrives here at Critical before it
                    // traps: keep it for the fault report too.
                    caller.data().stderr.push(message.as_bytes());
                    tracing::error!(target: "dpumesh::filter", filter, "{message}")
                }
            }
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_log_level",
        |mut caller: Caller<'_, PwState>, ret: i32| -> Ret {
            let level = if tracing::enabled!(target: "dpumesh::filter", tracing::Level::TRACE) {
                LogLevel::Trace
            } else if tracing::enabled!(target: "dpumesh::filter", tracing::Level::DEBUG) {
                LogLevel::Debug
            } else if tracing::enabled!(target: "dpumesh::filter", tracing::Level::INFO) {
                LogLevel::Info
            } else if tracing::enabled!(target: "dpumesh::filter", tracing::Level::WARN) {
                LogLevel::Warn
            } else {
                LogLevel::Error
            };
            state::write_u32(&mut caller, ret, level as u32)?;
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_current_time_nanoseconds",
        |mut caller: Caller<'_, PwState>, ret: i32| -> Ret {
            let now = caller.data().services.clock.wall_ns();
            state::write_u64(&mut caller, ret, now)?;
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_tick_period_milliseconds",
        |mut caller: Caller<'_, PwState>, period: i32| -> Ret {
            caller.data_mut().tick_ms = period as u32;
            ok()
        },
    )?;
    Ok(())
}

fn buffers(linker: &mut Linker<PwState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut caller: Caller<'_, PwState>,
         kind: i32,
         start: i32,
         max: i32,
         ret_ptr: i32,
         ret_len: i32|
         -> Ret {
            let Some(kind) = BufferType::from_i32(kind) else {
                return Ok(Status::BadArgument.code());
            };
            let bytes = match &caller.data().call.buffer {
                Some((k, bytes)) if *k == kind => bytes.clone(),
                // The body is never here: the proxy is header-only.
                _ => return Ok(Status::NotFound.code()),
            };
            let (start, max) = (start as u32 as usize, max as u32 as usize);
            let from = start.min(bytes.len());
            let to = from.saturating_add(max).min(bytes.len());
            state::give(&mut caller, &bytes[from..to], ret_ptr, ret_len)?;
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_buffer_status",
        |mut caller: Caller<'_, PwState>, kind: i32, ret_size: i32, ret_flags: i32| -> Ret {
            let size = match (&caller.data().call.buffer, BufferType::from_i32(kind)) {
                (Some((k, bytes)), Some(kind)) if *k == kind => bytes.len(),
                _ => return Ok(Status::NotFound.code()),
            };
            state::write_u32(&mut caller, ret_size, size as u32)?;
            state::write_u32(&mut caller, ret_flags, 0)?;
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_buffer_bytes",
        |_caller: Caller<'_, PwState>, kind: i32, _s: i32, _n: i32, _p: i32, _l: i32| -> Ret {
            // Bodies never pass through the proxy; configurations are read-only.
            wasmtime::bail!(
                "buffer {kind} cannot be written: this proxy is header-only (bodies go straight to the service)"
            )
        },
    )?;
    Ok(())
}

fn header_maps(linker: &mut Linker<PwState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_get_header_map_pairs",
        |mut caller: Caller<'_, PwState>, map: i32, ret_ptr: i32, ret_len: i32| -> Ret {
            let all = pairs(&caller.data().call, map_type(map)?);
            let bytes = abi::serialize_pairs(all.iter().map(|(k, v)| (k.as_bytes(), v.as_slice())));
            state::give(&mut caller, &bytes, ret_ptr, ret_len)?;
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_size",
        |mut caller: Caller<'_, PwState>, map: i32, ret: i32| -> Ret {
            let all = pairs(&caller.data().call, map_type(map)?);
            let size =
                abi::serialize_pairs(all.iter().map(|(k, v)| (k.as_bytes(), v.as_slice()))).len();
            state::write_u32(&mut caller, ret, size as u32)?;
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut caller: Caller<'_, PwState>,
         map: i32,
         kp: i32,
         kl: i32,
         ret_ptr: i32,
         ret_len: i32|
         -> Ret {
            let map = map_type(map)?;
            let key = state::read_str(&mut caller, kp, kl, "a header name")?.to_ascii_lowercase();
            // The first value, as Envoy answers.
            let value = pairs(&caller.data().call, map)
                .into_iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v);
            match value {
                Some(v) => {
                    state::give(&mut caller, &v, ret_ptr, ret_len)?;
                    ok()
                }
                None => Ok(Status::NotFound.code()),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_header_map_pairs",
        |mut caller: Caller<'_, PwState>, map: i32, ptr: i32, len: i32| -> Ret {
            let map = map_type(map)?;
            let bytes = state::read(&mut caller, ptr, len)?;
            let new = abi::parse_pairs(&bytes).map_err(|e| wasmtime::format_err!("{e}"))?;
            let call = &mut caller.data_mut().call;
            // Replace the whole map: remove what is not in the new one, then set.
            let old: Vec<String> = pairs(call, map)
                .into_iter()
                .map(|(k, _)| k)
                .filter(|k| !k.starts_with(':'))
                .collect();
            for name in old {
                edit(call, map, Edit::Remove(name))?;
            }
            let mut seen = std::collections::HashSet::new();
            for (name, value) in new {
                if name.starts_with(':') {
                    // Pseudo-headers come back unchanged from a get/set round trip.
                    let same = pairs(call, map)
                        .iter()
                        .any(|(k, v)| *k == name && *v == value);
                    if same {
                        continue;
                    }
                }
                let value = value_str(value, &name)?;
                let e = if seen.insert(name.to_ascii_lowercase()) {
                    Edit::Replace(name, value)
                } else {
                    Edit::Add(name, value)
                };
                edit(call, map, e)?;
            }
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_replace_header_map_value",
        |mut caller: Caller<'_, PwState>, map: i32, kp: i32, kl: i32, vp: i32, vl: i32| -> Ret {
            let map = map_type(map)?;
            let name = state::read_str(&mut caller, kp, kl, "a header name")?;
            let value = value_str(state::read(&mut caller, vp, vl)?, &name)?;
            edit(&mut caller.data_mut().call, map, Edit::Replace(name, value))?;
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_add_header_map_value",
        |mut caller: Caller<'_, PwState>, map: i32, kp: i32, kl: i32, vp: i32, vl: i32| -> Ret {
            let map = map_type(map)?;
            let name = state::read_str(&mut caller, kp, kl, "a header name")?;
            let value = value_str(state::read(&mut caller, vp, vl)?, &name)?;
            edit(&mut caller.data_mut().call, map, Edit::Add(name, value))?;
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut caller: Caller<'_, PwState>, map: i32, kp: i32, kl: i32| -> Ret {
            let map = map_type(map)?;
            let name = state::read_str(&mut caller, kp, kl, "a header name")?;
            edit(&mut caller.data_mut().call, map, Edit::Remove(name))?;
            ok()
        },
    )?;
    Ok(())
}

fn stream(linker: &mut Linker<PwState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut caller: Caller<'_, PwState>,
         status: i32,
         dp: i32,
         dl: i32,
         bp: i32,
         bl: i32,
         hp: i32,
         hl: i32,
         _grpc_status: i32|
         -> Ret {
            let details = String::from_utf8_lossy(&state::read(&mut caller, dp, dl)?).into_owned();
            let body = state::read(&mut caller, bp, bl)?;
            let headers = abi::parse_pairs(&state::read(&mut caller, hp, hl)?)
                .map_err(|e| wasmtime::format_err!("local response headers: {e}"))?;
            let status = u16::try_from(status).unwrap_or(0);
            caller.data_mut().call.local_response = Some(LocalResponse {
                status,
                details,
                body,
                headers,
            });
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_continue_stream",
        |mut caller: Caller<'_, PwState>, stream: i32| -> Ret {
            // 0: the request (resumes it if paused); a response is never held, so
            // continuing it changes nothing.
            if stream == 0 {
                caller.data_mut().call.resumed = true;
            }
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_close_stream",
        |mut caller: Caller<'_, PwState>, _stream: i32| -> Ret {
            caller.data_mut().call.closed = true;
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_effective_context",
        |mut caller: Caller<'_, PwState>, context: i32| -> Ret {
            let context = context as u32;
            if !caller.data().contexts.alive.contains(&context) {
                return Ok(Status::BadArgument.code());
            }
            caller.data_mut().contexts.effective = context;
            ok()
        },
    )?;
    linker.func_wrap("env", "proxy_done", |_caller: Caller<'_, PwState>| -> Ret {
        Ok(Status::NotFound.code())
    })?;
    Ok(())
}

fn properties_and_shared(linker: &mut Linker<PwState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_get_property",
        |mut caller: Caller<'_, PwState>, pp: i32, pl: i32, ret_ptr: i32, ret_len: i32| -> Ret {
            let path = state::read(&mut caller, pp, pl)?;
            let segments = abi::property_path(&path);
            let data = caller.data();
            let empty = RequestHead::default();
            let view = properties::View {
                head: data.call.head.as_deref().unwrap_or(&empty),
                plugin_name: &data.config.name,
                root_id: &data.config.root_id,
                vm_id: "",
                node_metadata: &data.config.node_metadata,
                response_code: data.call.response.as_ref().map(|(s, _)| *s),
            };
            match properties::get(&view, &segments) {
                properties::Value::Bytes(bytes) => {
                    state::give(&mut caller, &bytes, ret_ptr, ret_len)?;
                    ok()
                }
                properties::Value::NotFound => Ok(Status::NotFound.code()),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_property",
        |mut caller: Caller<'_, PwState>, pp: i32, pl: i32, vp: i32, vl: i32| -> Ret {
            let path = state::read(&mut caller, pp, pl)?;
            let segments: Vec<String> = abi::property_path(&path)
                .into_iter()
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect();
            let value = String::from_utf8_lossy(&state::read(&mut caller, vp, vl)?).into_owned();
            let key = properties::set_key(&segments.iter().map(String::as_str).collect::<Vec<_>>());
            match caller.data_mut().call.head.as_deref_mut() {
                Some(head) => head.set_metadata(&key, &value),
                // Outside a request (a root callback) there is nothing to set it on.
                None => return Ok(Status::NotFound.code()),
            }
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut caller: Caller<'_, PwState>,
         kp: i32,
         kl: i32,
         ret_ptr: i32,
         ret_len: i32,
         ret_cas: i32|
         -> Ret {
            let key = state::read_str(&mut caller, kp, kl, "a shared-data key")?;
            let found = caller
                .data()
                .shared
                .get_bytes(&key)
                .map_err(|e| wasmtime::format_err!("shared data {key:?}: {e}"))?;
            match found {
                None => Ok(Status::NotFound.code()),
                Some((value, cas)) => {
                    state::give(&mut caller, &value, ret_ptr, ret_len)?;
                    state::write_u32(&mut caller, ret_cas, cas)?;
                    ok()
                }
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut caller: Caller<'_, PwState>, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32| -> Ret {
            let key = state::read_str(&mut caller, kp, kl, "a shared-data key")?;
            let value = state::read(&mut caller, vp, vl)?;
            match caller.data().shared.set_bytes(&key, &value, cas as u32) {
                Ok(true) => ok(),
                Ok(false) => Ok(Status::CasMismatch.code()),
                Err(e) => wasmtime::bail!("shared data {key:?}: {e}"),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_register_shared_queue",
        |mut caller: Caller<'_, PwState>, np: i32, nl: i32, ret: i32| -> Ret {
            let name = state::read_str(&mut caller, np, nl, "a queue name")?;
            let data = caller.data();
            let Some(id) = data
                .services
                .queues
                .register(&data.vm_id, &name, &data.queue_owner)
            else {
                wasmtime::bail!(
                    "the node has {} shared queues already",
                    crate::queues::MAX_QUEUES
                );
            };
            state::write_u32(&mut caller, ret, id)?;
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_resolve_shared_queue",
        |mut caller: Caller<'_, PwState>, vp: i32, vl: i32, np: i32, nl: i32, ret: i32| -> Ret {
            let vm = state::read_str(&mut caller, vp, vl, "a VM id")?;
            let name = state::read_str(&mut caller, np, nl, "a queue name")?;
            let data = caller.data();
            // An empty VM id is the caller's own.
            let vm = if vm.is_empty() {
                data.vm_id.as_str()
            } else {
                vm.as_str()
            };
            match data.services.queues.resolve(vm, &name) {
                Some(id) => {
                    state::write_u32(&mut caller, ret, id)?;
                    ok()
                }
                None => Ok(Status::NotFound.code()),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_enqueue_shared_queue",
        |mut caller: Caller<'_, PwState>, id: i32, vp: i32, vl: i32| -> Ret {
            let value = state::read(&mut caller, vp, vl)?;
            match caller.data().services.queues.enqueue(id as u32, value) {
                Ok(()) => ok(),
                Err(_) => Ok(Status::NotFound.code()),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_dequeue_shared_queue",
        |mut caller: Caller<'_, PwState>, id: i32, ret_ptr: i32, ret_len: i32| -> Ret {
            match caller.data().services.queues.dequeue(id as u32) {
                Err(_) => Ok(Status::NotFound.code()),
                Ok(None) => Ok(Status::Empty.code()),
                Ok(Some(value)) => {
                    state::give(&mut caller, &value, ret_ptr, ret_len)?;
                    ok()
                }
            }
        },
    )?;
    Ok(())
}

fn metrics(linker: &mut Linker<PwState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_define_metric",
        |mut caller: Caller<'_, PwState>, kind: i32, np: i32, nl: i32, ret: i32| -> Ret {
            let name = state::read_str(&mut caller, np, nl, "a metric name")?;
            let Some(kind_of) = MetricType::from_i32(kind) else {
                return Ok(Status::BadArgument.code());
            };
            let data = caller.data_mut();
            let id = match data.metric_ids.get(&(kind, name.clone())) {
                Some(id) => *id,
                None => {
                    if data.metrics.len() >= MAX_METRICS {
                        wasmtime::bail!("more than {MAX_METRICS} metrics defined");
                    }
                    // Envoy's names are dotted; Prometheus wants underscores.
                    let prom: String = name
                        .chars()
                        .map(|c| {
                            if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
                                c
                            } else {
                                '_'
                            }
                        })
                        .collect();
                    let prom = if prom.starts_with(|c: char| c.is_ascii_digit()) {
                        format!("_{prom}")
                    } else {
                        prom
                    };
                    let labels = vec![::metrics::Label::new("filter", data.config.name.clone())];
                    let metric = match kind_of {
                        MetricType::Counter => {
                            Metric::Counter(::metrics::counter!(prom, labels), 0)
                        }
                        MetricType::Gauge => Metric::Gauge(::metrics::gauge!(prom, labels), 0),
                        MetricType::Histogram => {
                            Metric::Histogram(::metrics::histogram!(prom, labels))
                        }
                    };
                    data.metrics.push(metric);
                    let id = data.metrics.len() as u32;
                    data.metric_ids.insert((kind, name), id);
                    id
                }
            };
            state::write_u32(&mut caller, ret, id)?;
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_increment_metric",
        |mut caller: Caller<'_, PwState>, id: i32, delta: i64| -> Ret {
            let metrics = &mut caller.data_mut().metrics;
            let Some(metric) = (id as u32 as usize)
                .checked_sub(1)
                .and_then(|i| metrics.get_mut(i))
            else {
                return Ok(Status::NotFound.code());
            };
            match metric {
                Metric::Counter(c, total) => {
                    if delta < 0 {
                        return Ok(Status::BadArgument.code());
                    }
                    c.increment(delta as u64);
                    *total = total.saturating_add(delta as u64);
                }
                Metric::Gauge(g, value) => {
                    g.increment(delta as f64);
                    *value = value.saturating_add(delta);
                }
                Metric::Histogram(_) => return Ok(Status::BadArgument.code()),
            }
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_record_metric",
        |mut caller: Caller<'_, PwState>, id: i32, value: i64| -> Ret {
            let metrics = &mut caller.data_mut().metrics;
            let Some(metric) = (id as u32 as usize)
                .checked_sub(1)
                .and_then(|i| metrics.get_mut(i))
            else {
                return Ok(Status::NotFound.code());
            };
            match metric {
                Metric::Counter(c, total) => {
                    c.increment(value.max(0) as u64);
                    *total = total.saturating_add(value.max(0) as u64);
                }
                Metric::Gauge(g, v) => {
                    g.set(value as f64);
                    *v = value;
                }
                Metric::Histogram(h) => h.record(value as f64),
            }
            ok()
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_metric",
        |mut caller: Caller<'_, PwState>, id: i32, ret: i32| -> Ret {
            let value = match (id as u32 as usize)
                .checked_sub(1)
                .and_then(|i| caller.data().metrics.get(i))
            {
                None => return Ok(Status::NotFound.code()),
                Some(Metric::Counter(_, total)) => *total,
                Some(Metric::Gauge(_, value)) => *value as u64,
                Some(Metric::Histogram(_)) => return Ok(Status::BadArgument.code()),
            };
            state::write_u64(&mut caller, ret, value)?;
            ok()
        },
    )?;
    Ok(())
}

/// The buffer a root callback may read.
pub(crate) fn config_buffer(kind: BufferType, bytes: &[u8]) -> Option<(BufferType, Arc<[u8]>)> {
    Some((kind, Arc::from(bytes)))
}

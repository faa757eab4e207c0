//! One instance of a proxy-wasm plugin: its root context (created, `proxy_on_vm_start`
//! and `proxy_on_configure` at instantiation), and an HTTP context per request
//! (`proxy_on_context_create`, `proxy_on_request_headers`; then in the response phase
//! `proxy_on_response_headers`, `proxy_on_log`, `proxy_on_done`, `proxy_on_delete`, in
//! Envoy's order).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use dpumesh_head::RequestHead;
use wasmtime::{Store, TypedFunc};

use super::abi::{Action, BufferType};
use super::host::config_buffer;
use super::plugin::Plugin;
use super::state::{CallState, LocalResponse, PwState};
use crate::bindings::{LocalReply, ResponseInfo};
use crate::call::{Answer, classify};
use crate::callout::CalloutReply;
use crate::error::{FaultKind, LoadError};

/// The root context's id (Envoy: 1 in a single-plugin VM, so requests start at 2, as
/// the SDK's examples log).
const ROOT: u32 = 1;
/// Most request contexts open at once in one instance: a request whose response phase
/// never comes (the proxy dropped it) is finished when this many newer ones are open.
const MAX_OPEN: usize = 4096;
/// Where a request's context is noted for its response phase (per filter; the value
/// names the instance, so a replaced instance does not finish another's contexts).
const CONTEXT_METADATA: &str = "dpumesh.proxy-wasm.context.";

/// `proxy_on_http_call_response(root, token, headers, body size, trailers)`.
type CallResponse = TypedFunc<(i32, i32, i32, i32, i32), ()>;

/// Typed exports: the required ones, and the optional ones as `Option`.
struct Calls {
    context_create: TypedFunc<(i32, i32), ()>,
    request_headers: TypedFunc<(i32, i32, i32), i32>,
    response_headers: Option<TypedFunc<(i32, i32, i32), i32>>,
    log: Option<TypedFunc<i32, ()>>,
    done: Option<TypedFunc<i32, i32>>,
    delete: Option<TypedFunc<i32, ()>>,
    tick: Option<TypedFunc<i32, ()>>,
    call_response: Option<CallResponse>,
    queue_ready: Option<TypedFunc<(i32, i32), ()>>,
}

/// A configured instance.
pub(crate) struct PwInstance {
    pub(crate) store: Store<PwState>,
    calls: Calls,
    name: String,
    nonce: u64,
    next_context: u32,
    /// Open request contexts, oldest first (by the order they were opened), and
    /// each context's place in that order: finishing one costs O(log n), not a scan.
    open: BTreeMap<u64, u32>,
    opened: HashMap<u32, u64>,
    next_seq: u64,
    /// When `proxy_on_tick` is next due (set once the plugin asks for a period).
    next_tick: Option<std::time::Instant>,
    /// HTTP calls the root context made, for an owner that makes them.
    root_calls: Vec<crate::callout::Callout>,
}

fn typed<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
    store: &mut Store<PwState>,
    instance: &wasmtime::Instance,
    name: &'static str,
    filter: &str,
) -> Result<Option<TypedFunc<P, R>>, LoadError> {
    match instance.get_func(&mut *store, name) {
        None => Ok(None),
        Some(f) => f
            .typed(&*store)
            .map(Some)
            .map_err(|e| LoadError::ExportType {
                filter: filter.to_owned(),
                export: name,
                detail: format!("{e:#}"),
            }),
    }
}

impl PwInstance {
    /// Instantiates `plugin` into `store` and runs the root's start: `_initialize`,
    /// the root context, `proxy_on_vm_start`, `proxy_on_configure`. A `false` from
    /// either refuses the load with what the plugin logged.
    pub(crate) fn new(
        plugin: &Arc<Plugin>,
        mut store: Store<PwState>,
        deadline: Duration,
    ) -> Result<Self, LoadError> {
        let name = plugin.config.name.clone();
        let fault = |store: &mut Store<PwState>, e| LoadError::ConfigureFault {
            filter: name.clone(),
            fault: classify(store, e, deadline),
        };
        let instance = plugin
            .pre
            .instantiate(&mut store)
            .map_err(|e| LoadError::Instantiate {
                filter: name.clone(),
                detail: format!("{e:#}"),
            })?;
        for start in ["_initialize", "_start"] {
            if let Some(f) = typed::<(), ()>(&mut store, &instance, start, &name)? {
                f.call(&mut store, ()).map_err(|e| fault(&mut store, e))?;
                break;
            }
        }
        let missing = |export: &'static str| LoadError::MissingExport {
            filter: name.clone(),
            export,
        };
        let calls = Calls {
            context_create: typed(&mut store, &instance, "proxy_on_context_create", &name)?
                .ok_or_else(|| missing("proxy_on_context_create"))?,
            request_headers: typed(&mut store, &instance, "proxy_on_request_headers", &name)?
                .ok_or_else(|| missing("proxy_on_request_headers"))?,
            response_headers: typed(&mut store, &instance, "proxy_on_response_headers", &name)?,
            log: typed(&mut store, &instance, "proxy_on_log", &name)?,
            done: typed(&mut store, &instance, "proxy_on_done", &name)?,
            delete: typed(&mut store, &instance, "proxy_on_delete", &name)?,
            tick: typed(&mut store, &instance, "proxy_on_tick", &name)?,
            call_response: typed(&mut store, &instance, "proxy_on_http_call_response", &name)?,
            queue_ready: typed(&mut store, &instance, "proxy_on_queue_ready", &name)?,
        };
        let vm_start = typed::<(i32, i32), i32>(&mut store, &instance, "proxy_on_vm_start", &name)?;
        let configure =
            typed::<(i32, i32), i32>(&mut store, &instance, "proxy_on_configure", &name)?;
        calls
            .context_create
            .call(&mut store, (ROOT as i32, 0))
            .map_err(|e| fault(&mut store, e))?;
        store.data_mut().contexts.alive.insert(ROOT);
        store.data_mut().contexts.effective = ROOT;
        let config = plugin.config.clone();
        for (call, kind, bytes, what) in [
            (
                vm_start,
                BufferType::VmConfiguration,
                &config.vm,
                "proxy_on_vm_start",
            ),
            (
                configure,
                BufferType::PluginConfiguration,
                &config.plugin,
                "proxy_on_configure",
            ),
        ] {
            let Some(call) = call else { continue };
            store.data_mut().call.buffer = config_buffer(kind, bytes);
            let result = call.call(&mut store, (ROOT as i32, bytes.len() as i32));
            store.data_mut().call.buffer = None;
            match result {
                Ok(0) => {
                    let said = store.data().stderr.take();
                    return Err(LoadError::Configure {
                        filter: name.clone(),
                        message: if said.is_empty() {
                            format!("{what} returned false")
                        } else {
                            format!("{what} returned false: {said}")
                        },
                    });
                }
                Ok(_) => {}
                Err(e) => return Err(fault(&mut store, e)),
            }
        }
        drop_root_calls(&mut store, &name, "proxy_on_configure");
        static NONCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Self {
            store,
            calls,
            name,
            nonce: NONCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            next_context: ROOT + 1,
            open: BTreeMap::new(),
            opened: HashMap::new(),
            next_seq: 0,
            next_tick: None,
            root_calls: Vec::new(),
        })
    }

    fn metadata_key(&self) -> String {
        format!("{CONTEXT_METADATA}{}", self.name)
    }

    /// The request phase: a new HTTP context and `proxy_on_request_headers` over the
    /// lent head. A local response denies; `proxy_close_stream` denies with 503;
    /// `Pause` parks the request (with the HTTP calls it made) until
    /// [`Self::on_callout`] resumes or ends it.
    pub(crate) fn on_request(
        &mut self,
        head: Box<RequestHead>,
        deadline: Duration,
    ) -> (Box<RequestHead>, Result<Answer, FaultKind>) {
        let context = self.next_context;
        self.next_context = self.next_context.checked_add(1).unwrap_or(ROOT + 1);
        let eos = i32::from(!has_body(&head));
        let headers = 4 + head.headers().len() as i32;
        self.store.data_mut().call = CallState {
            head: Some(head),
            ..CallState::default()
        };
        let result = self.start_context(context).and_then(|()| {
            self.calls
                .request_headers
                .call(&mut self.store, (context as i32, headers, eos))
        });
        let mut call = std::mem::take(&mut self.store.data_mut().call);
        let mut head = call.head.take().unwrap_or_default();
        let action = match result {
            Ok(action) => Action::from_i32(action),
            Err(e) => return (head, Err(classify(&mut self.store, e, deadline))),
        };
        head.set_metadata(&self.metadata_key(), &format!("{}:{context}", self.nonce));
        let answer = self.answer(context, action == Action::Pause, call);
        (head, answer)
    }

    /// Hands the answer to HTTP call `token` to the context that made it
    /// (`proxy_on_http_call_response`, the head of its paused request lent), and says
    /// what became of the request: resumed, answered locally, or still paused (with
    /// any new calls).
    pub(crate) fn on_callout(
        &mut self,
        head: Box<RequestHead>,
        token: u32,
        reply: &CalloutReply,
        deadline: Duration,
    ) -> (Box<RequestHead>, Result<Answer, FaultKind>) {
        let Some(context) = self.store.data_mut().contexts.pending.remove(&token) else {
            return (
                head,
                Err(FaultKind::Unavailable(format!(
                    "no HTTP call with token {token} is under way in this instance"
                ))),
            );
        };
        if !self.store.data().contexts.alive.contains(&context) {
            return (
                head,
                Err(FaultKind::Unavailable(
                    "the paused request's context was ended".to_owned(),
                )),
            );
        }
        let Some(call_response) = self.calls.call_response.clone() else {
            return (
                head,
                Err(FaultKind::BadReply(
                    "the plugin made an HTTP call but exports no proxy_on_http_call_response"
                        .to_owned(),
                )),
            );
        };
        if let CalloutReply::Failed { reason } = reply {
            tracing::debug!(filter = self.name, token, reason, "HTTP call failed");
        }
        let pairs = reply.header_pairs();
        let body = reply.body();
        let (n_headers, body_len) = (pairs.len() as i32, body.len() as i32);
        let data = self.store.data_mut();
        data.call = CallState {
            head: Some(head),
            buffer: Some((BufferType::HttpCallResponseBody, std::sync::Arc::from(body))),
            call_response: Some(pairs),
            ..CallState::default()
        };
        data.contexts.effective = context;
        let result = call_response.call(
            &mut self.store,
            (ROOT as i32, token as i32, n_headers, body_len, 0),
        );
        let mut call = std::mem::take(&mut self.store.data_mut().call);
        let head = call.head.take().unwrap_or_default();
        if let Err(e) = result {
            return (head, Err(classify(&mut self.store, e, deadline)));
        }
        let resumed = call.resumed;
        let answer = self.answer(context, !resumed, call);
        (head, answer)
    }

    /// What a callback of request `context` decided: a local response or a closed
    /// stream deny; otherwise the request waits if `paused` (a fault when no call of
    /// its is under way: nothing could resume it), or goes on. Calls made by
    /// a request that does not wait are not made: their answer would have no request
    /// to go to (said in the log).
    fn answer(&mut self, context: u32, paused: bool, call: CallState) -> Result<Answer, FaultKind> {
        let reply = if let Some(reply) = call.local_response {
            Some(local_reply(reply))
        } else if call.closed {
            Some(LocalReply {
                status: 503,
                headers: Vec::new(),
                body: "stream closed by a filter\n".to_owned(),
            })
        } else {
            None
        };
        if paused && reply.is_none() && !call.resumed {
            let waiting = !call.callouts.is_empty()
                || self
                    .store
                    .data()
                    .contexts
                    .pending
                    .values()
                    .any(|c| *c == context);
            if !waiting {
                // Only an answer resumes a request here: this one would wait for its
                // route's timeout. Denied even fail-open (a plugin holding a request to
                // look at its body must not be skipped).
                return Err(FaultKind::BadReply(
                    "the plugin paused the request with no HTTP call under way: nothing can resume it here (the proxy is header-only and calls no body callbacks, so a plugin waiting for the body cannot run)".to_owned(),
                ));
            }
            return Ok(Answer::Pause(call.callouts));
        }
        if !call.callouts.is_empty() {
            let pending = &mut self.store.data_mut().contexts.pending;
            for callout in &call.callouts {
                pending.remove(&callout.token);
            }
            tracing::warn!(
                filter = self.name,
                context,
                calls = call.callouts.len(),
                "HTTP calls made by a request that did not pause were not made (only a paused request receives answers)"
            );
        }
        Ok(match reply {
            Some(reply) => Answer::Deny(reply),
            None => Answer::Continue,
        })
    }

    /// The response phase of the request whose context the head names:
    /// `proxy_on_response_headers`, then the context is finished.
    pub(crate) fn on_response(
        &mut self,
        head: Box<RequestHead>,
        info: &ResponseInfo,
        mut headers: Option<&mut crate::call::ResponseHeaders>,
        deadline: Duration,
    ) -> (Box<RequestHead>, Result<(), FaultKind>) {
        let context = head.metadata(&self.metadata_key()).and_then(|v| {
            let (nonce, context) = v.split_once(':')?;
            (nonce.parse::<u64>().ok()? == self.nonce).then(|| context.parse::<u32>().ok())?
        });
        let Some(context) = context.filter(|c| self.store.data().contexts.alive.contains(c)) else {
            return (head, Ok(()));
        };
        self.store.data_mut().call = CallState {
            head: Some(head),
            response: Some((
                info.status,
                headers
                    .as_ref()
                    .map(|h| h.fields.clone())
                    .unwrap_or_default(),
            )),
            ..CallState::default()
        };
        let mut result = Ok(());
        if let Some(call) = &self.calls.response_headers {
            // A response cannot be held: Pause here goes on, as a header-only proxy must.
            result = call
                .call(&mut self.store, (context as i32, 1, 1))
                .map(|_| ());
        }
        let finished = self.finish(context);
        let call = std::mem::take(&mut self.store.data_mut().call);
        if call.response_edited
            && let (Some(headers), Some((_, fields))) = (headers.as_mut(), call.response)
        {
            headers.fields = fields;
            headers.edited = true;
        }
        let head = call.head.unwrap_or_default();
        let result = result.and(finished);
        (
            head,
            result.map_err(|e| classify(&mut self.store, e, deadline)),
        )
    }

    /// Tells the root about its shared queues that got items
    /// (`proxy_on_queue_ready`), then runs `proxy_on_tick` if its period has come (the
    /// store armed by the caller); returns when the next tick is due (`None`: the
    /// plugin asked for none). Both are driven by the thread that owns the instance,
    /// between requests.
    pub(crate) fn tick(
        &mut self,
        now: std::time::Instant,
        deadline: Duration,
    ) -> (Option<std::time::Instant>, Result<(), FaultKind>) {
        let owner = self.store.data().queue_owner.clone();
        if owner.pending() {
            let ready = owner.take();
            if let Some(call) = self.calls.queue_ready.clone() {
                for id in ready {
                    self.store.data_mut().contexts.effective = ROOT;
                    let result = call.call(&mut self.store, (ROOT as i32, id as i32));
                    self.root_calls_made("proxy_on_queue_ready");
                    if let Err(e) = result {
                        return (None, Err(classify(&mut self.store, e, deadline)));
                    }
                }
            }
        }
        let period = self.store.data().tick_ms;
        let Some(tick) = self.calls.tick.as_ref().filter(|_| period > 0) else {
            self.next_tick = None;
            return (None, Ok(()));
        };
        let period = Duration::from_millis(u64::from(period));
        let due = *self.next_tick.get_or_insert(now + period);
        if now < due {
            return (Some(due), Ok(()));
        }
        self.store.data_mut().contexts.effective = ROOT;
        let result = tick
            .call(&mut self.store, ROOT as i32)
            .map_err(|e| classify(&mut self.store, e, deadline));
        self.root_calls_made("proxy_on_tick");
        // The plugin may have changed (or stopped) its period in the call.
        let period = self.store.data().tick_ms;
        self.next_tick = (period > 0).then(|| now + Duration::from_millis(u64::from(period)));
        (self.next_tick, result)
    }

    /// The instance is retired (its generation replaced, its runner dropped): the
    /// root's `proxy_on_done` (a `false` is not waited for: nothing will drive the
    /// instance any more) and `proxy_on_delete`. Faults are only logged.
    pub(crate) fn retire(&mut self, deadline: Duration) {
        self.store.data_mut().contexts.effective = ROOT;
        let mut result = Ok(());
        if let Some(done) = &self.calls.done {
            result = done.call(&mut self.store, ROOT as i32).map(|_| ());
        }
        if let (Ok(()), Some(delete)) = (&result, &self.calls.delete) {
            result = delete.call(&mut self.store, ROOT as i32);
        }
        if let Err(e) = result {
            let fault = classify(&mut self.store, e, deadline);
            tracing::warn!(
                filter = self.name,
                "the plugin's root faulted while retiring: {fault}"
            );
        }
    }

    /// Keeps the calls the root just made for the owner to make, if it makes them;
    /// else they are not made (and say so).
    fn root_calls_made(&mut self, callback: &str) {
        if self.store.data().queue_owner.slot().performs_calls() {
            let made = std::mem::take(&mut self.store.data_mut().call.callouts);
            self.root_calls.extend(made);
        } else {
            drop_root_calls(&mut self.store, &self.name, callback);
        }
    }

    /// The calls the root made since the last look.
    pub(crate) fn take_root_calls(&mut self) -> Vec<crate::callout::Callout> {
        std::mem::take(&mut self.root_calls)
    }

    /// Hands the root the answer to its call `token` (`proxy_on_http_call_response`
    /// with the root's context id); calls it makes there are kept as its others.
    pub(crate) fn on_root_callout(
        &mut self,
        token: u32,
        reply: &CalloutReply,
        deadline: Duration,
    ) -> Result<(), FaultKind> {
        let data = self.store.data_mut();
        if data.contexts.pending.get(&token) != Some(&ROOT) {
            return Ok(());
        }
        data.contexts.pending.remove(&token);
        let Some(call_response) = self.calls.call_response.clone() else {
            return Ok(());
        };
        let pairs = reply.header_pairs();
        let body = reply.body();
        let (n_headers, body_len) = (pairs.len() as i32, body.len() as i32);
        let data = self.store.data_mut();
        data.call = CallState {
            buffer: Some((BufferType::HttpCallResponseBody, std::sync::Arc::from(body))),
            call_response: Some(pairs),
            ..CallState::default()
        };
        data.contexts.effective = ROOT;
        let result = call_response.call(
            &mut self.store,
            (ROOT as i32, token as i32, n_headers, body_len, 0),
        );
        self.root_calls_made("proxy_on_http_call_response");
        self.store.data_mut().call = CallState::default();
        result.map_err(|e| classify(&mut self.store, e, deadline))
    }

    /// Whether a tick or a queue notification may be due (cheap: no guest call).
    pub(crate) fn ticks(&self) -> bool {
        let data = self.store.data();
        (self.calls.tick.is_some() && data.tick_ms > 0) || data.queue_owner.pending()
    }

    fn start_context(&mut self, context: u32) -> wasmtime::Result<()> {
        if self.open.len() >= MAX_OPEN
            && let Some((_, oldest)) = self.open.pop_first()
        {
            self.finish(oldest)?;
        }
        self.calls
            .context_create
            .call(&mut self.store, (context as i32, ROOT as i32))?;
        let data = self.store.data_mut();
        data.contexts.alive.insert(context);
        data.contexts.effective = context;
        self.next_seq += 1;
        self.open.insert(self.next_seq, context);
        self.opened.insert(context, self.next_seq);
        Ok(())
    }

    /// `proxy_on_log`, `proxy_on_done` (its answer ignored, as Envoy does for
    /// streams), `proxy_on_delete`.
    fn finish(&mut self, context: u32) -> wasmtime::Result<()> {
        if let Some(seq) = self.opened.remove(&context) {
            self.open.remove(&seq);
        }
        let data = self.store.data_mut();
        // Answers still to come for this request have nowhere to go.
        if !data.contexts.pending.is_empty() {
            data.contexts.pending.retain(|_, c| *c != context);
        }
        if !data.contexts.alive.remove(&context) {
            return Ok(());
        }
        let id = context as i32;
        if let Some(log) = &self.calls.log {
            log.call(&mut self.store, id)?;
        }
        if let Some(done) = &self.calls.done {
            done.call(&mut self.store, id)?;
        }
        if let Some(delete) = &self.calls.delete {
            delete.call(&mut self.store, id)?;
        }
        Ok(())
    }
}

/// HTTP calls made outside a request (from the root: configure, ticks, queue
/// notifications) are not made: only a paused request receives answers here. Their
/// tokens are released (else 1024 such calls would refuse every later one) and the
/// log says so.
fn drop_root_calls(store: &mut Store<PwState>, filter: &str, callback: &str) {
    let data = store.data_mut();
    let calls = std::mem::take(&mut data.call.callouts);
    if calls.is_empty() {
        return;
    }
    for call in &calls {
        data.contexts.pending.remove(&call.token);
    }
    tracing::warn!(
        filter,
        callback,
        calls = calls.len(),
        "HTTP calls made from the plugin's root context were not made (only a paused request receives answers on this proxy)"
    );
}

/// Whether a request has a body to come (which the plugin never sees).
fn has_body(head: &RequestHead) -> bool {
    head.header("transfer-encoding").is_some()
        || head
            .header("content-length")
            .is_some_and(|v| v.trim() != "0")
}

/// A plugin's local response as the chain's deny. The body and header values are
/// bytes in the ABI and text here: bytes that are not UTF-8 are replaced.
fn local_reply(reply: LocalResponse) -> LocalReply {
    LocalReply {
        status: reply.status,
        headers: reply
            .headers
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
            .collect(),
        body: String::from_utf8_lossy(&reply.body).into_owned(),
    }
}

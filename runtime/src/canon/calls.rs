//! Calls into a filter's core instance: the world's exports with their arguments
//! lowered and their results lifted by hand.

use wasmtime::{Result, Store, TypedFunc, format_err};

use super::CoreFilter;
use super::abi::{Guest, Realloc, aligned, lower_str, pairs_at, slice, str_at};
use crate::bindings::{FailureKind, LocalReply, RequestLine, ResponseInfo, Verdict};
use crate::imports::StoreState;

type OnRequest = TypedFunc<(i32, i32, i32, i32, i32, i32, i32, i32, i32), i32>;
type OnResponse = TypedFunc<(i32, i32, i64, i32, i32, i32, i32), ()>;
type Configure = TypedFunc<(i32, i32), i32>;
type OnRequestHead = TypedFunc<i32, i32>;
type PostReturn = TypedFunc<i32, ()>;

/// How the request phase is entered.
enum RequestCall {
    /// `on-request(line, head)`: the line's strings lowered into the guest per call.
    Line(OnRequest, Option<PostReturn>),
    /// `on-request-head(head)` (0.1.3): the guest reads the line if it needs it.
    Head(OnRequestHead, Option<PostReturn>),
}

/// A core instance's exports, before they have their store.
struct Exports {
    on_request: RequestCall,
    on_response: Option<OnResponse>,
    configure: Option<(Configure, Option<PostReturn>)>,
}

impl Exports {
    fn with(self, store: Store<StoreState>) -> CoreCalls {
        CoreCalls {
            store,
            on_request: self.on_request,
            on_response: self.on_response,
            configure: self.configure,
        }
    }
}

/// A core instance and its exports.
pub(crate) struct CoreCalls {
    pub(crate) store: Store<StoreState>,
    on_request: RequestCall,
    on_response: Option<OnResponse>,
    configure: Option<(Configure, Option<PostReturn>)>,
}

impl CoreCalls {
    /// Instantiates `core` in `store` (armed by the caller) and runs `_initialize`
    /// if the module has one, as the component's instantiation would. On failure the
    /// store comes back, to tell why (its memory cap, say).
    pub(crate) fn new(
        core: &CoreFilter,
        mut store: Store<StoreState>,
    ) -> Result<Self, (Store<StoreState>, wasmtime::Error)> {
        match Self::exports(core, &mut store) {
            Ok(exports) => Ok(exports.with(store)),
            Err(e) => Err((store, e)),
        }
    }

    fn exports(core: &CoreFilter, store: &mut Store<StoreState>) -> Result<Exports> {
        let instance = core.pre.instantiate(&mut *store)?;
        let memory = instance
            .get_memory(&mut *store, "memory")
            .ok_or_else(|| format_err!("the module exports no memory"))?;
        let realloc: Realloc = instance.get_typed_func(&mut *store, "cabi_realloc")?;
        store.data_mut().core = Some(Guest {
            memory,
            realloc: Some(realloc),
            lent: false,
        });
        if core.initialize {
            instance
                .get_typed_func::<(), ()>(&mut *store, "_initialize")?
                .call(&mut *store, ())?;
        }
        let post = |store: &mut Store<StoreState>, name: &str| {
            instance.get_typed_func::<i32, ()>(store, name).ok()
        };
        let on_request = match core.on_request_head {
            true => RequestCall::Head(
                instance.get_typed_func(&mut *store, "on-request-head")?,
                post(&mut *store, "cabi_post_on-request-head"),
            ),
            false => RequestCall::Line(
                instance.get_typed_func(&mut *store, "on-request")?,
                post(&mut *store, "cabi_post_on-request"),
            ),
        };
        let on_response = match core.on_response {
            true => Some(instance.get_typed_func(&mut *store, "on-response")?),
            false => None,
        };
        let configure = match core.configure {
            true => Some((
                instance.get_typed_func(&mut *store, "configure")?,
                post(&mut *store, "cabi_post_configure"),
            )),
            false => None,
        };
        Ok(Exports {
            on_request,
            on_response,
            configure,
        })
    }

    /// `configure(config) -> result<_, string>`; `Ok(Ok(()))` for a filter without one.
    pub(crate) fn configure(&mut self, config: &str) -> Result<Result<(), String>> {
        let Some((configure, post)) = &self.configure else {
            return Ok(Ok(()));
        };
        let store = &mut self.store;
        let (p, l) = lower_str(store, config)?;
        let ret = configure.call(&mut *store, (p, l))?;
        let result = {
            let mem = memory(store)?.data(&*store);
            aligned(ret, 4)?;
            let area = slice(mem, ret, 12)?;
            match area[0] {
                0 => Ok(()),
                1 => Err(str_at(mem, i32_at(area, 4), i32_at(area, 8))?.to_owned()),
                v => return Err(format_err!("invalid result discriminant {v}")),
            }
        };
        if let Some(post) = post {
            post.call(&mut *store, ret)?;
        }
        Ok(result)
    }

    /// Whether the request phase takes the request line (`on-request`).
    pub(crate) fn takes_line(&self) -> bool {
        matches!(self.on_request, RequestCall::Line(..))
    }

    /// The request phase: `on-request-head(head)` when the module exports it, else
    /// `on-request(line, head)` (`line` must then be given); the head must be lent (in
    /// the store's data).
    pub(crate) fn on_request(&mut self, line: Option<&RequestLine>) -> Result<Verdict> {
        let store = &mut self.store;
        let (ret, post) = match &self.on_request {
            RequestCall::Head(call, post) => {
                lend(store);
                let ret = call.call(&mut *store, super::HEAD);
                (returned(store, ret)?, post)
            }
            RequestCall::Line(call, post) => {
                let line = line.ok_or_else(|| {
                    format_err!("on-request called without its line (a host bug)")
                })?;
                let (case, mp, ml) = match &line.method {
                    crate::bindings::dpumesh::filter::types::Method::Other(text) => {
                        let (p, l) = lower_str(store, text)?;
                        (9, p, l)
                    }
                    method => (i32::from(super::world::method_case(method)), 0, 0),
                };
                let scheme = line.scheme as i32;
                let (ap, al) = lower_str(store, &line.authority)?;
                let (pp, pl) = lower_str(store, &line.path)?;
                lend(store);
                let ret = call.call(
                    &mut *store,
                    (case, mp, ml, scheme, ap, al, pp, pl, super::HEAD),
                );
                (returned(store, ret)?, post)
            }
        };
        let verdict = verdict(memory(store)?.data(&*store), ret)?;
        if let Some(post) = post {
            post.call(&mut *store, ret)?;
        }
        Ok(verdict)
    }

    /// Whether the module has a response phase.
    pub(crate) fn has_response(&self) -> bool {
        self.on_response.is_some()
    }

    /// `on-response(head, info)`; the head must be lent.
    pub(crate) fn on_response(&mut self, info: &ResponseInfo) -> Result<()> {
        let Some(on_response) = &self.on_response else {
            return Ok(());
        };
        let store = &mut self.store;
        let (case, up, ul) = match &info.upstream {
            None => (0, 0, 0),
            Some(upstream) => {
                let (p, l) = lower_str(store, upstream)?;
                (1, p, l)
            }
        };
        let failure = failure_case(info.failure);
        lend(store);
        let result = on_response.call(
            &mut *store,
            (
                super::HEAD,
                i32::from(info.status),
                info.latency_ns as i64,
                case,
                up,
                ul,
                failure,
            ),
        );
        returned(store, result)
    }
}

/// The head's borrow goes to the guest with the call.
fn lend(store: &mut Store<StoreState>) {
    if let Some(guest) = store.data_mut().core.as_mut() {
        guest.lent = true;
    }
}

/// A call's result, after checking the guest gave the head's borrow back (the
/// component model traps a call that returns with a borrow still held).
fn returned<T>(store: &mut Store<StoreState>, result: Result<T>) -> Result<T> {
    let held = store
        .data_mut()
        .core
        .as_mut()
        .is_some_and(|g| std::mem::replace(&mut g.lent, false));
    let value = result?;
    if held {
        return Err(format_err!(
            "borrow handles still remain at the end of the call"
        ));
    }
    Ok(value)
}

fn memory(store: &Store<StoreState>) -> Result<wasmtime::Memory> {
    store
        .data()
        .core
        .as_ref()
        .map(|g| g.memory)
        .ok_or_else(|| format_err!("a core instance without its memory (a host bug)"))
}

fn i32_at(bytes: &[u8], at: usize) -> i32 {
    super::abi::i32_at(bytes, at)
}

fn failure_case(failure: FailureKind) -> i32 {
    match failure {
        FailureKind::None => 0,
        FailureKind::ConnectFailure => 1,
        FailureKind::UpstreamReset => 2,
        FailureKind::Timeout => 3,
        FailureKind::LocalReply => 4,
        FailureKind::Internal => 5,
    }
}

/// Lifts the `verdict` at `ret`: 24 bytes, align 4; a deny's reply at 4 (status at
/// 4, headers at 8, body at 16).
fn verdict(mem: &[u8], ret: i32) -> Result<Verdict> {
    aligned(ret, 4)?;
    let area = slice(mem, ret, 24)?;
    match area[0] {
        0 => Ok(Verdict::Continue),
        1 => {
            let status = u16::from_le_bytes([area[4], area[5]]);
            let headers = pairs_at(mem, i32_at(area, 8), i32_at(area, 12))?;
            let body = str_at(mem, i32_at(area, 16), i32_at(area, 20))?.to_owned();
            Ok(Verdict::Deny(LocalReply {
                status,
                headers,
                body,
            }))
        }
        v => Err(format_err!("invalid variant discriminant {v} for verdict")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deny_area() -> Vec<u8> {
        // The reply at 0..24, one header at 24..40, its strings and the body after.
        let mut mem = vec![0u8; 64];
        mem[0] = 1;
        mem[4..6].copy_from_slice(&403u16.to_le_bytes());
        mem[8..12].copy_from_slice(&24i32.to_le_bytes());
        mem[12..16].copy_from_slice(&1i32.to_le_bytes());
        mem[16..20].copy_from_slice(&48i32.to_le_bytes());
        mem[20..24].copy_from_slice(&2i32.to_le_bytes());
        mem[24..28].copy_from_slice(&40i32.to_le_bytes());
        mem[28..32].copy_from_slice(&1i32.to_le_bytes());
        mem[32..36].copy_from_slice(&41i32.to_le_bytes());
        mem[36..40].copy_from_slice(&1i32.to_le_bytes());
        mem[40] = b'a';
        mem[41] = b'b';
        mem[48..50].copy_from_slice(b"no");
        mem
    }

    #[test]
    fn a_deny_is_lifted_with_its_headers_and_body() {
        let verdict = verdict(&deny_area(), 0).unwrap();
        let Verdict::Deny(reply) = verdict else {
            panic!("expected a deny")
        };
        assert_eq!(reply.status, 403);
        assert_eq!(reply.headers, vec![("a".to_owned(), "b".to_owned())]);
        assert_eq!(reply.body, "no");
    }

    /// The error lifting a verdict at `at` of `mem` gives.
    fn error(mem: &[u8], at: i32) -> String {
        verdict(mem, at).unwrap_err().to_string()
    }

    #[test]
    fn a_malformed_verdict_is_an_error_not_a_panic() {
        let mut mem = deny_area();
        mem[0] = 7;
        assert!(error(&mem, 0).contains("discriminant"));
        let mut mem = deny_area();
        mem[12..16].copy_from_slice(&i32::MAX.to_le_bytes());
        assert!(error(&mem, 0).contains("out of bounds"));
        let mut mem = deny_area();
        mem[40] = 0xff;
        assert!(error(&mem, 0).contains("UTF-8"));
        assert!(error(&deny_area(), 2).contains("unaligned"));
        assert!(
            verdict(&deny_area(), 60).is_err(),
            "the area runs past memory"
        );
    }
}

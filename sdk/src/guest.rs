//! The Wasm glue: binds a [`Filter`] to the world's exports and the request-head
//! resource to [`HeadAccess`]. Thin on purpose: all policy lives in the filter.

use std::cell::RefCell;
use std::thread::LocalKey;

use crate::bindings::dpumesh::filter::types as wit;
use crate::pending::Pending;
use crate::{
    Claim, FailureKind, Filter, HeadAccess, HeaderError, LocalReply, Method, Peer, Request,
    RequestLine, ResponseInfo, Scheme, Verdict,
};

type Slot<F> = LocalKey<RefCell<Option<F>>>;

/// The head lent for one call. Metadata writes are kept here and sent in one host call
/// when the filter returns (reads see them meanwhile): filters such as JWT set a dozen
/// entries per request, and each crossing costs more than the write itself.
struct Head<'a> {
    head: &'a wit::RequestHead,
    metadata: RefCell<Pending>,
}

impl<'a> Head<'a> {
    fn new(head: &'a wit::RequestHead) -> Self {
        Self {
            head,
            metadata: RefCell::new(Pending::take()),
        }
    }

    /// Sends the pending metadata and counter increments.
    fn flush(self) {
        let metadata = self.metadata.into_inner();
        match metadata.entries() {
            [] => {}
            [(key, value)] => self.head.set_metadata(key, value),
            entries => self.head.set_metadata_batch(&borrowed(entries)),
        }
        metadata.give_back();
        crate::sys::flush_counters();
    }
}

/// Entries as the import takes them.
fn borrowed(entries: &[(String, String)]) -> Vec<(&str, &str)> {
    entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

fn header_error(e: wit::HeaderError) -> HeaderError {
    match e {
        wit::HeaderError::InvalidName => HeaderError::InvalidName,
        wit::HeaderError::InvalidValue => HeaderError::InvalidValue,
        wit::HeaderError::ReadOnly => HeaderError::ReadOnly,
    }
}

impl HeadAccess for Head<'_> {
    fn line(&self) -> RequestLine {
        RequestLine {
            method: HeadAccess::method(self),
            scheme: HeadAccess::scheme(self),
            authority: HeadAccess::authority(self),
            path: HeadAccess::path(self),
        }
    }

    fn method(&self) -> Method {
        method(self.head.method())
    }

    fn scheme(&self) -> Scheme {
        scheme(self.head.scheme())
    }

    fn authority(&self) -> String {
        self.head.authority()
    }

    fn path(&self) -> String {
        self.head.path()
    }

    fn query(&self) -> Option<String> {
        self.head.query()
    }

    fn header(&self, name: &str) -> Option<String> {
        self.head.header(name)
    }

    fn header_all(&self, name: &str) -> Vec<String> {
        self.head.header_all(name)
    }

    fn headers(&self, names: &[&str]) -> Vec<Option<String>> {
        self.head.headers(names)
    }

    fn header_names(&self) -> Vec<String> {
        self.head.header_names()
    }

    fn source(&self) -> Peer {
        let peer = self.head.source();
        Peer {
            address: peer.address,
            port: peer.port,
            identity: peer.identity,
        }
    }

    fn destination(&self) -> Option<String> {
        self.head.destination()
    }

    fn set_header(&self, name: &str, value: &str) -> Result<(), HeaderError> {
        self.head.set_header(name, value).map_err(header_error)
    }

    fn append_header(&self, name: &str, value: &str) -> Result<(), HeaderError> {
        self.head.append_header(name, value).map_err(header_error)
    }

    fn remove_header(&self, name: &str) -> Result<(), HeaderError> {
        self.head.remove_header(name).map_err(header_error)
    }

    fn metadata(&self, key: &str) -> Option<String> {
        match self.metadata.borrow().get(key) {
            Some(value) => Some(value.to_owned()),
            None => self.head.metadata(key),
        }
    }

    fn set_metadata(&self, key: &str, value: &str) {
        // Appended without looking for the key: the proxy applies entries in order
        // (the last one for a key wins) and reads look from the end, so a filter that
        // writes a dozen keys does not compare each with all before it.
        self.metadata.borrow_mut().push(key, value);
    }

    fn claims(&self, names: &[&str]) -> Option<Vec<Option<Claim>>> {
        send_pending_payload(self.head, self.metadata.borrow().entries());
        claims_from_proxy(self.head, names)
    }
}

/// If this call set the verified payload itself, sends a copy of the metadata set so
/// far now, in order, so the proxy parses the payload the filter wrote (reads see the
/// call's own writes) and the guest never parses JSON for claims. The entries stay
/// pending and are sent again when the call returns: applying them twice in the same
/// order leaves the same metadata, and reads keep seeing them where they look first.
pub(crate) fn send_pending_payload(head: &wit::RequestHead, pending: &[(String, String)]) {
    if pending
        .iter()
        .any(|(k, _)| k == dpumesh_claims::PAYLOAD_KEY)
    {
        head.set_metadata_batch(&borrowed(pending));
    }
}

/// The claims at `names`, from the payload the proxy keeps parsed.
pub(crate) fn claims_from_proxy(
    head: &wit::RequestHead,
    names: &[&str],
) -> Option<Vec<Option<Claim>>> {
    let claims = head.claims(names)?;
    Some(
        claims
            .into_iter()
            .map(|c| {
                c.map(|c| match c {
                    wit::Claim::Text(s) => Claim::Text(s),
                    wit::Claim::TextList(items) => Claim::TextList(items),
                    wit::Claim::Json(json) => Claim::Json(json),
                })
            })
            .collect(),
    )
}

fn method(m: wit::Method) -> Method {
    match m {
        wit::Method::Get => Method::Get,
        wit::Method::Head => Method::Head,
        wit::Method::Post => Method::Post,
        wit::Method::Put => Method::Put,
        wit::Method::Delete => Method::Delete,
        wit::Method::Connect => Method::Connect,
        wit::Method::Options => Method::Options,
        wit::Method::Trace => Method::Trace,
        wit::Method::Patch => Method::Patch,
        wit::Method::Other(name) => Method::Other(name),
    }
}

fn scheme(s: wit::Scheme) -> Scheme {
    match s {
        wit::Scheme::Http => Scheme::Http,
        wit::Scheme::Https => Scheme::Https,
    }
}

/// `configure` export: parse, build, keep.
pub fn configure<F: Filter>(slot: &'static Slot<F>, config: &str) -> Result<(), String> {
    let filter = crate::configure::<F>(config);
    crate::sys::flush_counters();
    let filter = filter?;
    slot.with(|cell| *cell.borrow_mut() = Some(filter));
    Ok(())
}

/// Builds the filter from an empty config when the host never called `configure`.
fn ensure_configured<F: Filter>(slot: &'static Slot<F>) -> Result<(), String> {
    if slot.with(|cell| cell.borrow().is_some()) {
        return Ok(());
    }
    configure(slot, "")
}

/// `on-request` export: the line handed in.
pub fn on_request<F: Filter>(
    slot: &'static Slot<F>,
    line: wit::RequestLine,
    head: &wit::RequestHead,
) -> wit::Verdict {
    let line = RequestLine {
        method: method(line.method),
        scheme: scheme(line.scheme),
        authority: line.authority,
        path: line.path,
    };
    request_phase(slot, head, |access| Request::with_line(line, access))
}

/// `on-request-head` export (0.1.3): the line read from the head on first use.
pub fn on_request_head<F: Filter>(slot: &'static Slot<F>, head: &wit::RequestHead) -> wit::Verdict {
    request_phase(slot, head, |access| Request::lazy(access))
}

fn request_phase<'h, F: Filter>(
    slot: &'static Slot<F>,
    head: &'h wit::RequestHead,
    request: impl for<'a> FnOnce(&'a Head<'h>) -> Request<'a>,
) -> wit::Verdict {
    if let Err(e) = ensure_configured(slot) {
        return deny(LocalReply::new(500).body(format!("filter is not configured: {e}")));
    }
    let access = Head::new(head);
    let request = request(&access);
    let verdict = slot.with(|cell| match cell.borrow_mut().as_mut() {
        Some(filter) => filter.on_request(&request),
        None => Verdict::Continue,
    });
    drop(request);
    access.flush();
    match verdict {
        Verdict::Continue => wit::Verdict::Continue,
        Verdict::Deny(reply) => deny(reply),
    }
}

fn deny(reply: LocalReply) -> wit::Verdict {
    wit::Verdict::Deny(wit::LocalReply {
        status: reply.status,
        headers: reply.headers,
        body: reply.body,
    })
}

thread_local! {
    /// What this instance's filter declared (asked once, by `interest`).
    static INTEREST: RefCell<crate::Interest> = RefCell::new(crate::Interest::default());
}

/// `interest` export: what the filter reads on every request, kept so that inputs
/// are read in the same order (names are matched case-insensitively on both sides).
pub fn interest<F: Filter>(slot: &'static Slot<F>) -> wit::Interest {
    if ensure_configured(slot).is_err() {
        return wit::Interest {
            headers: Vec::new(),
            metadata: Vec::new(),
        };
    }
    let interest = slot.with(|cell| cell.borrow().as_ref().map(F::interest).unwrap_or_default());
    INTEREST.with(|i| *i.borrow_mut() = interest.clone());
    wit::Interest {
        headers: interest.headers,
        metadata: interest.metadata,
    }
}

/// `handle-request` export: the batched call.
pub fn handle_request<F: Filter>(
    slot: &'static Slot<F>,
    head: &wit::RequestHead,
    input: &[u8],
) -> wit::Outcome {
    let outcome = |verdict: Verdict, edits, metadata| wit::Outcome {
        verdict: match verdict {
            Verdict::Continue => wit::Verdict::Continue,
            Verdict::Deny(reply) => deny(reply),
        },
        headers: edits,
        metadata,
        counters: crate::sys::take_counters(),
    };
    if let Err(e) = ensure_configured(slot) {
        let reply = LocalReply::new(500).body(format!("filter is not configured: {e}"));
        return outcome(reply.into(), Vec::new(), Vec::new());
    }
    INTEREST.with(|interest| {
        let interest = interest.borrow();
        let decoded =
            crate::input::Input::decode(input, interest.headers.len(), interest.metadata.len());
        let input = match decoded {
            Ok(input) => input,
            // A proxy speaking another encoding: say so rather than guess.
            Err(e) => {
                let reply = LocalReply::new(500).body(format!("filter input: {e}"));
                return outcome(reply.into(), Vec::new(), Vec::new());
            }
        };
        let access = crate::batched::BatchedHead::new(head, input, &interest);
        // The line is copied out of the input only if the filter reads it.
        let request = Request::lazy(&access);
        let verdict = slot.with(|cell| match cell.borrow_mut().as_mut() {
            Some(filter) => filter.on_request(&request),
            None => Verdict::Continue,
        });
        drop(request);
        let (edits, metadata) = access.finish();
        outcome(verdict, edits, metadata)
    })
}

/// `on-response` export.
pub fn on_response<F: Filter>(
    slot: &'static Slot<F>,
    head: &wit::RequestHead,
    info: wit::ResponseInfo,
) {
    let info = ResponseInfo {
        status: info.status,
        latency_ns: info.latency_ns,
        upstream: info.upstream,
        failure: match info.failure {
            wit::FailureKind::None => FailureKind::None,
            wit::FailureKind::ConnectFailure => FailureKind::ConnectFailure,
            wit::FailureKind::UpstreamReset => FailureKind::UpstreamReset,
            wit::FailureKind::Timeout => FailureKind::Timeout,
            wit::FailureKind::LocalReply => FailureKind::LocalReply,
            wit::FailureKind::Internal => FailureKind::Internal,
        },
    };
    let access = Head::new(head);
    let request = Request::lazy(&access);
    slot.with(|cell| {
        if let Some(filter) = cell.borrow_mut().as_mut() {
            filter.on_response(&request, &info);
        }
    });
    drop(request);
    access.flush();
}

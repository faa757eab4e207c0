//! Filters' HTTP calls (proxy-wasm `proxy_http_call`), made for the data plane by one
//! thread of their own while the calling request stays parked in its chain runner.
//!
//! A call is a network round trip of its own, so handing it to this thread (and its
//! answer back through the shard's inbox and bell) costs little against it, and keeps
//! connecting, HTTP framing and waiting off the shard, which goes on serving other
//! requests meanwhile. The thread starts with the first call: a node whose filters
//! make none pays nothing.
//!
//! Two kinds of upstream:
//! - **a mesh service**: the call goes over the fabric to a node that runs it, as a
//!   request from the ingress would (the service's route policy applies there), named
//!   by the service (`:authority` becomes the service; the filter's goes along as
//!   `x-forwarded-host`);
//! - **a configured upstream** (the policy file's `upstreams:`): HTTP/1.1 over TCP to
//!   its address, connections kept for reuse.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::thread::JoinHandle;

use bytes::Bytes;
use dpumesh_dpa::fabric::Fabric;
use dpumesh_head::{RequestHead, wire};
use dpumesh_runtime::{Callout, CalloutReply, callout::MAX_CALLOUT_BYTES};
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

/// Calls to mesh services in flight at once (each holds a request and a response
/// buffer of [`SLOT_SIZE`]).
const SLOTS: u32 = 64;
/// Largest body of a call's request or response to a mesh service.
const SLOT_SIZE: u64 = MAX_CALLOUT_BYTES as u64;
/// Idle connections kept per configured upstream.
const IDLE_PER_UPSTREAM: usize = 8;

/// Where a call goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// A configured upstream's `host:port`.
    Upstream(String),
    /// Mesh service `service`, through the proxy of node `node`.
    Mesh { node: SocketAddr, service: String },
}

/// What to do with the answer (called on the callout thread: it must be quick).
pub(crate) type Done = Box<dyn FnOnce(CalloutReply) + Send>;

struct Job {
    target: Target,
    callout: Callout,
    done: Done,
}

/// The callout thread.
pub(crate) struct Callouts {
    jobs: tokio::sync::mpsc::UnboundedSender<Job>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Callouts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Callouts").finish_non_exhaustive()
    }
}

impl Callouts {
    /// Starts the thread; calls to mesh services go out over `fabric` (its own links,
    /// with the node's identity).
    pub(crate) fn start<F: Fabric + Clone>(fabric: F) -> std::io::Result<Self> {
        let (jobs, mut incoming) = tokio::sync::mpsc::unbounded_channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("dpumesh-callout".to_owned())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        tracing::error!(error = %e, "the callout thread cannot start: filters' HTTP calls fail");
                        while let Some(job) = incoming.blocking_recv() {
                            (job.done)(failed("the proxy's callout thread could not start"));
                        }
                        return;
                    }
                };
                let local = tokio::task::LocalSet::new();
                local.block_on(&runtime, async move {
                    let health = Arc::new(dpumesh_fabric_client::health::Health::new([]));
                    let shard = match dpumesh_fabric_client::Client::new("callout", fabric, SLOTS, SLOT_SIZE, health) {
                        Ok(shard) => {
                            shard.spawn_pump();
                            Some(shard)
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "calls to mesh services are unavailable");
                            None
                        }
                    };
                    let pool = Rc::new(Pool::default());
                    while let Some(job) = incoming.recv().await {
                        let (shard, pool) = (shard.clone(), pool.clone());
                        tokio::task::spawn_local(async move {
                            let timeout = job.callout.timeout;
                            let call = perform(shard.as_deref(), &pool, &job.target, &job.callout);
                            let reply = match tokio::time::timeout(timeout, call).await {
                                Ok(Ok(reply)) => reply,
                                Ok(Err(reason)) => failed(&reason),
                                Err(_) => failed(&format!(
                                    "no answer within the call's {} ms",
                                    timeout.as_millis()
                                )),
                            };
                            (job.done)(reply);
                        });
                    }
                });
            })?;
        Ok(Self {
            jobs,
            thread: Some(thread),
        })
    }

    /// Makes `callout` to `target`; `done` gets the answer (or the failure) exactly
    /// once.
    pub(crate) fn submit(&self, target: Target, callout: Callout, done: Done) {
        if let Err(refused) = self.jobs.send(Job {
            target,
            callout,
            done,
        }) {
            (refused.0.done)(failed("the proxy's callout thread is gone"));
        }
    }
}

impl Drop for Callouts {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop; calls under way are dropped
        // with it (their requests are answered by their exchanges' timeouts).
        let (closed, _) = tokio::sync::mpsc::unbounded_channel();
        self.jobs = closed;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn failed(reason: &str) -> CalloutReply {
    CalloutReply::Failed {
        reason: reason.to_owned(),
    }
}

async fn perform<F: Fabric>(
    shard: Option<&dpumesh_fabric_client::Client<F>>,
    pool: &Pool,
    target: &Target,
    callout: &Callout,
) -> Result<CalloutReply, String> {
    match target {
        Target::Upstream(address) => upstream(pool, address, callout).await,
        Target::Mesh { node, service } => {
            let shard = shard.ok_or("calls to mesh services are unavailable on this node")?;
            mesh(shard, *node, service, callout).await
        }
    }
}

/// The call's request head for the mesh: its method and target, addressed to
/// `service`, with its headers (those HTTP cannot carry refused).
fn mesh_head(service: &str, callout: &Callout) -> Result<RequestHead, String> {
    let method = callout.header(":method").unwrap_or("GET");
    let mut head = RequestHead::new(method, callout.header(":path").unwrap_or("/"));
    head.authority = service.to_owned();
    for (name, value) in &callout.headers {
        // The body's framing is the proxy's to say (from the body it carries).
        let framing = ["content-length", "transfer-encoding"]
            .iter()
            .any(|f| name.eq_ignore_ascii_case(f));
        if name.starts_with(':') || framing {
            continue;
        }
        let value = std::str::from_utf8(value)
            .map_err(|_| format!("the value of header {name:?} is not UTF-8"))?;
        // As a client's request arrives at the ingress: what HTTP can carry.
        head.append_received(name, value)
            .map_err(|e| format!("header {name:?}: {e}"))?;
    }
    if let Some(authority) = callout.header(":authority")
        && authority != service
    {
        head.append_received("x-forwarded-host", authority)
            .map_err(|e| format!(":authority: {e}"))?;
    }
    if !callout.body.is_empty() {
        head.append_received("content-length", &callout.body.len().to_string())
            .map_err(|e| e.to_string())?;
    }
    Ok(head)
}

async fn mesh<F: Fabric>(
    shard: &dpumesh_fabric_client::Client<F>,
    node: SocketAddr,
    service: &str,
    callout: &Callout,
) -> Result<CalloutReply, String> {
    let head = mesh_head(service, callout)?;
    let bytes = wire::encode_request(&head).map_err(|e| format!("request head: {e}"))?;
    let slot = shard.acquire().await;
    if !callout.body.is_empty() {
        shard
            .write(&slot, 0, &callout.body)
            .map_err(|e| e.to_string())?;
    }
    // A call inside the mesh: the service's own chain, as a pod's call meets it.
    let flags = dpumesh_dpa::frame::RequestFlags {
        call: true,
        ..Default::default()
    };
    let answer = shard
        .call_with(
            node,
            slot,
            bytes,
            callout.body.len() as u32,
            callout.timeout,
            flags,
        )
        .await
        .map_err(|_| "the call was dropped by the fabric".to_owned())?
        .map_err(|e| e.to_string())?;
    if answer.stream.is_some() {
        // A filter's call takes its answer whole (dropping the body cancels it).
        return Err("the service streamed its answer; a filter's call takes answers whole".into());
    }
    let response =
        wire::decode_response(&answer.head).map_err(|e| format!("response head: {e}"))?;
    Ok(CalloutReply::Response {
        status: response.status,
        headers: response
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect(),
        body: answer.body.to_vec(),
    })
}

/// Idle HTTP/1.1 connections per configured upstream address.
#[derive(Default)]
struct Pool {
    idle: RefCell<HashMap<String, Vec<SendRequest<Full<Bytes>>>>>,
}

impl Pool {
    fn take(&self, address: &str) -> Option<SendRequest<Full<Bytes>>> {
        let mut idle = self.idle.borrow_mut();
        let list = idle.get_mut(address)?;
        while let Some(sender) = list.pop() {
            if !sender.is_closed() {
                return Some(sender);
            }
        }
        None
    }

    fn put(&self, address: &str, sender: SendRequest<Full<Bytes>>) {
        let mut idle = self.idle.borrow_mut();
        let list = idle.entry(address.to_owned()).or_default();
        if list.len() < IDLE_PER_UPSTREAM {
            list.push(sender);
        }
    }
}

async fn connect(address: &str) -> Result<SendRequest<Full<Bytes>>, String> {
    let stream = tokio::net::TcpStream::connect(address)
        .await
        .map_err(|e| format!("cannot connect to {address}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP handshake with {address}: {e}"))?;
    tokio::task::spawn_local(async move {
        // Ends when the peer closes or the last sender is dropped.
        let _ = connection.await;
    });
    Ok(sender)
}

fn upstream_request(callout: &Callout) -> Result<http::Request<Full<Bytes>>, String> {
    let mut builder = http::Request::builder()
        .method(callout.header(":method").unwrap_or("GET"))
        .uri(callout.header(":path").unwrap_or("/"));
    if let Some(authority) = callout.header(":authority") {
        builder = builder.header(http::header::HOST, authority);
    }
    for (name, value) in &callout.headers {
        if name.starts_with(':') || name.eq_ignore_ascii_case("host") {
            continue;
        }
        builder = builder.header(name.as_str(), value.as_slice());
    }
    builder
        .body(Full::new(Bytes::from(callout.body.clone())))
        .map_err(|e| format!("the call's request is not valid HTTP: {e}"))
}

async fn upstream(pool: &Pool, address: &str, callout: &Callout) -> Result<CalloutReply, String> {
    let request = upstream_request(callout)?;
    let mut sender = match pool.take(address) {
        Some(sender) => sender,
        None => connect(address).await?,
    };
    sender
        .ready()
        .await
        .map_err(|e| format!("connection to {address}: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("call to {address}: {e}"))?;
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect();
    let body = Limited::new(response.into_body(), MAX_CALLOUT_BYTES)
        .collect()
        .await
        .map_err(|e| format!("response body from {address}: {e}"))?
        .to_bytes()
        .to_vec();
    pool.put(address, sender);
    Ok(CalloutReply::Response {
        status,
        headers,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn call(headers: &[(&str, &str)], body: &[u8]) -> Callout {
        Callout {
            token: 1,
            upstream: "auth".into(),
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
                .collect(),
            body: body.to_vec(),
            timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn a_mesh_call_is_addressed_to_its_service() {
        let c = call(
            &[
                (":method", "POST"),
                (":path", "/check?x=1"),
                (":authority", "auth.example"),
                ("x-user", "ann"),
            ],
            b"{}",
        );
        let head = mesh_head("auth", &c).unwrap();
        assert_eq!(head.method, "POST");
        assert_eq!(head.path, "/check");
        assert_eq!(head.query.as_deref(), Some("x=1"));
        assert_eq!(head.authority, "auth");
        assert_eq!(
            head.header("x-forwarded-host").as_deref(),
            Some("auth.example")
        );
        assert_eq!(head.header("x-user").as_deref(), Some("ann"));
        assert_eq!(head.header("content-length").as_deref(), Some("2"));
    }

    #[test]
    fn a_header_http_cannot_carry_fails_the_call() {
        let c = call(&[(":path", "/"), ("bad header", "x")], b"");
        assert!(mesh_head("auth", &c).unwrap_err().contains("bad header"));
        assert!(upstream_request(&c).is_err());
    }

    #[tokio::test]
    async fn an_upstream_answers_over_a_kept_connection() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut s, _) = listener.accept().unwrap();
            for _ in 0..2 {
                let mut got = Vec::new();
                let mut buf = [0u8; 1024];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = s.read(&mut buf).unwrap();
                    got.extend_from_slice(&buf[..n]);
                }
                let text = String::from_utf8_lossy(&got).to_lowercase();
                assert!(text.starts_with("get /bytes/1 http/1.1"), "{text}");
                assert!(text.contains("host: httpbin.org"), "{text}");
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\nx-a: b\r\n\r\n\x02")
                    .unwrap();
            }
        });
        let pool = Pool::default();
        let c = call(
            &[
                (":method", "GET"),
                (":path", "/bytes/1"),
                (":authority", "httpbin.org"),
            ],
            b"",
        );
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                for _ in 0..2 {
                    let reply = upstream(&pool, &address, &c).await.unwrap();
                    let CalloutReply::Response {
                        status,
                        headers,
                        body,
                    } = reply
                    else {
                        panic!("failed")
                    };
                    assert_eq!(status, 200);
                    assert!(headers.iter().any(|(n, v)| n == "x-a" && v == b"b"));
                    assert_eq!(body, vec![2]);
                }
            })
            .await;
    }
}

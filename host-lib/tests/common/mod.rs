//! What the host library's integration tests share.

use std::time::Duration;

use dpumesh_host::memory::InMemoryTransport;
use dpumesh_host::{EventLoop, ExecutionContext, HttpRequest, HttpResponse, LoopConfig};

/// `n` milliseconds.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Runs one GET of `path` through a loop over `transport` until it is idle; returns
/// (virtual time of the answer, the answer, the loop).
pub fn serve(
    path: &str,
    transport: InMemoryTransport,
    handler: impl Fn(&mut ExecutionContext) + Send + Sync + 'static,
) -> (Duration, HttpResponse, EventLoop<InMemoryTransport>) {
    let mut event_loop = EventLoop::new(transport, handler, LoopConfig::default()).unwrap();
    let id = event_loop.transport().inject(HttpRequest::get(path));
    event_loop.run_until_idle().unwrap();
    let (at, response) = event_loop
        .transport()
        .response(id)
        .map(|(t, r)| (t, r.clone()))
        .expect("answered");
    (at, response, event_loop)
}

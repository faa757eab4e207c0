//! Seed 000's basic example: an internal step, then two calls in parallel.
//!
//! `cargo run -p dpumesh-host --example basic_parallel`

use dpumesh_host::memory::{InMemoryTransport, Reply};
use dpumesh_host::{EventLoop, ExecutionContext, HttpRequest, LoopConfig};

fn handler(ctx: &mut ExecutionContext) {
    // Step 1: CPU work on the thread pool.
    ctx.run_internal(|_| Ok::<_, String>("config processed"))
        .id("process");
    // Step 2: two egress calls at the same time.
    ctx.parallel(|ctx| {
        ctx.get("http://svc-a/api/v1");
        ctx.get("http://svc-b/api/v1");
    });
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let transport = InMemoryTransport::new()
        .service("svc-a", |_| Reply::ok_after(10, "a says hi"))
        .service("svc-b", |_| Reply::ok_after(20, "b says hi"));
    let mut service = EventLoop::new(transport, handler, LoopConfig::default())?;
    let id = service.transport().inject(HttpRequest::get("/api/v1"));
    service.run_until_idle()?;
    let (at, response) = service.transport().response(id).expect("answered");
    println!(
        "{} {:?} after {at:?} (virtual): the calls overlapped",
        response.status,
        response.text()
    );
    Ok(())
}

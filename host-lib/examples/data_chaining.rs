//! Seed 000's data chaining: a call's result is the input of the next step.
//!
//! `cargo run -p dpumesh-host --example data_chaining`

use dpumesh_host::memory::{InMemoryTransport, Reply};
use dpumesh_host::{EventLoop, ExecutionContext, HttpRequest, LoopConfig};

fn handler(ctx: &mut ExecutionContext) {
    let user = ctx.get("http://user-service/me").id("get_user").step_ref();
    ctx.run_internal(|inputs| Ok::<_, String>(format!("Hello, {}", inputs["get_user"].text())))
        .inputs([&user]);
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let transport =
        InMemoryTransport::new().service("user-service", |_| Reply::ok_after(10, "alice"));
    let mut service = EventLoop::new(transport, handler, LoopConfig::default())?;
    let id = service.transport().inject(HttpRequest::get("/chain"));
    service.run_until_idle()?;
    let (_, response) = service.transport().response(id).expect("answered");
    println!("{} {}", response.status, response.text());
    Ok(())
}

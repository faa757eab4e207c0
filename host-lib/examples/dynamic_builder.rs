//! Seed 000's dynamic request builder: the next call's target comes from an earlier
//! result.
//!
//! `cargo run -p dpumesh-host --example dynamic_builder`

use dpumesh_host::memory::{InMemoryTransport, Reply};
use dpumesh_host::{EventLoop, ExecutionContext, HttpRequest, LoopConfig};

fn handler(ctx: &mut ExecutionContext) {
    let config = ctx
        .get("http://config-service/target")
        .id("config_step")
        .step_ref();
    // The URL here is ignored: the builder's requests are what is sent.
    ctx.get("dummy")
        .inputs([&config])
        .request_builder(|inputs| {
            let target = inputs["config_step"].text().trim().to_owned();
            vec![HttpRequest::post(format!("http://{target}/api"), "data")]
        });
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let transport = InMemoryTransport::new()
        .service("config-service", |_| Reply::ok_after(5, "inventory"))
        .service("inventory", |r| {
            Reply::ok_after(
                7,
                format!("inventory got {:?}", String::from_utf8_lossy(&r.body)),
            )
        });
    let mut service = EventLoop::new(transport, handler, LoopConfig::default())?;
    let id = service.transport().inject(HttpRequest::get("/dynamic"));
    service.run_until_idle()?;
    let (at, response) = service.transport().response(id).expect("answered");
    println!("{} {} after {at:?}", response.status, response.text());
    Ok(())
}

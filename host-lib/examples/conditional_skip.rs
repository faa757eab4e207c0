//! Seed 000's conditional execution: a request builder that returns nothing skips
//! its step, and the graph goes on.
//!
//! `cargo run -p dpumesh-host --example conditional_skip`

use dpumesh_host::memory::{InMemoryTransport, Reply};
use dpumesh_host::{EventLoop, ExecutionContext, HttpRequest, LoopConfig};

fn handler(ctx: &mut ExecutionContext) {
    let flags = ctx.get("http://flags/beta").id("flags").step_ref();
    let beta = ctx
        .get("http://beta/")
        .id("beta")
        .inputs([&flags])
        .request_builder(|inputs| {
            if inputs["flags"].text() == "on" {
                vec![HttpRequest::get("http://beta/feature")]
            } else {
                vec![] // skip
            }
        })
        .step_ref();
    ctx.respond(|inputs| {
        let beta = &inputs["beta"];
        Ok::<_, String>(if beta.skipped {
            "beta is off".to_owned()
        } else {
            beta.text()
        })
    })
    .inputs([&beta]);
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for flag in ["on", "off"] {
        let transport = InMemoryTransport::new()
            .service("flags", move |_| Reply::ok_after(3, flag))
            .service("beta", |_| Reply::ok_after(4, "beta feature"));
        let mut service = EventLoop::new(transport, handler, LoopConfig::default())?;
        let id = service.transport().inject(HttpRequest::get("/"));
        service.run_until_idle()?;
        let (_, response) = service.transport().response(id).expect("answered");
        println!("flag {flag}: {}", response.text());
    }
    Ok(())
}

//! Seed 000's fan-out/fan-in with the low-level API: `order([pipe([...]), merge])`,
//! and a request builder fanning out to several shards inside a parallel block.
//!
//! `cargo run -p dpumesh-host --example fanout_fanin`

use dpumesh_host::memory::{InMemoryTransport, Reply};
use dpumesh_host::{
    EgressStep, EventLoop, ExecutionContext, HttpRequest, InternalStep, LoopConfig, order, pipe,
};

fn low_level(ctx: &mut ExecutionContext) {
    ctx.add(order([
        pipe([
            EgressStep::new("fetch_user", vec![HttpRequest::get("http://users/me")]).into(),
            EgressStep::new("fetch_order", vec![HttpRequest::get("http://orders/mine")]).into(),
        ]),
        InternalStep::new(
            "merge",
            vec!["fetch_user".into(), "fetch_order".into()],
            |inputs| {
                Ok::<_, String>(format!(
                    "{} has {}",
                    inputs["fetch_user"].text(),
                    inputs["fetch_order"].text()
                ))
            },
        )
        .into(),
    ]));
}

fn shards(ctx: &mut ExecutionContext) {
    ctx.parallel(|ctx| {
        ctx.get("x").id("shards").request_builder(|_| {
            (1..=4)
                .map(|n| HttpRequest::get(format!("http://shard/{n}")))
                .collect()
        });
    });
    ctx.respond(|inputs| {
        let parts: Vec<String> = inputs["shards"].parts.iter().map(|p| p.text()).collect();
        Ok::<_, String>(parts.join(" + "))
    })
    .inputs(["shards"]);
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let transport = InMemoryTransport::new()
        .service("users", |_| Reply::ok_after(15, "alice"))
        .service("orders", |_| Reply::ok_after(25, "3 orders"))
        .service("shard", |r| {
            Reply::ok_after(10, format!("shard{}", r.path_and_query()))
        });
    let mut service = EventLoop::new(transport, low_level, LoopConfig::default())?;
    let id = service.transport().inject(HttpRequest::get("/"));
    service.run_until_idle()?;
    let (at, response) = service.transport().response(id).expect("answered");
    println!("fan-out/fan-in: {} after {at:?}", response.text());

    let transport = InMemoryTransport::new().service("shard", |r| {
        Reply::ok_after(10, format!("shard{}", r.path_and_query()))
    });
    let mut service = EventLoop::new(transport, shards, LoopConfig::default())?;
    let id = service.transport().inject(HttpRequest::get("/"));
    service.run_until_idle()?;
    let (at, response) = service.transport().response(id).expect("answered");
    println!("4 shards at once: {} after {at:?}", response.text());
    Ok(())
}

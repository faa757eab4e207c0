//! Asynchronous steps and the tower adapter: a future waits without a thread, is
//! dropped when its step times out, and a `tower::Service` answers with trailers.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use dpumesh_head::whole_body::WholeBody;
use dpumesh_host::memory::InMemoryTransport;
use dpumesh_host::{EventLoop, HttpRequest, LoopConfig};
use http_body_util::BodyExt;
use parking_lot::Mutex;

mod common;
use common::ms;

/// Pending until opened.
#[derive(Clone, Default)]
struct Gate(Arc<Mutex<(bool, Option<Waker>)>>);

impl Gate {
    fn open(&self) {
        let mut g = self.0.lock();
        g.0 = true;
        if let Some(w) = g.1.take() {
            w.wake();
        }
    }
}

impl Future for Gate {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut g = self.0.lock();
        if g.0 {
            Poll::Ready(())
        } else {
            g.1 = Some(cx.waker().clone());
            Poll::Pending
        }
    }
}

/// Sets its flag when dropped.
struct Dropped(Arc<AtomicBool>);

impl Drop for Dropped {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn a_waiting_future_holds_no_thread_and_answers_when_woken() {
    let gate = Gate::default();
    let opener = gate.clone();
    // One pool thread, and it is never used: the waiting request holds nothing.
    let config = LoopConfig {
        threads: 1,
        ..LoopConfig::default()
    };
    let mut el = EventLoop::new(
        InMemoryTransport::new(),
        move |ctx| {
            if ctx.request().url == "/wait" {
                let gate = gate.clone();
                ctx.respond_future(move |_| async move {
                    gate.await;
                    Ok::<_, String>("waited")
                });
            } else {
                let opener = opener.clone();
                ctx.respond(move |_| {
                    opener.open();
                    Ok::<_, String>("opened")
                });
            }
        },
        config,
    )
    .unwrap();
    let wait = el.transport().inject(HttpRequest::get("/wait"));
    el.turn(Some(ms(0))).unwrap();
    assert_eq!(el.in_flight().0, 1, "the waiting request is in flight");
    let open = el.transport().inject(HttpRequest::get("/open"));
    el.run_until_idle().unwrap();
    let answers = el.transport().take_responses();
    let order: Vec<_> = answers.iter().map(|(id, _, r)| (*id, r.text())).collect();
    assert_eq!(
        order,
        [(open, "opened".to_owned()), (wait, "waited".to_owned())],
        "the second request was served while the first waited"
    );
    assert_eq!(el.stats().internal, 2);
    assert_eq!(el.in_flight(), (0, 0));
}

#[test]
fn a_future_whose_step_times_out_is_dropped() {
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = dropped.clone();
    let (_, response, el) = common::serve("/", InMemoryTransport::new(), move |ctx| {
        let guard = Dropped(flag.clone());
        ctx.run_future(move |_| async move {
            let _guard = guard;
            std::future::pending::<()>().await;
            Ok::<_, String>("never")
        })
        .timeout(ms(10));
    });
    assert_eq!(response.status, 504);
    assert!(
        dropped.load(Ordering::SeqCst),
        "the timed-out future was dropped"
    );
    assert_eq!(el.in_flight(), (0, 0));
}

/// Answers with the request's body and a trailer naming its own request trailer.
#[derive(Clone)]
struct Echo;

impl tower_service::Service<http::Request<dpumesh_host::body::RequestBody>> for Echo {
    type Response = http::Response<WholeBody>;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<dpumesh_host::body::RequestBody>) -> Self::Future {
        Box::pin(async move {
            let caller = request.extensions().get::<dpumesh_host::Caller>().cloned();
            assert!(caller.is_none(), "an injected request has no caller");
            let collected = request.into_body().collect().await.unwrap();
            let mut trailers = http::HeaderMap::new();
            let asked = collected
                .trailers()
                .and_then(|t| t.get("x-ask"))
                .cloned()
                .unwrap_or_else(|| http::HeaderValue::from_static("none"));
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            trailers.insert("x-asked", asked);
            Ok(http::Response::new(WholeBody::new(
                collected.to_bytes(),
                trailers,
            )))
        })
    }
}

#[test]
fn a_tower_service_answers_with_its_trailers_in_the_first_poll() {
    let mut el = EventLoop::new(
        InMemoryTransport::new(),
        dpumesh_host::tower::handler(Echo),
        LoopConfig::default(),
    )
    .unwrap();
    let mut request = HttpRequest::post("/echo", Bytes::from_static(b"hello"));
    request
        .trailers
        .insert("x-ask", http::HeaderValue::from_static("please"));
    let id = el.transport().inject(request);
    el.run_until_idle().unwrap();
    let (_, response) = el.transport().response(id).unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(response.body, "hello");
    assert_eq!(response.trailers["grpc-status"], "0");
    assert_eq!(response.trailers["x-asked"], "please");
}

//! The interop server: `grpc.testing.TestService` as gRPC's interop spec has it
//! behave, with the metadata echo its `custom_metadata` case checks
//! ([`EchoMetadata`]).

use std::collections::VecDeque;
use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::proto::test_service_server::TestService;
use crate::proto::{
    EchoStatus, Empty, Payload, ResponseParameters, SimpleRequest, SimpleResponse,
    StreamingInputCallRequest, StreamingInputCallResponse, StreamingOutputCallRequest,
    StreamingOutputCallResponse,
};

/// The largest payload one response is asked for (the interop cases ask at most
/// 314 159 bytes): a request for more is refused, not allocated.
const MAX_PAYLOAD: i32 = 4 << 20;

/// The service.
#[derive(Debug, Clone, Copy, Default)]
pub struct Interop;

/// A stream of responses, as tonic's generated trait wants it.
pub type Responses =
    Pin<Box<dyn Stream<Item = Result<StreamingOutputCallResponse, Status>> + Send>>;

fn payload(size: i32) -> Result<Payload, Status> {
    if !(0..=MAX_PAYLOAD).contains(&size) {
        return Err(Status::invalid_argument(format!(
            "a payload of {size} bytes is not served (0 to {MAX_PAYLOAD})"
        )));
    }
    Ok(Payload {
        r#type: 0,
        body: vec![0; size as usize],
    })
}

/// The status a request asks to be answered with, if any (code 0 is none).
fn asked(status: Option<&EchoStatus>) -> Option<Status> {
    status
        .filter(|s| s.code != 0)
        .map(|s| Status::new(tonic::Code::from_i32(s.code), s.message.clone()))
}

#[tonic::async_trait]
impl TestService for Interop {
    async fn empty_call(&self, _: Request<Empty>) -> Result<Response<Empty>, Status> {
        Ok(Response::new(Empty {}))
    }

    async fn unary_call(
        &self,
        request: Request<SimpleRequest>,
    ) -> Result<Response<SimpleResponse>, Status> {
        let request = request.into_inner();
        if let Some(status) = asked(request.response_status.as_ref()) {
            return Err(status);
        }
        Ok(Response::new(SimpleResponse {
            payload: Some(payload(request.response_size)?),
            ..Default::default()
        }))
    }

    type StreamingOutputCallStream = Responses;

    async fn streaming_output_call(
        &self,
        request: Request<StreamingOutputCallRequest>,
    ) -> Result<Response<Responses>, Status> {
        let input = tokio_stream::once(Ok(request.into_inner()));
        Ok(Response::new(Box::pin(Replies::new(Box::pin(input)))))
    }

    async fn streaming_input_call(
        &self,
        request: Request<Streaming<StreamingInputCallRequest>>,
    ) -> Result<Response<StreamingInputCallResponse>, Status> {
        let mut input = request.into_inner();
        let mut total = 0usize;
        while let Some(message) = input.next().await {
            total += message?.payload.map_or(0, |p| p.body.len());
        }
        Ok(Response::new(StreamingInputCallResponse {
            aggregated_payload_size: i32::try_from(total).unwrap_or(i32::MAX),
        }))
    }

    type FullDuplexCallStream = Responses;

    async fn full_duplex_call(
        &self,
        request: Request<Streaming<StreamingOutputCallRequest>>,
    ) -> Result<Response<Responses>, Status> {
        Ok(Response::new(Box::pin(Replies::new(Box::pin(
            request.into_inner(),
        )))))
    }

    type HalfDuplexCallStream = Responses;

    async fn half_duplex_call(
        &self,
        request: Request<Streaming<StreamingOutputCallRequest>>,
    ) -> Result<Response<Responses>, Status> {
        // All requests first, then all answers.
        let mut input = request.into_inner();
        let mut all = Vec::new();
        while let Some(message) = input.next().await {
            all.push(message);
        }
        let input = tokio_stream::iter(all);
        Ok(Response::new(Box::pin(Replies::new(Box::pin(input)))))
    }

    async fn unimplemented_call(&self, _: Request<Empty>) -> Result<Response<Empty>, Status> {
        Err(Status::unimplemented(
            "UnimplementedCall is not implemented",
        ))
    }
}

type Requests = Pin<Box<dyn Stream<Item = Result<StreamingOutputCallRequest, Status>> + Send>>;

/// The answers to a stream of `StreamingOutputCallRequest`s: for each, one response
/// per `response_parameters` (after its `interval_us`), or the status it asks for.
struct Replies {
    input: Option<Requests>,
    queue: VecDeque<ResponseParameters>,
    delay: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Replies {
    fn new(input: Requests) -> Self {
        Self {
            input: Some(input),
            queue: VecDeque::new(),
            delay: None,
        }
    }
}

impl Stream for Replies {
    type Item = Result<StreamingOutputCallResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(params) = self.queue.front() {
                let wait = Duration::from_micros(params.interval_us.max(0) as u64);
                if !wait.is_zero() {
                    let delay = self
                        .delay
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(wait)));
                    if delay.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.delay = None;
                }
                let params = self.queue.pop_front().expect("front above");
                return Poll::Ready(Some(
                    payload(params.size).map(|p| StreamingOutputCallResponse { payload: Some(p) }),
                ));
            }
            let Some(input) = self.input.as_mut() else {
                return Poll::Ready(None);
            };
            match input.as_mut().poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.input = None;
                }
                Poll::Ready(Some(Err(e))) => {
                    self.input = None;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(request))) => {
                    if let Some(status) = asked(request.response_status.as_ref()) {
                        self.input = None;
                        return Poll::Ready(Some(Err(status)));
                    }
                    self.queue.extend(request.response_parameters);
                }
            }
        }
    }
}

/// Echoes the metadata the `custom_metadata` case sends: `x-grpc-test-echo-initial`
/// back as a header, `x-grpc-test-echo-trailing-bin` back as a trailer.
#[derive(Debug, Clone)]
pub struct EchoMetadata<S>(pub S);

const ECHO_INITIAL: &str = "x-grpc-test-echo-initial";
const ECHO_TRAILING: &str = "x-grpc-test-echo-trailing-bin";

impl<S: tonic::server::NamedService> tonic::server::NamedService for EchoMetadata<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B, RB> tower_service::Service<http::Request<RB>> for EchoMetadata<S>
where
    S: tower_service::Service<http::Request<RB>, Response = http::Response<B>>,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
{
    type Response = http::Response<WithTrailer<B>>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<RB>) -> Self::Future {
        let initial = request.headers().get(ECHO_INITIAL).cloned();
        let trailing = request.headers().get(ECHO_TRAILING).cloned();
        let call = self.0.call(request);
        Box::pin(async move {
            let mut response = call.await?;
            if let Some(v) = initial {
                response.headers_mut().insert(ECHO_INITIAL, v);
            }
            Ok(response.map(|inner| WithTrailer {
                inner,
                trailer: trailing,
                done: false,
            }))
        })
    }
}

/// A body with one more trailer field: added to the body's trailers, or sent as the
/// trailers if it ends without any.
pub struct WithTrailer<B> {
    inner: B,
    trailer: Option<http::HeaderValue>,
    done: bool,
}

impl<B: Body<Data = Bytes> + Unpin> Body for WithTrailer<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                let frame = match frame.into_trailers() {
                    Ok(mut trailers) => {
                        if let Some(v) = this.trailer.take() {
                            trailers.insert(ECHO_TRAILING, v);
                        }
                        Frame::trailers(trailers)
                    }
                    Err(frame) => frame,
                };
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(this.trailer.take().map(|v| {
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert(ECHO_TRAILING, v);
                    Ok(Frame::trailers(trailers))
                }))
            }
        }
    }
}

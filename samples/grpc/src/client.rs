//! The interop client: gRPC's standard interop cases, each a function that says
//! what went wrong. They speak to a server (or a mesh ingress) through tonic.

use std::time::Duration;

use tokio::sync::mpsc::Sender;
use tokio_stream::StreamExt;
use tonic::metadata::{MetadataKey, MetadataValue};
use tonic::transport::Channel;
use tonic::{Code, Request, Streaming};

use crate::proto::test_service_client::TestServiceClient;
use crate::proto::{
    EchoStatus, Empty, Payload, ResponseParameters, SimpleRequest, StreamingInputCallRequest,
    StreamingOutputCallRequest, StreamingOutputCallResponse,
};

/// Every case, in the spec's order.
pub const CASES: [&str; 12] = [
    "empty_unary",
    "large_unary",
    "client_streaming",
    "server_streaming",
    "ping_pong",
    "empty_stream",
    "status_code_and_message",
    "custom_metadata",
    "unimplemented_method",
    "timeout_on_sleeping_server",
    "cancel_after_begin",
    "cancel_after_first_response",
];

/// Cases of the mesh's own, beside the interop suite: what a proxy in the middle
/// must answer in gRPC's terms.
///
/// - `unary_unavailable`: the server answers UNAVAILABLE (the mesh's gRPC retries
///   try it again, and the client still sees UNAVAILABLE);
/// - `oversized_request`: a 9 MiB message streams through the mesh (a request
///   body is no longer bounded by the ingress's `max_body` unless its route buffers)
///   and meets the server's own limit (tonic's 4 MiB): OUT_OF_RANGE, with tonic's
///   reason;
/// - `unauthenticated`: an empty call without a token is UNAUTHENTICATED (a filter's
///   denial as gRPC says it);
/// - `deadline_with_open_stream`: a duplex call whose request stream stays open past
///   its `grpc-timeout` (300 ms) is DEADLINE_EXCEEDED from the server's side (the
///   client does not keep the deadline itself here).
pub const MESH_CASES: [&str; 4] = [
    "unary_unavailable",
    "oversized_request",
    "unauthenticated",
    "deadline_with_open_stream",
];

/// How a case failed.
pub type Outcome = Result<(), String>;

/// A client of one server, adding `token` (as `authorization: Bearer`) to each call.
#[derive(Clone)]
pub struct Client {
    stub: TestServiceClient<Channel>,
    channel: Channel,
    server: String,
    authority: Option<String>,
    token: Option<String>,
}

fn zeros(n: usize) -> Option<Payload> {
    Some(Payload {
        r#type: 0,
        body: vec![0; n],
    })
}

fn size_of(payload: &Option<Payload>) -> usize {
    payload.as_ref().map_or(0, |p| p.body.len())
}

fn check(what: &str, ok: bool) -> Outcome {
    if ok { Ok(()) } else { Err(what.to_owned()) }
}

fn output_request(sizes: &[i32], payload: usize) -> StreamingOutputCallRequest {
    StreamingOutputCallRequest {
        response_parameters: sizes
            .iter()
            .map(|s| ResponseParameters {
                size: *s,
                ..Default::default()
            })
            .collect(),
        payload: zeros(payload),
        ..Default::default()
    }
}

impl Client {
    /// A client of `server` (`http://host:port`) that names `authority` in its calls
    /// (the mesh routes by it).
    pub async fn connect(
        server: &str,
        authority: Option<&str>,
        token: Option<String>,
    ) -> anyhow::Result<Self> {
        let mut endpoint = tonic::transport::Endpoint::from_shared(server.to_owned())?
            .connect_timeout(Duration::from_secs(5));
        if let Some(authority) = authority {
            endpoint = endpoint.origin(format!("http://{authority}").parse()?);
        }
        let channel = endpoint.connect().await?;
        Ok(Self {
            stub: TestServiceClient::new(channel.clone()),
            channel,
            server: server.to_owned(),
            authority: authority.map(str::to_owned),
            token,
        })
    }

    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        if let Some(token) = &self.token
            && let Ok(v) = format!("Bearer {token}").parse()
        {
            request.metadata_mut().insert("authorization", v);
        }
        request
    }

    /// Runs the case named `name`.
    pub async fn run(&mut self, name: &str) -> Outcome {
        let case = async {
            match name {
                "empty_unary" => self.empty_unary().await,
                "large_unary" => self.large_unary().await,
                "client_streaming" => self.client_streaming().await,
                "server_streaming" => self.server_streaming().await,
                "ping_pong" => self.ping_pong().await,
                "empty_stream" => self.empty_stream().await,
                "status_code_and_message" => self.status_code_and_message().await,
                "custom_metadata" => self.custom_metadata().await,
                "unimplemented_method" => self.unimplemented_method().await,
                "timeout_on_sleeping_server" => self.timeout_on_sleeping_server().await,
                "cancel_after_begin" => self.cancel_after_begin().await,
                "cancel_after_first_response" => self.cancel_after_first_response().await,
                "unary_unavailable" => self.expect(Code::Unavailable, 0, 14).await,
                "oversized_request" => self.expect(Code::OutOfRange, 9 << 20, 0).await,
                "unauthenticated" => self.expect(Code::Unauthenticated, 0, 0).await,
                "deadline_with_open_stream" => self.deadline_with_open_stream().await,
                other => Err(format!(
                    "no case {other:?} (one of {}, {})",
                    CASES.join(", "),
                    MESH_CASES.join(", ")
                )),
            }
        };
        tokio::time::timeout(Duration::from_secs(20), case)
            .await
            .unwrap_or_else(|_| Err("no answer within 20 s".into()))
    }

    /// A unary call with a `payload` of that many bytes, asking the server for status
    /// `ask` (0: none), must fail with `code`.
    async fn expect(&mut self, code: Code, payload: usize, ask: i32) -> Outcome {
        let r = self.request(SimpleRequest {
            payload: zeros(payload),
            response_status: (ask != 0).then(|| EchoStatus {
                code: ask,
                message: "asked for".into(),
            }),
            ..Default::default()
        });
        match self.stub.unary_call(r).await {
            Ok(_) => Err(format!("answered, not {code:?}")),
            Err(e) => check(&e.to_string(), e.code() == code),
        }
    }

    async fn empty_unary(&mut self) -> Outcome {
        let r = self.request(Empty {});
        self.stub.empty_call(r).await.map_err(|s| s.to_string())?;
        Ok(())
    }

    async fn large_unary(&mut self) -> Outcome {
        let r = self.request(SimpleRequest {
            response_size: 314_159,
            payload: zeros(271_828),
            ..Default::default()
        });
        let answer = self.stub.unary_call(r).await.map_err(|s| s.to_string())?;
        let size = size_of(&answer.into_inner().payload);
        check(
            &format!("payload of {size} bytes, not 314159"),
            size == 314_159,
        )
    }

    async fn client_streaming(&mut self) -> Outcome {
        let messages = [27_182, 8, 1_828, 45_904].map(|n| StreamingInputCallRequest {
            payload: zeros(n),
            ..Default::default()
        });
        let r = self.request(tokio_stream::iter(messages));
        let answer = self
            .stub
            .streaming_input_call(r)
            .await
            .map_err(|s| s.to_string())?
            .into_inner();
        check(
            &format!(
                "aggregated {} bytes, not 74922",
                answer.aggregated_payload_size
            ),
            answer.aggregated_payload_size == 74_922,
        )
    }

    async fn server_streaming(&mut self) -> Outcome {
        let sizes = [31_415, 9, 2_653, 58_979];
        let r = self.request(output_request(&sizes, 0));
        let mut stream = self
            .stub
            .streaming_output_call(r)
            .await
            .map_err(|s| s.to_string())?
            .into_inner();
        let mut got = Vec::new();
        while let Some(m) = stream.next().await {
            got.push(size_of(&m.map_err(|s| s.to_string())?.payload) as i32);
        }
        check(&format!("sizes {got:?}, not {sizes:?}"), got == sizes)
    }

    /// A duplex call whose request stream stays open (its sender), `first` sent.
    async fn open_duplex(
        &mut self,
        first: StreamingOutputCallRequest,
    ) -> Result<
        (
            Sender<StreamingOutputCallRequest>,
            Streaming<StreamingOutputCallResponse>,
        ),
        String,
    > {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let r = self.request(tokio_stream::wrappers::ReceiverStream::new(rx));
        tx.send(first).await.map_err(|_| "the call ended early")?;
        let stream = self
            .stub
            .full_duplex_call(r)
            .await
            .map_err(|s| s.to_string())?
            .into_inner();
        Ok((tx, stream))
    }

    async fn ping_pong(&mut self) -> Outcome {
        let pairs = [(31_415, 27_182), (9, 8), (2_653, 1_828), (58_979, 45_904)];
        let (tx, mut stream) = self
            .open_duplex(output_request(&[pairs[0].0], pairs[0].1))
            .await?;
        for (i, (size, _)) in pairs.iter().enumerate() {
            if i > 0 {
                tx.send(output_request(&[*size], pairs[i].1))
                    .await
                    .map_err(|_| "the call ended early")?;
            }
            let m = stream
                .next()
                .await
                .ok_or("the stream ended early")?
                .map_err(|s| s.to_string())?;
            let got = size_of(&m.payload);
            check(
                &format!("response {i}: {got} bytes, not {size}"),
                got == *size as usize,
            )?;
        }
        drop(tx);
        check("a response after the last", stream.next().await.is_none())
    }

    async fn empty_stream(&mut self) -> Outcome {
        let r = self.request(tokio_stream::empty::<StreamingOutputCallRequest>());
        let mut stream = self
            .stub
            .full_duplex_call(r)
            .await
            .map_err(|s| s.to_string())?
            .into_inner();
        check("a response to no request", stream.next().await.is_none())
    }

    async fn status_code_and_message(&mut self) -> Outcome {
        let message = "test status message";
        let status = Some(EchoStatus {
            code: 2,
            message: message.into(),
        });
        let r = self.request(SimpleRequest {
            response_status: status.clone(),
            ..Default::default()
        });
        let e = self
            .stub
            .unary_call(r)
            .await
            .err()
            .ok_or("unary: no error")?;
        check(
            &format!("unary: {e}"),
            e.code() == Code::Unknown && e.message() == message,
        )?;
        let r = self.request(tokio_stream::iter([StreamingOutputCallRequest {
            response_status: status,
            ..Default::default()
        }]));
        let outcome = duplex_failure(self.stub.clone(), r).await;
        let e = outcome.err().ok_or("duplex: no error")?;
        check(
            &format!("duplex: {e}"),
            e.code() == Code::Unknown && e.message() == message,
        )
    }

    async fn custom_metadata(&mut self) -> Outcome {
        let initial = "test_initial_metadata_value";
        let trailing = [0xab_u8, 0xab, 0xab];
        let mut r = self.request(SimpleRequest {
            response_size: 314_159,
            payload: zeros(271_828),
            ..Default::default()
        });
        r.metadata_mut().insert(
            "x-grpc-test-echo-initial",
            MetadataValue::from_static(initial),
        );
        r.metadata_mut().insert_bin(
            MetadataKey::from_static("x-grpc-test-echo-trailing-bin"),
            MetadataValue::from_bytes(&trailing),
        );
        // A unary call's trailers are read by calling the method on the raw client.
        let (metadata, trailers) = unary_metadata(self.channel.clone(), r).await?;
        check(
            &format!(
                "initial metadata {:?}",
                metadata.get("x-grpc-test-echo-initial")
            ),
            metadata
                .get("x-grpc-test-echo-initial")
                .is_some_and(|v| v == initial),
        )?;
        let echoed = trailers
            .get_bin("x-grpc-test-echo-trailing-bin")
            .and_then(|v| v.to_bytes().ok());
        check(
            &format!("trailing metadata {echoed:?}"),
            echoed.as_deref() == Some(&trailing[..]),
        )
    }

    async fn unimplemented_method(&mut self) -> Outcome {
        let r = self.request(Empty {});
        let e = self
            .stub
            .unimplemented_call(r)
            .await
            .err()
            .ok_or("no error")?;
        check(&e.to_string(), e.code() == Code::Unimplemented)
    }

    async fn timeout_on_sleeping_server(&mut self) -> Outcome {
        // The call's deadline travels as `grpc-timeout` (servers and the mesh bound the
        // call by it) and is kept here too, as every gRPC client keeps its own: tonic
        // does not, so its expiry is DEADLINE_EXCEEDED here, after a grace that lets a
        // server's or a proxy's own answer come first.
        let deadline = Duration::from_millis(1);
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let mut r = self.request(tokio_stream::wrappers::ReceiverStream::new(rx));
        r.set_timeout(deadline);
        let _ = tx.send(output_request(&[], 27_182)).await;
        let call = duplex_failure(self.stub.clone(), r);
        let outcome = tokio::time::timeout(deadline + Duration::from_secs(2), call)
            .await
            .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("the client's deadline")));
        drop(tx);
        let e = outcome.err().ok_or("no deadline error")?;
        // tonic's channel keeps `grpc-timeout` itself and reports its expiry as
        // CANCELLED (with `TimeoutExpired` as the cause); gRPC's spec calls a
        // client's own expired deadline DEADLINE_EXCEEDED.
        let own_deadline = e.code() == Code::Cancelled && caused_by::<tonic::TimeoutExpired>(&e);
        check(
            &e.to_string(),
            e.code() == Code::DeadlineExceeded || own_deadline,
        )
    }

    /// Over hyper's HTTP/2 client rather than tonic: tonic keeps a `grpc-timeout` it
    /// sends itself, even one set as a header, and this case is about who else does.
    async fn deadline_with_open_stream(&mut self) -> Outcome {
        use http_body_util::StreamBody;
        use hyper::body::Frame;

        let uri: http::Uri = self.server.parse().map_err(|e| format!("{e}"))?;
        let addr = uri.authority().ok_or("the server has no address")?.as_str();
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut send, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        let (tx, rx) =
            tokio::sync::mpsc::channel::<Result<Frame<bytes::Bytes>, std::convert::Infallible>>(1);
        let authority = self.authority.clone().unwrap_or_else(|| addr.to_owned());
        let mut request = http::Request::post(format!(
            "http://{authority}/grpc.testing.TestService/FullDuplexCall"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", "300m");
        if let Some(token) = &self.token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        let request = request
            .body(StreamBody::new(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            ))
            .map_err(|e| e.to_string())?;
        let message = prost::Message::encode_to_vec(&output_request(&[], 8));
        let mut framed = vec![0u8];
        framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
        framed.extend_from_slice(&message);
        let _ = tx.send(Ok(Frame::data(framed.into()))).await;
        // The request stream stays open (`tx` is held) until the answer.
        let response = tokio::time::timeout(Duration::from_secs(5), send.send_request(request))
            .await
            .map_err(|_| "no answer within 5 s: nothing kept the call's deadline")?
            .map_err(|e| e.to_string())?;
        // The status comes in the answer's head (trailers-only) or, once the
        // answer's stream began, in its trailers.
        let head_status = response
            .headers()
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let http_status = response.status();
        let status = match head_status {
            Some(s) => Some(s),
            None => {
                use http_body_util::BodyExt;
                let body = tokio::time::timeout(Duration::from_secs(5), response.into_body().collect())
                    .await
                    .map_err(|_| "the answer's stream did not end within 5 s: nothing kept the call's deadline")?
                    .map_err(|e| e.to_string())?;
                body.trailers()
                    .and_then(|t| t.get("grpc-status"))
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            }
        };
        drop(tx);
        check(
            &format!("answered {http_status} with grpc-status {status:?}"),
            status.as_deref() == Some("4"),
        )
    }

    async fn cancel_after_begin(&mut self) -> Outcome {
        // A call whose request stream never yields, given up at once: the client's
        // side says CANCELLED; the server's must carry on serving.
        let r = self.request(tokio_stream::pending::<StreamingInputCallRequest>());
        let mut stub = self.stub.clone();
        let call = tokio::spawn(async move { stub.streaming_input_call(r).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        call.abort();
        check(
            "the call finished before it was cancelled",
            call.await.is_err(),
        )?;
        self.empty_unary().await
    }

    async fn cancel_after_first_response(&mut self) -> Outcome {
        let (tx, mut stream) = self.open_duplex(output_request(&[31_415], 27_182)).await?;
        let first = stream
            .next()
            .await
            .ok_or("no first response")?
            .map_err(|s| s.to_string())?;
        check("first response size", size_of(&first.payload) == 31_415)?;
        // Cancelled: the stream and the request side dropped (RST_STREAM CANCEL).
        drop(stream);
        drop(tx);
        self.empty_unary().await
    }
}

/// The status a duplex call ends with before its first answer, if it fails: the
/// call's own error, or the first message's.
async fn duplex_failure<S>(
    mut stub: TestServiceClient<Channel>,
    request: Request<S>,
) -> Result<(), tonic::Status>
where
    S: tokio_stream::Stream<Item = StreamingOutputCallRequest> + Send + 'static,
{
    match stub
        .full_duplex_call(request)
        .await?
        .into_inner()
        .next()
        .await
    {
        Some(Err(e)) => Err(e),
        _ => Ok(()),
    }
}

/// Whether `e`'s chain of causes holds an `E`.
fn caused_by<E: std::error::Error + 'static>(e: &tonic::Status) -> bool {
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        if c.is::<E>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// A unary call's response headers and trailers (tonic's generated method returns the
/// message and headers only).
async fn unary_metadata(
    channel: Channel,
    request: Request<SimpleRequest>,
) -> Result<(tonic::metadata::MetadataMap, tonic::metadata::MetadataMap), String> {
    // As a one-message stream to a unary method, tonic's streaming call gives the
    // trailers: UnaryCall's path with the streaming codec.
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| e.to_string())?;
    let path = http::uri::PathAndQuery::from_static("/grpc.testing.TestService/UnaryCall");
    let codec = tonic_prost::ProstCodec::<SimpleRequest, crate::proto::SimpleResponse>::default();
    let response = grpc
        .server_streaming(request, path, codec)
        .await
        .map_err(|s| s.to_string())?;
    let metadata = response.metadata().clone();
    let mut stream = response.into_inner();
    while let Some(m) = stream.next().await {
        m.map_err(|s| s.to_string())?;
    }
    let trailers = stream
        .trailers()
        .await
        .map_err(|s| s.to_string())?
        .unwrap_or_default();
    Ok((metadata, trailers))
}

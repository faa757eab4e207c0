//! gRPC's interop test service on the mesh. The server is tonic's code for
//! `grpc.testing.TestService` ([`server::Interop`]); as a mesh pod the host library
//! serves it through its `tower::Service` adapter ([`dpumesh_host::tower`]), with no
//! socket; on TCP tonic's own transport does (the baseline the benchmarks compare
//! against). The client runs gRPC's interop cases ([`client::CASES`]).

pub mod client;
pub mod server;

/// The code generated from `proto/test.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("grpc.testing");
}

use proto::test_service_server::TestServiceServer;

/// The service as both servers run it: the interop methods behind the metadata echo.
pub fn service() -> server::EchoMetadata<TestServiceServer<server::Interop>> {
    server::EchoMetadata(TestServiceServer::new(server::Interop))
}

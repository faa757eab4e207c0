//! The files that configure a mesh, parsed into checked types: the proxy (policy) file
//! every node loads and hot-reloads — key sets, filters, chains, services, routes — and
//! the mesh file that says which nodes exist, where each service runs and how the
//! ingress behaves.
//!
//! Every error names the file, the key path and, where it can be found, the line
//! (`policy.yaml:15: chains.api[1]: no filter named "gaurd" under filters`). This crate
//! knows nothing of Wasm: the ingress routes with it without linking the filter
//! runtime.

#![forbid(unsafe_code)]

pub mod access_log;
pub mod error;
pub mod grpc_codes;
pub mod ingress_tls;
pub mod mesh_file;
pub mod pingmesh;
pub mod proxy;
mod route_index;
pub mod routes;
pub mod store;
pub mod units;

pub use access_log::AccessLogConfig;
pub use error::ConfigError;
pub use grpc_codes::GrpcCodes;
pub use ingress_tls::{ClientCerts, IngressTls, TlsVersion};
pub use mesh_file::{
    BridgeEntry, BridgeProtocol, EscapedSlashes, IdentityConfig, IngressConfig, MeshConfig,
    MeshFile, Mtls, NodeEntry, PathConfig, PollMode, PollingConfig, ServiceEntry, Transport,
};
pub use pingmesh::PingmeshConfig;
pub use proxy::{CacheConfig, FailurePolicy, LoadedConfig, ProxyConfig};
pub use routes::{RouteMatch, RoutePolicy, RouteTable, strip_port};
pub use store::{StoreBackend, StoreConfig};
pub use units::{ByteSize, Span};

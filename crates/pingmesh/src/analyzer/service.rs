//! The analyzer's faces: gRPC for the agents' uploads, HTTP JSON for operators and
//! the dashboard (served by [`crate::dashboard`]).

use std::sync::Arc;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Response, StatusCode};
use tonic::Status;

use super::Analyzer;
use crate::proto;

/// The analyzer's gRPC service.
#[derive(Debug, Clone)]
pub struct AnalyzerService {
    analyzer: Arc<Analyzer>,
    /// Served over TLS only: a request without a proven caller is refused.
    tls: bool,
}

impl AnalyzerService {
    pub fn new(analyzer: Arc<Analyzer>) -> Self {
        Self {
            analyzer,
            tls: false,
        }
    }

    /// Served over mutual TLS only.
    pub fn with_tls(mut self, tls: bool) -> Self {
        self.tls = tls;
        self
    }

    pub fn server(self) -> proto::analyzer_service_server::AnalyzerServiceServer<Self> {
        proto::analyzer_service_server::AnalyzerServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl proto::analyzer_service_server::AnalyzerService for AnalyzerService {
    async fn upload_data(
        &self,
        request: tonic::Request<proto::UploadDataRequest>,
    ) -> Result<tonic::Response<proto::UploadDataResponse>, Status> {
        crate::tls::authorize(&request, &request.get_ref().agent_id, self.tls)?;
        let accepted = self
            .analyzer
            .upload(request.get_ref())
            .map_err(|e| Status::invalid_argument(format!("invalid upload: {e}")))?;
        Ok(tonic::Response::new(proto::UploadDataResponse { accepted }))
    }
}

fn json(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("cache-control", "no-store")
        .body(Full::new(Bytes::from(body)))
        .expect("static headers")
}

fn error(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    json(status, serde_json::json!({ "error": message }).to_string())
}

/// Answers one request of the HTTP JSON API:
/// `GET /v1/report` (everything), `/v1/problems`, `/v1/heatmap`, `/v1/sla`,
/// `/v1/unreachable`, `/v1/agents`, `/v1/paths`.
pub fn answer(analyzer: &Analyzer, method: &Method, path: &str) -> Response<Full<Bytes>> {
    if method != Method::GET {
        return error(StatusCode::METHOD_NOT_ALLOWED, "only GET");
    }
    let report = analyzer.report();
    let body = match path {
        "/v1/report" => serde_json::to_value(&report),
        "/v1/problems" => serde_json::to_value(&report.problems),
        "/v1/heatmap" => serde_json::to_value(&report.heatmap),
        "/v1/sla" => Ok(serde_json::json!({
            "cluster": report.cluster,
            "services": report.services,
        })),
        "/v1/unreachable" => serde_json::to_value(&report.unreachable),
        "/v1/paths" => serde_json::to_value(&report.paths),
        "/v1/agents" => Ok(serde_json::json!({
            "agents": report.agents,
            "host_delays": report.host_delays,
        })),
        _ => return error(StatusCode::NOT_FOUND, "no such endpoint (see /v1/report)"),
    };
    match body {
        Ok(v) => json(StatusCode::OK, v.to_string()),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

//! The requests and responses steps exchange: method, URL, headers and body, on the
//! `http` crate's types.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};

use crate::body::BodyStream;

/// Who sent a request a service received, as the mesh says it: taken from the head
/// the node delivered, never from a header (`x-forwarded-for` is the client's word
/// and any earlier proxy's; this is the mesh's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The client's address as the ingress saw its connection; for a call from a pod
    /// of the mesh, the node's loopback (the identity says who called).
    pub addr: SocketAddr,
    /// The calling workload's identity (a SPIFFE ID) when a pod of the mesh called;
    /// `None` for a client from outside.
    pub identity: Option<String>,
    /// The scheme the request arrived with at the mesh's edge (`http` or `https`).
    pub scheme: String,
}

/// An HTTP request: what an egress step sends, and what a service receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpRequest {
    /// The method.
    pub method: Method,
    /// The URL (`http://service/path?query`; for received requests, the path).
    pub url: String,
    /// The headers.
    pub headers: HeaderMap,
    /// The body.
    pub body: Bytes,
    /// Trailer fields sent after the body (rare in requests); empty: none.
    pub trailers: HeaderMap,
    /// Who sent it, for a received request (the mesh's word); `None` on requests a
    /// service builds (its egress calls), where the node sets it.
    pub caller: Option<Caller>,
    /// The body as it arrives, for a received request whose body streams to a
    /// handler that reads bodies as they come (`LoopConfig::stream_requests`; `body`
    /// is then empty and the trailers come at the stream's end). Take it with
    /// [`BodyStream::take`] and read it as an `http_body::Body`. On a call, the rest
    /// of the body after `body`, sent as it is made (an upload of any size, a gRPC
    /// client stream; its trailers end it, `trailers` is then not sent).
    pub stream: Option<BodyStream>,
}

impl HttpRequest {
    /// A request with no headers and an empty body.
    pub fn new(method: Method, url: impl Into<String>) -> Self {
        Self {
            method,
            url: url.into(),
            headers: HeaderMap::new(),
            body: Bytes::new(),
            trailers: HeaderMap::new(),
            caller: None,
            stream: None,
        }
    }

    /// A GET.
    pub fn get(url: impl Into<String>) -> Self {
        Self::new(Method::GET, url)
    }

    /// A POST with a body.
    pub fn post(url: impl Into<String>, body: impl Into<Bytes>) -> Self {
        Self::new(Method::POST, url).body(body)
    }

    /// With a header (invalid names or values are ignored, as a builder cannot fail;
    /// use [`HttpRequest::try_header`] to be told).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        let _ = self.try_header(name, value);
        self
    }

    /// Adds a header, or says why it is not valid.
    pub fn try_header(&mut self, name: &str, value: &str) -> Result<(), http::Error> {
        let name = HeaderName::try_from(name)?;
        let value = HeaderValue::try_from(value)?;
        self.headers.append(name, value);
        Ok(())
    }

    /// With a body.
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    /// The URL's host (the service name for mesh calls), if it has one.
    pub fn host(&self) -> Option<String> {
        self.url
            .parse::<Uri>()
            .ok()
            .and_then(|u| u.host().map(str::to_owned))
    }

    /// The URL's path and query (`/` when it has none).
    pub fn path_and_query(&self) -> String {
        self.url
            .parse::<Uri>()
            .ok()
            .and_then(|u| u.path_and_query().map(|p| p.as_str().to_owned()))
            .unwrap_or_else(|| "/".to_owned())
    }

    /// A header's value as text.
    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// An HTTP response: what an egress step gets back, and what a service answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    /// The status code.
    pub status: u16,
    /// The headers.
    pub headers: HeaderMap,
    /// The body.
    pub body: Bytes,
    /// Trailer fields sent after the body (gRPC's `grpc-status`); empty: none.
    pub trailers: HeaderMap,
    /// The rest of the body, after `body`, as it is made (its trailers end it:
    /// `trailers` is then empty). A service's answer streams when it sets this; an
    /// egress call's answer comes with it only when the call asked to take
    /// streamed answers as they come ([`crate::AnswerBody::Streamed`]): a graph's
    /// calls get their answers whole.
    pub stream: Option<BodyStream>,
}

impl HttpResponse {
    /// A response with a status and a body.
    pub fn new(status: u16, body: impl Into<Bytes>) -> Self {
        Self {
            status,
            headers: HeaderMap::new(),
            body: body.into(),
            trailers: HeaderMap::new(),
            stream: None,
        }
    }

    /// A response whose body is sent as `body` makes it ([`crate::body`]).
    pub fn streaming<B>(status: u16, body: B) -> Self
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<crate::body::BoxError>,
    {
        Self {
            stream: Some(BodyStream::new(body)),
            ..Self::new(status, Bytes::new())
        }
    }

    /// 200 with a body.
    pub fn ok(body: impl Into<Bytes>) -> Self {
        Self::new(200, body)
    }

    /// With a header (invalid ones ignored).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        if let (Ok(n), Ok(v)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) {
            self.headers.append(n, v);
        }
        self
    }

    /// With a trailer field (invalid ones ignored).
    pub fn trailer(mut self, name: &str, value: &str) -> Self {
        if let (Ok(n), Ok(v)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) {
            self.trailers.append(n, v);
        }
        self
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// As an `http::Response` (for a proxy to forward): its body whole with its
    /// trailers, or, for an answer that streams, `body` first and then the rest as it
    /// comes. An invalid status is a 502.
    pub fn into_http(self) -> http::Response<crate::body::RequestBody> {
        use crate::body::RequestBody;
        let body = match self.stream.as_ref().and_then(BodyStream::take) {
            Some(rest) => {
                RequestBody::Stream(Box::pin(crate::body::Prefixed::new(self.body, rest)))
            }
            None => RequestBody::Whole(dpumesh_head::whole_body::WholeBody::new(
                self.body,
                self.trailers,
            )),
        };
        let mut response = http::Response::new(body);
        *response.status_mut() =
            http::StatusCode::from_u16(self.status).unwrap_or(http::StatusCode::BAD_GATEWAY);
        *response.headers_mut() = self.headers;
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_give_their_host_and_path() {
        let r = HttpRequest::get("http://user-service/me?x=1").header("x-a", "b");
        assert_eq!(r.host().as_deref(), Some("user-service"));
        assert_eq!(r.path_and_query(), "/me?x=1");
        assert_eq!(r.header_str("x-a"), Some("b"));
        assert_eq!(HttpRequest::get("/local").host(), None);
        let mut bad = HttpRequest::get("http://a/");
        assert!(bad.try_header("bad name", "v").is_err());
        assert!(bad.try_header("x", "bad\nvalue").is_err());
    }
}

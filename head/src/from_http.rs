//! A head from a request as an HTTP server library parsed it: what the ingress (and
//! the proxy's loopback listener) do once per request.

use std::net::SocketAddr;

use crate::{HOP_BY_HOP, Peer, RequestHead};

/// Why a parsed HTTP request cannot become a head.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FromRequestError {
    /// A header value holds bytes filters could not read as text (obs-text, controls).
    #[error("header {0} is not visible ASCII")]
    NotVisibleAscii(String),
}

impl RequestHead {
    /// The head of `req`, received from `peer`: method, target, the authority (from
    /// the URI, else `Host`) and every header field as received. The body is not
    /// looked at.
    pub fn from_request<B>(
        req: &http::Request<B>,
        peer: SocketAddr,
    ) -> Result<Self, FromRequestError> {
        let target = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
        let mut head = Self::new(req.method().as_str(), target);
        head.authority = req
            .uri()
            .authority()
            .map(|a| a.as_str().to_owned())
            .or_else(|| {
                req.headers()
                    .get(http::header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_owned)
            })
            .unwrap_or_default();
        head.source = Peer {
            addr: peer,
            identity: None,
        };
        let mut headers = http::HeaderMap::with_capacity(req.headers().len());
        for (name, value) in req.headers() {
            // The server library checked the bytes are legal in a field; filters also
            // need them readable as text.
            if value.to_str().is_err() {
                return Err(FromRequestError::NotVisibleAscii(name.as_str().to_owned()));
            }
            headers.append(name.clone(), value.clone());
        }
        head.set_headers(headers);
        Ok(head)
    }

    /// Drops the hop-by-hop and framing headers ([`HOP_BY_HOP`]): what a head keeps
    /// when it is forwarded with its body's exact length beside it.
    pub fn remove_hop_by_hop(&mut self) {
        for name in HOP_BY_HOP {
            self.headers.remove(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer() -> SocketAddr {
        "10.0.0.9:4242".parse().unwrap()
    }

    #[test]
    fn a_request_becomes_its_head() {
        let req = http::Request::builder()
            .method("POST")
            .uri("/items/7?verbose=1")
            .header("host", "api.example.com")
            .header("x-a", "1")
            .header("x-a", "2")
            .header("content-length", "3")
            .body(())
            .unwrap();
        let mut head = RequestHead::from_request(&req, peer()).unwrap();
        assert_eq!(head.method, "POST");
        assert_eq!(head.path, "/items/7");
        assert_eq!(head.query.as_deref(), Some("verbose=1"));
        assert_eq!(head.authority, "api.example.com");
        assert_eq!(head.source.addr, peer());
        assert_eq!(head.header_all("x-a"), ["1", "2"]);
        assert_eq!(head.header("content-length").as_deref(), Some("3"));
        head.remove_hop_by_hop();
        assert_eq!(head.header("content-length"), None);
        assert_eq!(head.header("host").as_deref(), Some("api.example.com"));
    }

    #[test]
    fn the_uri_authority_wins_over_host() {
        let req = http::Request::builder()
            .uri("http://a.example/x")
            .header("host", "b.example")
            .body(())
            .unwrap();
        let head = RequestHead::from_request(&req, peer()).unwrap();
        assert_eq!(head.authority, "a.example");
    }

    #[test]
    fn unreadable_header_bytes_are_named() {
        let req = http::Request::builder()
            .uri("/")
            .header("x-bin", http::HeaderValue::from_bytes(b"caf\xe9").unwrap())
            .body(())
            .unwrap();
        let e = RequestHead::from_request(&req, peer()).unwrap_err();
        assert_eq!(e.to_string(), "header x-bin is not visible ASCII");
    }
}

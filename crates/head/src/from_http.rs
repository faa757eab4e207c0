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
    /// the URI, else `Host`) and every header field as received, but `Host`: when the
    /// target carried an authority (absolute-form, HTTP/2's `:authority`), `Host` is
    /// replaced by it (RFC 9112 §3.2.2), so that routing, filters and the service read
    /// one host, never two. The body is not looked at.
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
        if let Some(authority) = req.uri().authority() {
            // The authority is a parsed `http::uri::Authority`: a valid header value.
            if let Ok(value) = http::HeaderValue::from_str(authority.as_str()) {
                headers.insert(http::header::HOST, value);
            }
        }
        head.set_headers(headers);
        Ok(head)
    }

    /// Removes what a client may not say for the mesh: every header whose name starts
    /// with [`crate::RESERVED_PREFIX`]. Returns how many fields went.
    pub fn remove_reserved(&mut self) -> usize {
        let reserved: Vec<http::HeaderName> = self
            .headers
            .keys()
            .filter(|k| k.as_str().starts_with(crate::RESERVED_PREFIX))
            .cloned()
            .collect();
        reserved
            .iter()
            .map(|name| {
                let n = self.headers.get_all(name).iter().count();
                self.headers.remove(name);
                n
            })
            .sum()
    }

    /// Records the hop from `client` (Envoy's `use_remote_address`): its address is
    /// appended to `x-forwarded-for` (what earlier proxies wrote stays before it, as
    /// they said it), and `x-forwarded-proto` says the scheme this hop served (a
    /// client's own value is replaced: a service must not believe `https` from it).
    pub fn forwarded_from(&mut self, client: SocketAddr) {
        const XFF: &str = "x-forwarded-for";
        let earlier: Vec<&str> = self
            .headers
            .get_all(XFF)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        let ip = client.ip().to_string();
        let value = if earlier.is_empty() {
            ip
        } else {
            format!("{}, {ip}", earlier.join(", "))
        };
        if let Ok(value) = http::HeaderValue::from_str(&value) {
            self.headers.insert(XFF, value);
        }
        if let Ok(scheme) = http::HeaderValue::from_str(&self.scheme) {
            self.headers.insert("x-forwarded-proto", scheme);
        }
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
        assert_eq!(
            head.header_all("host"),
            ["a.example"],
            "one host for routing, filters and the service (RFC 9112 §3.2.2)"
        );
    }

    #[test]
    fn a_clients_reserved_headers_are_removed_and_its_address_is_appended() {
        let req = http::Request::builder()
            .uri("/")
            .header("host", "h")
            .header("x-dpumesh-generation", "7")
            .header("X-Dpumesh-Circuit", "closed")
            .header("x-dpumesh-circuit", "open")
            .header("x-dpumeshy", "kept: not the prefix")
            .header("x-forwarded-for", "203.0.113.7")
            .header("x-forwarded-for", "198.51.100.2")
            .header("x-forwarded-proto", "https")
            .body(())
            .unwrap();
        let mut head = RequestHead::from_request(&req, peer()).unwrap();
        assert_eq!(head.remove_reserved(), 3);
        assert_eq!(head.header("x-dpumesh-generation"), None);
        assert_eq!(head.header("x-dpumesh-circuit"), None);
        assert!(head.header("x-dpumeshy").is_some());
        head.forwarded_from(peer());
        assert_eq!(
            head.header_all("x-forwarded-for"),
            ["203.0.113.7, 198.51.100.2, 10.0.0.9"]
        );
        assert_eq!(head.header_all("x-forwarded-proto"), ["http"]);
        let mut bare = RequestHead::new("GET", "/");
        bare.forwarded_from("[2001:db8::1]:80".parse().unwrap());
        assert_eq!(bare.header_all("x-forwarded-for"), ["2001:db8::1"]);
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

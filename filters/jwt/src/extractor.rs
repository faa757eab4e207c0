//! Finding the token: configured headers (with prefix), query parameters, cookies.

use dpumesh_filter_sdk::Request;

use crate::config::Provider;

/// Where a token was found (so it can be stripped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// In this header.
    Header(String),
    /// In a query parameter (cannot be stripped from the head).
    Param,
    /// In a cookie.
    Cookie,
}

/// The first token found in the provider's sources, in order: headers, parameters,
/// cookies.
pub fn extract(req: &Request<'_>, provider: &Provider) -> Option<(String, Location)> {
    for source in &provider.headers {
        let Some(value) = req.header(&source.name) else {
            continue;
        };
        let value = value.trim();
        let prefix = source.prefix.as_str();
        let token = if prefix.is_empty() {
            value
        } else if value.len() >= prefix.len() && value[..prefix.len()].eq_ignore_ascii_case(prefix)
        {
            value[prefix.len()..].trim_start()
        } else if value.len() + 1 == prefix.len() && prefix.trim_end().eq_ignore_ascii_case(value) {
            // "Bearer" with nothing after it: present but empty.
            ""
        } else {
            continue;
        };
        return Some((token.to_owned(), Location::Header(source.name.clone())));
    }
    for param in &provider.raw.from_params {
        if let Some(token) = req.query_param(param) {
            return Some((token, Location::Param));
        }
    }
    for cookie in &provider.raw.from_cookies {
        if let Some(token) = req.cookie(cookie) {
            return Some((token, Location::Cookie));
        }
    }
    None
}

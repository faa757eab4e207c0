//! What a shared cache may store and for how long (RFC 9111 §3, §4.2), how old a
//! stored response is (§4.2.3), and how conditional requests are answered from it
//! (RFC 9110 §13).

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue, header};

use crate::directives;

/// A route's cache settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// The largest body stored.
    pub max_object: u64,
    /// Freshness for a response that states none, if its status is cacheable by
    /// default (`None`: such responses are not stored).
    pub default_ttl: Option<Duration>,
}

/// Why a response is not stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotStored {
    /// Only GET responses are stored.
    Method,
    /// The request said `no-store`.
    RequestNoStore,
    Status(u16),
    NoStore,
    /// `private`: for one user's cache, not a shared one.
    Private,
    /// The request carried credentials and the response did not allow sharing it.
    Authorization,
    /// It sets a cookie (shared caches here never replay a `Set-Cookie`).
    SetCookie,
    /// `Vary: *`.
    VaryAny,
    /// No explicit freshness and no default.
    NoFreshness,
    /// Already stale with nothing to revalidate it by.
    NoValidator,
    TooLarge(u64),
}

impl NotStored {
    /// A label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Method => "method",
            Self::RequestNoStore => "request_no_store",
            Self::Status(_) => "status",
            Self::NoStore => "no_store",
            Self::Private => "private",
            Self::Authorization => "authorization",
            Self::SetCookie => "set_cookie",
            Self::VaryAny => "vary_any",
            Self::NoFreshness => "no_freshness",
            Self::NoValidator => "no_validator",
            Self::TooLarge(_) => "too_large",
        }
    }
}

/// Statuses a cache may store without explicit freshness (RFC 9110 §15.1).
fn cacheable_by_default(status: u16) -> bool {
    matches!(
        status,
        200 | 203 | 204 | 206 | 300 | 301 | 308 | 404 | 405 | 410 | 414 | 501
    )
}

/// Whether a response to a request may be stored, and its freshness lifetime.
pub fn storable(
    rule: &Rule,
    method: &str,
    request: &HeaderMap,
    status: u16,
    response: &HeaderMap,
    body_len: u64,
) -> Result<Duration, NotStored> {
    if method != "GET" {
        return Err(NotStored::Method);
    }
    if directives::parse(request).no_store {
        return Err(NotStored::RequestNoStore);
    }
    // Final statuses this cache understands; 206 needs range handling it lacks.
    if !(200..600).contains(&status) || status == 206 || status == 304 {
        return Err(NotStored::Status(status));
    }
    let d = directives::parse(response);
    if d.no_store {
        return Err(NotStored::NoStore);
    }
    if d.private {
        return Err(NotStored::Private);
    }
    if request.contains_key(header::AUTHORIZATION)
        && !(d.public || d.s_maxage.is_some() || d.must_revalidate)
    {
        return Err(NotStored::Authorization);
    }
    if response.contains_key(header::SET_COOKIE) {
        return Err(NotStored::SetCookie);
    }
    if vary_names(response).is_none() {
        return Err(NotStored::VaryAny);
    }
    if body_len > rule.max_object {
        return Err(NotStored::TooLarge(body_len));
    }
    let lifetime = lifetime(rule, status, response).ok_or(NotStored::NoFreshness)?;
    if lifetime.is_zero() && validators(response).is_empty() {
        return Err(NotStored::NoValidator);
    }
    Ok(lifetime)
}

/// A response's freshness lifetime for a shared cache (§4.2.1): `s-maxage`, else
/// `max-age`, else `Expires` − `Date`, else the route's default for statuses
/// cacheable by default; `None` when nothing gives one.
pub fn lifetime(rule: &Rule, status: u16, response: &HeaderMap) -> Option<Duration> {
    let d = directives::parse(response);
    if let Some(s) = d.s_maxage.or(d.max_age) {
        return Some(Duration::from_secs(s));
    }
    if let Some(expires) = header_date(response, header::EXPIRES) {
        let date = header_date(response, header::DATE).unwrap_or_else(SystemTime::now);
        return Some(expires.duration_since(date).unwrap_or(Duration::ZERO));
    }
    if response.contains_key(header::EXPIRES) {
        // An invalid Expires means already expired (§5.3).
        return Some(Duration::ZERO);
    }
    rule.default_ttl.filter(|_| cacheable_by_default(status))
}

/// The header names a response varies on, lower-case (`None` for `Vary: *`).
pub fn vary_names(response: &HeaderMap) -> Option<Vec<HeaderName>> {
    let mut names = Vec::new();
    for line in response.get_all(header::VARY) {
        for name in line.to_str().unwrap_or("").split(',') {
            let name = name.trim();
            if name == "*" {
                return None;
            }
            if let Ok(n) = HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes())
                && !names.contains(&n)
            {
                names.push(n);
            }
        }
    }
    Some(names)
}

/// A request's values of `names`, each line joined with ", " (what `Vary` compares).
pub fn vary_values(request: &HeaderMap, names: &[HeaderName]) -> Vec<Option<String>> {
    names
        .iter()
        .map(|n| {
            let values: Vec<&str> = request
                .get_all(n)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .map(str::trim)
                .collect();
            (!values.is_empty()).then(|| values.join(", "))
        })
        .collect()
}

fn header_date(headers: &HeaderMap, name: HeaderName) -> Option<SystemTime> {
    httpdate::parse_http_date(headers.get(name)?.to_str().ok()?).ok()
}

/// The age a response had when received (§4.2.3's `corrected_initial_age`).
pub fn initial_age(
    response: &HeaderMap,
    request_time: SystemTime,
    response_time: SystemTime,
) -> Duration {
    let apparent = header_date(response, header::DATE)
        .and_then(|date| response_time.duration_since(date).ok())
        .unwrap_or(Duration::ZERO);
    let age_value = response
        .get(header::AGE)
        .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
        .map_or(Duration::ZERO, Duration::from_secs);
    let delay = response_time
        .duration_since(request_time)
        .unwrap_or(Duration::ZERO);
    apparent.max(age_value + delay)
}

/// A response's validators: its `ETag` and `Last-Modified`, as the conditional
/// request headers that revalidate it (`If-None-Match`, `If-Modified-Since`).
pub fn validators(response: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    let mut v = Vec::new();
    if let Some(etag) = response.get(header::ETAG) {
        v.push((header::IF_NONE_MATCH, etag.clone()));
    }
    if let Some(modified) = response.get(header::LAST_MODIFIED) {
        v.push((header::IF_MODIFIED_SINCE, modified.clone()));
    }
    v
}

/// Whether a conditional request is answered `304 Not Modified` by a stored
/// response with `stored` headers (RFC 9110 §13.2.2: `If-None-Match` first, weak
/// comparison; else `If-Modified-Since` against `Last-Modified`).
pub fn not_modified(request: &HeaderMap, stored: &HeaderMap) -> bool {
    let inm: Vec<&str> = request
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect();
    if !inm.is_empty() {
        let Some(etag) = stored.get(header::ETAG).and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let weak = |t: &str| t.trim_start_matches("W/").to_owned();
        return inm.iter().any(|t| *t == "*" || weak(t) == weak(etag));
    }
    match (
        header_date(request, header::IF_MODIFIED_SINCE),
        header_date(stored, header::LAST_MODIFIED),
    ) {
        (Some(since), Some(modified)) => modified <= since,
        _ => false,
    }
}

/// Whether a request carries its own conditions.
pub fn is_conditional(request: &HeaderMap) -> bool {
    request.contains_key(header::IF_NONE_MATCH) || request.contains_key(header::IF_MODIFIED_SINCE)
}

/// Headers not stored with a response (hop-by-hop, RFC 9110 §7.6.1).
pub fn storable_headers(response: &HeaderMap) -> HeaderMap {
    let mut kept = response.clone();
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::TE,
        header::TRAILER,
        header::UPGRADE,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::AGE,
    ] {
        kept.remove(name);
    }
    kept.remove("keep-alive");
    kept
}

/// A stored response's headers updated by a `304`'s (RFC 9111 §3.2): each field the
/// 304 carries replaces the stored one, except the framing.
pub fn refreshed_headers(stored: &HeaderMap, not_modified: &HeaderMap) -> HeaderMap {
    let mut headers = stored.clone();
    let fresh = storable_headers(not_modified);
    for name in fresh.keys() {
        if name == header::CONTENT_LENGTH || name == header::CONTENT_TYPE {
            continue;
        }
        headers.remove(name);
        for v in fresh.get_all(name) {
            headers.append(name.clone(), v.clone());
        }
    }
    headers
}

/// The headers of a `304` made from a stored response (RFC 9110 §15.4.5).
pub fn not_modified_headers(stored: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in [
        header::CACHE_CONTROL,
        header::CONTENT_LOCATION,
        header::DATE,
        header::ETAG,
        header::EXPIRES,
        header::VARY,
        header::LAST_MODIFIED,
    ] {
        for v in stored.get_all(&name) {
            out.append(name.clone(), v.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests;

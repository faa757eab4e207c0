//! `Cache-Control` (RFC 9111 §5.2): the directives a shared cache acts on, from every
//! `Cache-Control` field line of a request or response.

use http::HeaderMap;

/// The directives that matter here. Unknown directives are ignored (§5.2.3).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Directives {
    pub no_store: bool,
    /// Also set by the qualified form `no-cache="field"` (treated as unqualified).
    pub no_cache: bool,
    /// Also set by `private="field"` (treated as unqualified: not stored).
    pub private: bool,
    pub public: bool,
    pub must_revalidate: bool,
    pub proxy_revalidate: bool,
    /// Seconds; an invalid value counts as 0 (§4.2.1: stale).
    pub max_age: Option<u64>,
    pub s_maxage: Option<u64>,
    /// Request: the most staleness accepted (`None` inside: any).
    pub max_stale: Option<Option<u64>>,
    /// Request: fresh for at least this much longer.
    pub min_fresh: Option<u64>,
    pub only_if_cached: bool,
}

/// Parses every `Cache-Control` line of `headers`.
pub fn parse(headers: &HeaderMap) -> Directives {
    let mut d = Directives::default();
    for line in headers.get_all(http::header::CACHE_CONTROL) {
        let Ok(line) = line.to_str() else { continue };
        for item in split(line) {
            let (name, value) = match item.split_once('=') {
                Some((n, v)) => (n.trim(), Some(v.trim().trim_matches('"'))),
                None => (item.trim(), None),
            };
            let seconds = || value.map_or(0, |v| v.parse::<u64>().unwrap_or(0));
            match name.to_ascii_lowercase().as_str() {
                "no-store" => d.no_store = true,
                "no-cache" => d.no_cache = true,
                "private" => d.private = true,
                "public" => d.public = true,
                "must-revalidate" => d.must_revalidate = true,
                "proxy-revalidate" => d.proxy_revalidate = true,
                "max-age" => d.max_age = Some(seconds()),
                "s-maxage" => d.s_maxage = Some(seconds()),
                "max-stale" => d.max_stale = Some(value.and_then(|v| v.parse().ok())),
                "min-fresh" => d.min_fresh = Some(seconds()),
                "only-if-cached" => d.only_if_cached = true,
                _ => {}
            }
        }
    }
    d
}

/// Splits on commas outside quoted strings.
fn split(line: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in line.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                items.push(&line[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&line[start..]);
    items.into_iter().filter(|s| !s.trim().is_empty()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(lines: &[&str]) -> Directives {
        let mut h = HeaderMap::new();
        for l in lines {
            h.append(http::header::CACHE_CONTROL, l.parse().unwrap());
        }
        parse(&h)
    }

    #[test]
    fn directives_from_every_line_in_any_case() {
        let d = of(&["public, Max-Age=60", "s-maxage=\"120\""]);
        assert!(d.public);
        assert_eq!((d.max_age, d.s_maxage), (Some(60), Some(120)));
        let d = of(&["private=\"set-cookie, x-a\", no-cache"]);
        assert!(d.private && d.no_cache);
        assert!(of(&["no-store"]).no_store);
        // An invalid age is stale, not forever.
        assert_eq!(of(&["max-age=soon"]).max_age, Some(0));
        assert_eq!(of(&["max-stale"]).max_stale, Some(None));
        assert_eq!(of(&["max-stale=5, min-fresh=3"]).max_stale, Some(Some(5)));
        assert_eq!(of(&[]), Directives::default());
    }
}

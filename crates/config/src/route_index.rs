//! Finding a request's route among many without looking at each: the first route in
//! config order whose host and path prefix match, as a scan would find it.
//!
//! Routes are grouped by host pattern (exact hosts in a map, `*.suffix` patterns and
//! any-host routes apart). In a group, each distinct prefix maps to its first route,
//! and a path is looked up once per distinct prefix length no longer than it: a
//! policy of 50 000 routes whose prefixes have a dozen lengths costs a dozen map
//! lookups a request, where the scan compared up to 50 000 prefixes. The first match
//! overall is the least route number among the groups' matches.

use std::borrow::Cow;
use std::collections::HashMap;

/// One group's prefixes.
#[derive(Debug, Clone, Default)]
struct Prefixes {
    /// Prefix → the first route with it.
    first: HashMap<Box<str>, u32>,
    /// The prefixes' distinct lengths, ascending.
    lengths: Vec<usize>,
}

impl Prefixes {
    fn add(&mut self, prefix: &str, route: u32) {
        self.first.entry(prefix.into()).or_insert(route);
        if let Err(at) = self.lengths.binary_search(&prefix.len()) {
            self.lengths.insert(at, prefix.len());
        }
    }

    /// The first route whose prefix starts `path`.
    fn find(&self, path: &str) -> Option<u32> {
        let mut best: Option<u32> = None;
        for &len in &self.lengths {
            // A prefix is whole characters: a length inside one cannot match.
            let Some(head) = path.get(..len) else {
                if len > path.len() {
                    break;
                }
                continue;
            };
            if let Some(&route) = self.first.get(head) {
                best = Some(best.map_or(route, |b| b.min(route)));
            }
        }
        best
    }
}

/// The route numbers of a table by host pattern.
#[derive(Debug, Clone, Default)]
pub(crate) struct RouteIndex {
    /// Lowercased exact hosts.
    exact: HashMap<Box<str>, Prefixes>,
    /// Lowercased suffixes of `*.example.com` patterns (`.example.com`); few in a
    /// policy, looked at in turn.
    suffixes: Vec<(Box<str>, Prefixes)>,
    any: Prefixes,
}

/// A route's host pattern as the index keeps it.
pub(crate) enum HostKey<'a> {
    Any,
    Exact(&'a str),
    Suffix(&'a str),
}

impl RouteIndex {
    /// Adds route number `route` (routes are added in config order).
    pub(crate) fn add(&mut self, host: HostKey<'_>, prefix: &str, route: u32) {
        let group = match host {
            HostKey::Any => &mut self.any,
            HostKey::Exact(h) => self.exact.entry(h.into()).or_default(),
            HostKey::Suffix(s) => match self.suffixes.iter().position(|(k, _)| **k == *s) {
                Some(i) => &mut self.suffixes[i].1,
                None => {
                    self.suffixes.push((s.into(), Prefixes::default()));
                    &mut self.suffixes.last_mut().expect("just pushed").1
                }
            },
        };
        group.add(prefix, route);
    }

    /// The first route for `host` (without its port) and `path`.
    pub(crate) fn find(&self, host: &str, path: &str) -> Option<u32> {
        let host: Cow<'_, str> = if host.bytes().any(|b| b.is_ascii_uppercase()) {
            Cow::Owned(host.to_ascii_lowercase())
        } else {
            Cow::Borrowed(host)
        };
        let mut best = self.any.find(path);
        let mut better = |found: Option<u32>| {
            if let Some(r) = found {
                best = Some(best.map_or(r, |b| b.min(r)));
            }
        };
        if let Some(group) = self.exact.get(host.as_ref()) {
            better(group.find(path));
        }
        for (suffix, group) in &self.suffixes {
            // A subdomain, not the apex.
            if host.len() > suffix.len() && host.ends_with(suffix.as_ref()) {
                better(group.find(path));
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_route_number_among_matching_prefixes_wins() {
        let mut p = Prefixes::default();
        for (number, prefix) in ["/x", "/api/v1", "/api", "/", "/api"].iter().enumerate() {
            p.add(prefix, number as u32);
        }
        assert_eq!(p.find("/api/v1/x"), Some(1), "the longer prefix came first");
        assert_eq!(p.find("/api/x"), Some(2), "the first /api route");
        assert_eq!(p.find("/ap"), Some(3));
        assert_eq!(p.find(""), None);
        assert_eq!(p.lengths, vec![1, 2, 4, 7]);
    }

    #[test]
    fn a_path_with_multibyte_characters_is_looked_up_at_character_boundaries() {
        let mut p = Prefixes::default();
        p.add("/é", 0);
        p.add("/éa", 1);
        assert_eq!(p.find("/éa"), Some(0));
        assert_eq!(p.find("/e"), None);
        // Length 2 falls inside `é` (bytes 1..3): skipped, not a panic.
        let mut q = Prefixes::default();
        q.add("/x", 0);
        assert_eq!(q.find("/é"), None);
    }
}

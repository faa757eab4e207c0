//! Matchers: permissions (what is asked) and principals (who asks), as raw config
//! types checked into compiled matchers with pure `matches` functions.

use std::net::IpAddr;

use regex_lite::Regex;
use serde::Deserialize;

use dpumesh_filter_sdk::Claim;

use crate::RequestView;

/// How a string is matched.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum RawStringMatch {
    /// Equal.
    Exact(String),
    /// Starts with.
    Prefix(String),
    /// Ends with.
    Suffix(String),
    /// Shell-style glob: `*` any run of characters, `?` one character.
    Glob(String),
    /// Regular expression (whole value; linear time).
    Regex(String),
}

/// A compiled string matcher.
#[derive(Debug, Clone)]
pub enum StringMatch {
    /// Equal.
    Exact(String),
    /// Starts with.
    Prefix(String),
    /// Ends with.
    Suffix(String),
    /// Glob pattern.
    Glob(String),
    /// Anchored regex.
    Regex(Regex),
}

impl StringMatch {
    fn compile(raw: RawStringMatch) -> Result<Self, String> {
        Ok(match raw {
            RawStringMatch::Exact(s) => Self::Exact(s),
            RawStringMatch::Prefix(s) => Self::Prefix(s),
            RawStringMatch::Suffix(s) => Self::Suffix(s),
            RawStringMatch::Glob(s) => Self::Glob(s),
            RawStringMatch::Regex(r) => {
                if r.len() > 1024 {
                    return Err("regex longer than 1024 bytes".to_owned());
                }
                Self::Regex(
                    Regex::new(&format!("^(?:{r})$")).map_err(|e| format!("regex {r:?}: {e}"))?,
                )
            }
        })
    }

    /// Whether `value` matches.
    pub fn matches(&self, value: &str) -> bool {
        match self {
            Self::Exact(s) => value == s,
            Self::Prefix(s) => value.starts_with(s.as_str()),
            Self::Suffix(s) => value.ends_with(s.as_str()),
            Self::Glob(p) => glob(p.as_bytes(), value.as_bytes()),
            Self::Regex(r) => r.is_match(value),
        }
    }
}

/// Iterative glob matching with single-star backtracking: linear in practice, no
/// recursion on hostile input.
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && (pattern[p] == b'?' || pattern[p] == text[t]) {
            p += 1;
            t += 1;
        } else if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// A header condition.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHeaderMatch {
    /// Header name.
    pub name: String,
    /// Present with any value (the default when no value matcher is given), or absent
    /// with `false`.
    #[serde(default)]
    pub present: Option<bool>,
    /// The value equals this.
    #[serde(default)]
    pub exact: Option<String>,
    /// The value starts with this.
    #[serde(default)]
    pub prefix: Option<String>,
    /// The value ends with this.
    #[serde(default)]
    pub suffix: Option<String>,
    /// The value matches this glob.
    #[serde(default)]
    pub glob: Option<String>,
    /// The value matches this regex (whole value).
    #[serde(default)]
    pub regex: Option<String>,
}

impl RawHeaderMatch {
    fn value(&self) -> Result<Option<RawStringMatch>, String> {
        let given: Vec<RawStringMatch> = [
            self.exact.clone().map(RawStringMatch::Exact),
            self.prefix.clone().map(RawStringMatch::Prefix),
            self.suffix.clone().map(RawStringMatch::Suffix),
            self.glob.clone().map(RawStringMatch::Glob),
            self.regex.clone().map(RawStringMatch::Regex),
        ]
        .into_iter()
        .flatten()
        .collect();
        match given.len() {
            0 => Ok(None),
            1 => Ok(given.into_iter().next()),
            _ => Err(format!(
                "header {}: give one of exact, prefix, suffix, glob, regex",
                self.name
            )),
        }
    }
}

/// What is being asked for.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum RawPermission {
    /// Anything.
    Any(bool),
    /// Method (case-sensitive, as HTTP).
    Method(String),
    /// Path (without the query).
    Path(RawStringMatch),
    Header(RawHeaderMatch),
    /// The destination service.
    Destination(RawStringMatch),
    /// All of these.
    And(Vec<RawPermission>),
    /// Any of these.
    Or(Vec<RawPermission>),
    Not(Box<RawPermission>),
}

/// Who is asking: a claim condition.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClaimMatch {
    /// Claim name; `a.b` walks into objects.
    pub name: String,
    /// The claim is this string.
    #[serde(default)]
    pub equals: Option<String>,
    /// The claim is one of these strings.
    #[serde(default, rename = "in")]
    pub one_of: Option<Vec<String>>,
    /// The claim is an array containing this string (e.g. `roles` contains `admin`),
    /// or a space-separated string containing it as a word (OAuth `scope`).
    #[serde(default)]
    pub contains: Option<String>,
}

/// Who is asking.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum RawPrincipal {
    /// Anyone.
    Any(bool),
    /// A request with a verified JWT (metadata `jwt.payload`).
    Authenticated(bool),
    /// A verified JWT claim.
    Claim(RawClaimMatch),
    /// Source address in a CIDR block (`10.0.0.0/8`, `fd00::/8`, or one address).
    SourceIp(String),
    /// Source workload identity (e.g. a SPIFFE id).
    Identity(RawStringMatch),
    Header(RawHeaderMatch),
    /// All of these.
    And(Vec<RawPrincipal>),
    /// Any of these.
    Or(Vec<RawPrincipal>),
    Not(Box<RawPrincipal>),
}

/// A compiled header matcher.
#[derive(Debug, Clone)]
pub struct HeaderMatch {
    name: String,
    present: bool,
    value: Option<StringMatch>,
}

impl HeaderMatch {
    fn compile(raw: RawHeaderMatch) -> Result<Self, String> {
        if raw.name.is_empty() {
            return Err("header matcher needs a name".to_owned());
        }
        let value = raw.value()?;
        if raw.present == Some(false) && value.is_some() {
            return Err(format!(
                "header {}: present: false cannot have a value matcher",
                raw.name
            ));
        }
        Ok(Self {
            present: raw.present.unwrap_or(true),
            value: value.map(StringMatch::compile).transpose()?,
            name: raw.name,
        })
    }

    /// Present (with a matching value) when any value of a repeated header is; absent
    /// when it has none. A DENY rule is not dodged by sending a decoy value first, nor
    /// an ALLOW rule's value hidden behind another.
    fn matches(&self, req: &dyn RequestView) -> bool {
        let values = req.header_all(&self.name);
        match &self.value {
            _ if values.is_empty() => !self.present,
            None => self.present,
            Some(m) => values.iter().any(|v| m.matches(v)),
        }
    }
}

/// A CIDR block.
#[derive(Debug, Clone, Copy)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `a.b.c.d/n`, `x::y/n` or a plain address.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{text:?} is not an IP address or CIDR"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{text:?}: prefix must be 0-{max}"))?,
            None => max,
        };
        Ok(Self { addr, prefix })
    }

    /// Whether `ip` is inside the block.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let bits = |ip: IpAddr| -> Option<u128> {
            match (self.addr, ip) {
                (IpAddr::V4(_), IpAddr::V4(v)) => Some(u128::from(u32::from(v)) << 96),
                (IpAddr::V6(_), IpAddr::V6(v)) => Some(u128::from(v)),
                (IpAddr::V6(_), IpAddr::V4(v)) => Some(u128::from(v.to_ipv6_mapped())),
                (IpAddr::V4(_), IpAddr::V6(v)) => {
                    v.to_ipv4_mapped().map(|v| u128::from(u32::from(v)) << 96)
                }
            }
        };
        let (Some(a), Some(b)) = (bits(self.addr), bits(ip)) else {
            return false;
        };
        // IPv4 addresses sit in the top 32 bits, so the prefix counts from the top.
        let prefix = u32::from(self.prefix);
        if prefix == 0 {
            return true;
        }
        let mask = u128::MAX << (128 - prefix);
        a & mask == b & mask
    }
}

/// A compiled permission.
#[derive(Debug, Clone)]
pub enum Permission {
    /// Anything.
    Any,
    Method(String),
    Path(StringMatch),
    Header(HeaderMatch),
    Destination(StringMatch),
    /// All.
    And(Vec<Permission>),
    /// Any.
    Or(Vec<Permission>),
    Not(Box<Permission>),
}

/// What a policy reads of a request beyond its line, source and destination (which
/// come with every call): headers by name. Claims are asked of the proxy, which keeps
/// them parsed (see [`ClaimPaths`]).
#[derive(Debug, Default)]
pub struct Reads {
    pub headers: Vec<String>,
}

impl Permission {
    /// Adds what this permission reads to `reads`.
    pub fn reads(&self, reads: &mut Reads) {
        match self {
            Self::Header(h) => reads.headers.push(h.name.to_ascii_lowercase()),
            Self::And(v) | Self::Or(v) => v.iter().for_each(|p| p.reads(reads)),
            Self::Not(p) => p.reads(reads),
            Self::Any | Self::Method(_) | Self::Path(_) | Self::Destination(_) => {}
        }
    }

    /// Compiles a raw permission.
    pub fn compile(raw: RawPermission) -> Result<Self, String> {
        Ok(match raw {
            RawPermission::Any(true) => Self::Any,
            RawPermission::Any(false) => {
                return Err("any: false matches nothing; remove it".to_owned());
            }
            RawPermission::Method(m) => Self::Method(m),
            RawPermission::Path(m) => Self::Path(StringMatch::compile(m)?),
            RawPermission::Header(h) => Self::Header(HeaderMatch::compile(h)?),
            RawPermission::Destination(m) => Self::Destination(StringMatch::compile(m)?),
            RawPermission::And(v) => {
                Self::And(v.into_iter().map(Self::compile).collect::<Result<_, _>>()?)
            }
            RawPermission::Or(v) => {
                Self::Or(v.into_iter().map(Self::compile).collect::<Result<_, _>>()?)
            }
            RawPermission::Not(p) => Self::Not(Box::new(Self::compile(*p)?)),
        })
    }

    /// Whether the request asks for this.
    pub fn matches(&self, req: &dyn RequestView) -> bool {
        match self {
            Self::Any => true,
            Self::Method(m) => req.method() == m,
            Self::Path(m) => m.matches(req.path()),
            Self::Header(h) => h.matches(req),
            Self::Destination(m) => req.destination().is_some_and(|d| m.matches(&d)),
            Self::And(v) => v.iter().all(|p| p.matches(req)),
            Self::Or(v) => v.iter().any(|p| p.matches(req)),
            Self::Not(p) => !p.matches(req),
        }
    }
}

/// A compiled claim matcher.
#[derive(Debug, Clone)]
pub struct ClaimMatch {
    /// Where its claim is in the list the engine asks for (see [`ClaimPaths`]).
    index: usize,
    equals: Option<String>,
    one_of: Option<Vec<String>>,
    contains: Option<String>,
}

impl ClaimMatch {
    fn matches(&self, claims: &[Option<Claim>]) -> bool {
        let Some(Some(claim)) = claims.get(self.index) else {
            return false;
        };
        let as_str = claim.as_text();
        self.equals
            .as_ref()
            .is_none_or(|e| as_str == Some(e.as_str()))
            && self
                .one_of
                .as_ref()
                .is_none_or(|set| as_str.is_some_and(|s| set.iter().any(|x| x == s)))
            && self
                .contains
                .as_ref()
                .is_none_or(|needle| contains(claim, needle))
    }
}

/// Whether a claim holds `needle`: an array with it as an item, or a space-separated
/// string with it as a word (OAuth `scope`).
fn contains(claim: &Claim, needle: &str) -> bool {
    match claim {
        Claim::TextList(items) => items.iter().any(|i| i == needle),
        Claim::Text(s) => s.split(' ').any(|w| w == needle),
        // An array with items other than strings (rare): its string items count.
        Claim::Json(json) => match serde_json::from_str::<serde_json::Value>(json) {
            Ok(serde_json::Value::Array(items)) => items.iter().any(|i| i.as_str() == Some(needle)),
            _ => false,
        },
    }
}

/// The claim names a configuration's principals read, each once, in the order first
/// named: the engine asks the proxy for all of them in one call.
#[derive(Debug, Clone, Default)]
pub struct ClaimPaths(Vec<String>);

impl ClaimPaths {
    fn index(&mut self, name: String) -> usize {
        match self.0.iter().position(|n| *n == name) {
            Some(i) => i,
            None => {
                self.0.push(name);
                self.0.len() - 1
            }
        }
    }

    /// The names, in index order.
    pub fn names(&self) -> Vec<&str> {
        self.0.iter().map(String::as_str).collect()
    }
}

/// A compiled principal.
#[derive(Debug, Clone)]
pub enum Principal {
    /// Anyone.
    Any,
    /// Verified token present.
    Authenticated,
    Claim(ClaimMatch),
    /// Source CIDR.
    SourceIp(Cidr),
    Identity(StringMatch),
    Header(HeaderMatch),
    /// All.
    And(Vec<Principal>),
    /// Any.
    Or(Vec<Principal>),
    Not(Box<Principal>),
}

impl Principal {
    /// Adds what this principal reads to `reads`.
    pub fn reads(&self, reads: &mut Reads) {
        match self {
            Self::Header(h) => reads.headers.push(h.name.to_ascii_lowercase()),
            Self::Authenticated | Self::Claim(_) => {}
            Self::And(v) | Self::Or(v) => v.iter().for_each(|p| p.reads(reads)),
            Self::Not(p) => p.reads(reads),
            Self::Any | Self::SourceIp(_) | Self::Identity(_) => {}
        }
    }

    /// Compiles a raw principal, registering the claims it reads in `paths`.
    pub fn compile(raw: RawPrincipal, paths: &mut ClaimPaths) -> Result<Self, String> {
        let mut all = |v: Vec<RawPrincipal>| -> Result<Vec<Self>, String> {
            v.into_iter().map(|p| Self::compile(p, paths)).collect()
        };
        Ok(match raw {
            RawPrincipal::Any(true) => Self::Any,
            RawPrincipal::Any(false) => {
                return Err("any: false matches nobody; remove it".to_owned());
            }
            RawPrincipal::Authenticated(true) => Self::Authenticated,
            RawPrincipal::Authenticated(false) => Self::Not(Box::new(Self::Authenticated)),
            RawPrincipal::Claim(c) => {
                if c.equals.is_none() && c.one_of.is_none() && c.contains.is_none() {
                    return Err(format!("claim {}: give equals, in or contains", c.name));
                }
                Self::Claim(ClaimMatch {
                    index: paths.index(c.name),
                    equals: c.equals,
                    one_of: c.one_of,
                    contains: c.contains,
                })
            }
            RawPrincipal::SourceIp(c) => Self::SourceIp(Cidr::parse(&c)?),
            RawPrincipal::Identity(m) => Self::Identity(StringMatch::compile(m)?),
            RawPrincipal::Header(h) => Self::Header(HeaderMatch::compile(h)?),
            RawPrincipal::And(v) => Self::And(all(v)?),
            RawPrincipal::Or(v) => Self::Or(all(v)?),
            RawPrincipal::Not(p) => Self::Not(Box::new(Self::compile(*p, paths)?)),
        })
    }

    /// Whether the requester is this principal.
    pub fn matches(&self, req: &dyn RequestView) -> bool {
        match self {
            Self::Any => true,
            Self::Authenticated => req.claims().is_some(),
            Self::Claim(c) => req.claims().is_some_and(|claims| c.matches(claims)),
            Self::SourceIp(cidr) => req.source_ip().is_some_and(|ip| cidr.contains(ip)),
            Self::Identity(m) => req.identity().is_some_and(|id| m.matches(&id)),
            Self::Header(h) => h.matches(req),
            Self::And(v) => v.iter().all(|p| p.matches(req)),
            Self::Or(v) => v.iter().any(|p| p.matches(req)),
            Self::Not(p) => !p.matches(req),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob(b"/api/*/items", b"/api/v1/items"));
        assert!(glob(b"*.json", b"/a/b.json"));
        assert!(glob(b"/a?c", b"/abc"));
        assert!(!glob(b"/a?c", b"/abbc"));
        assert!(glob(b"*", b""));
        assert!(!glob(b"/api/*", b"/other"));
        // Hostile: many stars against a long non-matching text stays fast.
        let text = "a".repeat(10_000);
        assert!(!glob(b"*a*a*a*a*a*b", text.as_bytes()));
    }

    #[test]
    fn cidrs() {
        let net = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(net.contains("10.255.1.2".parse().unwrap()));
        assert!(!net.contains("11.0.0.1".parse().unwrap()));
        assert!(net.contains("::ffff:10.1.1.1".parse().unwrap()));
        assert!(
            Cidr::parse("fd00::/8")
                .unwrap()
                .contains("fd12::1".parse().unwrap())
        );
        assert!(
            Cidr::parse("0.0.0.0/0")
                .unwrap()
                .contains("1.2.3.4".parse().unwrap())
        );
        assert!(
            Cidr::parse("10.0.0.1")
                .unwrap()
                .contains("10.0.0.1".parse().unwrap())
        );
        assert!(
            !Cidr::parse("10.0.0.1")
                .unwrap()
                .contains("10.0.0.2".parse().unwrap())
        );
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("nope").is_err());
    }

    #[test]
    fn regexes_are_anchored() {
        let m = StringMatch::compile(RawStringMatch::Regex("v[0-9]+".into())).unwrap();
        assert!(m.matches("v12"));
        assert!(!m.matches("xv12"));
        assert!(StringMatch::compile(RawStringMatch::Regex("(".into())).is_err());
    }
}

//! Who may use an admin API, and under which names it may be asked.
//!
//! - **Reads stay open** on the admin address (health, readiness, metrics, what
//!   runs): what operators and scrapers need without a secret.
//! - **Mutations** (a reload, store and cache deletes) need the admin token as a
//!   bearer token. A mesh's token is derived from its registration key
//!   ([`admin_token`]): every node holds that key already (it checks pods' tokens
//!   with it), `dpumesh up` prints the token, and `dpumesh certs --admin-token` tells
//!   it to an operator. A standalone proxy reads its token from a file. With no token
//!   there are no mutations over TCP: a policy change is saved to the watched file.
//! - **The `Host` header** must name the admin address as an IP literal or
//!   `localhost` (with the admin port, if any), or a name the operator listed. A web
//!   page cannot reach the API through DNS rebinding: its requests carry the page's
//!   own host name.

use crate::registration::RegistrationKey;

const ADMIN_LABEL: &str = "admin";

/// The admin token of the mesh whose registration key is `key` (hex). Derived, not
/// stored: the key never leaves its folder through it (HMAC is one-way), and
/// registration tokens, which name services, can never equal it (a service cannot be
/// named with the label's reserved prefix).
pub fn admin_token(key: &RegistrationKey) -> String {
    key.token(&format!(
        "{}{ADMIN_LABEL}",
        crate::registration::RESERVED_PREFIX
    ))
}

/// Why a request to an admin API is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminRefusal {
    /// `Host` names something other than the admin address (421).
    #[error(
        "Host {0:?} is not this admin API's address: use its IP address or localhost (DNS rebinding is refused)"
    )]
    Host(String),
    /// A mutation without the right bearer token (401).
    #[error(
        "this admin call changes the node: send the admin token as `authorization: Bearer <token>`"
    )]
    Unauthorized,
    /// A mutation where no admin token is configured (403).
    #[error(
        "this admin call changes the node, and no admin token is configured: save the config file instead (it is watched), or configure a token"
    )]
    NoToken,
}

impl AdminRefusal {
    /// The HTTP status of the refusal.
    pub fn status(&self) -> u16 {
        match self {
            Self::Host(_) => 421,
            Self::Unauthorized => 401,
            Self::NoToken => 403,
        }
    }
}

/// One admin API's rules.
#[derive(Clone, Default)]
pub struct AdminAccess {
    token: Option<String>,
    port: u16,
    names: Vec<String>,
}

impl std::fmt::Debug for AdminAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminAccess")
            .field("token", &self.token.as_ref().map(|_| ".."))
            .field("port", &self.port)
            .field("names", &self.names)
            .finish()
    }
}

impl AdminAccess {
    /// The rules of an admin API on `port` whose mutations need `token` (none: no
    /// mutations), asked under IP literals, `localhost` and `names`.
    pub fn new(port: u16, token: Option<String>, names: Vec<String>) -> Self {
        Self {
            token: token.filter(|t| !t.is_empty()),
            port,
            names: names.into_iter().map(|n| n.to_ascii_lowercase()).collect(),
        }
    }

    /// Whether a request with this `Host` (absent: HTTP/1.0) is for this API.
    pub fn check_host(&self, host: Option<&str>) -> Result<(), AdminRefusal> {
        let Some(host) = host else { return Ok(()) };
        let refused = || AdminRefusal::Host(host.to_owned());
        let (name, port) = split_host(host).ok_or_else(refused)?;
        if port.is_some_and(|p| p != self.port) {
            return Err(refused());
        }
        let name = name.to_ascii_lowercase();
        let known = name.parse::<std::net::IpAddr>().is_ok()
            || name == "localhost"
            || self.names.contains(&name);
        if known { Ok(()) } else { Err(refused()) }
    }

    /// Whether a mutation with this `Authorization` header may go ahead.
    pub fn check_mutation(&self, authorization: Option<&str>) -> Result<(), AdminRefusal> {
        let Some(token) = &self.token else {
            return Err(AdminRefusal::NoToken);
        };
        let given = authorization
            .and_then(|a| {
                a.strip_prefix("Bearer ")
                    .or_else(|| a.strip_prefix("bearer "))
            })
            .map(str::trim)
            .ok_or(AdminRefusal::Unauthorized)?;
        if constant_time_eq(given.as_bytes(), token.as_bytes()) {
            Ok(())
        } else {
            Err(AdminRefusal::Unauthorized)
        }
    }
}

/// `name` and `port` of a `Host` value (`[v6]:port` too); `None` when malformed.
fn split_host(host: &str) -> Option<(&str, Option<u16>)> {
    if let Some(rest) = host.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        return match after {
            "" => Some((v6, None)),
            port => Some((v6, Some(port.strip_prefix(':')?.parse().ok()?))),
        };
    }
    match host.rsplit_once(':') {
        Some((name, port)) => Some((name, Some(port.parse().ok()?))),
        None => Some((host, None)),
    }
}

/// Compares in time that depends on the lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access() -> AdminAccess {
        AdminAccess::new(9101, Some("s3cret".into()), vec!["node1.admin.svc".into()])
    }

    #[test]
    fn ip_literals_localhost_and_listed_names_are_this_api_and_nothing_else() {
        let a = access();
        for ok in [
            None,
            Some("127.0.0.1:9101"),
            Some("127.0.0.1"),
            Some("10.1.2.3:9101"),
            Some("[::1]:9101"),
            Some("[fd00::7]"),
            Some("localhost:9101"),
            Some("LOCALHOST"),
            Some("node1.admin.svc:9101"),
        ] {
            assert_eq!(a.check_host(ok), Ok(()), "{ok:?}");
        }
        for bad in [
            "evil.example:9101",
            "evil.example",
            "127.0.0.1:80",
            "127.0.0.1:",
            "localhost:9102",
            "[::1",
            "127.0.0.1.nip.io:9101",
        ] {
            assert_eq!(
                a.check_host(Some(bad)),
                Err(AdminRefusal::Host(bad.into())),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_mutation_needs_the_token_and_without_one_none_is_possible() {
        let a = access();
        assert_eq!(a.check_mutation(Some("Bearer s3cret")), Ok(()));
        for bad in [
            None,
            Some("Bearer s3cre"),
            Some("Bearer s3cret2"),
            Some("Basic s3cret"),
            Some("s3cret"),
        ] {
            assert_eq!(
                a.check_mutation(bad),
                Err(AdminRefusal::Unauthorized),
                "{bad:?}"
            );
        }
        let none = AdminAccess::new(9101, None, Vec::new());
        assert_eq!(
            none.check_mutation(Some("Bearer x")),
            Err(AdminRefusal::NoToken)
        );
        let empty = AdminAccess::new(9101, Some(String::new()), Vec::new());
        assert_eq!(
            empty.check_mutation(Some("Bearer ")),
            Err(AdminRefusal::NoToken)
        );
        assert_eq!(AdminRefusal::Host("x".into()).status(), 421);
        assert_eq!(AdminRefusal::Unauthorized.status(), 401);
        assert_eq!(AdminRefusal::NoToken.status(), 403);
    }

    #[test]
    fn the_admin_token_is_the_meshs_and_no_services() {
        let dir = tempfile::tempdir().unwrap();
        let key = RegistrationKey::load_or_create(dir.path()).unwrap();
        let token = admin_token(&key);
        assert_eq!(token.len(), 64);
        assert_eq!(
            token,
            admin_token(&RegistrationKey::load(dir.path()).unwrap())
        );
        assert_ne!(
            token,
            key.token("admin"),
            "a service named admin cannot hold it"
        );
        assert!(
            !key.verify("mesh:admin", &token),
            "nor can a pod register with it"
        );
        let other = tempfile::tempdir().unwrap();
        assert_ne!(
            token,
            admin_token(&RegistrationKey::load_or_create(other.path()).unwrap())
        );
    }
}

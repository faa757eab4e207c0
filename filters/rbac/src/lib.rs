//! `rbac`: role-based access control with Envoy RBAC semantics.
//!
//! The configuration has one action and named policies, evaluated in order. A policy
//! matches when any of its permissions matches the request **and** any of its
//! principals matches the requester. With `action: ALLOW` a request is denied unless a
//! policy matches; with `action: DENY` it is denied if one does. Denials are 403 with a
//! body that names nothing internal. In shadow mode the decision is counted and logged
//! but never enforced. Counters: `rbac_policy_matches_total{policy}`,
//! `rbac_decisions_total{result=allowed|denied|shadow_denied}`.
//!
//! Principals read verified JWT claims, which the JWT filter leaves (`jwt.payload`), so
//! RBAC runs after JWT in a chain. It asks the proxy for exactly the claims its
//! policies name, in one call, typed: the proxy keeps the payload parsed, so RBAC
//! parses no JSON per request.

#![forbid(unsafe_code)]

pub mod matcher;

use std::cell::OnceCell;
use std::net::IpAddr;

use dpumesh_filter_sdk::metrics::Counter;
use dpumesh_filter_sdk::{
    Claim, Filter, Interest, LocalReply, Request, Verdict, export_filter, log,
};
use serde::Deserialize;

use crate::matcher::{ClaimPaths, Permission, Principal, RawPermission, RawPrincipal, Reads};

/// What the policy evaluation needs of a request; the filter's logic is pure over it.
pub trait RequestView {
    fn method(&self) -> &str;
    /// Path without query.
    fn path(&self) -> &str;
    /// Every value of a header, in order (a repeated header is matched on each, so a
    /// decoy value first cannot hide the one a rule looks for).
    fn header_all(&self, name: &str) -> Vec<String>;
    /// Destination service.
    fn destination(&self) -> Option<String>;
    /// The verified claims the engine's policies name ([`Engine::claim_names`], in that
    /// order), if a JWT was verified.
    fn claims(&self) -> Option<&[Option<Claim>]>;
    /// Source IP.
    fn source_ip(&self) -> Option<IpAddr>;
    /// Source workload identity.
    fn identity(&self) -> Option<String>;
}

/// [`RequestView`] over the SDK's request, fetching lazily: the claims the policies
/// name in one call, when a principal first needs them.
pub struct View<'r, 'a> {
    req: &'r Request<'a>,
    engine: &'r Engine,
    claims: OnceCell<Option<Vec<Option<Claim>>>>,
    source: OnceCell<dpumesh_filter_sdk::Peer>,
}

impl<'r, 'a> View<'r, 'a> {
    /// A view of `req` for `engine`'s policies.
    pub fn new(req: &'r Request<'a>, engine: &'r Engine) -> Self {
        Self {
            req,
            engine,
            claims: OnceCell::new(),
            source: OnceCell::new(),
        }
    }

    fn source(&self) -> &dpumesh_filter_sdk::Peer {
        self.source.get_or_init(|| self.req.source())
    }
}

impl RequestView for View<'_, '_> {
    fn method(&self) -> &str {
        self.req.method()
    }
    fn path(&self) -> &str {
        self.req.path()
    }
    fn header_all(&self, name: &str) -> Vec<String> {
        self.req.header_all(name)
    }
    fn destination(&self) -> Option<String> {
        self.req.destination()
    }
    fn claims(&self) -> Option<&[Option<Claim>]> {
        self.claims
            .get_or_init(|| self.req.claims(&self.engine.claim_names()))
            .as_deref()
    }
    fn source_ip(&self) -> Option<IpAddr> {
        self.source().address.parse().ok()
    }
    fn identity(&self) -> Option<String> {
        self.source().identity.clone()
    }
}

/// ALLOW or DENY.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Action {
    /// Deny unless a policy matches.
    #[serde(rename = "ALLOW")]
    Allow,
    /// Deny if a policy matches.
    #[serde(rename = "DENY")]
    Deny,
}

/// A policy as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPolicy {
    /// Name (metrics, logs).
    pub name: String,
    /// Any of these must match the request.
    pub permissions: Vec<RawPermission>,
    /// Any of these must match the requester.
    pub principals: Vec<RawPrincipal>,
}

/// The configuration as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub action: Action,
    /// Policies, in order.
    #[serde(default)]
    pub policies: Vec<RawPolicy>,
    /// Evaluate and count, never deny.
    #[serde(default)]
    pub shadow: bool,
}

/// A compiled policy.
#[derive(Debug, Clone)]
pub struct Policy {
    pub name: String,
    permissions: Vec<Permission>,
    principals: Vec<Principal>,
}

impl Policy {
    /// Whether the policy matches.
    pub fn matches(&self, req: &dyn RequestView) -> bool {
        self.permissions.iter().any(|p| p.matches(req))
            && self.principals.iter().any(|p| p.matches(req))
    }
}

/// The compiled configuration.
#[derive(Debug, Clone)]
pub struct Engine {
    pub action: Action,
    pub policies: Vec<Policy>,
    /// The claims the principals name; [`RequestView::claims`] lists them in this order.
    claims: ClaimPaths,
}

/// The decision and the policy that matched (if any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request is allowed.
    pub allowed: bool,
    /// The first policy that matched.
    pub policy: Option<usize>,
}

impl Engine {
    /// Compiles and checks a configuration.
    pub fn compile(raw: RawConfig) -> Result<Self, String> {
        let mut names = std::collections::HashSet::new();
        let mut claims = ClaimPaths::default();
        let policies = raw
            .policies
            .into_iter()
            .map(|p| {
                if !names.insert(p.name.clone()) {
                    return Err(format!("policy {} is defined twice", p.name));
                }
                if p.permissions.is_empty() || p.principals.is_empty() {
                    return Err(format!(
                        "policy {}: needs at least one permission and one principal",
                        p.name
                    ));
                }
                let at = |e: String| format!("policy {}: {e}", p.name);
                Ok(Policy {
                    permissions: p
                        .permissions
                        .into_iter()
                        .map(Permission::compile)
                        .collect::<Result<_, _>>()
                        .map_err(at)?,
                    principals: p
                        .principals
                        .into_iter()
                        .map(|p| Principal::compile(p, &mut claims))
                        .collect::<Result<_, _>>()
                        .map_err(at)?,
                    name: p.name,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Self {
            action: raw.action,
            policies,
            claims,
        })
    }

    /// The claims the policies read, in the order [`RequestView::claims`] lists them.
    pub fn claim_names(&self) -> Vec<&str> {
        self.claims.names()
    }

    /// Evaluates the policies in order (Envoy semantics).
    pub fn evaluate(&self, req: &dyn RequestView) -> Decision {
        let policy = self.policies.iter().position(|p| p.matches(req));
        let allowed = match self.action {
            Action::Allow => policy.is_some(),
            Action::Deny => policy.is_none(),
        };
        Decision { allowed, policy }
    }
}

/// The filter.
#[derive(Debug)]
pub struct Rbac {
    engine: Engine,
    shadow: bool,
    matches: Vec<Counter>,
    allowed: Counter,
    denied: Counter,
    shadow_denied: Counter,
}

impl Filter for Rbac {
    type Config = RawConfig;

    /// The headers the policies name. Claims are not declared: they are asked of the
    /// proxy, which keeps them parsed, when a principal needs them.
    fn interest(&self) -> Interest {
        let mut reads = Reads::default();
        for policy in &self.engine.policies {
            policy.permissions.iter().for_each(|p| p.reads(&mut reads));
            policy.principals.iter().for_each(|p| p.reads(&mut reads));
        }
        reads.headers.sort();
        reads.headers.dedup();
        Interest {
            headers: reads.headers,
            metadata: Vec::new(),
        }
    }

    fn new(raw: RawConfig) -> Result<Self, String> {
        let shadow = raw.shadow;
        let engine = Engine::compile(raw)?;
        let counter = |name: &str, labels: &[(&str, &str)]| {
            Counter::new(name, labels).map_err(|e| e.to_string())
        };
        Ok(Self {
            matches: engine
                .policies
                .iter()
                .map(|p| counter("rbac_policy_matches_total", &[("policy", &p.name)]))
                .collect::<Result<_, _>>()?,
            allowed: counter("rbac_decisions_total", &[("result", "allowed")])?,
            denied: counter("rbac_decisions_total", &[("result", "denied")])?,
            shadow_denied: counter("rbac_decisions_total", &[("result", "shadow_denied")])?,
            engine,
            shadow,
        })
    }

    fn on_request(&mut self, req: &Request<'_>) -> Verdict {
        let decision = self.engine.evaluate(&View::new(req, &self.engine));
        if let Some(i) = decision.policy {
            self.matches[i].increment(1);
        }
        if decision.allowed {
            self.allowed.increment(1);
            return Verdict::Continue;
        }
        let policy = decision
            .policy
            .map(|i| self.engine.policies[i].name.as_str())
            .unwrap_or("(no policy matched)");
        if self.shadow {
            self.shadow_denied.increment(1);
            dpumesh_filter_sdk::log!(
                log::Level::Info,
                "shadow: rbac would deny {} {} ({policy})",
                req.method(),
                req.path()
            );
            return Verdict::Continue;
        }
        self.denied.increment(1);
        dpumesh_filter_sdk::log!(
            log::Level::Info,
            "rbac denied {} {} ({policy})",
            req.method(),
            req.path()
        );
        LocalReply::new(403)
            .header("content-type", "text/plain")
            .body("RBAC: access denied\n")
            .into()
    }
}

export_filter!(Rbac);

#[cfg(test)]
mod tests {
    use dpumesh_filter_sdk::mock::{MockProxy, MockRequest};

    use super::*;

    #[test]
    fn allow_policies_need_both_a_permission_and_a_principal() {
        let host = MockProxy::new().install();
        let mut f: Rbac = host
            .configure(r#"{"action": "ALLOW", "policies": [{"name": "admins", "permissions": [{"path": {"prefix": "/admin"}}], "principals": [{"claim": {"name": "roles", "contains": "admin"}}]}]}"#)
            .unwrap();
        let admin = MockRequest::get("/admin/x")
            .with_metadata("jwt.payload", r#"{"roles": ["user", "admin"]}"#);
        assert!(host.on_request(&mut f, &admin).is_continue());
        let user =
            MockRequest::get("/admin/x").with_metadata("jwt.payload", r#"{"roles": ["user"]}"#);
        let reply = host.on_request(&mut f, &user);
        assert_eq!(reply.reply().unwrap().status, 403);
        assert_eq!(reply.reply().unwrap().body, "RBAC: access denied\n");
        assert_eq!(
            host.metric("rbac_policy_matches_total", &[("policy", "admins")]),
            1.0
        );
    }

    #[test]
    fn configs_are_checked() {
        let host = MockProxy::new().install();
        for (config, needle) in [
            (r#"{"action": "MAYBE"}"#, "unknown variant"),
            (
                r#"{"action": "ALLOW", "policies": [{"name": "a", "permissions": [], "principals": [{"any": true}]}]}"#,
                "at least one permission",
            ),
            (
                r#"{"action": "ALLOW", "policies": [{"name": "a", "permissions": [{"path": {"regex": "("}}], "principals": [{"any": true}]}]}"#,
                "policy a: regex",
            ),
            (
                r#"{"action": "ALLOW", "policies": [{"name": "a", "permissions": [{"any": true}], "principals": [{"source_ip": "10.0.0.0/99"}]}]}"#,
                "prefix must be",
            ),
            (
                r#"{"action": "ALLOW", "policies": [{"name": "a", "permissions": [{"any": true}], "principals": [{"claim": {"name": "x"}}]}]}"#,
                "equals, in or contains",
            ),
        ] {
            let err = host.configure::<Rbac>(config).unwrap_err();
            assert!(err.contains(needle), "{config}: {err}");
        }
    }
}

//! `guard`: allow or deny requests by path prefix, method and header.
//!
//! The smallest useful DPUmesh filter, shown in the README. Rules are checked in order
//! and the first that matches decides; when none matches, `default` decides. An allowed
//! request is tagged with `x-guard: <rule name>` so the upstream can see which rule let
//! it through; denials are counted in `guard_denied_total{rule}`.
//!
//! ```json
//! {
//!   "rules": [
//!     {"name": "health", "path_prefix": "/healthz", "action": "allow"},
//!     {"name": "admin", "path_prefix": "/admin",
//!      "header": {"name": "x-role", "value": "admin"}, "action": "allow"},
//!     {"name": "admin-other", "path_prefix": "/admin", "action": "deny"}
//!   ],
//!   "default": "allow"
//! }
//! ```

#![forbid(unsafe_code)]

use dpumesh_filter_sdk::metrics::Counter;
use dpumesh_filter_sdk::{Filter, Interest, LocalReply, Request, Verdict, export_filter};
use serde::Deserialize;

/// What a rule does when it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Let the request through.
    Allow,
    /// Answer with `deny_status`.
    Deny,
}

/// A header condition.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderMatch {
    /// Header name (case-insensitive).
    pub name: String,
    /// Required value; absent means "present with any value".
    pub value: Option<String>,
}

/// One rule. Every condition given must hold.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Name used in the `x-guard` header and the denial metric.
    pub name: String,
    /// The path must start with this.
    #[serde(default = "root")]
    pub path_prefix: String,
    /// The method must be one of these (any when empty).
    #[serde(default)]
    pub methods: Vec<String>,
    /// A header that must be present (with a value, if given).
    pub header: Option<HeaderMatch>,
    /// What to do on a match.
    pub action: Action,
}

fn root() -> String {
    "/".to_owned()
}

fn default_status() -> u16 {
    403
}

/// The filter's configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Rules in order.
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// What happens when no rule matches (`allow` unless set).
    #[serde(default = "default_action")]
    pub default: Action,
    /// Status of a denial (403 unless set).
    #[serde(default = "default_status")]
    pub deny_status: u16,
}

fn default_action() -> Action {
    Action::Allow
}

/// The guard filter.
#[derive(Debug)]
pub struct Guard {
    config: Config,
    denied: Vec<Counter>,
    denied_default: Counter,
}

impl Rule {
    fn matches(&self, req: &Request<'_>) -> bool {
        req.path().starts_with(&self.path_prefix)
            && (self.methods.is_empty()
                || self
                    .methods
                    .iter()
                    .any(|m| m.eq_ignore_ascii_case(req.method())))
            && self
                .header
                .as_ref()
                .is_none_or(|h| match req.header(&h.name) {
                    None => false,
                    Some(value) => h.value.as_ref().is_none_or(|want| *want == value),
                })
    }
}

impl Guard {
    fn deny(&self, counter: &Counter, rule: &str) -> Verdict {
        counter.increment(1);
        LocalReply::new(self.config.deny_status)
            .header("content-type", "text/plain")
            .body(format!("denied by guard rule {rule}\n"))
            .into()
    }
}

impl Filter for Guard {
    type Config = Config;

    /// The headers the rules look at: handed in with each call, no crossing to read.
    fn interest(&self) -> Interest {
        self.config
            .rules
            .iter()
            .filter_map(|r| r.header.as_ref())
            .fold(Interest::default(), |i, h| i.header(&h.name))
    }

    fn new(config: Config) -> Result<Self, String> {
        if !(100..=599).contains(&config.deny_status) {
            return Err(format!(
                "deny_status must be an HTTP status 100-599, got {}",
                config.deny_status
            ));
        }
        if let Some(rule) = config
            .rules
            .iter()
            .find(|r| !r.path_prefix.starts_with('/'))
        {
            return Err(format!(
                "rule {}: path_prefix must start with '/', got {:?}",
                rule.name, rule.path_prefix
            ));
        }
        let counter = |rule: &str| {
            Counter::new("guard_denied_total", &[("rule", rule)]).map_err(|e| e.to_string())
        };
        let denied = config
            .rules
            .iter()
            .map(|r| counter(&r.name))
            .collect::<Result<_, _>>()?;
        let denied_default = counter("default")?;
        Ok(Self {
            config,
            denied,
            denied_default,
        })
    }

    fn on_request(&mut self, req: &Request<'_>) -> Verdict {
        let matched = self.config.rules.iter().position(|rule| rule.matches(req));
        match matched {
            Some(i) => {
                let rule = &self.config.rules[i];
                match rule.action {
                    Action::Allow => {
                        // The tag is informational: a refused edit must not deny.
                        let _ = req.set_header("x-guard", &rule.name);
                        Verdict::Continue
                    }
                    Action::Deny => self.deny(&self.denied[i], &rule.name),
                }
            }
            None => match self.config.default {
                Action::Allow => Verdict::Continue,
                Action::Deny => self.deny(&self.denied_default, "default"),
            },
        }
    }
}

export_filter!(Guard);

#[cfg(test)]
mod tests {
    use dpumesh_filter_sdk::mock::{MockProxy, MockRequest};

    use super::*;

    const CONFIG: &str = r#"{
        "rules": [
            {"name": "health", "path_prefix": "/healthz", "action": "allow"},
            {"name": "admin", "path_prefix": "/admin",
             "header": {"name": "x-role", "value": "admin"}, "action": "allow"},
            {"name": "admin-other", "path_prefix": "/admin", "action": "deny"},
            {"name": "no-delete", "methods": ["DELETE"], "action": "deny"}
        ],
        "default": "allow"
    }"#;

    #[test]
    fn first_matching_rule_decides() {
        let host = MockProxy::new().install();
        let mut guard: Guard = host.configure(CONFIG).unwrap();

        let admin = MockRequest::get("/admin/users").with_header("X-Role", "admin");
        assert!(host.on_request(&mut guard, &admin).is_continue());
        assert_eq!(admin.header("x-guard").as_deref(), Some("admin"));

        let other = MockRequest::get("/admin/users").with_header("x-role", "user");
        let verdict = host.on_request(&mut guard, &other);
        let reply = verdict.reply().expect("denied");
        assert_eq!(reply.status, 403);
        assert!(reply.body.contains("admin-other"));

        let delete = MockRequest::new("DELETE", "/items/1");
        assert_eq!(
            host.on_request(&mut guard, &delete).reply().unwrap().status,
            403
        );

        let plain = MockRequest::get("/items");
        assert!(host.on_request(&mut guard, &plain).is_continue());
        assert_eq!(plain.header("x-guard"), None);

        assert_eq!(
            host.metric("guard_denied_total", &[("rule", "admin-other")]),
            1.0
        );
        assert_eq!(
            host.metric("guard_denied_total", &[("rule", "no-delete")]),
            1.0
        );
    }

    #[test]
    fn default_deny_uses_the_configured_status() {
        let host = MockProxy::new().install();
        let mut guard: Guard = host
            .configure(r#"{"default": "deny", "deny_status": 401}"#)
            .unwrap();
        let verdict = host.on_request(&mut guard, &MockRequest::get("/"));
        assert_eq!(verdict.reply().unwrap().status, 401);
        assert_eq!(
            host.metric("guard_denied_total", &[("rule", "default")]),
            1.0
        );
    }

    #[test]
    fn bad_configs_are_refused_with_the_cause() {
        let host = MockProxy::new().install();
        let err = host
            .configure::<Guard>(r#"{"deny_status": 42}"#)
            .unwrap_err();
        assert!(err.contains("deny_status"), "{err}");
        let err = host
            .configure::<Guard>(
                r#"{"rules": [{"name": "x", "path_prefix": "admin", "action": "deny"}]}"#,
            )
            .unwrap_err();
        assert!(err.contains("must start with '/'"), "{err}");
        let err = host.configure::<Guard>(r#"{"rulez": []}"#).unwrap_err();
        assert!(err.contains("unknown field `rulez`"), "{err}");
        let err = host
            .configure::<Guard>(r#"{"rules": [{"name": "x", "action": "maybe"}]}"#)
            .unwrap_err();
        assert!(err.contains("unknown variant `maybe`"), "{err}");
    }
}

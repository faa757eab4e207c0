//! SPIFFE IDs of the mesh's parts: what a certificate says its holder is.
//!
//! - a node's proxy: `spiffe://<trust-domain>/dpumesh/node/<name>`
//! - the ingress: `spiffe://<trust-domain>/dpumesh/ingress`
//! - the Pingmesh controller and analyzer: `spiffe://<trust-domain>/dpumesh/pingmesh`
//! - a workload (a service's pods): `spiffe://<trust-domain>/ns/<namespace>/sa/<account>`,
//!   Istio's form, so RBAC principals read the same in both meshes.

use std::fmt;

use crate::IdentityError;

/// What a holder of an identity is in the mesh.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Role {
    Node(String),
    Ingress,
    /// The Pingmesh controller and analyzer (`dpumesh pingmesh server`): serves the
    /// agents' gRPC calls, opens no fabric link.
    Pingmesh,
    Workload {
        namespace: String,
        account: String,
    },
}

/// A parsed SPIFFE ID.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SpiffeId {
    pub trust_domain: String,
    pub role: Role,
}

/// Trust domain and path segments: lowercase letters, digits, `-`, `.`, `_` (the
/// SPIFFE ID spec's set), never empty, never `.` or `..`.
fn check_segment(what: &str, s: &str) -> Result<(), IdentityError> {
    let ok = !s.is_empty()
        && s != "."
        && s != ".."
        && s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.' | b'_')
        });
    if ok {
        Ok(())
    } else {
        Err(IdentityError::BadId(format!(
            "{what} {s:?} must be lowercase letters, digits, '-', '.' or '_'"
        )))
    }
}

impl SpiffeId {
    pub fn node(trust_domain: &str, name: &str) -> Result<Self, IdentityError> {
        Self::checked(trust_domain, Role::Node(name.to_owned()))
    }

    pub fn ingress(trust_domain: &str) -> Result<Self, IdentityError> {
        Self::checked(trust_domain, Role::Ingress)
    }

    pub fn pingmesh(trust_domain: &str) -> Result<Self, IdentityError> {
        Self::checked(trust_domain, Role::Pingmesh)
    }

    pub fn workload(
        trust_domain: &str,
        namespace: &str,
        account: &str,
    ) -> Result<Self, IdentityError> {
        Self::checked(
            trust_domain,
            Role::Workload {
                namespace: namespace.to_owned(),
                account: account.to_owned(),
            },
        )
    }

    fn checked(trust_domain: &str, role: Role) -> Result<Self, IdentityError> {
        check_segment("trust domain", trust_domain)?;
        match &role {
            Role::Node(name) => check_segment("node name", name)?,
            Role::Ingress | Role::Pingmesh => {}
            Role::Workload { namespace, account } => {
                check_segment("namespace", namespace)?;
                check_segment("service account", account)?;
            }
        }
        Ok(Self {
            trust_domain: trust_domain.to_owned(),
            role,
        })
    }

    /// Parses `spiffe://...`; only the four forms above are mesh identities.
    pub fn parse(uri: &str) -> Result<Self, IdentityError> {
        let bad = |why: &str| IdentityError::BadId(format!("{uri:?}: {why}"));
        let rest = uri
            .strip_prefix("spiffe://")
            .ok_or_else(|| bad("not a spiffe:// URI"))?;
        let (domain, path) = rest.split_once('/').ok_or_else(|| bad("no path"))?;
        let parts: Vec<&str> = path.split('/').collect();
        let role = match parts.as_slice() {
            ["dpumesh", "node", name] => Role::Node((*name).to_owned()),
            ["dpumesh", "ingress"] => Role::Ingress,
            ["dpumesh", "pingmesh"] => Role::Pingmesh,
            ["ns", ns, "sa", sa] => Role::Workload {
                namespace: (*ns).to_owned(),
                account: (*sa).to_owned(),
            },
            _ => {
                return Err(bad(
                    "not a node, ingress, pingmesh or workload identity of the mesh",
                ));
            }
        };
        Self::checked(domain, role).map_err(|e| bad(&e.to_string()))
    }

    /// What a workload's account name is appended to for its ID in `namespace`
    /// (the data path builds pods' IDs from it, once per request, unchecked: a
    /// service name SPIFFE does not allow still names a distinct source).
    pub fn workload_prefix(trust_domain: &str, namespace: &str) -> String {
        format!("spiffe://{trust_domain}/ns/{namespace}/sa/")
    }

    /// Nodes and the ingress: the parts that may open fabric links and vouch for
    /// requests they have already policed.
    pub fn is_mesh_component(&self) -> bool {
        matches!(self.role, Role::Node(_) | Role::Ingress)
    }

    pub fn is_node(&self) -> bool {
        matches!(self.role, Role::Node(_))
    }

    pub fn is_ingress(&self) -> bool {
        matches!(self.role, Role::Ingress)
    }

    /// The name of its certificate files in a certificate folder.
    pub fn file_stem(&self) -> String {
        match &self.role {
            Role::Node(name) => format!("node-{name}"),
            Role::Ingress => "ingress".to_owned(),
            Role::Pingmesh => "pingmesh".to_owned(),
            Role::Workload { namespace, account } => format!("workload-{namespace}-{account}"),
        }
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.role {
            Role::Node(name) => write!(f, "spiffe://{}/dpumesh/node/{name}", self.trust_domain),
            Role::Ingress => write!(f, "spiffe://{}/dpumesh/ingress", self.trust_domain),
            Role::Pingmesh => write!(f, "spiffe://{}/dpumesh/pingmesh", self.trust_domain),
            Role::Workload { namespace, account } => {
                write!(
                    f,
                    "spiffe://{}/ns/{namespace}/sa/{account}",
                    self.trust_domain
                )
            }
        }
    }
}

/// Whether `principal` names an identity in `trust_domain` (`spiffe://<domain>` or
/// `spiffe://<domain>/…`; `spiffe://<domain>.other/…` is not in it).
pub fn in_trust_domain(principal: &str, trust_domain: &str) -> bool {
    principal
        .strip_prefix("spiffe://")
        .and_then(|rest| rest.strip_prefix(trust_domain))
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_four_forms_print_and_parse_back() {
        for id in [
            SpiffeId::node("mesh.local", "node1").unwrap(),
            SpiffeId::ingress("mesh.local").unwrap(),
            SpiffeId::pingmesh("mesh.local").unwrap(),
            SpiffeId::workload("mesh.local", "default", "frontend").unwrap(),
        ] {
            assert_eq!(SpiffeId::parse(&id.to_string()).unwrap(), id);
        }
        assert_eq!(
            SpiffeId::workload("td", "prod", "api").unwrap().to_string(),
            "spiffe://td/ns/prod/sa/api"
        );
    }

    #[test]
    fn anything_else_is_refused_with_the_reason() {
        for (uri, why) in [
            ("https://td/ns/a/sa/b", "not a spiffe"),
            ("spiffe://td", "no path"),
            ("spiffe://td/ns/a/sa/b/c", "not a node"),
            ("spiffe://td/dpumesh/node/../x", "not a node"),
            ("spiffe://TD/dpumesh/ingress", "lowercase"),
            ("spiffe://td/ns//sa/b", "lowercase"),
            ("spiffe://td/dpumesh/node/..", "lowercase"),
            ("spiffe://td/dpumesh/pingmesh/x", "not a node"),
        ] {
            let e = SpiffeId::parse(uri).unwrap_err().to_string();
            assert!(e.contains(why), "{uri}: {e}");
        }
    }

    #[test]
    fn only_nodes_and_the_ingress_are_mesh_components() {
        assert!(SpiffeId::node("td", "n").unwrap().is_mesh_component());
        assert!(SpiffeId::ingress("td").unwrap().is_mesh_component());
        assert!(
            !SpiffeId::workload("td", "a", "b")
                .unwrap()
                .is_mesh_component()
        );
        assert!(!SpiffeId::ingress("td").unwrap().is_node());
        // The Pingmesh server has a certificate but opens no fabric link.
        assert!(!SpiffeId::pingmesh("td").unwrap().is_mesh_component());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(20_000))]
        /// A peer's certificate names what it likes: parsing never panics, and what
        /// parses prints back to the same text.
        #[test]
        fn any_uri_parses_or_is_refused_without_a_panic(
            uri in "(spiffe://)?[a-zA-Z0-9._/%-]{0,40}|spiffe://[a-z.]{1,8}/(ns|dpumesh)/[a-z./]{0,12}(/sa/[a-z.]{0,6})?"
        ) {
            if let Ok(id) = SpiffeId::parse(&uri) {
                proptest::prop_assert_eq!(id.to_string(), uri);
            }
        }
    }
}

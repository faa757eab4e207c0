//! Whose keys are whose: each service's keys live under its own namespace, and the
//! node's own (the HTTP response cache's bodies) under one no service can name.
//!
//! A client acts for the service its control connection proved (a pod's registration,
//! or an `Authenticate` with the same token). Every key it sends is taken as
//! `SERVICE/key`, and every key it is told comes back without the prefix: it cannot
//! list, read, overwrite or delete another service's objects, nor the node's cached
//! response bodies (which were served to clients: overwriting one poisoned the
//! cache). Service names are DNS labels (no `/`, no leading `.`), so `SERVICE/` can
//! never reach [`NODE`]'s `.node/`.

use crate::protocol::{ObjectInfo, Request, Response};

/// The node's own namespace (the HTTP cache's bodies).
pub const NODE: &str = ".node";

/// Why a name cannot be a namespace.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} cannot name a store namespace (a service name: no '/', no leading '.')")]
pub struct BadNamespace(pub String);

/// One namespace: the prefix its keys carry in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    prefix: String,
}

impl Namespace {
    /// Service `name`'s.
    pub fn service(name: &str) -> Result<Self, BadNamespace> {
        if name.is_empty() || name.starts_with('.') || name.contains('/') {
            return Err(BadNamespace(name.to_owned()));
        }
        Ok(Self {
            prefix: format!("{name}/"),
        })
    }

    /// The node's own ([`NODE`]).
    pub fn node() -> Self {
        Self {
            prefix: format!("{NODE}/"),
        }
    }

    /// `key` as stored (an empty key stays empty: refused as it was sent).
    pub fn key(&self, key: &str) -> String {
        if key.is_empty() {
            return String::new();
        }
        format!("{}{key}", self.prefix)
    }

    /// A stored key as this namespace's client knows it; `None` when it is not one of
    /// its keys.
    pub fn strip<'a>(&self, stored: &'a str) -> Option<&'a str> {
        stored.strip_prefix(&self.prefix)
    }

    /// A client's request with every key in this namespace.
    pub fn request(&self, request: Request) -> Request {
        match request {
            Request::PushBatch { mut segments } => {
                for s in &mut segments {
                    s.key = self.key(&s.key);
                }
                Request::PushBatch { segments }
            }
            Request::PullBatch { mut segments } => {
                for s in &mut segments {
                    s.key = self.key(&s.key);
                }
                Request::PullBatch { segments }
            }
            Request::PullInfo { keys } => Request::PullInfo {
                keys: keys.iter().map(|k| self.key(k)).collect(),
            },
            Request::Delete { keys } => Request::Delete {
                keys: keys.iter().map(|k| self.key(k)).collect(),
            },
            Request::List {
                prefix,
                after,
                limit,
            } => Request::List {
                // Listing from "" is listing the namespace.
                prefix: format!("{}{prefix}", self.prefix),
                after: after.map(|a| self.key(&a)),
                limit,
            },
            other => other,
        }
    }

    /// An answer for this namespace's client: keys without the prefix.
    pub fn response(&self, response: Response) -> Response {
        let strip = |o: ObjectInfo| ObjectInfo {
            key: self.strip(&o.key).unwrap_or(&o.key).to_owned(),
            ..o
        };
        match response {
            Response::Info { objects } => Response::Info {
                objects: objects.into_iter().map(|o| o.map(strip)).collect(),
            },
            Response::Listed { objects, more } => Response::Listed {
                objects: objects.into_iter().map(strip).collect(),
                more,
            },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Segment;

    #[test]
    fn a_services_keys_are_its_own_and_never_the_nodes() {
        let user = Namespace::service("user").unwrap();
        let segment = |key: &str| Segment {
            key: key.to_owned(),
            buffer: 1,
            offset: 0,
            len: 1,
        };
        let Request::PushBatch { segments } = user.request(Request::PushBatch {
            segments: vec![
                segment("a"),
                segment("../frontend/b"),
                segment(".node/http-cache/1"),
            ],
        }) else {
            panic!()
        };
        let keys: Vec<_> = segments.iter().map(|s| s.key.as_str()).collect();
        // Whatever a key says, it stays under `user/`: a path is not a namespace.
        assert_eq!(
            keys,
            ["user/a", "user/../frontend/b", "user/.node/http-cache/1"]
        );
        assert!(keys.iter().all(|k| !k.starts_with(".node/")));
        assert_eq!(
            user.request(Request::List {
                prefix: String::new(),
                after: Some("x".into()),
                limit: 5
            }),
            Request::List {
                prefix: "user/".into(),
                after: Some("user/x".into()),
                limit: 5
            }
        );
        let info = |key: &str| ObjectInfo {
            key: key.to_owned(),
            size: 1,
            crc32: 0,
        };
        assert_eq!(
            user.response(Response::Listed {
                objects: vec![info("user/a")],
                more: false
            }),
            Response::Listed {
                objects: vec![info("a")],
                more: false
            }
        );
        assert_eq!(Namespace::node().key("http-cache/7"), ".node/http-cache/7");
    }

    #[test]
    fn only_a_service_name_is_a_namespace() {
        for bad in ["", ".node", "a/b", ".hidden"] {
            assert_eq!(
                Namespace::service(bad),
                Err(BadNamespace(bad.into())),
                "{bad}"
            );
        }
        assert!(Namespace::service("reservation").is_ok());
    }
}

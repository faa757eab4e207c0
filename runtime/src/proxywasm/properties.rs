//! `proxy_get_property` / `proxy_set_property`: the standard attributes Envoy
//! documents, read from the request head, encoded as Envoy encodes them (strings raw,
//! integers 8 bytes little-endian, booleans one byte, maps as serialized pairs).
//! Pure: what a filter may read is decided here, tested without a guest.

use std::collections::BTreeMap;

use dpumesh_head::RequestHead;

/// Metadata key prefix of properties a filter sets: Envoy keeps them as filter state
/// named `wasm.<path>`; here they are request metadata under that name, so the filters
/// after it (components too) read them.
pub const SET_PREFIX: &str = "wasm.";

/// What a property lookup can see besides the head.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    pub head: &'a RequestHead,
    pub plugin_name: &'a str,
    pub root_id: &'a str,
    pub vm_id: &'a str,
    /// `node.metadata` as configured for the proxy.
    pub node_metadata: &'a BTreeMap<String, String>,
    /// The response status, in the response phase.
    pub response_code: Option<u16>,
}

/// What a path resolved to.
#[derive(Debug, PartialEq, Eq)]
pub enum Value {
    Bytes(Vec<u8>),
    NotFound,
}

fn string(s: &str) -> Value {
    Value::Bytes(s.as_bytes().to_vec())
}

fn int(i: i64) -> Value {
    Value::Bytes(i.to_le_bytes().to_vec())
}

/// The value at `path` (segments as [`super::abi::property_path`] splits them).
pub fn get(view: &View<'_>, path: &[&[u8]]) -> Value {
    let Some(segments) = path
        .iter()
        .map(|s| std::str::from_utf8(s).ok())
        .collect::<Option<Vec<&str>>>()
    else {
        return Value::NotFound;
    };
    // A standard attribute is the mesh's word, found or not: a property a filter set
    // at the same path (or metadata anyone else wrote there) never stands in for it,
    // as Envoy answers its attributes before filter state.
    if let Some(value) = attribute(view, &segments) {
        return value;
    }
    // Any other path: a property a filter set (Envoy: filter state `wasm.<path>`).
    view.head
        .metadata(&set_key(&segments))
        .map_or(Value::NotFound, string)
}

/// A standard attribute's value (`NotFound` when the request has none), or `None`
/// when `segments` names no standard attribute.
fn attribute(view: &View<'_>, segments: &[&str]) -> Option<Value> {
    let head = view.head;
    let header = |name: &str| head.header(name).map_or(Value::NotFound, |v| string(&v));
    Some(match segments {
        ["request", "path"] => match &head.query {
            Some(q) => string(&format!("{}?{q}", head.path)),
            None => string(&head.path),
        },
        ["request", "url_path"] => string(&head.path),
        ["request", "host"] => string(&head.authority),
        ["request", "scheme"] => string(&head.scheme),
        ["request", "method"] => string(&head.method),
        ["request", "query"] => string(head.query.as_deref().unwrap_or("")),
        ["request", "referer"] => header("referer"),
        ["request", "useragent"] => header("user-agent"),
        ["request", "id"] => header("x-request-id"),
        ["request", "headers"] => {
            let names = head.header_names();
            let values: Vec<(String, String)> = names
                .into_iter()
                .map(|n| {
                    let v = head.header_all(&n).join(",");
                    (n, v)
                })
                .collect();
            Value::Bytes(super::abi::serialize_pairs(
                values.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())),
            ))
        }
        ["request", "headers", name] => {
            let all = head.header_all(name);
            if all.is_empty() {
                Value::NotFound
            } else {
                string(&all.join(","))
            }
        }
        ["source", "address"] => string(&head.source.addr.to_string()),
        ["source", "port"] => int(i64::from(head.source.addr.port())),
        ["connection", "mtls"] => Value::Bytes(vec![u8::from(head.source.identity.is_some())]),
        ["connection", "uri_san_peer_certificate"] | ["source", "principal"] => head
            .source
            .identity
            .as_deref()
            .map_or(Value::NotFound, string),
        ["destination", "service"] => head.destination.as_deref().map_or(Value::NotFound, string),
        ["response", "code"] => view
            .response_code
            .map_or(Value::NotFound, |c| int(i64::from(c))),
        ["plugin_name"] => string(view.plugin_name),
        ["plugin_root_id"] => string(view.root_id),
        ["plugin_vm_id"] => string(view.vm_id),
        ["node", "metadata", key] | ["xds", "node", "metadata", key] => view
            .node_metadata
            .get(*key)
            .map_or(Value::NotFound, |v| string(v)),
        _ => return None,
    })
}

/// The metadata key a property set at `path` is kept under.
pub fn set_key(segments: &[&str]) -> String {
    format!("{SET_PREFIX}{}", segments.join("."))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head() -> RequestHead {
        let mut head = RequestHead::new("POST", "/items/7?page=2");
        head.authority = "api.test".into();
        head.source.addr = "10.1.2.3:40000".parse().unwrap();
        head.append_received("user-agent", "curl/8").unwrap();
        head.append_received("x-tag", "a").unwrap();
        head.append_received("x-tag", "b").unwrap();
        head
    }

    fn view<'a>(head: &'a RequestHead, meta: &'a BTreeMap<String, String>) -> View<'a> {
        View {
            head,
            plugin_name: "auth",
            root_id: "root",
            vm_id: "",
            node_metadata: meta,
            response_code: None,
        }
    }

    fn get_str(view: &View<'_>, path: &str) -> Option<String> {
        let segments: Vec<&[u8]> = path.split('.').map(str::as_bytes).collect();
        match get(view, &segments) {
            Value::Bytes(b) => Some(String::from_utf8(b).unwrap()),
            Value::NotFound => None,
        }
    }

    #[test]
    fn request_attributes_read_as_envoy_encodes_them() {
        let (head, meta) = (head(), BTreeMap::new());
        let v = view(&head, &meta);
        assert_eq!(
            get_str(&v, "request.path").as_deref(),
            Some("/items/7?page=2")
        );
        assert_eq!(get_str(&v, "request.url_path").as_deref(), Some("/items/7"));
        assert_eq!(get_str(&v, "request.host").as_deref(), Some("api.test"));
        assert_eq!(get_str(&v, "request.method").as_deref(), Some("POST"));
        assert_eq!(get_str(&v, "request.query").as_deref(), Some("page=2"));
        assert_eq!(get_str(&v, "request.useragent").as_deref(), Some("curl/8"));
        assert_eq!(get_str(&v, "request.headers.x-tag").as_deref(), Some("a,b"));
        assert_eq!(
            get_str(&v, "source.address").as_deref(),
            Some("10.1.2.3:40000")
        );
        assert_eq!(
            get(&v, &[b"source", b"port"]),
            Value::Bytes(40000i64.to_le_bytes().to_vec())
        );
        assert_eq!(get(&v, &[b"connection", b"mtls"]), Value::Bytes(vec![0]));
        assert_eq!(get_str(&v, "plugin_name").as_deref(), Some("auth"));
        assert_eq!(get_str(&v, "request.id"), None);
        assert_eq!(get_str(&v, "nonsense.path"), None);
        let Value::Bytes(all) = get(&v, &[b"request", b"headers"]) else {
            panic!("a map")
        };
        let pairs = super::super::abi::parse_pairs(&all).unwrap();
        assert!(pairs.contains(&("x-tag".into(), b"a,b".to_vec())));
    }

    #[test]
    fn set_properties_and_node_metadata_read_back() {
        let mut head = head();
        head.set_metadata(&set_key(&["my", "flag"]), "on");
        let meta = BTreeMap::from([("region".to_owned(), "eu-1".to_owned())]);
        let mut v = view(&head, &meta);
        assert_eq!(get_str(&v, "my.flag").as_deref(), Some("on"));
        assert_eq!(get_str(&v, "node.metadata.region").as_deref(), Some("eu-1"));
        assert_eq!(get_str(&v, "node.metadata.zone"), None);
        assert_eq!(get(&v, &[b"response", b"code"]), Value::NotFound);
        v.response_code = Some(404);
        assert_eq!(
            get(&v, &[b"response", b"code"]),
            Value::Bytes(404i64.to_le_bytes().to_vec())
        );
        // A path that is not UTF-8 is simply absent.
        assert_eq!(get(&v, &[b"\xff"]), Value::NotFound);
    }

    #[test]
    fn a_property_set_at_a_standard_attributes_path_never_stands_in_for_it() {
        // `source.principal` is the mesh's word; with none (a client from outside),
        // it is absent, not what metadata `wasm.source.principal` says.
        let mut head = head();
        head.set_metadata(
            &set_key(&["source", "principal"]),
            "spiffe://hotel/sa/admin",
        );
        head.set_metadata(&set_key(&["connection", "mtls"]), "\u{1}");
        head.set_metadata(&set_key(&["request", "path"]), "/public");
        let meta = BTreeMap::new();
        let v = view(&head, &meta);
        assert_eq!(get_str(&v, "source.principal"), None);
        assert_eq!(get(&v, &[b"connection", b"mtls"]), Value::Bytes(vec![0]));
        assert_eq!(
            get_str(&v, "request.path").as_deref(),
            Some("/items/7?page=2")
        );
        head.source.identity = Some("spiffe://hotel/sa/user".into());
        let v = view(&head, &meta);
        assert_eq!(
            get_str(&v, "source.principal").as_deref(),
            Some("spiffe://hotel/sa/user")
        );
    }
}

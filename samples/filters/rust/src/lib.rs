//! API-key check, the sample policy every language implements: the key in the
//! configured header must be one of the configured keys; the client's name goes into
//! `client_header` (replacing any forged value) and the key is removed before the
//! request goes upstream; otherwise 401. Denials are counted.
//!
//! ```json
//! {"header": "x-api-key", "client_header": "x-api-client", "keys": {"alice": "key-alice-123"}}
//! ```

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use dpumesh_filter_sdk::metrics::Counter;
use dpumesh_filter_sdk::{Filter, LocalReply, Request, Verdict, export_filter};
use serde::Deserialize;

/// Configuration.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Header carrying the key.
    #[serde(default = "default_header")]
    pub header: String,
    /// Header receiving the client's name.
    #[serde(default = "default_client_header")]
    pub client_header: String,
    /// Client name → key.
    pub keys: BTreeMap<String, String>,
}

fn default_header() -> String {
    "x-api-key".to_owned()
}

fn default_client_header() -> String {
    "x-api-client".to_owned()
}

/// The filter.
#[derive(Debug)]
pub struct ApiKey {
    header: String,
    client_header: String,
    /// Key → client name.
    clients: BTreeMap<String, String>,
    denied: Counter,
}

fn unauthorized(why: &str) -> Verdict {
    LocalReply::new(401)
        .header("www-authenticate", "ApiKey")
        .header("content-type", "text/plain")
        .body(format!("{why}\n"))
        .into()
}

impl Filter for ApiKey {
    type Config = Config;

    fn new(config: Config) -> Result<Self, String> {
        if config.keys.is_empty() {
            return Err("keys must name at least one client".to_owned());
        }
        let mut clients = BTreeMap::new();
        for (client, key) in config.keys {
            if key.is_empty() {
                return Err(format!("the key of {client} is empty"));
            }
            if let Some(other) = clients.insert(key, client.clone()) {
                return Err(format!("{client} and {other} share a key"));
            }
        }
        Ok(Self {
            header: config.header,
            client_header: config.client_header,
            clients,
            denied: Counter::new("apikey_denied_total", &[]).map_err(|e| e.to_string())?,
        })
    }

    fn on_request(&mut self, req: &Request<'_>) -> Verdict {
        let key = req.header(&self.header).unwrap_or_default();
        if key.is_empty() {
            self.denied.increment(1);
            return unauthorized("missing API key");
        }
        let Some(client) = self.clients.get(&key) else {
            self.denied.increment(1);
            return unauthorized("unknown API key");
        };
        // Configured header names are valid; edits of them cannot be refused.
        let _ = req.set_header(&self.client_header, client);
        let _ = req.remove_header(&self.header);
        Verdict::Continue
    }
}

export_filter!(ApiKey);

#[cfg(test)]
mod tests {
    use dpumesh_filter_sdk::mock::{MockProxy, MockRequest};

    use super::*;

    const CONFIG: &str = r#"{"keys": {"alice": "k1", "bob": "k2"}}"#;

    #[test]
    fn known_keys_pass_and_unknown_ones_are_counted() {
        let host = MockProxy::new().install();
        let mut f: ApiKey = host.configure(CONFIG).unwrap();
        let ok = MockRequest::get("/").with_header("x-api-key", "k2");
        assert!(host.on_request(&mut f, &ok).is_continue());
        assert_eq!(ok.header("x-api-client").as_deref(), Some("bob"));
        let bad = MockRequest::get("/").with_header("x-api-key", "k3");
        assert!(!host.on_request(&mut f, &bad).is_continue());
        assert_eq!(host.metric("apikey_denied_total", &[]), 1.0);
    }

    #[test]
    fn bad_configs_are_refused() {
        let host = MockProxy::new().install();
        for config in [
            r#"{"keys": {}}"#,
            r#"{"keys": {"a": ""}}"#,
            r#"{"keys": {"a": "k", "b": "k"}}"#,
            r#"{"keys": {"a": "k"}, "extra": 1}"#,
        ] {
            assert!(host.configure::<ApiKey>(config).is_err(), "{config}");
        }
    }
}

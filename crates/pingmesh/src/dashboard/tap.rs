//! The dashboard's tap page: one tap at a time relayed from every node's `GET /tap`
//! into a short buffer the page polls. A tap opens when the page first asks for a
//! query, is replaced when the query changes, and closes when nobody polled it for
//! [`IDLE`], so a closed page leaves no tap (and no cost) on the nodes.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use parking_lot::Mutex;
use serde::Serialize;

/// A tap nobody polled for this long is closed.
pub const IDLE: Duration = Duration::from_secs(20);
/// Records kept for the page.
const KEPT: usize = 500;
/// The query keys passed on to the nodes (they check the values).
const KEYS: &[&str] = &["service", "route", "source", "method", "path", "status"];

/// Records since the page's last poll.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TapPage {
    /// The query the tap runs.
    pub query: String,
    /// The sequence number to ask from next.
    pub next: u64,
    pub records: Vec<serde_json::Value>,
    /// Nodes whose tap failed, with why.
    pub errors: Vec<String>,
}

#[derive(Default)]
struct State {
    query: Option<String>,
    next: u64,
    records: VecDeque<(u64, serde_json::Value)>,
    errors: Vec<String>,
    polled: Option<Instant>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// The relay.
pub struct TapRelay {
    nodes: Vec<(String, String)>,
    token: Option<String>,
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for TapRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TapRelay")
            .field("nodes", &self.nodes)
            .finish_non_exhaustive()
    }
}

/// The node query of the page's parameters: known keys only, values re-escaped; the
/// rate bounded for a page (20 records a second a node).
pub fn node_query(params: &[(String, String)]) -> String {
    let mut q: Vec<String> = params
        .iter()
        .filter(|(k, v)| KEYS.contains(&k.as_str()) && !v.is_empty())
        .map(|(k, v)| format!("{k}={}", escape(v)))
        .collect();
    q.sort();
    q.push("rate=20".to_owned());
    q.join("&")
}

/// `value` percent-encoded for a tap's query (`dpumesh tap` builds its query so too).
pub fn escape(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' | b'*' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl TapRelay {
    /// `nodes`: names and admin base URLs; `token`: the admin token taps need.
    pub fn new(nodes: Vec<(String, String)>, token: Option<String>) -> Self {
        Self {
            nodes,
            token,
            state: Arc::default(),
        }
    }

    /// Records after `since` for `query` (opening or replacing the tap as needed).
    pub fn poll(&self, query: String, since: u64) -> TapPage {
        let mut state = self.state.lock();
        state.polled = Some(Instant::now());
        if state.query.as_deref() != Some(query.as_str()) {
            for task in state.tasks.drain(..) {
                task.abort();
            }
            state.records.clear();
            state.errors.clear();
            state.query = Some(query.clone());
            let tasks = self
                .nodes
                .iter()
                .map(|(name, admin)| {
                    tokio::spawn(relay(
                        name.clone(),
                        admin.clone(),
                        query.clone(),
                        self.token.clone(),
                        self.state.clone(),
                    ))
                })
                .collect();
            state.tasks = tasks;
        }
        TapPage {
            query,
            next: state.next,
            records: state
                .records
                .iter()
                .filter(|(seq, _)| *seq >= since)
                .map(|(_, r)| r.clone())
                .collect(),
            errors: state.errors.clone(),
        }
    }

    /// Closes a tap nobody polls any more.
    pub fn reap(&self) {
        let mut state = self.state.lock();
        if state.polled.is_some_and(|at| at.elapsed() > IDLE) {
            for task in state.tasks.drain(..) {
                task.abort();
            }
            state.query = None;
            state.polled = None;
        }
    }
}

/// Streams one node's tap into the buffer until aborted or the stream ends.
async fn relay(
    name: String,
    admin: String,
    query: String,
    token: Option<String>,
    state: Arc<Mutex<State>>,
) {
    if let Err(e) = stream(&admin, &query, token.as_deref(), &state).await {
        state.lock().errors.push(format!("{name}: {e}"));
    }
}

async fn stream(
    admin: &str,
    query: &str,
    token: Option<&str>,
    state: &Mutex<State>,
) -> Result<(), String> {
    let authority = admin
        .strip_prefix("http://")
        .ok_or_else(|| format!("{admin}: not an http:// URL"))?
        .trim_end_matches('/')
        .to_owned();
    let tcp = tokio::net::TcpStream::connect(&authority)
        .await
        .map_err(|e| format!("{authority}: {e}"))?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let mut req = hyper::Request::get(format!("/tap?{query}")).header("host", &authority);
    if let Some(token) = token {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    let req = req.body(Empty::<Bytes>::new()).map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        return Err(format!(
            "{status}: {}",
            String::from_utf8_lossy(&body).trim()
        ));
    }
    let mut body = resp.into_body();
    let mut pending = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| e.to_string())?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        pending.extend_from_slice(data);
        while let Some(at) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=at).collect();
            let Ok(record) = serde_json::from_slice::<serde_json::Value>(&line) else {
                continue;
            };
            let mut s = state.lock();
            let seq = s.next;
            s.next += 1;
            s.records.push_back((seq, record));
            while s.records.len() > KEPT {
                s.records.pop_front();
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_known_keys_reach_the_nodes_escaped_and_rate_bounded() {
        let p = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        assert_eq!(
            node_query(&[
                p("status", "5xx"),
                p("service", "a b"),
                p("rate", "9999"),
                p("x", "y"),
                p("since", "3")
            ]),
            "service=a%20b&status=5xx&rate=20"
        );
    }
}

//! The response cache on the shard (routes with `cache`): after the chain allowed a
//! request (a denied one never reaches this), a fresh stored response answers it
//! here and it never reaches the host; a stale one is revalidated with the origin
//! (conditional request, `304` refreshes it); a miss notes that the response may be
//! stored, which happens as it goes back. Unsafe methods that succeed invalidate the
//! URL's responses (RFC 9111 §4.4).

use std::time::SystemTime;

use dpumesh_http_cache::{Entry, Lookup, Rule, policy, primary_key};
use http::header;

use super::wire_head::WireHead;
use super::*;

/// What to do with an exchange's response.
#[derive(Debug)]
pub(super) enum Pending {
    /// A miss: store the response if it may be.
    Store {
        primary: String,
        request: HeaderMap,
        request_time: SystemTime,
        rule: Rule,
    },
    /// A stale response being revalidated; `request` holds the client's own
    /// conditions, answered here once the origin said.
    Revalidate {
        primary: String,
        entry: Arc<Entry>,
        request: HeaderMap,
        request_time: SystemTime,
        rule: Rule,
        head_only: bool,
    },
    /// An unsafe method: a success invalidates the URL's responses.
    Invalidate { primary: String },
}

/// What a hit adds to the stored head (`age`, `x-cache`), and the frame's own bytes,
/// with room to spare (the local reply path keeps 512 bytes itself).
const HIT_OVERHEAD: usize = 1024;

fn rule(config: &dpumesh_config::CacheConfig) -> Rule {
    Rule {
        max_object: config.max_object() as u64,
        default_ttl: config.default_ttl.map(|s| s.0),
    }
}

impl<F: Fabric> Reactor<F> {
    /// Answers an allowed request from the cache if it can (`true`: answered), or
    /// notes what its response means for the cache.
    pub(super) fn cache_request(&mut self, xid: u32) -> bool {
        let Some(exchange) = self.table.get_mut(xid) else {
            return false;
        };
        // Routes without `cache` stop here, before anything is cloned or allocated.
        let (Some(config), Some(head), Some(cache)) = (
            exchange.policy.cache,
            exchange.head.as_mut(),
            self.topology.cache.as_ref(),
        ) else {
            return false;
        };
        let cache = cache.clone();
        let primary = primary_key(&head.authority, &head.path, head.query.as_deref());
        let head_only = match head.method.as_str() {
            "GET" => false,
            "HEAD" => true,
            "OPTIONS" | "TRACE" => return false,
            _ => {
                exchange.cache = Some(Box::new(Pending::Invalidate { primary }));
                return false;
            }
        };
        let now = SystemTime::now();
        let entry = match cache.lookup(&primary, head.headers(), now) {
            Lookup::Fresh(entry) => {
                let body = if head_only {
                    Some(Vec::new())
                } else {
                    cache.body(&primary, &entry)
                };
                if let Some(body) = body {
                    let reply = cached_head(&entry, head.headers(), now);
                    let body = if reply.status == 304 {
                        Vec::new()
                    } else {
                        body
                    };
                    cache.stats.hits.fetch_add(1, Ordering::Relaxed);
                    cache
                        .stats
                        .hit_bytes
                        .fetch_add(body.len() as u64, Ordering::Relaxed);
                    metrics::counter!("dpumesh_http_cache_hits_total").increment(1);
                    self.finish_with(
                        xid,
                        &reply,
                        body,
                        FailureKind::None,
                        Some("cache".to_owned()),
                    );
                    return true;
                }
                // The store lost its body: a miss.
                None
            }
            Lookup::Stale(entry) => Some(entry),
            Lookup::Miss => None,
        };
        cache.stats.misses.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("dpumesh_http_cache_misses_total", "stale" => entry.is_some().to_string())
            .increment(1);
        // The client's own headers, kept for what is stored and for its conditions.
        let request = head.headers().clone();
        let rule = rule(&config);
        let pending = match entry {
            Some(entry) => {
                // The origin is asked whether the stored response still holds; the
                // client's own conditions are answered here afterwards.
                for name in [
                    header::IF_NONE_MATCH,
                    header::IF_MODIFIED_SINCE,
                    header::IF_MATCH,
                    header::IF_UNMODIFIED_SINCE,
                    header::IF_RANGE,
                ] {
                    let _ = head.remove_header(name.as_str());
                }
                for (name, value) in policy::validators(&entry.headers) {
                    if let Ok(v) = value.to_str() {
                        let _ = head.set_header(name.as_str(), v);
                    }
                }
                Pending::Revalidate {
                    primary,
                    entry,
                    request,
                    request_time: now,
                    rule,
                    head_only,
                }
            }
            // A HEAD's answer has no body to store.
            None if head_only => return false,
            None => Pending::Store {
                primary,
                request,
                request_time: now,
                rule,
            },
        };
        if let Some(exchange) = self.table.get_mut(xid) {
            exchange.cache = Some(Box::new(pending));
        }
        false
    }

    /// What the cache makes of a pod's answer: a reply of its own to send instead
    /// (a revalidated response), or `None` (the answer goes back as it is; it may
    /// have been stored).
    pub(super) fn cache_response(
        &mut self,
        pending: Pending,
        d: &Descriptor,
        header: &mut WireHead<'_>,
    ) -> Option<(ResponseHead, Vec<u8>)> {
        let cache = self.topology.cache.clone()?;
        match pending {
            Pending::Invalidate { primary } => {
                if d.status < 400 {
                    cache.invalidate(&primary);
                }
                None
            }
            Pending::Store {
                primary,
                request,
                request_time,
                rule,
            } => {
                self.maybe_store(primary, &request, request_time, &rule, d, header);
                None
            }
            Pending::Revalidate {
                primary,
                entry,
                request,
                request_time,
                rule,
                head_only,
            } => {
                if d.status != 304 {
                    if !head_only {
                        self.maybe_store(primary, &request, request_time, &rule, d, header);
                    }
                    return None;
                }
                let confirmed = header.get()?;
                let now = SystemTime::now();
                let fresh = entry.refreshed(&rule, &confirmed.headers, request_time, now);
                cache.refresh(&primary, fresh.clone());
                cache.stats.revalidated.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("dpumesh_http_cache_revalidated_total").increment(1);
                let head = cached_head(&fresh, &request, now);
                let body = if head.status == 304 || head_only {
                    Vec::new()
                } else {
                    cache.body(&primary, &fresh)?
                };
                Some((head, body))
            }
        }
    }

    /// Stores a pod's answer if it may be: its body copied out of the pod's TX
    /// buffer now (the buffer goes back to the pod with the response), written to
    /// the store by its workers.
    fn maybe_store(
        &mut self,
        primary: String,
        request: &HeaderMap,
        request_time: SystemTime,
        rule: &Rule,
        d: &Descriptor,
        header: &mut WireHead<'_>,
    ) {
        let Some(cache) = self.topology.cache.clone() else {
            return;
        };
        let bytes = header.bytes();
        let Some(response) = header.get() else {
            return;
        };
        let body_len = if d.body.is_none() {
            0
        } else {
            u64::from(d.body.len)
        };
        // A hit travels in one frame with its head (and `age`, `x-cache`): a response
        // that would not fit is not stored, rather than served cut.
        if bytes.len() + body_len as usize + HIT_OVERHEAD > dpumesh_dpa::frame::MAX_FRAME {
            cache.stats.not_stored.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("dpumesh_http_cache_not_stored_total", "why" => "frame").increment(1);
            return;
        }
        // An entry keeps a head and a body; trailers (a gRPC status, a digest) would be
        // lost in it, and a hit served without them would say something else.
        if !response.trailers.is_empty() {
            cache.stats.not_stored.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("dpumesh_http_cache_not_stored_total", "why" => "trailers")
                .increment(1);
            return;
        }
        let lifetime =
            match policy::storable(rule, "GET", request, d.status, &response.headers, body_len) {
                Ok(lifetime) => lifetime,
                Err(why) => {
                    cache.stats.not_stored.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("dpumesh_http_cache_not_stored_total", "why" => why.label())
                        .increment(1);
                    return;
                }
            };
        let body = if body_len == 0 {
            Vec::new()
        } else {
            // Across PCIe the node reads the body from its staging copy.
            if let Err(e) = self.pods.port.stage_tx(d.src_pod, d.body, 0, d.body.len) {
                tracing::warn!(error = %e, "a response to store could not be staged");
                return;
            }
            match self
                .pods
                .get(d.src_pod)
                .map(|info| info.read_tx_body(d.body))
            {
                Some(Ok(bytes)) => bytes,
                _ => return,
            }
        };
        let entry = Entry::new(
            d.status,
            &response.headers,
            request,
            String::new(),
            body_len,
            lifetime,
            request_time,
            SystemTime::now(),
        );
        cache.store(primary, entry, body);
    }
}

/// The head a stored response is served with: `304` if the request's conditions
/// hold for it, else its own status and headers; with `Age`, and `x-cache: HIT`.
fn cached_head(entry: &Entry, request: &HeaderMap, now: SystemTime) -> ResponseHead {
    let (status, mut headers) =
        if policy::is_conditional(request) && policy::not_modified(request, &entry.headers) {
            (304, policy::not_modified_headers(&entry.headers))
        } else {
            (entry.status, entry.headers.clone())
        };
    headers.insert(header::AGE, HeaderValue::from(entry.age(now).as_secs()));
    headers.insert("x-cache", HeaderValue::from_static("HIT"));
    ResponseHead {
        status,
        headers,
        ..Default::default()
    }
}

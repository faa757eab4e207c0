//! The handshake counts of this process's certificates, as Prometheus metrics:
//! `dpumesh_tls_handshakes_total{result="accepted"|"refused"}` and
//! `dpumesh_tls_certificate_reloads_total`, set from the counters when an admin API
//! renders its metrics.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};

use crate::MeshTls;

static PUBLISHED: OnceLock<Arc<MeshTls>> = OnceLock::new();

/// Makes `tls` the process's certificates whose counts [`refresh`] publishes (the
/// first one set stays).
pub fn publish_from(tls: &Arc<MeshTls>) {
    let _ = PUBLISHED.set(tls.clone());
}

/// Sets the metrics from the counters (nothing when the process has no certificates).
pub fn refresh() {
    let Some(tls) = PUBLISHED.get() else {
        return;
    };
    let stats = &tls.stats;
    metrics::counter!("dpumesh_tls_handshakes_total", "result" => "accepted")
        .absolute(stats.accepted.load(Relaxed));
    metrics::counter!("dpumesh_tls_handshakes_total", "result" => "refused")
        .absolute(stats.refused.load(Relaxed));
    metrics::counter!("dpumesh_tls_certificate_reloads_total")
        .absolute(stats.reloads.load(Relaxed));
}

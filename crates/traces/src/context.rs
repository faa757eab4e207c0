//! W3C Trace Context: `traceparent` parsed and written, ids made, and the sampling
//! decision (parent-based, else a ratio of the trace id, as OpenTelemetry's
//! `parentbased_traceidratio`).

use std::cell::Cell;

pub type TraceId = [u8; 16];
pub type SpanId = [u8; 8];

/// One hop's place in a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: TraceId,
    /// The span this context names (the parent of the next hop's span).
    pub span_id: SpanId,
    pub sampled: bool,
}

fn hex_into(text: &str, out: &mut [u8]) -> Option<()> {
    let text = text.as_bytes();
    if text.len() != out.len() * 2 {
        return None;
    }
    // `to_digit` takes either case and no sign (`from_str_radix` took "+6").
    let digit = |c: u8| char::from(c).to_digit(16).map(|d| d as u8);
    for (byte, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *byte = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(())
}

const DIGITS: &[u8; 16] = b"0123456789abcdef";

fn hex_to(bytes: &[u8], out: &mut [u8]) {
    for (b, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = DIGITS[(b >> 4) as usize];
        pair[1] = DIGITS[(b & 15) as usize];
    }
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    let mut out = vec![0; bytes.len() * 2];
    hex_to(bytes, &mut out);
    // Hex digits are ASCII.
    String::from_utf8(out).unwrap_or_default()
}

/// The length of a version-00 `traceparent`.
pub const TRACEPARENT_LEN: usize = 55;

impl TraceContext {
    /// A `traceparent` value (`00-TRACEID-SPANID-FLAGS`); `None` when malformed or
    /// when its ids are all zero (the spec's invalid ids).
    pub fn parse(traceparent: &str) -> Option<Self> {
        let mut parts = traceparent.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        // Version 00 has exactly four fields; a later version may add more.
        if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        let mut trace_id = [0; 16];
        let mut span_id = [0; 8];
        hex_into(trace, &mut trace_id)?;
        hex_into(span, &mut span_id)?;
        let mut flag = [0; 1];
        hex_into(flags, &mut flag)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(Self {
            trace_id,
            span_id,
            sampled: flag[0] & 1 == 1,
        })
    }

    /// The `traceparent` value naming this context, as bytes (no allocation: a hop
    /// makes its header value from them).
    pub fn traceparent_bytes(&self) -> [u8; TRACEPARENT_LEN] {
        let mut out = *b"00-00000000000000000000000000000000-0000000000000000-00";
        hex_to(&self.trace_id, &mut out[3..35]);
        hex_to(&self.span_id, &mut out[36..52]);
        if self.sampled {
            out[54] = b'1';
        }
        out
    }

    /// The `traceparent` value naming this context.
    pub fn traceparent(&self) -> String {
        String::from_utf8_lossy(&self.traceparent_bytes()).into_owned()
    }

    /// A child of `self` with a new span id (the same trace and decision).
    pub fn child(&self) -> Self {
        Self {
            span_id: new_span_id(),
            ..*self
        }
    }
}

/// Whether a trace without a sampled parent is sampled at `ratio`: its trace id's
/// last eight bytes below `ratio` of their range (every hop decides alike).
pub fn ratio_samples(trace_id: &TraceId, ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    if ratio <= 0.0 {
        return false;
    }
    let mut low = [0; 8];
    low.copy_from_slice(&trace_id[8..]);
    let x = u64::from_be_bytes(low) >> 1;
    (x as f64) < ratio * (1u64 << 63) as f64
}

/// The context of a hop that starts or continues a trace: a child of `parent` (its
/// decision kept), or a new trace sampled at `ratio`.
pub fn start(parent: Option<&TraceContext>, ratio: f64) -> TraceContext {
    match parent {
        Some(p) => p.child(),
        None => {
            let trace_id = new_trace_id();
            TraceContext {
                trace_id,
                span_id: new_span_id(),
                sampled: ratio_samples(&trace_id, ratio),
            }
        }
    }
}

thread_local! {
    static STATE: Cell<u64> = Cell::new(seed());
}

fn seed() -> u64 {
    let mut bytes = [0; 8];
    if getrandom::fill(&mut bytes).is_err() {
        // No entropy source: the time and the thread still differ per thread.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        static THREADS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = THREADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    u64::from_le_bytes(bytes)
}

/// SplitMix64 per thread, seeded from the OS: ids need to be unique, not secret.
fn next() -> u64 {
    STATE.with(|s| {
        let mut z = s.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
        s.set(z);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

/// A new, nonzero span id.
pub fn new_span_id() -> SpanId {
    loop {
        let id = next().to_be_bytes();
        if id != [0; 8] {
            return id;
        }
    }
}

/// A new, nonzero trace id.
pub fn new_trace_id() -> TraceId {
    let mut id = [0; 16];
    id[..8].copy_from_slice(&next().to_be_bytes());
    id[8..].copy_from_slice(&new_span_id());
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_parse_and_print_and_bad_ones_are_refused() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let c = TraceContext::parse(tp).unwrap();
        assert!(c.sampled);
        assert_eq!(c.traceparent(), tp);
        let unsampled = TraceContext {
            sampled: false,
            ..c
        };
        assert_eq!(
            &unsampled.traceparent_bytes()[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
        );
        let child = c.child();
        assert_eq!(child.trace_id, c.trace_id);
        assert_ne!(child.span_id, c.span_id);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-xyz",
            // from_str_radix would take "+6" for a byte.
            "00-4bf92f3577b34da6a3ce929d0e0e47+6-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_ratio_samples_its_share_and_decides_alike_for_one_trace() {
        let n = 20_000;
        let ids: Vec<TraceId> = (0..n).map(|_| new_trace_id()).collect();
        let sampled = ids.iter().filter(|id| ratio_samples(id, 0.25)).count();
        assert!((4_500..5_500).contains(&sampled), "{sampled}");
        assert!(ids.iter().all(|id| ratio_samples(id, 1.0)));
        assert!(!ids.iter().any(|id| ratio_samples(id, 0.0)));
        // A sampled parent's decision is kept whatever the ratio.
        let parent =
            TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert!(start(Some(&parent), 0.0).sampled);
    }
}

//! Percentiles and rates over a window of probes.

use serde::Serialize;

/// RTT percentiles (microseconds) and the drop rate of a set of probes.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Sla {
    pub probes: usize,
    pub timeouts: usize,
    pub drop_rate: f64,
    pub rtt_p50_us: f64,
    pub rtt_p90_us: f64,
    pub rtt_p99_us: f64,
    pub rtt_p999_us: f64,
    pub rtt_max_us: f64,
}

/// The value below which a fraction `q` of `sorted` lies (nearest rank).
pub fn percentile(sorted: &[i64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64
}

impl Sla {
    /// From the answered probes' network RTTs (ns) and the count of network timeouts.
    pub fn of(mut rtts_ns: Vec<i64>, timeouts: usize) -> Self {
        rtts_ns.sort_unstable();
        let probes = rtts_ns.len() + timeouts;
        let us = |q: f64| percentile(&rtts_ns, q) / 1_000.0;
        Self {
            probes,
            timeouts,
            drop_rate: if probes == 0 {
                0.0
            } else {
                timeouts as f64 / probes as f64
            },
            rtt_p50_us: us(0.5),
            rtt_p90_us: us(0.9),
            rtt_p99_us: us(0.99),
            rtt_p999_us: us(0.999),
            rtt_max_us: rtts_ns.last().map_or(0.0, |v| *v as f64 / 1_000.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<i64> = (1..=100).map(|i| i * 1_000).collect();
        let s = Sla::of(v, 0);
        assert_eq!(
            (s.rtt_p50_us, s.rtt_p90_us, s.rtt_p99_us, s.rtt_max_us),
            (50.0, 90.0, 99.0, 100.0)
        );
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn the_drop_rate_counts_timeouts_among_all_probes() {
        let s = Sla::of(vec![1_000; 3], 1);
        assert_eq!((s.probes, s.timeouts, s.drop_rate), (4, 1, 0.25));
        assert_eq!(Sla::of(vec![], 0).drop_rate, 0.0);
    }
}

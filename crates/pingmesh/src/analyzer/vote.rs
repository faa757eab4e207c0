//! Localizing a faulty link or switch by voting (the paper's Algorithm 1).
//!
//! Every abnormal probe (a network timeout, or an RTT over the SLA) votes for each
//! element on its path; an element's score is its votes over the probes that crossed
//! it, so an element many healthy probes also cross scores low. The best-scoring
//! element over the threshold is blamed, the probes crossing it are taken out, and
//! the vote repeats on the rest — a greedy cover, so one fault does not also blame every
//! link next to it.

use std::collections::{BTreeMap, BTreeSet};

/// One probe's path and whether it was abnormal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathProbe<E> {
    pub path: Vec<E>,
    pub abnormal: bool,
}

/// An element blamed.
#[derive(Debug, Clone, PartialEq)]
pub struct Blame<E> {
    pub element: E,
    /// Abnormal probes it explains.
    pub votes: usize,
    /// Probes that crossed it.
    pub probes: usize,
    pub score: f64,
}

/// The elements to blame, worst first: each with at least `min_votes` votes and a
/// score of at least `min_score`.
pub fn localize<E: Ord + Clone>(
    probes: &[PathProbe<E>],
    min_votes: usize,
    min_score: f64,
) -> Vec<Blame<E>> {
    // Probes not yet explained by a blamed element: an element is judged only on
    // them, so a second fault next to the first is not diluted by the first's probes.
    let mut remaining: Vec<&PathProbe<E>> = probes.iter().collect();
    let mut blamed = Vec::new();
    loop {
        let mut crossed: BTreeMap<&E, usize> = BTreeMap::new();
        let mut votes: BTreeMap<&E, usize> = BTreeMap::new();
        for p in &remaining {
            for e in p.path.iter().collect::<BTreeSet<_>>() {
                *crossed.entry(e).or_default() += 1;
                if p.abnormal {
                    *votes.entry(e).or_default() += 1;
                }
            }
        }
        let best = votes
            .iter()
            .map(|(e, v)| {
                let total = crossed[e];
                (*e, *v, total, *v as f64 / total as f64)
            })
            .filter(|(_, v, _, score)| *v >= min_votes && *score >= min_score)
            // Highest score; on a tie, more votes; then the element's order.
            .max_by(|a, b| {
                a.3.partial_cmp(&b.3)
                    .unwrap_or(std::cmp::Ordering::Equal)
                    .then(a.1.cmp(&b.1))
                    .then(b.0.cmp(a.0))
            });
        let Some((element, v, total, score)) = best else {
            break;
        };
        let element = element.clone();
        remaining.retain(|p| !p.path.contains(&element));
        blamed.push(Blame {
            element,
            votes: v,
            probes: total,
            score,
        });
    }
    blamed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(path: &[&'static str], abnormal: bool) -> PathProbe<&'static str> {
        PathProbe {
            path: path.to_vec(),
            abnormal,
        }
    }

    /// Two ToRs (A, B) with hosts a1..a3 and b1..b3: every pair's path.
    fn mesh(mut abnormal: impl FnMut(&[&'static str]) -> bool) -> Vec<PathProbe<&'static str>> {
        let hosts = ["a1", "a2", "a3", "b1", "b2", "b3"];
        let link = |h: &str| -> &'static str {
            match h {
                "a1" => "a1-A",
                "a2" => "a2-A",
                "a3" => "a3-A",
                "b1" => "b1-B",
                "b2" => "b2-B",
                _ => "b3-B",
            }
        };
        let mut out = Vec::new();
        for s in hosts {
            for d in hosts {
                if s == d {
                    continue;
                }
                let mut path = vec![link(s)];
                if s.as_bytes()[0] != d.as_bytes()[0] {
                    path.push("A-B");
                }
                path.push(link(d));
                for _ in 0..10 {
                    let ab = abnormal(&path);
                    out.push(probe(&path, ab));
                }
            }
        }
        out
    }

    #[test]
    fn a_slow_inter_tor_link_is_blamed_alone() {
        let probes = mesh(|p| p.contains(&"A-B"));
        let blamed = localize(&probes, 5, 0.5);
        assert_eq!(blamed.len(), 1, "{blamed:?}");
        assert_eq!(blamed[0].element, "A-B");
        assert_eq!(blamed[0].score, 1.0);
    }

    #[test]
    fn a_lossy_host_link_is_blamed_not_its_neighbours() {
        // Half of the probes through a2's link are lost.
        let mut i = 0;
        let probes = mesh(|p| {
            i += 1;
            p.contains(&"a2-A") && i % 2 == 0
        });
        let blamed = localize(&probes, 5, 0.3);
        assert_eq!(blamed.len(), 1, "{blamed:?}");
        assert_eq!(blamed[0].element, "a2-A");
        assert!((blamed[0].score - 0.5).abs() < 0.05);
    }

    #[test]
    fn a_healthy_network_blames_nothing() {
        let mut i = 0;
        // One stray slow probe in a thousand.
        let probes = mesh(|_| {
            i += 1;
            i % 1000 == 0
        });
        assert!(localize(&probes, 5, 0.3).is_empty());
    }

    #[test]
    fn two_faults_are_both_found() {
        let probes = mesh(|p| p.contains(&"A-B") || p.contains(&"a1-A"));
        let blamed: Vec<_> = localize(&probes, 5, 0.5)
            .into_iter()
            .map(|b| b.element)
            .collect();
        assert_eq!(blamed.len(), 2, "{blamed:?}");
        assert!(blamed.contains(&"A-B") && blamed.contains(&"a1-A"));
    }
}

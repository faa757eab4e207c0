//! Pinglists: whom each RNIC probes, along which 5-tuples.
//!
//! - ToR-mesh: every other RNIC under the prober's ToR, one tuple each — a fault
//!   there involves one host link, one RNIC or the ToR.
//! - Inter-ToR: under every other ToR, a sample of RNICs (different probers pick
//!   different ones, and the pick rotates), each with as many tuples as formula (1)
//!   asks for the configured ECMP paths and coverage.
//!
//! Tuples differ by flow label (the entropy a RoCEv2 NIC turns into the UDP source
//! port). Labels and samples derive from the rotation generation, so every
//! `rotate_every` the mesh walks other paths; a pinglist is a pure function of the
//! registry, the prober and the generation.

use std::collections::BTreeMap;
use std::time::Duration;

use dpumesh_dpa::fabric::ud::Gid;

use crate::ecmp;
use crate::registry::Rnic;

/// How pinglists are made.
#[derive(Debug, Clone, PartialEq)]
pub struct PinglistPolicy {
    /// One probe per target every `interval`.
    pub interval: Duration,
    /// A probe unanswered this long is a timeout.
    pub timeout: Duration,
    /// RNICs probed under each other ToR.
    pub inter_tor_targets: usize,
    /// Equal-cost paths between two ToRs.
    pub ecmp_paths: u32,
    /// Probability that an inter-ToR target's tuples cover every path.
    pub coverage: f64,
    /// New tuples (and a new inter-ToR sample) this often.
    pub rotate_every: Duration,
}

impl Default for PinglistPolicy {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(500),
            inter_tor_targets: 2,
            ecmp_paths: 4,
            coverage: 0.99,
            rotate_every: Duration::from_secs(300),
        }
    }
}

impl PinglistPolicy {
    /// The rotation generation at `now_ms` (Unix milliseconds).
    pub fn generation(&self, now_ms: u64) -> u64 {
        now_ms / (self.rotate_every.as_millis() as u64).max(1)
    }
}

/// Which list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ListKind {
    TorMesh,
    InterTor,
}

/// One 5-tuple to probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub rnic: Rnic,
    pub flow_label: u32,
    pub kind: ListKind,
}

/// A 64-bit mix (splitmix64's finalizer): cheap, and a change of any input moves
/// every output bit.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn gid_word(g: &Gid) -> u64 {
    let mut a = [0u8; 8];
    let mut b = [0u8; 8];
    a.copy_from_slice(&g.0[..8]);
    b.copy_from_slice(&g.0[8..]);
    u64::from_le_bytes(a) ^ u64::from_le_bytes(b).rotate_left(17)
}

/// The flow label of tuple `i` from `prober` to `target` in `generation`: 20 bits,
/// never 0 (0 means "no entropy").
pub fn flow_label(prober: &Gid, target: &Gid, generation: u64, i: u32) -> u32 {
    let h = mix(gid_word(prober) ^ mix(gid_word(target) ^ mix(generation ^ (u64::from(i) << 40))));
    ((h as u32) & 0xF_FFFF).max(1)
}

/// The ToR-mesh list of `prober` among `same_tor` (its ToR's RNICs, itself included).
pub fn tor_mesh(prober: &Rnic, same_tor: &[Rnic], generation: u64) -> Vec<Target> {
    same_tor
        .iter()
        .filter(|r| r.gid != prober.gid)
        .map(|r| Target {
            flow_label: flow_label(&prober.gid, &r.gid, generation, 0),
            rnic: r.clone(),
            kind: ListKind::TorMesh,
        })
        .collect()
}

/// The inter-ToR list of `prober` among `all` registered RNICs.
pub fn inter_tor(
    prober: &Rnic,
    all: &[Rnic],
    policy: &PinglistPolicy,
    generation: u64,
) -> Vec<Target> {
    let mut by_tor: BTreeMap<&str, Vec<Rnic>> = BTreeMap::new();
    for r in all {
        by_tor.entry(&r.tor_id).or_default().push(r.clone());
    }
    inter_tor_grouped(
        prober,
        by_tor.values().map(Vec::as_slice),
        policy,
        generation,
    )
}

/// [`inter_tor`] over RNICs already grouped by ToR (the controller keeps them so).
pub fn inter_tor_grouped<'a>(
    prober: &Rnic,
    tors: impl Iterator<Item = &'a [Rnic]>,
    policy: &PinglistPolicy,
    generation: u64,
) -> Vec<Target> {
    let tuples = ecmp::tuples_needed(policy.ecmp_paths, policy.coverage);
    let me = gid_word(&prober.gid);
    let mut out = Vec::new();
    let mut keyed: Vec<(u64, usize)> = Vec::new();
    for rnics in tors {
        if rnics.first().is_none_or(|r| r.tor_id == prober.tor_id) {
            continue;
        }
        // A different order per prober and generation: the sample spreads over the
        // ToR's hosts and moves with the rotation. Only the first few are needed,
        // so they are selected, not sorted.
        keyed.clear();
        keyed.extend(
            rnics
                .iter()
                .enumerate()
                .map(|(i, r)| (mix(me ^ mix(gid_word(&r.gid) ^ generation)), i)),
        );
        let k = policy.inter_tor_targets.min(keyed.len());
        if k == 0 {
            continue;
        }
        if k < keyed.len() {
            keyed.select_nth_unstable(k - 1);
        }
        let picked = &mut keyed[..k];
        picked.sort_unstable();
        for &(_, i) in picked.iter() {
            let r = &rnics[i];
            for t in 0..tuples {
                out.push(Target {
                    rnic: r.clone(),
                    flow_label: flow_label(&prober.gid, &r.gid, generation, t),
                    kind: ListKind::InterTor,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::contract::rnic;

    fn topology() -> Vec<Rnic> {
        let mut all = Vec::new();
        for n in 1..=3 {
            all.push(rnic(n, "tor-a", 0));
        }
        for n in 4..=9 {
            all.push(rnic(n, "tor-b", 0));
        }
        for n in 10..=12 {
            all.push(rnic(n, "tor-c", 0));
        }
        all
    }

    #[test]
    fn the_tor_mesh_is_every_other_rnic_under_the_tor() {
        let all = topology();
        let tor_a: Vec<_> = all
            .iter()
            .filter(|r| r.tor_id == "tor-a")
            .cloned()
            .collect();
        let list = tor_mesh(&all[0], &tor_a, 1);
        let qpns: Vec<_> = list.iter().map(|t| t.rnic.qpn).collect();
        assert_eq!(qpns, vec![102, 103]);
        assert!(
            list.iter()
                .all(|t| t.kind == ListKind::TorMesh && t.flow_label != 0)
        );
    }

    #[test]
    fn inter_tor_samples_each_other_tor_with_formula_one_tuples() {
        let all = topology();
        let policy = PinglistPolicy {
            inter_tor_targets: 2,
            ecmp_paths: 4,
            coverage: 0.99,
            ..PinglistPolicy::default()
        };
        let k = ecmp::tuples_needed(4, 0.99) as usize;
        let list = inter_tor(&all[0], &all, &policy, 7);
        assert_eq!(list.len(), 2 * 2 * k, "two ToRs, two targets, k tuples");
        for tor in ["tor-b", "tor-c"] {
            let mut targets: Vec<_> = list
                .iter()
                .filter(|t| t.rnic.tor_id == tor)
                .map(|t| t.rnic.qpn)
                .collect();
            targets.dedup();
            assert_eq!(targets.len(), 2, "{tor}");
        }
        assert!(list.iter().all(|t| t.rnic.tor_id != "tor-a"));
        let mut labels: Vec<_> = list.iter().map(|t| t.flow_label).collect();
        labels.sort();
        labels.dedup();
        assert!(
            labels.len() > list.len() * 9 / 10,
            "tuples differ in entropy"
        );
    }

    #[test]
    fn rotation_changes_the_tuples_and_the_sample() {
        let all = topology();
        let policy = PinglistPolicy::default();
        let a = inter_tor(&all[0], &all, &policy, 1);
        let b = inter_tor(&all[0], &all, &policy, 2);
        assert_ne!(
            a.iter().map(|t| t.flow_label).collect::<Vec<_>>(),
            b.iter().map(|t| t.flow_label).collect::<Vec<_>>()
        );
        // Same generation, same list: agents may ask again and again.
        assert_eq!(a, inter_tor(&all[0], &all, &policy, 1));
        // Over generations every host of tor-b is probed by someone.
        let mut seen = std::collections::BTreeSet::new();
        for g in 0..50 {
            for t in inter_tor(&all[0], &all, &policy, g) {
                seen.insert(t.rnic.qpn);
            }
        }
        assert!((104..=109).all(|q| seen.contains(&q)), "{seen:?}");
    }

    #[test]
    fn the_generation_steps_with_the_rotation_period() {
        let p = PinglistPolicy {
            rotate_every: Duration::from_secs(10),
            ..PinglistPolicy::default()
        };
        assert_eq!(p.generation(9_999), 0);
        assert_eq!(p.generation(10_000), 1);
    }
}

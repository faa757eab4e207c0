//! Pinglists: whom each RNIC probes, along which 5-tuples.
//!
//! - ToR-mesh: every other RNIC under the prober's ToR, one tuple each — a fault
//!   there involves one host link, one RNIC or the ToR.
//! - Inter-ToR: a ToR's RNICs share out the other ToRs, `inter_tor_probers` of them
//!   probing each; an RNIC probes at most `inter_tor_tors` other ToRs in a rotation
//!   (past that the ToRs take turns over rotations), so its list is bounded by
//!   configuration, not by the number of racks, and the mesh's probing grows with
//!   its RNICs, not with its size squared. Under each of its ToRs the RNIC probes a
//!   sample of RNICs (different probers pick different ones, and the pick rotates),
//!   each with as many tuples as formula (1) asks for the configured ECMP paths and
//!   coverage.
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
    /// RNICs of a ToR that probe each other ToR in a rotation (all of them when the
    /// ToR has fewer).
    pub inter_tor_probers: usize,
    /// Other ToRs one RNIC probes in a rotation, at most: the bound on its inter-ToR
    /// list. A mesh with more than `RNICs a ToR × inter_tor_tors / inter_tor_probers`
    /// other ToRs covers them over several rotations.
    pub inter_tor_tors: usize,
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
            inter_tor_probers: 2,
            inter_tor_tors: 16,
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

/// A ToR's name as a word (FNV-1a), for orders every RNIC of the mesh agrees on.
fn tor_word(tor: &str) -> u64 {
    tor.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
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
    let my_tor = tor_word(&prober.tor_id);
    let mut peers: &[Rnic] = &[];
    // The other ToRs in an order of this ToR's: every RNIC of the ToR computes the
    // same one, so they share the ToRs out without talking.
    let mut others: Vec<(u64, &str, &[Rnic])> = Vec::new();
    for rnics in tors {
        let Some(first) = rnics.first() else { continue };
        if first.tor_id == prober.tor_id {
            peers = rnics;
        } else {
            let key = mix(my_tor ^ mix(tor_word(&first.tor_id)));
            others.push((key, &first.tor_id, rnics));
        }
    }
    others.sort_unstable_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    let (rank, size) = duty(prober, peers, generation);
    let probers = policy.inter_tor_probers.clamp(1, size);
    // The ToRs this ToR covers in a rotation: each of its RNICs probes at most
    // `inter_tor_tors`, so `window` of them in all. The window moves on by itself
    // each rotation, so every ToR pair is probed within ⌈ToRs / window⌉ rotations.
    let window = (policy.inter_tor_tors.max(1) * size / probers).max(1);
    let turn = if others.is_empty() {
        0
    } else {
        let k = others.len() as u64;
        ((generation % k) * (window as u64 % k) % k) as usize
    };
    let duties = (0..window.min(others.len()))
        // ToR j is probed by the ranks j·probers … j·probers + probers − 1 (mod size).
        .filter(|j| (rank + size - (j * probers) % size) % size < probers)
        .map(|j| others[(turn + j) % others.len()]);
    let mut out = Vec::new();
    let mut keyed: Vec<(u64, usize)> = Vec::new();
    for (_, _, rnics) in duties {
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

/// The prober's rank among its ToR's RNICs in this rotation, and their number (the
/// prober counted when it is not registered yet).
fn duty(prober: &Rnic, peers: &[Rnic], generation: u64) -> (usize, usize) {
    let key = |g: &Gid| (mix(gid_word(g) ^ mix(generation ^ 0x9e37_79b9)), g.0);
    let me = key(&prober.gid);
    let others = peers.iter().filter(|r| r.gid != prober.gid);
    let (mut below, mut size) = (0, 1);
    for r in others {
        size += 1;
        if key(&r.gid) < me {
            below += 1;
        }
    }
    (below, size)
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
            // Every RNIC of tor-a (three) probes every other ToR.
            inter_tor_probers: 3,
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

    /// `tors` ToRs of `size` RNICs each.
    fn racks(tors: usize, size: usize) -> Vec<Rnic> {
        let mut all = Vec::new();
        for t in 0..tors {
            for n in 0..size {
                let mut r = rnic(1, &format!("tor-{t}"), 0);
                let ip = std::net::Ipv4Addr::from(0x0a00_0000 + (t * 64 + n) as u32);
                r.gid = Gid::from_ip(ip.into());
                r.rnic_ip = ip.into();
                all.push(r);
            }
        }
        all
    }

    /// For each ToR pair (prober's ToR, target's ToR): how many of the prober's ToR's
    /// RNICs probe the target's, over one generation.
    fn pairs(
        all: &[Rnic],
        policy: &PinglistPolicy,
        generation: u64,
    ) -> BTreeMap<(String, String), usize> {
        let mut pairs = BTreeMap::new();
        for prober in all {
            let mut tors: Vec<_> = inter_tor(prober, all, policy, generation)
                .into_iter()
                .map(|t| t.rnic.tor_id)
                .collect();
            tors.dedup();
            for tor in tors {
                *pairs.entry((prober.tor_id.clone(), tor)).or_default() += 1;
            }
        }
        pairs
    }

    #[test]
    fn a_tors_rnics_share_out_the_other_tors() {
        let all = racks(6, 4);
        let policy = PinglistPolicy {
            ecmp_paths: 1,
            ..PinglistPolicy::default()
        };
        for generation in [1, 2, 3] {
            let pairs = pairs(&all, &policy, generation);
            // Every ordered pair of the 6 ToRs, each by exactly two probers.
            assert_eq!(pairs.len(), 6 * 5, "generation {generation}");
            assert!(pairs.values().all(|&n| n == 2), "{pairs:?}");
        }
        // Each RNIC probes 5 × 2 / 4 = 2 or 3 ToRs, not all 5.
        for prober in &all {
            let mut tors: Vec<_> = inter_tor(prober, &all, &policy, 1)
                .into_iter()
                .map(|t| t.rnic.tor_id)
                .collect();
            tors.dedup();
            assert!((2..=3).contains(&tors.len()), "{}: {tors:?}", prober.tor_id);
        }
    }

    #[test]
    fn an_rnics_list_is_bounded_by_configuration_not_by_the_racks() {
        let policy = PinglistPolicy {
            ecmp_paths: 1,
            inter_tor_tors: 4,
            ..PinglistPolicy::default()
        };
        let longest = |tors: usize| {
            let all = racks(tors, 4);
            all.iter()
                .map(|p| inter_tor(p, &all, &policy, 1).len())
                .max()
                .unwrap()
        };
        // Two targets under each of at most four ToRs.
        assert_eq!(longest(3), 2, "two other ToRs between four RNICs: one each");
        assert_eq!(longest(40), 2 * 4);
        assert_eq!(longest(200), 2 * 4);
        // Past the bound the ToRs take turns: a ToR's four RNICs cover 4 × 4 / 2 = 8
        // ToRs a rotation, so every pair is probed within ⌈39 / 8⌉ = 5 rotations.
        let all = racks(40, 4);
        let mut seen = std::collections::BTreeSet::new();
        for generation in 100..105 {
            seen.extend(pairs(&all, &policy, generation).into_keys());
        }
        assert_eq!(seen.len(), 40 * 39);
    }

    #[test]
    fn a_tor_of_one_rnic_probes_every_other_tor_up_to_the_bound() {
        let all = racks(5, 1);
        let policy = PinglistPolicy {
            ecmp_paths: 1,
            ..PinglistPolicy::default()
        };
        let list = inter_tor(&all[0], &all, &policy, 9);
        assert_eq!(
            list.len(),
            4,
            "one target under each of the other four ToRs"
        );
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

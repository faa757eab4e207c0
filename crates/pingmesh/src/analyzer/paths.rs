//! Traced paths: the hops an agent's traceroute found between two RNICs, checked on
//! the way in, and the elements they name for the voting.
//!
//! Routers answer from the address of the interface facing the prober, so one router
//! has a different address on each side (alias resolution is traceroute's old
//! problem). What the registry knows resolves the two that matter: the first hop is
//! the prober's ToR and the hop before the target is the target's ToR. Hops between
//! (spines) keep their addresses.

use std::net::IpAddr;

use dpumesh_dpa::fabric::ud::Gid;
use serde::Serialize;

use super::Element;
use crate::convert::{self, FieldError};
use crate::proto;
use crate::registry::Rnic;

/// The most hops believed.
const MAX_HOPS: usize = 64;

/// One pair's latest trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Traced {
    /// When the analyzer got it (Unix ms).
    pub at_ms: u64,
    /// By TTL from 1; `None` where nobody answered.
    pub hops: Vec<Option<IpAddr>>,
    pub reached: bool,
}

/// A traced path as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PathView {
    pub src: String,
    pub dst: String,
    /// The routers' addresses ("*": no answer).
    pub hops: Vec<String>,
    /// The same with the ToRs named.
    pub names: Vec<String>,
    pub reached: bool,
    pub age_ms: u64,
}

/// A checked trace: its pair and its hops.
pub fn from_proto(
    p: &proto::PathInfo,
    at_ms: u64,
    at: &str,
) -> Result<((Gid, Gid), Traced), FieldError> {
    let t = p.tuple.as_ref().ok_or_else(|| FieldError {
        field: format!("{at}.tuple"),
        detail: "missing".into(),
    })?;
    let src = convert::gid(&format!("{at}.tuple.src_gid"), &t.src_gid)?;
    let dst = convert::gid(&format!("{at}.tuple.dst_gid"), &t.dst_gid)?;
    if p.hops.len() > MAX_HOPS {
        return Err(FieldError {
            field: format!("{at}.hops"),
            detail: format!("{} hops (at most {MAX_HOPS})", p.hops.len()),
        });
    }
    let hops = p
        .hops
        .iter()
        .enumerate()
        .map(|(i, h)| {
            if h.ip.is_empty() {
                Ok(None)
            } else {
                convert::ip(&format!("{at}.hops[{i}].ip"), &h.ip).map(Some)
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((
        (src, dst),
        Traced {
            at_ms,
            hops,
            reached: p.reached,
        },
    ))
}

/// The routers' names along a complete trace: the ToRs by name, others by address.
/// `None` when the trace is not complete (a silent hop, the target not reached, or
/// no router at all).
pub fn names(src: &Rnic, dst: &Rnic, t: &Traced) -> Option<Vec<String>> {
    let hops: Vec<IpAddr> = t.hops.iter().copied().collect::<Option<_>>()?;
    if !t.reached || hops.is_empty() {
        return None;
    }
    let n = hops.len();
    Some(
        hops.iter()
            .enumerate()
            .map(|(i, h)| {
                if i == 0 {
                    src.tor_id.clone()
                } else if i == n - 1 {
                    dst.tor_id.clone()
                } else {
                    h.to_string()
                }
            })
            .collect(),
    )
}

/// The elements of a traced path: host links at both ends, every router, the links
/// between (ToR to ToR is the inter-ToR link; anything else a link by its names).
pub fn elements(
    src: &Rnic,
    dst: &Rnic,
    names: &[String],
    tors: &dyn Fn(&str) -> bool,
) -> Vec<Element> {
    let (Some(first), Some(last)) = (names.first(), names.last()) else {
        return Vec::new();
    };
    let mut out = vec![Element::HostLink {
        node: src.agent_id.clone(),
        tor: first.clone(),
    }];
    for (i, name) in names.iter().enumerate() {
        if i > 0 {
            let prev = &names[i - 1];
            if prev == name {
                continue;
            }
            let (a, b) = if prev < name {
                (prev, name)
            } else {
                (name, prev)
            };
            out.push(if tors(a) && tors(b) {
                Element::InterTor {
                    a: a.clone(),
                    b: b.clone(),
                }
            } else {
                Element::Link {
                    a: a.clone(),
                    b: b.clone(),
                }
            });
        }
        out.push(Element::Switch { tor: name.clone() });
    }
    out.push(Element::HostLink {
        node: dst.agent_id.clone(),
        tor: last.clone(),
    });
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::contract::rnic;

    fn traced(hops: &[&str], reached: bool) -> Traced {
        Traced {
            at_ms: 0,
            hops: hops
                .iter()
                .map(|h| (!h.is_empty()).then(|| h.parse().unwrap()))
                .collect(),
            reached,
        }
    }

    #[test]
    fn the_first_and_last_hops_are_the_tors_and_a_spine_keeps_its_address() {
        let (a, b) = (rnic(1, "tor-a", 0), rnic(4, "tor-b", 0));
        let t = traced(&["10.0.1.254", "10.9.0.1", "10.0.0.6"], true);
        let n = names(&a, &b, &t).unwrap();
        assert_eq!(n, ["tor-a", "10.9.0.1", "tor-b"]);
        let e = elements(&a, &b, &n, &|x| x.starts_with("tor-"));
        assert!(e.contains(&Element::Link {
            a: "10.9.0.1".into(),
            b: "tor-a".into()
        }));
        assert!(e.contains(&Element::Switch {
            tor: "10.9.0.1".into()
        }));
        assert!(
            !e.iter().any(|x| matches!(x, Element::InterTor { .. })),
            "{e:?}"
        );
    }

    #[test]
    fn two_tors_back_to_back_are_the_inter_tor_link() {
        let (a, b) = (rnic(1, "tor-a", 0), rnic(4, "tor-b", 0));
        let n = names(&a, &b, &traced(&["10.0.1.254", "10.0.0.2"], true)).unwrap();
        let e = elements(&a, &b, &n, &|x| x.starts_with("tor-"));
        assert_eq!(
            e,
            vec![
                Element::HostLink {
                    node: "node-1".into(),
                    tor: "tor-a".into()
                },
                Element::Switch {
                    tor: "tor-a".into()
                },
                Element::InterTor {
                    a: "tor-a".into(),
                    b: "tor-b".into()
                },
                Element::Switch {
                    tor: "tor-b".into()
                },
                Element::HostLink {
                    node: "node-4".into(),
                    tor: "tor-b".into()
                },
            ]
        );
    }

    #[test]
    fn an_incomplete_trace_names_nothing() {
        let (a, b) = (rnic(1, "tor-a", 0), rnic(4, "tor-b", 0));
        assert_eq!(names(&a, &b, &traced(&["10.0.1.254", ""], true)), None);
        assert_eq!(names(&a, &b, &traced(&["10.0.1.254"], false)), None);
        assert_eq!(names(&a, &b, &traced(&[], true)), None);
    }

    #[test]
    fn a_bad_hop_is_named() {
        let p = proto::PathInfo {
            tuple: Some(proto::FiveTuple {
                src_gid: "10.0.0.1".into(),
                dst_gid: "10.0.0.2".into(),
                ..Default::default()
            }),
            hops: vec![proto::Hop {
                ttl: 1,
                ip: "nope".into(),
                rtt_ns: 0,
            }],
            reached: true,
            traced_at_ms: 0,
        };
        assert_eq!(
            from_proto(&p, 0, "paths[0]").unwrap_err().field,
            "paths[0].hops[0].ip"
        );
    }
}

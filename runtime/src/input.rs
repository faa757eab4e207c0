//! The input of a batched call (`handle-request`, WIT 0.1.1): what a filter reads on
//! every request, in one byte list, so the call needs one allocation in the guest
//! instead of a host call (and an allocation) per value.
//!
//! Encoding, version 1 (little-endian; `str` is a `u32` length and UTF-8 bytes, `opt`
//! a byte 0 for none or 1 followed by a `str`):
//!
//! ```text
//! u8 version | u8 scheme (0 http, 1 https) | u64 wall ns | u64 monotonic ns
//! str method | str authority | str path | opt query | opt destination
//! str source address | u16 source port | opt source identity
//! for each declared header:        u32 count, count × str (every value, in order)
//! for each declared metadata key:  opt value
//! ```
//!
//! Everything up to the declared part is the same for every filter of a chain run
//! (filters cannot edit the request line, query, destination or source), so the chain
//! encodes it once ([`common`]) and each call appends its filter's declared values
//! ([`declared`]) as the head is then. The times are when the chain started on the
//! request. `docs/writing-filters.md` documents the same for SDK authors; the Rust
//! SDK's decoder (`dpumesh_filter_sdk::input`) is tested against this encoder.

use dpumesh_head::RequestHead;

/// The encoding's version, its first byte.
pub const VERSION: u8 = 1;

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Heads are bounded far below 4 GiB (the ingress's max_head), so lengths fit.
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_opt(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        None => out.push(0),
        Some(s) => {
            out.push(1);
            put_str(out, s);
        }
    }
}

/// The part of the input every filter of a chain run shares.
pub fn common(head: &RequestHead, wall_ns: u64, monotonic_ns: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        64 + head.method.len()
            + head.authority.len()
            + head.path.len()
            + head.query.as_ref().map_or(0, String::len),
    );
    out.push(VERSION);
    out.push(u8::from(head.scheme.eq_ignore_ascii_case("https")));
    out.extend_from_slice(&wall_ns.to_le_bytes());
    out.extend_from_slice(&monotonic_ns.to_le_bytes());
    put_str(&mut out, &head.method);
    put_str(&mut out, &head.authority);
    put_str(&mut out, &head.path);
    put_opt(&mut out, head.query.as_deref());
    put_opt(&mut out, head.destination.as_deref());
    put_str(&mut out, &head.source.addr.ip().to_string());
    out.extend_from_slice(&head.source.addr.port().to_le_bytes());
    put_opt(&mut out, head.source.identity.as_deref());
    out
}

/// Appends the values of the declared `headers` and `metadata` keys, read from `head`
/// now.
pub fn declared(out: &mut Vec<u8>, head: &RequestHead, headers: &[String], metadata: &[String]) {
    for name in headers {
        let values = head.header_all(name);
        out.extend_from_slice(&(values.len() as u32).to_le_bytes());
        for v in &values {
            put_str(out, v);
        }
    }
    for key in metadata {
        put_opt(out, head.metadata(key));
    }
}

//! The input of a batched call (`handle-request`, WIT 0.1.1): what a filter reads on
//! every request, in one byte list, so the call needs one allocation in the guest
//! instead of a host call (and an allocation) per value, and the guest reads it in
//! place without allocating.
//!
//! Encoding, version 1 (little-endian):
//!
//! ```text
//! u8 version | u8 scheme (0 http, 1 https) | u16 source port | u32 field count N
//! u64 wall ns | u64 monotonic ns
//! N × (u32 offset, u32 length) into the text; length 0xFFFF_FFFF = absent
//! text: UTF-8, every field's bytes
//! ```
//!
//! Fields in order: method, authority, path, query, destination, source address,
//! source identity, then one per declared header (every value, joined by `\n`, which
//! no header value contains; absent when the header is), then one per declared
//! metadata key. The times are when the chain started on the request. The SDK checks
//! the whole text as UTF-8 once, then hands out slices of it. `docs/writing-filters.md`
//! documents this for SDK authors; the Rust SDK's reader (`dpumesh_filter_sdk::input`)
//! is tested against this writer.

use dpumesh_head::RequestHead;

/// The encoding's version, its first byte.
pub const VERSION: u8 = 1;
/// A field's length when it is absent.
pub const ABSENT: u32 = u32::MAX;
/// Fields before the declared ones.
pub const FIXED_FIELDS: usize = 7;

/// What every filter call of one chain run shares.
#[derive(Debug, Clone)]
pub struct Shared {
    /// The source address as text (formatted once per chain run).
    pub source_address: String,
    pub wall_ns: u64,
    pub monotonic_ns: u64,
}

impl Shared {
    /// The shared part for `head` at the given times.
    pub fn new(head: &RequestHead, wall_ns: u64, monotonic_ns: u64) -> Self {
        Self {
            source_address: address_text(head.source.addr.ip()),
            wall_ns,
            monotonic_ns,
        }
    }
}

/// An address as text; IPv4 (the common case) without the formatting machinery, which
/// cost more than the rest of the encoding.
fn address_text(ip: std::net::IpAddr) -> String {
    match ip {
        std::net::IpAddr::V4(v4) => {
            let mut out = String::with_capacity(15);
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                if octet >= 100 {
                    out.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    out.push(char::from(b'0' + octet / 10 % 10));
                }
                out.push(char::from(b'0' + octet % 10));
            }
            out
        }
        v6 => v6.to_string(),
    }
}

/// Writes the input for a filter declaring `headers` and `metadata` into `out`
/// (cleared first), from `head` as it is now.
pub fn encode(
    out: &mut Vec<u8>,
    head: &RequestHead,
    shared: &Shared,
    headers: &[String],
    metadata: &[String],
) {
    out.clear();
    let fields = FIXED_FIELDS + headers.len() + metadata.len();
    out.push(VERSION);
    out.push(u8::from(head.scheme.eq_ignore_ascii_case("https")));
    out.extend_from_slice(&head.source.addr.port().to_le_bytes());
    out.extend_from_slice(&(fields as u32).to_le_bytes());
    out.extend_from_slice(&shared.wall_ns.to_le_bytes());
    out.extend_from_slice(&shared.monotonic_ns.to_le_bytes());
    let table = out.len();
    out.resize(table + fields * 8, 0);
    let mut w = Writer {
        out,
        table,
        text: table + fields * 8,
        index: 0,
    };
    w.field(Some(head.method.as_bytes()));
    w.field(Some(head.authority.as_bytes()));
    w.field(Some(head.path.as_bytes()));
    w.field(head.query.as_deref().map(str::as_bytes));
    w.field(head.destination.as_deref().map(str::as_bytes));
    w.field(Some(shared.source_address.as_bytes()));
    w.field(head.source.identity.as_deref().map(str::as_bytes));
    for name in headers {
        let values = head.headers().get_all(name.as_str());
        let mut values = values.iter().peekable();
        if values.peek().is_none() {
            w.field(None);
            continue;
        }
        let start = w.out.len();
        for (i, value) in values.enumerate() {
            if i > 0 {
                w.out.push(b'\n');
            }
            match value.to_str() {
                Ok(s) => w.out.extend_from_slice(s.as_bytes()),
                // Bytes beyond ASCII (obs-text), as the header imports read them.
                Err(_) => w
                    .out
                    .extend_from_slice(String::from_utf8_lossy(value.as_bytes()).as_bytes()),
            }
        }
        w.entry(start, w.out.len() - start);
    }
    for key in metadata {
        w.field(head.metadata(key).map(str::as_bytes));
    }
}

struct Writer<'a> {
    out: &'a mut Vec<u8>,
    table: usize,
    text: usize,
    index: usize,
}

impl Writer<'_> {
    /// Appends `value` to the text and records it.
    fn field(&mut self, value: Option<&[u8]>) {
        match value {
            Some(bytes) => {
                let start = self.out.len();
                self.out.extend_from_slice(bytes);
                self.entry(start, bytes.len());
            }
            None => self.set(0, ABSENT),
        }
    }

    /// Records the text written from `start` on, `len` bytes.
    fn entry(&mut self, start: usize, len: usize) {
        // Heads are bounded far below 4 GiB (the ingress's max_head), so these fit.
        self.set((start - self.text) as u32, len as u32);
    }

    fn set(&mut self, offset: u32, len: u32) {
        let at = self.table + self.index * 8;
        self.out[at..at + 4].copy_from_slice(&offset.to_le_bytes());
        self.out[at + 4..at + 8].copy_from_slice(&len.to_le_bytes());
        self.index += 1;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn addresses_read_as_the_standard_library_writes_them() {
        for ip in [
            "0.0.0.0",
            "10.1.20.255",
            "127.0.0.1",
            "192.168.100.9",
            "::1",
            "fd00::7",
        ] {
            let ip: std::net::IpAddr = ip.parse().unwrap();
            assert_eq!(super::address_text(ip), ip.to_string());
        }
    }
}

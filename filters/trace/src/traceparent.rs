//! W3C Trace Context `traceparent` (<https://www.w3.org/TR/trace-context/>), parsed
//! strictly: a malformed header is replaced, never forwarded.

/// A parsed `traceparent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// 16 bytes, not all zero.
    pub trace_id: [u8; 16],
    /// 8 bytes, not all zero.
    pub parent_id: [u8; 8],
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

/// The value of a lower-case hex digit; 0xff for anything else.
const DIGIT: [u8; 256] = {
    let mut table = [0xffu8; 256];
    let mut c = 0;
    while c < 10 {
        table[b'0' as usize + c] = c as u8;
        c += 1;
    }
    let mut c = 0;
    while c < 6 {
        table[b'a' as usize + c] = 10 + c as u8;
        c += 1;
    }
    table
};

/// Decodes `input` (exactly two lower-case hex digits per byte of `out`).
fn hex_lower(input: &[u8], out: &mut [u8]) -> Option<()> {
    if input.len() != out.len() * 2 {
        return None;
    }
    for (byte, pair) in out.iter_mut().zip(input.chunks_exact(2)) {
        let (hi, lo) = (DIGIT[usize::from(pair[0])], DIGIT[usize::from(pair[1])]);
        if (hi | lo) == 0xff {
            return None;
        }
        *byte = hi << 4 | lo;
    }
    Some(())
}

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    push_hex(&mut s, bytes);
    s
}

/// Appends `bytes` as lower-case hex digits. Ids are formatted by hand, and through a
/// stack buffer rather than a `push` per digit: both showed in the filter's profile,
/// at a few ids per request.
pub fn push_hex(out: &mut String, bytes: &[u8]) {
    let mut buf = [0u8; 64];
    for chunk in bytes.chunks(buf.len() / 2) {
        for (pair, b) in buf.chunks_exact_mut(2).zip(chunk) {
            pair[0] = DIGITS[usize::from(b >> 4)];
            pair[1] = DIGITS[usize::from(b & 15)];
        }
        let digits = &buf[..chunk.len() * 2];
        // Always ASCII; the check is a pass over at most 64 bytes.
        out.push_str(std::str::from_utf8(digits).unwrap_or_default());
    }
}

/// Parses a trace id as 32 lower-case hex digits, not all zero.
pub fn parse_trace_id(input: &str) -> Option<[u8; 16]> {
    trace_id(input.as_bytes())
}

fn trace_id(input: &[u8]) -> Option<[u8; 16]> {
    let mut id = [0u8; 16];
    hex_lower(input, &mut id)?;
    (id != [0; 16]).then_some(id)
}

/// Where version 00's fields end: `vv-<32>-<16>-ff`.
const LEN: usize = 55;

impl TraceParent {
    /// Parses a `traceparent` value. Version `00` must have exactly four fields; a
    /// higher version (not `ff`) may carry more, which are ignored as the spec says.
    /// The fields have fixed widths, so they are read at fixed offsets.
    pub fn parse(value: &str) -> Option<Self> {
        let v = value.as_bytes();
        if v.len() < LEN || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
            return None;
        }
        let mut version = [0u8; 1];
        hex_lower(&v[0..2], &mut version)?;
        let more = v.len() > LEN;
        if version[0] == 0xff || more && (version[0] == 0 || v[LEN] != b'-') {
            return None;
        }
        let trace_id = trace_id(&v[3..35])?;
        let mut parent_id = [0u8; 8];
        hex_lower(&v[36..52], &mut parent_id)?;
        if parent_id == [0; 8] {
            return None;
        }
        let mut flags = [0u8; 1];
        hex_lower(&v[53..55], &mut flags)?;
        Some(Self {
            trace_id,
            parent_id,
            flags: flags[0],
        })
    }

    /// The header value (always version `00`).
    pub fn to_header(&self) -> String {
        let mut header = String::with_capacity(LEN);
        header.push_str("00-");
        push_hex(&mut header, &self.trace_id);
        header.push('-');
        push_hex(&mut header, &self.parent_id);
        header.push('-');
        push_hex(&mut header, &[self.flags]);
        header
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_the_spec_example_and_round_trips() {
        let tp = TraceParent::parse(VALID).unwrap();
        assert_eq!(hex(&tp.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.flags, 1);
        assert_eq!(tp.to_header(), VALID);
    }

    #[test]
    fn rejects_malformed_values() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bé-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn hex_round_trips_any_length() {
        let bytes: Vec<u8> = (0..=255).collect();
        let text = hex(&bytes);
        assert_eq!(text.len(), 512);
        let mut back = vec![0u8; 256];
        hex_lower(text.as_bytes(), &mut back).unwrap();
        assert_eq!(back, bytes);
    }

    #[test]
    fn future_versions_may_carry_more_fields() {
        let tp = TraceParent::parse(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future",
        )
        .unwrap();
        assert_eq!(tp.to_header(), VALID);
    }
}

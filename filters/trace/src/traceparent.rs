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

fn hex_lower(input: &str, out: &mut [u8]) -> Option<()> {
    if input.len() != out.len() * 2 {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    for (i, pair) in input.as_bytes().chunks(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(())
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    push_hex(&mut s, bytes);
    s
}

/// Appends `bytes` as lower-case hex digits. Ids are formatted by hand: `format!`'s
/// machinery showed in the filter's profile, at a few ids per request.
pub fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 15)] as char);
    }
}

/// Parses a trace id as 32 lower-case hex digits, not all zero.
pub fn parse_trace_id(input: &str) -> Option<[u8; 16]> {
    let mut id = [0u8; 16];
    hex_lower(input, &mut id)?;
    (id != [0; 16]).then_some(id)
}

impl TraceParent {
    /// Parses a `traceparent` value. Version `00` must have exactly four fields; a
    /// higher version (not `ff`) may carry more, which are ignored as the spec says.
    pub fn parse(value: &str) -> Option<Self> {
        let mut fields = value.split('-');
        let version = fields.next()?;
        let mut v = [0u8; 1];
        hex_lower(version, &mut v)?;
        if v[0] == 0xff {
            return None;
        }
        let trace_id = parse_trace_id(fields.next()?)?;
        let mut parent_id = [0u8; 8];
        hex_lower(fields.next()?, &mut parent_id)?;
        if parent_id == [0; 8] {
            return None;
        }
        let flags_text = fields.next()?;
        let mut flags = [0u8; 1];
        hex_lower(flags_text, &mut flags)?;
        if v[0] == 0 && fields.next().is_some() {
            return None;
        }
        Some(Self {
            trace_id,
            parent_id,
            flags: flags[0],
        })
    }

    /// The header value (always version `00`).
    pub fn to_header(&self) -> String {
        let mut header = String::with_capacity(55);
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
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
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

//! The proxy-wasm ABI's numbers and byte formats (spec `abi-versions/v0.2.1`): status
//! codes, the enums the host receives, and the header-map serialization used for maps,
//! local-reply headers and call headers. Pure: no wasmtime here.

/// `proxy_status_t`. Only the values the proxy-wasm Rust SDK 0.2.x knows are ever
/// returned: a Rust guest handed another one sees an invalid enum discriminant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    SerializationFailure = 3,
    ParseFailure = 4,
    Empty = 7,
    CasMismatch = 8,
    InternalFailure = 10,
    Unimplemented = 12,
}

impl Status {
    /// The value a host function returns.
    pub fn code(self) -> i32 {
        self as i32
    }
}

/// What a header callback returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

impl Action {
    /// Envoy clamps unknown values; anything but 1 goes on.
    pub fn from_i32(value: i32) -> Self {
        if value == 1 {
            Self::Pause
        } else {
            Self::Continue
        }
    }
}

/// `proxy_map_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapType {
    RequestHeaders,
    RequestTrailers,
    ResponseHeaders,
    ResponseTrailers,
    GrpcInitialMetadata,
    GrpcTrailingMetadata,
    HttpCallResponseHeaders,
    HttpCallResponseTrailers,
}

impl MapType {
    pub fn from_i32(value: i32) -> Option<Self> {
        Some(match value {
            0 => Self::RequestHeaders,
            1 => Self::RequestTrailers,
            2 => Self::ResponseHeaders,
            3 => Self::ResponseTrailers,
            4 => Self::GrpcInitialMetadata,
            5 => Self::GrpcTrailingMetadata,
            6 => Self::HttpCallResponseHeaders,
            7 => Self::HttpCallResponseTrailers,
            _ => return None,
        })
    }
}

/// `proxy_buffer_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferType {
    RequestBody,
    ResponseBody,
    DownstreamData,
    UpstreamData,
    HttpCallResponseBody,
    GrpcReceiveBuffer,
    VmConfiguration,
    PluginConfiguration,
    CallData,
}

impl BufferType {
    pub fn from_i32(value: i32) -> Option<Self> {
        Some(match value {
            0 => Self::RequestBody,
            1 => Self::ResponseBody,
            2 => Self::DownstreamData,
            3 => Self::UpstreamData,
            4 => Self::HttpCallResponseBody,
            5 => Self::GrpcReceiveBuffer,
            6 => Self::VmConfiguration,
            7 => Self::PluginConfiguration,
            8 => Self::CallData,
            _ => return None,
        })
    }
}

/// `proxy_log_level_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

impl LogLevel {
    pub fn from_i32(value: i32) -> Option<Self> {
        Some(match value {
            0 => Self::Trace,
            1 => Self::Debug,
            2 => Self::Info,
            3 => Self::Warn,
            4 => Self::Error,
            5 => Self::Critical,
            _ => return None,
        })
    }
}

/// `proxy_stream_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamType {
    HttpRequest,
    HttpResponse,
    Downstream,
    Upstream,
}

impl StreamType {
    pub fn from_i32(value: i32) -> Option<Self> {
        Some(match value {
            0 => Self::HttpRequest,
            1 => Self::HttpResponse,
            2 => Self::Downstream,
            3 => Self::Upstream,
            _ => return None,
        })
    }
}

/// `proxy_metric_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
}

impl MetricType {
    pub fn from_i32(value: i32) -> Option<Self> {
        Some(match value {
            0 => Self::Counter,
            1 => Self::Gauge,
            2 => Self::Histogram,
            _ => return None,
        })
    }
}

/// The ABI versions this host serves, by the marker export a module carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbiVersion {
    V0_2_0,
    V0_2_1,
}

impl AbiVersion {
    /// As the spec writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V0_2_0 => "0.2.0",
            Self::V0_2_1 => "0.2.1",
        }
    }

    /// The version a marker export names; `None` for anything else (0.1.0 included:
    /// its header callbacks take other arguments and its continue calls differ).
    pub fn from_export(name: &str) -> Option<Self> {
        match name {
            "proxy_abi_version_0_2_0" => Some(Self::V0_2_0),
            "proxy_abi_version_0_2_1" => Some(Self::V0_2_1),
            _ => None,
        }
    }
}

/// Why serialized pairs were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PairsError {
    #[error("serialized pairs of {0} bytes are shorter than their length table")]
    Truncated(usize),
    #[error("serialized pairs: string {0} is not followed by its NUL")]
    MissingNul(usize),
    #[error("serialized pairs: {0} bytes after the last string")]
    Trailing(usize),
    #[error("serialized pairs: key {0} is not UTF-8")]
    KeyNotUtf8(usize),
}

/// Reads serialized pairs: a u32 count, a u32 length per key and value, then each string
/// followed by one NUL (all integers little-endian). Strings are located by the length
/// table, never by scanning for NULs. An empty buffer (or fewer than 4 bytes of zero)
/// is an empty map, as the spec allows.
pub fn parse_pairs(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>, PairsError> {
    if bytes.len() < 4 {
        return if bytes.iter().all(|&b| b == 0) {
            Ok(Vec::new())
        } else {
            Err(PairsError::Truncated(bytes.len()))
        };
    }
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap_or([0; 4]));
    let count = u32_at(0) as usize;
    // Each pair takes at least 8 bytes of lengths and 2 NULs: a count the buffer cannot
    // hold is refused before anything is allocated for it.
    let table_end = count
        .checked_mul(8)
        .and_then(|n| n.checked_add(4))
        .filter(|&end| end <= bytes.len() && count.saturating_mul(10) <= bytes.len())
        .ok_or(PairsError::Truncated(bytes.len()))?;
    let mut pairs = Vec::with_capacity(count);
    let mut at = table_end;
    let mut take = |len: usize, index: usize| -> Result<&[u8], PairsError> {
        let end = at
            .checked_add(len)
            .filter(|&end| end < bytes.len())
            .ok_or(PairsError::Truncated(bytes.len()))?;
        if bytes[end] != 0 {
            return Err(PairsError::MissingNul(index));
        }
        let s = &bytes[at..end];
        at = end + 1;
        Ok(s)
    };
    for i in 0..count {
        let (klen, vlen) = (u32_at(4 + 8 * i) as usize, u32_at(8 + 8 * i) as usize);
        let key = take(klen, 2 * i)?;
        let key = std::str::from_utf8(key)
            .map_err(|_| PairsError::KeyNotUtf8(i))?
            .to_owned();
        let value = take(vlen, 2 * i + 1)?.to_vec();
        pairs.push((key, value));
    }
    if at != bytes.len() {
        return Err(PairsError::Trailing(bytes.len() - at));
    }
    Ok(pairs)
}

/// Writes pairs in the format [`parse_pairs`] reads. An empty map is four zero bytes
/// (the Rust SDK panics on the one-byte form the spec also allows).
pub fn serialize_pairs<'a, K, V>(pairs: impl IntoIterator<Item = (K, V)> + Clone) -> Vec<u8>
where
    K: AsRef<[u8]> + 'a,
    V: AsRef<[u8]> + 'a,
{
    let (mut count, mut data) = (0usize, 0usize);
    for (k, v) in pairs.clone() {
        count += 1;
        data += k.as_ref().len() + v.as_ref().len() + 2;
    }
    let mut out = Vec::with_capacity(4 + 8 * count + data);
    out.extend_from_slice(&(count as u32).to_le_bytes());
    for (k, v) in pairs.clone() {
        out.extend_from_slice(&(k.as_ref().len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.as_ref().len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_ref());
        out.push(0);
        out.extend_from_slice(v.as_ref());
        out.push(0);
    }
    out
}

/// Splits a property path (segments joined by single NULs, no trailing NUL).
pub fn property_path(bytes: &[u8]) -> Vec<&[u8]> {
    if bytes.is_empty() {
        return Vec::new();
    }
    bytes.split(|&b| b == 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_round_trip_in_the_byte_layout_of_the_spec() {
        let bytes = serialize_pairs([("a", "1"), ("b", "22")]);
        assert_eq!(
            bytes,
            [
                2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, b'a', 0, b'1', 0, b'b',
                0, b'2', b'2', 0
            ]
        );
        assert_eq!(
            parse_pairs(&bytes).unwrap(),
            vec![("a".into(), b"1".to_vec()), ("b".into(), b"22".to_vec())]
        );
        let empty: [(&str, &str); 0] = [];
        assert_eq!(serialize_pairs(empty), [0, 0, 0, 0]);
        assert!(parse_pairs(&[]).unwrap().is_empty());
        assert!(parse_pairs(&[0]).unwrap().is_empty());
        assert!(parse_pairs(&[0, 0, 0, 0]).unwrap().is_empty());
    }

    #[test]
    fn values_are_bytes_and_may_hold_nuls() {
        let bytes = serialize_pairs([("k", &b"a\0b\xff"[..])]);
        assert_eq!(parse_pairs(&bytes).unwrap()[0].1, b"a\0b\xff");
    }

    #[test]
    fn malformed_pairs_are_refused_with_the_reason() {
        let good = serialize_pairs([("key", "value")]);
        // A count the buffer cannot hold (no allocation for it).
        let mut huge = good.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(parse_pairs(&huge), Err(PairsError::Truncated(good.len())));
        // A length past the end.
        let mut long = good.clone();
        long[4..8].copy_from_slice(&1000u32.to_le_bytes());
        assert!(matches!(parse_pairs(&long), Err(PairsError::Truncated(_))));
        // A missing NUL after the key.
        let mut nul = good.clone();
        nul[12 + 3] = b'x';
        assert_eq!(parse_pairs(&nul), Err(PairsError::MissingNul(0)));
        // Bytes after the last string.
        let mut trailing = good.clone();
        trailing.push(7);
        assert_eq!(parse_pairs(&trailing), Err(PairsError::Trailing(1)));
        // A key that is not UTF-8.
        let bad_key = serialize_pairs([(&b"\xff"[..], &b"v"[..])]);
        assert_eq!(parse_pairs(&bad_key), Err(PairsError::KeyNotUtf8(0)));
        assert!(matches!(
            parse_pairs(&[1, 2]),
            Err(PairsError::Truncated(2))
        ));
    }

    #[test]
    fn property_paths_split_on_nuls() {
        assert_eq!(
            property_path(b"request\0headers\0user-agent"),
            vec![&b"request"[..], b"headers", b"user-agent"]
        );
        assert!(property_path(b"").is_empty());
        assert_eq!(property_path(b"plugin_name"), vec![&b"plugin_name"[..]]);
    }

    #[test]
    fn only_the_0_2_x_markers_are_served() {
        assert_eq!(
            AbiVersion::from_export("proxy_abi_version_0_2_1"),
            Some(AbiVersion::V0_2_1)
        );
        assert_eq!(
            AbiVersion::from_export("proxy_abi_version_0_2_0"),
            Some(AbiVersion::V0_2_0)
        );
        assert_eq!(AbiVersion::from_export("proxy_abi_version_0_1_0"), None);
        assert_eq!(Action::from_i32(1), Action::Pause);
        assert_eq!(Action::from_i32(7), Action::Continue);
        assert_eq!(MapType::from_i32(8), None);
        assert_eq!(
            BufferType::from_i32(7),
            Some(BufferType::PluginConfiguration)
        );
    }
}

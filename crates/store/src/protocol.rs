//! The BlueCache control protocol (after BlueCache's `dma_transfer.h`): small, versioned
//! request/response messages between a host client and the DPU agent. Only metadata
//! travels here (keys, which registered host buffer and range, sizes, checksums,
//! status); bulk data moves by DMA between the exported host buffer and the agent's
//! staging buffer.
//!
//! A message is a 16-byte header, the same in every version so that a peer of another
//! version can be told so in words, then a body:
//!
//! | bytes | field |
//! | --- | --- |
//! | 0–3 | magic `DTRF` (0x44545246) |
//! | 4–5 | protocol version (little-endian) |
//! | 6–7 | kind: 1 request, 2 response, 3 version mismatch (body: UTF-8 text) |
//! | 8–11 | request id (a response echoes it) |
//! | 12–15 | body length (at most [`MAX_BODY`]) |
//!
//! Bodies are [`Request`]/[`Response`] in postcard. A batch carries up to
//! [`MAX_SEGMENTS`] segments, each naming a key and a range of a registered buffer,
//! and is answered with one [`SegmentResult`] per segment, in order. The messages
//! ride on the node's control channel (Unix socket or TCP here, DOCA Comch under
//! `doca`); the control channel has its own magic and version, and this protocol
//! checks its own on both sides.

use serde::{Deserialize, Serialize};

/// `DTRF`, as the seed defines it (0x44545246 read big-endian: the bytes spell it).
pub const MAGIC: [u8; 4] = *b"DTRF";
/// The protocol version this build speaks.
pub const VERSION: u16 = 2;
/// Largest body accepted (fits in one control-channel message with room to spare).
pub const MAX_BODY: u32 = 60 << 10;
/// Most segments in one batch.
pub const MAX_SEGMENTS: usize = 128;
/// Longest key, in bytes.
pub const MAX_KEY: usize = 512;
/// The header's length.
pub const HEADER: usize = 16;

const KIND_REQUEST: u16 = 1;
const KIND_RESPONSE: u16 = 2;
const KIND_VERSION_MISMATCH: u16 = 3;

/// One object's part of a batch: a key and the range of a registered host buffer its
/// bytes come from (push) or go to (pull).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub key: String,
    /// The buffer, as [`Response::Registered`] named it.
    pub buffer: u32,
    /// Where in the buffer.
    pub offset: u64,
    /// How many bytes (push: the object's size; pull: room for it, at least its size).
    pub len: u64,
}

/// What the host asks of the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Registers a host buffer the agent may DMA from and to, of `len` bytes: in
    /// software its memory comes as a descriptor with the message (a sealed memfd, on
    /// the Unix control socket: never a name the agent would open); on BlueField the
    /// `doca_mmap_export_pci` bytes.
    Register {
        len: u64,
        /// The hardware export descriptor (empty in software).
        hw_export: Vec<u8>,
    },
    /// Forgets a buffer (transfers still running on it finish first).
    Deregister { buffer: u32 },
    /// Host → DPU storage: each segment's bytes become the object of its key.
    PushBatch { segments: Vec<Segment> },
    /// Sizes (and checksums) of objects, before a pull.
    PullInfo { keys: Vec<String> },
    /// DPU storage → host: each object's bytes into its segment's range.
    PullBatch { segments: Vec<Segment> },
    /// Removes objects.
    Delete { keys: Vec<String> },
    /// Objects whose keys start with `prefix`, in key order, after `after` (paging).
    List {
        prefix: String,
        after: Option<String>,
        limit: u32,
    },
}

/// An object's metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectInfo {
    pub key: String,
    pub size: u64,
    /// CRC-32 (IEEE) of its bytes.
    pub crc32: u32,
}

/// How one segment (or one key) went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentResult {
    pub status: Status,
    /// The object's size (push: bytes stored; pull: bytes written to the buffer).
    pub size: u64,
    /// CRC-32 of the bytes moved.
    pub crc32: u32,
    /// Why, for people, when the status is not `Ok`.
    pub message: String,
}

impl SegmentResult {
    pub(crate) fn ok(size: u64, crc32: u32) -> Self {
        Self {
            status: Status::Ok,
            size,
            crc32,
            message: String::new(),
        }
    }

    pub(crate) fn failed(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            size: 0,
            crc32: 0,
            message: message.into(),
        }
    }
}

/// What the agent answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// The buffer's id for segments.
    Registered { buffer: u32 },
    /// Done.
    Ok,
    /// One result per segment or key, in order.
    Batch { results: Vec<SegmentResult> },
    /// Answer to [`Request::PullInfo`]: per key, its object (or none).
    Info { objects: Vec<Option<ObjectInfo>> },
    /// Answer to [`Request::List`].
    Listed {
        objects: Vec<ObjectInfo>,
        /// More follow (ask again with `after` the last key).
        more: bool,
    },
    /// The whole request failed.
    Error { status: Status, message: String },
}

/// Status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Status {
    Ok,
    /// No object of that key.
    NotFound,
    /// A key that is empty, too long or holds NUL or control characters.
    BadKey,
    /// A buffer id this client did not register, or a range outside it.
    BadBuffer,
    /// The pull's range is smaller than the object.
    TooSmall,
    /// The object is larger than the store's whole capacity.
    TooLarge,
    /// A malformed request (too many segments, an unknown buffer path…).
    BadRequest,
    /// The stored bytes do not match their checksum (the object is dropped).
    Corrupt,
    /// Storage failed (disk full, I/O error).
    Storage,
    /// The DMA engine failed.
    Dma,
    /// The transfer was cancelled (the client went away, or the agent is stopping).
    Cancelled,
}

/// Why a message could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("BlueCache message of {0} bytes is shorter than its 16-byte header")]
    Short(usize),
    #[error("not a BlueCache message (magic {found:02x?}, expected \"DTRF\")")]
    Magic { found: [u8; 4] },
    #[error(
        "BlueCache protocol version mismatch: this side speaks version {ours}, the peer speaks version {theirs}; run the same DPUmesh release on host and DPU"
    )]
    Version { ours: u16, theirs: u16 },
    #[error("the peer refused our messages: {0}")]
    Refused(String),
    #[error("BlueCache message body of {0} bytes exceeds the {MAX_BODY}-byte limit")]
    TooLarge(u32),
    #[error("BlueCache message body of {declared} bytes declared, {present} present")]
    Truncated { declared: u32, present: usize },
    #[error("unknown BlueCache message kind {0}")]
    Kind(u16),
    #[error("BlueCache message body does not decode: {0}")]
    Body(String),
}

/// A decoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Request(u32, Request),
    Response(u32, Response),
}

fn header(kind: u16, id: u32, len: usize, version: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + len);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out
}

/// Encodes a message in this build's version.
pub fn encode(message: &Message) -> Vec<u8> {
    encode_as(message, VERSION)
}

/// Encodes a message claiming `version` (tests use it to play an older peer).
pub fn encode_as(message: &Message, version: u16) -> Vec<u8> {
    let (kind, id, body) = match message {
        Message::Request(id, r) => (KIND_REQUEST, *id, postcard::to_stdvec(r)),
        Message::Response(id, r) => (KIND_RESPONSE, *id, postcard::to_stdvec(r)),
    };
    let body = body.expect("store messages always serialize");
    let mut out = header(kind, id, body.len(), version);
    out.extend_from_slice(&body);
    out
}

/// What a peer of another version is answered: our version in the header, the
/// mismatch in words.
pub fn encode_version_mismatch(id: u32, theirs: u16) -> Vec<u8> {
    let text = format!(
        "BlueCache protocol version mismatch: the agent speaks version {VERSION}, this client sent version {theirs}"
    );
    let mut out = header(KIND_VERSION_MISMATCH, id, text.len(), VERSION);
    out.extend_from_slice(text.as_bytes());
    out
}

/// The request id in a message's header, if it has one (to answer even a message
/// whose body is bad).
pub fn peek_id(bytes: &[u8]) -> Option<u32> {
    bytes
        .get(8..12)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Decodes one whole message, checking magic, version, length and body.
pub fn decode(bytes: &[u8]) -> Result<Message, ProtocolError> {
    if bytes.len() < HEADER {
        return Err(ProtocolError::Short(bytes.len()));
    }
    let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
    if magic != MAGIC {
        return Err(ProtocolError::Magic { found: magic });
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    let kind = u16::from_le_bytes([bytes[6], bytes[7]]);
    let id = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    let len = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
    if len > MAX_BODY {
        return Err(ProtocolError::TooLarge(len));
    }
    let body = &bytes[HEADER..];
    if body.len() != len as usize {
        return Err(ProtocolError::Truncated {
            declared: len,
            present: body.len(),
        });
    }
    if kind == KIND_VERSION_MISMATCH {
        return Err(ProtocolError::Refused(
            String::from_utf8_lossy(body).into_owned(),
        ));
    }
    if version != VERSION {
        return Err(ProtocolError::Version {
            ours: VERSION,
            theirs: version,
        });
    }
    let parse = |e: postcard::Error| ProtocolError::Body(e.to_string());
    match kind {
        KIND_REQUEST => Ok(Message::Request(
            id,
            postcard::from_bytes(body).map_err(parse)?,
        )),
        KIND_RESPONSE => Ok(Message::Response(
            id,
            postcard::from_bytes(body).map_err(parse)?,
        )),
        other => Err(ProtocolError::Kind(other)),
    }
}

/// Why a key is refused, if it is.
pub fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("an empty key".to_owned());
    }
    if key.len() > MAX_KEY {
        return Err(format!("a key of {} bytes (at most {MAX_KEY})", key.len()));
    }
    if key.chars().any(char::is_control) {
        return Err(format!("key {key:?} holds a control character"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push() -> Message {
        Message::Request(
            7,
            Request::PushBatch {
                segments: vec![Segment {
                    key: "a/b".into(),
                    buffer: 1,
                    offset: 0,
                    len: 10,
                }],
            },
        )
    }

    #[test]
    fn messages_round_trip() {
        let bytes = encode(&push());
        assert_eq!(&bytes[..4], b"DTRF");
        assert_eq!(decode(&bytes).unwrap(), push());
        let answer = Message::Response(
            7,
            Response::Batch {
                results: vec![SegmentResult::ok(10, 99)],
            },
        );
        assert_eq!(decode(&encode(&answer)).unwrap(), answer);
    }

    #[test]
    fn another_version_is_refused_with_both_versions_named() {
        let bytes = encode_as(&push(), VERSION + 1);
        let err = decode(&bytes).unwrap_err();
        assert_eq!(
            err,
            ProtocolError::Version {
                ours: VERSION,
                theirs: VERSION + 1
            }
        );
        assert!(err.to_string().contains("same DPUmesh release"), "{err}");
        // The agent's answer to it, read by the client, says so in words.
        let answer = encode_version_mismatch(7, VERSION + 1);
        assert_eq!(peek_id(&answer), Some(7));
        let err = decode(&answer).unwrap_err();
        assert!(
            matches!(&err, ProtocolError::Refused(t) if t.contains("version mismatch")),
            "{err}"
        );
    }

    #[test]
    fn malformed_messages_are_named() {
        assert_eq!(decode(b"DTRF").unwrap_err(), ProtocolError::Short(4));
        let mut bytes = encode(&push());
        bytes[0] = b'X';
        assert!(matches!(decode(&bytes), Err(ProtocolError::Magic { .. })));
        let mut bytes = encode(&push());
        bytes.pop();
        assert!(matches!(
            decode(&bytes),
            Err(ProtocolError::Truncated { .. })
        ));
        let mut bytes = encode(&push());
        bytes[6] = 9;
        assert_eq!(decode(&bytes).unwrap_err(), ProtocolError::Kind(9));
        let mut bytes = encode(&push());
        bytes[12..16].copy_from_slice(&(MAX_BODY + 1).to_le_bytes());
        assert!(matches!(decode(&bytes), Err(ProtocolError::TooLarge(_))));
        let mut bytes = header(KIND_REQUEST, 1, 3, VERSION);
        bytes.extend_from_slice(&[0xff, 0xff, 0xff]);
        assert!(matches!(decode(&bytes), Err(ProtocolError::Body(_))));
    }

    #[test]
    fn keys_are_checked() {
        assert!(check_key("cache/GET/a").is_ok());
        assert!(check_key("").is_err());
        assert!(check_key("a\nb").is_err());
        assert!(check_key(&"k".repeat(MAX_KEY + 1)).is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let _ = decode(&bytes);
        }
    }
}

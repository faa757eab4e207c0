//! The software descriptor: one 64-byte record that every ring carries
//! (`sw_descriptor`), with a version, the case flags, `(req_id, step_id)`, the source,
//! the destination (an external address or a pod), the header and body buffers, and
//! the `valid` word the rings use as their publication flag.
//!
//! Buffers are named by [`BufAddr`] (a region id and an offset), never by pointers:
//! every process maps the same shared regions at different virtual addresses, as the
//! DPU sees host memory through its own IOVA space.
//!
//! Descriptors cross process boundaries, so [`Descriptor::decode`] trusts nothing: a
//! wrong version, an unknown flag, a case without its destination kind, a buffer
//! length without a buffer, or a malformed destination is a typed error.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// Size of an encoded descriptor: one cache line.
pub const DESCRIPTOR_SIZE: usize = 64;

/// The descriptor layout this build writes and reads.
pub const DESCRIPTOR_VERSION: u16 = 1;

/// The layout in memory: `#[repr(C)]`, little-endian fields, no padding. Rings store
/// descriptors as these 64 bytes; [`Descriptor`] is the checked form.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RawDescriptor {
    /// [`DESCRIPTOR_VERSION`].
    pub version: u16,
    /// [`Flags`] bits.
    pub flags: u16,
    /// Bytes of the header buffer (0 when there is none).
    pub header_len: u32,
    /// The header buffer ([`BufAddr`] bits; 0 = none, seed case 2's `NULL`).
    pub header_addr: u64,
    /// The body buffer ([`BufAddr`] bits; 0 = none).
    pub body_addr: u64,
    /// Bytes of the body buffer.
    pub body_len: u32,
    /// The execution context (request) this belongs to.
    pub req_id: u32,
    /// The step within the request.
    pub step_id: u32,
    /// The pod that sent it (0 = from outside the node: ingress or a peer node).
    pub src_pod: u32,
    /// The destination: an IPv6 (or IPv4-mapped) address for external destinations,
    /// or a pod id in the first four bytes (little-endian) and zeros after.
    pub dst: [u8; 16],
    /// The destination port (external destinations only; 0 for pods).
    pub dst_port: u16,
    /// An HTTP status for responses, or a [`DescriptorStatus`] code on errors.
    pub status: u16,
    /// Publication flag: a ring writes its sequence tag here last; 0 = not valid.
    pub valid: u32,
}

const _: () = assert!(std::mem::size_of::<RawDescriptor>() == DESCRIPTOR_SIZE);
const _: () = assert!(std::mem::align_of::<RawDescriptor>() == 8);

/// A buffer address in the data path's address space: a region id (16 bits) and a
/// byte offset in that region (48 bits). 0 means "no buffer".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BufAddr(u64);

impl BufAddr {
    /// No buffer.
    pub const NULL: BufAddr = BufAddr(0);
    /// Largest offset an address can carry.
    pub const MAX_OFFSET: u64 = (1 << 48) - 1;

    /// The address of `offset` in region `region` (region ids start at 1, so no real
    /// buffer is [`BufAddr::NULL`]).
    pub fn new(region: u16, offset: u64) -> Option<Self> {
        (region != 0 && offset <= Self::MAX_OFFSET).then_some(Self((region as u64) << 48 | offset))
    }

    /// From raw descriptor bits.
    pub fn from_bits(bits: u64) -> Self {
        Self(bits)
    }

    /// The raw bits.
    pub fn bits(self) -> u64 {
        self.0
    }

    /// Whether this names no buffer.
    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// The region id.
    pub fn region(self) -> u16 {
        (self.0 >> 48) as u16
    }

    /// The offset in the region.
    pub fn offset(self) -> u64 {
        self.0 & Self::MAX_OFFSET
    }

    /// This address moved `delta` bytes further into the same region.
    pub fn offset_by(self, delta: u64) -> Option<Self> {
        Self::new(self.region(), self.offset().checked_add(delta)?)
    }
}

impl std::fmt::Display for BufAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_null() {
            f.write_str("null")
        } else {
            write!(f, "r{}+{:#x}", self.region(), self.offset())
        }
    }
}

/// Which of the three data paths a descriptor travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Case {
    /// Case 1: a host pod to another node (host TX SQ → DPA → ARM → RDMA).
    HostToRemote,
    /// Case 2: from outside the node (ingress or a peer node) to a host pod.
    ExternalToHost,
    /// Case 3: one pod to another on the same node (header via the ARM for policy,
    /// body copied pod A → pod B directly).
    PodToPod,
}

/// The flag bits. Exactly one case bit is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(u16);

impl Flags {
    /// Case 1.
    pub const CASE_1: Flags = Flags(1 << 0);
    /// Case 2.
    pub const CASE_2: Flags = Flags(1 << 1);
    /// Case 3.
    pub const CASE_3: Flags = Flags(1 << 2);
    /// The destination is a pod id (else an external address and port).
    pub const DST_POD: Flags = Flags(1 << 3);
    /// A response to an earlier request with the same `(req_id, step_id)`.
    pub const RESPONSE: Flags = Flags(1 << 4);
    /// A completion: the named buffers are handed back to their owner to be freed
    /// (the DMA's completion callback). Carries no new data.
    pub const COMPLETION: Flags = Flags(1 << 5);
    /// The operation failed; `status` holds a [`DescriptorStatus`] code.
    pub const ERROR: Flags = Flags(1 << 6);
    /// Part of a streamed body: `status` says which part ([`StreamPart`]).
    pub const STREAM: Flags = Flags(1 << 7);
    const CASES: u16 = Self::CASE_1.0 | Self::CASE_2.0 | Self::CASE_3.0;
    const KNOWN: u16 = Self::CASES
        | Self::DST_POD.0
        | Self::RESPONSE.0
        | Self::COMPLETION.0
        | Self::ERROR.0
        | Self::STREAM.0;
    /// The high byte: the lane (which of the node's shards the pod's ring pair
    /// belongs to) the descriptor travels on.
    const LANE_SHIFT: u16 = 8;
    const LANE: u16 = 0xff << Self::LANE_SHIFT;

    /// The raw bits.
    pub fn bits(self) -> u16 {
        self.0
    }

    /// Whether every bit of `other` is set.
    pub fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }

    /// The flags of the case.
    pub fn of_case(case: Case) -> Flags {
        match case {
            Case::HostToRemote => Self::CASE_1,
            Case::ExternalToHost => Self::CASE_2,
            Case::PodToPod => Self::CASE_3,
        }
    }
}

impl std::ops::BitOr for Flags {
    type Output = Flags;
    fn bitor(self, rhs: Flags) -> Flags {
        Flags(self.0 | rhs.0)
    }
}

/// Where a descriptor goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Destination {
    /// A service outside this node, by address (case 1).
    External(SocketAddr),
    /// A pod on a node, by the id the control channel assigned (cases 2 and 3).
    Pod(u32),
}

/// Error codes carried in `status` with [`Flags::ERROR`]: why the data path could
/// not carry a descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum DescriptorStatus {
    /// The descriptor failed to decode.
    Malformed = 1,
    /// A buffer it names is not owned by its sender, or lies outside its pool.
    BadBuffer = 2,
    /// The destination pod is not registered on this node.
    UnknownPod = 3,
    /// No free slot in a pool it needed.
    PoolExhausted = 4,
    /// The destination's ring was full.
    RingFull = 5,
    /// The DMA engine failed.
    CopyFailed = 6,
    /// The destination pod went away.
    PodGone = 7,
    /// The stream was given up: its receiver left or stopped it (a client that
    /// disconnected), or its idle time ran out. Its sender stops sending.
    Cancelled = 8,
}

impl DescriptorStatus {
    /// From a code, if known.
    pub fn from_code(code: u16) -> Option<Self> {
        Some(match code {
            1 => Self::Malformed,
            2 => Self::BadBuffer,
            3 => Self::UnknownPod,
            4 => Self::PoolExhausted,
            5 => Self::RingFull,
            6 => Self::CopyFailed,
            7 => Self::PodGone,
            8 => Self::Cancelled,
            _ => return None,
        })
    }
}

/// A checked descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    /// The data path.
    pub case: Case,
    /// Response, completion and error bits (the case and destination-kind bits are
    /// derived from `case` and `dst`).
    pub kind: Kind,
    /// The header buffer and its length ([`BufAddr::NULL`] and 0 for none).
    pub header: Buffer,
    /// The body buffer and its length.
    pub body: Buffer,
    /// The execution context.
    pub req_id: u32,
    /// The step in the context.
    pub step_id: u32,
    /// The sending pod (0 = from outside the node).
    pub src_pod: u32,
    pub dst: Destination,
    /// HTTP status of a response, or a [`DescriptorStatus`] code with `kind.error`.
    pub status: u16,
    /// The lane: which of the pod's ring pairs (one per proxy shard of its node) it
    /// travels on. The node stamps it on what it delivers; a pod answers on the lane
    /// the request came on, so the answer reaches the shard that holds the exchange.
    pub lane: u8,
}

/// A buffer reference: where and how many bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Buffer {
    pub addr: BufAddr,
    /// How many bytes.
    pub len: u32,
}

impl Buffer {
    /// No buffer.
    pub const NONE: Buffer = Buffer {
        addr: BufAddr::NULL,
        len: 0,
    };

    /// `len` bytes at `addr`.
    pub fn new(addr: BufAddr, len: u32) -> Self {
        Self { addr, len }
    }

    /// Whether this names no buffer.
    pub fn is_none(&self) -> bool {
        self.addr.is_null()
    }
}

/// The non-case flags of a descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Kind {
    pub response: bool,
    /// A completion handing buffers back.
    pub completion: bool,
    /// An error report.
    pub error: bool,
    /// Part of a streamed body ([`Descriptor::stream_part`]).
    pub stream: bool,
}

/// Which part of a streamed body a descriptor with [`Kind::stream`] carries, told by
/// its `status`. A stream is its opening, any number of data parts and one end (or an
/// abort), all with the opening's `(req_id, step_id)`, in order on one lane. Each part
/// may carry a body buffer (at most a slot: the body in pieces, so a body of any
/// size crosses in slot-sized parts and its first byte leaves before its last
/// arrives).
///
/// A response's body streams from the pod that answers; a request's body (an upload,
/// a gRPC client stream) streams from the node to the pod it delivered the request
/// to, opened by the request itself ([`StreamPart::OPEN_REQUEST`]). Its receiver,
/// the pod, tells the node what it did with the parts on responses to the request:
/// [`StreamPart::Taken`] for each part it passed on, [`StreamPart::Stop`] when it
/// wants no more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamPart {
    /// The head (a response's status 100–599 is its HTTP status; a request's is
    /// [`StreamPart::OPEN_REQUEST`]) and the body's first bytes, if any. More
    /// follows.
    Open,
    /// Status 0: more of the body.
    Data,
    /// Status 1: the last of the body; the header buffer, if any, holds the trailers.
    End,
    /// Status 2: the sender gives the stream up; what was sent is incomplete.
    Abort,
    /// Status 3: the receiver of a request's streamed body passed a part on: its
    /// sender may deliver another.
    Taken,
    /// Status 4: the receiver of a request's streamed body wants no more of it.
    Stop,
}

impl StreamPart {
    /// The status of a streamed request's opening.
    pub const OPEN_REQUEST: u16 = 5;

    /// The `status` a part of this kind carries (a response's opening carries its
    /// HTTP status; this is 200).
    pub fn code(self) -> u16 {
        match self {
            StreamPart::Data => 0,
            StreamPart::End => 1,
            StreamPart::Abort => 2,
            StreamPart::Taken => 3,
            StreamPart::Stop => 4,
            StreamPart::Open => 200,
        }
    }

    fn of(status: u16) -> Option<Self> {
        match status {
            0 => Some(StreamPart::Data),
            1 => Some(StreamPart::End),
            2 => Some(StreamPart::Abort),
            3 => Some(StreamPart::Taken),
            4 => Some(StreamPart::Stop),
            Self::OPEN_REQUEST | 100..=599 => Some(StreamPart::Open),
            _ => None,
        }
    }
}

/// Why bytes are not a descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    /// Fewer than 64 bytes.
    #[error("descriptor is {0} bytes; a descriptor is exactly 64")]
    Length(usize),
    /// The `valid` word is 0: nothing was published here.
    #[error("descriptor is not valid (valid word is 0)")]
    NotValid,
    /// Written by another layout version.
    #[error(
        "descriptor version {found} is not supported (this build reads version {DESCRIPTOR_VERSION})"
    )]
    Version {
        /// The version found.
        found: u16,
    },
    /// Bits this version does not define.
    #[error("unknown flag bits {bits:#06x}")]
    UnknownFlags {
        /// The unknown bits.
        bits: u16,
    },
    /// Zero or several case bits.
    #[error("flags {flags:#06x} must name exactly one of case 1, 2 or 3")]
    Case {
        /// The flags found.
        flags: u16,
    },
    /// A case with the wrong kind of destination.
    #[error("{case:?} needs a {needed} destination")]
    DestinationKind {
        case: Case,
        /// "pod" or "external".
        needed: &'static str,
    },
    /// A pod destination with bytes after the id, or id 0 on a request.
    #[error("pod destination is malformed (id 0 on a request, or bytes after the 4-byte id)")]
    PodDestination,
    /// An external destination with port 0 or an unspecified address.
    #[error("external destination {0} has no usable address or port")]
    ExternalDestination(SocketAddr),
    /// A pod destination with a port.
    #[error("a pod destination carries no port (found {0})")]
    PodPort(u16),
    /// A length without a buffer.
    #[error("{which} length is {len} but there is no {which} buffer")]
    LengthWithoutBuffer {
        /// "header" or "body".
        which: &'static str,
        /// The length found.
        len: u32,
    },
    /// A buffer address in no region (region id 0 with a non-zero offset).
    #[error("{which} address {bits:#x} names region 0")]
    Region {
        /// "header" or "body".
        which: &'static str,
        /// The raw address.
        bits: u64,
    },
    /// A buffer that runs past the address space.
    #[error("{which} buffer {addr} + {len} runs past the end of its region's address space")]
    Overflow {
        /// "header" or "body".
        which: &'static str,
        addr: BufAddr,
        /// The length.
        len: u32,
    },
    /// An error report without a known code.
    #[error("error descriptor carries unknown status code {0}")]
    ErrorCode(u16),
    /// A stream part whose status names no part.
    #[error(
        "stream descriptor carries status {0}: a part is 0 (data), 1 (end), 2 (abort), 3 (taken), 4 (stop), 5 (a request's opening) or an HTTP status (a response's opening)"
    )]
    StreamStatus(u16),
}

impl Descriptor {
    /// A request from `src_pod` (0 = outside) for `dst` on data path `case`.
    pub fn request(case: Case, req_id: u32, step_id: u32, src_pod: u32, dst: Destination) -> Self {
        Self {
            case,
            kind: Kind::default(),
            header: Buffer::NONE,
            body: Buffer::NONE,
            req_id,
            step_id,
            src_pod,
            dst,
            status: 0,
            lane: 0,
        }
    }

    /// With a header buffer.
    pub fn with_header(mut self, header: Buffer) -> Self {
        self.header = header;
        self
    }

    /// With a body buffer.
    pub fn with_body(mut self, body: Buffer) -> Self {
        self.body = body;
        self
    }

    /// The raw form; `valid` is left 0 for the ring to set.
    pub fn to_raw(&self) -> RawDescriptor {
        let mut flags = Flags::of_case(self.case);
        if self.kind.response {
            flags = flags | Flags::RESPONSE;
        }
        if self.kind.completion {
            flags = flags | Flags::COMPLETION;
        }
        if self.kind.error {
            flags = flags | Flags::ERROR;
        }
        if self.kind.stream {
            flags = flags | Flags::STREAM;
        }
        let (dst, dst_port) = match self.dst {
            Destination::Pod(id) => {
                flags = flags | Flags::DST_POD;
                let mut dst = [0u8; 16];
                dst[..4].copy_from_slice(&id.to_le_bytes());
                (dst, 0)
            }
            Destination::External(addr) => {
                let ip = match addr.ip() {
                    IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                    IpAddr::V6(v6) => v6,
                };
                (ip.octets(), addr.port())
            }
        };
        RawDescriptor {
            version: DESCRIPTOR_VERSION,
            flags: flags.bits() | (self.lane as u16) << Flags::LANE_SHIFT,
            header_len: self.header.len,
            header_addr: self.header.addr.bits(),
            body_addr: self.body.addr.bits(),
            body_len: self.body.len,
            req_id: self.req_id,
            step_id: self.step_id,
            src_pod: self.src_pod,
            dst,
            dst_port,
            status: self.status,
            valid: 0,
        }
    }

    /// The 64 bytes, with `valid` as given.
    pub fn encode(&self, valid: u32) -> [u8; DESCRIPTOR_SIZE] {
        let mut raw = self.to_raw();
        raw.valid = valid;
        raw.to_bytes()
    }

    /// Decodes and checks 64 bytes. Checks everything [`Descriptor::from_raw`] does,
    /// and the length.
    pub fn decode(bytes: &[u8]) -> Result<Self, DescriptorError> {
        let bytes: &[u8; DESCRIPTOR_SIZE] = bytes
            .try_into()
            .map_err(|_| DescriptorError::Length(bytes.len()))?;
        Self::from_raw(&RawDescriptor::from_bytes(bytes))
    }

    /// Checks a raw descriptor.
    pub fn from_raw(raw: &RawDescriptor) -> Result<Self, DescriptorError> {
        if raw.valid == 0 {
            return Err(DescriptorError::NotValid);
        }
        if raw.version != DESCRIPTOR_VERSION {
            return Err(DescriptorError::Version { found: raw.version });
        }
        let unknown = raw.flags & !(Flags::KNOWN | Flags::LANE);
        if unknown != 0 {
            return Err(DescriptorError::UnknownFlags { bits: unknown });
        }
        let flags = Flags(raw.flags);
        let case = match raw.flags & Flags::CASES {
            b if b == Flags::CASE_1.0 => Case::HostToRemote,
            b if b == Flags::CASE_2.0 => Case::ExternalToHost,
            b if b == Flags::CASE_3.0 => Case::PodToPod,
            _ => return Err(DescriptorError::Case { flags: raw.flags }),
        };
        let dst = if flags.contains(Flags::DST_POD) {
            let id = u32::from_le_bytes([raw.dst[0], raw.dst[1], raw.dst[2], raw.dst[3]]);
            // Pod 0 is "from outside the node": only what goes back goes there (the
            // proxy routes it by its ids): a response, or what a pod did with a
            // stream from outside (`Taken`, `Stop`).
            let ack = flags.contains(Flags::STREAM)
                && !flags.contains(Flags::ERROR)
                && !flags.contains(Flags::COMPLETION)
                && matches!(
                    StreamPart::of(raw.status),
                    Some(StreamPart::Taken | StreamPart::Stop)
                );
            let zero_ok = flags.contains(Flags::RESPONSE) || ack;
            if (id == 0 && !zero_ok) || raw.dst[4..].iter().any(|&b| b != 0) {
                return Err(DescriptorError::PodDestination);
            }
            if raw.dst_port != 0 {
                return Err(DescriptorError::PodPort(raw.dst_port));
            }
            Destination::Pod(id)
        } else {
            let v6 = Ipv6Addr::from(raw.dst);
            let ip = match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(v6),
            };
            let addr = SocketAddr::new(ip, raw.dst_port);
            if raw.dst_port == 0 || ip.is_unspecified() {
                return Err(DescriptorError::ExternalDestination(addr));
            }
            Destination::External(addr)
        };
        // A request on case 1 leaves the node for an address; on cases 2 and 3 it ends
        // at a pod. Responses and completions go back to wherever the request came
        // from, so they may carry either kind.
        let to_pod = matches!(dst, Destination::Pod(_));
        let returning = flags.contains(Flags::RESPONSE) || flags.contains(Flags::COMPLETION);
        if !returning {
            match case {
                Case::HostToRemote if to_pod => {
                    return Err(DescriptorError::DestinationKind {
                        case,
                        needed: "external",
                    });
                }
                Case::ExternalToHost | Case::PodToPod if !to_pod => {
                    return Err(DescriptorError::DestinationKind {
                        case,
                        needed: "pod",
                    });
                }
                _ => {}
            }
        }
        let header = buffer("header", raw.header_addr, raw.header_len)?;
        let body = buffer("body", raw.body_addr, raw.body_len)?;
        if flags.contains(Flags::ERROR) && DescriptorStatus::from_code(raw.status).is_none() {
            return Err(DescriptorError::ErrorCode(raw.status));
        }
        // A completion hands a part's buffers back and keeps its status (0 for the
        // manager's own); only a part on its way says which part it is.
        if flags.contains(Flags::STREAM)
            && !flags.contains(Flags::ERROR)
            && !flags.contains(Flags::COMPLETION)
            && StreamPart::of(raw.status).is_none()
        {
            return Err(DescriptorError::StreamStatus(raw.status));
        }
        Ok(Self {
            case,
            kind: Kind {
                response: flags.contains(Flags::RESPONSE),
                completion: flags.contains(Flags::COMPLETION),
                error: flags.contains(Flags::ERROR),
                stream: flags.contains(Flags::STREAM),
            },
            header,
            body,
            req_id: raw.req_id,
            step_id: raw.step_id,
            src_pod: raw.src_pod,
            dst,
            status: raw.status,
            lane: (raw.flags >> Flags::LANE_SHIFT) as u8,
        })
    }

    /// Which part of a stream this is (`None` for anything but a stream part on its
    /// way: a whole message, a completion, an error).
    pub fn stream_part(&self) -> Option<StreamPart> {
        (self.kind.stream && !self.kind.completion && !self.kind.error)
            .then(|| StreamPart::of(self.status))
            .flatten()
    }

    /// The error code, for error descriptors.
    pub fn error_status(&self) -> Option<DescriptorStatus> {
        self.kind
            .error
            .then(|| DescriptorStatus::from_code(self.status))
            .flatten()
    }
}

fn buffer(which: &'static str, bits: u64, len: u32) -> Result<Buffer, DescriptorError> {
    let addr = BufAddr::from_bits(bits);
    if addr.is_null() {
        if len != 0 {
            return Err(DescriptorError::LengthWithoutBuffer { which, len });
        }
        return Ok(Buffer::NONE);
    }
    if addr.region() == 0 {
        return Err(DescriptorError::Region { which, bits });
    }
    if addr.offset() + len as u64 > BufAddr::MAX_OFFSET {
        return Err(DescriptorError::Overflow { which, addr, len });
    }
    Ok(Buffer { addr, len })
}

impl RawDescriptor {
    /// Little-endian bytes, field by field (the `#[repr(C)]` layout on every target).
    pub fn to_bytes(&self) -> [u8; DESCRIPTOR_SIZE] {
        let mut b = [0u8; DESCRIPTOR_SIZE];
        b[0..2].copy_from_slice(&self.version.to_le_bytes());
        b[2..4].copy_from_slice(&self.flags.to_le_bytes());
        b[4..8].copy_from_slice(&self.header_len.to_le_bytes());
        b[8..16].copy_from_slice(&self.header_addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.body_addr.to_le_bytes());
        b[24..28].copy_from_slice(&self.body_len.to_le_bytes());
        b[28..32].copy_from_slice(&self.req_id.to_le_bytes());
        b[32..36].copy_from_slice(&self.step_id.to_le_bytes());
        b[36..40].copy_from_slice(&self.src_pod.to_le_bytes());
        b[40..56].copy_from_slice(&self.dst);
        b[56..58].copy_from_slice(&self.dst_port.to_le_bytes());
        b[58..60].copy_from_slice(&self.status.to_le_bytes());
        b[60..64].copy_from_slice(&self.valid.to_le_bytes());
        b
    }

    /// From little-endian bytes.
    pub fn from_bytes(b: &[u8; DESCRIPTOR_SIZE]) -> Self {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let mut dst = [0u8; 16];
        dst.copy_from_slice(&b[40..56]);
        Self {
            version: u16_at(0),
            flags: u16_at(2),
            header_len: u32_at(4),
            header_addr: u64_at(8),
            body_addr: u64_at(16),
            body_len: u32_at(24),
            req_id: u32_at(28),
            step_id: u32_at(32),
            src_pod: u32_at(36),
            dst,
            dst_port: u16_at(56),
            status: u16_at(58),
            valid: u32_at(60),
        }
    }

    /// As eight little-endian words (how rings store it); `valid` is the high half of
    /// the last word.
    pub fn to_words(&self) -> [u64; 8] {
        let bytes = self.to_bytes();
        std::array::from_fn(|i| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        })
    }

    /// From eight little-endian words.
    pub fn from_words(words: &[u64; 8]) -> Self {
        let mut bytes = [0u8; DESCRIPTOR_SIZE];
        for (i, w) in words.iter().enumerate() {
            bytes[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        Self::from_bytes(&bytes)
    }
}

#[cfg(test)]
mod tests;

//! The host↔DPU control channel: small request/response messages
//! with a magic number and a protocol version, one definition shared by both sides.
//! Only metadata travels here: pod registration, the export descriptors of the pools
//! and rings a pod maps, teardown. Bulk data never does.
//!
//! A frame is a fixed 16-byte header, the same in every version so that a peer of
//! another version can still be told so, then a body:
//!
//! | bytes | field |
//! | --- | --- |
//! | 0–3 | magic `DPMC` |
//! | 4–5 | protocol version |
//! | 6–7 | kind: 1 request, 2 response, 3 version mismatch (body: UTF-8 text) |
//! | 8–11 | request id (a response echoes it) |
//! | 12–15 | body length (at most 64 KiB) |
//!
//! Bodies are [`Request`]/[`Response`] in postcard. Transports: a Unix socket or TCP
//! here ([`transport`]); DOCA Comch on BlueField (`doca` feature).

pub mod transport;

#[cfg(feature = "doca")]
pub mod comch;

use std::io::{Read, Write};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `DPMC`, little-endian.
pub const MAGIC: u32 = u32::from_le_bytes(*b"DPMC");
/// The protocol version this build speaks.
/// 3: registrations carry a token. 4: BlueCache store messages. 7: host agents
/// (`PodShape`, `AdoptPod`, `Doorbell`, `Wake`).
pub const PROTOCOL_VERSION: u16 = 7;
/// Largest body accepted.
pub const MAX_BODY: u32 = 64 << 10;
const HEADER: usize = 16;

const KIND_REQUEST: u16 = 1;
const KIND_RESPONSE: u16 = 2;
const KIND_VERSION_MISMATCH: u16 = 3;

/// What a host asks of its DPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// First message on a connection: who is calling.
    Hello {
        /// The caller's role.
        role: Role,
        /// A name for logs (pod name, proxy name).
        name: String,
    },
    /// Registers a pod on this node: the DPU creates its pools and rings and answers
    /// with their export descriptors.
    RegisterPod {
        /// The pod's name (unique on the node).
        name: String,
        /// The service it serves (for routing).
        service: String,
        /// Its process id (for liveness checks beside the connection itself).
        pid: u32,
        /// Proof that it may serve as `service` (see `dpumesh_identity::registration`);
        /// a node with a registration key refuses registrations without a valid one.
        token: Option<String>,
    },
    /// Unregisters a pod: its rings stop being polled and its buffers are reclaimed.
    UnregisterPod { pod_id: u32 },
    /// Which pods on this node serve `service` (for case 3: a pod addressing a
    /// service on its own node).
    Resolve { service: String },
    /// Liveness.
    Ping,
    /// Where `service` runs as seen from this node: its pods here (case 3), else the
    /// fabric address of a node that runs it (case 1).
    Locate { service: String },
    /// A BlueCache store message (`dpumesh-store`'s `DTRF` protocol, with its own
    /// magic and version): metadata of transfers whose bytes move by DMA. The
    /// connection must act for a service first (its keys are that service's).
    Store(Vec<u8>),
    /// Proves that this connection acts for `service` (a store client: a pod's
    /// registration proves it too), with the same token a registration carries.
    Authenticate {
        service: String,
        token: Option<String>,
    },
    /// A host agent asks how to lay out a pod's regions (the DOCA split: the agent
    /// makes them in host memory, the DPU reaches them across PCIe).
    PodShape,
    /// A host agent registers a pod whose regions it made: [`AgentRegions`], with
    /// their export descriptors (`hw_export`, DOCA) or, on the node's Unix socket in
    /// software, the regions themselves as descriptors in the order
    /// [`AgentRegions::descriptors`] says. Checked as a registration is (the token),
    /// and every region against the node's [`PodShape`].
    AdoptPod {
        name: String,
        service: String,
        pid: u32,
        token: Option<String>,
        regions: Box<AgentRegions>,
    },
    /// A pod rang the host agent's bell of `lane` (it published to a TX SQ of that
    /// lane): the shard of that lane looks at its pods. Not answered.
    Doorbell { lane: u32 },
}

/// What the DPU answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// Answer to [`Request::Hello`].
    Hello {
        /// The node's name.
        node: String,
    },
    /// The pod is registered; map these.
    PodRegistered(Box<PodExports>),
    /// Answer to [`Request::Resolve`]: the pods serving it here, by id (empty: none
    /// on this node).
    Resolved { pods: Vec<u32> },
    /// Done.
    Ok,
    /// Answer to [`Request::Ping`].
    Pong,
    /// The request failed.
    Error {
        /// Why, as a class.
        code: ErrorCode,
        /// Why, for people.
        message: String,
    },
    /// Unsolicited: the DPU is tearing the pod down (node shutdown); stop using the
    /// exports.
    Teardown { reason: String },
    /// Answer to [`Request::Locate`].
    Located {
        /// Pods serving it on this node, by id.
        pods: Vec<u32>,
        /// A node elsewhere that runs it (`ip:port` of its proxy), when none here.
        remote: Option<String>,
    },
    /// The BlueCache agent's answer to [`Request::Store`].
    Store(Vec<u8>),
    /// Answer to [`Request::PodShape`].
    PodShape(PodShape),
    /// Answer to [`Request::AdoptPod`]: the pod's id and its four pools' region ids
    /// (what the agent lays the pools out with, in [`AgentRegions::pools`] order).
    PodAdopted { pod_id: u32, pools: [u16; 4] },
    /// Unsolicited (id 0), to a host agent: the DPU delivered to pod `pod`, which said
    /// it sleeps; the agent rings its bell and futex (the DPU cannot write a host
    /// eventfd).
    Wake { pod: u32 },
}

/// How a node's pods are laid out, for a host agent that makes their regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodShape {
    /// Ring pairs per pod (the node's shards).
    pub lanes: u32,
    /// Bytes per header slot, and header slots per direction.
    pub header_slot: u32,
    pub header_slots: u32,
    /// Bytes per body slot, and body slots per direction.
    pub body_slot: u32,
    pub body_slots: u32,
    /// Entries of each TX and RX SQ.
    pub ring_capacity: u32,
}

/// A pod's regions as a host agent made them (before the DPU named their ids): the
/// four pools (`tx_header`, `tx_body`, `rx_header`, `rx_body`, region id 0 in each
/// export), each lane's TX SQ and RX SQ, and the pod's bell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRegions {
    pub pools: [RegionExport; 4],
    /// (TX SQ, RX SQ) per lane, in lane order.
    pub lanes: Vec<(RegionExport, RegionExport)>,
    pub bell: RegionExport,
}

impl AgentRegions {
    /// How many descriptors come with them on a Unix socket: the four pools, each
    /// lane's two rings, the bell's region.
    pub fn descriptors(&self) -> usize {
        4 + 2 * self.lanes.len() + 1
    }
}

/// Classes of control errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// A pod of that name is registered already.
    AlreadyRegistered,
    /// No such pod.
    UnknownPod,
    /// The node has no room (pod table, regions).
    Exhausted,
    /// The request is not valid in this state (e.g. before Hello).
    BadRequest,
    /// Something failed on the DPU.
    Internal,
    /// The registration's token does not prove its service.
    Unauthorized,
}

/// Who is on the other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// A host pod (the host library).
    Host,
    /// A DPU proxy or tool.
    Dpu,
}

/// Everything a registered pod maps. The regions come as descriptors with the answer
/// (`SCM_RIGHTS` on the node's Unix socket), never by a name another process could
/// open: first each lane's bell eventfd, then each lane's bell region, the four pools
/// (`tx_header`, `tx_body`, `rx_header`, `rx_body`), each lane's TX SQ and RX SQ, and
/// last the pod's own bell, its region then its eventfd ([`PodExports::descriptors`]
/// of them in all).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodExports {
    /// The id the DPU assigned (goes in descriptors as `src_pod`/`dst`).
    pub pod_id: u32,
    /// Pool for the heads the pod sends.
    pub tx_header: RegionExport,
    /// Pool for the bodies the pod sends.
    pub tx_body: RegionExport,
    /// Pool the DPU writes received heads into.
    pub rx_header: RegionExport,
    /// Pool the DPU (or a remote peer over the fabric) writes received bodies into.
    pub rx_body: RegionExport,
    /// One ring pair per proxy shard of the node, in shard order: a request runs to
    /// completion on the shard that took it, so each shard reaches every pod on a
    /// lane of its own (as a multi-queue NIC gives each core its own queues).
    pub lanes: Vec<LaneExport>,
    /// The pod's bell, rung after a shard pushes to any of its RX SQs when the pod
    /// said it sleeps on it: a pod that waits in an event loop of its own (a reactor's
    /// `epoll`, with its sockets) puts the eventfd in its wait set instead of sleeping
    /// on its first RX lane's futex.
    pub bell: RegionExport,
}

impl PodExports {
    /// How many descriptors come with these exports.
    pub fn descriptors(&self) -> usize {
        4 + 4 * self.lanes.len() + 2
    }
}

/// One shard's ring pair into a pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneExport {
    /// Host TX SQ: the pod produces, the shard's DMA work consumes.
    pub tx_sq: RegionExport,
    /// Host RX SQ: the shard's DMA work produces, the pod consumes. Every lane's
    /// producer wakes the pod through the first lane's wake words.
    pub rx_sq: RegionExport,
    /// The shard's bell, rung after pushing to this lane's TX SQ: its `waiting` word
    /// here, its eventfd passed with the answer (in lane order; Unix sockets only:
    /// over TCP the shard polls).
    pub bell: RegionExport,
}

/// How to map one region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionExport {
    /// Region id (in [`dpumesh_rings::BufAddr`]s).
    pub id: u16,
    /// The region's name, for messages (`memfd:NAME`: it is passed as a descriptor,
    /// not opened by this).
    pub path: PathBuf,
    /// Size in bytes.
    pub len: u64,
    /// What it holds.
    pub kind: RegionKind,
    /// A hardware export descriptor (`doca_mmap_export_pci`), empty in software.
    pub hw_export: Vec<u8>,
}

/// What a region holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegionKind {
    /// A buffer pool.
    Pool {
        /// Bytes per slot.
        slot_size: u32,
        slot_count: u32,
    },
    /// A descriptor ring.
    Ring { capacity: u32 },
    /// A bell's `waiting` word (see [`dpumesh_rings::bell`]).
    Bell,
}

/// Why a control exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The transport failed.
    #[error("control channel I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the connection.
    #[error("control channel closed by the peer")]
    Closed,
    /// Not a control-channel peer.
    #[error("not a DPUmesh control channel peer (magic {found:#010x}, expected {MAGIC:#010x})")]
    Magic {
        /// The magic found.
        found: u32,
    },
    /// The peer speaks another protocol version.
    #[error(
        "control protocol version mismatch: this side speaks version {ours}, the peer speaks version {theirs}; run the same DPUmesh release on host and DPU"
    )]
    Version {
        /// This build's version.
        ours: u16,
        /// The peer's.
        theirs: u16,
    },
    /// A frame kind this version does not know.
    #[error("unknown control frame kind {0}")]
    Kind(u16),
    /// A body over the limit.
    #[error("control frame body of {0} bytes exceeds the {MAX_BODY}-byte limit")]
    TooLarge(u32),
    /// A body that does not decode.
    #[error("control frame body does not decode: {0}")]
    Body(String),
    /// The peer did not prove who it is (mutual TLS on a TCP connection).
    #[error("control channel: {0}")]
    Handshake(#[from] dpumesh_identity::IdentityError),
    /// A response to a request that was not asked.
    #[error("response id {got} does not answer request {expected}")]
    Unexpected {
        /// The id sent.
        expected: u32,
        /// The id received.
        got: u32,
    },
    /// The peer answered with an error.
    #[error("the DPU refused: {code:?}: {message}")]
    Refused {
        /// Its class.
        code: ErrorCode,
        message: String,
    },
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A request with its id.
    Request(u32, Request),
    /// A response with the id it answers.
    Response(u32, Response),
}

fn header(kind: u16, id: u32, len: u32, version: u16) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&version.to_le_bytes());
    h[6..8].copy_from_slice(&kind.to_le_bytes());
    h[8..12].copy_from_slice(&id.to_le_bytes());
    h[12..16].copy_from_slice(&len.to_le_bytes());
    h
}

/// Encodes a frame.
pub fn encode(frame: &Frame) -> Vec<u8> {
    let (kind, id, body) = match frame {
        Frame::Request(id, r) => (KIND_REQUEST, *id, postcard::to_stdvec(r)),
        Frame::Response(id, r) => (KIND_RESPONSE, *id, postcard::to_stdvec(r)),
    };
    let body = body.expect("control messages always serialize");
    let mut out = header(kind, id, body.len() as u32, PROTOCOL_VERSION).to_vec();
    out.extend_from_slice(&body);
    out
}

/// The frame a peer of another version gets: our version in the header, and the
/// mismatch in words.
pub fn encode_version_mismatch(theirs: u16) -> Vec<u8> {
    let text = format!(
        "control protocol version mismatch: the DPU speaks version {PROTOCOL_VERSION}, this peer sent version {theirs}"
    );
    let mut out = header(
        KIND_VERSION_MISMATCH,
        0,
        text.len() as u32,
        PROTOCOL_VERSION,
    )
    .to_vec();
    out.extend_from_slice(text.as_bytes());
    out
}

/// Reads one frame. A peer of another version yields [`ControlError::Version`]
/// (after the body is consumed, so the caller may still answer it).
pub fn read_frame(r: &mut impl Read) -> Result<Frame, ControlError> {
    let mut h = [0u8; HEADER];
    match r.read_exact(&mut h) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(ControlError::Closed);
        }
        Err(e) => return Err(e.into()),
    }
    decode_header_and_body(&h, |len| {
        let mut body = vec![0u8; len];
        r.read_exact(&mut body)?;
        Ok(body)
    })
}

/// Decodes a whole frame held in memory (what fuzzing and message transports use).
pub fn decode(bytes: &[u8]) -> Result<Frame, ControlError> {
    if bytes.len() < HEADER {
        return Err(ControlError::Closed);
    }
    let (h, rest) = bytes.split_at(HEADER);
    let h: &[u8; HEADER] = h.try_into().expect("split at HEADER");
    decode_header_and_body(h, |len| {
        rest.get(..len)
            .map(<[u8]>::to_vec)
            .ok_or(ControlError::Closed)
    })
}

fn decode_header_and_body(
    h: &[u8; HEADER],
    body: impl FnOnce(usize) -> Result<Vec<u8>, ControlError>,
) -> Result<Frame, ControlError> {
    let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    if magic != MAGIC {
        return Err(ControlError::Magic { found: magic });
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    let kind = u16::from_le_bytes([h[6], h[7]]);
    let id = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    let len = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
    if len > MAX_BODY {
        return Err(ControlError::TooLarge(len));
    }
    let body = body(len as usize)?;
    if version != PROTOCOL_VERSION {
        return Err(ControlError::Version {
            ours: PROTOCOL_VERSION,
            theirs: version,
        });
    }
    let parse = |e: postcard::Error| ControlError::Body(e.to_string());
    match kind {
        KIND_REQUEST => Ok(Frame::Request(
            id,
            postcard::from_bytes(&body).map_err(parse)?,
        )),
        KIND_RESPONSE => Ok(Frame::Response(
            id,
            postcard::from_bytes(&body).map_err(parse)?,
        )),
        // A peer complains about a version we did not send: a protocol error, with
        // its words.
        KIND_VERSION_MISMATCH => Err(ControlError::Body(
            String::from_utf8_lossy(&body).into_owned(),
        )),
        other => Err(ControlError::Kind(other)),
    }
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, frame: &Frame) -> Result<(), ControlError> {
    w.write_all(&encode(frame))?;
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests;

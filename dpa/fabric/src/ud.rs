//! Unreliable datagrams: UD queue pairs and address handles, as RoCE probes use them
//! (R-Pingmesh, `pingmesh/`).
//!
//! Semantics both backends follow, as in verbs:
//! - A UD queue pair is not connected: every send names its destination with an
//!   address handle (the peer's GID, a flow label, a hop limit), the destination
//!   queue pair number and its Q_Key. One message is at most [`UD_MTU`] bytes.
//! - Delivery is not guaranteed and not acknowledged: a send completes when the
//!   device has put it on the wire, whether or not it arrives. A datagram for a queue
//!   pair with no receive posted, with another Q_Key or another queue pair number is
//!   dropped silently (counted in [`UdCounters`]).
//! - A receive buffer starts with [`GRH_LEN`] bytes of Global Routing Header (the
//!   sender's and receiver's GIDs, the flow label), then the payload; the completion's
//!   `byte_len` counts both.
//! - Completions carry a time ([`UdCompletion::timestamp_ns`], [`now_ns`]'s clock):
//!   when a send went on the wire and when a receive arrived — the prober's T2/T5 and
//!   the responder's T3/T4.
//!
//! The flow label is the probe's entropy: RoCEv2 NICs derive the UDP source port
//! from it, so different labels between the same two GIDs take different ECMP paths;
//! the software backend sends each label from its own UDP source port for the same
//! reason.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use super::{FabricError, QpCaps, RecvWr, Sge, WcOpcode, WcStatus};

/// Bytes of Global Routing Header at the start of every UD receive buffer.
pub const GRH_LEN: usize = 40;
/// Largest UD message (RoCE's largest path MTU).
pub const UD_MTU: usize = 4096;
/// The UDP port RoCEv2 sends to.
pub const ROCEV2_PORT: u16 = 4791;

/// A port's global identifier: for RoCEv2, the interface's IP address (IPv4 as an
/// IPv4-mapped IPv6 address).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The GID RoCEv2 gives `ip`.
    pub fn from_ip(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self(v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => Self(v6.octets()),
        }
    }

    /// The IP address of a RoCEv2 GID.
    pub fn ip(&self) -> IpAddr {
        let v6 = Ipv6Addr::from(self.0);
        match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        }
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The full colon form verbs tools print (`ibv_devinfo -v`), never shortened.
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// Why a GID does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0:?} is not a GID (an IPv6 address such as fe80::2:c903:33:1234, or an IPv4 address)")]
pub struct GidParseError(pub String);

impl FromStr for Gid {
    type Err = GidParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(v6) = s.parse::<Ipv6Addr>() {
            return Ok(Self(v6.octets()));
        }
        if let Ok(v4) = s.parse::<Ipv4Addr>() {
            return Ok(Self::from_ip(IpAddr::V4(v4)));
        }
        Err(GidParseError(s.to_owned()))
    }
}

/// Where a datagram goes (verbs' `ibv_ah_attr` with a GRH).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AddressVector {
    /// The destination port's GID.
    pub gid: Gid,
    /// 20 bits of flow label: the ECMP entropy of this path.
    pub flow_label: u32,
    /// IP TTL of the datagram (traceroute-style path probes lower it).
    pub hop_limit: u8,
    /// The destination's UDP port. RoCEv2 hardware always sends to
    /// [`ROCEV2_PORT`] and ignores it; the software backend uses it so several
    /// devices can share one host.
    pub udp_port: u16,
}

impl AddressVector {
    /// The address of `peer` (IP and UDP port) with no entropy and the default hop
    /// limit.
    pub fn to(peer: SocketAddr) -> Self {
        Self {
            gid: Gid::from_ip(peer.ip()),
            flow_label: 0,
            hop_limit: 64,
            udp_port: peer.port(),
        }
    }

    /// The socket address it names.
    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::new(self.gid.ip(), self.udp_port)
    }
}

/// A UD send work request.
#[derive(Debug)]
pub struct UdSendWr<'a, Ah> {
    /// The caller's id, returned in the completion.
    pub wr_id: u64,
    /// The message (at most [`UD_MTU`] bytes).
    pub sge: Sge,
    /// Where to.
    pub ah: &'a Ah,
    /// The destination queue pair.
    pub remote_qpn: u32,
    /// Its Q_Key.
    pub remote_qkey: u32,
    /// Immediate data (SEND_WITH_IMM).
    pub imm: Option<u32>,
    /// Whether success produces a completion.
    pub signaled: bool,
}

/// A completion on a UD queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdCompletion {
    /// The work request's id.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// [`WcOpcode::Send`] or [`WcOpcode::Recv`].
    pub opcode: WcOpcode,
    /// Bytes received, the GRH included (receives).
    pub byte_len: u32,
    /// Immediate data, if the sender sent some.
    pub imm: Option<u32>,
    /// The sender's queue pair (receives).
    pub src_qp: u32,
    /// The sender's address, to answer it (receives; verbs' `ibv_create_ah_from_wc`).
    pub src: Option<AddressVector>,
    /// The UDP source port of the datagram: the port it left from (sends) or
    /// arrived from (receives). With the two GIDs and the destination port it is the
    /// 5-tuple the network hashed.
    pub udp_src_port: u16,
    /// When the completion was produced, in [`now_ns`]'s clock.
    pub timestamp_ns: u64,
}

/// What a UD queue pair dropped, as a NIC's counters say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UdCounters {
    /// Datagrams that arrived with no receive posted.
    pub no_receive: u64,
    /// Datagrams for another queue pair or Q_Key, or malformed.
    pub rejected: u64,
}

/// A UD queue pair with its own completion queue.
pub trait UdQueuePair: Send + Sync {
    /// The address handle type.
    type Ah: Send + Sync;

    fn qp_num(&self) -> u32;
    /// Its Q_Key.
    fn qkey(&self) -> u32;
    /// The address peers reach it at (its GID and, in software, UDP port).
    fn local(&self) -> AddressVector;
    /// Posts a send.
    fn post_send(&self, wr: UdSendWr<'_, Self::Ah>) -> Result<(), FabricError>;
    /// Posts a receive (its buffer must hold [`GRH_LEN`] bytes more than the message).
    fn post_recv(&self, wr: RecvWr) -> Result<(), FabricError>;
    /// Appends up to `max` completions to `out`; returns how many. Never blocks.
    fn poll(&self, out: &mut Vec<UdCompletion>, max: usize) -> usize;
    /// Blocks up to `timeout` until a completion is available; true if one is.
    fn wait(&self, timeout: Duration) -> Result<bool, FabricError>;
    /// What it dropped.
    fn counters(&self) -> UdCounters;
    /// Whether a send's completion time is the time it was posted (software: the
    /// datagram is stamped as it goes, in the posting call), so a caller knows it
    /// before posting. A NIC stamps the CQE when the message left, known only from
    /// the completion: that is why R-Pingmesh's responder sends a second ACK.
    fn stamps_sends_when_posted(&self) -> bool {
        false
    }
}

/// A fabric with unreliable datagram queue pairs.
pub trait DatagramFabric: super::Fabric {
    /// Address handle.
    type Ah: Send + Sync;
    /// UD queue pair.
    type UdQp: UdQueuePair<Ah = Self::Ah>;

    /// A UD queue pair on the port whose address is `bind` (software: the UDP
    /// socket it binds; verbs: the GID of that IP, the UDP port ignored) with Q_Key
    /// `qkey`.
    fn create_ud_qp(
        &self,
        pd: &Self::Pd,
        bind: SocketAddr,
        qkey: u32,
        caps: QpCaps,
    ) -> Result<Self::UdQp, FabricError>;

    /// An address handle for `av`.
    fn create_ah(&self, pd: &Self::Pd, av: AddressVector) -> Result<Self::Ah, FabricError>;
}

/// Nanoseconds of the monotonic clock completions are stamped with, counted from
/// the first use in this process. T1..T6 come from it and only their differences
/// within one process are used (T5−T2 and T6−T1 on the prober, T4−T3 on the
/// responder), so no clock has to agree with another host's.
pub fn now_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_nanos() as u64
}

/// The Global Routing Header written in front of a received message.
pub(crate) fn encode_grh(src: Gid, dst: Gid, flow_label: u32, payload: u16, hop: u8) -> [u8; 40] {
    let mut g = [0u8; GRH_LEN];
    // Version 6, traffic class 0, flow label: as an IPv6 header.
    let word = (6u32 << 28) | (flow_label & 0xF_FFFF);
    g[0..4].copy_from_slice(&word.to_be_bytes());
    g[4..6].copy_from_slice(&payload.to_be_bytes());
    g[6] = 0x1b; // next header: IBA's BTH
    g[7] = hop;
    g[8..24].copy_from_slice(&src.0);
    g[24..40].copy_from_slice(&dst.0);
    g
}

/// The sender's GID and flow label in a received GRH.
pub fn parse_grh(grh: &[u8]) -> Option<(Gid, u32)> {
    if grh.len() < GRH_LEN {
        return None;
    }
    let word = u32::from_be_bytes([grh[0], grh[1], grh[2], grh[3]]);
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&grh[8..24]);
    Some((Gid(gid), word & 0xF_FFFF))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv4_gid_is_ipv4_mapped_and_comes_back() {
        let ip: IpAddr = "10.1.1.10".parse().unwrap();
        let gid = Gid::from_ip(ip);
        assert_eq!(gid.to_string(), "0000:0000:0000:0000:0000:ffff:0a01:010a");
        assert_eq!(gid.ip(), ip);
        assert_eq!("10.1.1.10".parse::<Gid>().unwrap(), gid);
        assert_eq!(gid.to_string().parse::<Gid>().unwrap(), gid);
    }

    #[test]
    fn a_gid_that_is_not_an_address_is_refused() {
        let err = "tor-a".parse::<Gid>().unwrap_err();
        assert!(err.to_string().contains("not a GID"), "{err}");
    }

    #[test]
    fn the_grh_carries_the_sender_and_flow_label() {
        let src = Gid::from_ip("10.0.0.1".parse().unwrap());
        let dst = Gid::from_ip("10.0.0.2".parse().unwrap());
        let g = encode_grh(src, dst, 0x12345, 100, 64);
        assert_eq!(parse_grh(&g), Some((src, 0x12345)));
        assert_eq!(parse_grh(&g[..39]), None);
    }
}

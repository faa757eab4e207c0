//! The data path: how heads and bodies move between ingress, the DPU proxy and host
//! pods — the three paths (1: a pod to another node, 2: outside to a pod, 3: a pod to
//! a pod on its node; docs/data-path.md), RPC over RDMA, and the host↔DPU control
//! channel.
//!
//! - [`descriptor`]: the 64-byte `sw_descriptor` every ring carries, checked on decode.
//! - [`shm`]: shared memory regions mapped by every process of a node.
//! - [`pool`]: fixed-size buffer slots with ownership that moves with descriptors and
//!   is reclaimed from participants that die.
//! - [`bell`]: how producers wake a consumer that sleeps in `epoll` (eventfd plus a
//!   shared `waiting` word), and [`fdpass`]: handing such an eventfd to another process.
//! - [`control`]: the host↔DPU control channel (registration, exports, teardown).
//! - [`dma`]: DMA engines and the DMA work (cases 1, 2 and 3) a proxy shard runs for
//!   its pods.
//! - [`fabric`]: the RDMA fabric between nodes (verbs semantics; shared memory between
//!   processes of one host, software over TCP between hosts, libibverbs behind
//!   `verbs`).
//! - [`agent`]: the host agent of the BlueField split (pods register there; it makes
//!   their regions in host memory and registers them with the DPU).
//! - [`dpu`]: a node's DPU side (pod registration, pools, rings, the shards' DMA work).
//! - [`host`]: a host pod's port (registration, TX/RX, completions).
//! - [`frame`]: the messages ingress and DPU proxies exchange over the fabric.
//! - [`link`]: one queue pair carrying frames with credits, and body transfers.
//! - [`rpc`]: RPC on the fabric (inline small requests, RDMA READ of large
//!   ones, responses by WRITE_WITH_IMM, a ring of contexts per connection).
//! - [`poll`]: how a serving thread waits: adaptive hybrid polling, or pure polling.
//! - [`ring`]: SPSC descriptor rings (host TX/RX SQs) with a busy-poll and an
//!   event-driven wake mode.
//!
//! No DPU, RDMA NIC or DOCA exists on the machines this is developed on: the software
//! implementations here are the product there, and follow the hardware semantics;
//! hardware backends sit behind the `verbs` and `doca` features.

pub use dpumesh_control as control;
pub use dpumesh_fabric as fabric;
pub use dpumesh_rings::{bell, descriptor, dma, fdpass, peercred, poll, pool, ring, shm};

pub mod agent;
pub mod dpu;
pub mod frame;
pub mod host;
pub mod link;
pub mod reconnect;
pub mod rpc;
pub mod traceroute;

pub use descriptor::{
    BufAddr, Buffer, Case, DESCRIPTOR_SIZE, Descriptor, DescriptorError, DescriptorStatus,
    Destination, Kind, RawDescriptor, StreamPart,
};
pub use dpu::{Dpu, DpuConfig, DpuError, DpuShard, PodInfo, PodSizing};
pub use host::{HostError, HostPort, Incoming, NodeWatch, Outgoing};
pub use poll::{Polling, Spin, Waited};
pub use pool::{BufferPool, OwnerId, PoolError, PoolLayout, SlotRef};
pub use ring::{Consumer, Producer, Ring, RingError, WakeMode};
pub use shm::{SharedRegion, ShmError};

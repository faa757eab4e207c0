//! The node's shared-memory data path, below the fabric and the control channel:
//!
//! - [`descriptor`]: the 64-byte `sw_descriptor` every ring carries, checked on decode.
//! - [`shm`]: shared memory regions mapped by every process of a node.
//! - [`pool`]: fixed-size buffer slots with ownership that moves with descriptors and
//!   is reclaimed from participants that die.
//! - [`ring`]: SPSC descriptor rings (host TX/RX SQs).
//! - [`bell`]: how producers wake a consumer that sleeps in `epoll` (eventfd plus a
//!   shared `waiting` word), [`fdpass`]: handing such an eventfd to another process,
//!   and [`peercred`]: who is on the other end of a Unix socket.
//! - [`poll`]: how a serving thread waits: adaptive hybrid polling, or pure polling.
//! - [`dma`]: DMA engines and the DMA work (cases 1, 2 and 3) a proxy shard runs for
//!   its pods.
//!
//! `dpumesh-dpa` re-exports these under the same paths.

pub mod bell;
pub mod descriptor;
pub mod dma;
pub mod fdpass;
pub mod peercred;
pub mod poll;
pub mod pool;
#[cfg(feature = "reactor")]
pub mod reactor_bell;
pub mod ring;
pub mod shm;

pub use descriptor::{
    BufAddr, Buffer, Case, DESCRIPTOR_SIZE, Descriptor, DescriptorError, DescriptorStatus,
    Destination, Kind, RawDescriptor, StreamPart,
};
pub use poll::{Polling, Spin, Waited};
pub use pool::{BufferPool, OwnerId, PoolError, PoolLayout, SlotRef};
pub use ring::{Consumer, Producer, Ring, RingError, WakeMode};
pub use shm::{SharedRegion, ShmError};

//! The client side of the mesh fabric, for whoever sends requests to nodes: the
//! ingress's shards (one [`Client`] per shard thread) and a node's filter callouts
//! (one on the callout thread). It owns a thread's links to the nodes, its registered
//! request and response slots, and the pump that turns completions into answers; the
//! nodes' link states go to a shared [`health::Health`].
//!
//! A role that sends through the fabric links this crate, not another role: the proxy
//! does not link the ingress.

pub mod health;

mod client;
mod stream;
mod upload;

pub use client::{Answer, Client, Slot};
pub use stream::StreamBody;
pub use upload::{Upload, UploadError};

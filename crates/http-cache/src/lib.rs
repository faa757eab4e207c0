//! The HTTP response cache's policy, for a shared cache (RFC 9111): which responses
//! may be stored and for how long, `Vary`, `Age`, revalidation with `ETag` and
//! `Last-Modified`, conditional requests answered with `304`, invalidation by unsafe
//! methods, and the index of what is stored. Pure logic over `http` types, with time
//! passed in; the DPU proxy applies it and keeps the bodies in its BlueCache store.
//!
//! - [`directives`] parses `Cache-Control`;
//! - [`policy`] decides storable, lifetime, age, validators, conditionals;
//! - [`index`] keeps stored responses by key and variant, and looks them up.

#![forbid(unsafe_code)]

pub mod directives;
pub mod index;
pub mod policy;

pub use index::{Entry, Index, Lookup, primary_key};
pub use policy::{NotStored, Rule};

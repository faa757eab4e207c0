//! Write DPUmesh filters in Rust.
//!
//! A filter is a type implementing [`Filter`]: it is built once per instance from its
//! configuration ([`Filter::Config`], parsed from JSON), sees the head of every request
//! routed through its chain in [`Filter::on_request`], and may watch the outcome in
//! [`Filter::on_response`]. [`export_filter!`] turns it into a `dpumesh:filter@0.1.3`
//! component when built for `wasm32-wasip2`.
//!
//! ```
//! use dpumesh_filter_sdk::{Filter, LocalReply, Request, Verdict, export_filter};
//!
//! #[derive(serde::Deserialize)]
//! struct Config {
//!     header: String,
//! }
//!
//! struct RequireHeader {
//!     header: String,
//! }
//!
//! impl Filter for RequireHeader {
//!     type Config = Config;
//!
//!     fn new(config: Config) -> Result<Self, String> {
//!         Ok(Self { header: config.header })
//!     }
//!
//!     fn on_request(&mut self, req: &Request<'_>) -> Verdict {
//!         match req.header(&self.header) {
//!             Some(_) => Verdict::Continue,
//!             None => LocalReply::new(400).body("missing header").into(),
//!         }
//!     }
//! }
//!
//! export_filter!(RequireHeader);
//! ```
//!
//! Host services (logging, clocks, metrics, node-wide shared state, signature
//! verification) are in the [`log`], [`clock`], [`metrics`], [`shared`] and [`crypto`]
//! modules. On a native target they are served by the [`mock`] proxy, so `cargo test`
//! runs a filter's logic without wasmtime.
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod clock;
pub mod crypto;
pub mod input;
pub mod log;
pub mod metrics;
pub mod shared;
pub mod util;

mod request;
mod sys;

#[cfg(any(target_arch = "wasm32", test))]
mod pending;

/// A guest allocates and frees the same few small blocks on every request (the
/// strings the host lowers into it, every value it reads): size classes serve those
/// from free lists instead of dlmalloc (docs/benchmarks.md, "The guests' allocator").
#[cfg(all(target_arch = "wasm32", feature = "fast-alloc"))]
#[global_allocator]
static ALLOCATOR: dpumesh_guest_alloc::SizeClasses<std::alloc::System> =
    dpumesh_guest_alloc::SizeClasses::new(std::alloc::System);
mod verdict;

#[cfg(target_arch = "wasm32")]
mod batched;
#[cfg(target_arch = "wasm32")]
mod guest;
#[cfg(not(target_arch = "wasm32"))]
pub mod mock;

pub use input::Interest;
pub use request::{Claim, HeadAccess, HeaderError, Method, Peer, Request, RequestLine, Scheme};
pub use verdict::{FailureKind, LocalReply, ResponseInfo, Verdict};

/// The bindings generated from `wit/filter.wit` (guest side). Filter authors rarely
/// need them: [`Filter`] and the helper modules cover the whole world.
#[cfg(target_arch = "wasm32")]
#[expect(missing_docs, reason = "bindgen-generated")]
#[allow(clippy::too_many_arguments, reason = "bindgen-generated")]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../wit",
        world: "batched-filter",
        pub_export_macro: true,
        export_macro_name: "__export_filter_world",
        default_bindings_module: "dpumesh_filter_sdk::bindings",
        generate_all,
        // Imports take lists of strings as `&[&str]`: a filter asking for two headers
        // or handing over its metadata copies nothing into owned strings first.
        ownership: Borrowing { duplicate_if_necessary: true },
    });
}

/// A DPUmesh filter.
///
/// Only [`Filter::new`] and [`Filter::on_request`] are required; the response phase
/// defaults to doing nothing. One value lives per instance, and an instance handles
/// one request at a time, so `&mut self` is safe for caches and counters (for state
/// every worker must agree on, use [`shared`]).
pub trait Filter: Sized + 'static {
    /// The filter's configuration, parsed from the JSON string the proxy passes to
    /// `configure`. An empty string parses as `{}` (or `null`), so a config type whose
    /// fields all have defaults needs no configuration at all.
    type Config: serde::de::DeserializeOwned;

    /// Builds the filter from its configuration. An error rejects the configuration:
    /// the proxy refuses to load (or reload) it and says why.
    fn new(config: Self::Config) -> Result<Self, String>;

    /// Decides about one request.
    fn on_request(&mut self, req: &Request<'_>) -> Verdict;

    /// What the filter reads on every request: the proxy hands these headers and
    /// metadata in with the call, so reading them costs no crossing into the proxy
    /// (anything else is still fetched when asked for). Asked once, after
    /// [`Filter::new`]. Header edits, metadata and counters are sent back with the
    /// verdict in any case.
    fn interest(&self) -> Interest {
        Interest::default()
    }

    /// Observes the outcome of a request whose `on_request` ran (reverse chain order).
    fn on_response(&mut self, req: &Request<'_>, info: &ResponseInfo) {
        let _ = (req, info);
    }
}

/// Parses a filter configuration the way the export glue does: JSON, with an empty
/// string meaning `{}` (or `null`). Errors read `invalid config: <cause>`.
pub fn parse_config<C: serde::de::DeserializeOwned>(config: &str) -> Result<C, String> {
    if config.trim().is_empty() {
        return serde_json::from_str("{}")
            .or_else(|_| serde_json::from_str("null"))
            .map_err(|e| format!("invalid config: the filter needs a configuration ({e})"));
    }
    serde_json::from_str(config).map_err(|e| format!("invalid config: {e}"))
}

/// Builds a filter from a configuration string: [`parse_config`] then [`Filter::new`].
pub fn configure<F: Filter>(config: &str) -> Result<F, String> {
    F::new(parse_config(config)?)
}

/// Exports a [`Filter`] as the component's `dpumesh:filter@0.1.3` world.
///
/// Expands to nothing on native targets, so the same crate builds for unit tests.
#[macro_export]
macro_rules! export_filter {
    ($ty:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            struct __DpumeshFilterGuest;

            ::std::thread_local! {
                static FILTER: ::core::cell::RefCell<::core::option::Option<$ty>> =
                    const { ::core::cell::RefCell::new(::core::option::Option::None) };
            }

            impl $crate::bindings::Guest for __DpumeshFilterGuest {
                fn configure(
                    config: ::std::string::String,
                ) -> ::core::result::Result<(), ::std::string::String> {
                    $crate::__private::configure::<$ty>(&FILTER, &config)
                }

                fn on_request(
                    line: $crate::bindings::dpumesh::filter::types::RequestLine,
                    head: &$crate::bindings::dpumesh::filter::types::RequestHead,
                ) -> $crate::bindings::dpumesh::filter::types::Verdict {
                    $crate::__private::on_request::<$ty>(&FILTER, line, head)
                }

                fn on_request_head(
                    head: &$crate::bindings::dpumesh::filter::types::RequestHead,
                ) -> $crate::bindings::dpumesh::filter::types::Verdict {
                    $crate::__private::on_request_head::<$ty>(&FILTER, head)
                }

                fn on_response(
                    head: &$crate::bindings::dpumesh::filter::types::RequestHead,
                    info: $crate::bindings::dpumesh::filter::types::ResponseInfo,
                ) {
                    $crate::__private::on_response::<$ty>(&FILTER, head, info)
                }

                fn interest() -> $crate::bindings::dpumesh::filter::types::Interest {
                    $crate::__private::interest::<$ty>(&FILTER)
                }

                fn handle_request(
                    head: &$crate::bindings::dpumesh::filter::types::RequestHead,
                    input: ::std::vec::Vec<u8>,
                ) -> $crate::bindings::dpumesh::filter::types::Outcome {
                    $crate::__private::handle_request::<$ty>(&FILTER, head, &input)
                }
            }

            $crate::bindings::__export_filter_world!(
                __DpumeshFilterGuest with_types_in $crate::bindings
            );
        };
    };
}

#[doc(hidden)]
#[cfg(target_arch = "wasm32")]
pub mod __private {
    pub use crate::guest::{
        configure, handle_request, interest, on_request, on_request_head, on_response,
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Cfg {
        #[serde(default)]
        n: u32,
    }

    #[test]
    fn empty_config_means_defaults() {
        assert_eq!(parse_config::<Cfg>("  "), Ok(Cfg { n: 0 }));
        assert_eq!(parse_config::<()>(""), Ok(()));
    }

    #[test]
    fn config_errors_name_the_cause() {
        let err = parse_config::<Cfg>(r#"{"m": 1}"#).unwrap_err();
        assert!(
            err.starts_with("invalid config: unknown field `m`"),
            "{err}"
        );
        let err = parse_config::<Cfg>("{").unwrap_err();
        assert!(err.contains("EOF"), "{err}");
    }
}

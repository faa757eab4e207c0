//! Composing a chain's filter components and its driver into one component.
//!
//! Each filter is instantiated inside the composition with the imports it declares
//! left to the composition's own imports (merged by name, the highest semver-
//! compatible version kept: a filter built for `dpumesh:filter@0.1.0` and one built for
//! 0.1.2 share the 0.1.2 instance, which has everything 0.1.0 had), so the host links it
//! as it links a single filter. The driver takes each filter's `on-request` and
//! `on-response`; the composition exports the driver's two calls and every filter's
//! `configure` as `configure-K`.

use wac_graph::types::Package;
use wac_graph::{CompositionGraph, EncodeOptions};

use super::driver::{RUN_REQUEST, RUN_RESPONSE};

/// What the composition needs of one filter.
pub(crate) struct Member<'a> {
    /// The component's bytes.
    pub(crate) bytes: &'a [u8],
    /// Whether it exports `configure`.
    pub(crate) configure: bool,
    /// Whether it exports `on-response`.
    pub(crate) on_response: bool,
}

/// The name of filter `k`'s `configure` in the composition.
pub(crate) fn configure_export(k: usize) -> String {
    format!("configure-{k}")
}

/// Why the composition failed: the filter it names (an index into the chain) or the
/// graph as a whole.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ComposeError {
    #[error("filter #{index} cannot be composed: {source:#}")]
    Member {
        index: usize,
        #[source]
        source: anyhow::Error,
    },
    #[error("the chain cannot be composed: {0:#}")]
    Graph(anyhow::Error),
}

/// One component running `members` in order through `driver`.
pub(crate) fn compose(driver: &[u8], members: &[Member<'_>]) -> Result<Vec<u8>, ComposeError> {
    let graph_error = |e: anyhow::Error| ComposeError::Graph(e);
    let mut graph = CompositionGraph::new();
    let package = Package::from_bytes("dpumesh:chain-driver", None, driver, graph.types_mut())
        .map_err(graph_error)?;
    let driver = graph
        .register_package(package)
        .map_err(|e| graph_error(e.into()))?;
    let driver = graph.instantiate(driver);
    for (index, member) in members.iter().enumerate() {
        let failed = |source: anyhow::Error| ComposeError::Member { index, source };
        let package = Package::from_bytes(
            &format!("dpumesh:chain-filter-{index}"),
            None,
            member.bytes,
            graph.types_mut(),
        )
        .map_err(failed)?;
        let package = graph
            .register_package(package)
            .map_err(|e| failed(e.into()))?;
        let instance = graph.instantiate(package);
        let mut wire = |export: &str, argument: String| -> Result<(), ComposeError> {
            let alias = graph
                .alias_instance_export(instance, export)
                .map_err(|e| failed(e.into()))?;
            graph
                .set_instantiation_argument(driver, &argument, alias)
                .map_err(|e| failed(e.into()))
        };
        wire("on-request", format!("on-request-{index}"))?;
        if member.on_response {
            wire("on-response", format!("on-response-{index}"))?;
        }
        if member.configure {
            let alias = graph
                .alias_instance_export(instance, "configure")
                .map_err(|e| failed(e.into()))?;
            graph
                .export(alias, configure_export(index))
                .map_err(|e| failed(e.into()))?;
        }
    }
    for export in [RUN_REQUEST, RUN_RESPONSE] {
        let alias = graph
            .alias_instance_export(driver, export)
            .map_err(|e| graph_error(e.into()))?;
        graph
            .export(alias, export)
            .map_err(|e| graph_error(e.into()))?;
    }
    graph
        .encode(EncodeOptions::default())
        .map_err(|e| graph_error(e.into()))
}

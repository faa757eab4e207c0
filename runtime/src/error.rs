//! Errors of loading filters and of running them.
//!
//! Load errors are returned to whoever asked for the load (the config loader, the
//! admin API) and never reach a request. Run-time faults are applied as the filter's
//! failure policy and reported per request.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// Why a filter could not be loaded. Each variant names the filter.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The bytes are not a WebAssembly component (a core module, or not Wasm at all).
    #[error("filter {filter}: not a WebAssembly component: {detail}")]
    NotAComponent {
        filter: String,
        /// What the validator said.
        detail: String,
    },
    /// Compilation failed.
    #[error("filter {filter}: failed to compile: {detail}")]
    Compile {
        filter: String,
        /// The compiler's message.
        detail: String,
    },
    /// The component was built against another version of the filter package.
    #[error(
        "filter {filter}: component targets {found}, but this runtime serves dpumesh:filter@{expected}; rebuild the filter against dpumesh:filter@{expected}"
    )]
    WrongVersion {
        filter: String,
        /// The package the component imports, e.g. `dpumesh:filter/log@0.2.0`.
        found: String,
        /// The version this runtime serves.
        expected: &'static str,
    },
    /// The component imports something the filter world does not provide.
    #[error(
        "filter {filter}: component imports {import}, which the dpumesh:filter world does not provide (was it built for another world?)"
    )]
    UnknownImport {
        filter: String,
        /// The import's name.
        import: String,
    },
    /// A required export is missing.
    #[error(
        "filter {filter}: component does not export `{export}` (is it built for world dpumesh:filter/filter?)"
    )]
    MissingExport {
        filter: String,
        /// The missing export.
        export: &'static str,
    },
    /// An export has the wrong type.
    #[error("filter {filter}: export `{export}` has the wrong type: {detail}")]
    ExportType {
        filter: String,
        export: &'static str,
        /// The type checker's message.
        detail: String,
    },
    /// Linking or instantiating failed.
    #[error("filter {filter}: failed to instantiate: {detail}")]
    Instantiate { filter: String, detail: String },
    /// The filter's `configure` rejected its configuration.
    #[error("filter {filter}: configuration rejected: {message}")]
    Configure {
        filter: String,
        /// The filter's own message.
        message: String,
    },
    /// `configure` trapped, ran out of time or memory.
    #[error("filter {filter}: configure failed: {fault}")]
    ConfigureFault {
        filter: String,
        /// What went wrong.
        fault: FaultKind,
    },
    /// The settings are inconsistent (e.g. a memory cap above the runtime's maximum).
    #[error("filter {filter}: {detail}")]
    Settings {
        filter: String,
        /// What is wrong.
        detail: String,
    },
    /// A chain's filters could not be composed into one component (see
    /// `FilterChain::fuse`); the chain can still run unfused.
    #[error("chain {chain}: cannot fuse its filters: {detail}")]
    Fuse {
        chain: String,
        /// Why.
        detail: String,
    },
    /// Reading the component or the compile cache failed.
    #[error("filter {filter}: {path}: {source}")]
    Io {
        filter: String,
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// What went wrong inside a filter call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultKind {
    /// The call ran past its CPU deadline and was interrupted.
    Deadline(Duration),
    /// The call held its thread past the wall-clock backstop (this much wall time)
    /// without finishing, whatever CPU it used, and was interrupted.
    Stalled(Duration),
    /// The instance tried to grow its memory past the cap.
    MemoryCap(usize),
    /// The guest trapped (panic, unreachable, out-of-bounds access, ...).
    Trap(String),
    /// The filter returned something the proxy cannot send (bad status or header).
    BadReply(String),
    /// No instance could be created.
    Unavailable(String),
    /// Not called: repeated faults put the filter in backoff.
    Degraded {
        /// Milliseconds until the next attempt.
        retry_in_ms: u64,
    },
}

impl FaultKind {
    /// Whether a fresh instance might not fault again (traps, deadlines, memory): the
    /// `reload` policy retries only these.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            Self::Deadline(_) | Self::Stalled(_) | Self::MemoryCap(_) | Self::Trap(_)
        )
    }

    /// A short, stable label for metrics: `deadline`, `stalled`, `memory`, `trap`,
    /// `bad_reply`, `unavailable`, `degraded`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Deadline(_) => "deadline",
            Self::Stalled(_) => "stalled",
            Self::MemoryCap(_) => "memory",
            Self::Trap(_) => "trap",
            Self::BadReply(_) => "bad_reply",
            Self::Unavailable(_) => "unavailable",
            Self::Degraded { .. } => "degraded",
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Deadline(d) => write!(f, "exceeded its CPU deadline of {d:?}"),
            Self::Stalled(d) => write!(
                f,
                "held its thread for {d:?} of wall time without finishing (the wall-clock backstop)"
            ),
            Self::MemoryCap(cap) => write!(f, "exceeded its memory cap of {} KiB", cap / 1024),
            Self::Trap(msg) => write!(f, "trapped: {msg}"),
            Self::BadReply(msg) => write!(f, "returned an invalid reply: {msg}"),
            Self::Unavailable(msg) => write!(f, "has no instance: {msg}"),
            Self::Degraded { retry_in_ms } => write!(
                f,
                "is degraded after repeated faults (next attempt in {retry_in_ms} ms)"
            ),
        }
    }
}

/// Which export was running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// `configure`.
    Configure,
    /// `on-request`.
    Request,
    /// `on-response`.
    Response,
    /// A proxy-wasm plugin's `proxy_on_tick`.
    Tick,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Configure => "configure",
            Self::Request => "on-request",
            Self::Response => "on-response",
            Self::Tick => "proxy_on_tick",
        })
    }
}

/// A fault in a filter call, tagged with where it happened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("filter {filter} {kind} in {phase}")]
pub struct FilterFault {
    pub filter: String,
    pub phase: Phase,
    /// What happened.
    pub kind: FaultKind,
}

//! Logging setup: `tracing` with the level from the config, overridden by
//! `DPUMESH_LOG` (same syntax as `RUST_LOG`), as text or JSON lines.

use tracing_subscriber::EnvFilter;

use dpumesh_config::proxy::{LogConfig, LogFormat};

/// Whether log lines on stderr get ANSI colours: only on a terminal, and never with
/// `NO_COLOR` set (<https://no-color.org>); a log file or a pipe gets plain text.
pub fn colour() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Installs the global subscriber; a second call (or an existing subscriber) is a
/// no-op.
pub fn init(config: &LogConfig) {
    let filter = std::env::var("DPUMESH_LOG")
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .or_else(|| EnvFilter::try_new(&config.level).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour())
        .with_writer(std::io::stderr);
    let _ = match config.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

//! Logging setup: `tracing` with the level from the config, overridden by
//! `DPUMESH_LOG` (same syntax as `RUST_LOG`), as text or JSON lines.

use tracing_subscriber::EnvFilter;

use dpumesh_config::proxy::{LogConfig, LogFormat};

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
        .with_writer(std::io::stderr);
    let _ = match config.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

//! Logging setup: `tracing` with the level from the config, overridden by
//! `DPUMESH_LOG` (same syntax as `RUST_LOG`), as text or JSON lines: JSON unless
//! stderr is a terminal (`DPUMESH_LOG_FORMAT` = `auto`, `text` or `json` overrides
//! the config's `format`).

use tracing_subscriber::EnvFilter;

use dpumesh_config::proxy::{LogConfig, LogFormat};

/// Whether log lines on stderr get ANSI colours: only on a terminal, and never with
/// `NO_COLOR` set (<https://no-color.org>); a log file or a pipe gets plain text.
pub fn colour() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Whether lines are JSON: `DPUMESH_LOG_FORMAT` if set, else `format`; `auto` means
/// JSON when stderr is not a terminal.
pub fn json(format: LogFormat) -> bool {
    json_with(
        std::env::var("DPUMESH_LOG_FORMAT").ok().as_deref(),
        format,
        std::io::IsTerminal::is_terminal(&std::io::stderr()),
    )
}

fn json_with(env: Option<&str>, format: LogFormat, terminal: bool) -> bool {
    let format = match env.map(str::trim) {
        None | Some("") => format,
        Some("auto") => LogFormat::Auto,
        Some("text") => LogFormat::Text,
        Some("json") => LogFormat::Json,
        Some(other) => {
            // Logging is not up yet: this is the one place to say it.
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "dpumesh: DPUMESH_LOG_FORMAT={other:?} is not auto, text or json; using {format:?}"
            );
            format
        }
    };
    match format {
        LogFormat::Auto => !terminal,
        LogFormat::Text => false,
        LogFormat::Json => true,
    }
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
        .with_writer(std::io::stderr);
    let _ = if json(config.format) {
        builder.with_ansi(false).json().try_init()
    } else {
        builder.with_ansi(colour()).try_init()
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_json_off_a_terminal_and_the_environment_overrides_the_config() {
        assert!(json_with(None, LogFormat::Auto, false));
        assert!(!json_with(None, LogFormat::Auto, true));
        assert!(!json_with(None, LogFormat::Text, false));
        assert!(json_with(None, LogFormat::Json, true));
        assert!(!json_with(Some("text"), LogFormat::Json, false));
        assert!(json_with(Some("json"), LogFormat::Text, true));
        assert!(json_with(Some("auto"), LogFormat::Text, false));
        assert!(json_with(Some(""), LogFormat::Auto, false));
        // A typo keeps the config's choice (and says so).
        assert!(!json_with(Some("jsno"), LogFormat::Text, false));
    }
}

//! Logging into the proxy's structured log, tagged with the filter's name.

/// Severity, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Very verbose tracing.
    Trace,
    /// Debugging detail.
    Debug,
    /// Normal operation.
    Info,
    /// Something odd that did not stop the request.
    Warn,
    /// Something failed.
    Error,
}

/// Whether `level` is enabled for this filter: skip formatting when it is not.
pub fn enabled(level: Level) -> bool {
    crate::sys::log_enabled(level)
}

/// Writes one log line at `level`.
pub fn log(level: Level, message: &str) {
    crate::sys::log(level, message)
}

/// Logs at debug level.
pub fn debug(message: &str) {
    log(Level::Debug, message)
}

/// Logs at info level.
pub fn info(message: &str) {
    log(Level::Info, message)
}

/// Logs at warn level.
pub fn warn(message: &str) {
    log(Level::Warn, message)
}

/// Logs at error level.
pub fn error(message: &str) {
    log(Level::Error, message)
}

/// Logs a formatted message, formatting only if the level is enabled:
/// `log!(Level::Info, "denied {path}")`.
#[macro_export]
macro_rules! log {
    ($level:expr, $($arg:tt)+) => {{
        let level = $level;
        if $crate::log::enabled(level) {
            $crate::log::log(level, &::std::format!($($arg)+));
        }
    }};
}

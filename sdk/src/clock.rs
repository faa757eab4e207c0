//! Time as the proxy sees it (fixed by test hosts, so never read `SystemTime` in
//! time-dependent logic: use these).

/// Wall-clock nanoseconds since the Unix epoch.
pub fn wall_ns() -> u64 {
    crate::sys::wall_ns()
}

/// Monotonic nanoseconds from an arbitrary start.
pub fn monotonic_ns() -> u64 {
    crate::sys::monotonic_ns()
}

/// Whole seconds since the Unix epoch (what JWT `exp`/`nbf`/`iat` count).
pub fn unix_secs() -> u64 {
    wall_ns() / 1_000_000_000
}

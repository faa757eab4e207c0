//! What the tests share to stay honest on a busy machine.
//!
//! - A helper thread that panics fails its test with the helper's own message
//!   ([`joined`]), not `Any { .. }` from `join().unwrap()`.
//! - A test that needs a tool or a capability the machine lacks fails in CI, naming
//!   what is missing, and skips (saying so) only on a developer's machine
//!   ([`cannot_run`]): a suite that passes silently without its browser or its
//!   network namespaces proves nothing.
#![forbid(unsafe_code)]

use std::any::Any;
use std::thread::{JoinHandle, ScopedJoinHandle};

/// Joins a test's helper thread (plain or scoped); if it panicked, panics with its
/// message.
pub fn joined<T>(handle: impl Join<T>) -> T {
    let (name, result) = handle.join_named();
    match result {
        Ok(value) => value,
        Err(panic) => panic!(
            "a helper thread{} panicked: {}",
            name.map_or(String::new(), |n| format!(" ({n})")),
            message(&*panic)
        ),
    }
}

/// A handle of a thread that can be joined: [`JoinHandle`] and [`ScopedJoinHandle`].
pub trait Join<T> {
    /// The thread's name, and what joining it gave.
    fn join_named(self) -> (Option<String>, std::thread::Result<T>);
}

impl<T> Join<T> for JoinHandle<T> {
    fn join_named(self) -> (Option<String>, std::thread::Result<T>) {
        (self.thread().name().map(str::to_owned), self.join())
    }
}

impl<T> Join<T> for ScopedJoinHandle<'_, T> {
    fn join_named(self) -> (Option<String>, std::thread::Result<T>) {
        (self.thread().name().map(str::to_owned), self.join())
    }
}

/// The text a panic carried (`panic!` with a literal or a format).
pub fn message(panic: &(dyn Any + Send)) -> &str {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s
    } else {
        "(a panic without a message)"
    }
}

/// Whether this run is CI's (the `CI` environment variable is set and not `false`
/// or `0`, as CI services and `.ci/run` set it).
pub fn in_ci() -> bool {
    says_ci(std::env::var("CI").ok().as_deref())
}

fn says_ci(value: Option<&str>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// The test cannot run here because `what` is missing (`why`: the error that said
/// so). In CI this fails the test naming the tool; elsewhere it prints that the test
/// skipped and the caller returns.
#[track_caller]
pub fn cannot_run(what: &str, why: &dyn std::fmt::Display) {
    if in_ci() {
        panic!(
            "this test needs {what}, which CI must have: {why} \
             (./scripts/install-toolchain.sh installs the tools; CI runs as root)"
        );
    }
    eprintln!("SKIPPED (CI would fail here): this test needs {what}: {why}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_helper_threads_panic_reaches_the_test_with_its_message() {
        let helper = std::thread::Builder::new()
            .name("load client".into())
            .spawn(|| -> u32 { panic!("wrote to a closed socket: {}", 104) })
            .unwrap();
        let caught =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| joined(helper))).unwrap_err();
        assert_eq!(
            message(&*caught),
            "a helper thread (load client) panicked: wrote to a closed socket: 104"
        );
        assert_eq!(joined(std::thread::spawn(|| 7)), 7);
    }

    #[test]
    fn ci_is_any_value_of_ci_but_empty_false_and_0() {
        for (value, ci) in [
            (None, false),
            (Some(""), false),
            (Some("false"), false),
            (Some("0"), false),
            (Some("1"), true),
            (Some("true"), true),
        ] {
            assert_eq!(says_ci(value), ci, "CI={value:?}");
        }
    }

    #[test]
    fn a_panic_without_text_still_says_it_panicked() {
        let helper = std::thread::spawn(|| -> u8 { std::panic::panic_any(42u8) });
        let caught =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| joined(helper))).unwrap_err();
        assert_eq!(
            message(&*caught),
            "a helper thread panicked: (a panic without a message)"
        );
    }
}

/// A child process that is killed and reaped when dropped, so a test that panics
/// leaves no process behind, nor a pipe its runner would wait on.
#[derive(Debug)]
pub struct Reaped(pub std::process::Child);

impl std::ops::Deref for Reaped {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

//! What the multi-process tests share.

use std::process::Command;

/// The environment variable naming the emulator the test binary runs under (set by
/// the cargo `runner` of `.cargo/config.toml` for aarch64: qemu-aarch64 user mode).
pub const RUNNER: &str = "DPUMESH_TEST_RUNNER";

/// A command running this test binary again (a pod or peer process). Under user-mode
/// emulation the kernel cannot exec an aarch64 binary by itself (no binfmt_misc
/// registration is assumed): the child starts through the same emulator.
pub fn this_test_binary() -> Command {
    let me = std::env::current_exe().expect("the test binary's path");
    match std::env::var(RUNNER).ok().filter(|r| !r.trim().is_empty()) {
        Some(runner) => {
            let mut words = runner.split_whitespace();
            let mut cmd = Command::new(words.next().expect("not empty"));
            cmd.args(words).arg(me);
            cmd
        }
        None => Command::new(me),
    }
}

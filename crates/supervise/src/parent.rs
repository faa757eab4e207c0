//! Processes that end with the process that started them.
//!
//! `dpumesh up` starts nodes, the ingress, Pingmesh and the services as its children
//! and stops them when it stops. If `up` itself is killed (SIGKILL, an OOM kill, a
//! test harness giving up on it), nothing would stop them: they would serve on as
//! orphans, holding ports and shared memory. A child started with [`PARENT_ENV`] set
//! asks the kernel for SIGTERM when its parent dies (`PR_SET_PDEATHSIG`), and exits at
//! once if its parent is already gone by the time it asks.

/// Set by a parent to its own pid for children that must not outlive it.
pub const PARENT_ENV: &str = "DPUMESH_PARENT";

/// Makes this process end (SIGTERM, which the roles take as their stop signal) when
/// the process named by [`PARENT_ENV`] dies; nothing when the variable is not set.
pub fn die_with_parent() {
    let Some(parent) = std::env::var(PARENT_ENV)
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    if let Err(e) =
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))
    {
        tracing::warn!(error = %e, "cannot ask to end with the parent process");
        return;
    }
    // The parent may have died between our start and the request above: then the
    // signal never comes. (A parent that is not ours, but alive, started us through
    // a wrapper such as `sh -c`: the signal then follows the wrapper.)
    let ours = rustix::process::getppid().map(|p| p.as_raw_nonzero().get());
    let gone = rustix::process::Pid::from_raw(parent)
        .is_none_or(|p| rustix::process::test_kill_process(p).is_err());
    if ours != Some(parent) && gone {
        tracing::warn!(parent, "the process that started this one is gone: exiting");
        std::process::exit(1);
    }
}

//! The policy steps around an exchange's tries, each pure (no I/O, time passed in)
//! with its own table tests: [`timeout`] (the exchange's and each try's deadline, and
//! what a peer is told), [`retry`] (whether a failed try is tried again), [`breaker`]
//! (how an answer counts for the circuit breaker of the response phase, and whom it
//! blames). The shard's event loop asks them at the points where an exchange opens,
//! a try starts, a try fails and an exchange ends; the response cache is the fourth
//! step (`super::cache`, over `dpumesh-http-cache`).

pub(super) mod breaker;
pub(super) mod retry;
pub(super) mod timeout;

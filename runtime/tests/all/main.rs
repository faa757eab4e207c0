//! Integration tests of the runtime, in one binary to keep link time down.

mod chain;
mod errors;
mod faults;
mod support;
mod workers;

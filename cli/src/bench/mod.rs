//! `dpumesh bench …`: benchmark harnesses that measure a path and its baselines in
//! one run and print ratios.

pub mod dpa;

//! The DPUmesh DPU proxy as a process: a YAML config file, hot reload (file watch and
//! `POST /reload`) with atomic generations, an admin API with Prometheus metrics, and
//! a loopback HTTP listener that runs the chains and answers the verdict until the
//! ingress and data path exist.

#![deny(unsafe_code)]

pub mod config;

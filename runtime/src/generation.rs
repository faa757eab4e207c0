//! Published, numbered sets of chains, and what ties a request's two phases to the
//! one it started in: the request phase's ticket and results. A shard's inline chains
//! ([`crate::LocalChains`]) and the worker pool both run generations.

use std::sync::Arc;

use dpumesh_head::RequestHead;

use crate::chain::{ChainOutcome, FilterChain};
use crate::error::FilterFault;

/// A published, numbered set of chains.
#[derive(Debug)]
pub struct Generation {
    number: u64,
    chains: Vec<Arc<FilterChain>>,
}

impl Generation {
    /// Generation `number` of `chains`.
    pub fn new(number: u64, chains: Vec<Arc<FilterChain>>) -> Arc<Self> {
        Arc::new(Self { number, chains })
    }

    /// The generation number.
    pub fn number(&self) -> u64 {
        self.number
    }

    pub fn chains(&self) -> &[Arc<FilterChain>] {
        &self.chains
    }

    /// The index of the chain named `name`.
    pub fn chain_index(&self, name: &str) -> Option<usize> {
        self.chains.iter().position(|c| c.name() == name)
    }
}

/// Where a request's response phase must run: the worker, generation and chain of its
/// request phase, and how many filters ran.
#[derive(Debug, Clone)]
pub struct Ticket {
    /// The worker that ran the request phase.
    pub worker: usize,
    /// The generation it ran in.
    pub generation: Arc<Generation>,
    /// The chain's index in that generation.
    pub chain: usize,
    /// Filters whose `on-request` ran.
    pub ran: usize,
}

/// The request phase's result.
#[derive(Debug)]
pub struct RequestDone {
    /// Where the response phase must run.
    pub ticket: Ticket,
    /// What the chain decided.
    pub outcome: ChainOutcome,
}

/// What a response phase gives back: the request head (as the response filters left
/// it) and the faults of filters that failed in it.
pub type ResponseDone = (RequestHead, Vec<FilterFault>);

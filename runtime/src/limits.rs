//! Per-instance resource limits: a memory cap enforced when linear memory grows.

use wasmtime::ResourceLimiter;

/// Largest table a filter may grow to (function references); generous for
/// interpreters compiled to Wasm.
const MAX_TABLE_ELEMENTS: usize = 1 << 20;

/// Enforces a filter's memory cap across all of its linear memories.
#[derive(Debug)]
pub(crate) struct MemoryLimiter {
    cap: usize,
    /// Bytes of linear memory per memory index seen so far, summed on demand.
    committed: usize,
    /// Set when a growth was refused; cleared before every call so a fault can be
    /// classified as "memory cap" even if the guest turns the refusal into a trap.
    pub(crate) hit: bool,
}

impl MemoryLimiter {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            cap,
            committed: 0,
            hit: false,
        }
    }

    pub(crate) fn cap(&self) -> usize {
        self.cap
    }
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let next = self.committed - current.min(self.committed) + desired;
        if next > self.cap {
            self.hit = true;
            // Refuse (memory.grow returns -1) rather than trap: a guest that handles
            // allocation failure may still answer; one that does not traps, and `hit`
            // tells the runtime why.
            return Ok(false);
        }
        self.committed = next;
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }
}

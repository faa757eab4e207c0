//! Per-instance resource limits: a memory cap enforced when linear memory grows.

use wasmtime::ResourceLimiter;

/// Largest table a filter may grow to (function references); generous for
/// interpreters compiled to Wasm.
const MAX_TABLE_ELEMENTS: usize = 1 << 20;

/// Enforces each filter's memory cap across its linear memories. A store of one
/// filter has one budget; a fused chain's store has one per filter, and the budget
/// charged is that of the filter running (the driver says which when it enters one).
#[derive(Debug)]
pub(crate) struct MemoryLimiter {
    budgets: Vec<Budget>,
    /// The filter whose budget growth is charged to; `None` while a fused chain is
    /// instantiated (no filter runs: each memory must fit the largest cap).
    current: Option<usize>,
    /// Set when a growth was refused; cleared before every call so a fault can be
    /// classified as "memory cap" even if the guest turns the refusal into a trap.
    pub(crate) hit: bool,
}

#[derive(Debug)]
struct Budget {
    cap: usize,
    /// Bytes of linear memory committed so far (see `memory_growing`).
    committed: usize,
}

impl MemoryLimiter {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            budgets: vec![Budget { cap, committed: 0 }],
            current: Some(0),
            hit: false,
        }
    }

    /// One budget per `(cap, bytes committed at start)`, none charged until
    /// [`Self::switch_to`].
    pub(crate) fn per_filter(budgets: impl IntoIterator<Item = (usize, usize)>) -> Self {
        Self {
            budgets: budgets
                .into_iter()
                .map(|(cap, committed)| Budget { cap, committed })
                .collect(),
            current: None,
            hit: false,
        }
    }

    /// Charges no filter until the next [`Self::switch_to`] (growth must only fit the
    /// largest cap).
    pub(crate) fn charge_none(&mut self) {
        self.current = None;
    }

    /// Bytes committed so far to the budget charged now (a filter's own instance:
    /// its memories' total).
    pub(crate) fn committed(&self) -> usize {
        self.current
            .and_then(|i| self.budgets.get(i))
            .map_or(0, |b| b.committed)
    }

    /// Charges growth to filter `index` from now on.
    pub(crate) fn switch_to(&mut self, index: usize) {
        if index < self.budgets.len() {
            self.current = Some(index);
        }
    }

    /// The cap that applies now.
    pub(crate) fn cap(&self) -> usize {
        match self.current.and_then(|i| self.budgets.get(i)) {
            Some(budget) => budget.cap,
            None => self.largest_cap(),
        }
    }

    fn largest_cap(&self) -> usize {
        self.budgets.iter().map(|b| b.cap).max().unwrap_or(0)
    }
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let largest = self.largest_cap();
        let Some(budget) = self.current.and_then(|i| self.budgets.get_mut(i)) else {
            // Instantiating a fused chain, or its driver before it enters a filter:
            // which filter a memory belongs to is not known here, so none may grow
            // past the largest cap; each filter's budget starts with what its
            // memories take at start (measured on its own instance).
            if desired > largest {
                self.hit = true;
                return Ok(false);
            }
            return Ok(true);
        };
        let next = budget.committed - current.min(budget.committed) + desired;
        if next > budget.cap {
            self.hit = true;
            // Refuse (memory.grow returns -1) rather than trap: a guest that handles
            // allocation failure may still answer; one that does not traps, and `hit`
            // tells the runtime why.
            return Ok(false);
        }
        budget.committed = next;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_filter_of_a_fused_store_is_held_to_its_own_cap() {
        let mut limiter = MemoryLimiter::per_filter([(1 << 20, 64 << 10), (4 << 20, 0)]);
        // Instantiation: any memory up to the largest cap.
        assert!(limiter.memory_growing(0, 2 << 20, None).unwrap());
        assert!(!limiter.memory_growing(0, 8 << 20, None).unwrap());
        limiter.hit = false;
        limiter.switch_to(0);
        assert!(limiter.memory_growing(64 << 10, 1 << 20, None).unwrap());
        assert!(!limiter.memory_growing(1 << 20, 2 << 20, None).unwrap());
        assert!(limiter.hit);
        assert_eq!(limiter.cap(), 1 << 20);
        limiter.switch_to(1);
        assert!(limiter.memory_growing(2 << 20, 3 << 20, None).unwrap());
        assert_eq!(limiter.cap(), 4 << 20);
    }
}

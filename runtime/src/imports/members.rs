//! Whom a store's guest code acts for, and what a fused call records as its driver
//! enters each filter: the per-filter and fused-path parts of a store.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use dpumesh_head::RequestHead;
use dpumesh_shared_state::Namespace;

use super::{FilterTag, MetricHandle, MetricKey, NodeServices};
use crate::stamp::Stamp;

/// Whom a store's guest code acts for: one filter's identity, shared-state namespace
/// and metrics, and the limits its calls run under. A store of one filter has one
/// member; a fused chain's store has one per filter and switches as the chain's driver
/// enters each (the fused chains).
pub(crate) struct Member {
    pub(super) tag: Arc<FilterTag>,
    pub(super) namespace: Namespace,
    pub(super) metrics: Vec<MetricHandle>,
    pub(super) metric_ids: HashMap<MetricKey, u32>,
    /// CPU deadline of the filter's calls (armed as the driver enters it).
    pub(super) deadline: Duration,
    /// Whether its failure policy retries on the head as it was before its call: the
    /// head is then copied as the driver enters it (as an unfused chain copies it).
    pub(super) reload: bool,
}

impl Member {
    pub(crate) fn new(
        tag: Arc<FilterTag>,
        namespace: &str,
        services: &NodeServices,
        deadline: Duration,
        reload: bool,
    ) -> Self {
        Self {
            tag,
            namespace: services.state.namespace(namespace),
            metrics: Vec::new(),
            metric_ids: HashMap::new(),
            deadline,
            reload,
        }
    }
}

/// The filters a store acts for, and which one the guest code running now belongs to.
pub(super) struct Members {
    /// Never empty; `current` always indexes it.
    list: Vec<Member>,
    current: usize,
}

impl Members {
    pub(super) fn new(list: Vec<Member>) -> Self {
        assert!(!list.is_empty(), "a store acts for at least one filter");
        Self { list, current: 0 }
    }

    pub(super) fn len(&self) -> usize {
        self.list.len()
    }

    pub(super) fn current(&self) -> &Member {
        &self.list[self.current]
    }

    pub(super) fn current_mut(&mut self) -> &mut Member {
        &mut self.list[self.current]
    }

    /// Acts for filter `index` from now on; false (and no change) past the end.
    pub(super) fn switch_to(&mut self, index: usize) -> bool {
        if index < self.list.len() {
            self.current = index;
            true
        } else {
            false
        }
    }
}

/// What the fused call under way records as its driver enters each filter.
#[derive(Default)]
pub(super) struct FusedRun {
    /// Filters the request phase of a fused call entered, with the time each began.
    pub(super) marks: Vec<(u32, Stamp)>,
    /// Whether this call stamps its entries (the request phase: the response phase's
    /// times are not recorded, so it reads no clock).
    timed: bool,
    /// The filter the call under way entered last (whose fault a trap is).
    pub(super) entered: Option<u32>,
    /// The head as it was before the filter entered last, when that filter's policy
    /// retries (fused chains only).
    pub(super) reload_head: Option<RequestHead>,
}

impl FusedRun {
    /// A fused call starts: forget the last one's record.
    pub(super) fn begin(&mut self, timed: bool) {
        self.marks.clear();
        self.timed = timed;
        self.entered = None;
        self.reload_head = None;
    }

    /// The driver enters filter `index`: note it, stamp the time in a timed call, and
    /// keep a copy of `head` when the filter's policy retries on it.
    pub(super) fn enter(&mut self, index: usize, reload: bool, head: Option<&RequestHead>) {
        self.entered = Some(index as u32);
        if self.timed {
            self.marks.push((index as u32, crate::stamp::now()));
        }
        if reload {
            self.reload_head = head.cloned();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fused_run_forgets_the_last_call_and_copies_only_for_reload() {
        let head = RequestHead::default();
        let mut run = FusedRun::default();
        run.begin(true);
        run.enter(0, false, Some(&head));
        assert!(run.reload_head.is_none());
        run.enter(2, true, Some(&head));
        assert_eq!(run.entered, Some(2));
        assert_eq!(run.marks.iter().map(|m| m.0).collect::<Vec<_>>(), [0, 2]);
        assert!(run.reload_head.is_some());
        run.begin(false);
        run.enter(1, false, None);
        assert!(run.marks.is_empty(), "an untimed call stamps nothing");
        assert!(run.reload_head.is_none());
        assert_eq!(run.entered, Some(1));
    }
}

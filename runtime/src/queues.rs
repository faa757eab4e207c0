//! Shared queues of proxy-wasm plugins, node-wide as in Envoy: a plugin registers a
//! queue under a name (in its VM: the filter's namespace), any plugin on any thread
//! resolves it by VM and name, enqueues and dequeues; the instance that registered it
//! last is told (`proxy_on_queue_ready`) on its own thread, which a waker set by that
//! thread brings back to its chains (a shard's bell, a pool worker's job queue).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

/// Most queues on a node; a registration past it is refused.
pub(crate) const MAX_QUEUES: usize = 1024;
/// Most items a queue holds; an enqueue past it drops the oldest.
pub(crate) const MAX_QUEUE_ITEMS: usize = 4096;

/// Wakes the thread that owns some instances (it then runs their notifications).
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Where the instances of one owner (a [`crate::LocalChains`], a
/// [`crate::ChainRunner`]) find their thread's waker: set by that thread when it
/// starts, which may be after the instances were created (a pool's are created before
/// its threads run). Without one, notifications wait for the owner's next tick pass.
///
/// It also says whether that thread makes its instances' root-context HTTP calls
/// (calls from `on_tick` and the like): a node's shard does; a pool worker does not,
/// and its instances' root calls are not made.
#[derive(Default)]
pub struct WakeSlot(arc_swap::ArcSwapOption<Waker>, AtomicBool);

impl std::fmt::Debug for WakeSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WakeSlot")
            .field("set", &self.0.load().is_some())
            .finish()
    }
}

impl WakeSlot {
    /// Sets the waker.
    pub fn set(&self, waker: Waker) {
        self.0.store(Some(Arc::new(waker)));
    }

    /// The owning thread makes its instances' root-context HTTP calls.
    pub fn set_performs_calls(&self) {
        self.1.store(true, Ordering::Release);
    }

    pub(crate) fn performs_calls(&self) -> bool {
        self.1.load(Ordering::Acquire)
    }

    fn wake(&self) {
        if let Some(waker) = &*self.0.load() {
            waker();
        }
    }
}

/// The queues' side of one instance: the queues it registered that have items to
/// tell it about.
#[derive(Default)]
pub(crate) struct QueueOwner {
    ready: Mutex<BTreeSet<u32>>,
    any: AtomicBool,
    wake: Arc<WakeSlot>,
}

impl QueueOwner {
    /// An owner woken through `wake`.
    pub(crate) fn new(wake: Arc<WakeSlot>) -> Arc<Self> {
        Arc::new(Self {
            wake,
            ..Self::default()
        })
    }

    fn notify(&self, id: u32) {
        self.ready.lock().insert(id);
        // One wake-up until the owner looks, however many items come meanwhile.
        if !self.any.swap(true, Ordering::AcqRel) {
            self.wake.wake();
        }
    }

    /// The owner's slot.
    pub(crate) fn slot(&self) -> &WakeSlot {
        &self.wake
    }

    /// Whether a notification waits (cheap: no lock).
    pub(crate) fn pending(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// The queues to tell about, once each.
    pub(crate) fn take(&self) -> Vec<u32> {
        self.any.store(false, Ordering::Release);
        std::mem::take(&mut *self.ready.lock())
            .into_iter()
            .collect()
    }
}

struct Queue {
    items: VecDeque<Vec<u8>>,
    owner: Weak<QueueOwner>,
}

#[derive(Default)]
struct Inner {
    by_name: HashMap<(String, String), u32>,
    /// Queue `id` is at `id - 1`.
    queues: Vec<Queue>,
}

/// Every queue of the node.
#[derive(Default)]
pub struct SharedQueues {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for SharedQueues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedQueues")
            .field("queues", &self.inner.lock().queues.len())
            .finish()
    }
}

/// No such queue.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct NotFound;

impl SharedQueues {
    /// Registers (or takes over) queue `name` of VM `vm` for `owner`; its id, or
    /// `None` when the node has [`MAX_QUEUES`] already.
    pub(crate) fn register(&self, vm: &str, name: &str, owner: &Arc<QueueOwner>) -> Option<u32> {
        let mut inner = self.inner.lock();
        let key = (vm.to_owned(), name.to_owned());
        if let Some(&id) = inner.by_name.get(&key) {
            inner.queues[id as usize - 1].owner = Arc::downgrade(owner);
            return Some(id);
        }
        if inner.queues.len() >= MAX_QUEUES {
            return None;
        }
        inner.queues.push(Queue {
            items: VecDeque::new(),
            owner: Arc::downgrade(owner),
        });
        let id = inner.queues.len() as u32;
        inner.by_name.insert(key, id);
        Some(id)
    }

    /// The id of queue `name` of VM `vm`.
    pub(crate) fn resolve(&self, vm: &str, name: &str) -> Option<u32> {
        self.inner
            .lock()
            .by_name
            .get(&(vm.to_owned(), name.to_owned()))
            .copied()
    }

    /// Adds `item` to queue `id` (dropping the oldest past [`MAX_QUEUE_ITEMS`]) and
    /// tells its owner.
    pub(crate) fn enqueue(&self, id: u32, item: Vec<u8>) -> Result<(), NotFound> {
        let owner = {
            let mut inner = self.inner.lock();
            let queue = (id as usize)
                .checked_sub(1)
                .and_then(|i| inner.queues.get_mut(i))
                .ok_or(NotFound)?;
            if queue.items.len() >= MAX_QUEUE_ITEMS {
                queue.items.pop_front();
            }
            queue.items.push_back(item);
            queue.owner.upgrade()
        };
        // Outside the lock: the waker may take the owner thread's locks.
        if let Some(owner) = owner {
            owner.notify(id);
        }
        Ok(())
    }

    /// Takes the oldest item of queue `id` (`None`: empty).
    pub(crate) fn dequeue(&self, id: u32) -> Result<Option<Vec<u8>>, NotFound> {
        let mut inner = self.inner.lock();
        let queue = (id as usize)
            .checked_sub(1)
            .and_then(|i| inner.queues.get_mut(i))
            .ok_or(NotFound)?;
        Ok(queue.items.pop_front())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_queue_is_shared_by_name_and_tells_its_last_registrant_once_per_wait() {
        let queues = SharedQueues::default();
        let woken = Arc::new(AtomicUsize::new(0));
        let counted = woken.clone();
        let slot = Arc::new(WakeSlot::default());
        slot.set(Arc::new(move || {
            counted.fetch_add(1, Ordering::Relaxed);
        }));
        let first = QueueOwner::new(slot);
        let id = queues.register("vm", "jobs", &first).unwrap();
        assert_eq!(queues.resolve("vm", "jobs"), Some(id));
        assert_eq!(queues.resolve("other-vm", "jobs"), None);
        queues.enqueue(id, b"a".to_vec()).unwrap();
        queues.enqueue(id, b"b".to_vec()).unwrap();
        // Two items, one wake-up until the owner looks.
        assert_eq!(woken.load(Ordering::Relaxed), 1);
        assert!(first.pending());
        assert_eq!(first.take(), vec![id]);
        assert!(!first.pending());
        assert_eq!(queues.dequeue(id).unwrap(), Some(b"a".to_vec()));
        assert_eq!(queues.dequeue(id).unwrap(), Some(b"b".to_vec()));
        assert_eq!(queues.dequeue(id).unwrap(), None);
        // A second registrant takes the notifications over; the first's stop.
        let second = Arc::new(QueueOwner::default());
        assert_eq!(queues.register("vm", "jobs", &second), Some(id));
        queues.enqueue(id, b"c".to_vec()).unwrap();
        assert!(second.pending());
        assert!(!first.pending());
        assert_eq!(queues.enqueue(99, vec![]), Err(NotFound));
        assert_eq!(queues.dequeue(0), Err(NotFound));
    }

    #[test]
    fn a_full_queue_drops_its_oldest_item() {
        let queues = SharedQueues::default();
        let owner = Arc::new(QueueOwner::default());
        let id = queues.register("vm", "q", &owner).unwrap();
        for i in 0..=MAX_QUEUE_ITEMS {
            queues.enqueue(id, i.to_string().into_bytes()).unwrap();
        }
        assert_eq!(queues.dequeue(id).unwrap(), Some(b"1".to_vec()));
    }
}

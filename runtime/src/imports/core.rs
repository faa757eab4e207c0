//! The core path's part of a store (the `canon` module runs a filter as a core module
//! with the canonical ABI by hand): what its imports need of the instance they serve.

use wasmtime::{Memory, TypedFunc};

/// `cabi_realloc(old, old_size, align, new_size) -> ptr`.
pub(crate) type Realloc = TypedFunc<(i32, i32, i32, i32), i32>;

/// What the imports need of the instance they serve: its memory and its allocator.
pub(crate) struct Guest {
    pub(crate) memory: Memory,
    /// Taken out while it runs (the import that calls it holds the store), so it is
    /// moved rather than cloned: a `TypedFunc` clone costs two atomic operations.
    pub(crate) realloc: Option<Realloc>,
    /// Whether the head's borrow is in the guest's hands: from the start of a call
    /// that lends it until the guest drops it, which it must before returning.
    pub(crate) lent: bool,
}

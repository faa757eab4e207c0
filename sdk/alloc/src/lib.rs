//! The memory allocator of filter guests.
//!
//! A filter allocates the same few small blocks on every request and frees them
//! before it returns: the request line's strings the host lowers into it through
//! `cabi_realloc`, every header value and claim it reads, the metadata it writes.
//! The system allocator of `wasm32-wasip2` (wasi-libc's dlmalloc) spends a hundred
//! or more instructions on each `malloc` and `free` — a third of the built-in
//! filters' own time in the chain's profile (docs/benchmarks.md). Rust tells an
//! allocator the size of a block when it frees it, so small blocks need no header
//! and no search: [`SizeClasses`] keeps a free list per 8-byte size class up to
//! [`SMALL`] bytes, a block freed goes to the front of its class's list and the
//! next allocation of that class takes it back. Blocks come from the system
//! allocator the first time; a list keeps at most [`KEEP`] blocks and returns the
//! rest, so what a burst allocated goes back. Larger or over-aligned blocks go to
//! the system allocator directly.
//!
//! `unsafe` is the point of this crate: an allocator hands out raw memory. Its
//! contract is small and checked by the tests below against the system allocator
//! (every block is its layout's size and alignment, distinct while live, reused
//! only after it was freed).
//!
//! The filter SDK installs it as the global allocator of `wasm32` guests (its
//! `fast-alloc` feature, on by default). A guest is single-threaded, which is what
//! makes the lists safe to share without locks: [`SizeClasses`] is `Sync` only on
//! `wasm32` without the `atomics` feature.

#![no_std]
#![allow(unsafe_code)]

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;
use core::ptr;

/// Sizes are rounded up to this; it is also the largest alignment a class serves.
pub const GRAIN: usize = 8;
/// The largest block served from a size class.
pub const SMALL: usize = 256;
/// Blocks a class keeps on its free list; a block freed beyond it goes back.
pub const KEEP: u32 = 32;
const CLASSES: usize = SMALL / GRAIN;

/// One size class: the free blocks, linked through their first word.
#[derive(Clone, Copy)]
struct Class {
    head: *mut u8,
    len: u32,
}

/// Size classes with free lists in front of `A` (see the crate's documentation).
pub struct SizeClasses<A: GlobalAlloc> {
    backing: A,
    classes: UnsafeCell<[Class; CLASSES]>,
}

// SAFETY: a wasm32 guest without the `atomics` feature has exactly one thread, so
// the lists are never touched by two threads at once.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
unsafe impl<A: GlobalAlloc + Sync> Sync for SizeClasses<A> {}

impl<A: GlobalAlloc> SizeClasses<A> {
    /// Size classes in front of `backing`, every list empty.
    pub const fn new(backing: A) -> Self {
        Self {
            backing,
            classes: UnsafeCell::new(
                [Class {
                    head: ptr::null_mut(),
                    len: 0,
                }; CLASSES],
            ),
        }
    }

    /// Blocks held on the free lists (for tests and diagnostics).
    pub fn kept(&self) -> usize {
        // SAFETY: no other reference to the lists lives while this one is read
        // (single-threaded use, see the `Sync` impl; the allocator never calls out
        // while it holds one).
        let classes = unsafe { &*self.classes.get() };
        classes.iter().map(|c| c.len as usize).sum()
    }
}

impl<A: GlobalAlloc> Drop for SizeClasses<A> {
    /// Gives the kept blocks back (a global allocator is a static and never drops;
    /// an allocator made for a while, as in the tests, must not leak its lists).
    fn drop(&mut self) {
        for (class, list) in self.classes.get_mut().iter_mut().enumerate() {
            while !list.head.is_null() {
                let block = list.head;
                // SAFETY: a block on the list is free and links the next in its first
                // word; it came from `backing` with its class layout.
                unsafe {
                    list.head = block.cast::<*mut u8>().read();
                    self.backing.dealloc(block, class_layout(class));
                }
            }
            list.len = 0;
        }
    }
}

/// The class of a layout, if a class serves it.
fn class_of(layout: Layout) -> Option<usize> {
    if layout.size() > SMALL || layout.align() > GRAIN {
        return None;
    }
    Some(layout.size().max(1).div_ceil(GRAIN) - 1)
}

/// The layout a class's blocks have in the backing allocator.
fn class_layout(class: usize) -> Layout {
    // `(class + 1) * GRAIN` is at most SMALL and GRAIN is a power of two: valid.
    match Layout::from_size_align((class + 1) * GRAIN, GRAIN) {
        Ok(layout) => layout,
        Err(_) => unreachable!("class sizes are multiples of GRAIN up to SMALL"),
    }
}

// SAFETY: every block handed out comes from `backing` with a layout at least as
// large and as aligned as the one asked for (a class's layout), and goes back to
// `backing` with the layout it was allocated with; a block on a free list is one
// its owner freed, so it is reused only once it is no longer live.
unsafe impl<A: GlobalAlloc> GlobalAlloc for SizeClasses<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(class) = class_of(layout) else {
            // SAFETY: the caller's layout has a nonzero size (GlobalAlloc's contract).
            return unsafe { self.backing.alloc(layout) };
        };
        // SAFETY: single-threaded (see the `Sync` impl), and no other reference to
        // the lists is live while this one is.
        let list = unsafe { &mut (*self.classes.get())[class] };
        let block = list.head;
        if block.is_null() {
            // SAFETY: a class layout has a nonzero size.
            return unsafe { self.backing.alloc(class_layout(class)) };
        }
        // SAFETY: a block on the list is free, GRAIN-aligned and at least GRAIN
        // bytes long; its first word holds the next block (written by `dealloc`).
        list.head = unsafe { block.cast::<*mut u8>().read() };
        list.len -= 1;
        block
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        let Some(class) = class_of(layout) else {
            // SAFETY: a block of this layout came from `backing` with it (`alloc`).
            return unsafe { self.backing.dealloc(block, layout) };
        };
        // SAFETY: as in `alloc`.
        let list = unsafe { &mut (*self.classes.get())[class] };
        if list.len >= KEEP {
            // SAFETY: blocks of a class come from `backing` with the class layout.
            return unsafe { self.backing.dealloc(block, class_layout(class)) };
        }
        // SAFETY: the caller gives the block up; it is GRAIN-aligned and at least
        // GRAIN bytes long (its class layout), so its first word can link the list.
        unsafe { block.cast::<*mut u8>().write(list.head) };
        list.head = block;
        list.len += 1;
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // The new layout is valid: GlobalAlloc's contract on `new_size`.
        let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
            return ptr::null_mut();
        };
        match (class_of(layout), class_of(new_layout)) {
            // Still fits the block it has (a class block is its class's full size).
            (Some(old), Some(new)) if old == new => block,
            (None, None) => {
                // SAFETY: both layouts are the backing allocator's; the caller's
                // contract carries over.
                unsafe { self.backing.realloc(block, layout, new_size) }
            }
            _ => {
                // SAFETY: `new_layout` has a nonzero size (the caller's contract).
                let moved = unsafe { self.alloc(new_layout) };
                if !moved.is_null() {
                    // SAFETY: both blocks are live, distinct, and at least the
                    // smaller size long.
                    unsafe {
                        ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                        self.dealloc(block, layout);
                    }
                }
                moved
            }
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;

    use core::sync::atomic::{AtomicIsize, Ordering};
    use std::alloc::System;
    use std::vec::Vec;

    use super::*;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).unwrap()
    }

    #[test]
    fn sizes_map_to_the_classes_that_hold_them() {
        assert_eq!(class_of(layout(1, 1)), Some(0));
        assert_eq!(class_of(layout(8, 8)), Some(0));
        assert_eq!(class_of(layout(9, 1)), Some(1));
        assert_eq!(class_of(layout(SMALL, 4)), Some(CLASSES - 1));
        assert_eq!(class_of(layout(SMALL + 1, 1)), None, "too large");
        assert_eq!(class_of(layout(16, 16)), None, "over-aligned");
        for size in 1..=SMALL {
            let class = class_of(layout(size, 1)).unwrap();
            assert!(class_layout(class).size() >= size);
            assert!(class == 0 || class_layout(class - 1).size() < size);
        }
    }

    #[test]
    fn a_freed_block_is_reused_by_the_next_allocation_of_its_class() {
        let a = SizeClasses::new(System);
        unsafe {
            let first = a.alloc(layout(20, 1));
            a.dealloc(first, layout(20, 1));
            assert_eq!(a.kept(), 1);
            // 17..=24 bytes share a class.
            let again = a.alloc(layout(24, 8));
            assert_eq!(again, first);
            assert_eq!(a.kept(), 0);
            let other = a.alloc(layout(24, 8));
            assert_ne!(other, again, "a live block is never handed out twice");
            a.dealloc(again, layout(24, 8));
            a.dealloc(other, layout(17, 1));
        }
    }

    #[test]
    fn live_blocks_are_distinct_aligned_and_hold_what_was_written() {
        let a = SizeClasses::new(System);
        let mut live: Vec<(*mut u8, Layout, u8)> = Vec::new();
        // A deterministic mix of sizes and alignments, freed in a scrambled order
        // and allocated again, three rounds.
        for round in 0..3u8 {
            for i in 0..500usize {
                let size = 1 + (i * 37 + round as usize * 11) % 600;
                let align = [1, 2, 4, 8, 16][i % 5];
                let l = layout(size, align);
                let p = unsafe { a.alloc(l) };
                assert!(!p.is_null());
                assert_eq!(p as usize % align, 0, "{size} bytes aligned {align}");
                let fill = (i as u8).wrapping_add(round);
                unsafe { ptr::write_bytes(p, fill, size) };
                live.push((p, l, fill));
            }
            for (p, l, fill) in &live {
                let bytes = unsafe { core::slice::from_raw_parts(*p, l.size()) };
                assert!(bytes.iter().all(|b| b == fill), "a block was overwritten");
            }
            let mut order: Vec<usize> = (0..live.len()).collect();
            order.sort_by_key(|i| (i * 7919) % live.len());
            for i in order.iter().take(live.len() / 2 + round as usize * 50) {
                let (p, l, _) = live[*i];
                unsafe { a.dealloc(p, l) };
                live[*i].0 = ptr::null_mut();
            }
            live.retain(|(p, _, _)| !p.is_null());
        }
        for (p, l, _) in live {
            unsafe { a.dealloc(p, l) };
        }
        assert!(a.kept() <= CLASSES * KEEP as usize);
    }

    #[test]
    fn a_class_keeps_at_most_keep_blocks() {
        let a = SizeClasses::new(System);
        let l = layout(40, 8);
        let blocks: Vec<_> = (0..KEEP * 3).map(|_| unsafe { a.alloc(l) }).collect();
        for p in blocks {
            unsafe { a.dealloc(p, l) };
        }
        assert_eq!(a.kept(), KEEP as usize);
    }

    /// Blocks the counting allocator has out (one test uses it).
    static OUT: AtomicIsize = AtomicIsize::new(0);

    /// The system allocator, counting the blocks it has out in [`OUT`].
    struct Counted;

    // SAFETY: every call is passed on unchanged to `System`, which upholds the
    // contract; the count is all this adds.
    unsafe impl GlobalAlloc for Counted {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            OUT.fetch_add(1, Ordering::Relaxed);
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
            OUT.fetch_sub(1, Ordering::Relaxed);
            unsafe { System.dealloc(block, layout) }
        }
    }

    #[test]
    fn dropping_the_allocator_gives_every_kept_block_back() {
        {
            let a = SizeClasses::new(Counted);
            let blocks: Vec<_> = (1..=200usize)
                .map(|size| (unsafe { a.alloc(layout(size, 1)) }, size))
                .collect();
            for (p, size) in blocks {
                unsafe { a.dealloc(p, layout(size, 1)) };
            }
            assert!(a.kept() > 0);
        }
        assert_eq!(OUT.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn realloc_keeps_the_contents_across_classes_and_to_the_backing_allocator() {
        let a = SizeClasses::new(System);
        unsafe {
            let mut l = layout(3, 1);
            let mut p = a.alloc(l);
            ptr::copy_nonoverlapping(b"abc".as_ptr(), p, 3);
            // Same class: the block stays.
            let same = a.realloc(p, l, 7);
            assert_eq!(same, p);
            l = layout(7, 1);
            p = same;
            for new_size in [100, 256, 257, 4096, 300, 5] {
                p = a.realloc(p, l, new_size);
                assert!(!p.is_null());
                l = layout(new_size, 1);
                assert_eq!(core::slice::from_raw_parts(p, 3), b"abc");
            }
            a.dealloc(p, l);
        }
    }
}

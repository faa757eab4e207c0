//! Memory registration: regions, their keys, and the checks every remote access passes.

use super::*;

impl MrEntry {
    /// The region offset of `[addr, addr + len)`, if it lies inside the range.
    pub(super) fn locate(&self, addr: u64, len: u64) -> Option<u64> {
        let start = addr.checked_sub(self.addr)?;
        (start.checked_add(len)? <= self.len).then_some(self.offset + start)
    }
}

impl MemoryRegion for SoftMr {
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
    fn addr(&self) -> u64 {
        self.entry.addr
    }
    fn len(&self) -> u64 {
        self.entry.len
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        self.pd.by_lkey.write().remove(&self.lkey);
        self.pd.by_rkey.write().remove(&self.rkey);
    }
}

//! The canonical ABI's memory half, by hand: reading what a guest passed by pointer
//! and writing what it gets back, with the checks the component model makes (bounds,
//! alignment, UTF-8), so a malformed call traps the same way on both paths.

use wasmtime::{AsContext, AsContextMut, Caller, Memory, Result, format_err};

use crate::imports::StoreState;

/// The call context of an import.
pub(crate) type Cx<'a> = Caller<'a, StoreState>;

/// Where the helpers read: an import's caller, or the store before and after a call.
pub(crate) trait Ctx: AsContext<Data = StoreState> {}
impl<T: AsContext<Data = StoreState>> Ctx for T {}

/// Where the helpers write.
pub(crate) trait CtxMut: AsContextMut<Data = StoreState> {}
impl<T: AsContextMut<Data = StoreState>> CtxMut for T {}

pub(crate) use crate::imports::core::{Guest, Realloc};

fn guest(cx: &impl Ctx) -> Result<Memory> {
    cx.as_context()
        .data()
        .core
        .as_ref()
        .map(|g| g.memory)
        .ok_or_else(|| format_err!("a core import ran without its instance's memory (a host bug)"))
}

/// `ptr..ptr+len` of `mem`, or the trap the component model raises.
pub(crate) fn slice(mem: &[u8], ptr: i32, len: usize) -> Result<&[u8]> {
    let start = ptr as u32 as usize;
    start
        .checked_add(len)
        .and_then(|end| mem.get(start..end))
        .ok_or_else(|| format_err!("pointer out of bounds: {len} bytes at {start:#x}"))
}

pub(crate) fn aligned(ptr: i32, align: u32) -> Result<()> {
    if (ptr as u32).is_multiple_of(align) {
        Ok(())
    } else {
        Err(format_err!(
            "unaligned pointer {:#x} (needs {align})",
            ptr as u32
        ))
    }
}

/// The string at `ptr`, `len` bytes: checked UTF-8, borrowed from guest memory.
pub(crate) fn str_at(mem: &[u8], ptr: i32, len: i32) -> Result<&str> {
    std::str::from_utf8(slice(mem, ptr, len as u32 as usize)?)
        .map_err(|e| format_err!("invalid UTF-8 in a string argument: {e}"))
}

/// The string argument at `ptr`, copied out.
pub(crate) fn string(cx: &impl Ctx, ptr: i32, len: i32) -> Result<String> {
    let mem = guest(cx)?;
    Ok(str_at(mem.data(cx), ptr, len)?.to_owned())
}

/// Runs `f` on the host state and the `list<string>` argument at `ptr`, its strings
/// borrowed in place (all checked before `f` runs, as the component model lifts the
/// whole list before the host sees it).
pub(crate) fn with_str_list<R>(
    cx: &mut Cx<'_>,
    ptr: i32,
    len: i32,
    f: impl FnOnce(&mut StoreState, &[&str]) -> Result<R>,
) -> Result<R> {
    let mem = guest(cx)?;
    let (data, state) = mem.data_and_store_mut(&mut *cx);
    let data: &[u8] = data;
    let items = table(data, ptr, len, 8)?.map(|e| str_at(data, i32_at(e, 0), i32_at(e, 4)));
    gathered(items, |items| f(state, items))
}

/// [`with_str_list`] for a `list<tuple<string, string>>`.
pub(crate) fn with_str_pairs<R>(
    cx: &mut Cx<'_>,
    ptr: i32,
    len: i32,
    f: impl FnOnce(&mut StoreState, &[(&str, &str)]) -> Result<R>,
) -> Result<R> {
    let mem = guest(cx)?;
    let (data, state) = mem.data_and_store_mut(&mut *cx);
    let data: &[u8] = data;
    let pairs = table(data, ptr, len, 16)?.map(|e| pair_at(data, e));
    gathered(pairs, |pairs| f(state, pairs))
}

/// Most items of a list argument gathered on the stack: a filter's lists are a few
/// header or claim names, or a few metadata entries, and a `Vec` for them was a
/// `malloc` and a `free` per host call.
const ON_STACK: usize = 8;

/// Runs `f` on `items`, every one checked first (the first error is the call's): on
/// the stack up to [`ON_STACK`] items, in a `Vec` past that.
fn gathered<T: Copy + Default, R>(
    items: impl ExactSizeIterator<Item = Result<T>>,
    f: impl FnOnce(&[T]) -> Result<R>,
) -> Result<R> {
    let n = items.len();
    if n > ON_STACK {
        return f(&items.collect::<Result<Vec<_>>>()?);
    }
    let mut stack = [T::default(); ON_STACK];
    for (slot, item) in stack.iter_mut().zip(items) {
        *slot = item?;
    }
    f(&stack[..n])
}

/// One `tuple<string, string>` of a list (16 bytes: two pointer and length pairs).
fn pair_at<'m>(mem: &'m [u8], entry: &[u8]) -> Result<(&'m str, &'m str)> {
    Ok((
        str_at(mem, i32_at(entry, 0), i32_at(entry, 4))?,
        str_at(mem, i32_at(entry, 8), i32_at(entry, 12))?,
    ))
}

/// The `list<tuple<string, string>>` argument at `ptr`.
pub(crate) fn string_pairs(cx: &impl Ctx, ptr: i32, len: i32) -> Result<Vec<(String, String)>> {
    let mem = guest(cx)?;
    pairs_at(mem.data(cx), ptr, len)
}

/// The `list<tuple<string, string>>` at `ptr` of `mem`, copied out.
pub(crate) fn pairs_at(mem: &[u8], ptr: i32, len: i32) -> Result<Vec<(String, String)>> {
    table(mem, ptr, len, 16)?
        .map(|e| pair_at(mem, e).map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect()
}

/// A list's elements of `stride` bytes (align 4) at `ptr`: checked, then one slice each.
fn table(mem: &[u8], ptr: i32, len: i32, stride: usize) -> Result<std::slice::ChunksExact<'_, u8>> {
    aligned(ptr, 4)?;
    let n = len as u32 as usize;
    let bytes = n.checked_mul(stride).ok_or_else(too_long)?;
    Ok(slice(mem, ptr, bytes)?.chunks_exact(stride))
}

/// The `list<u8>` argument at `ptr`, copied out.
pub(crate) fn byte_list(cx: &impl Ctx, ptr: i32, len: i32) -> Result<Vec<u8>> {
    let mem = guest(cx)?;
    Ok(slice(mem.data(cx), ptr, len as u32 as usize)?.to_vec())
}

fn too_long() -> wasmtime::Error {
    format_err!("list length overflows the address space")
}

pub(crate) fn i32_at(bytes: &[u8], at: usize) -> i32 {
    i32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Runs `f` on the host state and the string argument at `ptr`, borrowed in place
/// (no copy for a name only looked up).
pub(crate) fn with_str<R>(
    cx: &mut Cx<'_>,
    ptr: i32,
    len: i32,
    f: impl FnOnce(&mut StoreState, &str) -> Result<R>,
) -> Result<R> {
    let mem = guest(cx)?;
    let (data, state) = mem.data_and_store_mut(&mut *cx);
    f(state, str_at(data, ptr, len)?)
}

/// [`with_str`] for two string arguments.
pub(crate) fn with_strs<R>(
    cx: &mut Cx<'_>,
    (p1, l1): (i32, i32),
    (p2, l2): (i32, i32),
    f: impl FnOnce(&mut StoreState, &str, &str) -> Result<R>,
) -> Result<R> {
    let mem = guest(cx)?;
    let (data, state) = mem.data_and_store_mut(&mut *cx);
    f(state, str_at(data, p1, l1)?, str_at(data, p2, l2)?)
}

/// Calls the guest's `cabi_realloc` for a fresh block of `size` bytes.
pub(crate) fn alloc(cx: &mut impl CtxMut, align: u32, size: usize) -> Result<i32> {
    let size = i32::try_from(size).map_err(|_| too_long())?;
    let realloc = cx
        .as_context_mut()
        .data_mut()
        .core
        .as_mut()
        .and_then(|g| g.realloc.take())
        .ok_or_else(|| format_err!("cabi_realloc re-entered or missing (a host bug)"))?;
    let result = realloc.call(&mut *cx, (0, 0, align as i32, size));
    if let Some(g) = cx.as_context_mut().data_mut().core.as_mut() {
        g.realloc = Some(realloc);
    }
    let ptr = result?;
    aligned(ptr, align)?;
    // In bounds is checked where the block is written ([`put`]); an empty block is
    // never written to.
    Ok(ptr)
}

/// Writes `bytes` at `at` (a return area or a block from [`alloc`]).
pub(crate) fn put(cx: &mut impl CtxMut, at: i32, bytes: &[u8]) -> Result<()> {
    let mem = guest(cx)?;
    let start = at as u32 as usize;
    let dest = start
        .checked_add(bytes.len())
        .and_then(|end| mem.data_mut(&mut *cx).get_mut(start..end))
        .ok_or_else(|| format_err!("pointer out of bounds: {} bytes at {start:#x}", bytes.len()))?;
    dest.copy_from_slice(bytes);
    Ok(())
}

/// Checks a return area the guest passed: in bounds and aligned for `align`.
pub(crate) fn ret_area(cx: &impl Ctx, ptr: i32, size: usize, align: u32) -> Result<()> {
    aligned(ptr, align)?;
    let mem = guest(cx)?;
    slice(mem.data(cx), ptr, size).map(drop)
}

/// A string given to the guest: copied into a block of its own allocator.
pub(crate) fn lower_str(cx: &mut impl CtxMut, s: &str) -> Result<(i32, i32)> {
    let ptr = alloc(cx, 1, s.len())?;
    put(cx, ptr, s.as_bytes())?;
    Ok((ptr, s.len() as i32))
}

/// A `list<string>` given to the guest.
pub(crate) fn lower_strings<S: AsRef<str>>(
    cx: &mut impl CtxMut,
    items: &[S],
) -> Result<(i32, i32)> {
    let table = alloc(cx, 4, items.len() * 8)?;
    let mut pairs = Vec::with_capacity(items.len() * 8);
    for item in items {
        let (p, l) = lower_str(cx, item.as_ref())?;
        pairs.extend_from_slice(&p.to_le_bytes());
        pairs.extend_from_slice(&l.to_le_bytes());
    }
    put(cx, table, &pairs)?;
    Ok((table, items.len() as i32))
}

/// Most bytes a record written by an import or read by the host takes.
const RECORD_MAX: usize = 32;

/// Builds a little-endian record of a given size, field by field, on the stack.
pub(crate) struct Record {
    buf: [u8; RECORD_MAX],
    len: usize,
}

impl Record {
    pub(crate) fn new(size: usize) -> Self {
        assert!(
            size <= RECORD_MAX,
            "records here are at most {RECORD_MAX} bytes"
        );
        Self {
            buf: [0; RECORD_MAX],
            len: size,
        }
    }

    pub(crate) fn u8(mut self, at: usize, v: u8) -> Self {
        self.buf[at] = v;
        self
    }

    pub(crate) fn u16(mut self, at: usize, v: u16) -> Self {
        self.buf[at..at + 2].copy_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn i32(mut self, at: usize, v: i32) -> Self {
        self.buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn u64(mut self, at: usize, v: u64) -> Self {
        self.buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// An `option<string>` written to a return area (12 bytes, align 4).
pub(crate) fn ret_option_string(cx: &mut impl CtxMut, ret: i32, value: Option<&str>) -> Result<()> {
    ret_area(cx, ret, 12, 4)?;
    let record = match value {
        None => Record::new(12),
        Some(s) => {
            let (p, l) = lower_str(cx, s)?;
            Record::new(12).u8(0, 1).i32(4, p).i32(8, l)
        }
    };
    put(cx, ret, record.bytes())
}

/// A `string` written to a return area (8 bytes, align 4).
pub(crate) fn ret_string(cx: &mut impl CtxMut, ret: i32, value: &str) -> Result<()> {
    ret_area(cx, ret, 8, 4)?;
    let (p, l) = lower_str(cx, value)?;
    put(cx, ret, Record::new(8).i32(0, p).i32(4, l).bytes())
}

/// A `list<string>` written to a return area (8 bytes, align 4).
pub(crate) fn ret_strings<S: AsRef<str>>(
    cx: &mut impl CtxMut,
    ret: i32,
    items: &[S],
) -> Result<()> {
    ret_area(cx, ret, 8, 4)?;
    let (p, l) = lower_strings(cx, items)?;
    put(cx, ret, Record::new(8).i32(0, p).i32(4, l).bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_are_bounds_checked_without_overflow() {
        let mem = [0u8; 16];
        assert_eq!(slice(&mem, 8, 8).unwrap().len(), 8);
        assert!(slice(&mem, 9, 8).is_err());
        assert!(
            slice(&mem, -1, 2).is_err(),
            "0xffffffff + 2 is out of bounds"
        );
        assert!(
            slice(&mem, 16, 0).is_ok(),
            "an empty slice at the end is fine"
        );
    }

    #[test]
    fn strings_must_be_utf8() {
        let mem = *b"ok\xff\xfe";
        assert_eq!(str_at(&mem, 0, 2).unwrap(), "ok");
        let err = str_at(&mem, 0, 4).unwrap_err().to_string();
        assert!(err.contains("invalid UTF-8"), "{err}");
    }

    #[test]
    fn records_are_little_endian() {
        let r = Record::new(16).u8(0, 1).u16(2, 0x0102).i32(4, -2).u64(8, 7);
        assert_eq!(
            r.bytes(),
            &[1, 0, 2, 1, 0xfe, 0xff, 0xff, 0xff, 7, 0, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn lists_are_gathered_whole_on_the_stack_or_past_it() {
        for n in [0, 1, ON_STACK, ON_STACK + 1, 3 * ON_STACK] {
            let items = (0..n).map(|i| Ok::<_, wasmtime::Error>(i as u32));
            let got = gathered(items, |items| Ok(items.to_vec())).unwrap();
            assert_eq!(got, (0..n as u32).collect::<Vec<_>>(), "{n} items");
        }
    }

    #[test]
    fn a_bad_item_anywhere_fails_the_list_before_the_host_sees_it() {
        for n in [2, ON_STACK, 2 * ON_STACK] {
            let items = (0..n).map(|i| match i == n - 1 {
                true => Err(format_err!("item {i} is bad")),
                false => Ok(i),
            });
            let err = gathered(items, |_| -> Result<()> {
                panic!("the host acted on {n} items")
            })
            .unwrap_err();
            assert_eq!(err.to_string(), format!("item {} is bad", n - 1));
        }
    }

    #[test]
    fn alignment_is_checked() {
        assert!(aligned(8, 4).is_ok());
        assert!(aligned(6, 4).is_err());
        assert!(aligned(7, 1).is_ok());
    }
}

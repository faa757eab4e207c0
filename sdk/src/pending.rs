//! Metadata writes held back until the filter returns (sent in one host call), in
//! buffers reused from call to call: a filter writes the same keys with values of
//! about the same size on every request (JWT a dozen), so after the first request
//! its writes allocate nothing and the flush frees nothing.

use std::cell::Cell;

/// Entries beyond this many, and strings grown beyond this size, are not kept for
/// the next call: one odd request must not pin its memory for the instance's life.
const KEEP_ENTRIES: usize = 64;
const KEEP_BYTES: usize = 4096;

thread_local! {
    static SPARE: Cell<Option<Pending>> = const { Cell::new(None) };
}

/// The writes of one call, in order (the proxy applies them in order, so the last
/// one for a key wins).
#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// `..len` are this call's; the rest are spare buffers.
    entries: Vec<(String, String)>,
    len: usize,
}

impl Pending {
    /// An empty set, with the buffers the last call gave back.
    pub(crate) fn take() -> Self {
        SPARE.with(Cell::take).unwrap_or_default()
    }

    /// Keeps the buffers for the next call.
    pub(crate) fn give_back(mut self) {
        self.len = 0;
        self.entries.truncate(KEEP_ENTRIES);
        for (k, v) in &mut self.entries {
            for s in [k, v] {
                if s.capacity() > KEEP_BYTES {
                    *s = String::new();
                }
            }
        }
        SPARE.with(|spare| spare.set(Some(self)));
    }

    pub(crate) fn push(&mut self, key: &str, value: &str) {
        match self.entries.get_mut(self.len) {
            Some((k, v)) => {
                k.clear();
                k.push_str(key);
                v.clear();
                v.push_str(value);
            }
            None => self.entries.push((key.to_owned(), value.to_owned())),
        }
        self.len += 1;
    }

    /// The value last written for `key` in this call.
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.entries()
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// This call's writes, in order.
    pub(crate) fn entries(&self) -> &[(String, String)] {
        &self.entries[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_sees_only_its_own_writes_and_reuses_the_last_ones_buffers() {
        let mut p = Pending::take();
        p.push("jwt.sub", "alice");
        p.push("jwt.iss", "https://issuer");
        p.push("jwt.sub", "bob");
        assert_eq!(p.get("jwt.sub"), Some("bob"));
        assert_eq!(p.entries().len(), 3);
        let buffer = p.entries()[1].1.as_ptr();
        p.give_back();

        let mut p = Pending::take();
        assert!(p.entries().is_empty());
        assert_eq!(p.get("jwt.sub"), None, "the last call's writes are gone");
        p.push("a", "1");
        p.push("b", "https://other");
        assert_eq!(p.entries()[1].1.as_ptr(), buffer, "the buffer is reused");
        assert_eq!(
            p.entries(),
            [
                ("a".to_owned(), "1".to_owned()),
                ("b".to_owned(), "https://other".to_owned())
            ]
        );
        p.give_back();
    }

    #[test]
    fn big_buffers_and_many_entries_are_not_kept() {
        let mut p = Pending::take();
        p.push("big", &"x".repeat(100_000));
        for i in 0..100 {
            p.push(&i.to_string(), "v");
        }
        p.give_back();
        let p = Pending::take();
        assert!(p.entries.len() <= KEEP_ENTRIES);
        assert!(
            p.entries
                .iter()
                .all(|(k, v)| k.capacity() <= KEEP_BYTES && v.capacity() <= KEEP_BYTES)
        );
        p.give_back();
    }
}

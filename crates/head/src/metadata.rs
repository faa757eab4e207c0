//! Per-request metadata: the key-value pairs filters pass along the chain, kept in one
//! text buffer. A request through the full chain carries some fifteen entries (JWT
//! alone sets a dozen); as separate strings that was thirty allocations and thirty
//! frees per request, here it is two buffers that grow a few times at most.

use std::ops::Range;

/// Where an entry's key and value sit in the text.
#[derive(Debug, Clone)]
struct Entry {
    key: Range<usize>,
    value: Range<usize>,
    /// The key's [`tag`].
    tag: u64,
}

/// A key's length and last seven bytes in one word. The keys of a chain share
/// prefixes and lengths (`jwt.sub`, `jwt.iss`, `jwt.aud`), so comparing whole keys
/// called `memcmp` for most entries on every lookup; the tag settles nearly all of
/// them in one comparison, and keys of up to seven bytes entirely.
fn tag(key: &str) -> u64 {
    let bytes = key.as_bytes();
    let n = bytes.len().min(7);
    let mut word = [0u8; 8];
    word[..n].copy_from_slice(&bytes[bytes.len() - n..]);
    // The length's low byte: keys of lengths 256 apart compare in full.
    word[7] = bytes.len() as u8;
    u64::from_le_bytes(word)
}

/// Metadata entries in the order their keys were first set; setting a key again
/// replaces its value in place.
#[derive(Debug, Clone, Default)]
pub struct Metadata {
    text: String,
    entries: Vec<Entry>,
}

/// What the first entry reserves: room for a verified payload and the claims beside
/// it, so a typical request grows neither buffer again.
const TEXT_RESERVE: usize = 512;
const ENTRIES_RESERVE: usize = 16;

impl Metadata {
    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<&str> {
        let tag = tag(key);
        self.entries
            .iter()
            .find(|e| e.tag == tag && &self.text[e.key.clone()] == key)
            .map(|e| &self.text[e.value.clone()])
    }

    /// Sets `key` to `value`. A value replaced by one of another length is spliced
    /// out (the entries after it move), so overwriting a key in a loop never grows
    /// the buffer beyond what is live.
    pub fn set(&mut self, key: &str, value: &str) {
        let tag = tag(key);
        if let Some(i) = self
            .entries
            .iter()
            .position(|e| e.tag == tag && &self.text[e.key.clone()] == key)
        {
            let old = self.entries[i].value.clone();
            self.text.replace_range(old.clone(), value);
            let end = old.start + value.len();
            self.entries[i].value = old.start..end;
            if value.len() != old.len() {
                let shift = |at: usize| at - old.end + end;
                for e in &mut self.entries[i + 1..] {
                    e.key = shift(e.key.start)..shift(e.key.end);
                    e.value = shift(e.value.start)..shift(e.value.end);
                }
            }
            return;
        }
        if self.entries.is_empty() {
            self.text.reserve(TEXT_RESERVE.max(key.len() + value.len()));
            self.entries.reserve(ENTRIES_RESERVE);
        }
        let start = self.text.len();
        self.text.push_str(key);
        self.text.push_str(value);
        let mid = start + key.len();
        self.entries.push(Entry {
            key: start..mid,
            value: mid..self.text.len(),
            tag,
        });
    }

    /// The entries, in the order their keys were first set.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &str)> + '_ {
        self.entries
            .iter()
            .map(|e| (&self.text[e.key.clone()], &self.text[e.value.clone()]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(m: &Metadata) -> Vec<(String, String)> {
        m.iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    #[test]
    fn keys_keep_their_first_place_and_the_last_value() {
        let mut m = Metadata::default();
        m.set("jwt.sub", "alice");
        m.set("other", "1");
        m.set("jwt.sub", "bob");
        assert_eq!(m.get("jwt.sub"), Some("bob"));
        assert_eq!(m.get("nope"), None);
        assert_eq!(
            entries(&m),
            [
                ("jwt.sub".into(), "bob".into()),
                ("other".into(), "1".into())
            ]
        );
    }

    #[test]
    fn longer_and_shorter_values_move_the_entries_after_them() {
        let mut m = Metadata::default();
        m.set("a", "1");
        m.set("b", "22");
        m.set("c", "");
        m.set("a", "loooong ✓");
        assert_eq!(m.get("b"), Some("22"));
        m.set("b", "");
        m.set("c", "ß");
        m.set("a", "x");
        assert_eq!(
            entries(&m),
            [
                ("a".into(), "x".into()),
                ("b".into(), "".into()),
                ("c".into(), "ß".into())
            ]
        );
        // Nothing but the live entries stays in the buffer.
        assert_eq!(m.text, "axbcß");
    }

    #[test]
    fn overwriting_in_a_loop_does_not_grow_the_buffer() {
        let mut m = Metadata::default();
        let big = "v".repeat(10_000);
        for i in 0..1_000 {
            m.set("k", &big[..10_000 - i % 7]);
        }
        assert!(m.text.len() <= 10_001, "{}", m.text.len());
        assert_eq!(m.iter().len(), 1);
    }

    #[test]
    fn keys_alike_in_length_and_ending_stay_apart() {
        let mut m = Metadata::default();
        // Same length, same last seven bytes: same tag, different keys.
        m.set("a-prefix.subject", "1");
        m.set("b-prefix.subject", "2");
        // Lengths 256 apart, same ending: same tag too.
        let long = format!("{}.subject", "x".repeat(256));
        m.set(&long, "3");
        m.set("x.subject", "4");
        assert_eq!(m.get("a-prefix.subject"), Some("1"));
        assert_eq!(m.get("b-prefix.subject"), Some("2"));
        assert_eq!(m.get(&long), Some("3"));
        assert_eq!(m.get("x.subject"), Some("4"));
        assert_eq!(m.get("c-prefix.subject"), None);
        assert_eq!(m.iter().len(), 4);
    }

    proptest::proptest! {
        /// Against the obvious model: a list of owned pairs.
        #[test]
        fn behaves_like_a_list_of_pairs(
            ops in proptest::collection::vec(("[a-d]{1,2}|[ab]{1,3}\\.suffix9", "\\PC{0,6}"), 0..40)
        ) {
            let mut m = Metadata::default();
            let mut model: Vec<(String, String)> = Vec::new();
            for (k, v) in &ops {
                m.set(k, v);
                match model.iter_mut().find(|(mk, _)| mk == k) {
                    Some((_, mv)) => *mv = v.clone(),
                    None => model.push((k.clone(), v.clone())),
                }
            }
            proptest::prop_assert_eq!(entries(&m), model.clone());
            for (k, v) in &model {
                proptest::prop_assert_eq!(m.get(k), Some(v.as_str()));
            }
        }
    }
}

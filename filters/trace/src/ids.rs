//! Random ids without a host call per id: a xoshiro256++ generator seeded once per
//! instance from the host's entropy. Request, trace and span ids need uniqueness, not
//! secrecy (W3C Trace Context asks for randomness, not unpredictability), and a WASI
//! random call per id cost more than the rest of the filter.

/// A seeded generator of non-zero ids.
#[derive(Debug, Clone)]
pub struct IdSource {
    s: [u64; 4],
}

impl IdSource {
    /// A generator seeded from the host's random source.
    pub fn from_entropy() -> Self {
        let mut seed = [0u8; 32];
        // A failed draw leaves zeros, which `from_seed` turns into a fixed non-zero state:
        // ids stay unique within the instance, which is all callers rely on.
        let _ = getrandom::fill(&mut seed);
        Self::from_seed(seed)
    }

    /// A generator from a fixed seed (tests).
    pub fn from_seed(seed: [u8; 32]) -> Self {
        let mut s = [0u64; 4];
        for (word, chunk) in s.iter_mut().zip(seed.chunks_exact(8)) {
            *word = u64::from_le_bytes(chunk.try_into().unwrap_or_default());
        }
        if s == [0; 4] {
            // xoshiro's one forbidden state.
            s = [0x9e37_79b9_7f4a_7c15, 1, 2, 3];
        }
        Self { s }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// `N` random bytes, never all zero (a zero trace or span id is invalid).
    pub fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        while out == [0u8; N] {
            for chunk in out.chunks_mut(8) {
                let word = self.next_u64().to_le_bytes();
                chunk.copy_from_slice(&word[..chunk.len()]);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn ids_do_not_repeat_and_are_never_zero() {
        let mut ids = IdSource::from_seed([0; 32]);
        let seen: HashSet<[u8; 16]> = (0..10_000).map(|_| ids.bytes()).collect();
        assert_eq!(seen.len(), 10_000);
        assert!(!seen.contains(&[0u8; 16]));
    }

    #[test]
    fn seeds_give_different_streams() {
        let a = IdSource::from_seed([1; 32]).bytes::<8>();
        let b = IdSource::from_seed([2; 32]).bytes::<8>();
        assert_ne!(a, b);
        assert_ne!(
            IdSource::from_entropy().bytes::<16>(),
            IdSource::from_entropy().bytes::<16>()
        );
    }

    #[test]
    fn bits_are_balanced() {
        let mut ids = IdSource::from_seed([7; 32]);
        let ones: u32 = (0..1000)
            .map(|_| ids.bytes::<8>().iter().map(|b| b.count_ones()).sum::<u32>())
            .sum();
        // 64 000 bits: a fair source lands within a few hundred of half.
        assert!((31_000..33_000).contains(&ones), "{ones}");
    }
}

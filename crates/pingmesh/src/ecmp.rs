//! How many 5-tuples an inter-ToR target needs (the seed's formula (1)).
//!
//! Between two ToRs there are `n` equal-cost paths and the switches hash each 5-tuple
//! onto one of them, uniformly. With `k` tuples of different entropy (flow labels),
//! the probability that every path carries at least one is the coupon collector's
//!
//! ```text
//! P(n, k) = Σ_{i=0..n} (−1)^i · C(n, i) · (1 − i/n)^k
//! ```
//!
//! and a pinglist gives each target the smallest `k` with `P(n, k) ≥ p`, the
//! configured coverage probability. The sum alternates and loses precision for large
//! `n`, so it is computed by the equivalent recurrence on the number of paths covered
//! after each tuple (a path is new with probability (n − j)/n when j are covered).

/// The most tuples a target gets, whatever the formula says.
pub const MAX_TUPLES: u32 = 512;

/// The probability that `k` uniformly hashed tuples cover all `n` paths.
pub fn coverage(n: u32, k: u32) -> f64 {
    if n == 0 {
        return 1.0;
    }
    let n_us = n as usize;
    // dist[j]: probability that exactly j paths are covered.
    let mut dist = vec![0.0f64; n_us + 1];
    dist[0] = 1.0;
    for _ in 0..k {
        for j in (0..=n_us).rev() {
            let stay = dist[j] * j as f64 / n as f64;
            let arrive = if j > 0 {
                dist[j - 1] * (n_us - j + 1) as f64 / n as f64
            } else {
                0.0
            };
            dist[j] = stay + arrive;
        }
    }
    dist[n_us]
}

/// The smallest number of tuples covering all `n` paths with probability at least
/// `p` (at most [`MAX_TUPLES`]).
pub fn tuples_needed(n: u32, p: f64) -> u32 {
    if n <= 1 {
        return 1;
    }
    let p = p.clamp(0.0, 0.999_999);
    let mut k = n;
    while k < MAX_TUPLES && coverage(n, k) < p {
        k += 1;
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    /// The inclusion–exclusion form of formula (1), for checking the recurrence.
    fn formula(n: u32, k: u32) -> f64 {
        let mut sum = 0.0;
        let mut binom = 1.0f64;
        for i in 0..=n {
            let term = binom * (1.0 - i as f64 / n as f64).powi(k as i32);
            sum += if i % 2 == 0 { term } else { -term };
            binom = binom * (n - i) as f64 / (i + 1) as f64;
        }
        sum
    }

    #[test_case(2, 1 ; "two paths one tuple")]
    #[test_case(2, 5 ; "two paths five tuples")]
    #[test_case(4, 10 ; "four paths")]
    #[test_case(8, 30 ; "eight paths")]
    #[test_case(16, 60 ; "sixteen paths")]
    fn the_recurrence_is_formula_one(n: u32, k: u32) {
        assert!((coverage(n, k) - formula(n, k)).abs() < 1e-9);
    }

    #[test]
    fn known_values() {
        // Two paths, k tuples: all on one side with probability 2 · 2^−k.
        assert!((coverage(2, 3) - 0.75).abs() < 1e-12);
        assert_eq!(coverage(3, 2), 0.0, "two tuples cannot cover three paths");
        assert_eq!(tuples_needed(1, 0.99), 1);
        // 2 paths at 0.99: 1 − 2^(1−k) ≥ 0.99 → k = 8.
        assert_eq!(tuples_needed(2, 0.99), 8);
    }

    #[test]
    fn more_paths_or_more_certainty_need_more_tuples() {
        assert!(tuples_needed(8, 0.99) > tuples_needed(4, 0.99));
        assert!(tuples_needed(8, 0.999) > tuples_needed(8, 0.9));
        let k = tuples_needed(8, 0.99);
        assert!(coverage(8, k) >= 0.99 && coverage(8, k - 1) < 0.99);
    }

    #[test]
    fn the_count_is_capped() {
        assert_eq!(tuples_needed(400, 0.99), MAX_TUPLES);
    }
}

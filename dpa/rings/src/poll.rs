//! How a thread that serves rings and queues waits when it has nothing to do: keep
//! polling for a while after the last work (a wake-up costs a system call on each side
//! and a context switch; polling costs the core), then sleep until woken — or never
//! sleep, on a core given to it alone.
//!
//! The polling time adapts, as Linux's halt-polling does: a sleep that ended sooner
//! than the longest allowed poll means polling that long would have caught the work
//! without a wake-up (poll longer next time); a sleep that outlasted it, or a poll
//! that found nothing, means the poll was spent for nothing (poll shorter).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::ring::WakeMode;

/// A waiting thread's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Polling {
    /// Poll for between `min` and `max` after the last work (adapting in between),
    /// then sleep until woken.
    Hybrid {
        /// The shortest poll.
        min: Duration,
        /// The longest poll.
        max: Duration,
    },
    /// Never sleep: for a core that serves nothing else (a DPU's Arm core).
    Poll,
}

impl Default for Polling {
    /// Hybrid, 0 to 50 µs: on a busy node the poll grows and catches the next work
    /// without a wake-up; on an idle one it shrinks to nothing.
    fn default() -> Self {
        Polling::Hybrid {
            min: Duration::ZERO,
            max: Duration::from_micros(50),
        }
    }
}

/// The environment variable `dpumesh up` sets for pods (and a node's shards read),
/// in [`Polling`]'s text form.
pub const ENV: &str = "DPUMESH_POLL";

impl Polling {
    /// From [`ENV`] if it is set and valid, else the default (an invalid value is
    /// logged, not fatal: a pod must not fail to start over a tuning knob).
    pub fn from_env() -> Polling {
        match std::env::var(ENV) {
            Ok(v) => v.parse().unwrap_or_else(|e| {
                tracing::warn!(value = %v, error = %e, "{ENV} ignored");
                Polling::default()
            }),
            Err(_) => Polling::default(),
        }
    }
}

/// Why a polling policy does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "polling {0:?}: expected `poll`, `hybrid` or `hybrid:MIN-MAX` with times such as 0us, 50us, 1ms"
)]
pub struct BadPolling(pub String);

fn micros(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = n.parse().ok()?;
    match unit {
        "ns" => Some(Duration::from_nanos(n)),
        "us" | "µs" => Some(Duration::from_micros(n)),
        "ms" => Some(Duration::from_millis(n)),
        _ => None,
    }
}

impl FromStr for Polling {
    type Err = BadPolling;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadPolling(s.to_owned());
        match s.trim() {
            "poll" => Ok(Polling::Poll),
            "hybrid" => Ok(Polling::default()),
            other => {
                let range = other.strip_prefix("hybrid:").ok_or_else(bad)?;
                let (min, max) = range.split_once('-').ok_or_else(bad)?;
                let (min, max) = (micros(min).ok_or_else(bad)?, micros(max).ok_or_else(bad)?);
                if min > max || max > Duration::from_secs(1) {
                    return Err(bad());
                }
                Ok(Polling::Hybrid { min, max })
            }
        }
    }
}

impl fmt::Display for Polling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Polling::Poll => f.write_str("poll"),
            Polling::Hybrid { min, max } => {
                write!(f, "hybrid:{}ns-{}ns", min.as_nanos(), max.as_nanos())
            }
        }
    }
}

/// How a wait ended, for [`Spin::record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// Work came while polling.
    WhilePolling,
    /// Work came after sleeping this long.
    Slept(Duration),
    /// Nothing came before the wait's timeout.
    Nothing,
}

/// The adaptive poll of one waiting thread.
#[derive(Debug, Clone)]
pub struct Spin {
    polling: Polling,
    current: Duration,
}

/// Where a poll starts growing from when its minimum is zero.
const GROW_FROM: Duration = Duration::from_micros(2);

impl Spin {
    pub fn new(polling: Polling) -> Self {
        let current = match polling {
            Polling::Hybrid { min, .. } => min,
            Polling::Poll => Duration::ZERO,
        };
        Self { polling, current }
    }

    pub fn polling(&self) -> Polling {
        self.polling
    }

    /// How long to poll before sleeping now; `None`: never sleep.
    pub fn budget(&self) -> Option<Duration> {
        match self.polling {
            Polling::Poll => None,
            Polling::Hybrid { .. } => Some(self.current),
        }
    }

    /// The next wait as a ring's wake mode.
    pub fn wake_mode(&self) -> WakeMode {
        match self.budget() {
            None => WakeMode::Poll,
            Some(spin) => WakeMode::Event { spin },
        }
    }

    /// Learns from how a wait ended.
    pub fn record(&mut self, waited: Waited) {
        let Polling::Hybrid { min, max } = self.polling else {
            return;
        };
        match waited {
            Waited::WhilePolling => {}
            Waited::Slept(d) if d <= max => {
                self.current = (self.current * 2).max(GROW_FROM).clamp(min, max);
            }
            Waited::Slept(_) | Waited::Nothing => {
                self.current = (self.current / 2).max(min);
                if self.current < GROW_FROM {
                    self.current = min;
                }
            }
        }
    }

    /// Classifies a wait that polled for `budget` and returned after `elapsed`, `found`
    /// saying whether work came.
    pub fn classify(budget: Duration, elapsed: Duration, found: bool) -> Waited {
        if !found {
            Waited::Nothing
        } else if elapsed <= budget {
            Waited::WhilePolling
        } else {
            Waited::Slept(elapsed - budget)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test_case("poll", Polling::Poll)]
    #[test_case("hybrid", Polling::default())]
    #[test_case("hybrid:0us-50us", Polling::Hybrid { min: us(0), max: us(50) })]
    #[test_case("hybrid:5us-1ms", Polling::Hybrid { min: us(5), max: us(1000) })]
    #[test_case("hybrid:100ns-200ns", Polling::Hybrid { min: Duration::from_nanos(100), max: Duration::from_nanos(200) })]
    fn policies_parse(text: &str, want: Polling) {
        assert_eq!(text.parse::<Polling>(), Ok(want));
        // And print back to what parses to the same.
        assert_eq!(want.to_string().parse::<Polling>(), Ok(want));
    }

    #[test_case("" ; "empty")]
    #[test_case("sleep" ; "unknown mode")]
    #[test_case("hybrid:50us" ; "no range")]
    #[test_case("hybrid:50us-10us" ; "min above max")]
    #[test_case("hybrid:0us-2s" ; "max above a second")]
    #[test_case("hybrid:1h-2h" ; "unknown unit")]
    #[test_case("hybrid:-5us-10us" ; "negative")]
    fn bad_policies_are_refused_with_the_text(text: &str) {
        let e = text.parse::<Polling>().unwrap_err();
        assert!(e.to_string().contains(&format!("{text:?}")), "{e}");
    }

    #[test]
    fn a_busy_thread_polls_longer_up_to_the_maximum() {
        let mut spin = Spin::new(Polling::Hybrid {
            min: us(0),
            max: us(50),
        });
        assert_eq!(spin.budget(), Some(us(0)));
        // Work came 10 µs after each sleep: polling would have caught it.
        let mut seen = Vec::new();
        for _ in 0..8 {
            spin.record(Waited::Slept(us(10)));
            seen.push(spin.budget().unwrap());
        }
        assert_eq!(&seen[..6], &[us(2), us(4), us(8), us(16), us(32), us(50)]);
        assert_eq!(spin.budget(), Some(us(50)), "never past the maximum");
        // Work found while polling keeps the poll as it is.
        spin.record(Waited::WhilePolling);
        assert_eq!(spin.budget(), Some(us(50)));
    }

    #[test]
    fn an_idle_thread_stops_polling() {
        let mut spin = Spin::new(Polling::Hybrid {
            min: us(0),
            max: us(50),
        });
        for _ in 0..6 {
            spin.record(Waited::Slept(us(5)));
        }
        assert_eq!(spin.budget(), Some(us(50)));
        // Long sleeps and empty waits halve it down to the minimum.
        spin.record(Waited::Slept(Duration::from_millis(20)));
        assert_eq!(spin.budget(), Some(us(25)));
        for _ in 0..10 {
            spin.record(Waited::Nothing);
        }
        assert_eq!(spin.budget(), Some(us(0)));
    }

    #[test]
    fn the_minimum_is_kept() {
        let mut spin = Spin::new(Polling::Hybrid {
            min: us(10),
            max: us(40),
        });
        assert_eq!(spin.budget(), Some(us(10)));
        spin.record(Waited::Nothing);
        assert_eq!(spin.budget(), Some(us(10)));
        spin.record(Waited::Slept(us(1)));
        assert_eq!(spin.budget(), Some(us(20)));
    }

    #[test]
    fn poll_mode_never_sleeps() {
        let mut spin = Spin::new(Polling::Poll);
        spin.record(Waited::Nothing);
        assert_eq!(spin.budget(), None);
        assert_eq!(spin.wake_mode(), WakeMode::Poll);
    }

    #[test_case(us(10), us(4), true, Waited::WhilePolling)]
    #[test_case(us(10), us(30), true, Waited::Slept(us(20)))]
    #[test_case(us(10), us(30), false, Waited::Nothing)]
    fn waits_are_classified_by_when_work_came(
        budget: Duration,
        elapsed: Duration,
        found: bool,
        want: Waited,
    ) {
        assert_eq!(Spin::classify(budget, elapsed, found), want);
    }
}

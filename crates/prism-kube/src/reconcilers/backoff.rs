//! Retries of failed reconciles, per object: 1 s, 2 s, 4 s … up to 5 min, back to 1 s
//! after a successful reconcile. An object that keeps failing (a bad spec, a missing
//! permission) then costs a request every few minutes rather than every few seconds,
//! while a passing hiccup is still retried at once.

use std::time::Duration;

use moka::policy::EvictionPolicy;
use moka::sync::Cache;

/// The wait after the first failure.
pub const FIRST_RETRY: Duration = Duration::from_secs(1);
/// The longest wait between two attempts.
pub const MAX_RETRY: Duration = Duration::from_secs(300);
/// A failure older than this no longer counts (the object was deleted, or fixed while
/// this replica was not leading): the next failure starts again at `FIRST_RETRY`.
const FORGET_AFTER: Duration = Duration::from_secs(2 * MAX_RETRY.as_secs());
/// The most objects counted at once: every object of both kinds at the 30,000 scale
/// goal failing together (Postgres down), so an outage does not reset anyone's backoff.
/// Past it the least recently failed are forgotten first.
const CAPACITY: u64 = 65_536;

/// The wait before the next attempt after `failures` consecutive failures (>= 1).
pub fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(31);
    FIRST_RETRY.saturating_mul(1u32 << doublings).min(MAX_RETRY)
}

/// Consecutive failures by object (`kind/namespace/name`). A bounded moka cache whose
/// time to live restarts at each failure: a count expires `FORGET_AFTER` after the last
/// failure, at O(1) per failure where a map pruned by a scan cost O(n).
pub struct Failures {
    entries: Cache<String, u32>,
}

impl Default for Failures {
    fn default() -> Self {
        Self::bounded(FORGET_AFTER, CAPACITY)
    }
}

impl Failures {
    fn bounded(forget_after: Duration, capacity: u64) -> Self {
        let entries = Cache::builder()
            .max_capacity(capacity)
            .time_to_live(forget_after)
            .eviction_policy(EvictionPolicy::lru())
            .build();
        Self { entries }
    }

    /// Counts a failure of `key` and returns the wait before its next attempt.
    pub fn failed(&self, key: String) -> Duration {
        // One atomic read-modify-write: two failures of one object at once count twice.
        let entry = self.entries.entry(key).and_upsert_with(|n| n.map_or(1, |n| n.into_value().saturating_add(1)));
        backoff(entry.into_value())
    }

    /// A successful reconcile of `key`: its next failure waits `FIRST_RETRY` again.
    pub fn succeeded(&self, key: &str) {
        self.entries.invalidate(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_one_second_up_to_five_minutes() {
        let secs: Vec<u64> = (1..=11).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(backoff(0), FIRST_RETRY, "called before any failure: the shortest wait");
        assert_eq!(backoff(u32::MAX), MAX_RETRY, "no overflow");
    }

    #[test]
    fn per_object_and_reset_by_a_success() {
        let failures = Failures::default();
        let waits: Vec<u64> = (0..4).map(|_| failures.failed("K/ns/a".into()).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8]);
        assert_eq!(failures.failed("K/ns/b".into()), FIRST_RETRY, "another object has its own count");
        failures.succeeded("K/ns/a");
        assert_eq!(failures.failed("K/ns/a".into()), FIRST_RETRY, "a success starts over");
        assert_eq!(failures.failed("K/ns/b".into()), Duration::from_secs(2), "b still counts");
    }

    #[test]
    fn an_old_failure_no_longer_counts() {
        let failures = Failures::bounded(Duration::from_millis(200), 16);
        assert_eq!(failures.failed("K/ns/a".into()), FIRST_RETRY);
        assert_eq!(failures.failed("K/ns/a".into()), Duration::from_secs(2));
        std::thread::sleep(Duration::from_millis(120));
        assert_eq!(failures.failed("K/ns/a".into()), Duration::from_secs(4), "each failure restarts the clock");
        std::thread::sleep(Duration::from_millis(120));
        assert_eq!(failures.failed("K/ns/a".into()), Duration::from_secs(8), "still within 200 ms of the last");
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(failures.failed("K/ns/a".into()), FIRST_RETRY, "forgotten: starts over");
    }

    #[test]
    fn bounded() {
        let failures = Failures::bounded(FORGET_AFTER, 8);
        for n in 0..100 {
            failures.failed(format!("K/ns/{n}"));
        }
        failures.entries.run_pending_tasks();
        assert!(failures.entries.entry_count() <= 8, "{} entries", failures.entries.entry_count());
        assert_eq!(failures.failed("K/ns/99".into()), Duration::from_secs(2), "the latest is still counted");
    }
}

//! Retries of failed reconciles, per object: 1 s, 2 s, 4 s … up to 5 min, back to 1 s
//! after a successful reconcile. An object that keeps failing (a bad spec, a missing
//! permission) then costs a request every few minutes rather than every few seconds,
//! while a passing hiccup is still retried at once.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The wait after the first failure.
pub const FIRST_RETRY: Duration = Duration::from_secs(1);
/// The longest wait between two attempts.
pub const MAX_RETRY: Duration = Duration::from_secs(300);
/// A failure older than this no longer counts (the object was deleted, or fixed while
/// this replica was not leading): the next failure starts again at `FIRST_RETRY`.
const FORGET_AFTER: Duration = Duration::from_secs(2 * MAX_RETRY.as_secs());

/// The wait before the next attempt after `failures` consecutive failures (>= 1).
pub fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(31);
    FIRST_RETRY.saturating_mul(1u32 << doublings).min(MAX_RETRY)
}

/// Consecutive failures by object (`kind/namespace/name`).
#[derive(Default)]
pub struct Failures {
    entries: Mutex<HashMap<String, (u32, Instant)>>,
}

impl Failures {
    /// Counts a failure of `key` and returns the wait before its next attempt.
    pub fn failed(&self, key: String) -> Duration {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if entries.len() >= 1024 {
            entries.retain(|_, (_, at)| at.elapsed() < FORGET_AFTER);
        }
        let failures = match entries.get(&key) {
            Some((n, at)) if at.elapsed() < FORGET_AFTER => n.saturating_add(1),
            _ => 1,
        };
        entries.insert(key, (failures, Instant::now()));
        backoff(failures)
    }

    /// A successful reconcile of `key`: its next failure waits `FIRST_RETRY` again.
    pub fn succeeded(&self, key: &str) {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !entries.is_empty() {
            entries.remove(key);
        }
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
}

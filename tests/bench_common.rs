//! The benchmarks' shared measuring and counting code (benches/common), unit-tested with
//! the other tests: bench targets run without the test harness, so their #[test]s would
//! never run there.
#![allow(dead_code)]

#[path = "../benches/common/counts.rs"]
mod counts;
#[path = "../benches/common/measure.rs"]
mod measure;

use std::time::Duration;

/// A paced window calls each task at most once per period, and times the call, not the
/// wait for its slot.
#[tokio::test]
async fn a_paced_window_keeps_the_pace_and_times_only_the_calls() {
    let period = Duration::from_millis(20);
    let w = measure::window_paced(2, Duration::from_millis(400), Some(period), |_, _| async {
        tokio::time::sleep(Duration::from_millis(2)).await;
        true
    })
    .await;
    // 20 slots per task in 400 ms; the last may not fit.
    assert!((36..=40).contains(&w.ops), "about 2 x 20 calls: {}", w.ops);
    assert!(w.latencies.iter().all(|l| *l < Duration::from_millis(15)), "the waits are not timed: {:?}", w.latencies);
    let unpaced = measure::window(2, Duration::from_millis(400), |_, _| async {
        tokio::time::sleep(Duration::from_millis(2)).await;
        true
    })
    .await;
    assert!(unpaced.ops > 2 * w.ops, "unpaced, as fast as they can: {} vs {}", unpaced.ops, w.ops);
}

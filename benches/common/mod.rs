//! What both benchmarks share: run an operation on CONCURRENCY tasks for WINDOW.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub const CONCURRENCY: usize = 16;
pub const WINDOW: Duration = Duration::from_secs(5);

/// Runs `op(task, n)` on CONCURRENCY tasks for WINDOW (n counts each task's calls);
/// returns successful operations per second. A task stops at its first failure.
pub async fn rate<F, Fut>(op: F) -> f64
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|i| {
            let (op, done) = (op.clone(), done.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while start.elapsed() < WINDOW {
                    if !op(i, n).await {
                        break;
                    }
                    n += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

//! What the fault tests share: a seeded generator (the same seed gives the same faults at
//! the same points of the load) and the Postgres backend killer.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;

/// A small deterministic generator (an LCG): enough to draw projects, surfaces and fault
/// times reproducibly; not for anything that needs real randomness.
pub struct Lcg(pub u64);

impl Lcg {
    /// A number in `0..below`.
    pub fn next(&mut self, below: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % below.max(1)
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next(100) < percent
    }

    /// A duration in `[lo, hi)` milliseconds.
    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next(hi.saturating_sub(lo).max(1)))
    }
}

/// The seed of a fault run: PRISM_FAULT_SEED, or a fixed default (printed by the tests so
/// a failing run can be repeated).
pub fn seed() -> u64 {
    std::env::var("PRISM_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(20261130)
}

/// Runs the independent invariant checker (tests/faults/check_invariants.py: psql and
/// SPEC §10, no code of the operator) on `db_url` with `args`; returns whether every
/// invariant held and what it printed. A crash of the checker itself fails the test.
pub async fn check_invariants(db_url: &str, args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new("python3")
        .arg(super::repo_root().join("tests/faults/check_invariants.py"))
        .arg(db_url)
        .args(args)
        .output()
        .await
        .expect("run the checker (python3)");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.code().is_some_and(|c| c <= 1),
        "the checker crashed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), stdout)
}

/// Ends every backend of database `name` each `every` until `stop` is set; counts them.
/// It works through `admin_url` (another database of the same server): its own connection
/// is not among those it ends.
pub async fn backend_killer(
    admin_url: &str,
    name: &str,
    every: Duration,
) -> (Arc<AtomicBool>, Arc<AtomicU64>, tokio::task::JoinHandle<()>) {
    let admin = PgPoolOptions::new().max_connections(1).connect(admin_url).await.expect("admin");
    let stop = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(AtomicU64::new(0));
    let handle = {
        let (stop, killed, name) = (stop.clone(), killed.clone(), name.to_string());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                )
                .bind(&name)
                .fetch_one(&admin)
                .await
                .unwrap_or(0);
                killed.fetch_add(n as u64, Ordering::Relaxed);
                tokio::time::sleep(every).await;
            }
        })
    };
    (stop, killed, handle)
}

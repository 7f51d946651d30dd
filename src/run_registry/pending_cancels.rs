//! Which Run addresses may hold a job whose cancel was requested, kept in memory by every
//! replica, so that a heartbeat (SPEC §6: its reply lists `cancel`) reads Postgres only
//! for those. Without it every heartbeat of every Run made two Postgres reads to answer
//! an empty list almost always, and the heartbeat ran at a tenth of its Redis baseline.
//!
//! A Postgres trigger NOTIFYs when a job in flight gets its cancel requested, whoever
//! requested it (the API, the fence of a new master term). This replica LISTENs; while it
//! is not listening (starting, Postgres restarting) nothing is known and every heartbeat
//! reads Postgres, as before. On each (re)connection, and every `RESCAN_EVERY`, it reads
//! the whole set again: that is how addresses whose cancels are done leave it. The
//! replica that took a cancel request notes its address itself before it answers, so the
//! Run's next heartbeat there sees it even before the notification comes back.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tracing::{debug, warn};

use super::RunAddress;

/// The channel the trigger of migration `20261202000004_cancel_signal.sql` notifies.
pub const CHANNEL: &str = "prism_job_cancels";
/// Addresses whose cancels are all done are forgotten this often.
pub const RESCAN_EVERY: Duration = Duration::from_secs(30);

/// The payload of one notification: the job's address.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Signal {
    server_instance_id: String,
    component_kind: String,
}

#[derive(Clone, Default)]
pub struct PendingCancels {
    // None: not listening, nothing known (every address may have one).
    known: Arc<Mutex<Option<HashSet<RunAddress>>>>,
}

impl PendingCancels {
    /// False only when no job of `address` can have a cancel request pending.
    pub fn may_have(&self, address: &RunAddress) -> bool {
        self.with(|known| known.as_ref().is_none_or(|set| set.contains(address)))
    }

    /// A cancel of a job of `address` was requested (or a notification says so).
    pub fn note(&self, address: &RunAddress) {
        self.with(|known| {
            if let Some(set) = known {
                set.insert(address.clone());
            }
        })
    }

    /// Stopped listening: notifications may be lost from now on.
    fn forget(&self) {
        self.with(|known| *known = None)
    }

    fn replace(&self, set: HashSet<RunAddress>) {
        self.with(|known| *known = Some(set))
    }

    fn with<T>(&self, f: impl FnOnce(&mut Option<HashSet<RunAddress>>) -> T) -> T {
        // A panic elsewhere while the lock was held leaves a set that is still a set.
        f(&mut self.known.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Follows the notifications until the process ends.
    pub async fn follow(self, pool: PgPool) {
        const RETRY: Duration = Duration::from_secs(2);
        loop {
            if let Err(error) = self.follow_once(&pool).await {
                warn!(%error, "pending cancels: not listening; heartbeats read Postgres until it is back");
            }
            self.forget();
            tokio::time::sleep(RETRY).await;
        }
    }

    /// Listens, reads the set, then applies notifications until the connection is lost.
    /// LISTEN comes before the read, so a cancel committed in between is in one or the
    /// other; notifications that arrive during a rescan wait in the listener's buffer and
    /// are applied after it.
    async fn follow_once(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
        listener.eager_reconnect(false);
        listener.listen(CHANNEL).await?;
        self.replace(scan(pool).await?);
        let mut rescan = tokio::time::interval(RESCAN_EVERY);
        rescan.tick().await;
        loop {
            tokio::select! {
                received = listener.try_recv() => match received? {
                    Some(notification) => match serde_json::from_str::<Signal>(notification.payload()) {
                        Ok(s) => self.note(&RunAddress {
                            server_instance_id: s.server_instance_id,
                            component_kind: s.component_kind,
                        }),
                        Err(error) => {
                            debug!(%error, payload = notification.payload(), "pending cancels: unreadable signal");
                            // Unreadable: it may have named any address.
                            return Ok(());
                        }
                    },
                    // Lost the connection: what was sent meanwhile is gone.
                    None => return Ok(()),
                },
                _ = rescan.tick() => self.replace(scan(pool).await?),
            }
        }
    }
}

async fn scan(pool: &PgPool) -> Result<HashSet<RunAddress>, sqlx::Error> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT DISTINCT server_instance_id, component_kind FROM runtime_jobs
          WHERE cancel_requested_at IS NOT NULL AND state IN ('claimed','running')",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(server_instance_id, component_kind)| RunAddress { server_instance_id, component_kind })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(server: &str) -> RunAddress {
        RunAddress { server_instance_id: server.into(), component_kind: "run".into() }
    }

    #[test]
    fn unknown_until_listening_then_only_the_noted_addresses() {
        let pending = PendingCancels::default();
        assert!(pending.may_have(&at("a")), "not listening: every address may have one");
        pending.note(&at("a"));
        pending.replace(HashSet::from([at("b")]));
        assert!(!pending.may_have(&at("a")), "the read replaced what was noted before it");
        assert!(pending.may_have(&at("b")));
        pending.note(&at("c"));
        assert!(pending.may_have(&at("c")));
        assert!(!pending.may_have(&RunAddress { server_instance_id: "c".into(), component_kind: "agent".into() }));
        pending.forget();
        assert!(pending.may_have(&at("z")), "stopped listening: unknown again");
    }

    #[test]
    fn clones_share_one_set() {
        let pending = PendingCancels::default();
        pending.replace(HashSet::new());
        let other = pending.clone();
        other.note(&at("a"));
        assert!(pending.may_have(&at("a")));
    }

    #[test]
    fn the_signal_is_the_json_the_trigger_builds() {
        let s: Signal = serde_json::from_str(r#"{"server_instance_id":"srv-1","component_kind":"run"}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s, Signal { server_instance_id: "srv-1".into(), component_kind: "run".into() });
    }
}

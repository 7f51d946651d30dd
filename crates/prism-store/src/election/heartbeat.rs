//! Heartbeat coalescing (SPEC §4 rule 8): every authenticated agent call refreshes its
//! session's registration, but Postgres sees one batched UPDATE per window, however many
//! calls arrived in it. Write load grows with the number of sessions, not the call rate.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tracing::warn;

use super::store::ElectionStore;

/// Heartbeats arriving within this window become one UPDATE; a heartbeat's answer may be
/// reused for the same session for as long (a role change shows within it).
pub const COALESCING_WINDOW: Duration = Duration::from_millis(250);

#[derive(Clone)]
pub struct HeartbeatCoalescer {
    pending: Arc<Mutex<HashSet<(String, String)>>>,
    /// UPDATE statements written (exported as prism_controller_heartbeat_flushes).
    writes: Counter,
}

impl HeartbeatCoalescer {
    /// Starts the flusher: one UPDATE per `window` when there is anything to write.
    pub fn spawn(store: ElectionStore, window: Duration, writes: Counter) -> Self {
        let this = Self { pending: Arc::default(), writes };
        let worker = this.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(window);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                worker.flush(&store).await;
            }
        });
        this
    }

    /// Records a heartbeat of (namespace, session_id); written at the next flush.
    pub fn beat(&self, namespace: &str, session_id: &str) {
        if let Ok(mut pending) = self.pending.lock() {
            pending.insert((namespace.to_string(), session_id.to_string()));
        }
    }

    /// Writes everything pending in one statement. On a database error the batch is put
    /// back (a heartbeat is only lost if Postgres stays down past the stale threshold).
    pub async fn flush(&self, store: &ElectionStore) {
        let batch: Vec<(String, String)> = match self.pending.lock() {
            Ok(mut pending) => pending.drain().collect(),
            Err(_) => return,
        };
        if batch.is_empty() {
            return;
        }
        self.writes.inc();
        if let Err(e) = store.touch(&batch).await {
            warn!(sessions = batch.len(), error = %e, "heartbeat flush failed; will retry");
            if let Ok(mut pending) = self.pending.lock() {
                pending.extend(batch);
            }
        }
    }

    /// How many UPDATEs were written so far.
    pub fn writes(&self) -> u64 {
        self.writes.get()
    }
}

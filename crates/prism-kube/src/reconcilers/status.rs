//! One status writer for both kinds: compare with the last status (ours if we wrote one
//! lately), merge-patch the status only when it changed in a way worth a write,
//! remember what we wrote, and record an Event when the role or phase changed. What
//! differs between the kinds is `ObservedStatus`.

use std::fmt::Debug;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::core::object::HasStatus;
use kube::{Api, Resource, ResourceExt};
use moka::policy::EvictionPolicy;
use moka::sync::Cache;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::FIELD_MANAGER;
use super::events::{EventPublisher, StatusEvent};

/// What the status writer needs to know of a kind's status.
pub trait ObservedStatus: Clone + PartialEq + Default + Serialize + Send + Sync + 'static {
    /// The `action` of this kind's Events.
    const EVENT_ACTION: &'static str;

    fn last_heartbeat(&self) -> Option<&Time>;

    /// This status without the parts that move on their own (`lastHeartbeat` and what is
    /// derived from it), for comparison.
    fn stable(&self) -> Self;

    /// The Events for the change `previous` → `next` (none unless it is a change worth one).
    fn events(previous: &Self, next: &Self) -> Vec<StatusEvent>;
}

/// Whether to write: anything but the heartbeat changed, or the heartbeat moved by at
/// least `heartbeat_every` (`lastHeartbeat` alone is never a status write per beat).
pub fn needs_write<S: ObservedStatus>(previous: &S, next: &S, heartbeat_every: Duration) -> bool {
    let secs = |t: Option<&Time>| t.map(|t| t.0.as_second());
    let beat_moved = match (secs(previous.last_heartbeat()), secs(next.last_heartbeat())) {
        (Some(a), Some(b)) => (b - a).unsigned_abs() >= heartbeat_every.as_secs(),
        (a, b) => a != b,
    };
    beat_moved || previous.stable() != next.stable()
}

/// Compare → merge patch of the status (only when needed) → remember it →
/// record the Events of a change of role or phase (or drain). `previous` is what `next` was built
/// against (`Written::previous`).
pub async fn write_status<K>(
    api: &Api<K>,
    events: &EventPublisher,
    written: &Written<K::Status>,
    obj: &K,
    previous: &K::Status,
    next: &K::Status,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = ()> + HasStatus<Status: ObservedStatus> + Clone + DeserializeOwned + Debug,
{
    if needs_write(previous, next, written.heartbeat_every) {
        let patch = json!({"status": status_patch(previous, next).map_err(kube::Error::SerdeError)?});
        let params = PatchParams { field_manager: Some(FIELD_MANAGER.to_string()), ..PatchParams::default() };
        api.patch_status(&obj.name_any(), &params, &Patch::Merge(&patch)).await?;
        written.wrote(obj.uid().as_deref(), next.clone());
    }
    for event in K::Status::events(previous, next) {
        events.publish(obj, event, K::Status::EVENT_ACTION).await;
    }
    Ok(())
}

/// The JSON merge patch (RFC 7386) that makes the status `next`: all of `next`, and a null
/// for each field `previous` has and `next` lacks, at any depth (a merge patch keeps what
/// it does not name; lists such as `conditions` it replaces whole). A merge patch rather
/// than a server-side apply: the API server's apply builds and diffs managed-field sets
/// on every write, ~6 % more of its CPU per status write (BENCHMARKS.md, election).
fn status_patch<S: Serialize>(previous: &S, next: &S) -> Result<Value, serde_json::Error> {
    fn null_what_went(previous: &Value, next: &mut Value) {
        if let (Value::Object(previous), Value::Object(next)) = (previous, next) {
            for (field, old) in previous {
                match next.get_mut(field) {
                    Some(new) => null_what_went(old, new),
                    None => {
                        next.insert(field.clone(), Value::Null);
                    }
                }
            }
        }
    }
    let mut patch = serde_json::to_value(next)?;
    null_what_went(&serde_json::to_value(previous)?, &mut patch);
    Ok(patch)
}

/// How long a status this replica wrote is preferred over the watch cache's copy.
const WRITTEN_TTL: Duration = Duration::from_secs(10);

/// The most statuses of one kind remembered at once: all that this replica writes in
/// `WRITTEN_TTL`, even 30,000 objects written in one burst. Past it the least recently
/// used go first (a reconcile of such an object compares with the watch cache's copy,
/// as after `WRITTEN_TTL`).
const WRITTEN_CAPACITY: u64 = 65_536;

/// The statuses this leader wrote in the last few seconds, by resource uid. The watch
/// cache lags our own writes: a reconcile that comes sooner (an election trigger)
/// would compare against the older status, write the same status again and repeat its
/// Event. After `WRITTEN_TTL` the cache is trusted again, so a status changed by
/// someone else is still corrected at the next reconcile. A bounded moka cache: expiry
/// and eviction cost O(1) per write, where a map pruned by a scan cost O(n) per insert.
pub struct Written<S> {
    entries: Cache<String, S>,
    /// A status whose only change is `lastHeartbeat` is written once it moved this much
    /// (PRISM_STATUS_HEARTBEAT_SECONDS): the API server's steady write load.
    pub heartbeat_every: Duration,
}

impl<S: Clone + Send + Sync + 'static> Written<S> {
    pub fn new(heartbeat_every: Duration) -> Self {
        Self::bounded(heartbeat_every, WRITTEN_TTL, WRITTEN_CAPACITY)
    }

    fn bounded(heartbeat_every: Duration, ttl: Duration, capacity: u64) -> Self {
        // LRU: the status written last is the one a lagging reconcile is about to need;
        // TinyLFU's admission could turn a new uid away in a burst of new objects.
        let entries =
            Cache::builder().max_capacity(capacity).time_to_live(ttl).eviction_policy(EvictionPolicy::lru()).build();
        Self { entries, heartbeat_every }
    }

    /// The status to compare against: ours if we wrote one lately, else the cached one.
    pub fn previous(&self, uid: Option<&str>, cached: Option<&S>) -> Option<S> {
        uid.and_then(|uid| self.entries.get(uid)).or_else(|| cached.cloned())
    }

    pub fn wrote(&self, uid: Option<&str>, status: S) {
        if let Some(uid) = uid {
            self.entries.insert(uid.to_string(), status);
        }
    }

    /// Forgets everything: another leader may have written since.
    pub fn clear(&self) {
        self.entries.invalidate_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_patch_writes_next_whole_and_removes_what_went() {
        let previous = json!({
            "role": "Master", "term": 3, "releaseReason": "stale_heartbeat",
            "master": {"name": "a", "sessionId": "s-a"},
            "capacity": {"cpu": 4, "gpu": 1},
            "conditions": [{"type": "Ready"}, {"type": "Master"}]
        });
        let next = json!({
            "role": "Peer", "term": 3,
            "master": {"name": "b", "sessionId": "s-b"},
            "capacity": {"cpu": 4},
            "conditions": [{"type": "Ready"}]
        });
        let patch = status_patch(&previous, &next).expect("serializable");
        assert_eq!(
            patch,
            json!({
                "role": "Peer", "term": 3, "releaseReason": null,
                "master": {"name": "b", "sessionId": "s-b"},
                "capacity": {"cpu": 4, "gpu": null},
                "conditions": [{"type": "Ready"}]
            }),
            "all of next, a null for each field gone at any depth, lists whole"
        );
        assert_eq!(status_patch(&json!({}), &next).expect("serializable"), next, "a first status is itself");
    }

    #[test]
    fn a_status_we_just_wrote_wins_over_the_lagging_cache() {
        let written: Written<&str> = Written::new(Duration::from_secs(120));
        assert_eq!(written.previous(Some("uid-1"), Some(&"cached")), Some("cached"), "nothing written yet");
        written.wrote(Some("uid-1"), "ours");
        assert_eq!(written.previous(Some("uid-1"), Some(&"cached")), Some("ours"));
        assert_eq!(written.previous(Some("uid-2"), Some(&"other")), Some("other"), "per resource");
        assert_eq!(written.previous(None, None), None);
        written.clear();
        assert_eq!(written.previous(Some("uid-1"), Some(&"cached")), Some("cached"), "a new term trusts the cache");
    }

    #[test]
    fn what_we_wrote_is_trusted_only_for_the_ttl() {
        let written: Written<&str> = Written::bounded(Duration::from_secs(120), Duration::from_millis(200), 16);
        written.wrote(Some("uid-1"), "ours");
        assert_eq!(written.previous(Some("uid-1"), Some(&"cached")), Some("ours"));
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(written.previous(Some("uid-1"), Some(&"cached")), Some("cached"), "expired: the cache again");
        written.entries.run_pending_tasks();
        assert_eq!(written.entries.entry_count(), 0, "and it is gone, not just hidden");
        written.wrote(Some("uid-1"), "newer");
        assert_eq!(written.previous(Some("uid-1"), None), Some("newer"), "a new write counts from its own time");
    }

    #[test]
    fn bounded_and_the_latest_write_is_kept() {
        let written: Written<u32> = Written::bounded(Duration::from_secs(120), WRITTEN_TTL, 8);
        for n in 0..100 {
            written.wrote(Some(&format!("uid-{n}")), n);
        }
        written.entries.run_pending_tasks();
        assert!(written.entries.entry_count() <= 8, "{} entries", written.entries.entry_count());
        assert_eq!(written.previous(Some("uid-99"), None), Some(99), "the newest survives the bound");
        assert_eq!(written.previous(Some("uid-0"), Some(&7)), Some(7), "the oldest made room");
    }
}

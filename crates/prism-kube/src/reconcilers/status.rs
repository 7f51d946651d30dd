//! One status writer for both kinds: compare with the last status (ours if we wrote one
//! lately), server-side apply the status only when it changed in a way worth a write,
//! remember what we wrote, and record an Event when the role or phase changed. What
//! differs between the kinds is `ObservedStatus`.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::core::object::HasStatus;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tracing::warn;

use super::FIELD_MANAGER;

/// An Event to record: its type, reason and note.
pub type StatusEvent = (EventType, &'static str, String);

/// What the status writer needs to know of a kind's status.
pub trait ObservedStatus: Clone + PartialEq + Default + Serialize {
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

/// Compare → server-side apply of the status (only when needed) → remember it →
/// record the Events of a change of role or phase (or drain). `previous` is what `next` was built
/// against (`Written::previous`).
pub async fn write_status<K>(
    api: &Api<K>,
    recorder: &Recorder,
    written: &Written<K::Status>,
    obj: &K,
    previous: &K::Status,
    next: &K::Status,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = ()> + HasStatus<Status: ObservedStatus> + Clone + DeserializeOwned + Debug,
{
    if needs_write(previous, next, written.heartbeat_every) {
        let patch = json!({"apiVersion": K::api_version(&()), "kind": K::kind(&()), "status": next});
        api.patch_status(&obj.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
        written.wrote(obj.uid().as_deref(), next.clone());
    }
    for event in K::Status::events(previous, next) {
        publish(recorder, obj, event, K::Status::EVENT_ACTION).await;
    }
    Ok(())
}

/// Records an Event on `obj`; a failure is logged: an Event never fails a reconcile.
pub async fn publish<K: Resource<DynamicType = ()>>(
    recorder: &Recorder,
    obj: &K,
    (type_, reason, note): StatusEvent,
    action: &str,
) {
    let event = Event { type_, reason: reason.into(), note: Some(note), action: action.into(), secondary: None };
    if let Err(e) = recorder.publish(&event, &obj.object_ref(&())).await {
        warn!(reason, error = %e, "could not record an Event");
    }
}

/// How long a status this replica wrote is preferred over the watch cache's copy.
const WRITTEN_TTL: Duration = Duration::from_secs(10);

/// The statuses this leader wrote in the last few seconds, by resource uid. The watch
/// cache lags our own writes: a reconcile that comes sooner (an election trigger)
/// would compare against the older status, write the same status again and repeat its
/// Event. After `WRITTEN_TTL` the cache is trusted again, so a status changed by
/// someone else is still corrected at the next reconcile.
pub struct Written<S> {
    entries: Mutex<HashMap<String, (Instant, S)>>,
    /// A status whose only change is `lastHeartbeat` is written once it moved this much
    /// (PRISM_STATUS_HEARTBEAT_SECONDS): the API server's steady write load.
    pub heartbeat_every: Duration,
}

impl<S: Clone> Written<S> {
    pub fn new(heartbeat_every: Duration) -> Self {
        Self { entries: Default::default(), heartbeat_every }
    }

    /// The status to compare against: ours if we wrote one lately, else the cached one.
    pub fn previous(&self, uid: Option<&str>, cached: Option<&S>) -> Option<S> {
        let ours = uid.and_then(|uid| {
            let entries = self.entries.lock().ok()?;
            entries.get(uid).filter(|(at, _)| at.elapsed() < WRITTEN_TTL).map(|(_, s)| s.clone())
        });
        ours.or_else(|| cached.cloned())
    }

    pub fn wrote(&self, uid: Option<&str>, status: S) {
        let (Some(uid), Ok(mut entries)) = (uid, self.entries.lock()) else { return };
        if entries.len() >= 1024 {
            entries.retain(|_, (at, _)| at.elapsed() < WRITTEN_TTL);
        }
        entries.insert(uid.to_string(), (Instant::now(), status));
    }

    /// Forgets everything: another leader may have written since.
    pub fn clear(&self) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

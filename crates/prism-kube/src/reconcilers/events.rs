//! Kubernetes Events (`events.k8s.io/v1`) on our resources: one create per Event, and
//! nothing kept once it is sent.
//!
//! Why not kube's `runtime::events::Recorder`: it keeps every Event it publishes for six
//! minutes (to turn a repeat into a `series` patch) and scans that whole map on every
//! publish. Every RunSession publishes an Event on its first Pending → Online, so at
//! 10,000 RunSessions that is ~10k cached Events (~28 MB) and a scan per Event, quadratic
//! in a hello burst (issue 23). Our Events are already one per change (the status memo,
//! `status::Written`, keeps a change from being announced twice), so a repeat is rare and
//! is simply a second Event: readers count a series as its `count` and a plain Event as
//! one, which adds up the same.

use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::runtime::events::EventType;
use kube::{Api, Client, Resource};
use tracing::warn;

use super::FIELD_MANAGER;

/// An Event to record: its type, reason and note.
pub type StatusEvent = (EventType, &'static str, String);

/// Creates Events as this operator (`reportingController` = `FIELD_MANAGER`) and this
/// replica (`reportingInstance`). It holds a client and a name, nothing per Event.
#[derive(Clone)]
pub struct EventPublisher {
    client: Client,
    /// `reportingInstance`: the pod's name, or the controller's when it has none.
    instance: String,
}

impl EventPublisher {
    /// `instance` is the replica's name (`None`: the controller's name stands for it).
    pub fn new(client: Client, instance: Option<String>) -> Self {
        Self { client, instance: instance.unwrap_or_else(|| FIELD_MANAGER.to_string()) }
    }

    /// Reports as the pod named by `POD_NAME` (the chart sets it from the downward API).
    pub fn of_this_pod(client: Client) -> Self {
        Self::new(client, std::env::var("POD_NAME").ok())
    }

    /// The Event `(type, reason, note)` with `action` on `obj`, at `now`: what kube's
    /// Recorder sent for a first occurrence, field for field.
    pub fn event<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        (type_, reason, note): StatusEvent,
        action: &str,
        now: Timestamp,
    ) -> Event {
        let regarding = obj.object_ref(&());
        // Unique per object and instant, as client-go names them.
        let name = format!("{}.{:x}", regarding.name.as_deref().unwrap_or(FIELD_MANAGER), now.as_nanosecond());
        let type_ = match type_ {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        };
        Event {
            metadata: ObjectMeta { name: Some(name), namespace: regarding.namespace.clone(), ..Default::default() },
            action: Some(action.to_string()),
            reason: Some(reason.to_string()),
            note: Some(note),
            type_: Some(type_.to_string()),
            event_time: Some(MicroTime(now)),
            reporting_controller: Some(FIELD_MANAGER.to_string()),
            reporting_instance: Some(self.instance.clone()),
            regarding: Some(regarding),
            ..Default::default()
        }
    }

    /// Records an Event on `obj`; a failure is logged: an Event never fails a reconcile.
    pub async fn publish<K: Resource<DynamicType = ()>>(&self, obj: &K, event: StatusEvent, action: &str) {
        let reason = event.1;
        let event = self.event(obj, event, action, Timestamp::now());
        // Cluster-scoped objects' Events go to "default", as kube's Recorder put them.
        let namespace = event.metadata.namespace.as_deref().unwrap_or("default");
        let events: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        if let Err(e) = events.create(&PostParams::default(), &event).await {
            warn!(reason, error = %e, "could not record an Event");
        }
    }
}

//! ControllerRegistration reconciler: glue between the resource and the election store.
//! read (resource) → register/release (store) → build status (pure) → apply status →
//! Events on role changes. Registrations whose role or master changed because of another
//! resource's event are fed back in through `Triggers`, so every status of a project
//! follows a commit within a second instead of waiting for a resync.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};
use uuid::Uuid;

use super::events::StatusEvent;
use super::status::{ObservedStatus, write_status};
use super::{Context, ControllerError, Reconciled, condition};
use crate::crd::{
    ControllerRegistration, ControllerRegistrationStatus, OWNER_ANNOTATION, PROJECT_LABEL, REGISTERED_BY_ANNOTATION,
    REGISTERED_BY_API, REGISTRATION_FINALIZER, RegistrationRef, ReleaseReason, Role, is_label_value,
};
use crate::time::to_k8s;
use prism_core::election::{NewRegistration, ProjectView, RegisterOutcome, Registration};
use prism_core::store::{ElectionFailure, Elections, Refusal, Runs};

/// Tries of the label patch when our copy keeps turning out stale.
const LABEL_ATTEMPTS: u32 = 3;

/// Its usual text: the fields, values, reasons and messages this reconciler writes, in
/// the order they are serialized (see `packed`).
impl super::packed::Packable for ControllerRegistration {
    const DICTIONARY: &'static [u8] = br#"{"apiVersion":"prism.ntecdev.ai/v1alpha1","kind":"ControllerRegistration","metadata":{"annotations":{"prism.ntecdev.ai/owner":"system:serviceaccount:","prism.ntecdev.ai/registered-by":"api"},"labels":{"prism.ntecdev.ai/project":""}},"spec":{"projectId":"","sessionId":"","agentSurface":"claude_code"},"status":{"role":"Released","isMaster":false,"term":1,"master":{"name":"","sessionId":"","agentSurface":"claude_desktop"},"registeredAt":"2026-12-05T00:00:00Z","lastHeartbeat":"2026-12-05T00:00:00Z","releasedAt":"2026-12-05T00:00:00Z","releaseReason":"stale_heartbeat_incident","preempted":true,"preemptedBy":{"name":"","sessionId":"","agentSurface":"cursor"},"observedGeneration":1,"conditions":[{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"released: context_switch","observedGeneration":1,"reason":"ContextSwitch","status":"False","type":"Ready"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"not in the election","observedGeneration":1,"reason":"Released","status":"False","type":"Master"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"no heartbeat for 0s","observedGeneration":1,"reason":"HeartbeatStale","status":"True","type":"Stale"}]}}
{"metadata":{"annotations":{"prism.ntecdev.ai/owner":"system:serviceaccount:"},"labels":{"prism.ntecdev.ai/project":""}},"spec":{"projectId":"","sessionId":"","agentSurface":"codex"},"status":{"role":"Peer","isMaster":false,"term":1,"master":{"name":"","sessionId":"","agentSurface":"other"},"registeredAt":"2026-12-05T00:00:00Z","lastHeartbeat":"2026-12-05T00:00:00Z","preempted":false,"observedGeneration":1,"conditions":[{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"registered on project ","observedGeneration":1,"reason":"Registered","status":"True","type":"Ready"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"peer; master is ","observedGeneration":1,"reason":"Peer","status":"False","type":"Master"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"preempted by a desktop registration","observedGeneration":1,"reason":"Preempted","status":"False","type":"Master"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"heartbeat within the stale threshold","observedGeneration":1,"reason":"HeartbeatFresh","status":"False","type":"Stale"}]}}
{"apiVersion":"prism.ntecdev.ai/v1alpha1","kind":"ControllerRegistration","metadata":{"annotations":{"prism.ntecdev.ai/owner":"system:serviceaccount:"},"labels":{"prism.ntecdev.ai/project":""}},"spec":{"projectId":"","sessionId":"","agentSurface":"claude_code"},"status":{"role":"Master","isMaster":true,"term":1,"master":{"name":"","sessionId":"","agentSurface":"claude_code"},"registeredAt":"2026-12-05T00:00:00Z","lastHeartbeat":"2026-12-05T00:00:00Z","preempted":false,"observedGeneration":1,"conditions":[{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"registered on project ","observedGeneration":1,"reason":"Registered","status":"True","type":"Ready"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"master of project  in term ","observedGeneration":1,"reason":"Elected","status":"True","type":"Master"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"heartbeat within the stale threshold","observedGeneration":1,"reason":"HeartbeatFresh","status":"False","type":"Stale"}]}}"#;
}

impl Reconciled for ControllerRegistration {
    /// Deleting the resource is the wrap: the finalizer holds it until the release (and
    /// the promotion of a successor) is committed.
    const FINALIZER: &'static str = REGISTRATION_FINALIZER;
    const METRIC: &'static str = "controllerregistration";

    async fn prepare(obj: Arc<Self>, api: &Api<Self>) -> Arc<Self> {
        add_finalizer_with_label(api, obj).await
    }

    async fn apply<E: Elections, R: Runs>(
        obj: Arc<Self>,
        api: &Api<Self>,
        ctx: &Context<E, R>,
    ) -> Result<Action, ControllerError> {
        let current = ensure_label(api, &obj).await;
        apply(current.as_ref().unwrap_or(&obj), api, ctx).await
    }

    async fn cleanup<E: Elections, R: Runs>(obj: Arc<Self>, ctx: &Context<E, R>) -> Result<Action, ControllerError> {
        cleanup(&obj, ctx).await
    }
}

impl ObservedStatus for ControllerRegistrationStatus {
    const EVENT_ACTION: &'static str = "Elect";

    fn last_heartbeat(&self) -> Option<&Time> {
        self.last_heartbeat.as_ref()
    }

    fn stable(&self) -> Self {
        let mut s = self.clone();
        s.last_heartbeat = None;
        // The Stale message carries the heartbeat age; compare its status only.
        for c in &mut s.conditions {
            if c.type_ == "Stale" {
                c.message.clear();
            }
        }
        s
    }

    fn events(previous: &Self, next: &Self) -> Vec<StatusEvent> {
        role_event(previous, next).into_iter().collect()
    }
}

/// Copies spec.projectId to the project label when the resource lacks it. Registrations
/// made through the HTTP API or admitted through the chart's policy carry it already:
/// then nothing is written. The patch holds the label alone, guarded by the
/// resourceVersion of the copy that lacked it: that copy comes from the watch cache,
/// which lags, so a conflict means "look again" (a fresh read, and a write only if the
/// label is still missing). Returns the fresher resource when it read or wrote one. A
/// failure is logged, never returned: the label serves selection, and the election must
/// not wait for it (the periodic requeue tries again).
pub async fn ensure_label(
    api: &Api<ControllerRegistration>,
    obj: &ControllerRegistration,
) -> Option<ControllerRegistration> {
    let mut fresh: Option<ControllerRegistration> = None;
    for _ in 0..LABEL_ATTEMPTS {
        let current = fresh.as_ref().unwrap_or(obj);
        let Some(patch) = label_patch(current) else { return fresh };
        match api.patch(&obj.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(updated) => return Some(updated),
            Err(kube::Error::Api(s)) if s.code == 409 => match api.get(&obj.name_any()).await {
                Ok(read) => fresh = Some(read),
                Err(e) => {
                    warn!(error = %e, "could not read the registration to set its project label");
                    return fresh;
                }
            },
            Err(e) => {
                warn!(error = %e, "could not set the project label");
                return fresh;
            }
        }
    }
    warn!("could not set the project label: the resource kept changing; next reconcile retries");
    fresh
}

/// A registration applied without the chart's admission policy lacks both the finalizer
/// and the project label. Writing both in one merge patch (guarded by resourceVersion)
/// lets this reconcile go straight on to the election, where kube's `finalizer()` alone
/// would add the finalizer, wait for that change to come back as another reconcile, and
/// then the label would take a second patch: one API write and one reconcile fewer per
/// registration, which matters when many register at once and the API server is what
/// they wait on. Any failure leaves the resource as it was: `finalizer()` then adds the
/// finalizer its own way, and the label follows in `apply`.
pub async fn add_finalizer_with_label(
    api: &Api<ControllerRegistration>,
    obj: Arc<ControllerRegistration>,
) -> Arc<ControllerRegistration> {
    let Some(patch) = finalizer_and_label_patch(&obj) else { return obj };
    match api.patch(&obj.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(updated) => Arc::new(updated),
        Err(e) => {
            debug!(error = %e, "finalizer and label in one patch failed; adding them one by one");
            obj
        }
    }
}

/// The label patch plus the finalizer list with ours appended, when both are missing
/// on a live resource (None otherwise).
pub fn finalizer_and_label_patch(obj: &ControllerRegistration) -> Option<serde_json::Value> {
    let has_finalizer = obj.finalizers().iter().any(|f| f == REGISTRATION_FINALIZER);
    if has_finalizer || obj.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let mut patch = label_patch(obj)?;
    let mut finalizers = obj.finalizers().to_vec();
    finalizers.push(REGISTRATION_FINALIZER.to_string());
    patch["metadata"]["finalizers"] = json!(finalizers);
    Some(patch)
}

/// The merge patch that sets the project label (None: it is set, or the project id is
/// not a valid label value — over 63 characters, or other characters — and
/// spec.projectId stays selectable as a field).
pub fn label_patch(obj: &ControllerRegistration) -> Option<serde_json::Value> {
    let project = obj.spec.project_id.as_str();
    if !is_label_value(project) || obj.labels().get(PROJECT_LABEL).map(String::as_str) == Some(project) {
        return None;
    }
    Some(json!({"metadata": {"labels": {PROJECT_LABEL: project}, "resourceVersion": obj.resource_version()}}))
}

fn uid(obj: &ControllerRegistration) -> Result<Uuid, ControllerError> {
    let uid = obj.uid().ok_or(ControllerError::MissingField("metadata.uid"))?;
    Uuid::parse_str(&uid).map_err(|_| ControllerError::MissingField("metadata.uid"))
}

/// What the reconcile found for the resource in the election.
enum Found {
    /// Its row (registered now, or before).
    Registered(Registration),
    /// Another resource holds its session on its project.
    Duplicate(Registration),
    /// Not used, and why (a condition reason and message).
    Unused { reason: &'static str, message: String },
}

/// How long a resource the API created may wait for its row before the reconciler takes
/// it for the leftover of a call that died between its two steps, and deletes it. Far
/// longer than a register call's own retries (a few seconds).
pub const ORPHAN_GRACE: chrono::TimeDelta = chrono::TimeDelta::seconds(60);

/// Whether the API made this resource (and so writes its row; SPEC §12, one writer per
/// registration).
pub fn through_api(obj: &ControllerRegistration) -> bool {
    obj.annotations().get(REGISTERED_BY_ANNOTATION).map(String::as_str) == Some(REGISTERED_BY_API)
}

/// The owner of a kubectl registration: the annotation the admission policy stamped, when
/// this operator is told to trust it (PRISM_TRUST_OWNER_ANNOTATION); else none is known.
pub fn kubectl_owner(obj: &ControllerRegistration, trusted: bool) -> Option<String> {
    let owner = obj.annotations().get(OWNER_ANNOTATION)?;
    let shaped = !owner.is_empty() && owner.chars().count() <= 1024 && !owner.chars().any(char::is_control);
    (trusted && shaped).then(|| owner.clone())
}

async fn apply<E: Elections, R: Runs>(
    obj: &ControllerRegistration,
    api: &Api<ControllerRegistration>,
    ctx: &Context<E, R>,
) -> Result<Action, ControllerError> {
    let id = uid(obj)?;
    let ns = obj.namespace().unwrap_or_default();
    let now = Utc::now();
    // Most reconciles find the registration live in the project its spec names (a
    // resync, a status heartbeat): one read of that project gives both its row and the
    // view its status is built from, without the project lock. (Reading the row and then
    // its project was two reads per live registration every status heartbeat.)
    let spec_view = ctx.election.project(&ns, &obj.spec.project_id).await.map_err(ControllerError::election)?;
    let live_here = spec_view.live.iter().find(|r| r.id == id).cloned();
    let (found, known_view) = match live_here {
        Some(row) => (Found::Registered(row), Some(spec_view)),
        None => match find_or_register(obj, api, ctx, id, &ns, now).await? {
            ControlFlow::Continue(found) => (found, None),
            ControlFlow::Break(action) => return Ok(action),
        },
    };

    let previous = ctx.written_registrations.previous(obj.uid().as_deref(), obj.status.as_ref()).unwrap_or_default();
    let generation = obj.metadata.generation;
    let next = match &found {
        Found::Registered(row) => {
            let view = match known_view {
                Some(view) => view,
                None => {
                    ctx.election.project(&row.namespace, &row.project_id).await.map_err(ControllerError::election)?
                }
            };
            // The preemptor is most often live in the same project (its master).
            let preempted_by = match row.preempted_by {
                Some(by) => match view.live.iter().find(|r| r.id == by) {
                    Some(live) => Some(live.clone()),
                    None => ctx.election.get(by).await.map_err(ControllerError::election)?,
                },
                None => None,
            };
            build_status(row, &view, preempted_by.as_ref(), generation, &previous, ctx.stale_after, now)
        }
        Found::Duplicate(existing) => duplicate_status(existing, generation, &previous, now),
        Found::Unused { reason, message } => unused_status(reason, message, generation, &previous, now),
    };
    let slot = match &found {
        Found::Registered(row) => project_slot(&row.namespace, &row.project_id),
        _ => project_slot(&ns, &obj.spec.project_id),
    };
    write_status(api, &ctx.events, &ctx.written_registrations, obj, &previous, &next).await?;

    Ok(match next.role {
        // Live registrations come back to refresh lastHeartbeat and the Stale condition.
        // The slot is the project's, taken from the clock as the reconcile ends (not as it
        // began), so the project's registrations come back at the same instant and share
        // one read of it (`ElectionStore::project`).
        Role::Master | Role::Peer => Action::requeue(next_slot(ctx.status_heartbeat, slot, Utc::now())),
        Role::Pending => Action::requeue(Duration::from_secs(60)),
        Role::Released => Action::await_change(),
    })
}

/// The registration's row when it is not live in its spec's project (released, moved, or
/// not registered yet): read by id, or registered now when kubectl made it. Break: the
/// reconcile ends here with that action.
async fn find_or_register<E: Elections, R: Runs>(
    obj: &ControllerRegistration,
    api: &Api<ControllerRegistration>,
    ctx: &Context<E, R>,
    id: Uuid,
    ns: &str,
    now: DateTime<Utc>,
) -> Result<ControlFlow<Action, Found>, ControllerError> {
    Ok(ControlFlow::Continue(match ctx.election.get(id).await.map_err(ControllerError::election)? {
        Some(row) => Found::Registered(row),
        // The API writes this one's row; without it yet, wait, and after the grace the
        // resource is a leftover: never registered here (a refused or wrapped session
        // would come back to life from it), deleted instead.
        None if through_api(obj) => {
            let created = obj.creation_timestamp().map(|t| t.0.as_second()).unwrap_or(i64::MAX);
            if now.timestamp().saturating_sub(created) > ORPHAN_GRACE.num_seconds() {
                delete_orphan(api, obj).await?;
                return Ok(ControlFlow::Break(Action::await_change()));
            }
            // No status write meanwhile: the API's own call announces the row within
            // milliseconds, and a "waiting" status would cost the API server a write
            // per registration made through the API.
            return Ok(ControlFlow::Break(Action::requeue(Duration::from_secs(5))));
        }
        None => {
            let new = NewRegistration {
                id,
                namespace: ns.to_string(),
                name: obj.name_any(),
                project_id: obj.spec.project_id.clone(),
                session_id: obj.spec.session_id.clone(),
                surface: obj.spec.agent_surface,
                owner: kubectl_owner(obj, ctx.trust_owner_annotation),
                through_api: false,
            };
            match ctx.election.register(&new).await {
                Ok(RegisterOutcome::Registered(row)) => Found::Registered(row),
                Ok(RegisterOutcome::DuplicateSession { existing }) => Found::Duplicate(existing),
                // The session is another identity's (or has an owner, and this resource's
                // is not known): it is not moved, and this resource is not used.
                Err(e) => match e.refusal() {
                    Some(Refusal::NotOwned(session)) => Found::Unused {
                        reason: "SessionNotOwned",
                        message: format!(
                            "session {session} belongs to another identity; this registration is not used"
                        ),
                    },
                    Some(Refusal::QuotaExceeded(quota)) => Found::Unused {
                        reason: "QuotaExceeded",
                        message: format!("quota exceeded: {quota}; this registration is not used"),
                    },
                    None => return Err(ControllerError::election(e)),
                },
            }
        }
    }))
}

/// Deletes a resource the API made that never got its row (only that resource: a uid
/// precondition). Its finalizer then releases nothing and lets it go.
async fn delete_orphan(api: &Api<ControllerRegistration>, obj: &ControllerRegistration) -> Result<(), ControllerError> {
    let params = kube::api::DeleteParams {
        preconditions: Some(kube::api::Preconditions { uid: obj.uid(), resource_version: None }),
        ..Default::default()
    };
    match api.delete(&obj.name_any(), &params).await {
        Ok(_) => {
            warn!("deleted a registration the API created but never registered (its call ended between the two steps)");
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Deleting the resource is the wrap: release (promoting a successor); `finalizer()`
/// then lets the resource go.
async fn cleanup<E: Elections, R: Runs>(
    obj: &ControllerRegistration,
    ctx: &Context<E, R>,
) -> Result<Action, ControllerError> {
    let id = uid(obj)?;
    let was_live = ctx.election.release(id, ReleaseReason::Wrapped).await.map_err(ControllerError::election)?;
    // The resource goes once this returns: its row may be pruned after retention.
    ctx.election.resource_gone(id).await.map_err(ControllerError::election)?;
    if was_live {
        info!("registration wrapped");
        let event = (EventType::Normal, "Released", "released: wrapped (resource deleted)".to_string());
        ctx.events.publish(obj, event, ControllerRegistrationStatus::EVENT_ACTION).await;
    }
    Ok(Action::await_change())
}

/// The wait until a live registration's next periodic reconcile: the next instant of its
/// slot in every `period`, at an offset fixed by `slot` (its project's, `project_slot`)
/// over the whole period.
///
/// Registrations made or reconciled together (a burst of creates, a leader change)
/// would otherwise come back together, every period: 10,000 of them one pass of tens of
/// seconds in the queue that also carries role changes, which then wait behind it (the
/// scale bench saw a role change's status lag p99 of 25 s at 10,000 when periods were
/// only stretched by 0-10 %). With slots they come back at a steady rate whenever they
/// started. A reconcile that a trigger ran shortly before its slot skips that slot, so
/// the time between two reconciles stays within 0.1-1.1 periods. One project's
/// registrations share a slot: each reads the whole project, and reads asked for at once
/// are made once (issue 23: the status heartbeat's reads were 42 of the 100 Postgres
/// transactions a second at 10,000).
pub fn next_slot(period: Duration, slot: u64, now: DateTime<Utc>) -> Duration {
    let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX).max(1);
    let offset = slot % period_ms;
    let now_ms = u64::try_from(now.timestamp_millis()).unwrap_or(0);
    let wait = period_ms - (now_ms % period_ms + offset) % period_ms;
    let wait = if wait < period_ms / 10 { wait + period_ms } else { wait };
    Duration::from_millis(wait)
}

/// The slot key of a project (`next_slot`): the same for every registration of it, in
/// every replica.
pub fn project_slot(namespace: &str, project_id: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    (namespace, project_id).hash(&mut h);
    h.finish()
}

fn reference(row: &Registration) -> RegistrationRef {
    RegistrationRef { name: row.name.clone(), session_id: row.session_id.clone(), agent_surface: row.agent_surface }
}

/// The status of a registration, from its row and its project's view. Pure.
pub fn build_status(
    row: &Registration,
    view: &ProjectView,
    preempted_by: Option<&Registration>,
    generation: Option<i64>,
    previous: &ControllerRegistrationStatus,
    stale_after: chrono::Duration,
    now: DateTime<Utc>,
) -> ControllerRegistrationStatus {
    let role = row.role();
    let reason = row.release_reason;
    let heartbeat_age = now - row.last_heartbeat;
    let stale = reason == Some(ReleaseReason::StaleHeartbeatIncident) || (row.is_live() && heartbeat_age > stale_after);
    let (ready, ready_reason, ready_msg) = match (role, reason) {
        (Role::Released, Some(r)) => (false, released_reason(r), format!("released: {r}")),
        (Role::Released, None) => (false, "Released", "released".to_string()),
        _ => (true, "Registered", format!("registered on project {}", row.project_id)),
    };
    let (master_reason, master_msg) = match role {
        Role::Master => {
            ("Elected", format!("master of project {} in term {}", row.project_id, row.master_term.unwrap_or_default()))
        }
        Role::Peer if row.preempted => ("Preempted", "preempted by a desktop registration".to_string()),
        Role::Peer => (
            "Peer",
            match &view.master {
                Some(m) => format!("peer; master is {}", m.name),
                None => "peer".to_string(),
            },
        ),
        _ => ("Released", "not in the election".to_string()),
    };
    let (stale_reason, stale_msg) = if stale {
        ("HeartbeatStale", format!("no heartbeat for {}s", heartbeat_age.num_seconds().max(0)))
    } else {
        ("HeartbeatFresh", "heartbeat within the stale threshold".to_string())
    };
    let conditions = vec![
        condition(&previous.conditions, "Ready", ready, ready_reason, &ready_msg, generation, now),
        condition(&previous.conditions, "Master", role == Role::Master, master_reason, &master_msg, generation, now),
        condition(&previous.conditions, "Stale", stale, stale_reason, &stale_msg, generation, now),
    ];
    ControllerRegistrationStatus {
        role,
        is_master: role == Role::Master,
        term: row.master_term,
        master: view.master.as_ref().map(reference),
        registered_at: Some(to_k8s(row.registered_at)),
        last_heartbeat: Some(to_k8s(row.last_heartbeat)),
        released_at: row.released_at.map(to_k8s),
        release_reason: reason,
        preempted: row.preempted,
        preempted_by: preempted_by.map(reference),
        observed_generation: generation,
        conditions,
    }
}

fn duplicate_status(
    existing: &Registration,
    generation: Option<i64>,
    previous: &ControllerRegistrationStatus,
    now: DateTime<Utc>,
) -> ControllerRegistrationStatus {
    // The other resource is of this namespace (sessions are scoped by namespace).
    let msg = format!(
        "session {} is already registered on project {} by {}; this registration is not used",
        existing.session_id, existing.project_id, existing.name
    );
    unused_status("DuplicateSession", &msg, generation, previous, now)
}

/// The status of a resource that is not in the election, with the reason why.
fn unused_status(
    reason: &str,
    message: &str,
    generation: Option<i64>,
    previous: &ControllerRegistrationStatus,
    now: DateTime<Utc>,
) -> ControllerRegistrationStatus {
    ControllerRegistrationStatus {
        role: Role::Pending,
        observed_generation: generation,
        conditions: vec![
            condition(&previous.conditions, "Ready", false, reason, message, generation, now),
            condition(&previous.conditions, "Master", false, reason, "not in the election", generation, now),
        ],
        ..Default::default()
    }
}

fn released_reason(r: ReleaseReason) -> &'static str {
    match r {
        ReleaseReason::Wrapped => "Wrapped",
        ReleaseReason::ContextSwitch => "ContextSwitch",
        ReleaseReason::StaleHeartbeatIncident => "StaleHeartbeatIncident",
    }
}

fn ready(status: &ControllerRegistrationStatus) -> Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    status.conditions.iter().find(|c| c.type_ == "Ready")
}

/// The Event for a change of role, if the role changed; for a resource that is not used
/// (Pending), once per reason why.
pub fn role_event(previous: &ControllerRegistrationStatus, next: &ControllerRegistrationStatus) -> Option<StatusEvent> {
    let master_name = next.master.as_ref().map(|m| m.name.as_str()).unwrap_or("none");
    let term = next.term.unwrap_or_default();
    match (previous.role, next.role) {
        // Pending → Pending may still be news: a resource that is not used says why once.
        (a, b) if a == b && a != Role::Pending => None,
        (Role::Peer, Role::Master) => {
            Some((EventType::Normal, "Promoted", format!("promoted to master in term {term}")))
        }
        (_, Role::Master) => Some((EventType::Normal, "BecameMaster", format!("became master in term {term}"))),
        (Role::Master, Role::Peer) if next.preempted => {
            let by = next.preempted_by.as_ref().map(|p| p.name.as_str()).unwrap_or(master_name);
            Some((EventType::Warning, "Preempted", format!("preempted by desktop registration {by}")))
        }
        (Role::Master, Role::Peer) => {
            Some((EventType::Normal, "Demoted", format!("now a peer; master is {master_name}")))
        }
        // Joining as a peer changes nobody's role: status and the routing table show it,
        // and an Event per peer would double the API writes of every registration.
        (_, Role::Peer) => None,
        (_, Role::Released) => {
            let reason = next.release_reason.map(ReleaseReason::as_str).unwrap_or("released");
            Some((EventType::Normal, "Released", format!("released: {reason}")))
        }
        (_, Role::Pending) => ready(next).and_then(|c| {
            if previous.role == Role::Pending && ready(previous).map(|p| &p.reason) == Some(&c.reason) {
                return None;
            }
            let reason = match c.reason.as_str() {
                "DuplicateSession" => "DuplicateSession",
                "SessionNotOwned" => "SessionNotOwned",
                "QuotaExceeded" => "QuotaExceeded",
                _ => return None,
            };
            Some((EventType::Warning, reason, c.message.clone()))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcilers::status::needs_write;
    use chrono::TimeZone;

    fn row(name: &str, master: bool) -> Registration {
        let t = Utc.timestamp_opt(1_700_000_000, 0).single().expect("time");
        Registration {
            id: Uuid::new_v4(),
            namespace: "ns".into(),
            name: name.into(),
            project_id: "P".into(),
            session_id: format!("s-{name}"),
            agent_surface: crate::crd::AgentSurface::Codex,
            is_master: master,
            master_term: master.then_some(3),
            registered_at: t,
            last_heartbeat: t,
            released_at: None,
            release_reason: None,
            preempted: false,
            preempted_by: None,
        }
    }

    fn status_of(r: &Registration, master: &Registration, now_offset: i64) -> ControllerRegistrationStatus {
        let view =
            ProjectView { term: 3, changes: 0, master: Some(master.clone()), live: vec![master.clone(), r.clone()] };
        let now = r.last_heartbeat + chrono::Duration::seconds(now_offset);
        build_status(r, &view, None, Some(1), &Default::default(), chrono::Duration::minutes(10), now)
    }

    #[test]
    fn master_and_peer_status() {
        let m = row("m", true);
        let p = row("p", false);
        let sm = status_of(&m, &m, 5);
        assert_eq!((sm.role, sm.is_master, sm.term), (Role::Master, true, Some(3)));
        let sp = status_of(&p, &m, 5);
        assert_eq!((sp.role, sp.is_master, sp.term), (Role::Peer, false, None));
        assert_eq!(sp.master.as_ref().map(|m| m.name.as_str()), Some("m"));
        let ready = sp.conditions.iter().find(|c| c.type_ == "Ready").expect("Ready");
        assert_eq!(ready.status, "True");
    }

    #[test]
    fn stale_condition_follows_the_threshold() {
        let m = row("m", true);
        let stale = |s: &ControllerRegistrationStatus| {
            s.conditions.iter().find(|c| c.type_ == "Stale").map(|c| c.status.clone())
        };
        assert_eq!(stale(&status_of(&m, &m, 60)).as_deref(), Some("False"));
        assert_eq!(stale(&status_of(&m, &m, 11 * 60)).as_deref(), Some("True"));
    }

    #[test]
    fn registrations_reconciled_together_come_back_spread_over_the_period() {
        let period = Duration::from_secs(120);
        let now = Utc::now();
        // 10,000 projects' registrations reconciled in the same instant (a leader change).
        let mut per_second = [0u32; 132];
        for n in 0..10_000u32 {
            let wait = next_slot(period, project_slot("team-a", &format!("project-{n}")), now);
            assert!(wait >= period / 10 && wait < period + period / 10, "{wait:?}");
            per_second[wait.as_secs() as usize] += 1;
        }
        // A steady rate (~83/s), not a burst: no second of the period gets 3x its share.
        let busiest = per_second.iter().max().copied().unwrap_or(0);
        assert!(busiest < 3 * 10_000 / 120, "busiest second {busiest}");
    }

    #[test]
    fn a_registration_keeps_its_slot_whenever_it_is_reconciled() {
        // (Its project's slot: every registration of the project has the same.)
        let period = Duration::from_secs(120);
        let id = project_slot("team-a", "checkout");
        let start = Utc::now();
        let slot = start + chrono::Duration::from_std(next_slot(period, id, start)).expect("wait");
        // Reconciled again at its slot, or by a trigger in between: the same next slot
        // (or the one after, when the trigger was just before it).
        for late_ms in [0i64, 1, 250] {
            let at = slot + chrono::Duration::milliseconds(late_ms);
            let next = at + chrono::Duration::from_std(next_slot(period, id, at)).expect("wait");
            assert_eq!((next - slot).num_milliseconds(), 120_000, "reconciled {late_ms} ms after its slot");
        }
        let trigger = slot - chrono::Duration::seconds(60);
        let next = trigger + chrono::Duration::from_std(next_slot(period, id, trigger)).expect("wait");
        assert_eq!(next, slot, "a trigger does not move the slot");
        let just_before = slot - chrono::Duration::seconds(5);
        let next = just_before + chrono::Duration::from_std(next_slot(period, id, just_before)).expect("wait");
        assert_eq!((next - slot).num_seconds(), 120, "a trigger 5 s before its slot skips that slot");
    }

    #[test]
    fn a_status_read_back_from_the_api_server_is_not_rewritten() {
        // Postgres keeps microseconds; Kubernetes keeps seconds.
        let mut m = row("m", true);
        m.registered_at += chrono::Duration::microseconds(123_456);
        m.last_heartbeat += chrono::Duration::microseconds(654_321);
        let view = ProjectView { term: 3, changes: 0, master: Some(m.clone()), live: vec![m.clone()] };
        let written = status_of(&m, &m, 1);
        let read_back: ControllerRegistrationStatus =
            serde_json::from_value(serde_json::to_value(&written).expect("json")).expect("status");
        let mut later = m.clone();
        later.last_heartbeat += chrono::Duration::seconds(30);
        let next =
            build_status(&later, &view, None, Some(1), &read_back, chrono::Duration::minutes(10), later.last_heartbeat);
        assert!(!needs_write(&read_back, &next, Duration::from_secs(120)), "{read_back:?}\n{next:?}");
    }

    #[test]
    fn heartbeat_alone_is_written_at_most_every_status_heartbeat() {
        let m = row("m", true);
        let a = status_of(&m, &m, 1);
        // The same registration after `secs` more seconds of heartbeats, against `a`.
        let beaten = |secs: i64| {
            let mut later = m.clone();
            later.last_heartbeat += chrono::Duration::seconds(secs);
            let view = ProjectView { term: 3, changes: 0, master: Some(m.clone()), live: vec![] };
            build_status(&later, &view, None, Some(1), &a, chrono::Duration::minutes(10), later.last_heartbeat)
        };
        let every = Duration::from_secs(120);
        assert!(!needs_write(&a, &beaten(10), every), "10 s of heartbeat is not worth a write");
        assert!(!needs_write(&a, &beaten(119), every));
        assert!(needs_write(&a, &beaten(125), every));
        // The Stale condition is not held back: past the stale threshold it is written.
        let stale = |secs: i64| {
            let view = ProjectView { term: 3, changes: 0, master: Some(m.clone()), live: vec![] };
            build_status(
                &m,
                &view,
                None,
                Some(1),
                &a,
                chrono::Duration::minutes(10),
                m.last_heartbeat + chrono::Duration::seconds(secs),
            )
        };
        assert!(needs_write(&a, &stale(601), every), "a registration turning stale is written at once");
    }

    #[test]
    fn role_changes_have_events() {
        let m = row("m", true);
        let p = row("p", false);
        let peer = status_of(&p, &m, 1);
        let master = status_of(&m, &m, 1);
        assert_eq!(role_event(&Default::default(), &master).map(|e| e.1), Some("BecameMaster"));
        assert_eq!(role_event(&Default::default(), &peer), None, "joining as a peer is no change of role");
        assert_eq!(role_event(&peer, &master).map(|e| e.1), Some("Promoted"));
        assert_eq!(role_event(&master, &master), None);
        let mut preempted = peer.clone();
        preempted.preempted = true;
        assert_eq!(role_event(&master, &preempted).map(|e| e.1), Some("Preempted"));
        let mut released = peer.clone();
        released.role = Role::Released;
        released.release_reason = Some(ReleaseReason::ContextSwitch);
        assert_eq!(role_event(&peer, &released).map(|e| e.2), Some("released: context_switch".to_string()));
    }

    #[test]
    fn label_patch_sets_only_a_missing_label() {
        let spec = |project: &str| crate::crd::ControllerRegistrationSpec {
            project_id: project.into(),
            session_id: "s".into(),
            agent_surface: crate::crd::AgentSurface::Codex,
        };
        let mut obj = ControllerRegistration::new("r", spec("PID-1"));
        obj.metadata.resource_version = Some("7".into());
        let patch = label_patch(&obj).expect("label missing");
        assert_eq!(
            patch,
            json!({"metadata": {"labels": {PROJECT_LABEL: "PID-1"}, "resourceVersion": "7"}}),
            "the label alone, guarded by the copy's resourceVersion"
        );
        obj.metadata.labels = Some([(PROJECT_LABEL.to_string(), "other".to_string())].into());
        assert!(label_patch(&obj).is_some(), "a wrong value is corrected");
        obj.metadata.labels = Some([(PROJECT_LABEL.to_string(), "PID-1".to_string())].into());
        assert_eq!(label_patch(&obj), None, "nothing to write");
        let long = ControllerRegistration::new("r", spec(&"x".repeat(64)));
        assert_eq!(label_patch(&long), None, "no label for a project id that cannot be one");
    }

    #[test]
    fn label_values() {
        assert!(is_label_value("PID-PGR01"));
        assert!(!is_label_value("has space"));
        assert!(!is_label_value(&"a".repeat(64)));
        assert!(!is_label_value("-lead"));
    }
}

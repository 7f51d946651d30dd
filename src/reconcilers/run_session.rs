//! RunSession reconciler: mirrors the identity into Postgres, revokes sessions when the
//! credential rotates or the resource goes, and projects the Redis lease into `status`.
//! It comes back at the lease's own expiry, so an expired lease shows `Offline` promptly
//! instead of at the next resync.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tracing::{info, warn};
use uuid::Uuid;

use super::{Context, ControllerError, FIELD_MANAGER, condition};
use crate::crd::{RunPhase, RunSession, RunSessionStatus};
use crate::run_registry::identity::{Identity, Mirror};
use crate::run_registry::projection::{self, Lease, SessionView};

pub const FINALIZER: &str = "prism.ntecdev.ai/revoke";
/// lastHeartbeat alone is written at most this often.
const HEARTBEAT_STATUS_RESOLUTION: i64 = 10;

fn identity_of(obj: &RunSession) -> Result<Identity, ControllerError> {
    let uid = obj.uid().ok_or(ControllerError::MissingField("metadata.uid"))?;
    Ok(Identity {
        id: Uuid::parse_str(&uid).map_err(|_| ControllerError::MissingField("metadata.uid"))?,
        namespace: obj.namespace().ok_or(ControllerError::MissingField("metadata.namespace"))?,
        name: obj.name_any(),
        server_instance_id: obj.spec.server_instance_id.clone(),
        component_kind: obj.spec.component_kind.clone(),
        public_key: obj.spec.credential.public_key.clone(),
        key_generation: obj.spec.credential.generation,
        lease_seconds: obj.spec.lease_seconds,
    })
}

pub async fn reconcile(obj: Arc<RunSession>, ctx: Arc<Context>) -> Result<Action, ControllerError> {
    let ns = obj.namespace().ok_or(ControllerError::MissingField("metadata.namespace"))?;
    let api: Api<RunSession> = Api::namespaced(ctx.client.clone(), &ns);
    let started = std::time::Instant::now();
    let result = finalizer(&api, FINALIZER, obj, |event| async {
        match event {
            Finalizer::Apply(obj) => apply(&obj, &api, &ctx).await,
            Finalizer::Cleanup(obj) => cleanup(&obj, &ctx).await,
        }
    })
    .await
    .map_err(|e| ControllerError::Finalizer(Box::new(e)));
    ctx.metrics.reconciled("runsession", started.elapsed(), result.is_err());
    result
}

async fn apply(obj: &RunSession, api: &Api<RunSession>, ctx: &Context) -> Result<Action, ControllerError> {
    let identity = identity_of(obj)?;
    let address = identity.address();
    let previous = ctx.written_runsessions.previous(obj.uid().as_deref(), obj.status.as_ref()).unwrap_or_default();
    let now = Utc::now();
    let generation = obj.metadata.generation;

    let (next, requeue) = match ctx.runtime.identities.mirror(&identity).await? {
        Mirror::Duplicate { owner_namespace, owner_name } => {
            let msg = format!(
                "{}/{} is already claimed by RunSession {owner_namespace}/{owner_name}; this one is not used",
                identity.server_instance_id, identity.component_kind
            );
            (duplicate_status(&previous, generation, &msg, now), Duration::from_secs(30))
        }
        Mirror::Owned { rotated } => {
            let credential_rotated = rotated && revoke_session(ctx, obj, &address).await;
            let lease_len = Duration::from_secs(u64::from(ctx.runtime.lease_seconds(&identity)));
            let shown = SessionView::shown_in(&previous);
            let (view, requeue) = match ctx.runtime.sessions.session(&address).await {
                Ok(session) => {
                    // A session opened with an older key does not count.
                    let session = session.filter(|s| s.generation == identity.key_generation);
                    match &session {
                        // Come back right after the lease would end.
                        Some(s) => (
                            projection::project(Lease::Held(s), &shown),
                            s.lease_left.min(lease_len) + Duration::from_millis(250),
                        ),
                        None => (projection::project(Lease::Absent { credential_rotated }, &shown), lease_len),
                    }
                }
                Err(e) if e.registry_unavailable() => {
                    warn!(name = %obj.name_any(), error = %e, "Redis unavailable; RunSession shown Unavailable");
                    (projection::project(Lease::RegistryDown, &shown), Duration::from_secs(5))
                }
                Err(e) => return Err(e.into()),
            };
            (status_of(view, &previous, generation, now), requeue)
        }
    };
    if needs_write(&previous, &next) {
        let patch = json!({"apiVersion": "prism.ntecdev.ai/v1alpha1", "kind": "RunSession", "status": next});
        api.patch_status(&obj.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
        ctx.written_runsessions.wrote(obj.uid().as_deref(), next.clone());
    }
    if previous.phase != next.phase {
        let (type_, reason, note) = match next.phase {
            RunPhase::Online => (
                EventType::Normal,
                "Online",
                format!("session started, version {}", next.version.clone().unwrap_or_default()),
            ),
            RunPhase::Offline => {
                let reason = next.unavailable_reason.map(|r| r.as_str()).unwrap_or("none");
                (EventType::Normal, "Offline", format!("offline: {reason}"))
            }
            RunPhase::Unavailable => {
                (EventType::Warning, "Unavailable", "runtime registry (Redis) unavailable".to_string())
            }
            RunPhase::Pending => {
                (EventType::Warning, "DuplicateIdentity", "identity claimed by another RunSession".to_string())
            }
        };
        let event =
            KubeEvent { type_, reason: reason.into(), note: Some(note), action: "Observe".into(), secondary: None };
        if let Err(e) = ctx.recorder.publish(&event, &obj.object_ref(&())).await {
            warn!(name = %obj.name_any(), error = %e, "could not record an Event");
        }
    }
    Ok(Action::requeue(requeue))
}

/// Ends the live session after a credential rotation; true when there was one. A
/// failure is logged and leaves the reason unchanged: the old key no longer proves
/// possession anyway, and the lease runs out on its own.
async fn revoke_session(ctx: &Context, obj: &RunSession, address: &crate::run_registry::RunAddress) -> bool {
    match ctx.runtime.sessions.revoke(address).await {
        Ok(revoked) => {
            if revoked {
                info!(name = %obj.name_any(), "credential rotated; live session revoked");
            }
            revoked
        }
        Err(error) => {
            warn!(name = %obj.name_any(), %error, "credential rotated; could not revoke the live session now");
            false
        }
    }
}

/// Deleting the resource revokes the identity: the live session stops being accepted.
/// Its queued jobs stay queued (they are durable, and addressed to the identity).
async fn cleanup(obj: &RunSession, ctx: &Context) -> Result<Action, ControllerError> {
    let identity = identity_of(obj)?;
    if ctx.runtime.identities.revoke(identity.id).await? {
        ctx.runtime.sessions.revoke(&identity.address()).await?;
        info!(name = %obj.name_any(), "RunSession deleted; identity revoked");
    }
    Ok(Action::await_change())
}

/// A RunSession's status from the projection (pure): the projection's facts plus the
/// Ready and Online conditions.
pub fn status_of(
    view: SessionView,
    previous: &RunSessionStatus,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> RunSessionStatus {
    let (reason, message) = match (view.phase, view.unavailable_reason) {
        (RunPhase::Online, _) => ("LeaseHeld", "session lease held".to_string()),
        (RunPhase::Pending, _) => ("NeverConnected", "never connected".to_string()),
        (RunPhase::Unavailable, _) => ("RegistryUnavailable", "runtime registry (Redis) unavailable".to_string()),
        (RunPhase::Offline, r) => {
            ("LeaseExpired", format!("no session lease ({})", r.map(|r| r.as_str()).unwrap_or("none")))
        }
    };
    let online = view.online;
    RunSessionStatus {
        observed_generation: generation,
        conditions: identity_conditions(previous, online, reason, &message, generation, now),
        ..view.into_status()
    }
}

/// Ready (the identity is registered) and Online with the given state.
fn identity_conditions(
    previous: &RunSessionStatus,
    online: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    vec![
        condition(&previous.conditions, "Ready", true, "Identity", "identity registered", generation, now),
        condition(&previous.conditions, "Online", online, reason, message, generation, now),
    ]
}

fn duplicate_status(
    previous: &RunSessionStatus,
    generation: Option<i64>,
    msg: &str,
    now: DateTime<Utc>,
) -> RunSessionStatus {
    RunSessionStatus {
        phase: RunPhase::Pending,
        observed_generation: generation,
        conditions: vec![condition(&previous.conditions, "Ready", false, "DuplicateIdentity", msg, generation, now)],
        ..Default::default()
    }
}

fn needs_write(previous: &RunSessionStatus, next: &RunSessionStatus) -> bool {
    let secs = |t: &Option<Time>| t.as_ref().map(|t| t.0.as_second());
    let beat_moved = match (secs(&previous.last_heartbeat), secs(&next.last_heartbeat)) {
        (Some(a), Some(b)) => (b - a).abs() >= HEARTBEAT_STATUS_RESOLUTION,
        (a, b) => a != b,
    };
    let strip = |s: &RunSessionStatus| RunSessionStatus { last_heartbeat: None, ..s.clone() };
    beat_moved || strip(previous) != strip(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_follow_the_phase() {
        let now = Utc::now();
        let online = SessionView { phase: RunPhase::Online, online: true, ..Default::default() };
        let status = status_of(online, &Default::default(), Some(2), now);
        let cond = |s: &RunSessionStatus, t: &str| {
            s.conditions.iter().find(|c| c.type_ == t).map(|c| (c.status.clone(), c.reason.clone()))
        };
        assert_eq!(cond(&status, "Online"), Some(("True".into(), "LeaseHeld".into())));
        assert_eq!(cond(&status, "Ready"), Some(("True".into(), "Identity".into())));
        assert_eq!(status.observed_generation, Some(2));
        let offline = SessionView {
            phase: RunPhase::Offline,
            unavailable_reason: Some(crate::crd::UnavailableReason::LeaseExpired),
            ..Default::default()
        };
        let status = status_of(offline, &status, Some(2), now);
        assert_eq!(cond(&status, "Online"), Some(("False".into(), "LeaseExpired".into())));
        let msg = status.conditions.iter().find(|c| c.type_ == "Online").map(|c| c.message.clone());
        assert_eq!(msg.as_deref(), Some("no session lease (lease_expired)"));
    }
}

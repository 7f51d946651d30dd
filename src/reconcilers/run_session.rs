//! RunSession reconciler: mirrors the identity into Postgres, revokes sessions when the
//! credential rotates or the resource goes, and projects the Redis lease into `status`.
//! It comes back at the lease's own expiry, so an expired lease shows `Offline` promptly
//! instead of at the next resync.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use tracing::{info, warn};
use uuid::Uuid;

use super::status::{ObservedStatus, StatusEvent, write_status};
use super::{Context, ControllerError, Reconciled, condition, to_time};
use crate::crd::{RunPhase, RunSession, RunSessionStatus, RunTarget, UnavailableReason};
use crate::run_registry::identity::{Identity, Mirror};
use crate::run_registry::{RuntimeError, Session};

pub const FINALIZER: &str = "prism.ntecdev.ai/revoke";
/// A RunSession's `status.lastHeartbeat` alone is written at most this often.
pub const RUNSESSION_HEARTBEAT_RESOLUTION: Duration = Duration::from_secs(10);

impl Reconciled for RunSession {
    const FINALIZER: &'static str = FINALIZER;
    const METRIC: &'static str = "runsession";

    async fn apply(obj: Arc<Self>, api: &Api<Self>, ctx: &Context) -> Result<Action, ControllerError> {
        apply(&obj, api, ctx).await
    }

    async fn cleanup(obj: Arc<Self>, ctx: &Context) -> Result<Action, ControllerError> {
        cleanup(&obj, ctx).await
    }
}

impl ObservedStatus for RunSessionStatus {
    const HEARTBEAT_RESOLUTION: Duration = RUNSESSION_HEARTBEAT_RESOLUTION;
    const EVENT_ACTION: &'static str = "Observe";

    fn last_heartbeat(&self) -> Option<&Time> {
        self.last_heartbeat.as_ref()
    }

    fn stable(&self) -> Self {
        RunSessionStatus { last_heartbeat: None, ..self.clone() }
    }

    fn event(previous: &Self, next: &Self) -> Option<StatusEvent> {
        phase_event(previous, next)
    }
}

impl From<RuntimeError> for ControllerError {
    fn from(e: RuntimeError) -> Self {
        ControllerError::Runtime(e)
    }
}

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

async fn apply(obj: &RunSession, api: &Api<RunSession>, ctx: &Context) -> Result<Action, ControllerError> {
    let identity = identity_of(obj)?;
    let target = identity.target();
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
            let mut rotated_now = false;
            if rotated {
                // Raising the generation revokes every older key, and the session it opened.
                rotated_now = ctx.runtime.redis.revoke(&target).await.unwrap_or(false);
                info!("credential rotated; live session revoked");
            }
            let lease = Duration::from_secs(u64::from(ctx.runtime.lease_seconds(&identity)));
            match ctx.runtime.redis.session(&target).await {
                Ok(session) => {
                    // A session opened with an older key does not count.
                    let session = session.filter(|s| s.generation == identity.key_generation);
                    let requeue = match &session {
                        // Come back right after the lease would end.
                        Some(s) => Duration::from_millis(s.ttl_ms.clamp(0, lease.as_millis() as i64) as u64 + 250),
                        None => lease,
                    };
                    (project(session.as_ref(), &previous, rotated_now, generation, now), requeue)
                }
                Err(e) => {
                    warn!(error = %e, "Redis unavailable; RunSession shown Unavailable");
                    (unavailable(&previous, generation, now), Duration::from_secs(5))
                }
            }
        }
    };
    write_status(api, &ctx.recorder, &ctx.written_runsessions, obj, &previous, &next).await?;
    Ok(Action::requeue(requeue))
}

/// Deleting the resource revokes the identity: the live session stops being accepted.
/// Its queued jobs stay queued (they are durable, and addressed to the identity).
async fn cleanup(obj: &RunSession, ctx: &Context) -> Result<Action, ControllerError> {
    let identity = identity_of(obj)?;
    if ctx.runtime.identities.revoke(identity.id).await? {
        ctx.runtime.redis.revoke(&identity.target()).await?;
        info!("RunSession deleted; identity revoked");
    }
    Ok(Action::await_change())
}

fn reason_str(r: Option<UnavailableReason>) -> &'static str {
    match r {
        Some(UnavailableReason::RedisUnavailable) => "redis_unavailable",
        Some(UnavailableReason::LeaseExpired) => "lease_expired",
        Some(UnavailableReason::Superseded) => "superseded",
        Some(UnavailableReason::CredentialRotated) => "credential_rotated",
        None => "none",
    }
}

fn ms_time(ms: i64) -> Option<Time> {
    DateTime::<Utc>::from_timestamp_millis(ms).map(to_time)
}

/// The safe projection of a session into status (pure): never a token, hash, key name or
/// credential — only what a platform engineer needs to see.
pub fn project(
    session: Option<&Session>,
    previous: &RunSessionStatus,
    credential_rotated: bool,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> RunSessionStatus {
    match session {
        Some(s) => {
            let target: Option<RunTarget> = serde_json::from_str::<serde_json::Value>(&s.target).ok().and_then(|v| {
                Some(RunTarget { os: v.get("os")?.as_str()?.into(), arch: v.get("arch")?.as_str()?.into() })
            });
            RunSessionStatus {
                phase: RunPhase::Online,
                online: true,
                last_heartbeat: ms_time(s.last_heartbeat_ms),
                session_started_at: ms_time(s.started_at_ms),
                version: (!s.version.is_empty()).then(|| s.version.clone()),
                target,
                capabilities: serde_json::from_str(&s.capabilities).unwrap_or_default(),
                capacity: serde_json::from_str(&s.capacity).unwrap_or_default(),
                unavailable_reason: None,
                observed_generation: generation,
                conditions: identity_conditions(previous, true, "LeaseHeld", "session lease held", generation, now),
            }
        }
        None => {
            let ever = previous.last_heartbeat.is_some() || previous.session_started_at.is_some();
            let reason = if credential_rotated {
                Some(UnavailableReason::CredentialRotated)
            } else if !ever {
                None
            } else {
                match previous.unavailable_reason {
                    Some(r @ (UnavailableReason::CredentialRotated | UnavailableReason::Superseded))
                        if previous.phase == RunPhase::Offline =>
                    {
                        Some(r)
                    }
                    _ => Some(UnavailableReason::LeaseExpired),
                }
            };
            let phase = if ever || credential_rotated { RunPhase::Offline } else { RunPhase::Pending };
            let msg = match phase {
                RunPhase::Pending => "never connected".to_string(),
                _ => format!("no session lease ({})", reason_str(reason)),
            };
            let online_reason = if ever { "LeaseExpired" } else { "NeverConnected" };
            RunSessionStatus {
                phase,
                online: false,
                unavailable_reason: reason,
                observed_generation: generation,
                conditions: identity_conditions(previous, false, online_reason, &msg, generation, now),
                // The last known facts stay visible while offline.
                ..previous.clone()
            }
        }
    }
}

fn unavailable(previous: &RunSessionStatus, generation: Option<i64>, now: DateTime<Utc>) -> RunSessionStatus {
    RunSessionStatus {
        phase: RunPhase::Unavailable,
        online: false,
        unavailable_reason: Some(UnavailableReason::RedisUnavailable),
        observed_generation: generation,
        conditions: identity_conditions(
            previous,
            false,
            "RegistryUnavailable",
            "runtime registry (Redis) unavailable",
            generation,
            now,
        ),
        ..previous.clone()
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

/// The Event for a change of phase, if the phase changed.
pub fn phase_event(previous: &RunSessionStatus, next: &RunSessionStatus) -> Option<StatusEvent> {
    if previous.phase == next.phase {
        return None;
    }
    Some(match next.phase {
        RunPhase::Online => (
            EventType::Normal,
            "Online",
            format!("session started, version {}", next.version.clone().unwrap_or_default()),
        ),
        RunPhase::Offline => {
            (EventType::Normal, "Offline", format!("offline: {}", reason_str(next.unavailable_reason)))
        }
        RunPhase::Unavailable => {
            (EventType::Warning, "Unavailable", "runtime registry (Redis) unavailable".to_string())
        }
        RunPhase::Pending => {
            (EventType::Warning, "DuplicateIdentity", "identity claimed by another RunSession".to_string())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcilers::status::needs_write;

    fn session() -> Session {
        Session {
            session_id: "s".into(),
            generation: 1,
            started_at_ms: 1_700_000_000_000,
            last_heartbeat_ms: 1_700_000_005_000,
            version: "1.4.2".into(),
            target: r#"{"os":"linux","arch":"amd64"}"#.into(),
            capabilities: r#"["lifecycle","config"]"#.into(),
            capacity: r#"{"slots":4}"#.into(),
            ttl_ms: 20_000,
        }
    }

    #[test]
    fn online_offline_and_pending() {
        let now = Utc::now();
        let pending = project(None, &Default::default(), false, Some(1), now);
        assert_eq!((pending.phase, pending.online, pending.unavailable_reason), (RunPhase::Pending, false, None));
        let online = project(Some(&session()), &pending, false, Some(1), now);
        assert_eq!(online.phase, RunPhase::Online);
        assert_eq!(online.version.as_deref(), Some("1.4.2"));
        assert_eq!(online.capacity.get("slots"), Some(&4));
        assert_eq!(online.target, Some(RunTarget { os: "linux".into(), arch: "amd64".into() }));
        let offline = project(None, &online, false, Some(1), now);
        assert_eq!(
            (offline.phase, offline.unavailable_reason),
            (RunPhase::Offline, Some(UnavailableReason::LeaseExpired))
        );
        assert_eq!(offline.version.as_deref(), Some("1.4.2"), "last known facts stay");
        let rotated = project(None, &online, true, Some(2), now);
        assert_eq!(rotated.unavailable_reason, Some(UnavailableReason::CredentialRotated));
        let still = project(None, &rotated, false, Some(2), now);
        assert_eq!(
            still.unavailable_reason,
            Some(UnavailableReason::CredentialRotated),
            "the reason sticks while offline"
        );
    }

    #[test]
    fn heartbeat_alone_is_written_at_most_every_10_seconds() {
        let now = Utc::now();
        let first = project(Some(&session()), &Default::default(), false, Some(1), now);
        let beaten = |ms: i64| {
            let mut s = session();
            s.last_heartbeat_ms += ms;
            project(Some(&s), &first, false, Some(1), now)
        };
        assert!(!needs_write(&first, &beaten(5_000)));
        assert!(needs_write(&first, &beaten(10_000)));
        assert!(phase_event(&first, &beaten(10_000)).is_none(), "no Event without a change of phase");
        let offline = project(None, &first, false, Some(1), now);
        assert_eq!(phase_event(&first, &offline).map(|e| e.1), Some("Offline"));
    }

    #[test]
    fn status_never_carries_secrets() {
        let text = serde_json::to_string(&project(Some(&session()), &Default::default(), false, Some(1), Utc::now()))
            .expect("json");
        for secret in ["token", "hash", "prism:", "publicKey", "private"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
    }
}

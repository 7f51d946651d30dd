//! RunSession reconciler: mirrors the identity into Postgres, revokes sessions when the
//! credential rotates or the resource goes, and projects the Redis lease into `status`.
//! It comes back at the lease's own expiry, so an expired lease shows `Offline` promptly
//! instead of at the next resync.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use tracing::{info, warn};
use uuid::Uuid;

use super::events::StatusEvent;
use super::status::{ObservedStatus, write_status};
use super::{Context, ControllerError, Reconciled, condition};
use crate::crd::{RunPhase, RunSession, RunSessionStatus};
use crate::projection::{self, Drain, Lease, SessionView};
use prism_core::run::{Fenced, IdentitySpec, Mirror, REVOKED_EPOCH_TTL};
use prism_core::store::{Elections, Failure, Runs};

pub const FINALIZER: &str = "prism.ntecdev.ai/revoke";

/// Its usual text: the fields, values, reasons and messages this reconciler writes, in
/// the order they are serialized (see `packed`).
impl super::packed::Packable for RunSession {
    const DICTIONARY: &'static [u8] = br#"{"apiVersion":"prism.ntecdev.ai/v1alpha1","kind":"RunSession","metadata":{"labels":{"prism.ntecdev.ai/"}},"spec":{"serverInstanceId":"","componentKind":"run","credential":{"publicKey":"","generation":1},"leaseSeconds":30,"paused":true},"status":{"phase":"Offline","online":false,"lastHeartbeat":"2026-12-05T00:00:00Z","sessionStartedAt":"2026-12-05T00:00:00Z","version":"1.0.0","target":{"os":"linux","arch":"amd64"},"capabilities":["lifecycle","jobs"],"capacity":{"slots":1},"unavailableReason":"lease_expired","observedGeneration":1,"conditions":[{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"identity registered","observedGeneration":1,"reason":"Identity","status":"True","type":"Ready"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"no session lease (lease_expired)","observedGeneration":1,"reason":"LeaseExpired","status":"False","type":"Online"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"spec.paused: the platform cordoned this Run; its claims hand out no new job, jobs in flight finish","observedGeneration":1,"reason":"Paused","status":"True","type":"Draining"}]}}
{"status":{"phase":"Pending","online":false,"observedGeneration":1,"conditions":[{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"identity registered","observedGeneration":1,"reason":"Identity","status":"True","type":"Ready"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"never connected","observedGeneration":1,"reason":"NeverConnected","status":"False","type":"Online"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"the Run said it is draining (its graceful stop); its claims hand out no new job, jobs in flight finish","observedGeneration":1,"reason":"RunDraining","status":"True","type":"Draining"},{"message":"runtime registry (Redis) unavailable","reason":"RegistryUnavailable","type":"Online","phase":"Unavailable","unavailableReason":"redis_unavailable"},{"message":" is already claimed by RunSession ; this one is not used","reason":"DuplicateIdentity"},{"message":" is already claimed by a RunSession of another namespace; this one is not used"},{"message":" was taken over by a later RunSession of this name; this one is not used","reason":"IdentityRevoked","unavailableReason":"superseded","credential_rotated"}]}}
{"apiVersion":"prism.ntecdev.ai/v1alpha1","kind":"RunSession","metadata":{},"spec":{"serverInstanceId":"","componentKind":"run","credential":{"publicKey":"","generation":1}},"status":{"phase":"Online","online":true,"lastHeartbeat":"2026-12-05T00:00:00Z","sessionStartedAt":"2026-12-05T00:00:00Z","version":"1.0.0","capabilities":["lifecycle"],"capacity":{"slots":1},"observedGeneration":1,"conditions":[{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"identity registered","observedGeneration":1,"reason":"Identity","status":"True","type":"Ready"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"session lease held","observedGeneration":1,"reason":"LeaseHeld","status":"True","type":"Online"},{"lastTransitionTime":"2026-12-05T00:00:00Z","message":"claims hand out jobs: not paused, and the Run has not said it is draining","observedGeneration":1,"reason":"NotDraining","status":"False","type":"Draining"}]}}"#;
}

impl Reconciled for RunSession {
    const FINALIZER: &'static str = FINALIZER;
    const METRIC: &'static str = "runsession";

    async fn apply<E: Elections, R: Runs>(
        obj: Arc<Self>,
        api: &Api<Self>,
        ctx: &Context<E, R>,
    ) -> Result<Action, ControllerError> {
        apply(&obj, api, ctx).await
    }

    async fn cleanup<E: Elections, R: Runs>(obj: Arc<Self>, ctx: &Context<E, R>) -> Result<Action, ControllerError> {
        cleanup(&obj, ctx).await
    }
}

impl ObservedStatus for RunSessionStatus {
    const EVENT_ACTION: &'static str = "Observe";

    fn last_heartbeat(&self) -> Option<&Time> {
        self.last_heartbeat.as_ref()
    }

    fn stable(&self) -> Self {
        RunSessionStatus { last_heartbeat: None, ..self.clone() }
    }

    fn events(previous: &Self, next: &Self) -> Vec<StatusEvent> {
        status_events(previous, next)
    }
}

pub(crate) fn identity_of(obj: &RunSession) -> Result<IdentitySpec, ControllerError> {
    let uid = obj.uid().ok_or(ControllerError::MissingField("metadata.uid"))?;
    Ok(IdentitySpec {
        id: Uuid::parse_str(&uid).map_err(|_| ControllerError::MissingField("metadata.uid"))?,
        namespace: obj.namespace().ok_or(ControllerError::MissingField("metadata.namespace"))?,
        name: obj.name_any(),
        server_instance_id: obj.spec.server_instance_id.clone(),
        component_kind: obj.spec.component_kind.clone(),
        public_key: obj.spec.credential.public_key.clone(),
        key_generation: obj.spec.credential.generation,
        lease_seconds: obj.spec.lease_seconds,
        paused: obj.spec.paused,
    })
}

/// How long an identity mirrored unchanged is not read again (`MirrorMemo`).
pub const MIRROR_MEMO_TTL: Duration = prism_core::store::UNNOTIFIED_CHANGE_BOUND;

/// The identities this replica mirrored and owns, with their epoch. A live Run's
/// RunSession is reconciled once a lease, and each reconcile read its identity row to
/// find it unchanged, a row that only this reconcile (a spec change) and the finalizer
/// (a revocation) change. (Issue 23 estimated ~330 reads a second at 10,000 Runs; the
/// scale bench's steady window at 2,500 showed almost none before this memo either, so
/// what it saves is a read per reconcile in bursts, such as every RunSession after a
/// Redis outage: BENCHMARKS.md.) A spec equal to the one mirrored is taken as mirrored, for at most
/// `MIRROR_MEMO_TTL`: that bounds how long a row changed behind the operator's back (a
/// database restored from a backup) goes unseen. The Redis fence still runs every
/// reconcile, so revocation stays level-triggered. An entry keeps a keyed hash of the
/// spec, not the spec (16 bytes, not ~300, per Run): the key is random per process, so
/// nobody can make a changed spec hash as the one mirrored.
#[derive(Clone)]
pub struct MirrorMemo {
    mirrored: moka::sync::Cache<Uuid, (u64, i64)>,
    hasher: std::hash::RandomState,
}

impl MirrorMemo {
    pub fn new(capacity: u64, ttl: Duration) -> Self {
        let mirrored = moka::sync::Cache::builder().max_capacity(capacity).time_to_live(ttl).build();
        Self { mirrored, hasher: std::hash::RandomState::new() }
    }

    /// The epoch of `identity` if it was mirrored, exactly as it is now, within the TTL.
    fn epoch(&self, identity: &IdentitySpec) -> Option<i64> {
        let digest = self.hasher.hash_one(identity);
        self.mirrored.get(&identity.id).filter(|(d, _)| *d == digest).map(|(_, epoch)| epoch)
    }

    fn note(&self, identity: &IdentitySpec, epoch: i64) {
        self.mirrored.insert(identity.id, (self.hasher.hash_one(identity), epoch));
    }

    fn forget(&self, id: Uuid) {
        self.mirrored.invalidate(&id);
    }
}

/// What a duplicate's status says of the resource that holds its identity: its name when
/// it is of the same namespace, and nothing of it when it is another tenant's.
pub fn duplicate_message(identity: &IdentitySpec, owner_namespace: &str, owner_name: &str) -> String {
    let address = identity.address();
    if owner_namespace == identity.namespace {
        format!("{address} is already claimed by RunSession {owner_name}; this one is not used")
    } else {
        format!("{address} is already claimed by a RunSession of another namespace; this one is not used")
    }
}

async fn apply<E: Elections, R: Runs>(
    obj: &RunSession,
    api: &Api<RunSession>,
    ctx: &Context<E, R>,
) -> Result<Action, ControllerError> {
    let identity = identity_of(obj)?;
    let address = identity.address();
    let previous = ctx.written_runsessions.previous(obj.uid().as_deref(), obj.status.as_ref()).unwrap_or_default();
    let now = Utc::now();
    let generation = obj.metadata.generation;

    let mirrored = match ctx.mirrored.epoch(&identity) {
        Some(epoch) => Mirror::Owned { rotated: false, epoch },
        None => {
            let mirrored = ctx.registry.mirror(&identity).await.map_err(ControllerError::registry)?;
            if let Mirror::Owned { epoch, .. } = mirrored {
                ctx.mirrored.note(&identity, epoch);
            }
            mirrored
        }
    };
    let (next, requeue) = match mirrored {
        Mirror::Duplicate { owner_namespace, owner_name } => {
            let msg = duplicate_message(&identity, &owner_namespace, &owner_name);
            (duplicate_status(&previous, generation, "DuplicateIdentity", &msg, now), Duration::from_secs(30))
        }
        Mirror::Revoked => {
            let msg = format!("{address} was taken over by a later RunSession of this name; this one is not used");
            (duplicate_status(&previous, generation, "IdentityRevoked", &msg, now), Duration::from_secs(300))
        }
        Mirror::Owned { rotated, epoch } => {
            if rotated {
                ctx.fences_owed.insert(identity.id, ());
            }
            let lease_len = Duration::from_secs(u64::from(ctx.registry.lease_seconds(identity.lease_seconds)));
            let shown = SessionView::shown_in(&previous);
            // Every reconcile fences the address to the identity's epoch (level-triggered
            // revocation, SPEC §12): a session of an older key is ended here, even when
            // the write that should have ended it failed before, or a hello raced the
            // rotation.
            let (view, requeue) = match ctx.registry.fence(&address, epoch).await {
                Ok(fenced) => {
                    ctx.fences_owed.invalidate(&identity.id);
                    match &fenced {
                        // Come back right after the lease would end.
                        Fenced::Live(s) => (
                            projection::project(Lease::Held(s), identity.paused, &shown),
                            s.lease_left.min(lease_len) + Duration::from_millis(250),
                        ),
                        Fenced::Absent => {
                            let lease = Lease::Absent { credential_rotated: false };
                            (projection::project(lease, identity.paused, &shown), lease_len)
                        }
                        Fenced::Revoked => {
                            info!(name = %obj.name_any(), "credential rotated; the older key's session ended");
                            let lease = Lease::Absent { credential_rotated: true };
                            (projection::project(lease, identity.paused, &shown), lease_len)
                        }
                    }
                }
                Err(e) if e.unavailable() => {
                    warn!(name = %obj.name_any(), error = %e, "Redis unavailable; RunSession shown Unavailable");
                    // A fence owed (the key was just rotated) is tried again at once: the
                    // old key's session must end within seconds of the rotation.
                    let owed = ctx.fences_owed.contains_key(&identity.id);
                    let retry = if owed { Duration::from_secs(1) } else { Duration::from_secs(5) };
                    (projection::project(Lease::RegistryDown, identity.paused, &shown), retry)
                }
                Err(e) => return Err(ControllerError::registry(e)),
            };
            (status_of(view, &previous, generation, now), requeue)
        }
    };
    write_status(api, &ctx.events, &ctx.written_runsessions, obj, &previous, &next).await?;
    Ok(Action::requeue(requeue))
}

/// Deleting the resource revokes the identity (a new epoch), cancels the jobs of its
/// namespace it left unfinished (`identity_deleted`: nobody may run them now), and fences
/// Redis to the revoked epoch, which ends its session. Every step is repeated until all
/// succeed: the finalizer stays until then, so a failed Redis write is made again.
async fn cleanup<E: Elections, R: Runs>(obj: &RunSession, ctx: &Context<E, R>) -> Result<Action, ControllerError> {
    let identity = identity_of(obj)?;
    ctx.mirrored.forget(identity.id);
    // None: this resource never held the identity (a duplicate): nothing of it to undo.
    if let Some(cancelled) =
        ctx.registry.revoke(&identity, REVOKED_EPOCH_TTL).await.map_err(ControllerError::registry)?
    {
        info!(name = %obj.name_any(), jobs_cancelled = cancelled, "RunSession deleted; identity revoked, its session ended");
    }
    Ok(Action::await_change())
}

/// A RunSession's status from the projection (pure): the projection's facts plus the
/// Ready, Online and Draining conditions.
pub fn status_of(
    view: SessionView,
    previous: &RunSessionStatus,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> RunSessionStatus {
    let (reason, message) = match (view.phase, view.unavailable_reason) {
        (RunPhase::Online | RunPhase::Draining, _) => ("LeaseHeld", "session lease held".to_string()),
        (RunPhase::Pending, _) => ("NeverConnected", "never connected".to_string()),
        (RunPhase::Unavailable, _) => ("RegistryUnavailable", "runtime registry (Redis) unavailable".to_string()),
        (RunPhase::Offline, r) => {
            ("LeaseExpired", format!("no session lease ({})", r.map(|r| r.as_str()).unwrap_or("none")))
        }
    };
    let online = view.online;
    let mut conditions = identity_conditions(previous, online, reason, &message, generation, now);
    let (drained, reason, message) = match view.drain {
        Some(drain) => (true, drain.reason(), drain_message(drain)),
        None => (false, "NotDraining", "claims hand out jobs: not paused, and the Run has not said it is draining"),
    };
    conditions.push(condition(&previous.conditions, DRAINING, drained, reason, message, generation, now));
    RunSessionStatus { observed_generation: generation, conditions, ..view.into_status() }
}

/// The condition that says who drained a Run (SPEC §5.1).
pub const DRAINING: &str = "Draining";

fn drain_message(drain: Drain) -> &'static str {
    match drain {
        Drain::Paused => {
            "spec.paused: the platform cordoned this Run; its claims hand out no new job, jobs in flight finish"
        }
        Drain::RunDraining => {
            "the Run said it is draining (its graceful stop); its claims hand out no new job, jobs in flight finish"
        }
    }
}

/// Who drained the Run as `status` says it: the `Draining` condition's reason when True;
/// `Some(None)` when it says False, None when there is no such condition (a duplicate).
fn drain_shown(status: &RunSessionStatus) -> Option<Option<Drain>> {
    let c = status.conditions.iter().find(|c| c.type_ == DRAINING)?;
    Some(if c.status == "True" { SessionView::shown_in(status).drain } else { None })
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
    reason: &str,
    msg: &str,
    now: DateTime<Utc>,
) -> RunSessionStatus {
    RunSessionStatus {
        phase: RunPhase::Pending,
        observed_generation: generation,
        conditions: vec![condition(&previous.conditions, "Ready", false, reason, msg, generation, now)],
        ..Default::default()
    }
}

/// The Events of a change of status: one for a change of phase (Online and Draining are
/// one phase as far as the session goes), and `Draining` / `Resumed` when a drain starts
/// or ends (SPEC §5.1). A Run's own drain that ends with its session (the graceful stop
/// done) is no resumption: its `Offline` says it.
pub fn status_events(previous: &RunSessionStatus, next: &RunSessionStatus) -> Vec<StatusEvent> {
    let online = |phase| matches!(phase, RunPhase::Online | RunPhase::Draining);
    let mut events = Vec::new();
    if !(online(previous.phase) && online(next.phase)) {
        events.extend(phase_event(previous, next));
    }
    let was = drain_shown(previous).flatten();
    match (was, drain_shown(next)) {
        (None, Some(Some(drain))) => {
            let note = match drain {
                Drain::Paused => "paused: the platform cordoned it (spec.paused); no new job is handed out",
                Drain::RunDraining => "the Run is draining (its heartbeat said so); no new job is handed out",
            };
            events.push((EventType::Normal, "Draining", note.to_string()));
        }
        (Some(drain), Some(None)) if drain == Drain::Paused || online(next.phase) => {
            events.push((EventType::Normal, "Resumed", "no longer draining; claims hand out jobs again".to_string()));
        }
        _ => {}
    }
    events
}

/// The Event for a change of phase, if the phase changed.
pub fn phase_event(previous: &RunSessionStatus, next: &RunSessionStatus) -> Option<StatusEvent> {
    if previous.phase == next.phase && next.phase != RunPhase::Pending {
        return None;
    }
    Some(match next.phase {
        RunPhase::Online | RunPhase::Draining => (
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
        // Pending after a hello is never: a resource that is not used, said once per reason
        // (a new resource is Pending with nothing to say until it is).
        RunPhase::Pending => {
            let not_used = |s: &RunSessionStatus| {
                s.conditions.iter().find(|c| c.type_ == "Ready" && c.status == "False").map(|c| c.reason.clone())
            };
            let reason = not_used(next).filter(|r| not_used(previous).as_ref() != Some(r))?;
            match reason.as_str() {
                "DuplicateIdentity" => {
                    (EventType::Warning, "DuplicateIdentity", "identity claimed by another RunSession".to_string())
                }
                "IdentityRevoked" => (
                    EventType::Warning,
                    "IdentityRevoked",
                    "identity taken over by a later RunSession of this name".to_string(),
                ),
                _ => return None,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcilers::status::needs_write;
    use prism_core::run::Session;

    fn session() -> Session {
        Session {
            session_id: Uuid::nil(),
            generation: 1,
            epoch: 1,
            started_at: DateTime::from_timestamp_millis(1_700_000_000_000).expect("time"),
            last_heartbeat: DateTime::from_timestamp_millis(1_700_000_005_000).expect("time"),
            version: Some("1.4.2".into()),
            target: None,
            capabilities: vec!["lifecycle".into()],
            capacity: Default::default(),
            draining: false,
            lease_left: Duration::from_secs(20),
        }
    }

    fn status(lease: Lease<'_>, previous: &RunSessionStatus) -> RunSessionStatus {
        status_of(projection::project(lease, false, &SessionView::shown_in(previous)), previous, Some(1), Utc::now())
    }

    #[test]
    fn conditions_follow_the_phase() {
        let online = status(Lease::Held(&session()), &Default::default());
        let cond = |s: &RunSessionStatus, t: &str| {
            s.conditions.iter().find(|c| c.type_ == t).map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        };
        assert_eq!(cond(&online, "Online"), Some(("True".into(), "LeaseHeld".into(), "session lease held".into())));
        assert_eq!(cond(&online, "Ready").map(|c| c.1), Some("Identity".into()));
        assert_eq!(online.observed_generation, Some(1));
        let offline = status(Lease::Absent { credential_rotated: false }, &online);
        assert_eq!(
            cond(&offline, "Online"),
            Some(("False".into(), "LeaseExpired".into(), "no session lease (lease_expired)".into()))
        );
        let pending = status(Lease::Absent { credential_rotated: false }, &Default::default());
        assert_eq!(cond(&pending, "Online").map(|c| c.1), Some("NeverConnected".into()));
        let down = status(Lease::RegistryDown, &online);
        assert_eq!(cond(&down, "Online").map(|c| c.1), Some("RegistryUnavailable".into()));
    }

    fn drained(lease: Lease<'_>, paused: bool, previous: &RunSessionStatus) -> RunSessionStatus {
        status_of(projection::project(lease, paused, &SessionView::shown_in(previous)), previous, Some(2), Utc::now())
    }

    fn reasons(events: Vec<StatusEvent>) -> Vec<&'static str> {
        events.into_iter().map(|e| e.1).collect()
    }

    #[test]
    fn a_drain_is_a_phase_a_condition_and_one_event_each_way() {
        let cond = |s: &RunSessionStatus| {
            s.conditions.iter().find(|c| c.type_ == DRAINING).map(|c| (c.status.clone(), c.reason.clone()))
        };
        let online = status(Lease::Held(&session()), &Default::default());
        assert_eq!(cond(&online), Some(("False".into(), "NotDraining".into())));
        assert_eq!(reasons(status_events(&Default::default(), &online)), ["Online"]);

        // The platform's cordon.
        let paused = drained(Lease::Held(&session()), true, &online);
        assert_eq!((paused.phase, paused.online), (RunPhase::Draining, true));
        assert_eq!(cond(&paused), Some(("True".into(), "Paused".into())));
        let message = paused.conditions.iter().find(|c| c.type_ == DRAINING).map(|c| c.message.clone());
        assert!(message.is_some_and(|m| m.contains("cordoned")));
        assert_eq!(reasons(status_events(&online, &paused)), ["Draining"]);
        let again = drained(Lease::Held(&session()), true, &paused);
        assert!(status_events(&paused, &again).is_empty(), "once per transition, not per reconcile");
        let unpaused = drained(Lease::Held(&session()), false, &paused);
        assert_eq!(unpaused.phase, RunPhase::Online);
        assert_eq!(reasons(status_events(&paused, &unpaused)), ["Resumed"]);
        // A cordoned Run that goes offline stays cordoned; unpaused offline, it resumed.
        let absent = Lease::Absent { credential_rotated: false };
        let gone = drained(absent, true, &paused);
        assert_eq!((gone.phase, cond(&gone).map(|c| c.0)), (RunPhase::Offline, Some("True".into())));
        assert_eq!(reasons(status_events(&paused, &gone)), ["Offline"]);
        assert_eq!(reasons(status_events(&gone, &drained(absent, false, &gone))), ["Resumed"]);
        assert_eq!(reasons(status_events(&gone, &drained(Lease::Held(&session()), true, &gone))), ["Online"]);

        // The Run's own graceful stop: done when its session ends, which resumes nothing.
        let stopping = Session { draining: true, ..session() };
        let run = drained(Lease::Held(&stopping), false, &online);
        assert_eq!((run.phase, cond(&run)), (RunPhase::Draining, Some(("True".into(), "RunDraining".into()))));
        assert_eq!(reasons(status_events(&online, &run)), ["Draining"]);
        let stopped = drained(absent, false, &run);
        assert_eq!(cond(&stopped).map(|c| c.0), Some("False".into()));
        assert_eq!(reasons(status_events(&run, &stopped)), ["Offline"]);
        assert_eq!(reasons(status_events(&run, &drained(Lease::Held(&session()), false, &run))), ["Resumed"]);
        // Redis away and back: the drain neither ends nor starts again.
        let down = drained(Lease::RegistryDown, false, &run);
        assert_eq!(reasons(status_events(&run, &down)), ["Unavailable"]);
        assert_eq!(reasons(status_events(&down, &drained(Lease::Held(&stopping), false, &down))), ["Online"]);
    }

    #[test]
    fn a_status_read_back_from_the_api_server_is_not_rewritten() {
        // Redis keeps milliseconds; Kubernetes keeps seconds. The status as the API server
        // gives it back must compare equal to the same session's next projection.
        let mut s = session();
        s.started_at += chrono::Duration::milliseconds(123);
        s.last_heartbeat += chrono::Duration::milliseconds(456);
        let written = status(Lease::Held(&s), &Default::default());
        let read_back: RunSessionStatus =
            serde_json::from_value(serde_json::to_value(&written).expect("json")).expect("status");
        s.last_heartbeat += chrono::Duration::seconds(30);
        let next = status(Lease::Held(&s), &read_back);
        assert!(!needs_write(&read_back, &next, Duration::from_secs(120)), "{read_back:?}\n{next:?}");
    }

    #[test]
    fn heartbeat_alone_is_written_at_most_every_10_seconds() {
        let first = status(Lease::Held(&session()), &Default::default());
        let beaten = |ms: i64| {
            let mut s = session();
            s.last_heartbeat += chrono::Duration::milliseconds(ms);
            status(Lease::Held(&s), &first)
        };
        let every = Duration::from_secs(120);
        assert!(!needs_write(&first, &beaten(5_000), every));
        assert!(!needs_write(&first, &beaten(119_000), every));
        assert!(needs_write(&first, &beaten(120_000), every));
        assert!(phase_event(&first, &beaten(10_000)).is_none(), "no Event without a change of phase");
        let offline = status(Lease::Absent { credential_rotated: false }, &first);
        assert_eq!(phase_event(&first, &offline).map(|e| e.1), Some("Offline"));
    }
}

//! The safe projection of a Run's session (SPEC §1, §3.2): what `status` of a RunSession
//! and `GET /api/v1/runtime/servers/{id}/status` both show. One function decides it, so
//! the two never disagree: online from the Redis lease, otherwise the last known facts
//! with the reason the Run is not online. Never a token, hash, key name, credential, host
//! path or socket. Pure: no clock, no I/O.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::crd::{RunPhase, RunSessionStatus, RunTarget, UnavailableReason};
use crate::time::{from_k8s, to_k8s};
use prism_core::run::Session;

/// What can be said of an address's session right now.
#[derive(Clone, Copy, Debug)]
pub enum Lease<'a> {
    /// Redis holds a live lease opened with the current credential.
    Held(&'a Session),
    /// No live lease (expired, revoked, superseded, or Redis lost it).
    Absent {
        /// The credential was rotated just now, which revoked the session.
        credential_rotated: bool,
    },
    /// Redis cannot be asked.
    RegistryDown,
}

/// Who drained a Run (SPEC §5.1): its claims hand out no new job while one does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drain {
    /// spec.paused: the platform cordoned it.
    Paused,
    /// The Run's own heartbeat said it is draining (its graceful stop).
    RunDraining,
}

impl Drain {
    /// The reason of the `Draining` condition.
    pub fn reason(self) -> &'static str {
        match self {
            Drain::Paused => "Paused",
            Drain::RunDraining => "RunDraining",
        }
    }

    fn from_reason(reason: &str) -> Option<Drain> {
        [Drain::Paused, Drain::RunDraining].into_iter().find(|d| d.reason() == reason)
    }

    /// Who drains the address now: the cordon first (whether or not the Run is online),
    /// else the live session's word. While Redis cannot be asked, the Run's word is what
    /// was last shown (`last`): an outage neither starts nor ends its drain.
    pub fn of(paused: bool, lease: Lease<'_>, last: Option<Drain>) -> Option<Drain> {
        if paused {
            return Some(Drain::Paused);
        }
        match lease {
            Lease::Held(s) => s.draining.then_some(Drain::RunDraining),
            Lease::Absent { .. } => None,
            Lease::RegistryDown => last.filter(|d| *d == Drain::RunDraining),
        }
    }
}

/// The projection's fields (the JSON of the HTTP API uses these snake_case names).
#[derive(Clone, Debug, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct SessionView {
    pub phase: RunPhase,
    pub online: bool,
    pub last_heartbeat: Option<DateTime<Utc>>,
    pub session_started_at: Option<DateTime<Utc>>,
    pub version: Option<String>,
    pub target: Option<RunTarget>,
    pub capabilities: Vec<String>,
    pub capacity: BTreeMap<String, i64>,
    pub unavailable_reason: Option<UnavailableReason>,
    /// Who drains the Run, if anyone: phase `Draining` while it is online. Status says it
    /// in the `Draining` condition; the HTTP API by the phase alone.
    #[serde(skip)]
    pub drain: Option<Drain>,
}

/// The projection now, given the lease, the identity's `paused` and what was last shown
/// (`last`).
pub fn project(lease: Lease<'_>, paused: bool, last: &SessionView) -> SessionView {
    let drain = Drain::of(paused, lease, last.drain);
    match lease {
        Lease::Held(s) => SessionView {
            phase: if drain.is_some() { RunPhase::Draining } else { RunPhase::Online },
            online: true,
            last_heartbeat: Some(s.last_heartbeat),
            session_started_at: Some(s.started_at),
            version: s.version.clone(),
            target: s.target.clone(),
            capabilities: s.capabilities.clone(),
            capacity: s.capacity.clone(),
            unavailable_reason: None,
            drain,
        },
        Lease::RegistryDown => SessionView {
            phase: RunPhase::Unavailable,
            online: false,
            unavailable_reason: Some(UnavailableReason::RedisUnavailable),
            drain,
            // The last known facts stay visible.
            ..last.clone()
        },
        Lease::Absent { credential_rotated } => {
            let ever_connected = last.last_heartbeat.is_some() || last.session_started_at.is_some();
            let unavailable_reason = if credential_rotated {
                Some(UnavailableReason::CredentialRotated)
            } else if !ever_connected {
                None
            } else {
                match last.unavailable_reason {
                    // A revocation stays the reason for as long as the Run stays offline.
                    Some(r @ (UnavailableReason::CredentialRotated | UnavailableReason::Superseded))
                        if last.phase == RunPhase::Offline =>
                    {
                        Some(r)
                    }
                    _ => Some(UnavailableReason::LeaseExpired),
                }
            };
            let phase = if ever_connected || credential_rotated { RunPhase::Offline } else { RunPhase::Pending };
            SessionView { phase, online: false, unavailable_reason, drain, ..last.clone() }
        }
    }
}

impl SessionView {
    /// What a RunSession's status last showed.
    pub fn shown_in(status: &RunSessionStatus) -> Self {
        SessionView {
            phase: status.phase,
            online: status.online,
            last_heartbeat: status.last_heartbeat.as_ref().map(from_k8s),
            session_started_at: status.session_started_at.as_ref().map(from_k8s),
            version: status.version.clone(),
            target: status.target.clone(),
            capabilities: status.capabilities.clone(),
            capacity: status.capacity.clone(),
            unavailable_reason: status.unavailable_reason,
            drain: status
                .conditions
                .iter()
                .find(|c| c.type_ == "Draining" && c.status == "True")
                .and_then(|c| Drain::from_reason(&c.reason)),
        }
    }

    /// The projection's part of a RunSession status; the reconciler adds conditions (the
    /// `Draining` one says `drain`) and observedGeneration.
    pub fn into_status(self) -> RunSessionStatus {
        RunSessionStatus {
            phase: self.phase,
            online: self.online,
            last_heartbeat: self.last_heartbeat.map(to_k8s),
            session_started_at: self.session_started_at.map(to_k8s),
            version: self.version,
            target: self.target,
            capabilities: self.capabilities,
            capacity: self.capacity,
            unavailable_reason: self.unavailable_reason,
            observed_generation: None,
            conditions: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn session() -> Session {
        Session {
            session_id: uuid::Uuid::nil(),
            generation: 1,
            epoch: 1,
            started_at: DateTime::from_timestamp_millis(1_700_000_000_000).expect("time"),
            last_heartbeat: DateTime::from_timestamp_millis(1_700_000_005_000).expect("time"),
            version: Some("1.4.2".into()),
            target: Some(RunTarget { os: "linux".into(), arch: "amd64".into() }),
            capabilities: vec!["lifecycle".into(), "config".into()],
            capacity: [("slots".to_string(), 4)].into(),
            draining: false,
            lease_left: Duration::from_secs(20),
        }
    }

    #[test]
    fn pending_online_offline_and_rotated() {
        let absent = Lease::Absent { credential_rotated: false };
        let pending = project(absent, false, &SessionView::default());
        assert_eq!((pending.phase, pending.online, pending.unavailable_reason), (RunPhase::Pending, false, None));
        let online = project(Lease::Held(&session()), false, &pending);
        assert_eq!((online.phase, online.online), (RunPhase::Online, true));
        assert_eq!(online.capacity.get("slots"), Some(&4));
        let offline = project(absent, false, &online);
        assert_eq!(
            (offline.phase, offline.unavailable_reason),
            (RunPhase::Offline, Some(UnavailableReason::LeaseExpired))
        );
        assert_eq!(offline.version.as_deref(), Some("1.4.2"), "last known facts stay");
        let rotated = project(Lease::Absent { credential_rotated: true }, false, &online);
        assert_eq!(rotated.unavailable_reason, Some(UnavailableReason::CredentialRotated));
        assert_eq!(
            project(absent, false, &rotated).unavailable_reason,
            Some(UnavailableReason::CredentialRotated),
            "sticks"
        );
        let down = project(Lease::RegistryDown, false, &online);
        assert_eq!(
            (down.phase, down.unavailable_reason),
            (RunPhase::Unavailable, Some(UnavailableReason::RedisUnavailable))
        );
        assert_eq!(project(absent, false, &down).phase, RunPhase::Offline, "back from an outage without a lease");
    }

    #[test]
    fn a_drained_run_is_draining_while_online_and_the_cordon_outlives_the_session() {
        let absent = Lease::Absent { credential_rotated: false };
        let online = project(Lease::Held(&session()), false, &SessionView::default());
        assert_eq!((online.phase, online.drain), (RunPhase::Online, None));
        // The platform's cordon: Draining while online, and still the reason once offline.
        let paused = project(Lease::Held(&session()), true, &online);
        assert_eq!((paused.phase, paused.online, paused.drain), (RunPhase::Draining, true, Some(Drain::Paused)));
        let gone = project(absent, true, &paused);
        assert_eq!((gone.phase, gone.drain), (RunPhase::Offline, Some(Drain::Paused)));
        assert_eq!(project(absent, true, &SessionView::default()).phase, RunPhase::Pending);
        // The Run's own word: only while its session lives; an outage keeps what was shown.
        let draining = Session { draining: true, ..session() };
        let run = project(Lease::Held(&draining), false, &online);
        assert_eq!((run.phase, run.drain), (RunPhase::Draining, Some(Drain::RunDraining)));
        assert_eq!(project(Lease::Held(&draining), true, &run).drain, Some(Drain::Paused), "the cordon first");
        let down = project(Lease::RegistryDown, false, &run);
        assert_eq!((down.phase, down.drain), (RunPhase::Unavailable, Some(Drain::RunDraining)));
        assert_eq!(project(Lease::RegistryDown, false, &paused).drain, None, "unpaused during the outage");
        assert_eq!(project(absent, false, &run).drain, None, "a session's drain ends with it");
        assert_eq!(project(Lease::Held(&session()), false, &run).phase, RunPhase::Online, "a new hello");
    }

    /// Status says who drained a Run (its condition); the HTTP API's projection says it
    /// by its phase alone, in its JSON and its schema.
    #[test]
    fn the_api_projection_carries_no_drain_field() {
        let schema = serde_json::to_value(<SessionView as utoipa::PartialSchema>::schema()).expect("schema");
        let properties = schema["properties"].as_object().expect("properties");
        assert!(properties.contains_key("phase") && !properties.contains_key("drain"), "{schema}");
        let view = SessionView { drain: Some(Drain::Paused), ..Default::default() };
        let json = serde_json::to_value(&view).expect("json");
        assert!(json.get("phase").is_some() && json.get("drain").is_none(), "{json}");
    }

    #[test]
    fn status_round_trip_keeps_every_shown_fact() {
        let online = project(Lease::Held(&session()), false, &SessionView::default());
        assert_eq!(SessionView::shown_in(&online.clone().into_status()), online);
    }

    #[test]
    fn the_projection_never_carries_secrets() {
        let text =
            serde_json::to_string(&project(Lease::Held(&session()), false, &SessionView::default())).expect("json");
        for secret in ["token", "hash", "prism:", "publicKey", "private"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
    }
}

//! The safe projection of a Run's session (SPEC §1, §3.2): what `status` of a RunSession
//! and `GET /api/v1/runtime/servers/{id}/status` both show. One function decides it, so
//! the two never disagree: online from the Redis lease, otherwise the last known facts
//! with the reason the Run is not online. Never a token, hash, key name, credential, host
//! path or socket. Pure: no clock, no I/O.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::Session;
use crate::crd::{RunPhase, RunSessionStatus, RunTarget, UnavailableReason};
use crate::time::{from_k8s, to_k8s};

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
}

/// The projection now, given the lease and what was last shown (`last`).
pub fn project(lease: Lease<'_>, last: &SessionView) -> SessionView {
    match lease {
        Lease::Held(s) => SessionView {
            phase: RunPhase::Online,
            online: true,
            last_heartbeat: Some(s.last_heartbeat),
            session_started_at: Some(s.started_at),
            version: s.version.clone(),
            target: s.target.clone(),
            capabilities: s.capabilities.clone(),
            capacity: s.capacity.clone(),
            unavailable_reason: None,
        },
        Lease::RegistryDown => SessionView {
            phase: RunPhase::Unavailable,
            online: false,
            unavailable_reason: Some(UnavailableReason::RedisUnavailable),
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
            SessionView { phase, online: false, unavailable_reason, ..last.clone() }
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
        }
    }

    /// The projection's part of a RunSession status; the reconciler adds conditions and
    /// observedGeneration.
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
            lease_left: Duration::from_secs(20),
        }
    }

    #[test]
    fn pending_online_offline_and_rotated() {
        let absent = Lease::Absent { credential_rotated: false };
        let pending = project(absent, &SessionView::default());
        assert_eq!((pending.phase, pending.online, pending.unavailable_reason), (RunPhase::Pending, false, None));
        let online = project(Lease::Held(&session()), &pending);
        assert_eq!((online.phase, online.online), (RunPhase::Online, true));
        assert_eq!(online.capacity.get("slots"), Some(&4));
        let offline = project(absent, &online);
        assert_eq!(
            (offline.phase, offline.unavailable_reason),
            (RunPhase::Offline, Some(UnavailableReason::LeaseExpired))
        );
        assert_eq!(offline.version.as_deref(), Some("1.4.2"), "last known facts stay");
        let rotated = project(Lease::Absent { credential_rotated: true }, &online);
        assert_eq!(rotated.unavailable_reason, Some(UnavailableReason::CredentialRotated));
        assert_eq!(project(absent, &rotated).unavailable_reason, Some(UnavailableReason::CredentialRotated), "sticks");
        let down = project(Lease::RegistryDown, &online);
        assert_eq!(
            (down.phase, down.unavailable_reason),
            (RunPhase::Unavailable, Some(UnavailableReason::RedisUnavailable))
        );
        assert_eq!(project(absent, &down).phase, RunPhase::Offline, "back from an outage without a lease");
    }

    #[test]
    fn status_round_trip_keeps_every_shown_fact() {
        let online = project(Lease::Held(&session()), &SessionView::default());
        assert_eq!(SessionView::shown_in(&online.clone().into_status()), online);
    }

    #[test]
    fn the_projection_never_carries_secrets() {
        let text = serde_json::to_string(&project(Lease::Held(&session()), &SessionView::default())).expect("json");
        for secret in ["token", "hash", "prism:", "publicKey", "private"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
    }
}

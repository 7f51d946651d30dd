//! A Run as the domain knows it (SPEC §3.2, §5): where it lives (its address), what its
//! RunSession says it is (its identity), its live session (a lease), and the values its
//! status is spelled in. Data only: the stores fill these in, the reconciler and the API
//! read them.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::text_enum;

/// Where a Run lives, and what its keys and jobs are addressed by: one server instance's
/// component. A live resource owns each address (SPEC §3.2).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunAddress {
    pub server_instance_id: String,
    pub component_kind: String,
}

impl std::fmt::Display for RunAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.server_instance_id, self.component_kind)
    }
}

// The platform a Run says it runs on (hello checks both; the OpenAPI schemas say the same).
// (A doc comment would become the CRD's description of `status.target`.)
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct RunTarget {
    #[cfg_attr(feature = "utoipa", schema(pattern = "^[A-Za-z0-9_]{1,32}$", example = "linux"))]
    pub os: String,
    #[cfg_attr(feature = "utoipa", schema(pattern = "^[A-Za-z0-9_]{1,32}$", example = "amd64"))]
    pub arch: String,
}

// A Run's phase, spelled as Kubernetes spells enum values (`kubectl get` shows it). (A doc
// comment would become the CRD's description of `status.phase`.)
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub enum RunPhase {
    /// Never connected.
    #[default]
    Pending,
    Online,
    // Online, but its claims hand out no new job: spec.paused, or the Run said it is
    // draining (SPEC §5.1). (A doc comment here would reorder the schema's enum.)
    Draining,
    Offline,
    Unavailable,
}

text_enum! {
    /// Why a Run is not online.
    #[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
    pub enum UnavailableReason {
        RedisUnavailable = "redis_unavailable",
        LeaseExpired = "lease_expired",
        Superseded = "superseded",
        CredentialRotated = "credential_rotated",
    }
}

#[cfg(feature = "sqlx")]
crate::sqlx_text!(UnavailableReason);
#[cfg(feature = "utoipa")]
crate::utoipa_text!(UnavailableReason);

/// A live session as stored (never its token; the token hash stays inside the store).
#[derive(Clone, Debug, PartialEq)]
pub struct Session {
    pub session_id: Uuid,
    /// The credential generation the session proved possession with.
    pub generation: i64,
    /// The identity epoch it was opened in (0: a session of a build before epochs).
    pub epoch: i64,
    pub started_at: DateTime<Utc>,
    pub last_heartbeat: DateTime<Utc>,
    pub version: Option<String>,
    pub target: Option<RunTarget>,
    pub capabilities: Vec<String>,
    pub capacity: BTreeMap<String, i64>,
    /// The Run said it is draining (its graceful stop, SPEC §5.1): its claims hand out no
    /// new job. Sticky until a heartbeat says `false`; a new session starts without it.
    pub draining: bool,
    /// What is left of the lease.
    pub lease_left: Duration,
}

/// What a RunSession says its identity is: what is mirrored.
#[derive(Clone, Debug, PartialEq, Hash)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct IdentitySpec {
    /// The RunSession's metadata.uid.
    pub id: Uuid,
    pub namespace: String,
    pub name: String,
    pub server_instance_id: String,
    pub component_kind: String,
    pub public_key: String,
    pub key_generation: i64,
    pub lease_seconds: Option<i32>,
    /// spec.paused, the platform's cordon (SPEC §5.1): claims hand out no new job. Not
    /// part of the key: a change of it is no new epoch.
    pub paused: bool,
}

impl IdentitySpec {
    pub fn address(&self) -> RunAddress {
        RunAddress { server_instance_id: self.server_instance_id.clone(), component_kind: self.component_kind.clone() }
    }
}

/// A live identity as stored: its spec and its current epoch.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct Identity {
    #[cfg_attr(feature = "sqlx", sqlx(flatten))]
    pub spec: IdentitySpec,
    pub epoch: i64,
}

impl Identity {
    pub fn address(&self) -> RunAddress {
        self.spec.address()
    }
}

/// What mirroring a RunSession's identity found.
#[derive(Clone, Debug, PartialEq)]
pub enum Mirror {
    /// The resource owns the identity (new, or its credential was updated), in `epoch`.
    Owned { rotated: bool, epoch: i64 },
    /// Another live resource owns this (server, component): this one is not used. (Its
    /// namespace and name are for the reconciler to decide what to say: a status never
    /// names another tenant's objects.)
    Duplicate { owner_namespace: String, owner_name: String },
    /// This resource's row was revoked (a later resource of the same name took the
    /// identity over): it stands for nothing any more.
    Revoked,
}

/// What a fence found after it wrote the epoch.
#[derive(Clone, Debug, PartialEq)]
pub enum Fenced {
    /// The live session of the current epoch.
    Live(Session),
    /// No session.
    Absent,
    /// A session of an older epoch, which the fence just ended.
    Revoked,
}

/// How long a revoked identity's epoch stays in the lease store: past any hello that read
/// the identity before it was revoked (that hello's mark is refused durably anyway).
pub const REVOKED_EPOCH_TTL: Duration = Duration::from_secs(24 * 3600);

/// What the job reaper ended in one round.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reaped {
    /// Attempts that ran out (visibility or deadline) and were queued again.
    pub requeued: u64,
    /// ... and failed for good (no attempt left, or not retryable).
    pub failed: u64,
    /// Jobs cancelled: a cancel requested past its grace, or an ended attempt of a job
    /// whose cancel was requested.
    pub cancelled: u64,
    /// Jobs left queued past their time, cancelled (cause `expired`).
    pub expired: u64,
    /// Stale-term fenced jobs cancelled after their project's change of term committed.
    pub stale_term: u64,
}

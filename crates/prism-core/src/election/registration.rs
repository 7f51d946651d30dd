//! A registration as the election stores it, and what the election answers about it and
//! its project. Data only: the election store fills these in.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{AgentSurface, ReleaseReason, Role};

/// A registration to enter into the election.
#[derive(Clone, Debug)]
pub struct NewRegistration {
    /// The resource's metadata.uid.
    pub id: Uuid,
    pub namespace: String,
    pub name: String,
    pub project_id: String,
    pub session_id: String,
    pub surface: AgentSurface,
    /// The Kubernetes identity the session belongs to (SPEC §6, §12): the API's caller,
    /// or a kubectl registration's creator as the admission policy stamped it. None: no
    /// owner is known, and the registration never displaces a session that has one.
    pub owner: Option<String>,
    /// The API writes this row and the resource's reconciler only reads it, so the
    /// resource's own status is refreshed at commit (its creation may have been
    /// reconciled before the row existed).
    pub through_api: bool,
}

/// Which quota of live registrations (SPEC §12) a registration would exceed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quota {
    Owner(u32),
    Namespace(u32),
}

impl std::fmt::Display for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Quota::Owner(n) => {
                write!(f, "the identity holds {n} live registrations, its quota (PRISM_MAX_SESSIONS_PER_IDENTITY)")
            }
            Quota::Namespace(n) => {
                write!(f, "the namespace holds {n} live registrations, its quota (PRISM_MAX_SESSIONS_PER_NAMESPACE)")
            }
        }
    }
}

/// One registration as stored (a row of `controller_registrations`).
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct Registration {
    pub id: Uuid,
    pub namespace: String,
    pub name: String,
    pub project_id: String,
    pub session_id: String,
    pub agent_surface: AgentSurface,
    pub is_master: bool,
    /// The project term in which this registration became master.
    pub master_term: Option<i64>,
    pub registered_at: DateTime<Utc>,
    pub last_heartbeat: DateTime<Utc>,
    pub released_at: Option<DateTime<Utc>>,
    pub release_reason: Option<ReleaseReason>,
    pub preempted: bool,
    pub preempted_by: Option<Uuid>,
}

impl Registration {
    pub fn is_live(&self) -> bool {
        self.released_at.is_none()
    }

    pub fn role(&self) -> Role {
        match (self.is_live(), self.is_master) {
            (false, _) => Role::Released,
            (true, true) => Role::Master,
            (true, false) => Role::Peer,
        }
    }
}

/// How a registration went in.
#[derive(Clone, Debug)]
pub enum RegisterOutcome {
    /// Registered now, or already (idempotent): the row as it stands.
    Registered(Registration),
    /// The session already has a live registration on this project under another
    /// resource; this one is not used.
    DuplicateSession { existing: Registration },
}

/// A project's routing view.
#[derive(Clone, Debug, Default)]
pub struct ProjectView {
    pub term: i64,
    /// How many election writes the project has had (`routing_seq`): a watch's event id.
    pub changes: i64,
    pub master: Option<Registration>,
    /// Master first, then by succession order.
    pub live: Vec<Registration>,
}

/// Rows retention deleted, by table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub registrations: u64,
    /// Projects nothing referred to any more (their terms kept as their namespace's floor).
    pub projects: u64,
    pub history: u64,
    pub nudges: u64,
}

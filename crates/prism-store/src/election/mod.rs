//! The controller election (SPEC §4): the Postgres store around the pure rules (they
//! are `prism_core::election`'s), and the heartbeat coalescer that keeps registrations
//! fresh.

pub mod heartbeat;
pub mod restore;
pub mod roles;
pub mod shared_reads;
pub mod store;

pub use prism_core::election::rules;
pub use prism_core::election::{Candidate, Cause, Decision, Event, ProjectState, Transition, decide};
pub use roles::LiveRoles;
pub use store::{
    ElectionStore, LiveRole, NewRegistration, OwnedRegistration, ProjectView, Quota, Quotas, RegisterOutcome,
    Registration,
};

use crate::db::QueryError;

/// Errors of the election layer; mapped once to HTTP codes (api::error) and conditions.
#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    #[error(transparent)]
    Database(#[from] QueryError),
    #[error("registration {0} not found")]
    NotFound(uuid::Uuid),
    /// SPEC §6: the session belongs to another Kubernetes identity.
    #[error("session {0} belongs to another identity")]
    NotOwned(String),
    /// SPEC §12: a quota of live registrations is full; nothing was written.
    #[error("quota exceeded: {0}")]
    QuotaExceeded(store::Quota),
    #[error("{0}: the election did not settle after {attempts} attempts (concurrent changes)", attempts = store::MAX_ATTEMPTS)]
    Contended(&'static str),
}

impl crate::db::MaybeUnavailable for ElectionError {
    fn is_unavailable(&self) -> bool {
        matches!(self, ElectionError::Database(e) if e.is_unavailable())
    }
}

impl ElectionError {
    /// A race lost to a concurrent transaction: the whole operation may be retried.
    pub fn is_race(&self) -> bool {
        matches!(self, ElectionError::Database(e) if e.is_race())
    }
}

impl prism_core::store::Failure for ElectionError {
    fn unavailable(&self) -> bool {
        crate::db::MaybeUnavailable::is_unavailable(self)
    }
}

impl prism_core::store::ElectionFailure for ElectionError {
    fn refusal(&self) -> Option<prism_core::store::Refusal> {
        use prism_core::store::Refusal;
        match self {
            ElectionError::NotOwned(session) => Some(Refusal::NotOwned(session.clone())),
            ElectionError::QuotaExceeded(quota) => Some(Refusal::QuotaExceeded(*quota)),
            _ => None,
        }
    }
}

//! The controller election (SPEC §4): pure rules plus the Postgres store around them.

pub mod heartbeat;
pub mod rules;
pub mod store;

pub use rules::{Candidate, Cause, Decision, Event, ProjectState, Transition, decide};
pub use store::{ElectionStore, NewRegistration, RegisterOutcome, Registration, Touched};

/// Errors of the election layer; mapped once to HTTP codes and conditions.
#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    #[error("database unavailable: {0}")]
    Database(#[from] sqlx::Error),
    #[error("registration {0} not found")]
    NotFound(uuid::Uuid),
    #[error("the election did not settle after {0} attempts (concurrent changes)")]
    Contended(u32),
}

impl ElectionError {
    /// A unique-index race lost to a concurrent transaction: retry the whole operation.
    pub fn is_race(e: &sqlx::Error) -> bool {
        matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("23505") | Some("40001") | Some("40P01")))
    }
}

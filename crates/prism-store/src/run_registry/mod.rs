//! The registry of Runs (SPEC §5): Run identities mirrored from RunSessions (Postgres),
//! proofs of possession, session leases (Redis), durable jobs (Postgres), and the one
//! safe projection of a session that status and the HTTP API both show.

pub mod identity;
pub mod jobs;
// The safe projection of a session is the Kubernetes side's (status), and the API's.
pub use prism_core::proof;
pub mod service;
pub mod sessions;

pub use self::sessions::{RedisEndpoint, RunAddress, Session, SessionStore, TokenCheck};

use crate::db::QueryError;

/// Errors of the registry; mapped once to HTTP codes (api::error) and conditions.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("runtime registry (Redis): {step}: {source}")]
    Redis {
        step: &'static str,
        #[source]
        source: redis::RedisError,
    },
    #[error(transparent)]
    Database(#[from] QueryError),
    /// A session hash this build cannot read (written by hand, or by another version).
    #[error("runtime registry (Redis): the session of {address} has {field} = {value:?}, which cannot be read")]
    CorruptSession { address: RunAddress, field: &'static str, value: String },
    /// Redis did not answer a probe in time, or (a cluster) some slots have no master
    /// that answers for them.
    #[error("runtime registry (Redis): {0}")]
    Unavailable(String),
    #[error("no randomness available: {0}")]
    Entropy(String),
}

impl RegistryError {
    /// Redis cannot be reached right now: a 503 `runtime_registry_unavailable`, and Runs
    /// shown `Unavailable`. Answers Redis gave that this build cannot read are bugs.
    pub fn registry_unavailable(&self) -> bool {
        use redis::ErrorKind;
        match self {
            RegistryError::Redis { source, .. } => {
                !matches!(source.kind(), ErrorKind::Parse | ErrorKind::UnexpectedReturnType)
            }
            RegistryError::Unavailable(_) => true,
            _ => false,
        }
    }
}

/// `redis::RedisError` with the step that failed.
pub(crate) trait RedisStep<T> {
    fn step(self, step: &'static str) -> Result<T, RegistryError>;
}

impl<T> RedisStep<T> for Result<T, redis::RedisError> {
    fn step(self, step: &'static str) -> Result<T, RegistryError> {
        self.map_err(|source| RegistryError::Redis { step, source })
    }
}

impl prism_core::store::Failure for RegistryError {
    fn unavailable(&self) -> bool {
        self.registry_unavailable()
    }
}

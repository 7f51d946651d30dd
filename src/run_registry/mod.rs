//! The runtime session registry (SPEC §5): Run identities (Postgres), proofs of
//! possession, session leases (Redis), durable jobs (Postgres).

pub mod identity;
pub mod jobs;
pub mod proof;
pub mod service;
pub mod sessions;

pub use self::sessions::{RedisStore, Session, Target, TokenCheck};

/// Errors of the runtime layer; mapped once to HTTP codes and conditions.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("runtime registry unavailable: {0}")]
    Unavailable(#[from] ::redis::RedisError),
    #[error("database unavailable: {0}")]
    Database(#[from] sqlx::Error),
    #[error("no randomness available: {0}")]
    Entropy(String),
}

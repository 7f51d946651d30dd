//! PostgreSQL connection and migrations.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("cannot connect to PostgreSQL at {url}: {source}")]
    Connect { url: String, source: sqlx::Error },
    #[error("migration failed: {0}")]
    Migrate(#[from] crate::migrations::MigrationError),
}

/// Connects without waiting forever: a dead database is an error the caller can report.
pub async fn connect(url: &str) -> Result<PgPool, DbError> {
    connect_with(url, 16).await
}

/// The same, with a pool of at most `max_connections`.
///
/// sqlx pings each connection before it hands it out (`test_before_acquire`, on), a round
/// trip beside each query. It stays: pinging only connections idle longer than a second
/// (2026-12-03) made the first registration after `tests/faults.rs`' storm of killed
/// backends a 503, on a connection killed less than a second before.
pub async fn connect_with(url: &str, max_connections: u32) -> Result<PgPool, DbError> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .map_err(|source| DbError::Connect { url: redact_url(url), source })
}

/// A pool of one connection to the same database as `pool`, for a LISTEN: a listener
/// holds its connection for good, and taken from `pool` it would be one fewer for
/// queries (with a pool of one, none). Connects when first used.
pub fn listener_pool(pool: &PgPool) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(pool.connect_options().as_ref().clone())
}

/// A connection of `pool`, for a caller that needs one connection for several steps.
/// sqlx's `Pool::acquire` future is about 14 KB (the whole opening of a connection is
/// in it), and an `async fn` that awaits it in place is that large on every call, even
/// one that never gets there: a Run's heartbeat or an MCP call was moved and allocated
/// at 15-20 KB per request for a transaction its usual path never opens. Boxed here, it
/// costs its size only when it runs. (Queries on the pool itself are boxed by sqlx.)
pub async fn acquire(pool: &PgPool) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, sqlx::Error> {
    Box::pin(pool.acquire()).await
}

/// A transaction of `pool`: `Pool::begin` holds the same large future (see `acquire`).
pub async fn begin(pool: &PgPool) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
    Box::pin(pool.begin()).await
}

/// Applies every pending migration (in their two ledgers: `crate::migrations`); a second
/// call is a no-op.
pub async fn migrate(pool: &PgPool) -> Result<(), DbError> {
    crate::migrations::migrate(pool).await?;
    Ok(())
}

/// A domain value spelled as one lowercase word in JSON, in Postgres (a text column
/// guarded by a CHECK constraint) and in logs: `prism_core::text_enum!` with the codecs
/// of this crate's layers (the Postgres text codec, the OpenAPI schema) from the same
/// list of spellings. A spelling the code does not know is a decode error naming the
/// type and the value, never a default.
macro_rules! text_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident { $($body:tt)* }
    ) => {
        prism_core::text_enum! { $(#[$meta])* $vis enum $name { $($body)* } }
        prism_core::sqlx_text!($name);
        prism_core::utoipa_text!($name);
    };
}
pub(crate) use text_enum;

pub use prism_core::UnknownValue;

/// An error that may say no more than "Postgres could not be reached just now".
pub trait MaybeUnavailable {
    fn is_unavailable(&self) -> bool;
}

impl MaybeUnavailable for QueryError {
    fn is_unavailable(&self) -> bool {
        QueryError::is_unavailable(self)
    }
}

/// Runs `op` again, with a growing pause, while it fails only because Postgres is out of
/// reach (a killed backend, a restart, a failover behind the same address) and `budget`
/// lasts; returns its last result. For idempotent operations only: a failure can hide a
/// commit whose answer was lost, and the next attempt must find it done.
pub async fn retry_unavailable<T, E, F, Fut>(budget: std::time::Duration, mut op: F) -> Result<T, E>
where
    E: MaybeUnavailable,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + budget;
    let mut pause = std::time::Duration::from_millis(50);
    loop {
        match op().await {
            Err(e) if e.is_unavailable() && tokio::time::Instant::now() + pause < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(1));
            }
            other => return other,
        }
    }
}

/// A failed statement, with the step it was part of (`register: insert registration`).
#[derive(Debug, thiserror::Error)]
#[error("{step}: {source}")]
pub struct QueryError {
    pub step: &'static str,
    #[source]
    pub source: sqlx::Error,
}

impl QueryError {
    /// Postgres cannot be reached right now (connection lost or refused, pool exhausted,
    /// server shutting down or starting): worth a retry, and a 503 to a caller. Anything
    /// else (a violated constraint, a row this build cannot decode) is a bug or bad data.
    pub fn is_unavailable(&self) -> bool {
        match &self.source {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Protocol(_) => true,
            // Class 08: connection exception; 57P01-03: shutdown, crash recovery, starting up;
            // 53300: too many connections.
            sqlx::Error::Database(db) => db
                .code()
                .is_some_and(|c| c.starts_with("08") || matches!(c.as_ref(), "57P01" | "57P02" | "57P03" | "53300")),
            _ => false,
        }
    }

    /// Lost to a concurrent transaction (a unique index, a serialization failure or a
    /// deadlock): the whole operation may be retried.
    pub fn is_race(&self) -> bool {
        matches!(&self.source, sqlx::Error::Database(db)
            if matches!(db.code().as_deref(), Some("23505") | Some("40001") | Some("40P01")))
    }

    /// The unique index or constraint a failed statement violated, if any.
    pub fn constraint(&self) -> Option<&str> {
        match &self.source {
            sqlx::Error::Database(db) => db.constraint(),
            _ => None,
        }
    }
}

/// Names the step a statement belongs to: `query.await.step("register: insert registration")?`.
pub trait Step<T> {
    fn step(self, step: &'static str) -> Result<T, QueryError>;
}

impl<T> Step<T> for Result<T, sqlx::Error> {
    fn step(self, step: &'static str) -> Result<T, QueryError> {
        self.map_err(|source| QueryError { step, source })
    }
}

/// Renders a URL for logs and errors without its password.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let creds = &url[scheme_end + 3..at];
            let user = creds.split(':').next().unwrap_or_default();
            format!("{}://{}:***@{}", &url[..scheme_end], user, &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use uuid::Uuid;

    use crate::election::{ElectionStore, NewRegistration};
    use crate::run_registry::jobs::{JobSettings, JobStore};

    /// `acquire` and `begin`: a store call that may open a transaction is a small future
    /// on every path, not the 14-15 KB it was with sqlx's acquire in place (measured with
    /// `-Zprint-type-sizes`: `ElectionStore::register` 15,760 bytes, `JobStore::get`
    /// 14,688). The futures are only made, never run: no database is needed.
    #[tokio::test]
    async fn store_calls_that_may_open_a_transaction_are_small_futures() {
        let pool =
            sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://nobody@127.0.0.1:1/none").expect("lazy");
        let election = ElectionStore::new(pool.clone());
        let jobs = JobStore::new(pool, JobSettings::default());
        let new = NewRegistration {
            id: Uuid::nil(),
            namespace: "ns".into(),
            name: "r".into(),
            project_id: "p".into(),
            session_id: "s".into(),
            surface: prism_core::election::AgentSurface::Codex,
            owner: None,
            through_api: true,
        };
        let sizes = [
            ("ElectionStore::register", size_of_val(&election.register(&new))),
            (
                "ElectionStore::release",
                size_of_val(&election.release(Uuid::nil(), prism_core::election::ReleaseReason::Wrapped)),
            ),
            ("JobStore::get", size_of_val(&jobs.get("ns", Uuid::nil()))),
        ];
        for (call, size) in sizes {
            assert!(size < 4096, "{call} is a future of {size} bytes");
        }
    }
}

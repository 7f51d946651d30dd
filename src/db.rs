//! PostgreSQL connection and migrations.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// The migrations in `migrations/`, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("cannot connect to PostgreSQL at {url}: {source}")]
    Connect { url: String, source: sqlx::Error },
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

/// Connects without waiting forever: a dead database is an error the caller can report.
pub async fn connect(url: &str) -> Result<PgPool, DbError> {
    connect_with(url, 16).await
}

/// The same, with a pool of at most `max_connections`.
pub async fn connect_with(url: &str, max_connections: u32) -> Result<PgPool, DbError> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .map_err(|source| DbError::Connect { url: crate::config::redact_url(url), source })
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

/// Applies every pending migration; a second call is a no-op.
pub async fn migrate(pool: &PgPool) -> Result<(), DbError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// A domain value spelled as one lowercase word in JSON, in Postgres (a text column
/// guarded by a CHECK constraint) and in logs: declares the enum with its spellings and
/// implements serde, `Display`, `FromStr` and the sqlx text codec from that one list. A
/// spelling the code does not know is a decode error naming the type and the value,
/// never a default.
macro_rules! text_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(serde::Serialize, serde::Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
        $vis enum $name {
            $( $(#[$vmeta])* #[serde(rename = $text)] $variant ),+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The wire and database spelling.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = $crate::db::UnknownValue;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err($crate::db::UnknownValue { kind: stringify!($name), value: s.to_string() }),
                }
            }
        }

        // The OpenAPI schema, from the same spellings as serde's (a derive would not see
        // the `rename`s this macro writes, and would list the variant names).
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::schema::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .enum_values(Some([$($text),+]))
                    .into()
            }
        }

        impl utoipa::ToSchema for $name {}

        impl sqlx::Type<sqlx::Postgres> for $name {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <String as sqlx::Type<sqlx::Postgres>>::type_info()
            }
            // TEXT and VARCHAR columns alike.
            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <String as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }

        impl sqlx::Encode<'_, sqlx::Postgres> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }

        impl<'r> sqlx::Decode<'r, sqlx::Postgres> for $name {
            fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
                let text = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
                Ok(text.parse::<$name>()?)
            }
        }
    };
}
pub(crate) use text_enum;

/// A spelling of a domain value that this build does not know (a newer writer, or a
/// row changed by hand): an error, never a silent default.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {value:?}")]
pub struct UnknownValue {
    pub kind: &'static str,
    pub value: String,
}

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

//! The schema's migrations, kept in two ledgers so that the previous release keeps running
//! on this release's schema (SPEC §15: migrations are expand/contract, and a
//! `helm rollback` starts the previous binary on the newer schema).
//!
//! Releases up to 0.2.0 apply `migrations/` with sqlx's strict check: a version recorded
//! in `_sqlx_migrations` that their binary does not embed stops them at start ("migration
//! … was previously applied but it is missing in the resolved migrations"). So that
//! ledger holds only the migrations those releases know, up to [`LEGACY_LAST`], and never
//! grows. Every later migration is recorded in [`LEDGER`], which this release (and every
//! later one) reads leniently: a version it does not know there was applied by a newer
//! release, whose schema only added to what this one needs.
//!
//! One directory, `migrations/`, holds both: the version decides the ledger.

use sqlx::PgPool;
use sqlx::migrate::{MigrateError, Migration, Migrator};

/// Every migration in `migrations/`, embedded in the binary.
pub static ALL: Migrator = sqlx::migrate!("../../migrations");

/// The last migration of the strict ledger (`_sqlx_migrations`): 0.2.0's last.
pub const LEGACY_LAST: i64 = 20261207000001;

// A literal, for the statements below: sqlx takes only static SQL text.
macro_rules! ledger {
    () => {
        "prism_schema_migrations"
    };
}

/// The ledger of the migrations after [`LEGACY_LAST`].
pub const LEDGER: &str = ledger!();

/// What fails, named by its step.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error("applying the migrations up to 0.2.0 (_sqlx_migrations): {0}")]
    Legacy(#[source] MigrateError),
    #[error("moving pre-release versions from _sqlx_migrations to {LEDGER}: {0}")]
    Adopt(#[source] sqlx::Error),
    #[error("applying the migrations after 0.2.0 ({LEDGER}): {0}")]
    Current(#[source] MigrateError),
}

fn subset(keep: impl Fn(&Migration) -> bool) -> Vec<Migration> {
    ALL.iter().filter(|m| keep(m)).cloned().collect()
}

/// The migrations 0.1.0 and 0.2.0 embed, in the ledger they check strictly. Lenient here:
/// a database a pre-release build of 0.3.0 migrated has later versions in it, which
/// [`migrate`] moves to [`LEDGER`].
pub fn legacy() -> Migrator {
    let mut m = Migrator::with_migrations(subset(|m| m.version <= LEGACY_LAST));
    m.set_ignore_missing(true);
    m
}

/// The migrations after 0.2.0, in their own ledger, which tolerates a newer release's.
pub fn current() -> Migrator {
    let mut m = Migrator::with_migrations(subset(|m| m.version > LEGACY_LAST));
    m.dangerous_set_table_name(LEDGER);
    m.set_ignore_missing(true);
    m
}

/// Applies every pending migration; a second call is a no-op.
pub async fn migrate(pool: &PgPool) -> Result<(), MigrationError> {
    legacy().run(pool).await.map_err(MigrationError::Legacy)?;
    adopt(pool).await.map_err(MigrationError::Adopt)?;
    current().run(pool).await.map_err(MigrationError::Current)?;
    Ok(())
}

/// How many migrations the database records as applied, in both ledgers.
pub async fn applied(pool: &PgPool) -> Result<usize, sqlx::Error> {
    let n: i64 = sqlx::query_scalar(concat!(
        "SELECT (SELECT count(*) FROM _sqlx_migrations WHERE success) + (SELECT count(*) FROM ",
        ledger!(),
        " WHERE success)"
    ))
    .fetch_one(pool)
    .await?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// A database migrated by a pre-release build of 0.3.0 recorded later versions in
/// `_sqlx_migrations`, where 0.2.0 would refuse them: they move to [`LEDGER`] (same
/// columns as sqlx makes), so they are neither applied twice nor in 0.2.0's way.
async fn adopt(pool: &PgPool) -> Result<(), sqlx::Error> {
    // Not `db::begin`: db calls this module, and the layers test keeps modules acyclic.
    let mut tx = pool.begin().await?;
    let stray: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE version > $1")
        .bind(LEGACY_LAST)
        .fetch_one(&mut *tx)
        .await?;
    if stray > 0 {
        sqlx::query(concat!(
            "CREATE TABLE IF NOT EXISTS ",
            ledger!(),
            " (version BIGINT PRIMARY KEY, description TEXT NOT NULL, installed_on TIMESTAMPTZ NOT NULL DEFAULT now(), \
             success BOOLEAN NOT NULL, checksum BYTEA NOT NULL, execution_time BIGINT NOT NULL)"
        ))
        .execute(&mut *tx)
        .await?;
        sqlx::query(concat!(
            "INSERT INTO ",
            ledger!(),
            " SELECT * FROM _sqlx_migrations WHERE version > $1 ON CONFLICT (version) DO NOTHING"
        ))
        .bind(LEGACY_LAST)
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM _sqlx_migrations WHERE version > $1").bind(LEGACY_LAST).execute(&mut *tx).await?;
    }
    tx.commit().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_is_in_exactly_one_ledger() {
        let legacy: Vec<i64> = legacy().iter().map(|m| m.version).collect();
        let current: Vec<i64> = current().iter().map(|m| m.version).collect();
        assert_eq!(legacy.len() + current.len(), ALL.iter().count());
        assert!(legacy.iter().all(|v| *v <= LEGACY_LAST) && current.iter().all(|v| *v > LEGACY_LAST));
        assert_eq!(legacy.last(), Some(&LEGACY_LAST), "LEGACY_LAST names a migration that exists");
    }
}

//! The database's side of "a restore never reissues a term" (SPEC §15): how far its
//! election history goes, and the raise of every project's term after a restore. The
//! rules are `prism_core::election::restore`'s; the mark outside Postgres is the
//! operator's (the binary's `term_guard`).

use sqlx::PgPool;

use super::ElectionError;
use crate::db::Step;
use prism_core::election::restore::{History, raised};

/// What a raise after a restore did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Raised {
    /// Projects whose term was raised.
    pub projects: u64,
    /// The floor projects made from now on start at.
    pub floor: i64,
}

#[derive(Clone)]
pub struct RestoreGuard {
    pool: PgPool,
}

impl RestoreGuard {
    pub fn new(pool: PgPool) -> Self {
        RestoreGuard { pool }
    }

    /// How far the election history's sequence went, and the highest term issued that
    /// the database still knows (pruned projects' terms live on in the floors, so the
    /// prune does not look like a restore).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn history(&self) -> Result<History, ElectionError> {
        let (events, highest_term): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM controller_election_events_id_seq),
                    GREATEST((SELECT COALESCE(max(term), 0) FROM controller_projects),
                             (SELECT COALESCE(max(term_floor), 0) FROM controller_term_floors),
                             (SELECT term_floor FROM controller_term_guard))",
        )
        .fetch_one(&self.pool)
        .await
        .step("restore guard: read how far the election history goes")?;
        Ok(History { events, highest_term })
    }

    /// Raises every project's term above `above` (one row of `controller_term_restores`
    /// each), every live master's term with it, and the floor new projects start at;
    /// each raised project's fenced jobs of older terms are cancelled by the term
    /// change's own trigger. One transaction: a crash leaves all of it or none. A floor
    /// at `above` already means another replica did it: nothing is done twice.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn raise_after_restore(&self, above: i64) -> Result<Raised, ElectionError> {
        let mut tx = self.pool.begin().await.step("restore guard: begin")?;
        let floor: i64 = sqlx::query_scalar("SELECT term_floor FROM controller_term_guard FOR UPDATE")
            .fetch_one(&mut *tx)
            .await
            .step("restore guard: lock the floor")?;
        if floor > above {
            return Ok(Raised { projects: 0, floor });
        }
        let floor = raised(above, 0);
        // Every project goes to `raised(above, term)`; the masters' rows follow their
        // project. This runs before the controllers start: their first reconcile of
        // every resource writes the new terms into the statuses.
        let projects = sqlx::query(
            "WITH raised AS (
                 UPDATE controller_projects p SET term = GREATEST($1, p.term) + 1, updated_at = now()
                 FROM (SELECT namespace, project_id, term AS before FROM controller_projects FOR UPDATE) b
                 WHERE b.namespace = p.namespace AND b.project_id = p.project_id
                 RETURNING p.namespace, p.project_id, b.before, p.term, p.master_id),
             masters AS (
                 UPDATE controller_registrations r SET master_term = raised.term
                 FROM raised WHERE r.id = raised.master_id)
             INSERT INTO controller_term_restores (namespace, project_id, term_before, term_after)
             SELECT namespace, project_id, before, term FROM raised",
        )
        .bind(above)
        .execute(&mut *tx)
        .await
        .step("restore guard: raise every project's term")?
        .rows_affected();
        sqlx::query("UPDATE controller_term_guard SET term_floor = $1")
            .bind(floor)
            .execute(&mut *tx)
            .await
            .step("restore guard: raise the floor of new projects")?;
        tx.commit().await.step("restore guard: commit")?;
        Ok(Raised { projects, floor })
    }
}

//! The passes over every job that no caller makes: the reaper ends attempts that ran out,
//! cancels what outlived its cancel grace or its queued TTL, and sweeps stale-term fenced
//! jobs; retention deletes finished jobs and expired idempotency keys.

use chrono::{DateTime, Utc};

use super::{BACKOFF, DEADLINE_EXCEEDED, JobState, JobStore, Reaped, VISIBILITY_TIMEOUT};
use crate::db::Step as _;
use crate::run_registry::RegistryError;

impl JobStore {
    /// Deletes finished jobs completed over `days` ago, and idempotency keys past their
    /// 24 h (retention). Returns how many jobs.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn prune_finished(&self, days: u32) -> Result<u64, RegistryError> {
        crate::election::store::prune_batches(&self.pool, "retention: prune idempotency keys", || {
            sqlx::query(
                "DELETE FROM runtime_job_idempotency WHERE (namespace, server_instance_id, component_kind, idempotency_key) IN (
                     SELECT namespace, server_instance_id, component_kind, idempotency_key FROM runtime_job_idempotency
                     WHERE created_at < now() - interval '24 hours' LIMIT 1000)",
            )
        })
        .await?;
        Ok(crate::election::store::prune_batches(&self.pool, "retention: prune finished jobs", || {
            sqlx::query(
                "DELETE FROM runtime_jobs WHERE id IN (
                     SELECT id FROM runtime_jobs
                     WHERE state IN ('succeeded','failed','cancelled') AND completed_at < now() - make_interval(days => $1)
                     LIMIT 1000)",
            )
            .bind(days as i32)
        })
        .await?)
    }

    /// Ends the attempts that ran out — past the visibility timeout (the Run went
    /// silent) or the deadline — as retryable ends: queued again after the backoff while
    /// attempts are left, else failed for good; a job whose cancel was requested is
    /// cancelled instead. Then cancels in-flight jobs whose cancel grace has passed.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn reap(&self) -> Result<Reaped, RegistryError> {
        let sql = format!(
            "UPDATE runtime_jobs SET
                 last_error = CASE WHEN deadline_at < now() THEN '{DEADLINE_EXCEEDED}' ELSE '{VISIBILITY_TIMEOUT}' END,
                 state = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled'
                              WHEN attempts < max_attempts THEN 'queued' ELSE 'failed' END,
                 completed_at = CASE WHEN cancel_requested_at IS NULL AND attempts < max_attempts THEN NULL ELSE now() END,
                 eligible_at = CASE WHEN cancel_requested_at IS NULL AND attempts < max_attempts THEN {BACKOFF}
                                    ELSE eligible_at END,
                 claimed_by_session = NULL, visible_at = NULL, deadline_at = NULL, updated_at = now()
             WHERE state IN ('claimed','running') AND (visible_at < now() OR deadline_at < now())
             RETURNING state"
        );
        let ended: Vec<JobState> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .step("reaper: end attempts that ran out")?;
        let mut reaped = Reaped::default();
        for state in ended {
            match state {
                JobState::Queued => reaped.requeued += 1,
                JobState::Cancelled => reaped.cancelled += 1,
                _ => reaped.failed += 1,
            }
        }
        let graced = sqlx::query(
            "UPDATE runtime_jobs SET state = 'cancelled', completed_at = now(), claimed_by_session = NULL,
                 visible_at = NULL, deadline_at = NULL, cancel_cause = 'grace', updated_at = now()
             WHERE state IN ('claimed','running') AND cancel_requested_at < now() - make_interval(secs => $1)",
        )
        .bind(self.settings.cancel_grace.as_secs_f64())
        .execute(&self.pool)
        .await
        .step("reaper: cancel what outlived its cancel grace")?;
        reaped.cancelled += graced.rows_affected();
        // Jobs left queued past their time (SPEC §12), oldest first, in batches: a backlog
        // of any size ends without one long statement.
        reaped.expired = crate::election::store::prune_batches(&self.pool, "reaper: expire jobs left queued", || {
            sqlx::query(
                "UPDATE runtime_jobs SET state = 'cancelled', completed_at = now(), updated_at = now(),
                     cancel_reason = COALESCE(cancel_reason, 'expired'), cancel_cause = 'expired'
                 WHERE id IN (
                     SELECT id FROM runtime_jobs
                     WHERE state = 'queued' AND created_at < now() - make_interval(secs => $1)
                     ORDER BY created_at LIMIT 1000
                     FOR UPDATE SKIP LOCKED)",
            )
            .bind(self.settings.queued_ttl.as_secs_f64())
        })
        .await?;
        reaped.stale_term = self.sweep_fenced().await?;
        Ok(reaped)
    }

    /// The fenced jobs a change of master term left to after its commit (its transaction
    /// cancels the first 1,000 queued ones and leaves a sweep request when more are
    /// left): each requested project's stale-term queued jobs are cancelled in batches
    /// of 1,000, any in flight (claimed while the change was committing) asked to stop,
    /// and the request forgotten unless a newer one came meanwhile. Returns how many jobs.
    async fn sweep_fenced(&self) -> Result<u64, RegistryError> {
        let requests: Vec<(String, String, DateTime<Utc>)> = sqlx::query_as(
            "SELECT namespace, project_id, requested_at FROM runtime_job_fence_sweeps ORDER BY requested_at LIMIT 100",
        )
        .fetch_all(&self.pool)
        .await
        .step("fence sweep: read the requests")?;
        let mut swept = 0;
        // A job is stale when its term is below the project's (terms only rise), or the
        // project has no master: the same rule as the change's own trigger.
        const STALE: &str = "j.fence_namespace = $1 AND j.fence_project_id = $2 AND j.fence_term IS NOT NULL
             AND EXISTS (SELECT 1 FROM controller_projects p WHERE p.namespace = $1 AND p.project_id = $2
                         AND (j.fence_term < p.term OR p.master_id IS NULL))";
        for (namespace, project_id, requested_at) in requests {
            let queued = format!(
                "UPDATE runtime_jobs SET state = 'cancelled', completed_at = now(), updated_at = now(),
                     cancel_reason = COALESCE(cancel_reason, 'stale_term'), cancel_cause = COALESCE(cancel_cause, 'stale_term')
                 WHERE id IN (SELECT j.id FROM runtime_jobs j WHERE {STALE} AND j.state = 'queued' LIMIT 1000)"
            );
            swept +=
                crate::election::store::prune_batches(&self.pool, "fence sweep: cancel stale-term queued jobs", || {
                    sqlx::query(sqlx::AssertSqlSafe(queued.clone())).bind(&namespace).bind(&project_id)
                })
                .await?;
            let in_flight = format!(
                "UPDATE runtime_jobs j SET cancel_requested_at = now(), updated_at = now(),
                     cancel_reason = COALESCE(cancel_reason, 'stale_term'), cancel_cause = COALESCE(cancel_cause, 'stale_term')
                 WHERE {STALE} AND j.state IN ('claimed','running') AND j.cancel_requested_at IS NULL"
            );
            sqlx::query(sqlx::AssertSqlSafe(in_flight))
                .bind(&namespace)
                .bind(&project_id)
                .execute(&self.pool)
                .await
                .step("fence sweep: ask the Runs of stale-term jobs in flight")?;
            sqlx::query(
                "DELETE FROM runtime_job_fence_sweeps WHERE namespace = $1 AND project_id = $2 AND requested_at <= $3",
            )
            .bind(&namespace)
            .bind(&project_id)
            .bind(requested_at)
            .execute(&self.pool)
            .await
            .step("fence sweep: forget a request done")?;
        }
        Ok(swept)
    }
}

//! Durable jobs (Postgres), addressed to a (server, component) — never to a session or
//! endpoint — and owned by the namespace of the RunSession they were enqueued for: only
//! sessions of that namespace's identity claim or step them (SPEC §5, §12). queued →
//! claimed → running → succeeded | failed (and cancelled). A claimed job not progressed
//! within its visibility timeout returns to queued: a job timer, independent of any
//! Redis lease.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::{RegistryError, RunAddress};
use crate::db::{Step as _, text_enum};

text_enum! {
    /// What a job asks the Run to do (SPEC §8; also a Postgres CHECK constraint).
    pub enum JobKind {
        Lifecycle = "lifecycle",
        Config = "config",
        File = "file",
        Log = "log",
        ProtectedRequest = "protected_request",
    }
}

text_enum! {
    /// Where a job is in its life (SPEC §5; also a Postgres CHECK constraint).
    pub enum JobState {
        Queued = "queued",
        Claimed = "claimed",
        Running = "running",
        Succeeded = "succeeded",
        Failed = "failed",
        Cancelled = "cancelled",
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Job {
    pub id: Uuid,
    /// The namespace of the RunSession it was enqueued for: its owner.
    pub namespace: String,
    pub server_instance_id: String,
    pub component_kind: String,
    pub kind: JobKind,
    pub payload: Value,
    pub state: JobState,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub claimed_at: Option<DateTime<Utc>>,
    pub completed_at: Option<DateTime<Utc>>,
    pub progress: Option<Value>,
    pub result: Option<Value>,
    /// Why it was cancelled (`identity_deleted`: its RunSession was deleted).
    pub cancel_reason: Option<String>,
}

const COLUMNS: &str = "id, namespace, server_instance_id, component_kind, kind, payload, state, attempts, created_at, \
     claimed_at, completed_at, progress, result, cancel_reason";

/// The cancel reason of the jobs of a deleted RunSession (SPEC §5).
pub const IDENTITY_DELETED: &str = "identity_deleted";

/// Why a job step was refused; the job is unchanged in every case.
#[derive(Debug, PartialEq)]
pub enum StepRefused {
    NotFound,
    /// The job belongs to another (server, component).
    CrossTarget,
    /// The job is not in a state that allows this step (e.g. already completed).
    WrongState(JobState),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Ack,
    Progress,
    Complete { succeeded: bool },
}

#[derive(Clone)]
pub struct JobStore {
    pool: PgPool,
    visibility: chrono::Duration,
}

impl JobStore {
    pub fn new(pool: PgPool, visibility: std::time::Duration) -> Self {
        let visibility = chrono::Duration::from_std(visibility).unwrap_or(chrono::Duration::seconds(60));
        Self { pool, visibility }
    }

    /// A job for `a`, owned by `namespace` (the namespace of the RunSession it is for).
    pub async fn enqueue(
        &self,
        namespace: &str,
        a: &RunAddress,
        kind: JobKind,
        payload: &Value,
    ) -> Result<Job, RegistryError> {
        let sql = format!(
            "INSERT INTO runtime_jobs (namespace, server_instance_id, component_kind, kind, payload)
             VALUES ($1, $2, $3, $4, $5) RETURNING {COLUMNS}"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(namespace)
            .bind(&a.server_instance_id)
            .bind(&a.component_kind)
            .bind(kind)
            .bind(payload)
            .fetch_one(&self.pool)
            .await
            .step("enqueue: insert job")?)
    }

    /// Claims up to `max` of the oldest queued jobs of `namespace` for the session's own
    /// address. SKIP LOCKED: concurrent claimers never wait on, or take, each other's rows.
    pub async fn claim(
        &self,
        namespace: &str,
        a: &RunAddress,
        session_id: Uuid,
        max: i64,
    ) -> Result<Vec<Job>, RegistryError> {
        let sql = format!(
            "UPDATE runtime_jobs SET state = 'claimed', claimed_at = now(), updated_at = now(),
                 visible_at = now() + make_interval(secs => $5), attempts = attempts + 1, claimed_by_session = $3
             WHERE id IN (
                 SELECT id FROM runtime_jobs
                 WHERE namespace = $6 AND server_instance_id = $1 AND component_kind = $2 AND state = 'queued'
                 ORDER BY created_at, id
                 LIMIT $4
                 FOR UPDATE SKIP LOCKED)
             RETURNING {COLUMNS}"
        );
        let mut jobs: Vec<Job> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(&a.server_instance_id)
            .bind(&a.component_kind)
            .bind(session_id)
            .bind(max)
            .bind(self.visibility_secs())
            .bind(namespace)
            .fetch_all(&self.pool)
            .await
            .step("claim: take queued jobs")?;
        jobs.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        Ok(jobs)
    }

    fn visibility_secs(&self) -> f64 {
        self.visibility.num_seconds() as f64
    }

    /// Ack, progress or complete a job of the caller's own address and namespace. A Run
    /// that said hello again (new session, same identity) may finish what its previous
    /// session claimed.
    pub async fn step(
        &self,
        namespace: &str,
        a: &RunAddress,
        id: Uuid,
        step: Step,
        body: Option<&Value>,
    ) -> Result<Result<Job, StepRefused>, RegistryError> {
        // $1-$4 and $6 in every step; $5 is the visibility timeout for ack/progress, the
        // final state for complete. Nothing of the caller's is spliced into the text.
        let (set, fifth) = match step {
            Step::Ack => (
                "state = 'running', progress = COALESCE($4::jsonb, progress), visible_at = now() + make_interval(secs => $5)",
                None,
            ),
            Step::Progress => {
                ("state = 'running', progress = $4::jsonb, visible_at = now() + make_interval(secs => $5)", None)
            }
            Step::Complete { succeeded } => (
                "state = $5, result = $4::jsonb, completed_at = now(), visible_at = NULL",
                Some(if succeeded { JobState::Succeeded } else { JobState::Failed }),
            ),
        };
        let sql = format!(
            "UPDATE runtime_jobs SET {set}, updated_at = now()
             WHERE id = $1 AND server_instance_id = $2 AND component_kind = $3 AND namespace = $6
               AND state IN ('claimed','running')
             RETURNING {COLUMNS}"
        );
        let update = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(&a.server_instance_id)
            .bind(&a.component_kind)
            .bind(body);
        let update = match fifth {
            Some(state) => update.bind(state),
            None => update.bind(self.visibility_secs()),
        }
        .bind(namespace);
        let done: Option<Job> = update.fetch_optional(&self.pool).await.step("job step: update the job")?;
        if let Some(job) = done {
            return Ok(Ok(job));
        }
        // Say why, without changing anything. Another namespace's job is no job at all
        // to this session: its existence is not told.
        let existing: Option<(String, String, String, JobState)> = sqlx::query_as(
            "SELECT namespace, server_instance_id, component_kind, state FROM runtime_jobs WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .step("job step: read the refused job")?;
        Ok(Err(match existing {
            None => StepRefused::NotFound,
            Some((ns, _, _, _)) if ns != namespace => StepRefused::NotFound,
            Some((_, s, c, _)) if s != a.server_instance_id || c != a.component_kind => StepRefused::CrossTarget,
            Some((_, _, _, state)) => StepRefused::WrongState(state),
        }))
    }

    /// Cancels every unfinished job of `namespace` for `a` (its RunSession was deleted:
    /// no session of that namespace's identity is left to run them, and none of another
    /// namespace may). Returns how many.
    /// Only jobs enqueued before the identity `revoked` was revoked: a finalizer retried
    /// later must not cancel the work of a newer identity that took the address since.
    pub async fn cancel_for_identity(
        &self,
        namespace: &str,
        a: &RunAddress,
        revoked: Uuid,
    ) -> Result<u64, RegistryError> {
        let done = sqlx::query(
            "UPDATE runtime_jobs SET state = 'cancelled', cancel_reason = $4, completed_at = now(), visible_at = NULL,
                 claimed_by_session = NULL, updated_at = now()
             WHERE namespace = $1 AND server_instance_id = $2 AND component_kind = $3
               AND state IN ('queued','claimed','running')
               AND created_at <= (SELECT revoked_at FROM run_identities WHERE id = $5)",
        )
        .bind(namespace)
        .bind(&a.server_instance_id)
        .bind(&a.component_kind)
        .bind(IDENTITY_DELETED)
        .bind(revoked)
        .execute(&self.pool)
        .await
        .step("RunSession deleted: cancel its jobs")?;
        Ok(done.rows_affected())
    }

    /// Deletes finished jobs completed over `days` ago (retention). Returns how many.
    pub async fn prune_finished(&self, days: u32) -> Result<u64, RegistryError> {
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

    /// Returns claimed or running jobs past their visibility timeout to the queue.
    pub async fn reap(&self) -> Result<u64, RegistryError> {
        let done = sqlx::query(
            "UPDATE runtime_jobs SET state = 'queued', claimed_at = NULL, visible_at = NULL,
                 claimed_by_session = NULL, updated_at = now()
             WHERE state IN ('claimed','running') AND visible_at < now()",
        )
        .execute(&self.pool)
        .await
        .step("reaper: requeue expired claims")?;
        Ok(done.rows_affected())
    }

    /// Queued jobs of every address, for metrics.
    pub async fn queue_depth(&self) -> Result<i64, RegistryError> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM runtime_jobs WHERE state = 'queued'")
            .fetch_one(&self.pool)
            .await
            .step("metrics: count queued jobs")?)
    }
}

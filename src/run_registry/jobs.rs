//! Durable jobs (Postgres), addressed to a (server, component) — never to a session or
//! endpoint. queued → claimed → running → succeeded | failed (and cancelled). A claimed
//! job not progressed within its visibility timeout returns to queued: a job timer,
//! independent of any Redis lease.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::{RuntimeError, Target};

pub const JOB_KINDS: [&str; 5] = ["lifecycle", "config", "file", "log", "protected_request"];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct Job {
    pub id: Uuid,
    pub server_instance_id: String,
    pub component_kind: String,
    pub kind: String,
    pub payload: Value,
    pub state: String,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub claimed_at: Option<DateTime<Utc>>,
    pub progress: Option<Value>,
    pub result: Option<Value>,
}

const COLUMNS: &str =
    "id, server_instance_id, component_kind, kind, payload, state, attempts, created_at, claimed_at, progress, result";

/// Why a job step was refused; the job is unchanged in every case.
#[derive(Debug, PartialEq)]
pub enum StepRefused {
    NotFound,
    /// The job belongs to another (server, component).
    CrossTarget,
    /// The job is not in a state that allows this step (e.g. already completed).
    WrongState(String),
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

    pub async fn enqueue(&self, t: &Target, kind: &str, payload: &Value) -> Result<Job, RuntimeError> {
        let sql = format!(
            "INSERT INTO runtime_jobs (server_instance_id, component_kind, kind, payload) VALUES ($1, $2, $3, $4) RETURNING {COLUMNS}"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(&t.server_instance_id)
            .bind(&t.component_kind)
            .bind(kind)
            .bind(payload)
            .fetch_one(&self.pool)
            .await?)
    }

    /// Claims up to `max` of the oldest queued jobs of the session's own target.
    /// SKIP LOCKED: concurrent claimers never wait on, or take, each other's rows.
    pub async fn claim(&self, t: &Target, session_id: Uuid, max: i64) -> Result<Vec<Job>, RuntimeError> {
        let sql = format!(
            "UPDATE runtime_jobs SET state = 'claimed', claimed_at = now(), updated_at = now(),
                 visible_at = now() + make_interval(secs => $5), attempts = attempts + 1, claimed_by_session = $3
             WHERE id IN (
                 SELECT id FROM runtime_jobs
                 WHERE server_instance_id = $1 AND component_kind = $2 AND state = 'queued'
                 ORDER BY created_at, id
                 LIMIT $4
                 FOR UPDATE SKIP LOCKED)
             RETURNING {COLUMNS}"
        );
        let mut jobs: Vec<Job> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(&t.server_instance_id)
            .bind(&t.component_kind)
            .bind(session_id)
            .bind(max)
            .bind(self.visibility.num_seconds() as f64)
            .fetch_all(&self.pool)
            .await?;
        jobs.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        Ok(jobs)
    }

    /// Ack, progress or complete a job of the caller's own target. A Run that said hello
    /// again (new session, same identity) may finish what its previous session claimed.
    pub async fn step(
        &self,
        t: &Target,
        id: Uuid,
        step: Step,
        body: Option<&Value>,
    ) -> Result<Result<Job, StepRefused>, RuntimeError> {
        // The visibility timeout is configuration (a number), not input.
        let visible = format!("now() + make_interval(secs => {})", self.visibility.num_seconds());
        let set = match step {
            Step::Ack => format!("state = 'running', progress = COALESCE($4::jsonb, progress), visible_at = {visible}"),
            Step::Progress => {
                format!("state = 'running', progress = $4::jsonb, visible_at = {visible}")
            }
            Step::Complete { succeeded } => {
                let state = if succeeded { "succeeded" } else { "failed" };
                format!("state = '{state}', result = $4::jsonb, completed_at = now(), visible_at = NULL")
            }
        };
        let sql = format!(
            "UPDATE runtime_jobs SET {set}, updated_at = now()
             WHERE id = $1 AND server_instance_id = $2 AND component_kind = $3 AND state IN ('claimed','running')
             RETURNING {COLUMNS}"
        );
        let done: Option<Job> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(&t.server_instance_id)
            .bind(&t.component_kind)
            .bind(body)
            .fetch_optional(&self.pool)
            .await?;
        if let Some(job) = done {
            return Ok(Ok(job));
        }
        // Say why, without changing anything.
        let existing: Option<(String, String, String)> =
            sqlx::query_as("SELECT server_instance_id, component_kind, state FROM runtime_jobs WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(Err(match existing {
            None => StepRefused::NotFound,
            Some((s, c, _)) if s != t.server_instance_id || c != t.component_kind => StepRefused::CrossTarget,
            Some((_, _, state)) => StepRefused::WrongState(state),
        }))
    }

    pub async fn get(&self, id: Uuid) -> Result<Option<Job>, RuntimeError> {
        let sql = format!("SELECT {COLUMNS} FROM runtime_jobs WHERE id = $1");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(id).fetch_optional(&self.pool).await?)
    }

    /// Returns claimed or running jobs past their visibility timeout to the queue.
    pub async fn reap(&self) -> Result<u64, RuntimeError> {
        let done = sqlx::query(
            "UPDATE runtime_jobs SET state = 'queued', claimed_at = NULL, visible_at = NULL,
                 claimed_by_session = NULL, updated_at = now()
             WHERE state IN ('claimed','running') AND visible_at < now()",
        )
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Queued jobs per target, for metrics and status.
    pub async fn queue_depth(&self) -> Result<i64, RuntimeError> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM runtime_jobs WHERE state = 'queued'").fetch_one(&self.pool).await?)
    }
}

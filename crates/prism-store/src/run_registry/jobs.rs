//! Durable jobs (Postgres), addressed to a (server, component) — never to a session or
//! endpoint — and owned by the namespace of the RunSession they were enqueued for: only
//! sessions of that namespace's identity claim or step them (SPEC §5, §12).
//!
//! The lifecycle (SPEC §5.1): queued → claimed → running → succeeded | failed |
//! cancelled. Every attempt ends — by the Run's `complete`, by the visibility timeout
//! (the Run went silent) or by the attempt's deadline — and a retryable end with
//! attempts left requeues the job after a backoff; nothing is redelivered without bound.
//! The rules a row can state are CHECKs and triggers of the migrations (attempts bounded,
//! a finished job stays finished, a change of a project's term cancels its fenced jobs).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::{RegistryError, RunAddress};
use crate::db::{Step as _, text_enum};

// The store's methods by what they do; each part adds its own `impl JobStore`, and the
// types it defines are re-exported here, where the API and the tests name them.
mod enqueue;
mod reaper;
mod steps;

pub use self::enqueue::{Enqueued, NewJob};
pub use self::steps::{Attempt, Eligibility, Outcome, Step, StepRefused};

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
    /// Where a job is in its life (SPEC §5.1; also a Postgres CHECK constraint).
    pub enum JobState {
        Queued = "queued",
        Claimed = "claimed",
        Running = "running",
        Succeeded = "succeeded",
        Failed = "failed",
        Cancelled = "cancelled",
    }
}

text_enum! {
    /// Why a job was cancelled, as metrics name it (SPEC §12: fixed causes, never the
    /// canceller's free text, which stays in `cancel_reason`; also a Postgres CHECK).
    pub enum CancelCause {
        /// A caller cancelled it (`POST …/cancel`).
        Requested = "requested",
        /// Its fence's term passed.
        StaleTerm = "stale_term",
        /// Its RunSession was deleted.
        IdentityDeleted = "identity_deleted",
        /// It stayed queued past `PRISM_JOB_QUEUED_TTL_HOURS`.
        Expired = "expired",
        /// Its Run did not honour a cancel request within the grace.
        Grace = "grace",
        /// The Run ended it as cancelled, unasked.
        RunCancelled = "run_cancelled",
    }
}

impl JobState {
    pub fn finished(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }
}

/// A job valid only while `term` is its project's master term (SPEC §5.1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JobFence {
    #[schema(max_length = 63, pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", example = "agents")]
    pub namespace: String,
    #[schema(min_length = 1, max_length = 128, pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$", example = "PID-42")]
    pub project_id: String,
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "crate::json_int::i64")]
    pub term: i64,
}

/// A job as every reader sees it (SPEC §8).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Job {
    pub id: Uuid,
    /// The namespace of the RunSession it was enqueued for: its owner.
    pub namespace: String,
    pub server_instance_id: String,
    pub component_kind: String,
    pub kind: JobKind,
    pub payload: Value,
    pub state: JobState,
    /// Attempts begun (claims) so far.
    pub attempts: i32,
    /// The attempt in flight (claimed or running): the number its steps name (SPEC §12).
    pub attempt: Option<i32>,
    pub max_attempts: i32,
    /// How long one attempt may run.
    pub timeout_seconds: i32,
    pub idempotency_key: Option<String>,
    pub fence: Option<JobFence>,
    pub created_at: DateTime<Utc>,
    pub claimed_at: Option<DateTime<Utc>>,
    pub completed_at: Option<DateTime<Utc>>,
    pub progress: Option<Value>,
    pub result: Option<Value>,
    /// How the last attempt ended when it did not succeed (`visibility_timeout`,
    /// `deadline_exceeded`, or the Run's own error).
    pub last_error: Option<String>,
    /// A cancel was asked for while the job was in flight: the Run should stop it.
    pub cancel_requested: bool,
    /// Why it was (or is being) cancelled: the canceller's reason, `stale_term`,
    /// `identity_deleted`, `run_cancelled`.
    pub cancel_reason: Option<String>,
}

/// The row behind a `Job` (the fence is three nullable columns).
#[derive(sqlx::FromRow)]
struct JobRow {
    id: Uuid,
    namespace: String,
    server_instance_id: String,
    component_kind: String,
    kind: JobKind,
    payload: Value,
    state: JobState,
    attempts: i32,
    max_attempts: i32,
    timeout_seconds: i32,
    idempotency_key: Option<String>,
    fence_namespace: Option<String>,
    fence_project_id: Option<String>,
    fence_term: Option<i64>,
    created_at: DateTime<Utc>,
    claimed_at: Option<DateTime<Utc>>,
    completed_at: Option<DateTime<Utc>>,
    progress: Option<Value>,
    result: Option<Value>,
    last_error: Option<String>,
    cancel_requested: bool,
    cancel_reason: Option<String>,
}

impl From<JobRow> for Job {
    fn from(r: JobRow) -> Self {
        let fence = match (r.fence_namespace, r.fence_project_id, r.fence_term) {
            (Some(namespace), Some(project_id), Some(term)) => Some(JobFence { namespace, project_id, term }),
            _ => None,
        };
        Job {
            id: r.id,
            namespace: r.namespace,
            server_instance_id: r.server_instance_id,
            component_kind: r.component_kind,
            kind: r.kind,
            payload: r.payload,
            state: r.state,
            attempts: r.attempts,
            attempt: matches!(r.state, JobState::Claimed | JobState::Running).then_some(r.attempts),
            max_attempts: r.max_attempts,
            timeout_seconds: r.timeout_seconds,
            idempotency_key: r.idempotency_key,
            fence,
            created_at: r.created_at,
            claimed_at: r.claimed_at,
            completed_at: r.completed_at,
            progress: r.progress,
            result: r.result,
            last_error: r.last_error,
            cancel_requested: r.cancel_requested,
            cancel_reason: r.cancel_reason,
        }
    }
}

fn jobs(rows: Vec<JobRow>) -> Vec<Job> {
    rows.into_iter().map(Job::from).collect()
}

/// The columns of a `JobRow`, of the table aliased `j` where a statement joins.
const COLUMNS: &str = "id, namespace, server_instance_id, component_kind, kind, payload, state, attempts, max_attempts, \
     timeout_seconds, idempotency_key, fence_namespace, fence_project_id, fence_term, created_at, claimed_at, \
     completed_at, progress, result, last_error, cancel_requested_at IS NOT NULL AS cancel_requested, cancel_reason";

/// The cancel reason of the jobs of a deleted RunSession (SPEC §5).
pub const IDENTITY_DELETED: &str = "identity_deleted";
/// The cancel reason of a job the Run itself ended as cancelled, unasked.
pub const RUN_CANCELLED: &str = "run_cancelled";
/// The cancel reason when the canceller gives none.
pub const CANCEL_REQUESTED: &str = "cancel_requested";

/// How an attempt ended without the Run saying so.
pub const VISIBILITY_TIMEOUT: &str = "visibility_timeout";
pub const DEADLINE_EXCEEDED: &str = "deadline_exceeded";

/// Bounds of the enqueue options (SPEC §5.1; also CHECK constraints).
pub const MAX_ATTEMPTS_RANGE: std::ops::RangeInclusive<i32> = 1..=100;
pub const TIMEOUT_SECONDS_RANGE: std::ops::RangeInclusive<i32> = 1..=86_400;
/// What `idempotency_key_ok` accepts.
pub const IDEMPOTENCY_KEY_PATTERN: &str = "^[A-Za-z0-9._:-]{1,128}$";
/// A `last_error` or cancel reason longer than this is cut (CHECK constraints).
pub const MAX_ERROR_CHARS: usize = 1024;
pub const MAX_REASON_CHARS: usize = 256;
/// Most jobs one page of the list answers.
pub const MAX_PAGE: i64 = 500;

pub fn idempotency_key_ok(k: &str) -> bool {
    (1..=128).contains(&k.len()) && k.bytes().all(|c| c.is_ascii_alphanumeric() || b"._:-".contains(&c))
}

/// What a cancel did (SPEC §5.1).
#[derive(Clone, Debug, PartialEq)]
pub enum Cancel {
    /// It was queued: cancelled at once.
    Cancelled(Job),
    /// It is in flight: the Run is told, and the grace runs.
    Requested(Job),
    Finished(Job),
}

/// Which jobs a list answers (SPEC §5.1 read), newest first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobFilter {
    pub server_instance_id: Option<String>,
    pub component_kind: Option<String>,
    pub state: Option<JobState>,
}

/// A keyset position in the newest-first list: the last job of the page before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    created_at_micros: i64,
    id: Uuid,
}

impl Cursor {
    pub fn after(job: &Job) -> Self {
        Cursor { created_at_micros: job.created_at.timestamp_micros(), id: job.id }
    }

    /// Opaque to clients: `<created_at in µs>.<id as 32 hex digits>`. Every text of the
    /// shape `CURSOR_PATTERN` says decodes (the API schema states it).
    pub fn encode(&self) -> String {
        format!("{}.{}", self.created_at_micros.max(0), self.id.simple())
    }

    pub fn decode(s: &str) -> Option<Self> {
        let (micros, id) = s.split_once('.')?;
        if micros.is_empty() || micros.len() > 18 || !micros.bytes().all(|c| c.is_ascii_digit()) || id.len() != 32 {
            return None;
        }
        Some(Cursor { created_at_micros: micros.parse().ok()?, id: Uuid::parse_str(id).ok()? })
    }
}

/// The shape of a cursor (`Cursor::encode`); 18 digits fit an i64 and a timestamp.
pub const CURSOR_PATTERN: &str = "^[0-9]{1,18}[.][0-9a-f]{32}$";

pub use prism_core::run::Reaped;

/// The job defaults and timers (settings).
#[derive(Clone, Copy, Debug)]
pub struct JobSettings {
    /// A claimed job not progressed within this returns to the queue (or fails).
    pub visibility: std::time::Duration,
    pub default_max_attempts: i32,
    pub default_timeout_seconds: i32,
    /// How long a Run has to honour a cancel request before the job is cancelled anyway.
    pub cancel_grace: std::time::Duration,
    /// Queued jobs a namespace may hold at once (SPEC §12): beyond, 429 `quota_exceeded`.
    pub max_queued_per_namespace: i64,
    /// A job still queued after this is cancelled (cause `expired`).
    pub queued_ttl: std::time::Duration,
}

impl Default for JobSettings {
    fn default() -> Self {
        JobSettings {
            visibility: std::time::Duration::from_secs(60),
            default_max_attempts: 3,
            default_timeout_seconds: 600,
            cancel_grace: std::time::Duration::from_secs(30),
            max_queued_per_namespace: 100_000,
            queued_ttl: std::time::Duration::from_secs(72 * 3600),
        }
    }
}

/// The backoff before attempt `attempts + 1`, as SQL: `min(2^attempts, 600)` s, ±20 %.
const BACKOFF: &str = "now() + make_interval(secs => least(power(2, attempts), 600) * (0.8 + random() * 0.4))";

#[derive(Clone)]
pub struct JobStore {
    pool: PgPool,
    settings: JobSettings,
}

impl JobStore {
    pub fn new(pool: PgPool, settings: JobSettings) -> Self {
        Self { pool, settings }
    }

    pub fn settings(&self) -> &JobSettings {
        &self.settings
    }

    fn visibility_secs(&self) -> f64 {
        self.settings.visibility.as_secs_f64()
    }

    async fn get_in(
        &self,
        tx: &mut sqlx::PgConnection,
        namespace: &str,
        id: Uuid,
    ) -> Result<Option<Job>, RegistryError> {
        let sql = format!("SELECT {COLUMNS} FROM runtime_jobs WHERE id = $1 AND namespace = $2");
        let row: Option<JobRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(namespace)
            .fetch_optional(tx)
            .await
            .step("read a job")?;
        Ok(row.map(Job::from))
    }

    /// One job of `namespace` (another namespace's is no job at all).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn get(&self, namespace: &str, id: Uuid) -> Result<Option<Job>, RegistryError> {
        let mut conn = crate::db::acquire(&self.pool).await.step("read a job: connect")?;
        self.get_in(&mut conn, namespace, id).await
    }

    /// A page of `namespace`'s jobs, newest first, after `after`; and the cursor of the
    /// next page when there may be one.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn list(
        &self,
        namespace: &str,
        filter: &JobFilter,
        limit: i64,
        after: Option<Cursor>,
    ) -> Result<(Vec<Job>, Option<Cursor>), RegistryError> {
        let limit = limit.clamp(1, MAX_PAGE);
        let sql = format!(
            "SELECT {COLUMNS} FROM runtime_jobs
             WHERE namespace = $1
               AND ($2::text IS NULL OR server_instance_id = $2)
               AND ($3::text IS NULL OR component_kind = $3)
               AND ($4::text IS NULL OR state = $4)
               AND ($5::timestamptz IS NULL OR (created_at, id) < ($5, $6::uuid))
             ORDER BY created_at DESC, id DESC
             LIMIT $7"
        );
        let rows: Vec<JobRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(namespace)
            .bind(&filter.server_instance_id)
            .bind(&filter.component_kind)
            .bind(filter.state.map(JobState::as_str))
            .bind(after.and_then(|c| DateTime::<Utc>::from_timestamp_micros(c.created_at_micros)))
            .bind(after.map(|c| c.id))
            .bind(limit)
            .fetch_all(&self.pool)
            .await
            .step("list jobs")?;
        let page = jobs(rows);
        let next = (page.len() as i64 == limit).then(|| page.last().map(Cursor::after)).flatten();
        Ok((page, next))
    }

    /// Cancels a job of `namespace`: a queued one at once, one in flight by a request the
    /// Run is told of (cancelled anyway after the grace). `None`: no such job there.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn cancel(
        &self,
        namespace: &str,
        id: Uuid,
        reason: Option<&str>,
    ) -> Result<Option<Cancel>, RegistryError> {
        let reason = reason.map(reason_text).unwrap_or_else(|| CANCEL_REQUESTED.to_string());
        let sql = format!(
            "UPDATE runtime_jobs SET
                 state = CASE WHEN state = 'queued' THEN 'cancelled' ELSE state END,
                 completed_at = CASE WHEN state = 'queued' THEN now() ELSE completed_at END,
                 cancel_requested_at = CASE WHEN state = 'queued' THEN NULL ELSE COALESCE(cancel_requested_at, now()) END,
                 cancel_reason = COALESCE(cancel_reason, $3),
                 cancel_cause = COALESCE(cancel_cause, 'requested'), updated_at = now()
             WHERE id = $1 AND namespace = $2 AND state IN ('queued','claimed','running')
             RETURNING {COLUMNS}"
        );
        let done: Option<JobRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(namespace)
            .bind(&reason)
            .fetch_optional(&self.pool)
            .await
            .step("cancel: update the job")?;
        if let Some(job) = done {
            let job = Job::from(job);
            return Ok(Some(if job.state == JobState::Cancelled {
                Cancel::Cancelled(job)
            } else {
                Cancel::Requested(job)
            }));
        }
        Ok(self
            .get(namespace, id)
            .await?
            .map(|job| if job.state.finished() { Cancel::Finished(job) } else { Cancel::Requested(job) }))
    }

    /// Cancels every unfinished job of `namespace` for `a` (its RunSession was deleted:
    /// no session of that namespace's identity is left to run them, and none of another
    /// namespace may). Returns how many.
    /// Only jobs enqueued before the identity `revoked` was revoked: a finalizer retried
    /// later must not cancel the work of a newer identity that took the address since.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn cancel_for_identity(
        &self,
        namespace: &str,
        a: &RunAddress,
        revoked: Uuid,
    ) -> Result<u64, RegistryError> {
        let done = sqlx::query(
            "UPDATE runtime_jobs SET state = 'cancelled', cancel_reason = COALESCE(cancel_reason, $4),
                 cancel_cause = COALESCE(cancel_cause, 'identity_deleted'), completed_at = now(), visible_at = NULL, deadline_at = NULL, claimed_by_session = NULL, updated_at = now()
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

    /// Jobs by state, and cancelled jobs by reason, of every address (metrics).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn census(&self) -> Result<JobCensus, RegistryError> {
        let by_state: Vec<(JobState, i64)> = sqlx::query_as("SELECT state, count(*) FROM runtime_jobs GROUP BY state")
            .fetch_all(&self.pool)
            .await
            .step("metrics: count jobs by state")?;
        // By fixed cause only; rows an earlier release cancelled have no cause: their reason
        // names it when it is one of the fixed words, else a caller asked.
        let cancelled: Vec<(CancelCause, i64)> = sqlx::query_as(
            "SELECT COALESCE(cancel_cause, CASE WHEN cancel_reason IN ('stale_term','identity_deleted','run_cancelled')
                                               THEN cancel_reason ELSE 'requested' END), count(*)
             FROM runtime_jobs WHERE state = 'cancelled' GROUP BY 1",
        )
        .fetch_all(&self.pool)
        .await
        .step("metrics: count cancellations by reason")?;
        Ok(JobCensus { by_state, cancelled })
    }
}

/// The jobs' gauges (SPEC §5.1 metrics).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobCensus {
    pub by_state: Vec<(JobState, i64)>,
    pub cancelled: Vec<(CancelCause, i64)>,
}

/// Text the CHECK on `last_error` takes: at most `MAX_ERROR_CHARS`, never empty.
fn error_text(e: &str) -> String {
    let cut: String = e.chars().take(MAX_ERROR_CHARS).collect();
    if cut.is_empty() { "failed".into() } else { cut }
}

fn reason_text(r: &str) -> String {
    let cut: String = r.chars().take(MAX_REASON_CHARS).collect();
    if cut.is_empty() { CANCEL_REQUESTED.into() } else { cut }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn texts_fit_their_checks() {
        assert_eq!(error_text("").as_str(), "failed");
        assert_eq!(error_text(&"é".repeat(5000)).chars().count(), MAX_ERROR_CHARS);
        assert_eq!(reason_text(&"x".repeat(300)).len(), MAX_REASON_CHARS);
        assert!(idempotency_key_ok("order-42:retry.1_A"));
        for bad in ["", "has space", "ü", &"k".repeat(129)] {
            assert!(!idempotency_key_ok(bad), "{bad:?}");
        }
    }

    proptest! {
        /// Any cursor round-trips; any text decodes to a cursor or to nothing, never panics.
        #[test]
        fn cursors_round_trip(micros in 0i64..=999_999_999_999_999_999, id in any::<u128>(), text in ".*",
                              shaped in "[0-9]{1,18}[.][0-9a-f]{32}") {
            let c = Cursor { created_at_micros: micros, id: Uuid::from_u128(id) };
            prop_assert_eq!(Cursor::decode(&c.encode()), Some(c));
            let _ = Cursor::decode(&text);
            // Whatever matches the pattern the schema states decodes to a time Postgres takes.
            let decoded = Cursor::decode(&shaped);
            prop_assert!(decoded.is_some_and(|c| DateTime::<Utc>::from_timestamp_micros(c.created_at_micros).is_some()));
        }
    }
}

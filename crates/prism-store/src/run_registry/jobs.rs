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
use sha2::{Digest, Sha256};
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

/// What an enqueue asks for, checked by the API (SPEC §5.1).
#[derive(Clone, Debug, PartialEq)]
pub struct NewJob {
    pub kind: JobKind,
    pub payload: Value,
    pub max_attempts: Option<i32>,
    pub timeout_seconds: Option<i32>,
    pub idempotency_key: Option<String>,
    pub fence: Option<JobFence>,
}

impl NewJob {
    /// The digest an idempotency key remembers: the request's own fields (defaults not
    /// filled in), keys sorted, so the same request retried matches and any other does not.
    pub fn digest(&self) -> String {
        let fields = serde_json::json!({
            "kind": self.kind,
            "payload": canonical(&self.payload),
            "max_attempts": self.max_attempts,
            "timeout_seconds": self.timeout_seconds,
            "fence": self.fence,
        });
        Sha256::digest(canonical(&fields).to_string().as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// `v` with every object's keys in order, whatever order the map type keeps.
fn canonical(v: &Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let mut out = serde_json::Map::new();
            for k in keys {
                out.insert(k.clone(), canonical(&map[k]));
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

/// What an enqueue did.
#[derive(Clone, Debug, PartialEq)]
pub enum Enqueued {
    Created(Job),
    /// The same idempotency key and request within 24 h: the first job, as it is now.
    Existing(Job),
    /// The same key with another request.
    IdempotencyConflict,
    /// The fence's term is not its project's current master term.
    StaleTerm,
    /// The namespace holds its quota of queued jobs already.
    QuotaExceeded {
        limit: i64,
    },
}

/// What a claim may hand a session (SPEC §5.1 eligibility).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Eligibility {
    /// The job kinds the session advertised; `None`: it advertised none, every kind.
    pub kinds: Option<Vec<JobKind>>,
    /// Its `capacity.slots`, when advertised: most jobs in flight at once.
    pub slots: Option<i64>,
}

impl Eligibility {
    /// From a session's advertised snapshot: capabilities that name job kinds, and slots.
    pub fn of(capabilities: &[String], capacity: &std::collections::BTreeMap<String, i64>) -> Self {
        let kinds = (!capabilities.is_empty())
            .then(|| JobKind::ALL.iter().copied().filter(|k| capabilities.iter().any(|c| c == k.as_str())).collect());
        Eligibility { kinds, slots: capacity.get("slots").copied() }
    }

    fn kind_texts(&self) -> Option<Vec<&'static str>> {
        self.kinds.as_ref().map(|ks| ks.iter().map(|k| k.as_str()).collect())
    }
}

/// Why a job step was refused; the job is unchanged in every case.
#[derive(Debug, PartialEq)]
pub enum StepRefused {
    NotFound,
    /// The job belongs to another (server, component).
    CrossTarget,
    /// The job is finished (perhaps cancelled past the grace): 409 `job_finished`.
    Finished(JobState),
    /// Not in a state that allows this step (e.g. queued again after its attempt ended).
    WrongState(JobState),
    /// The attempt outlived its `timeout_seconds`: it has ended, whatever the Run says
    /// now (the reaper records it within seconds).
    DeadlinePassed,
    /// The step is of an attempt that is no longer the job's current one (it timed out and
    /// the job was queued or claimed again): 409 `stale_attempt`, nothing changes.
    StaleAttempt,
}

/// Which attempt a step is of (SPEC §12, "a step names its attempt").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attempt {
    /// The number the claim answered (`attempt`): any session of the identity may step it
    /// while it is the job's current attempt.
    Named(i32),
    /// A step that names none (a Run written before attempts were named): accepted only
    /// while the job's current attempt is the one this session claimed.
    OfSession(Uuid),
}

impl Attempt {
    /// Whether a job whose latest attempt is `attempts`, claimed by `claimed_by`, is still
    /// at this attempt. Mirrors the step's SQL guard, to say why a step was refused.
    fn current(self, attempts: i32, claimed_by: Option<Uuid>) -> bool {
        match self {
            Attempt::Named(n) => n == attempts,
            Attempt::OfSession(session) => claimed_by == Some(session),
        }
    }
}

/// How the Run ends an attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed { retryable: bool, error: Option<String> },
    Cancelled,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    Ack,
    Progress,
    Complete(Outcome),
}

/// A job whose step was refused, as read to say why.
#[derive(sqlx::FromRow)]
struct RefusedJob {
    namespace: String,
    server_instance_id: String,
    component_kind: String,
    state: JobState,
    late: bool,
    attempts: i32,
    claimed_by_session: Option<Uuid>,
}

impl RefusedJob {
    /// Why a step of `attempt` by a session of `namespace` at `a` was refused. Another
    /// namespace's job is no job at all to this session: its existence is not told.
    fn why(&self, namespace: &str, a: &RunAddress, attempt: Attempt) -> StepRefused {
        if self.namespace != namespace {
            return StepRefused::NotFound;
        }
        if self.server_instance_id != a.server_instance_id || self.component_kind != a.component_kind {
            return StepRefused::CrossTarget;
        }
        let current = attempt.current(self.attempts, self.claimed_by_session);
        match self.state {
            // Finished after another attempt: this one's word came too late to count.
            s if s.finished() => match attempt {
                Attempt::Named(n) if n != self.attempts => StepRefused::StaleAttempt,
                _ => StepRefused::Finished(s),
            },
            JobState::Claimed | JobState::Running if !current => StepRefused::StaleAttempt,
            JobState::Claimed | JobState::Running if self.late => StepRefused::DeadlinePassed,
            // Queued again after an attempt ended (timed out, or failed retryably).
            JobState::Queued if self.attempts > 0 => StepRefused::StaleAttempt,
            s => StepRefused::WrongState(s),
        }
    }
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

    /// A job for `a`, owned by `namespace` (the namespace of the RunSession it is for).
    /// With an idempotency key, the first job of that key (24 h) answers a repeat; with a
    /// fence, only while its term is the project's master term. One transaction: 20
    /// concurrent identical requests make one job.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn enqueue(&self, namespace: &str, a: &RunAddress, new: &NewJob) -> Result<Enqueued, RegistryError> {
        for _ in 0..3 {
            if let Some(done) = self.try_enqueue(namespace, a, new).await? {
                return Ok(done);
            }
        }
        Err(RegistryError::Unavailable("enqueue: the idempotency key kept changing hands; retry".into()))
    }

    /// One try of `enqueue`; `None` when the key expired and was pruned between its two
    /// reads (try again).
    async fn try_enqueue(
        &self,
        namespace: &str,
        a: &RunAddress,
        new: &NewJob,
    ) -> Result<Option<Enqueued>, RegistryError> {
        let mut tx = crate::db::begin(&self.pool).await.step("enqueue: begin")?;
        let id = Uuid::new_v4();
        if let Some(key) = &new.idempotency_key {
            let digest = new.digest();
            // Waits on a concurrent insert of the same key, then sees it. An expired key
            // (over 24 h) is taken over by this request.
            let taken: Option<Uuid> = sqlx::query_scalar(
                "INSERT INTO runtime_job_idempotency
                     (namespace, server_instance_id, component_kind, idempotency_key, job_id, request_digest)
                 VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (namespace, server_instance_id, component_kind, idempotency_key) DO UPDATE
                     SET job_id = EXCLUDED.job_id, request_digest = EXCLUDED.request_digest, created_at = now()
                     WHERE runtime_job_idempotency.created_at < now() - interval '24 hours'
                 RETURNING job_id",
            )
            .bind(namespace)
            .bind(&a.server_instance_id)
            .bind(&a.component_kind)
            .bind(key)
            .bind(id)
            .bind(&digest)
            .fetch_optional(&mut *tx)
            .await
            .step("enqueue: take the idempotency key")?;
            if taken.is_none() {
                let first: Option<(Uuid, String)> = sqlx::query_as(
                    "SELECT job_id, request_digest FROM runtime_job_idempotency
                     WHERE namespace = $1 AND server_instance_id = $2 AND component_kind = $3 AND idempotency_key = $4",
                )
                .bind(namespace)
                .bind(&a.server_instance_id)
                .bind(&a.component_kind)
                .bind(key)
                .fetch_optional(&mut *tx)
                .await
                .step("enqueue: read the idempotency key")?;
                let Some((job_id, first_digest)) = first else {
                    return Ok(None);
                };
                if first_digest != digest {
                    return Ok(Some(Enqueued::IdempotencyConflict));
                }
                let job = self.get_in(&mut tx, namespace, job_id).await?;
                tx.commit().await.step("enqueue: commit")?;
                return Ok(job.map(Enqueued::Existing));
            }
        }
        if let Some(f) = &new.fence {
            // FOR SHARE: a change of master holds the project row until it commits, so a
            // fenced job is never inserted after its term moved on (that change's trigger
            // would not see it).
            let current: Option<(i64, bool)> = sqlx::query_as(
                "SELECT term, master_id IS NOT NULL FROM controller_projects
                 WHERE namespace = $1 AND project_id = $2 FOR SHARE",
            )
            .bind(&f.namespace)
            .bind(&f.project_id)
            .fetch_optional(&mut *tx)
            .await
            .step("enqueue: check the fence's term")?;
            if current != Some((f.term, true)) {
                return Ok(Some(Enqueued::StaleTerm));
            }
        }
        // The namespace's queued jobs, from the trigger-kept count (16 rows at most, whatever
        // the backlog). Concurrent enqueues may pass the quota by as many as race here: a
        // bound, not an exact count.
        let queued: i64 = sqlx::query_scalar(
            "SELECT COALESCE(sum(queued), 0)::int8 FROM runtime_job_queue_counts WHERE namespace = $1",
        )
        .bind(namespace)
        .fetch_one(&mut *tx)
        .await
        .step("enqueue: count the namespace's queued jobs")?;
        if queued >= self.settings.max_queued_per_namespace {
            return Ok(Some(Enqueued::QuotaExceeded { limit: self.settings.max_queued_per_namespace }));
        }
        let sql = format!(
            "INSERT INTO runtime_jobs (id, namespace, server_instance_id, component_kind, kind, payload, max_attempts,
                 timeout_seconds, idempotency_key, fence_namespace, fence_project_id, fence_term)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) RETURNING {COLUMNS}"
        );
        let row: JobRow = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(namespace)
            .bind(&a.server_instance_id)
            .bind(&a.component_kind)
            .bind(new.kind)
            .bind(&new.payload)
            .bind(new.max_attempts.unwrap_or(self.settings.default_max_attempts))
            .bind(new.timeout_seconds.unwrap_or(self.settings.default_timeout_seconds))
            .bind(&new.idempotency_key)
            .bind(new.fence.as_ref().map(|f| &f.namespace))
            .bind(new.fence.as_ref().map(|f| &f.project_id))
            .bind(new.fence.as_ref().map(|f| f.term))
            .fetch_one(&mut *tx)
            .await
            .step("enqueue: insert job")?;
        tx.commit().await.step("enqueue: commit")?;
        Ok(Some(Enqueued::Created(row.into())))
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

    /// Claims up to `max` of the oldest eligible queued jobs of `namespace` for the
    /// session's own address: kinds it advertised, within its free slots, past their
    /// backoff, and for a fenced job only while its term is current. With slots, claims
    /// of one address take turns, so concurrent claims never exceed them; SKIP LOCKED
    /// keeps claims off each other's rows otherwise.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn claim(
        &self,
        namespace: &str,
        a: &RunAddress,
        session_id: Uuid,
        max: i64,
        eligible: &Eligibility,
    ) -> Result<Vec<Job>, RegistryError> {
        // One round trip: the rules are the database's function (its migration says why
        // the count comes after the turn and why no stale-term job can be handed out).
        let sql = format!("SELECT {COLUMNS} FROM runtime_jobs_claim($1, $2, $3, $4, $5, $6, $7, $8)");
        let rows: Vec<JobRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(namespace)
            .bind(&a.server_instance_id)
            .bind(&a.component_kind)
            .bind(session_id)
            .bind(max)
            .bind(self.visibility_secs())
            .bind(eligible.kind_texts())
            .bind(eligible.slots)
            .fetch_all(&self.pool)
            .await
            .step("claim: take eligible jobs")?;
        let mut claimed = jobs(rows);
        claimed.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        Ok(claimed)
    }

    /// The jobs in flight at `a` (of `namespace`) whose cancel was requested: what the
    /// Run must stop, told in its heartbeat and claim answers.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn cancel_requested(&self, namespace: &str, a: &RunAddress) -> Result<Vec<Uuid>, RegistryError> {
        Ok(sqlx::query_scalar(
            "SELECT id FROM runtime_jobs
             WHERE namespace = $1 AND server_instance_id = $2 AND component_kind = $3
               AND cancel_requested_at IS NOT NULL AND state IN ('claimed','running')
             ORDER BY cancel_requested_at, id LIMIT 1000",
        )
        .bind(namespace)
        .bind(&a.server_instance_id)
        .bind(&a.component_kind)
        .fetch_all(&self.pool)
        .await
        .step("read the cancel requests of a Run")?)
    }

    /// Ack, progress or complete a job of the caller's own address and namespace. A Run
    /// that said hello again (new session, same identity) may finish what its previous
    /// session claimed.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "jobs"))]
    pub async fn step(
        &self,
        namespace: &str,
        a: &RunAddress,
        id: Uuid,
        step: &Step,
        attempt: Attempt,
        body: Option<&Value>,
    ) -> Result<Result<Job, StepRefused>, RegistryError> {
        // $1-$4 and $6-$8 in every step; $5 is the visibility timeout for ack/progress, the
        // error for a complete; $7/$8 the attempt (its number, or the session that claimed
        // it). Nothing of the caller's is spliced into the text.
        let set = match step {
            Step::Ack => {
                "state = 'running', progress = COALESCE($4::jsonb, progress), visible_at = now() + make_interval(secs => $5::float8)"
            }
            Step::Progress => {
                "state = 'running', progress = $4::jsonb, visible_at = now() + make_interval(secs => $5::float8)"
            }
            Step::Complete(Outcome::Succeeded) => {
                "state = 'succeeded', result = $4::jsonb, completed_at = now(), visible_at = NULL, deadline_at = NULL"
            }
            Step::Complete(Outcome::Cancelled) => {
                "state = 'cancelled', result = $4::jsonb, completed_at = now(), visible_at = NULL, deadline_at = NULL,
                 cancel_reason = COALESCE(cancel_reason, 'run_cancelled'),
                 cancel_cause = COALESCE(cancel_cause, 'run_cancelled')"
            }
            // A retryable failure with attempts left goes back to the queue after the
            // backoff, unless its cancel was requested; otherwise it failed for good.
            Step::Complete(Outcome::Failed { retryable: true, .. }) => {
                "state = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled'
                              WHEN attempts < max_attempts THEN 'queued' ELSE 'failed' END,
                 result = $4::jsonb, last_error = $5::text,
                 completed_at = CASE WHEN cancel_requested_at IS NULL AND attempts < max_attempts THEN NULL ELSE now() END,
                 eligible_at = CASE WHEN cancel_requested_at IS NULL AND attempts < max_attempts THEN BACKOFF
                                    ELSE eligible_at END,
                 claimed_by_session = NULL, visible_at = NULL, deadline_at = NULL"
            }
            Step::Complete(Outcome::Failed { retryable: false, .. }) => {
                "state = 'failed', result = $4::jsonb, last_error = $5::text, completed_at = now(), visible_at = NULL,
                 deadline_at = NULL"
            }
        };
        let set = set.replace("BACKOFF", BACKOFF);
        // `named`: the attempt the step names, for the history row of the change it makes
        // (a setting of this statement's own transaction; the events trigger reads it).
        let sql = format!(
            "WITH named AS (SELECT set_config('prism.step_attempt', COALESCE($7::int4::text, ''), true))
             UPDATE runtime_jobs SET {set}, updated_at = now()
             WHERE id = $1 AND server_instance_id = $2 AND component_kind = $3 AND namespace = $6
               AND state IN ('claimed','running') AND deadline_at >= now()
               AND CASE WHEN $7::int4 IS NOT NULL THEN attempts = $7::int4
                        ELSE claimed_by_session IS NOT DISTINCT FROM $8::uuid END
               AND (SELECT count(*) FROM named) = 1
             RETURNING {COLUMNS}"
        );
        let update = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(&a.server_instance_id)
            .bind(&a.component_kind)
            .bind(body);
        let update = match step {
            Step::Ack | Step::Progress => update.bind(Some(self.visibility_secs().to_string())),
            Step::Complete(Outcome::Failed { error, .. }) => {
                update.bind(Some(error_text(error.as_deref().unwrap_or("failed"))))
            }
            Step::Complete(_) => update.bind(None::<String>),
        }
        .bind(namespace);
        let update = match attempt {
            Attempt::Named(n) => update.bind(Some(n)).bind(None::<Uuid>),
            Attempt::OfSession(session) => update.bind(None::<i32>).bind(Some(session)),
        };
        let done: Option<JobRow> = update.fetch_optional(&self.pool).await.step("job step: update the job")?;
        if let Some(job) = done {
            return Ok(Ok(job.into()));
        }
        // Say why, without changing anything. Another namespace's job is no job at all
        // to this session: its existence is not told.
        let existing: Option<RefusedJob> = sqlx::query_as(
            "SELECT namespace, server_instance_id, component_kind, state, COALESCE(deadline_at < now(), false) AS late,
                    attempts, claimed_by_session
             FROM runtime_jobs WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .step("job step: read the refused job")?;
        Ok(Err(match existing {
            None => StepRefused::NotFound,
            Some(j) => j.why(namespace, a, attempt),
        }))
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
    use serde_json::json;

    fn new_job(payload: Value) -> NewJob {
        NewJob {
            kind: JobKind::Config,
            payload,
            max_attempts: None,
            timeout_seconds: None,
            idempotency_key: Some("k".into()),
            fence: None,
        }
    }

    #[test]
    fn the_digest_is_the_request_not_its_key_order() {
        let a = new_job(json!({"a": 1, "b": {"c": [1, 2], "d": null}}));
        let b = new_job(serde_json::from_str(r#"{"b": {"d": null, "c": [1, 2]}, "a": 1}"#).expect("json"));
        assert_eq!(a.digest(), b.digest());
        assert_ne!(a.digest(), new_job(json!({"a": 2})).digest());
        let mut c = a.clone();
        c.max_attempts = Some(3);
        assert_ne!(a.digest(), c.digest(), "an explicit default is another request");
        let mut d = a.clone();
        d.idempotency_key = Some("other".into());
        assert_eq!(a.digest(), d.digest(), "the key itself is not part of the request");
    }

    #[test]
    fn eligibility_takes_the_kinds_among_the_capabilities_and_the_slots() {
        let caps = vec!["lifecycle".to_string(), "gpu".to_string(), "log".to_string()];
        let cap = [("slots".to_string(), 2), ("mem".to_string(), 9)].into();
        let e = Eligibility::of(&caps, &cap);
        assert_eq!(e.kinds, Some(vec![JobKind::Lifecycle, JobKind::Log]));
        assert_eq!(e.slots, Some(2));
        assert_eq!(Eligibility::of(&[], &Default::default()), Eligibility { kinds: None, slots: None });
        // Capabilities that name no job kind: no job is eligible (not every kind).
        assert_eq!(Eligibility::of(&["gpu".to_string()], &Default::default()).kinds, Some(vec![]));
    }

    #[test]
    fn a_refused_step_says_which_attempt_it_missed() {
        let here = RunAddress { server_instance_id: "srv".into(), component_kind: "run".into() };
        let (mine, other) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let job = |state, attempts, claimed_by, late| RefusedJob {
            namespace: "ns".into(),
            server_instance_id: "srv".into(),
            component_kind: "run".into(),
            state,
            late,
            attempts,
            claimed_by_session: claimed_by,
        };
        let why = |j: RefusedJob, attempt| j.why("ns", &here, attempt);
        use Attempt::{Named, OfSession};
        // Another attempt holds it, or it went back to the queue: stale, whatever the deadline.
        assert_eq!(why(job(JobState::Claimed, 2, Some(mine), true), Named(1)), StepRefused::StaleAttempt);
        assert_eq!(why(job(JobState::Running, 2, Some(other), false), OfSession(mine)), StepRefused::StaleAttempt);
        assert_eq!(why(job(JobState::Queued, 1, None, false), Named(1)), StepRefused::StaleAttempt);
        assert_eq!(
            why(job(JobState::Queued, 0, None, false), OfSession(mine)),
            StepRefused::WrongState(JobState::Queued)
        );
        // Its own attempt, too late.
        assert_eq!(why(job(JobState::Running, 2, Some(other), true), Named(2)), StepRefused::DeadlinePassed);
        assert_eq!(why(job(JobState::Running, 2, Some(mine), true), OfSession(mine)), StepRefused::DeadlinePassed);
        // Finished: by its own attempt (or unnamed) finished, by a later one stale.
        assert_eq!(why(job(JobState::Succeeded, 2, None, false), Named(2)), StepRefused::Finished(JobState::Succeeded));
        assert_eq!(why(job(JobState::Failed, 3, None, false), Named(1)), StepRefused::StaleAttempt);
        assert_eq!(
            why(job(JobState::Cancelled, 3, None, false), OfSession(mine)),
            StepRefused::Finished(JobState::Cancelled)
        );
        // Tenancy and target come first: nothing about attempts is told to another tenant.
        assert_eq!(job(JobState::Claimed, 2, Some(mine), false).why("other", &here, Named(1)), StepRefused::NotFound);
        let there = RunAddress { server_instance_id: "srv-2".into(), component_kind: "run".into() };
        assert_eq!(job(JobState::Claimed, 2, Some(mine), false).why("ns", &there, Named(1)), StepRefused::CrossTarget);
    }

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

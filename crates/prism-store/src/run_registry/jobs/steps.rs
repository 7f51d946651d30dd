//! A Run's side of its jobs: claim the eligible ones, hear which to stop, and step an
//! attempt (ack, progress, complete). Every step names its attempt (SPEC §12): one of an
//! attempt that already ended changes nothing, and a refusal says why.

use serde_json::Value;
use uuid::Uuid;

use super::{BACKOFF, COLUMNS, Job, JobKind, JobRow, JobState, JobStore, error_text, jobs};
use crate::db::Step as _;
use crate::run_registry::{RegistryError, RunAddress};

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

impl JobStore {
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

//! A Run's steps on a job it claimed: ack, progress, complete. Each names the attempt its
//! claim answered (SPEC §12).

use std::net::IpAddr;
use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use utoipa::ToSchema;
use uuid::Uuid;

use super::{authenticated, job_finished, job_id, optional_json, session_refused};
use crate::AppState;
use crate::docs::JsonbValue;
use crate::docs::{
    BadRequest, Conflict, Forbidden, Internal, Invalid, NotFound, TooLarge, TooManyRequests, Unauthenticated,
    Unavailable,
};
use crate::error::{ApiBody, ApiError, ApiPath, ClientAddr};
use crate::reconcilers::ReconcileMetrics as _;
use crate::run_registry::jobs::{Job, JobState, MAX_ERROR_CHARS, Outcome as JobOutcome, Step, StepRefused};
use crate::run_registry::service::{StepError, check_jsonb};

/// The attempt a step is of: the `attempt` its claim answered (SPEC §12). Without it, the
/// step counts only while the job's current attempt is the one this session claimed.
fn checked_attempt(attempt: Option<i64>) -> Result<Option<i32>, ApiError> {
    attempt
        .map(|n| {
            i32::try_from(n)
                .ok()
                .filter(|n| (1..=MAX_ATTEMPT).contains(n))
                .ok_or_else(|| ApiError::invalid(format!("attempt must be 1 to {MAX_ATTEMPT}")))
        })
        .transpose()
}

/// The most attempts a job can have (`max_attempts` is 1 to 100).
const MAX_ATTEMPT: i32 = 100;

/// An ack's optional body: the attempt it is of.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AckBody {
    /// The `attempt` the claim answered for this job.
    #[schema(minimum = 1, maximum = 100)]
    #[serde(default, deserialize_with = "crate::json_int::opt_i64")]
    attempt: Option<i64>,
}

impl AckBody {
    /// The attempt an ack body (maybe empty) names, checked.
    pub fn parse(body: &[u8]) -> Result<Option<i32>, ApiError> {
        checked_attempt(optional_json::<AckBody>(body)?.and_then(|b| b.attempt))
    }
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ProgressBody {
    #[schema(value_type = JsonbValue)]
    progress: Value,
    /// The `attempt` the claim answered for this job.
    #[schema(minimum = 1, maximum = 100)]
    #[serde(default, deserialize_with = "crate::json_int::opt_i64")]
    attempt: Option<i64>,
}

impl ProgressBody {
    /// The progress a body reports, and the attempt it names, checked.
    pub fn parse(body: &[u8]) -> Result<(Value, Option<i32>), ApiError> {
        let b: ProgressBody =
            optional_json(body)?.ok_or_else(|| ApiError::invalid("body {\"progress\": {...}} is required"))?;
        check_jsonb("progress", &b.progress).map_err(|e| ApiError::invalid(e.0))?;
        Ok((b.progress, checked_attempt(b.attempt)?))
    }
}

#[derive(Deserialize, ToSchema, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Succeeded,
    Failed,
    /// The Run stopped it (asked to, or of its own accord).
    Cancelled,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompleteBody {
    outcome: Outcome,
    /// Absent or null: `{}`.
    #[serde(default)]
    #[schema(value_type = Option<JsonbValue>)]
    result: Option<Value>,
    /// A failure worth another attempt (default false): queued again after a backoff
    /// while attempts are left.
    #[serde(default)]
    retryable: Option<bool>,
    /// What went wrong (kept as the job's `last_error`).
    #[serde(default)]
    #[schema(min_length = 1, max_length = 1024, pattern = "^[^\\u0000]*$")]
    error: Option<String>,
    /// The `attempt` the claim answered for this job.
    #[schema(minimum = 1, maximum = 100)]
    #[serde(default, deserialize_with = "crate::json_int::opt_i64")]
    attempt: Option<i64>,
}

/// A completion's `error`: 1 to 1024 characters, any but NUL (a stack trace keeps its
/// lines; Postgres `text` cannot hold a NUL).
pub fn job_error_ok(e: &str) -> bool {
    !e.is_empty() && e.chars().count() <= MAX_ERROR_CHARS && !e.contains('\0')
}

impl CompleteBody {
    /// The step, result and attempt a body reports, checked.
    pub fn parse(body: &[u8]) -> Result<(Step, Value, Option<i32>), ApiError> {
        let b: CompleteBody = optional_json(body)?.ok_or_else(|| {
            ApiError::invalid(
                "body {\"outcome\": \"succeeded\"|\"failed\"|\"cancelled\", \"result\": {...}} is required",
            )
        })?;
        let result = b.result.unwrap_or(json!({}));
        check_jsonb("result", &result).map_err(|e| ApiError::invalid(e.0))?;
        if let Some(e) = &b.error
            && !job_error_ok(e)
        {
            return Err(ApiError::invalid("error must be 1 to 1024 characters without NUL"));
        }
        let outcome = match b.outcome {
            Outcome::Succeeded => JobOutcome::Succeeded,
            Outcome::Cancelled => JobOutcome::Cancelled,
            Outcome::Failed => JobOutcome::Failed { retryable: b.retryable.unwrap_or(false), error: b.error },
        };
        Ok((Step::Complete(outcome), result, checked_attempt(b.attempt)?))
    }
}

/// Acknowledge a claimed job: the Run is working on it
#[utoipa::path(
    post,
    path = "/api/v1/runtime/jobs/{id}/ack",
    tag = "runtime",
    params(("id" = Uuid, Path, description = "The job id")),
    request_body(content = Option<AckBody>, description = "Optional: the attempt it acknowledges"),
    security(("session" = [])),
    responses(
        (status = 200, description = "The job now", body = Job),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 403, response = Forbidden),
        (status = 404, response = NotFound),
        (status = 409, response = Conflict),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn ack(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
    ApiBody(body): ApiBody,
) -> Result<Json<Job>, ApiError> {
    let id = job_id(&id)?;
    let attempt = AckBody::parse(&body)?;
    job_step(&state, &headers, peer, id, Step::Ack, attempt, None).await
}

/// Report a job's progress
#[utoipa::path(
    post,
    path = "/api/v1/runtime/jobs/{id}/progress",
    tag = "runtime",
    params(("id" = Uuid, Path, description = "The job id")),
    request_body = ProgressBody,
    security(("session" = [])),
    responses(
        (status = 200, description = "The job now", body = Job),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 403, response = Forbidden),
        (status = 404, response = NotFound),
        (status = 409, response = Conflict),
        (status = 413, response = TooLarge),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn progress(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
    ApiBody(body): ApiBody,
) -> Result<Json<Job>, ApiError> {
    let id = job_id(&id)?;
    let (progress, attempt) = ProgressBody::parse(&body)?;
    job_step(&state, &headers, peer, id, Step::Progress, attempt, Some(progress)).await
}

/// Complete a job: succeeded or failed, with its result
#[utoipa::path(
    post,
    path = "/api/v1/runtime/jobs/{id}/complete",
    tag = "runtime",
    params(("id" = Uuid, Path, description = "The job id")),
    request_body = CompleteBody,
    security(("session" = [])),
    responses(
        (status = 200, description = "The job now", body = Job),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 403, response = Forbidden),
        (status = 404, response = NotFound),
        (status = 409, response = Conflict),
        (status = 413, response = TooLarge),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn complete(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
    ApiBody(body): ApiBody,
) -> Result<Json<Job>, ApiError> {
    let id = job_id(&id)?;
    let (step, result, attempt) = CompleteBody::parse(&body)?;
    let job = job_step(&state, &headers, peer, id, step, attempt, Some(result)).await?;
    state.metrics.attempts_ended(
        match job.state {
            JobState::Queued => "requeued",
            JobState::Cancelled => "cancelled",
            JobState::Failed => "failed",
            _ => "succeeded",
        },
        1,
    );
    Ok(job)
}

/// A job step once its input is checked: the session, then the step itself.
async fn job_step(
    state: &AppState,
    headers: &HeaderMap,
    peer: Option<IpAddr>,
    id: Uuid,
    step: Step,
    attempt: Option<i32>,
    value: Option<Value>,
) -> Result<Json<Job>, ApiError> {
    let (address, session) = authenticated(state, headers, peer).await?;
    match state.registry.step(&address, &session, id, &step, attempt, value.as_ref()).await? {
        Ok(job) => Ok(Json(job)),
        Err(StepError::Session(refused)) => Err(session_refused(refused)),
        Err(StepError::Job(StepRefused::NotFound)) => {
            Err(ApiError::not_found("job_not_found", format!("job {id} not found")))
        }
        Err(StepError::Job(StepRefused::CrossTarget)) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "cross_target",
            "this job is addressed to another server/component",
        )),
        Err(StepError::Job(StepRefused::Finished(s))) => Err(job_finished(s)),
        Err(StepError::Job(StepRefused::DeadlinePassed)) => Err(ApiError::conflict(
            "deadline_exceeded",
            "the attempt passed its timeout_seconds: it has ended (retried or failed, as its attempts allow)",
        )),
        Err(StepError::Job(StepRefused::StaleAttempt)) => Err(ApiError::conflict(
            "stale_attempt",
            "this step is of an attempt that is no longer the job's current one: it has ended and changes nothing",
        )),
        Err(StepError::Job(StepRefused::WrongState(s))) => {
            Err(ApiError::conflict("invalid_state", format!("job is {s}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::any_input::{body_bytes, is_client_error};
    use proptest::prelude::*;

    fn no_nul(v: &Value) -> bool {
        check_jsonb("v", v).is_ok()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn progress_bodies(bytes in body_bytes(json!({"progress": {"pct": 50}}))) {
            match ProgressBody::parse(&bytes) {
                Ok((v, attempt)) => prop_assert!(no_nul(&v) && attempt.is_none_or(|n| (1..=MAX_ATTEMPT).contains(&n))),
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
            }
        }

        #[test]
        fn ack_bodies(bytes in body_bytes(json!({"attempt": 2}))) {
            match AckBody::parse(&bytes) {
                Ok(attempt) => prop_assert!(attempt.is_none_or(|n| (1..=MAX_ATTEMPT).contains(&n))),
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
            }
        }

        #[test]
        fn complete_bodies(bytes in body_bytes(json!({"outcome": "succeeded", "result": {"ok": true}}))) {
            match CompleteBody::parse(&bytes) {
                Ok((_, v, attempt)) => prop_assert!(no_nul(&v) && attempt.is_none_or(|n| (1..=MAX_ATTEMPT).contains(&n))),
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
            }
        }
    }
}

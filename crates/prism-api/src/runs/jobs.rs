//! The job routes of platform identities (Kubernetes tokens): enqueue a job for a Run,
//! read one, list a namespace's, cancel one.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{RESOURCE, job_finished, job_id, optional_json};
use crate::AppState;
use crate::agents::{check_identifier, check_namespace};
use crate::auth::Caller;
use crate::docs::JsonbValue;
use crate::docs::{
    BadRequest, Conflict, Forbidden, Internal, Invalid, NotFound, TooLarge, TooManyRequests, Unauthenticated,
    Unavailable, UnsupportedMediaType,
};
use crate::error::{ApiBody, ApiError, ApiJson, ApiPath, ApiQuery, ClientAddr};
use crate::run_registry::RunAddress;
use crate::run_registry::jobs::{
    Cancel, Cursor, Enqueued, IDEMPOTENCY_KEY_PATTERN, Job, JobFence, JobFilter, JobKind, JobState, MAX_ATTEMPTS_RANGE,
    MAX_PAGE, MAX_REASON_CHARS, NewJob, TIMEOUT_SECONDS_RANGE, idempotency_key_ok,
};
use crate::run_registry::service::{check_address, check_jsonb, server_instance_id_ok};

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnqueueBody {
    /// The namespace of the RunSession the job is for (its owner). Absent: the namespace
    /// of the RunSession that holds the address now.
    #[serde(default)]
    #[schema(max_length = 63, pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", example = "runtime")]
    namespace: Option<String>,
    #[schema(min_length = 1, max_length = 253, pattern = "^[A-Za-z0-9._-]+$", example = "srv-eu1-7")]
    server_instance_id: String,
    #[schema(min_length = 1, max_length = 63, pattern = "^[a-z0-9-]+$", example = "run")]
    component_kind: String,
    kind: JobKind,
    /// Absent or null: `{}`.
    #[serde(default)]
    #[schema(value_type = JsonbValue)]
    payload: Value,
    /// Attempts the job gets (default `PRISM_JOB_MAX_ATTEMPTS`, 3).
    #[serde(default, deserialize_with = "crate::json_int::opt_i64")]
    #[schema(minimum = 1, maximum = 100)]
    max_attempts: Option<i64>,
    /// How long one attempt may run (default `PRISM_JOB_TIMEOUT_SECONDS`, 600).
    #[serde(default, deserialize_with = "crate::json_int::opt_i64")]
    #[schema(minimum = 1, maximum = 86400)]
    timeout_seconds: Option<i64>,
    /// The same key for the same namespace and address within 24 h answers the first
    /// job (200) instead of queueing another; with another request, 409.
    #[serde(default)]
    #[schema(min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9._:-]{1,128}$", example = "deploy-42")]
    idempotency_key: Option<String>,
    /// Valid only while `term` is the project's master term (the caller also needs `get`
    /// on registrations in its namespace); 409 `stale_term` otherwise.
    #[serde(default)]
    fence: Option<JobFence>,
}

impl EnqueueBody {
    pub fn check(&self) -> Result<(), ApiError> {
        if let Some(ns) = &self.namespace {
            check_namespace(ns)?;
        }
        check_address(&self.server_instance_id, &self.component_kind).map_err(|e| ApiError::invalid(e.0))?;
        check_jsonb("payload", &self.payload).map_err(|e| ApiError::invalid(e.0))?;
        if let Some(n) = self.max_attempts
            && !(i64::from(*MAX_ATTEMPTS_RANGE.start())..=i64::from(*MAX_ATTEMPTS_RANGE.end())).contains(&n)
        {
            return Err(ApiError::invalid("max_attempts must be 1 to 100"));
        }
        if let Some(n) = self.timeout_seconds
            && !(i64::from(*TIMEOUT_SECONDS_RANGE.start())..=i64::from(*TIMEOUT_SECONDS_RANGE.end())).contains(&n)
        {
            return Err(ApiError::invalid("timeout_seconds must be 1 to 86400"));
        }
        if let Some(k) = &self.idempotency_key
            && !idempotency_key_ok(k)
        {
            return Err(ApiError::invalid(format!("idempotency_key must match {IDEMPOTENCY_KEY_PATTERN}")));
        }
        if let Some(f) = &self.fence {
            check_fence(f)?;
        }
        Ok(())
    }

    fn new_job(&self) -> NewJob {
        NewJob {
            kind: self.kind,
            payload: if self.payload.is_null() { json!({}) } else { self.payload.clone() },
            // In range: `check` ran.
            max_attempts: self.max_attempts.and_then(|n| i32::try_from(n).ok()),
            timeout_seconds: self.timeout_seconds.and_then(|n| i32::try_from(n).ok()),
            idempotency_key: self.idempotency_key.clone(),
            fence: self.fence.clone(),
        }
    }
}

pub fn check_fence(f: &JobFence) -> Result<(), ApiError> {
    check_namespace(&f.namespace)?;
    check_identifier("fence.project_id", &f.project_id, prism_core::limits::PROJECT_ID_MAX)?;
    if f.term < 1 {
        return Err(ApiError::invalid("fence.term must be an integer >= 1"));
    }
    Ok(())
}

/// Enqueue a job for a Run
///
/// The caller must be allowed to `update` the RunSession of that server/component. The
/// job belongs to that RunSession's namespace. A caller without that right gets the same
/// 403 whether or not such a RunSession exists (a 404 only when `namespace` is given and
/// the caller may update RunSessions there). 201 with a new job; 200 with the first job
/// of a repeated `idempotency_key`; 409 `idempotency_conflict` (the key with another
/// request) or `stale_term` (the fence's term is not current).
#[utoipa::path(
    post,
    path = "/api/v1/runtime/jobs",
    tag = "runtime",
    request_body = EnqueueBody,
    security(("kubernetes" = [])),
    responses(
        (status = 201, description = "Queued", body = Job),
        (status = 200, description = "The first job of this idempotency key, as it is now", body = Job),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 403, response = Forbidden),
        (status = 404, response = NotFound),
        (status = 409, response = Conflict),
        (status = 413, response = TooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn enqueue(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiJson(body): ApiJson<EnqueueBody>,
) -> Result<(StatusCode, Json<Job>), ApiError> {
    body.check()?;
    let caller = state.auth.authenticate(&headers, peer).await?;
    let address =
        RunAddress { server_instance_id: body.server_instance_id.clone(), component_kind: body.component_kind.clone() };
    let (status, job) = enqueue_as(&state, &caller, body.namespace.as_deref(), &address, &body.new_job()).await?;
    Ok((status, Json(job)))
}

/// Enqueue by `caller` (HTTP or MCP): authorized on the RunSession of `address` (in
/// `namespace`, else wherever it is now) before anything of it is told, and on the
/// fence's registrations before the project is read.
pub async fn enqueue_as(
    state: &AppState,
    caller: &Caller,
    namespace: Option<&str>,
    address: &RunAddress,
    new: &NewJob,
) -> Result<(StatusCode, Job), ApiError> {
    // One refusal for "no such RunSession", "not yours" and "another tenant's": it names
    // only what the caller said.
    let refused = || {
        ApiError::forbidden(format!(
            "{} may not enqueue jobs for {address}{} (or no RunSession there has this address)",
            caller.username,
            namespace.map(|ns| format!(" in namespace {ns}")).unwrap_or_default()
        ))
    };
    let identity = match namespace {
        Some(ns) => state.registry.identity(Some(ns), address).await?,
        None => state.registry.identity(None, address).await?,
    };
    let Some(identity) = identity else {
        if let Some(ns) = namespace
            && state.auth.allowed(caller, "update", RESOURCE, ns, None).await?
        {
            return Err(ApiError::not_found("unknown_identity", format!("no RunSession of {ns} has this address")));
        }
        return Err(refused());
    };
    let (namespace, name) = (&identity.spec.namespace, &identity.spec.name);
    if !state.auth.allowed(caller, "update", RESOURCE, namespace, Some(name)).await? {
        return Err(refused());
    }
    // A fence reads the election: the caller must be allowed to read it there, before
    // the project is looked up.
    if let Some(f) = &new.fence {
        state.auth.authorize(caller, "get", crate::agents::RESOURCE, &f.namespace).await?;
    }
    enqueued(state.registry.enqueue(namespace, address, new).await?)
}

/// An enqueue's answer: 201 new, 200 the first job of its key, or the 409 that refused it.
fn enqueued(done: Enqueued) -> Result<(StatusCode, Job), ApiError> {
    match done {
        Enqueued::Created(job) => Ok((StatusCode::CREATED, job)),
        Enqueued::Existing(job) => Ok((StatusCode::OK, job)),
        Enqueued::IdempotencyConflict => Err(ApiError::conflict(
            "idempotency_conflict",
            "this idempotency_key was used within 24 h with another request",
        )),
        Enqueued::QuotaExceeded { limit } => Err(ApiError::quota_exceeded(format!(
            "the namespace holds {limit} queued jobs already (PRISM_MAX_QUEUED_JOBS_PER_NAMESPACE)"
        ))),
        Enqueued::StaleTerm => {
            Err(ApiError::conflict("stale_term", "the fence's term is not its project's current master term"))
        }
    }
}

/// Where a job is read or cancelled: the namespace the caller is authorized in.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct JobQuery {
    /// The namespace that owns the job (its RunSession's).
    #[param(max_length = 63, pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
    namespace: String,
}

/// Read one job
///
/// The caller must be allowed to `get` RunSessions in `namespace`; without that, the
/// same 403 whether or not the job exists.
#[utoipa::path(
    get,
    path = "/api/v1/runtime/jobs/{id}",
    tag = "runtime",
    params(("id" = Uuid, Path, description = "The job id"), JobQuery),
    security(("kubernetes" = [])),
    responses(
        (status = 200, description = "The job", body = Job),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 403, response = Forbidden),
        (status = 404, response = NotFound),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn get_job(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<JobQuery>,
) -> Result<Json<Job>, ApiError> {
    let id = job_id(&id)?;
    check_namespace(&q.namespace)?;
    let caller = state.auth.authenticate(&headers, peer).await?;
    state.auth.authorize(&caller, "get", RESOURCE, &q.namespace).await?;
    match state.registry.job(&q.namespace, id).await? {
        Some(job) => Ok(Json(job)),
        None => Err(job_not_found(id, &q.namespace)),
    }
}

fn job_not_found(id: Uuid, namespace: &str) -> ApiError {
    ApiError::not_found("job_not_found", format!("no job {id} in namespace {namespace}"))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct JobListQuery {
    /// The namespace whose jobs to list.
    #[param(max_length = 63, pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
    namespace: String,
    #[param(min_length = 1, max_length = 253, pattern = "^[A-Za-z0-9._-]+$")]
    server_instance_id: Option<String>,
    #[param(min_length = 1, max_length = 63, pattern = "^[a-z0-9-]+$")]
    component_kind: Option<String>,
    #[param(inline)]
    state: Option<JobState>,
    /// Jobs per page, 1-500 (default 100).
    #[param(minimum = 1, maximum = 500)]
    limit: Option<i64>,
    /// The `next_cursor` of the page before.
    #[param(max_length = 51, pattern = "^[0-9]{1,18}[.][0-9a-f]{32}$")]
    after: Option<String>,
}

/// A page of jobs, newest first.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct JobPage {
    pub jobs: Vec<Job>,
    /// Pass as `after` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

/// List a namespace's jobs
///
/// Newest first, filtered, in pages (keyset: `after` is the `next_cursor` of the page
/// before). The caller must be allowed to `list` RunSessions in `namespace`.
#[utoipa::path(
    get,
    path = "/api/v1/runtime/jobs",
    tag = "runtime",
    params(JobListQuery),
    security(("kubernetes" = [])),
    responses(
        (status = 200, description = "A page of jobs", body = JobPage),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 403, response = Forbidden),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn list_jobs(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<JobListQuery>,
) -> Result<Json<JobPage>, ApiError> {
    check_namespace(&q.namespace)?;
    if let Some(s) = &q.server_instance_id
        && !server_instance_id_ok(s)
    {
        return Err(ApiError::invalid(prism_core::limits::server_instance_id_rule()));
    }
    if let Some(c) = &q.component_kind
        && !crate::run_registry::service::component_kind_ok(c)
    {
        return Err(ApiError::invalid(prism_core::limits::component_kind_rule()));
    }
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::invalid(format!("limit must be 1 to {MAX_PAGE}")));
    }
    let after = match &q.after {
        Some(c) => Some(Cursor::decode(c).ok_or_else(|| ApiError::invalid("after: not a cursor this API gave"))?),
        None => None,
    };
    let caller = state.auth.authenticate(&headers, peer).await?;
    state.auth.authorize(&caller, "list", RESOURCE, &q.namespace).await?;
    let filter =
        JobFilter { server_instance_id: q.server_instance_id, component_kind: q.component_kind, state: q.state };
    let (jobs, next) = state.registry.jobs(&q.namespace, &filter, limit, after).await?;
    Ok(Json(JobPage { jobs, next_cursor: next.map(|c| c.encode()) }))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelBody {
    /// Why (kept as the job's `cancel_reason`; default `cancel_requested`).
    #[schema(min_length = 1, max_length = 256, pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$")]
    reason: Option<String>,
}

impl CancelBody {
    /// The reason a body (maybe empty) gives, checked.
    pub fn reason_of(body: &[u8]) -> Result<Option<String>, ApiError> {
        let reason = optional_json::<CancelBody>(body)?.and_then(|b| b.reason);
        if let Some(r) = &reason {
            check_identifier("reason", r, MAX_REASON_CHARS)?;
        }
        Ok(reason)
    }
}

/// Cancel a job
///
/// A queued job is cancelled at once (200). One in flight gets a cancel request (202):
/// its Run is told (heartbeat `cancel`, step answers `cancel_requested`) and completes it
/// as `cancelled`; after `PRISM_JOB_CANCEL_GRACE_SECONDS` it is cancelled anyway. A
/// finished job: 409 `job_finished`. The caller must be allowed to `update` RunSessions
/// in `namespace`; without that, the same 403 whether or not the job exists.
#[utoipa::path(
    post,
    path = "/api/v1/runtime/jobs/{id}/cancel",
    tag = "runtime",
    params(("id" = Uuid, Path, description = "The job id"), JobQuery),
    request_body(content = Option<CancelBody>, description = "Optional"),
    security(("kubernetes" = [])),
    responses(
        (status = 200, description = "Cancelled", body = Job),
        (status = 202, description = "In flight: cancel requested, the Run is told", body = Job),
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
pub async fn cancel_job(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<JobQuery>,
    ApiBody(body): ApiBody,
) -> Result<(StatusCode, Json<Job>), ApiError> {
    let id = job_id(&id)?;
    check_namespace(&q.namespace)?;
    let reason = CancelBody::reason_of(&body)?;
    let caller = state.auth.authenticate(&headers, peer).await?;
    state.auth.authorize(&caller, "update", RESOURCE, &q.namespace).await?;
    match state.registry.cancel(&q.namespace, id, reason.as_deref()).await? {
        Some(Cancel::Cancelled(job)) => Ok((StatusCode::OK, Json(job))),
        Some(Cancel::Requested(job)) => Ok((StatusCode::ACCEPTED, Json(job))),
        Some(Cancel::Finished(job)) => Err(job_finished(job.state)),
        None => Err(job_not_found(id, &q.namespace)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::any_input::{body_bytes, is_client_error, through_api_json};
    use crate::run_registry::service::component_kind_ok;
    use proptest::prelude::*;

    fn no_nul(v: &Value) -> bool {
        check_jsonb("v", v).is_ok()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// An enqueued job names an address of an identity's shape and a payload jsonb takes.
        #[test]
        fn enqueue_bodies(bytes in body_bytes(json!({
            "server_instance_id": "srv-1", "component_kind": "run", "kind": "config", "payload": {"a": 1}
        }))) {
            match through_api_json::<EnqueueBody>(bytes).and_then(|b| b.check().map(|()| b)) {
                Ok(b) => {
                    prop_assert!(server_instance_id_ok(&b.server_instance_id));
                    prop_assert!(component_kind_ok(&b.component_kind));
                    prop_assert!(no_nul(&b.payload));
                }
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
            }
        }
    }
}

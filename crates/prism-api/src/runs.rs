//! `/api/v1/runtime/*`: Runs prove possession (hello), then use their session token;
//! platform identities enqueue jobs and read safe status with Kubernetes tokens.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use chrono::Utc;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::AppState;
use super::agents::{check_identifier, check_namespace};
use super::auth::{Caller, bearer};
use super::docs::JsonbValue;
use super::docs::{
    BadRequest, Conflict, Forbidden, Internal, Invalid, NotFound, TooLarge, TooManyRequests, Unauthenticated,
    Unavailable, UnsupportedMediaType,
};
use super::error::{ApiBody, ApiError, ApiJson, ApiPath, ApiQuery, ClientAddr};
use super::limits::{Announce, DRAIN_ANNOUNCE_EVERY};
use kube::Api;

use crate::crd::RunSession;
use crate::reconcilers::ReconcileMetrics as _;
use crate::run_registry::identity::Identity;
use crate::run_registry::jobs::{
    Cancel, Cursor, Enqueued, IDEMPOTENCY_KEY_PATTERN, Job, JobFence, JobFilter, JobKind, JobState, MAX_ATTEMPTS_RANGE,
    MAX_ERROR_CHARS, MAX_PAGE, MAX_REASON_CHARS, NewJob, Outcome as JobOutcome, Step, StepRefused,
    TIMEOUT_SECONDS_RANGE, idempotency_key_ok,
};
use crate::run_registry::service::{
    Granted, Hello, HelloError, Renewed, SessionRefused, StepError, capabilities_schema, capacity_schema,
    check_address, check_jsonb, check_snapshot, heartbeat_interval, server_instance_id_ok,
};
use crate::run_registry::sessions::Renewal;
use crate::run_registry::{RunAddress, Session};
use prism_kube::projection::{Lease, SessionView, project};

const RESOURCE: &str = "runsessions";
const MAX_CLAIM: i64 = 100;
/// The longest a claim waits (SPEC §11); the request timeout of the route is this plus
/// the usual limit (`transport::timeout::WAITING_ROUTES`).
pub const MAX_CLAIM_WAIT_SECONDS: i64 = 60;

/// A JSON body that may be absent (empty, or `null`), with our error codes when present
/// but bad; read strictly, as `ApiJson` reads. The whole body must be one JSON value.
pub fn optional_json<T: DeserializeOwned>(body: &[u8]) -> Result<Option<T>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "malformed_json", e.to_string()))?;
    if value.is_null() {
        return Ok(None);
    }
    super::strict::from_value(value).map(Some).map_err(|e| ApiError::invalid(e.to_string()))
}

fn session_token(headers: &HeaderMap) -> Result<&str, ApiError> {
    bearer(headers).ok_or_else(|| ApiError::unauthenticated("unauthenticated", "a session token is required"))
}

/// The request's session token, once its address may spend a look-up on it (a token not
/// seen valid lately is charged to the address: `Limits::session_token`).
fn gated_session_token<'h>(
    state: &AppState,
    headers: &'h HeaderMap,
    peer: Option<IpAddr>,
) -> Result<&'h str, ApiError> {
    let token = session_token(headers)?;
    state.limits.session_token(token, peer)?;
    Ok(token)
}

async fn authenticated(
    state: &AppState,
    headers: &HeaderMap,
    peer: Option<IpAddr>,
) -> Result<(RunAddress, Session), ApiError> {
    let token = gated_session_token(state, headers, peer)?;
    let checked = state.registry.session(token).await?;
    state.limits.session_checked(token, checked.is_ok());
    match checked {
        Ok(s) => {
            super::record_caller(&format_args!("run:{}", s.0));
            Ok(s)
        }
        Err(refused) => Err(session_refused(refused)),
    }
}

fn session_refused(r: SessionRefused) -> ApiError {
    let message = match r {
        SessionRefused::InvalidToken => "not a session token",
        SessionRefused::Superseded => {
            "a newer hello replaced this session, or its key was rotated or its RunSession deleted; say hello again"
        }
        SessionRefused::Expired => "the session lease expired; say hello again",
    };
    ApiError::unauthenticated(r.code(), message)
}

/// Prove possession of a Run's key and open a session
///
/// The body is signed as SPEC §8 says. Every failure of proof is a 401 with one of the
/// codes `unknown_identity`, `stale_generation`, `bad_signature`, `clock_skew`,
/// `replayed_nonce`, and nothing more.
#[utoipa::path(
    post,
    path = "/api/v1/runtime/hello",
    tag = "runtime",
    request_body = Hello,
    responses(
        (status = 201, description = "Session granted", body = Granted),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 413, response = TooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn hello(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    ApiJson(body): ApiJson<Hello>,
) -> Result<(StatusCode, Json<Granted>), ApiError> {
    // Before any lookup: a hello costs Postgres reads and a signature check, charged to
    // the source address. The Run identity's own budget is spent only once its proof
    // checks out: hellos signed by anybody else cannot lock it out (SPEC §12).
    state.limits.unauthenticated(peer)?;
    let proven = match state.registry.prove(&body, Utc::now()).await? {
        Ok(proven) => proven,
        Err(refused) => return Err(hello_refused(refused)),
    };
    let address = proven.address();
    state.limits.proven_hello(&format!("{}/{}", address.server_instance_id, address.component_kind))?;
    match state.registry.open(proven).await? {
        Ok((identity, granted)) => {
            // The new token was just proven: its calls are not charged to the address (a
            // Run saying hello again after an outage is served at once, even while a flood
            // of dead tokens from its address spends the address's budget).
            state.limits.session_checked(&granted.session_token, true);
            // The session is granted whatever happens next; a lost signal only delays
            // `Online` in status until the reconciler's own requeue.
            if let Err(error) = state.registry.announce_status(&identity.spec).await {
                tracing::warn!(namespace = %identity.spec.namespace, name = %identity.spec.name, %error,
                               "hello granted, but its RunSession's status refresh could not be announced");
            }
            Ok((StatusCode::CREATED, Json(granted)))
        }
        Err(refused) => Err(hello_refused(refused)),
    }
}

fn hello_refused(e: HelloError) -> ApiError {
    match e {
        HelloError::Invalid(e) => ApiError::invalid(e.0),
        // Every failure of proof says its code and nothing more.
        HelloError::Refused(r) => ApiError::unauthenticated(r.code(), "hello refused"),
    }
}

/// A fresh capability/capacity snapshot, and whether the Run is draining (each part
/// optional; the body may be empty).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = RunHeartbeatBody)]
pub struct HeartbeatBody {
    #[schema(schema_with = capabilities_schema)]
    capabilities: Option<Vec<String>>,
    #[serde(default, deserialize_with = "crate::json_int::opt_map_i64")]
    #[schema(schema_with = capacity_schema)]
    capacity: Option<BTreeMap<String, i64>>,
    /// The Run's graceful stop (SPEC §5.1): `true` and its claims hand out no new job
    /// (the jobs it holds still take steps) until a heartbeat says `false`; absent or
    /// null: as it was. A new hello starts not draining.
    #[serde(default)]
    draining: Option<bool>,
}

impl HeartbeatBody {
    pub fn check(&self) -> Result<(), ApiError> {
        check_snapshot(self.capabilities.as_ref(), self.capacity.as_ref()).map_err(|e| ApiError::invalid(e.0))
    }
}

#[derive(Serialize, ToSchema)]
pub struct RunHeartbeatReply {
    /// Seconds the renewed lease has left.
    lease_ttl_seconds: u64,
    heartbeat_interval_seconds: u64,
    /// Jobs this Run holds whose cancel was requested: stop them and complete each with
    /// outcome `cancelled` (SPEC §5.1).
    cancel: Vec<Uuid>,
}

/// Heartbeat of a Run: renews its session lease
#[utoipa::path(
    post,
    path = "/api/v1/runtime/heartbeat",
    operation_id = "runtime_heartbeat",
    tag = "runtime",
    request_body(content = Option<HeartbeatBody>, description = "Optional; an empty body renews only"),
    security(("session" = [])),
    responses(
        (status = 200, description = "Lease renewed", body = RunHeartbeatReply),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 413, response = TooLarge),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn heartbeat(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiBody(body): ApiBody,
) -> Result<Json<RunHeartbeatReply>, ApiError> {
    let token = gated_session_token(&state, &headers, peer)?;
    let body: Option<HeartbeatBody> = optional_json(&body)?;
    if let Some(b) = &body {
        b.check()?;
    }
    let (caps, cap, draining) = body.map(|b| (b.capabilities, b.capacity, b.draining)).unwrap_or_default();
    let renewal = Renewal { capabilities: caps.as_deref(), capacity: cap.as_ref(), draining };
    let renewed = state.registry.renew(token, renewal).await?;
    state.limits.session_checked(token, renewed.is_ok());
    match renewed {
        Ok(Renewed { address, lease }) => {
            if lease.drain_changed {
                // Bounded: one status refresh per address per period, the latest state last.
                let key = address.to_string();
                match state.limits.drain_announce(&key) {
                    Announce::Now => drain_changed_announce(&state, &address).await,
                    Announce::Later => {
                        let (state, address) = (state.clone(), address.clone());
                        tokio::spawn(async move {
                            tokio::time::sleep(DRAIN_ANNOUNCE_EVERY).await;
                            state.limits.drain_announced_late(&key);
                            drain_changed_announce(&state, &address).await;
                        });
                    }
                    Announce::Waiting => {}
                }
            }
            let cancel = state.registry.cancel_requested(&address, &lease).await?;
            let lease = (lease.lease_left.as_millis() as u64).div_ceil(1000);
            Ok(Json(RunHeartbeatReply {
                lease_ttl_seconds: lease,
                heartbeat_interval_seconds: u64::from(heartbeat_interval(u32::try_from(lease).unwrap_or(u32::MAX))),
                cancel,
            }))
        }
        Err(r) => Err(session_refused(r)),
    }
}

/// A Run started or stopped draining: its RunSession's status is refreshed now (phase
/// `Draining`, its condition and Event) rather than at the reconciler's next requeue. The
/// heartbeat succeeded whatever happens here; a lost signal only delays the status.
async fn drain_changed_announce(state: &AppState, address: &RunAddress) {
    let identity = match state.registry.identity(None, address).await {
        Ok(Some(identity)) => identity,
        Ok(None) => return,
        Err(error) => {
            tracing::warn!(%address, %error, "the Run's drain changed, but its RunSession could not be read");
            return;
        }
    };
    if let Err(error) = state.registry.announce_status(&identity.spec).await {
        tracing::warn!(namespace = %identity.spec.namespace, name = %identity.spec.name, %error,
                       "the Run's drain changed, but its RunSession's status refresh could not be announced");
    }
}

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
        state.auth.authorize(caller, "get", super::agents::RESOURCE, &f.namespace).await?;
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

/// A long-poll claim counted while it waits.
struct Waiting<'a>(&'a crate::metrics::Metrics);

impl<'a> Waiting<'a> {
    fn on(metrics: &'a crate::metrics::Metrics) -> Self {
        metrics.claims_waiting.inc();
        Waiting(metrics)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.claims_waiting.dec();
    }
}

fn job_finished(state: JobState) -> ApiError {
    ApiError::conflict("job_finished", format!("the job is {state}"))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClaimBody {
    /// How many jobs at most (default 1).
    #[schema(minimum = 1, maximum = 100)]
    #[serde(default, deserialize_with = "crate::json_int::opt_i64")]
    max: Option<i64>,
    /// Long poll (SPEC §11): when nothing is claimable now, wait up to this many seconds
    /// for a job queued for this Run, a slot freed or a cancel requested (default 0:
    /// answer at once). A waiting claim renews nothing: keep heartbeating.
    #[schema(minimum = 0, maximum = 60)]
    #[serde(default, deserialize_with = "crate::json_int::opt_i64")]
    wait_seconds: Option<i64>,
}

/// What a claim asks for, checked.
#[derive(Debug, PartialEq)]
pub struct ClaimAsk {
    pub max: i64,
    pub wait: std::time::Duration,
}

impl ClaimBody {
    /// What a claim body (maybe empty) asks for, checked.
    pub fn parse(body: &[u8]) -> Result<ClaimAsk, ApiError> {
        let b = optional_json::<ClaimBody>(body)?;
        let (max, wait) = b.map(|b| (b.max, b.wait_seconds)).unwrap_or_default();
        let max = max.unwrap_or(1);
        if !(1..=MAX_CLAIM).contains(&max) {
            return Err(ApiError::invalid(format!("max must be 1 to {MAX_CLAIM}")));
        }
        let wait = wait.unwrap_or(0);
        if !(0..=MAX_CLAIM_WAIT_SECONDS).contains(&wait) {
            return Err(ApiError::invalid(format!("wait_seconds must be 0 to {MAX_CLAIM_WAIT_SECONDS}")));
        }
        Ok(ClaimAsk { max, wait: std::time::Duration::from_secs(wait.unsigned_abs()) })
    }
}

#[derive(Serialize, ToSchema)]
pub struct Claimed {
    jobs: Vec<Job>,
    /// Jobs this Run holds whose cancel was requested: stop them (SPEC §5.1).
    cancel: Vec<Uuid>,
}

/// Claim the oldest queued jobs of the session's own server/component
#[utoipa::path(
    post,
    path = "/api/v1/runtime/jobs/claim",
    tag = "runtime",
    request_body(content = Option<ClaimBody>, description = "Optional; an empty body claims one"),
    security(("session" = [])),
    responses(
        (status = 200, description = "The jobs claimed (maybe none)", body = Claimed),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 413, response = TooLarge),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn claim(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiBody(body): ApiBody,
) -> Result<Json<Claimed>, ApiError> {
    let ask = ClaimBody::parse(&body)?;
    // No session (Redis down included) means no job is assigned.
    let started = std::time::Instant::now();
    let (address, session) = authenticated(&state, &headers, peer).await?;
    let claim = if ask.wait.is_zero() {
        let claim = state.registry.claim(&address, &session, ask.max).await?;
        state.metrics.claim_seconds.observe(started.elapsed().as_secs_f64());
        claim
    } else {
        // A held request of the Run's session (SPEC §12): one of its share, for its wait.
        let _held = state.streams.hold(crate::streams::Holder::RunSession(session.session_id))?;
        let _waiting = Waiting::on(&state.metrics);
        let until = tokio::time::Instant::now() + ask.wait;
        let mut stopping = state.stopping.clone();
        let stop = async move {
            // A dropped sender also means the server is stopping.
            let _ = stopping.wait_for(|stop| *stop).await;
        };
        let token = session_token(&headers)?;
        state.registry.claim_waiting(token, &address, session, ask.max, until, stop).await?
    }
    .map_err(session_refused)?;
    let now = Utc::now();
    for job in claim.jobs.iter().filter(|j| j.attempts == 1) {
        state.metrics.job_dispatch_seconds.observe((now - job.created_at).as_seconds_f64().max(0.0));
    }
    Ok(Json(Claimed { jobs: claim.jobs, cancel: claim.cancel }))
}

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

fn job_id(id: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(id).map_err(|_| ApiError::invalid("job id must be a uuid"))
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

/// One component of a server: which resource it is, and the safe projection.
#[derive(Serialize, ToSchema)]
pub struct ComponentStatus {
    component_kind: String,
    namespace: String,
    name: String,
    #[serde(flatten)]
    session: SessionView,
}

#[derive(Serialize, ToSchema)]
pub struct ServerStatus {
    server_instance_id: String,
    components: Vec<ComponentStatus>,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ServerStatusQuery {
    /// Only the components of this namespace; then an unknown server is a 404 for a
    /// caller who may get RunSessions there (otherwise the same 403 as a refusal).
    #[param(max_length = 63, pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
    namespace: Option<String>,
}

/// The safe projection of every component of a server
///
/// The components whose RunSession the caller may `get`; the others (another tenant's
/// among them) are left out, never named. None: 403, whether the server has components
/// or not.
#[utoipa::path(
    get,
    path = "/api/v1/runtime/servers/{server_instance_id}/status",
    tag = "runtime",
    params(
        ("server_instance_id" = String, Path, min_length = 1, max_length = 253, pattern = "^[A-Za-z0-9._-]+$"),
        ServerStatusQuery,
    ),
    security(("kubernetes" = [])),
    responses(
        (status = 200, description = "The components of the server the caller may see", body = ServerStatus),
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
pub async fn server_status(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiPath(server_instance_id): ApiPath<String>,
    ApiQuery(q): ApiQuery<ServerStatusQuery>,
) -> Result<Json<ServerStatus>, ApiError> {
    // No RunSession can have another shape: saying so is no existence check.
    if !server_instance_id_ok(&server_instance_id) {
        return Err(ApiError::invalid(prism_core::limits::server_instance_id_rule()));
    }
    if let Some(ns) = &q.namespace {
        check_namespace(ns)?;
    }
    let caller = state.auth.authenticate(&headers, peer).await?;
    let identities = state.registry.identities_of_server(&server_instance_id, q.namespace.as_deref()).await?;
    let mut components = Vec::new();
    for identity in &identities {
        let (namespace, name) = (&identity.spec.namespace, &identity.spec.name);
        if state.auth.allowed(&caller, "get", RESOURCE, namespace, Some(name)).await? {
            components.push(component_status(&state, identity).await?);
        }
    }
    if components.is_empty() {
        if let Some(ns) = &q.namespace
            && state.auth.allowed(&caller, "get", RESOURCE, ns, None).await?
        {
            return Err(ApiError::not_found(
                "unknown_server",
                format!("no RunSession of {ns} is for server {server_instance_id}"),
            ));
        }
        return Err(ApiError::forbidden(format!(
            "{} may get no RunSession of server {server_instance_id} (or it has none)",
            caller.username
        )));
    }
    Ok(Json(ServerStatus { server_instance_id, components }))
}

/// A component as its RunSession's status would show it now: live facts from the Redis
/// lease when there is one, else the last facts the status showed.
async fn component_status(state: &AppState, identity: &Identity) -> Result<ComponentStatus, ApiError> {
    let (namespace, name) = (&identity.spec.namespace, &identity.spec.name);
    let shown = Api::<RunSession>::namespaced(state.kube.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(|e| {
            tracing::warn!(%namespace, %name, error = %e,
                           "server status: reading the RunSession failed");
            ApiError::unavailable("kubernetes_unavailable", format!("server status: read RunSession: {e}"))
        })?
        .and_then(|r| r.status)
        .map(|status| SessionView::shown_in(&status))
        .unwrap_or_default();
    let live = match state.registry.session_of(&identity.address()).await {
        // A session of an older epoch (an older key, an earlier identity) does not count.
        Ok(session) => session.filter(|s| s.epoch == identity.epoch),
        Err(e) if e.registry_unavailable() => {
            return Ok(component(identity, project(Lease::RegistryDown, identity.spec.paused, &shown)));
        }
        Err(e) => return Err(e.into()),
    };
    let lease = match &live {
        Some(session) => Lease::Held(session),
        None => Lease::Absent { credential_rotated: false },
    };
    Ok(component(identity, project(lease, identity.spec.paused, &shown)))
}

fn component(identity: &Identity, session: SessionView) -> ComponentStatus {
    ComponentStatus {
        component_kind: identity.spec.component_kind.clone(),
        namespace: identity.spec.namespace.clone(),
        name: identity.spec.name.clone(),
        session,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::any_input::{body_bytes, is_client_error, through_api_json};
    use crate::run_registry::service::{component_kind_ok, name_ok};
    use proptest::prelude::*;

    fn no_nul(v: &Value) -> bool {
        check_jsonb("v", v).is_ok()
    }

    #[test]
    fn optional_bodies_take_empty_and_null_and_refuse_trailing_bytes() {
        let ask = |max, wait| Some(ClaimAsk { max, wait: std::time::Duration::from_secs(wait) });
        assert_eq!(ClaimBody::parse(b"").ok(), ask(1, 0));
        assert_eq!(ClaimBody::parse(b" null ").ok(), ask(1, 0));
        assert_eq!(ClaimBody::parse(br#"{"max": 7}"#).ok(), ask(7, 0));
        assert_eq!(ClaimBody::parse(br#"{"max": 7, "wait_seconds": 60}"#).ok(), ask(7, 60));
        for refused in [&br#"{"wait_seconds": 61}"#[..], br#"{"wait_seconds": -1}"#, br#"{"wait_seconds": "5"}"#] {
            assert!(ClaimBody::parse(refused).is_err_and(|e| e.status.is_client_error()));
        }
        let e = ClaimBody::parse(br#"{"max": 7} x"#).err().map(|e| e.code);
        assert_eq!(e, Some("malformed_json"));
        assert!(ProgressBody::parse(b"null").is_err());
        // A step's attempt: absent, or 1 to 100.
        assert_eq!(AckBody::parse(b"").ok(), Some(None));
        assert_eq!(AckBody::parse(br#"{"attempt": 2}"#).ok(), Some(Some(2)));
        for refused in
            [&br#"{"attempt": 0}"#[..], br#"{"attempt": 101}"#, br#"{"attempt": "1"}"#, br#"{"attempt": 4294967297}"#]
        {
            assert!(AckBody::parse(refused).is_err_and(|e| e.status.is_client_error()), "{refused:?}");
        }
        assert_eq!(
            CompleteBody::parse(br#"{"outcome": "succeeded", "attempt": 3}"#).ok().map(|(_, _, a)| a),
            Some(Some(3))
        );
        assert!(ProgressBody::parse(br#"{"progress": "a\u0000"}"#).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Snapshots that pass are bounded, with known-shape names and amounts >= 0.
        #[test]
        fn run_heartbeat_bodies(bytes in body_bytes(json!({"capabilities": ["lifecycle"], "capacity": {"slots": 4}}))) {
            match optional_json::<HeartbeatBody>(&bytes).and_then(|b| b.map(|b| b.check().map(|()| b)).transpose()) {
                Ok(Some(b)) => {
                    let caps = b.capabilities.unwrap_or_default();
                    prop_assert!(caps.len() <= 32 && caps.iter().all(|c| name_ok(c)));
                    let cap = b.capacity.unwrap_or_default();
                    prop_assert!(cap.len() <= 32 && cap.iter().all(|(k, v)| name_ok(k) && *v >= 0));
                }
                Ok(None) => {}
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
            }
        }

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

        /// `max` and `wait_seconds` are any JSON the caller likes; only 1..=100 and
        /// 0..=60 pass.
        #[test]
        fn claim_bodies(bytes in body_bytes(json!({"max": 5, "wait_seconds": 30}))) {
            match ClaimBody::parse(&bytes) {
                Ok(ask) => prop_assert!((1..=MAX_CLAIM).contains(&ask.max) && ask.wait.as_secs() <= 60),
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
            }
        }

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

    /// The hello path with every input (SPEC §8): the body through the handler's JSON
    /// extractor, the shape check, then the proof against an identity, at any clock.
    mod hello_properties {
        use crate::any_input::{any_string, body_bytes, is_client_error, through_api_json};
        use crate::run_registry::proof;
        use crate::run_registry::service::{
            Hello, ProofRefused, TOKEN_PREFIX, check_hello, check_proof, component_kind_ok, server_instance_id_ok,
            token_address,
        };
        use base64::Engine as _;
        use base64::engine::general_purpose::STANDARD;
        use base64::engine::general_purpose::URL_SAFE_NO_PAD;
        use ed25519_dalek::{Signer, SigningKey};
        use proptest::prelude::*;
        use serde_json::Value;
        use serde_json::json;

        fn any_time() -> impl Strategy<Value = i64> {
            prop_oneof![Just(i64::MIN), Just(i64::MAX), Just(0i64), any::<i64>(), 1_764_399_000i64..1_764_401_000]
        }

        fn good_hello() -> Value {
            json!({
                "server_instance_id": "srv-eu1-7", "component_kind": "run", "key_generation": 3,
                "timestamp": 1_764_400_000i64, "nonce": "Zk3q9-2LwX0aPq7T", "signature": "AAAA",
                "version": "1.4.2", "target": {"os": "linux", "arch": "amd64"},
                "capabilities": ["lifecycle"], "capacity": {"slots": 4}
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(1000))]

            /// Any body, any identity generation and clock: a 4xx-worthy refusal or a
            /// proof refusal, never a panic; an unsigned hello never passes.
            #[test]
            fn every_hello_body_is_answered(
                bytes in body_bytes(good_hello()), generation in any::<i64>(), now in any_time(), seed in any::<[u8; 32]>(),
            ) {
                let public_key = STANDARD.encode(SigningKey::from_bytes(&seed).verifying_key().to_bytes());
                match through_api_json::<Hello>(bytes) {
                    Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
                    Ok(h) => {
                        if check_hello(&h).is_ok() {
                            prop_assert!(h.key_generation >= 1 && proof::nonce_ok(&h.nonce));
                            for g in [generation, h.key_generation] {
                                prop_assert!(check_proof(&h, g, &public_key, now).is_err());
                            }
                        }
                    }
                }
            }

            /// A hello signed by the identity's key passes exactly when its timestamp is
            /// within the window of `now`, whatever the two integers are.
            #[test]
            fn a_signed_hello_passes_only_in_the_clock_window(
                timestamp in any_time(), now in any_time(), generation in 1i64.., seed in any::<[u8; 32]>(),
                server in "[A-Za-z0-9._-]{1,40}", nonce in "[A-Za-z0-9_-]{16,40}", other in any_string(),
            ) {
                let key = SigningKey::from_bytes(&seed);
                let public_key = STANDARD.encode(key.verifying_key().to_bytes());
                let message = proof::hello_message(&server, "run", generation, timestamp, &nonce);
                let h = Hello {
                    server_instance_id: server, component_kind: "run".into(), key_generation: generation, timestamp,
                    nonce, signature: STANDARD.encode(key.sign(message.as_bytes()).to_bytes()),
                    version: None, target: None, capabilities: None, capacity: None,
                };
                prop_assert_eq!(check_hello(&h), Ok(()));
                let expected = if proof::within_clock_window(timestamp, now) { Ok(()) } else { Err(ProofRefused::ClockSkew) };
                prop_assert_eq!(check_proof(&h, generation, &public_key, now), expected);
                prop_assert_eq!(check_proof(&h, generation.wrapping_add(1), &public_key, now), Err(ProofRefused::StaleGeneration));
                prop_assert!(check_proof(&h, generation, &other, timestamp).is_err());
            }

            /// Session tokens are the caller's text: any string is routed or refused.
            #[test]
            fn any_token_is_routed_or_refused(token in any_string(), route in any_string()) {
                if let Some(a) = token_address(&token) {
                    prop_assert!(server_instance_id_ok(&a.server_instance_id) && component_kind_ok(&a.component_kind));
                }
                let forged = format!("{TOKEN_PREFIX}.{}.{}", URL_SAFE_NO_PAD.encode(&route), "a".repeat(43));
                if let Some(a) = token_address(&forged) {
                    prop_assert!(server_instance_id_ok(&a.server_instance_id) && component_kind_ok(&a.component_kind));
                }
            }
        }
    }
}

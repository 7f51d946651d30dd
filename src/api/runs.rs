//! `/api/v1/runtime/*`: Runs prove possession (hello), then use their session token;
//! platform identities enqueue jobs and read safe status with Kubernetes tokens.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

use super::AppState;
use super::auth::bearer;
use super::error::{ApiError, ApiJson};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Api;

use crate::crd::{RunPhase, RunSession, RunSessionStatus, RunTarget, UnavailableReason};
use crate::run_registry::identity::Identity;
use crate::run_registry::jobs::{Job, Step, StepRefused};
use crate::run_registry::service::{Granted, Hello, HelloError, SessionRefused, check_snapshot};
use crate::run_registry::{RuntimeError, Session, Target};

const RESOURCE: &str = "runsessions";
const MAX_CLAIM: i64 = 100;

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> Self {
        match e {
            RuntimeError::Unavailable(_) => {
                ApiError::unavailable("runtime_registry_unavailable", "the runtime registry (Redis) is unavailable")
            }
            RuntimeError::Database(e) => {
                tracing::error!(error = %e, "database error");
                ApiError::unavailable("database_unavailable", "the job database is unavailable")
            }
            RuntimeError::Entropy(e) => ApiError::internal("no randomness", e),
        }
    }
}

/// A JSON body that may be absent (empty), with our error codes when present but bad.
fn optional_json<T: DeserializeOwned>(body: &Bytes) -> Result<Option<T>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize(&mut de) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.inner().is_syntax() || e.inner().is_eof() => {
            Err(ApiError::new(StatusCode::BAD_REQUEST, "malformed_json", e.to_string()))
        }
        Err(e) => Err(ApiError::invalid(e.to_string())),
    }
}

fn session_token(headers: &HeaderMap) -> Result<&str, ApiError> {
    bearer(headers).ok_or_else(|| ApiError::unauthenticated("unauthenticated", "a session token is required"))
}

async fn authenticated(state: &AppState, headers: &HeaderMap) -> Result<(Target, Session), ApiError> {
    let token = session_token(headers)?;
    match state.runtime.session(token, None).await? {
        Ok(s) => Ok(s),
        Err(refused) => Err(session_refused(refused)),
    }
}

fn session_refused(r: SessionRefused) -> ApiError {
    let message = match r {
        SessionRefused::InvalidToken => "not a session token",
        SessionRefused::Superseded => "a newer hello replaced this session; say hello again",
        SessionRefused::Expired => "the session lease expired; say hello again",
    };
    ApiError::unauthenticated(r.code(), message)
}

pub async fn hello(
    State(state): State<Arc<AppState>>,
    ApiJson(body): ApiJson<Hello>,
) -> Result<(StatusCode, Json<Granted>), ApiError> {
    match state.runtime.hello(&body, Utc::now()).await? {
        Ok((identity, granted)) => {
            state.triggers.runsession(&identity.namespace, &identity.name);
            // The leader may be another replica: tell it through Postgres too.
            let _ = sqlx::query("SELECT pg_notify($1, $2)")
                .bind(crate::reconcilers::NOTIFY_RUNSESSIONS)
                .bind(format!("{}/{}", identity.namespace, identity.name))
                .execute(&state.db)
                .await;
            Ok((StatusCode::CREATED, Json(granted)))
        }
        Err(HelloError::Invalid(e)) => Err(ApiError::invalid(e.0)),
        // Every failure of proof says its code and nothing more.
        Err(HelloError::Refused(r)) => Err(ApiError::unauthenticated(r.code(), "hello refused")),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatBody {
    capabilities: Option<Vec<String>>,
    capacity: Option<BTreeMap<String, i64>>,
}

pub async fn heartbeat(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let token = session_token(&headers)?;
    let body: Option<HeartbeatBody> = optional_json(&body)?;
    let (caps, cap) = body.map(|b| (b.capabilities, b.capacity)).unwrap_or_default();
    check_snapshot(caps.as_ref(), cap.as_ref()).map_err(|e| ApiError::invalid(e.0))?;
    match state.runtime.session(token, Some((Utc::now(), caps.as_ref(), cap.as_ref()))).await? {
        Ok((_, session)) => {
            let lease = (session.ttl_ms.max(0) as u64).div_ceil(1000);
            Ok(Json(json!({"lease_ttl_seconds": lease, "heartbeat_interval_seconds": (lease / 3).max(1)})))
        }
        Err(r) => Err(session_refused(r)),
    }
}

#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    Lifecycle,
    Config,
    File,
    Log,
    ProtectedRequest,
}

impl JobKind {
    fn as_str(self) -> &'static str {
        match self {
            JobKind::Lifecycle => "lifecycle",
            JobKind::Config => "config",
            JobKind::File => "file",
            JobKind::Log => "log",
            JobKind::ProtectedRequest => "protected_request",
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnqueueBody {
    server_instance_id: String,
    component_kind: String,
    kind: JobKind,
    #[serde(default)]
    payload: Value,
}

pub async fn enqueue(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<EnqueueBody>,
) -> Result<(StatusCode, Json<Job>), ApiError> {
    let caller = state.auth.authenticate(&headers).await?;
    let target = Target { server_instance_id: body.server_instance_id, component_kind: body.component_kind };
    let Some(identity) = state.runtime.identities.live(&target).await? else {
        return Err(ApiError::not_found(
            "unknown_identity",
            "no RunSession has this server_instance_id/component_kind",
        ));
    };
    state.auth.authorize_named(&caller, "update", RESOURCE, &identity.namespace, Some(&identity.name)).await?;
    let payload = if body.payload.is_null() { json!({}) } else { body.payload };
    let job = state.runtime.jobs.enqueue(&target, body.kind.as_str(), &payload).await?;
    Ok((StatusCode::CREATED, Json(job)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimBody {
    max: Option<i64>,
}

pub async fn claim(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let max = optional_json::<ClaimBody>(&body)?.and_then(|b| b.max).unwrap_or(1);
    if !(1..=MAX_CLAIM).contains(&max) {
        return Err(ApiError::invalid(format!("max must be 1 to {MAX_CLAIM}")));
    }
    // No session (Redis down included) means no job is assigned.
    let started = std::time::Instant::now();
    let (target, session) = authenticated(&state, &headers).await?;
    let jobs = state.runtime.claim(&target, &session, max).await?;
    state.metrics.claim_seconds.observe(started.elapsed().as_secs_f64());
    Ok(Json(json!({"jobs": jobs})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgressBody {
    progress: Value,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Succeeded,
    Failed,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteBody {
    outcome: Outcome,
    #[serde(default)]
    result: Option<Value>,
}

pub async fn job_step(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path((id, action)): Path<(String, String)>,
    body: Bytes,
) -> Result<Json<Job>, ApiError> {
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::invalid("job id must be a uuid"))?;
    let (step, value) = match action.as_str() {
        "ack" => (Step::Ack, None),
        "progress" => {
            let b: ProgressBody =
                optional_json(&body)?.ok_or_else(|| ApiError::invalid("body {\"progress\": {...}} is required"))?;
            (Step::Progress, Some(b.progress))
        }
        "complete" => {
            let b: CompleteBody = optional_json(&body)?.ok_or_else(|| {
                ApiError::invalid("body {\"outcome\": \"succeeded\"|\"failed\", \"result\": {...}} is required")
            })?;
            (Step::Complete { succeeded: matches!(b.outcome, Outcome::Succeeded) }, Some(b.result.unwrap_or(json!({}))))
        }
        _ => return Err(ApiError::not_found("not_found", "no such endpoint")),
    };
    let (target, _) = authenticated(&state, &headers).await?;
    match state.runtime.step(&target, id, step, value.as_ref()).await? {
        Ok(job) => Ok(Json(job)),
        Err(StepRefused::NotFound) => Err(ApiError::not_found("job_not_found", format!("job {id} not found"))),
        Err(StepRefused::CrossTarget) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "cross_target",
            "this job is addressed to another server/component",
        )),
        Err(StepRefused::WrongState(s)) => Err(ApiError::conflict("invalid_state", format!("job is {s}"))),
    }
}

/// One component's safe projection: never a token, hash, key name or credential.
#[derive(Serialize)]
pub struct ComponentStatus {
    component_kind: String,
    namespace: String,
    name: String,
    phase: RunPhase,
    online: bool,
    last_heartbeat: Option<DateTime<Utc>>,
    session_started_at: Option<DateTime<Utc>>,
    version: Option<String>,
    target: Option<RunTarget>,
    capabilities: Vec<String>,
    capacity: BTreeMap<String, i64>,
    unavailable_reason: Option<UnavailableReason>,
}

fn from_time(t: Option<Time>) -> Option<DateTime<Utc>> {
    t.and_then(|t| DateTime::<Utc>::from_timestamp_micros(t.0.as_microsecond()))
}

/// Live facts from the Redis lease when there is one; otherwise the last known facts
/// and the reason from the RunSession's status (the reconciler's projection).
fn component(
    identity: &Identity,
    live: Option<Session>,
    registry_up: bool,
    known: RunSessionStatus,
) -> ComponentStatus {
    let base = ComponentStatus {
        component_kind: identity.component_kind.clone(),
        namespace: identity.namespace.clone(),
        name: identity.name.clone(),
        phase: known.phase,
        online: false,
        last_heartbeat: from_time(known.last_heartbeat),
        session_started_at: from_time(known.session_started_at),
        version: known.version,
        target: known.target,
        capabilities: known.capabilities,
        capacity: known.capacity,
        unavailable_reason: known.unavailable_reason,
    };
    if !registry_up {
        return ComponentStatus {
            phase: RunPhase::Unavailable,
            unavailable_reason: Some(UnavailableReason::RedisUnavailable),
            ..base
        };
    }
    match live {
        Some(s) => {
            let target: Option<RunTarget> = serde_json::from_str(&s.target).ok();
            ComponentStatus {
                phase: RunPhase::Online,
                online: true,
                last_heartbeat: DateTime::<Utc>::from_timestamp_millis(s.last_heartbeat_ms),
                session_started_at: DateTime::<Utc>::from_timestamp_millis(s.started_at_ms),
                version: (!s.version.is_empty()).then_some(s.version),
                target,
                capabilities: serde_json::from_str(&s.capabilities).unwrap_or_default(),
                capacity: serde_json::from_str(&s.capacity).unwrap_or_default(),
                unavailable_reason: None,
                ..base
            }
        }
        None if base.phase == RunPhase::Online || base.phase == RunPhase::Unavailable => ComponentStatus {
            phase: RunPhase::Offline,
            unavailable_reason: Some(UnavailableReason::LeaseExpired),
            ..base
        },
        None => base,
    }
}

pub async fn server_status(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(server_instance_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let caller = state.auth.authenticate(&headers).await?;
    let identities = state.runtime.identities.of_server(&server_instance_id).await?;
    if identities.is_empty() {
        return Err(ApiError::not_found("unknown_server", format!("no RunSession for server {server_instance_id}")));
    }
    let mut components = Vec::new();
    for identity in &identities {
        state.auth.authorize_named(&caller, "get", RESOURCE, &identity.namespace, Some(&identity.name)).await?;
        let known = Api::<RunSession>::namespaced(state.kube.clone(), &identity.namespace)
            .get_opt(&identity.name)
            .await?
            .and_then(|r| r.status)
            .unwrap_or_default();
        let (live, up) = match state.runtime.redis.session(&identity.target()).await {
            Ok(s) => (s.filter(|s| s.generation == identity.key_generation), true),
            Err(_) => (None, false),
        };
        components.push(component(identity, live, up, known));
    }
    Ok(Json(json!({"server_instance_id": server_instance_id, "components": components})))
}

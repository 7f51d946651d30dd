//! `/api/v1/runtime/*`: Runs prove possession (hello), then use their session token;
//! platform identities enqueue jobs and read safe status with Kubernetes tokens.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use chrono::Utc;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

use super::AppState;
use super::auth::bearer;
use super::error::{ApiError, ApiJson};
use kube::Api;

use crate::crd::RunSession;
use crate::refresh::{self, NamespacedName};
use crate::run_registry::identity::Identity;
use crate::run_registry::jobs::{Job, JobKind, Step, StepRefused};
use crate::run_registry::projection::{Lease, SessionView, project};
use crate::run_registry::service::{Granted, Hello, HelloError, SessionRefused, check_snapshot};
use crate::run_registry::sessions::Renewal;
use crate::run_registry::{RunAddress, Session};

const RESOURCE: &str = "runsessions";
const MAX_CLAIM: i64 = 100;

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

async fn authenticated(state: &AppState, headers: &HeaderMap) -> Result<(RunAddress, Session), ApiError> {
    let token = session_token(headers)?;
    match state.registry.session(token, None).await? {
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
    match state.registry.hello(&body, Utc::now()).await? {
        Ok((identity, granted)) => {
            // The session is granted whatever happens next; a lost signal only delays
            // `Online` in status until the reconciler's own requeue.
            let resource = NamespacedName::new(identity.namespace.as_str(), identity.name.as_str());
            if let Err(error) = refresh::announce_now(&state.db, refresh::Kind::RunSession, [&resource]).await {
                tracing::warn!(namespace = %resource.namespace, name = %resource.name, %error,
                               "hello granted, but its RunSession's status refresh could not be announced");
            }
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
    let renewal = Renewal { now: Utc::now(), capabilities: caps.as_deref(), capacity: cap.as_ref() };
    match state.registry.session(token, Some(renewal)).await? {
        Ok((_, session)) => {
            let lease = (session.lease_left.as_millis() as u64).div_ceil(1000);
            Ok(Json(json!({"lease_ttl_seconds": lease, "heartbeat_interval_seconds": (lease / 3).max(1)})))
        }
        Err(r) => Err(session_refused(r)),
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
    let address = RunAddress { server_instance_id: body.server_instance_id, component_kind: body.component_kind };
    let Some(identity) = state.registry.identities.live(&address).await? else {
        return Err(ApiError::not_found(
            "unknown_identity",
            "no RunSession has this server_instance_id/component_kind",
        ));
    };
    state.auth.authorize_named(&caller, "update", RESOURCE, &identity.namespace, Some(&identity.name)).await?;
    let payload = if body.payload.is_null() { json!({}) } else { body.payload };
    let job = state.registry.jobs.enqueue(&address, body.kind, &payload).await?;
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
    let (address, session) = authenticated(&state, &headers).await?;
    let jobs = state.registry.claim(&address, &session, max).await?;
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
    let (address, _) = authenticated(&state, &headers).await?;
    match state.registry.step(&address, id, step, value.as_ref()).await? {
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

/// One component of a server: which resource it is, and the safe projection.
#[derive(Serialize)]
pub struct ComponentStatus {
    component_kind: String,
    namespace: String,
    name: String,
    #[serde(flatten)]
    session: SessionView,
}

pub async fn server_status(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(server_instance_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let caller = state.auth.authenticate(&headers).await?;
    let identities = state.registry.identities.of_server(&server_instance_id).await?;
    if identities.is_empty() {
        return Err(ApiError::not_found("unknown_server", format!("no RunSession for server {server_instance_id}")));
    }
    let mut components = Vec::new();
    for identity in &identities {
        state.auth.authorize_named(&caller, "get", RESOURCE, &identity.namespace, Some(&identity.name)).await?;
        components.push(component_status(&state, identity).await?);
    }
    Ok(Json(json!({"server_instance_id": server_instance_id, "components": components})))
}

/// A component as its RunSession's status would show it now: live facts from the Redis
/// lease when there is one, else the last facts the status showed.
async fn component_status(state: &AppState, identity: &Identity) -> Result<ComponentStatus, ApiError> {
    let shown = Api::<RunSession>::namespaced(state.kube.clone(), &identity.namespace)
        .get_opt(&identity.name)
        .await
        .map_err(|e| {
            tracing::warn!(namespace = %identity.namespace, name = %identity.name, error = %e,
                           "server status: reading the RunSession failed");
            ApiError::unavailable("kubernetes_unavailable", format!("server status: read RunSession: {e}"))
        })?
        .and_then(|r| r.status)
        .map(|status| SessionView::shown_in(&status))
        .unwrap_or_default();
    let live = match state.registry.sessions.session(&identity.address()).await {
        // A session opened with an older key does not count.
        Ok(session) => session.filter(|s| s.generation == identity.key_generation),
        Err(e) if e.registry_unavailable() => {
            return Ok(component(identity, project(Lease::RegistryDown, &shown)));
        }
        Err(e) => return Err(e.into()),
    };
    let lease = match &live {
        Some(session) => Lease::Held(session),
        None => Lease::Absent { credential_rotated: false },
    };
    Ok(component(identity, project(lease, &shown)))
}

fn component(identity: &Identity, session: SessionView) -> ComponentStatus {
    ComponentStatus {
        component_kind: identity.component_kind.clone(),
        namespace: identity.namespace.clone(),
        name: identity.name.clone(),
        session,
    }
}

//! `/api/v1/controller/*`, what AI agent sessions call: parse, authorize, call the agent
//! sessions service, map errors.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::AppState;
use super::error::{ApiError, ApiJson};
use crate::agent_sessions::{HeartbeatReply, Registered, RoutingTable};
use crate::crd::AgentSurface;

const RESOURCE: &str = "controllerregistrations";

fn check_namespace(ns: &str) -> Result<(), ApiError> {
    let ok = !ns.is_empty()
        && ns.len() <= 63
        && ns.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        && !ns.starts_with('-')
        && !ns.ends_with('-');
    if ok { Ok(()) } else { Err(ApiError::invalid(format!("namespace {ns:?} is not a valid namespace name"))) }
}

fn check_len(field: &str, v: &str, max: usize) -> Result<(), ApiError> {
    if v.is_empty() || v.chars().count() > max {
        Err(ApiError::invalid(format!("{field} must be 1 to {max} characters")))
    } else {
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterBody {
    namespace: String,
    project_id: String,
    session_id: String,
    agent_surface: AgentSurface,
}

pub async fn register(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<RegisterBody>,
) -> Result<(StatusCode, Json<Registered>), ApiError> {
    check_namespace(&body.namespace)?;
    check_len("project_id", &body.project_id, 128)?;
    check_len("session_id", &body.session_id, 256)?;
    let caller = state.auth.authenticate(&headers).await?;
    state.auth.authorize(&caller, "create", RESOURCE, &body.namespace).await?;
    let done = state.agents.register(&body.namespace, &body.project_id, &body.session_id, body.agent_surface).await?;
    Ok((StatusCode::OK, Json(done)))
}

pub async fn release(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<RoutingTable>, ApiError> {
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::invalid("id must be a registration id (uuid)"))?;
    let caller = state.auth.authenticate(&headers).await?;
    // Authorize against the registration's own namespace; an unknown id is 404 only for
    // callers who could see it, so ids do not leak across namespaces.
    let row = state.agents.registration(id).await.map_err(ApiError::from)?;
    state.auth.authorize(&caller, "delete", RESOURCE, &row.namespace).await?;
    Ok(Json(state.agents.release(id).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatBody {
    namespace: String,
    session_id: String,
}

pub async fn heartbeat(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<HeartbeatBody>,
) -> Result<Json<HeartbeatReply>, ApiError> {
    check_namespace(&body.namespace)?;
    check_len("session_id", &body.session_id, 256)?;
    let caller = state.auth.authenticate(&headers).await?;
    state.auth.authorize(&caller, "create", RESOURCE, &body.namespace).await?;
    state.metrics.heartbeats.inc();
    Ok(Json(state.agents.heartbeat(&body.namespace, &body.session_id).await?))
}

#[derive(Deserialize)]
pub struct StatusQuery {
    namespace: Option<String>,
    session_id: Option<String>,
}

pub async fn status(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(project_id): Path<String>,
    Query(q): Query<StatusQuery>,
) -> Result<Json<RoutingTable>, ApiError> {
    let namespace = q.namespace.ok_or_else(|| ApiError::invalid("the namespace query parameter is required"))?;
    check_namespace(&namespace)?;
    check_len("project_id", &project_id, 128)?;
    let caller = state.auth.authenticate(&headers).await?;
    state.auth.authorize(&caller, "list", RESOURCE, &namespace).await?;
    Ok(Json(state.agents.routing(&namespace, &project_id, q.session_id.as_deref()).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FenceBody {
    namespace: String,
    project_id: String,
    term: i64,
}

pub async fn fence(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<FenceBody>,
) -> Result<Json<Value>, ApiError> {
    check_namespace(&body.namespace)?;
    check_len("project_id", &body.project_id, 128)?;
    let caller = state.auth.authenticate(&headers).await?;
    state.auth.authorize(&caller, "get", RESOURCE, &body.namespace).await?;
    match state.agents.fence(&body.namespace, &body.project_id, body.term).await? {
        Some(master) => Ok(Json(json!({"project_id": body.project_id, "term": body.term, "master": master}))),
        None => Err(ApiError::conflict(
            "stale_term",
            format!("term {} is not the current master term of {}", body.term, body.project_id),
        )),
    }
}

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
use crate::agent_sessions::{AgentError, HeartbeatReply, Registered, RoutingTable};
use crate::crd::AgentSurface;
use crate::election::ElectionError;

pub const RESOURCE: &str = "controllerregistrations";

pub fn check_namespace(ns: &str) -> Result<(), ApiError> {
    let ok = !ns.is_empty()
        && ns.len() <= 63
        && ns.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        && !ns.starts_with('-')
        && !ns.ends_with('-');
    if ok { Ok(()) } else { Err(ApiError::invalid(format!("namespace {ns:?} is not a valid namespace name"))) }
}

pub fn check_len(field: &str, v: &str, max: usize) -> Result<(), ApiError> {
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
    let done = state
        .agents
        .register(&body.namespace, &body.project_id, &body.session_id, body.agent_surface, &caller.username)
        .await?;
    Ok((StatusCode::OK, Json(done)))
}

#[derive(Deserialize)]
pub struct ReleaseQuery {
    namespace: Option<String>,
}

/// Wrap by registration id. Authorization comes before any existence check (SPEC §6):
/// with `?namespace=` the caller is authorized there first and the id is looked up in
/// that namespace only (404 only for callers with rights there). Without it, an unknown
/// id and an id the caller may not delete get the same 403, so no caller learns which
/// ids exist where.
pub async fn release(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<ReleaseQuery>,
) -> Result<Json<RoutingTable>, ApiError> {
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::invalid("id must be a registration id (uuid)"))?;
    if let Some(ns) = &q.namespace {
        check_namespace(ns)?;
    }
    let caller = state.auth.authenticate(&headers).await?;
    let row = match &q.namespace {
        Some(ns) => {
            state.auth.authorize(&caller, "delete", RESOURCE, ns).await?;
            match state.agents.registration(id).await {
                Ok(row) if row.row.namespace == *ns => row,
                Ok(_) | Err(AgentError::Election(ElectionError::NotFound(_))) => {
                    return Err(ApiError::not_found("not_found", format!("registration {id} not found in {ns}")));
                }
                Err(e) => return Err(e.into()),
            }
        }
        None => {
            let refused = || {
                ApiError::forbidden(format!(
                    "{} may not delete registration {id}, or it does not exist (pass ?namespace= to tell which)",
                    caller.username
                ))
            };
            match state.agents.registration(id).await {
                Ok(row) => {
                    match state.auth.authorize(&caller, "delete", RESOURCE, &row.row.namespace).await {
                        Err(e) if e.code == "forbidden" => return Err(refused()),
                        other => other?,
                    }
                    row
                }
                Err(AgentError::Election(ElectionError::NotFound(_))) => return Err(refused()),
                Err(e) => return Err(e.into()),
            }
        }
    };
    Ok(Json(state.agents.release(&row, &caller.username).await?))
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
    let role = state.agents.heartbeat(&body.namespace, &body.session_id, &caller.username).await?;
    Ok(Json(HeartbeatReply::from(&role)))
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
    if let Some(session_id) = &q.session_id {
        // An agent call carrying a session_id is its heartbeat (SPEC §4 rule 8) when the
        // session is the caller's; reading the table is refused to nobody.
        match state.agents.heartbeat(&namespace, session_id, &caller.username).await {
            Ok(_) | Err(AgentError::NotRegistered(_) | AgentError::NotOwned(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
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

//! `/api/v1/controller/*`, what AI agent sessions call: parse, authorize, call the agent
//! sessions service, map errors.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::AppState;
use super::docs::{
    BadRequest, Conflict, Forbidden, Internal, Invalid, NotFound, TooLarge, TooManyRequests, Unauthenticated,
    Unavailable, UnsupportedMediaType,
};
use super::error::{ApiError, ApiJson, ApiPath, ApiQuery, ClientAddr};
use crate::agent_sessions::{AgentError, HeartbeatReply, Registered, RouteEntry, RoutingTable};
use crate::crd::AgentSurface;
use crate::election::ElectionError;
use prism_core::limits::{self, PROJECT_ID_MAX, SESSION_ID_MAX};

pub const RESOURCE: &str = "controllerregistrations";

pub fn check_namespace(ns: &str) -> Result<(), ApiError> {
    if limits::is_namespace(ns) {
        Ok(())
    } else {
        Err(ApiError::invalid(format!("namespace {ns:?} is not a valid namespace name")))
    }
}

// The schemas below state these checks as `pattern`s (utoipa takes literals only); the
// unit tests hold each pattern of the served document to the function it restates.

/// An identifier (a project or session id, SPEC §3.1): `limits::is_identifier`.
pub fn check_identifier(field: &str, v: &str, max: usize) -> Result<(), ApiError> {
    if limits::is_identifier(v, max) { Ok(()) } else { Err(ApiError::invalid(limits::identifier_rule(field, max))) }
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegisterBody {
    #[schema(max_length = 63, pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", example = "agents")]
    namespace: String,
    #[schema(min_length = 1, max_length = 128, pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$", example = "PID-42")]
    project_id: String,
    #[schema(min_length = 1, max_length = 256, pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$", example = "session-1")]
    session_id: String,
    agent_surface: AgentSurface,
}

impl RegisterBody {
    /// Everything about the body a handler checks before any token or row is looked at.
    pub fn check(&self) -> Result<(), ApiError> {
        check_namespace(&self.namespace)?;
        check_identifier("project_id", &self.project_id, PROJECT_ID_MAX)?;
        check_identifier("session_id", &self.session_id, SESSION_ID_MAX)
    }
}

/// Register an agent session for a project
///
/// Creates (or finds) the session's ControllerRegistration, runs the election and answers
/// with its result and the project's routing table. The caller must be allowed to
/// `create` controllerregistrations in the namespace; the session then belongs to it.
#[utoipa::path(
    post,
    path = "/api/v1/controller/register",
    tag = "controller",
    request_body = RegisterBody,
    security(("kubernetes" = [])),
    responses(
        (status = 200, description = "Registered (or already registered)", body = Registered),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 403, response = Forbidden),
        (status = 404, response = NotFound),
        (status = 413, response = TooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn register(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiJson(body): ApiJson<RegisterBody>,
) -> Result<(StatusCode, Json<Registered>), ApiError> {
    body.check()?;
    let caller = state.auth.authenticate(&headers, peer).await?;
    state.auth.authorize(&caller, "create", RESOURCE, &body.namespace).await?;
    let done = state
        .agents
        .register(&body.namespace, &body.project_id, &body.session_id, body.agent_surface, &caller.username)
        .await?;
    Ok((StatusCode::OK, Json(done)))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ReleaseQuery {
    /// The registration's namespace: with it, an id unknown there is a 404 (for callers
    /// with rights there); without it, the same 403 as a refusal.
    #[param(max_length = 63, pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
    namespace: Option<String>,
}

/// Wrap by registration id. Authorization comes before any existence check (SPEC §6):
/// with `?namespace=` the caller is authorized there first and the id is looked up in
/// that namespace only (404 only for callers with rights there). Without it, an unknown
/// id and an id the caller may not delete get the same 403, so no caller learns which
/// ids exist where.
#[utoipa::path(
    post,
    path = "/api/v1/controller/{id}/release",
    tag = "controller",
    params(("id" = Uuid, Path, description = "The registration id"), ReleaseQuery),
    security(("kubernetes" = [])),
    responses(
        (status = 200, description = "Released; the project's routing table now", body = RoutingTable),
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
pub async fn release(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<ReleaseQuery>,
) -> Result<Json<RoutingTable>, ApiError> {
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::invalid("id must be a registration id (uuid)"))?;
    if let Some(ns) = &q.namespace {
        check_namespace(ns)?;
    }
    let caller = state.auth.authenticate(&headers, peer).await?;
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

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatBody {
    #[schema(max_length = 63, pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", example = "agents")]
    namespace: String,
    #[schema(min_length = 1, max_length = 256, pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$", example = "session-1")]
    session_id: String,
}

impl HeartbeatBody {
    pub fn check(&self) -> Result<(), ApiError> {
        check_namespace(&self.namespace)?;
        check_identifier("session_id", &self.session_id, SESSION_ID_MAX)
    }
}

/// Heartbeat of an agent session
///
/// Keeps the caller's registration live and answers with its role.
#[utoipa::path(
    post,
    path = "/api/v1/controller/heartbeat",
    operation_id = "controller_heartbeat",
    tag = "controller",
    request_body = HeartbeatBody,
    security(("kubernetes" = [])),
    responses(
        (status = 200, description = "The session's role now", body = HeartbeatReply),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 403, response = Forbidden),
        (status = 404, response = NotFound),
        (status = 413, response = TooLarge),
        (status = 415, response = UnsupportedMediaType),
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
    ApiJson(body): ApiJson<HeartbeatBody>,
) -> Result<Json<HeartbeatReply>, ApiError> {
    body.check()?;
    let caller = state.auth.authenticate(&headers, peer).await?;
    state.auth.authorize(&caller, "create", RESOURCE, &body.namespace).await?;
    state.metrics.heartbeats.inc();
    let role = state.agents.heartbeat(&body.namespace, &body.session_id, &caller.username).await?;
    let mut reply = HeartbeatReply::from(&role);
    reply.nudges = state.agents.take_nudges(&body.namespace, &body.session_id, &caller.username).await?;
    Ok(Json(reply))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StatusQuery {
    /// The project's namespace (required).
    #[param(required = true, max_length = 63, pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", example = "agents")]
    namespace: Option<String>,
    /// The caller's session: fills `caller` and counts as its heartbeat.
    #[param(min_length = 1, max_length = 256, pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$")]
    session_id: Option<String>,
}

impl StatusQuery {
    pub fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }

    /// The namespace, once the query and the path's project id are checked.
    pub fn check(&self, project_id: &str) -> Result<String, ApiError> {
        let namespace =
            self.namespace.clone().ok_or_else(|| ApiError::invalid("the namespace query parameter is required"))?;
        check_namespace(&namespace)?;
        check_identifier("project_id", project_id, PROJECT_ID_MAX)?;
        if let Some(session_id) = &self.session_id {
            check_identifier("session_id", session_id, SESSION_ID_MAX)?;
        }
        Ok(namespace)
    }
}

/// A project's routing table
#[utoipa::path(
    get,
    path = "/api/v1/controller/{project_id}/status",
    tag = "controller",
    params(
        ("project_id" = String, Path, min_length = 1, max_length = 128, pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$"),
        StatusQuery,
    ),
    security(("kubernetes" = [])),
    responses(
        (status = 200, description = "The routing table", body = RoutingTable),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 403, response = Forbidden),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn status(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiPath(project_id): ApiPath<String>,
    ApiQuery(q): ApiQuery<StatusQuery>,
) -> Result<Json<RoutingTable>, ApiError> {
    let namespace = q.check(&project_id)?;
    let caller = state.auth.authenticate(&headers, peer).await?;
    state.auth.authorize(&caller, "list", RESOURCE, &namespace).await?;
    let mut nudges = None;
    if let Some(session_id) = &q.session_id
        && state.auth.allowed(&caller, "create", RESOURCE, &namespace, None).await?
    {
        // An agent call carrying a session_id is its heartbeat (SPEC §4 rule 8) when the
        // caller may heartbeat it: it owns the session and may create registrations. A
        // reader (a dashboard with get/list) refreshes nothing, so it cannot keep a dead
        // session alive past the sweep. Reading the table is refused to nobody.
        match state.agents.heartbeat(&namespace, session_id, &caller.username).await {
            Ok(_) => nudges = Some(state.agents.take_nudges(&namespace, session_id, &caller.username).await?),
            Err(AgentError::NotRegistered(_) | AgentError::NotOwned(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let mut table = state.agents.routing(&namespace, &project_id, q.session_id.as_deref()).await?;
    table.nudges = nudges;
    Ok(Json(table))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FenceBody {
    #[schema(max_length = 63, pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", example = "agents")]
    namespace: String,
    #[schema(min_length = 1, max_length = 128, pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$", example = "PID-42")]
    project_id: String,
    /// The term a write claims to be made in.
    #[serde(deserialize_with = "crate::json_int::i64")]
    term: i64,
}

impl FenceBody {
    pub fn check(&self) -> Result<(), ApiError> {
        check_namespace(&self.namespace)?;
        check_identifier("project_id", &self.project_id, PROJECT_ID_MAX)
    }
}

/// `term` is the project's current master term.
#[derive(Serialize, ToSchema)]
pub struct FenceReply {
    project_id: String,
    term: i64,
    master: RouteEntry,
}

/// Fence a write by its term
///
/// 200 if `term` is the project's current master term, else 409 `stale_term`: lets any
/// downstream system reject writes from a demoted master.
#[utoipa::path(
    post,
    path = "/api/v1/controller/fence",
    tag = "controller",
    request_body = FenceBody,
    security(("kubernetes" = [])),
    responses(
        (status = 200, description = "`term` is current", body = FenceReply),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 403, response = Forbidden),
        (status = 409, response = Conflict),
        (status = 413, response = TooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn fence(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiJson(body): ApiJson<FenceBody>,
) -> Result<Json<FenceReply>, ApiError> {
    body.check()?;
    let caller = state.auth.authenticate(&headers, peer).await?;
    state.auth.authorize(&caller, "get", RESOURCE, &body.namespace).await?;
    match state.agents.fence(&body.namespace, &body.project_id, body.term).await? {
        Some(master) => Ok(Json(FenceReply { project_id: body.project_id, term: body.term, master })),
        None => Err(ApiError::conflict(
            "stale_term",
            format!("term {} is not the current master term of {}", body.term, body.project_id),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::any_input::{any_string, body_bytes, is_client_error, through_api_json};
    use proptest::prelude::*;
    use serde_json::json;

    /// What Postgres and Kubernetes will take for the text columns these bodies fill
    /// (`VARCHAR(n)` counts characters; no `text` holds a NUL), and what prints on one
    /// line (no control character).
    fn storable(v: &str, max: usize) -> bool {
        !v.is_empty() && v.chars().count() <= max && !v.chars().any(char::is_control)
    }

    #[test]
    fn control_characters_are_refused_in_identifiers() {
        assert!(check_identifier("session_id", "a\0b", SESSION_ID_MAX).is_err());
        for bad in ["P\nX", "P\rX", "P\tX", "P\u{7f}", "P\u{85}X", "\u{1b}[31m"] {
            assert!(check_identifier("project_id", bad, PROJECT_ID_MAX).is_err(), "{bad:?}");
        }
        assert!(check_identifier("project_id", "PID-42 ü 日本 🚀", PROJECT_ID_MAX).is_ok());
        assert!(check_identifier("session_id", "é".repeat(256).as_str(), SESSION_ID_MAX).is_ok());
        assert!(check_identifier("session_id", "é".repeat(257).as_str(), SESSION_ID_MAX).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Any body: a 4xx or a body whose every field fits its column; never a panic.
        #[test]
        fn register_bodies(bytes in body_bytes(json!({
            "namespace": "agents", "project_id": "P", "session_id": "s", "agent_surface": "codex"
        }))) {
            match through_api_json::<RegisterBody>(bytes).and_then(|b| b.check().map(|()| b)) {
                Ok(b) => {
                    prop_assert!(check_namespace(&b.namespace).is_ok());
                    prop_assert!(storable(&b.project_id, PROJECT_ID_MAX) && storable(&b.session_id, SESSION_ID_MAX));
                }
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
            }
        }

        #[test]
        fn heartbeat_bodies(bytes in body_bytes(json!({"namespace": "agents", "session_id": "s"}))) {
            match through_api_json::<HeartbeatBody>(bytes).and_then(|b| b.check().map(|()| b)) {
                Ok(b) => prop_assert!(storable(&b.session_id, SESSION_ID_MAX)),
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
            }
        }

        /// `term` is any i64 the caller likes (it is only compared); u64 and floats are 422s.
        #[test]
        fn fence_bodies(bytes in body_bytes(json!({"namespace": "agents", "project_id": "P", "term": 3}))) {
            match through_api_json::<FenceBody>(bytes).and_then(|b| b.check().map(|()| b)) {
                Ok(b) => prop_assert!(storable(&b.project_id, PROJECT_ID_MAX)),
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
            }
        }

        #[test]
        fn status_queries(ns in any_string(), project in any_string(), session in proptest::option::of(any_string())) {
            let q = StatusQuery { namespace: Some(ns), session_id: session };
            match q.check(&project) {
                Ok(_) => {
                    prop_assert!(storable(&project, PROJECT_ID_MAX));
                    prop_assert!(q.session_id.as_deref().is_none_or(|s| storable(s, SESSION_ID_MAX)));
                }
                Err(e) => prop_assert!(is_client_error(&e)),
            }
        }
    }
}

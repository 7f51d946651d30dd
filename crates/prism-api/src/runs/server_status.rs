//! `GET /api/v1/runtime/servers/{id}/status`: the safe projection of every component of a
//! server that the caller may see.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use kube::Api;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::RESOURCE;
use crate::AppState;
use crate::agents::check_namespace;
use crate::crd::RunSession;
use crate::docs::{BadRequest, Forbidden, Internal, Invalid, NotFound, TooManyRequests, Unauthenticated, Unavailable};
use crate::error::{ApiError, ApiPath, ApiQuery, ClientAddr};
use crate::run_registry::identity::Identity;
use crate::run_registry::service::server_instance_id_ok;
use prism_kube::projection::{Lease, SessionView, project};

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

//! HTTP API (axum). Handlers parse, authorize, call a service and map errors; no domain
//! logic lives here.

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{any, get};
use serde_json::json;
use sqlx::PgPool;
use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::agent_sessions::AgentService;
use crate::election::Cause;
use crate::run_registry::service::RunRegistry;
use crate::telemetry::Metrics;

pub mod agents;
pub mod auth;
pub mod docs;
pub mod error;
pub mod limits;
pub mod mcp;
pub mod runs;
pub mod strict;

pub use error::{ApiError, ApiJson};

/// Largest request body accepted anywhere (SPEC §6: limit it).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

pub struct AppState {
    pub db: PgPool,
    pub kube: kube::Client,
    pub auth: auth::Authorizer,
    pub limits: Arc<limits::Limits>,
    pub agents: AgentService,
    pub registry: RunRegistry,
    pub metrics: Arc<Metrics>,
    pub mcp: mcp::McpConfig,
}

/// Every route of `/api/v1`, each with its OpenAPI operation: the router and the
/// document are both made from this one list, so neither has a route the other lacks
/// (tests check it: `routes_and_document_agree`, tests/openapi.rs).
pub fn api_routes() -> OpenApiRouter<Arc<AppState>> {
    OpenApiRouter::with_openapi(docs::ApiDoc::openapi())
        .routes(routes!(docs::openapi_json))
        .routes(routes!(agents::register))
        .routes(routes!(agents::heartbeat))
        .routes(routes!(agents::fence))
        .routes(routes!(agents::release))
        .routes(routes!(agents::status))
        .routes(routes!(runs::hello))
        .routes(routes!(runs::heartbeat))
        .routes(routes!(runs::enqueue))
        .routes(routes!(runs::claim))
        .routes(routes!(runs::ack))
        .routes(routes!(runs::progress))
        .routes(routes!(runs::complete))
        .routes(routes!(runs::server_status))
}

/// The OpenAPI document of `/api/v1` (what `GET /api/v1/openapi.json` serves).
pub fn openapi() -> utoipa::openapi::OpenApi {
    api_routes().into_openapi()
}

/// Everything outside `/api/v1` that needs no state of its own at build time.
fn service_routes() -> Router<Arc<AppState>> {
    Router::new().route("/healthz", get(healthz)).route("/readyz", get(readyz)).route("/metrics", get(metrics))
}

/// Every route but `/mcp` (whose endpoint is built from the state), before the state is
/// given: what the route test inspects.
pub fn stateless_routes() -> Router<Arc<AppState>> {
    let (api, _) = api_routes().split_for_parts();
    service_routes().merge(api)
}

pub fn router(state: Arc<AppState>) -> Router {
    let mcp = Arc::new(mcp::Endpoint::new(state.clone()));
    Router::new()
        .route(
            "/mcp",
            any(move |request: axum::extract::Request| {
                let mcp = mcp.clone();
                async move { mcp.handle(request).await }
            }),
        )
        .merge(stateless_routes())
        .fallback(|| async { ApiError::not_found("not_found", "no such endpoint") })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    refresh_gauges(&state).await;
    let headers = [(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")];
    (headers, state.metrics.render()).into_response()
}

/// Cluster-wide gauges, read at scrape time. A dependency that does not answer is
/// reported down (and logged) and its gauges keep their last value.
async fn refresh_gauges(state: &AppState) {
    let pg_up = match postgres_gauges(state).await {
        Ok(()) => true,
        Err(error) => {
            tracing::warn!(%error, "metrics: Postgres gauges not refreshed");
            false
        }
    };
    state.metrics.set_up("postgres", pg_up);
    let redis_up = state.registry.sessions.ping().await.is_ok();
    state.metrics.set_up("redis", redis_up);
    if redis_up && let Err(error) = runs_online_gauge(state).await {
        tracing::warn!(%error, "metrics: runs online not refreshed");
    }
}

async fn postgres_gauges(state: &AppState) -> Result<(), crate::db::QueryError> {
    use crate::db::Step;
    let m = &state.metrics;
    let causes: Vec<(Cause, i64)> =
        sqlx::query_as("SELECT cause, count(*) FROM controller_election_events GROUP BY cause")
            .fetch_all(&state.db)
            .await
            .step("metrics: count election events")?;
    for (cause, n) in causes {
        m.set_election_events(cause, n);
    }
    let roles: Vec<(String, bool, i64)> = sqlx::query_as(
        "SELECT namespace, is_master, count(*) FROM controller_registrations WHERE released_at IS NULL GROUP BY 1, 2",
    )
    .fetch_all(&state.db)
    .await
    .step("metrics: count live registrations")?;
    m.set_registrations(roles);
    match state.registry.jobs.queue_depth().await {
        Ok(n) => {
            m.jobs_queued.set(n);
        }
        Err(crate::run_registry::RegistryError::Database(e)) => return Err(e),
        Err(other) => tracing::warn!(error = %other, "metrics: queued jobs not counted"),
    };
    Ok(())
}

async fn runs_online_gauge(state: &AppState) -> Result<(), crate::run_registry::RegistryError> {
    let addresses = state.registry.identities.all_addresses().await?;
    let online = state.registry.sessions.count_live(&addresses).await?;
    state.metrics.runs_online.set(i64::try_from(online).unwrap_or(i64::MAX));
    Ok(())
}

/// Liveness: the process serves requests. Dependencies are /readyz's business.
async fn healthz() -> &'static str {
    "ok"
}

/// Readiness per dependency. Without Postgres nothing works (503). Without Redis the
/// runtime registry is unavailable but the controller API still is, so the replica stays
/// in the Service and Runs get a precise 503 `runtime_registry_unavailable` rather than
/// a connection error.
async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    // At once, not one after another: a probe has one timeout for the whole answer.
    let (postgres, redis, kubernetes) = tokio::join!(
        async { sqlx::query("SELECT 1").execute(&state.db).await.map(|_| ()).map_err(|e| e.to_string()) },
        async { state.registry.sessions.ping().await.map_err(|e| e.to_string()) },
        async { state.kube.apiserver_version().await.map(|_| ()).map_err(|e| e.to_string()) },
    );
    let check = |r: &Result<(), String>| match r {
        Ok(()) => json!({"status": "ok"}),
        Err(e) => json!({"status": "unavailable", "message": e}),
    };
    let ready = postgres.is_ok() && kubernetes.is_ok();
    let status = match (ready, redis.is_ok()) {
        (true, true) => "ready",
        (true, false) => "degraded",
        (false, _) => "unavailable",
    };
    let body = json!({
        "status": status,
        "checks": {
            "postgres": check(&postgres),
            "runtime_registry": check(&redis),
            "kubernetes": check(&kubernetes),
        }
    });
    let code = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(body)).into_response()
}

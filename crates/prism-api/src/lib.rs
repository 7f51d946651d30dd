//! prism-operator's HTTP and MCP API (axum, rmcp) and the listener that serves it.
//! Handlers parse, authorize, call a service and map errors; no domain logic lives here,
//! and no SQL or Redis: the stores' services (prism-store) do that.

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{any, get};
use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::agent_sessions::AgentService;
use crate::metrics::Metrics;
use crate::run_registry::service::RunRegistry;

// The layers below, by the names this crate's modules use for them.
pub(crate) use prism_kube::{crd, reconcilers};
pub(crate) use prism_store::{db, election, json_int, mcp_store, run_registry, signals};

// What agents ask for (register, heartbeat, fence, release, status), over the election.
pub mod agent_sessions;
// The listener (TLS, server limits) and the client a Run uses to speak this API.
pub mod run_client;
pub mod transport;
// The API's own flags and environment variables, read into the types they configure.
pub mod settings;
// The metrics this process exposes (and the reconcilers record into).
pub mod metrics;
// Fail points for the tests (the `failpoints` feature).
pub mod failpoints;
// Strategies for the property tests of every input (tests only).
#[cfg(test)]
pub(crate) mod any_input;

// The routes: Kubernetes-token agents, the proofs and jobs of Runs, the watch, MCP.
pub mod agents;
pub mod auth;
pub mod docs;
pub mod error;
pub mod health;
pub mod limits;
pub mod mcp;
pub mod runs;
pub mod shares;
pub mod sse;
pub mod streams;
pub mod strict;
pub mod watch;

pub use error::{ApiError, ApiJson};

/// Largest request body accepted anywhere (SPEC §6: limit it).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

pub struct AppState {
    pub health: Arc<health::Health>,
    pub kube: kube::Client,
    pub auth: auth::Authorizer,
    pub limits: Arc<limits::Limits>,
    pub agents: AgentService,
    pub registry: RunRegistry,
    pub metrics: Arc<Metrics>,
    pub mcp: mcp::McpConfig,
    /// True once the process is stopping: long polls answer at once (SPEC §11).
    pub stopping: tokio::sync::watch::Receiver<bool>,
    /// What this replica hears of change on any replica (long polls, watches).
    pub signals: crate::signals::Signals,
    /// The held requests (watches, MCP streams, long polls) of each caller (SPEC §12).
    pub streams: Arc<streams::Streams>,
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
        .routes(routes!(watch::watch))
        .routes(routes!(runs::hello))
        .routes(routes!(runs::heartbeat))
        .routes(routes!(runs::enqueue, runs::list_jobs))
        .routes(routes!(runs::get_job))
        .routes(routes!(runs::cancel_job))
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
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/version", get(version))
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
        .layer(
            tower_http::trace::TraceLayer::new_for_http()
                .make_span_with(request_span)
                .on_request(())
                .on_response(request_done)
                .on_failure(()),
        )
        .with_state(state)
}

/// One span per request: method and route now, the caller once authenticated
/// (`record_caller`), the MCP method once the gate read it, the status at the end.
/// Store calls are its children (debug spans), so a slow heartbeat can be followed.
fn request_span(request: &axum::http::Request<axum::body::Body>) -> tracing::Span {
    let route = request.extensions().get::<axum::extract::MatchedPath>().map(|p| p.as_str()).unwrap_or("unmatched");
    tracing::info_span!(
        "request",
        otel.name = format!("{} {route}", request.method()),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = %request.method(),
        http.route = route,
        caller = tracing::field::Empty,
        mcp.method = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    )
}

fn request_done(response: &Response, latency: std::time::Duration, span: &tracing::Span) {
    let status = response.status();
    // As an i64: the OpenTelemetry layer exports a u64 as a string.
    span.record("http.response.status_code", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    tracing::debug!(status = status.as_u16(), latency_ms = latency.as_secs_f64() * 1000.0, "request answered");
}

/// Names the caller on the request's span: a Kubernetes username, or `run:<address>`.
/// Never a token.
pub fn record_caller(caller: &dyn std::fmt::Display) {
    tracing::Span::current().record("caller", tracing::field::display(caller));
}

/// Prometheus text, from memory: the gauges are refreshed in the background
/// (`health`), so a scrape (needing no token) costs no backend round trip.
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let headers = [(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")];
    (headers, state.metrics.render()).into_response()
}

/// The release this replica runs (SPEC §15): during a rolling upgrade or a rollback the
/// replicas behind one Service answer with their own. No token, like `/healthz`.
async fn version() -> Response {
    Json(serde_json::json!({"version": prism_core::release::VERSION})).into_response()
}

/// Liveness: the process serves requests. Dependencies are /readyz's business.
async fn healthz() -> &'static str {
    "ok"
}

/// Readiness per dependency, as the background prober last saw it (`health`).
async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let (ready, body) = state.health.readiness();
    let code = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(body)).into_response()
}

/// Selects ring as the process's TLS provider for every client (kube, sqlx, reqwest),
/// whatever features dependencies enable. Idempotent; call before building clients.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn version_answers_the_release() {
        let response = super::version().await;
        assert_eq!(response.status(), axum::http::StatusCode::OK);
        let body = axum::body::to_bytes(response.into_body(), 1024).await.expect("body");
        let json: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(json, serde_json::json!({"version": env!("CARGO_PKG_VERSION")}));
    }
}

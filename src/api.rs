//! HTTP API (axum). Handlers parse, authorize, call a service and map errors; no domain
//! logic lives here.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use serde_json::json;
use sqlx::PgPool;
use tower_http::limit::RequestBodyLimitLayer;

use crate::runtime::RedisStore;

/// Largest request body accepted anywhere (SPEC §6: limit it).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

pub struct AppState {
    pub db: PgPool,
    pub redis: RedisStore,
    pub kube: kube::Client,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .layer(RequestBodyLimitLayer::new(MAX_BODY_BYTES))
        .with_state(state)
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
    let postgres = sqlx::query("SELECT 1")
        .execute(&state.db)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string());
    let redis = state.redis.ping().await.map_err(|e| e.to_string());
    let kubernetes = state
        .kube
        .apiserver_version()
        .await
        .map(|_| ())
        .map_err(|e| e.to_string());
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
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

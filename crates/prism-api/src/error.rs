//! The one mapping from errors to HTTP: `{"error": {"code", "message"}}` with a status.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{error, warn};
use utoipa::ToSchema;

use crate::agent_sessions::AgentError;
use crate::db::QueryError;
use crate::election::ElectionError;
use crate::run_registry::RegistryError;

/// Every error answer of the API, whatever its status (SPEC §6).
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    /// A stable, machine-readable code (`invalid_request`, `forbidden`, ...).
    pub code: &'static str,
    /// For people; its wording may change.
    pub message: String,
}

/// What a 503 asks its caller to wait before the retry.
const UNAVAILABLE_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Sent as `Retry-After` (whole seconds, rounded up): 429 and 503 answers carry it.
    pub retry_after: Option<std::time::Duration>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), retry_after: None }
    }
    /// SPEC §12: a rate limit spent; `retry_after` says when the next try may pass.
    pub fn rate_limited(message: impl Into<String>, retry_after: std::time::Duration) -> Self {
        Self { retry_after: Some(retry_after), ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", message) }
    }
    /// SPEC §12: a quota of live objects is full.
    pub fn quota_exceeded(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", message)
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", message)
    }
    pub fn unauthenticated(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, code, message)
    }
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }
    /// SPEC §6: the session belongs to another Kubernetes identity.
    pub fn not_owned(session_id: &str) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "session_not_owned",
            format!("session {session_id} was registered by another identity; only its owner may act on it"),
        )
    }
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, message)
    }
    /// A dependency out of reach just now: worth a retry, which `Retry-After` invites
    /// (SPEC §15: a client retries a 503 with `Retry-After`; a rolling update or a
    /// failover is over in about that time).
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self { retry_after: Some(UNAVAILABLE_RETRY), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message) }
    }
    /// Details go to the log; the caller gets a generic message.
    pub fn internal(context: &str, e: impl std::fmt::Display) -> Self {
        error!(error = %e, "{context}");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error; see the operator log")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody { error: ErrorDetail { code: self.code, message: self.message } };
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(wait) = self.retry_after {
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}

/// A failed statement: 503 only when Postgres cannot be reached (worth a retry); anything
/// else is a bug or bad data, a 500 whose cause is logged with the step that failed.
impl From<QueryError> for ApiError {
    fn from(e: QueryError) -> Self {
        if e.is_unavailable() {
            warn!(error = %e, "database unavailable");
            ApiError::unavailable("database_unavailable", "the database is unavailable; retry")
        } else {
            ApiError::internal("database error", e)
        }
    }
}

impl From<ElectionError> for ApiError {
    fn from(e: ElectionError) -> Self {
        match e {
            ElectionError::NotFound(id) => ApiError::not_found("not_found", format!("registration {id} not found")),
            ElectionError::NotOwned(s) => ApiError::not_owned(&s),
            ElectionError::QuotaExceeded(quota) => ApiError::quota_exceeded(format!("quota exceeded: {quota}")),
            ElectionError::Contended(_) => ApiError::unavailable("contended", e.to_string()),
            ElectionError::Database(e) => e.into(),
        }
    }
}

impl From<AgentError> for ApiError {
    fn from(e: AgentError) -> Self {
        match e {
            AgentError::Election(e) => e.into(),
            AgentError::Kube { step, source } => match source {
                kube::Error::Api(s) if s.code == 404 => ApiError::not_found("not_found", s.message),
                kube::Error::Api(s) if s.code == 403 => ApiError::forbidden(s.message),
                kube::Error::Api(s) if s.code == 422 || s.code == 400 => ApiError::invalid(s.message),
                other => {
                    // The cause to the log only: a caller learns nothing of the cluster's
                    // insides (addresses, the operator's identity) from an answer.
                    warn!(step, error = %other, "Kubernetes API unavailable");
                    ApiError::unavailable(
                        "kubernetes_unavailable",
                        format!("{step}: the Kubernetes API did not answer; retry"),
                    )
                }
            },
            AgentError::NotRegistered(s) => {
                ApiError::not_found("not_registered", format!("session {s} has no live registration"))
            }
            AgentError::NotOwned(s) => ApiError::not_owned(&s),
            AgentError::BadUid(_) | AgentError::Patch(_) => ApiError::internal("register", e),
        }
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        if e.registry_unavailable() {
            warn!(error = %e, "runtime registry unavailable");
            return ApiError::unavailable(
                "runtime_registry_unavailable",
                "the runtime registry (Redis) is unavailable",
            );
        }
        match e {
            RegistryError::Database(e) => e.into(),
            other => ApiError::internal("runtime registry", other),
        }
    }
}

/// `axum::Json`, but every rejection is our JSON error with a code, and the body is read
/// as JSON Schema reads it (`strict`: structs from objects only, enums from strings only).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<serde_json::Value>::from_request(req, state).await {
            Ok(axum::Json(v)) => {
                super::strict::from_value(v).map(ApiJson).map_err(|e| ApiError::invalid(e.to_string()))
            }
            Err(rejection) => Err(match &rejection {
                JsonRejection::JsonSyntaxError(_) | JsonRejection::JsonDataError(_) => {
                    ApiError::new(StatusCode::BAD_REQUEST, "malformed_json", rejection.body_text())
                }
                JsonRejection::MissingJsonContentType(_) => ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    "expected Content-Type: application/json",
                ),
                JsonRejection::BytesRejection(_) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                    ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", "request body too large")
                }
                _ => ApiError::new(StatusCode::BAD_REQUEST, "bad_request", rejection.body_text()),
            }),
        }
    }
}

/// `axum::extract::Path`, but a value that cannot be decoded (say `%FF`, not UTF-8) is
/// our JSON 400 rather than axum's plain-text one.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(ApiPath(v)),
            Err(rejection) => Err(ApiError::new(StatusCode::BAD_REQUEST, "bad_request", rejection.body_text())),
        }
    }
}

/// `axum::extract::Query`, with our JSON 400 for a query string that cannot be decoded
/// (a repeated parameter, bytes that are not UTF-8).
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(ApiQuery(v)),
            Err(rejection) => Err(ApiError::new(StatusCode::BAD_REQUEST, "bad_request", rejection.body_text())),
        }
    }
}

/// The address of the peer that sent the request, when the server says (it does: the
/// router is served with `ConnectInfo`); what rate limits of unauthenticated work key on.
pub struct ClientAddr(pub Option<std::net::IpAddr>);

impl<S: Send + Sync> FromRequestParts<S> for ClientAddr {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let info = parts.extensions.get::<axum::extract::ConnectInfo<std::net::SocketAddr>>();
        Ok(ClientAddr(info.map(|c| c.0.ip())))
    }
}

/// The raw body (for routes whose JSON body is optional), with our JSON 413 for one over
/// the limit rather than axum's plain-text one.
pub struct ApiBody(pub axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for ApiBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::body::Bytes::from_request(req, state).await {
            Ok(bytes) => Ok(ApiBody(bytes)),
            Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", "request body too large"))
            }
            Err(rejection) => Err(ApiError::new(StatusCode::BAD_REQUEST, "bad_request", rejection.body_text())),
        }
    }
}

//! The OpenAPI 3.1 document of `/api/v1`: generated from the handlers' own request and
//! response types (`#[utoipa::path]` on each handler, `ToSchema` on each type) and served
//! at `GET /api/v1/openapi.json`. What is not a handler's is here: the document's info,
//! the two bearer schemes, and one reusable response per error status, each with the
//! `{"error": {"code", "message"}}` body that `ApiError` answers with.

use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi, ToResponse};

use super::error::{ApiError, ErrorBody};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "prism-operator HTTP API",
        description = "Agents register, heartbeat, read routing tables and fence writes with a Kubernetes \
                       bearer token; Runs prove possession of their key (hello) and then use their session \
                       token. Every error is `{\"error\": {\"code\", \"message\"}}`."
    ),
    modifiers(&SecuritySchemes),
    components(
        schemas(ErrorBody),
        responses(
            BadRequest,
            Unauthenticated,
            Forbidden,
            NotFound,
            Conflict,
            TooLarge,
            UnsupportedMediaType,
            Invalid,
            Internal,
            Unavailable
        )
    ),
    tags(
        (name = "controller", description = "AI agent sessions and the controller election"),
        (name = "runtime", description = "Runs: hello, session heartbeat, jobs; status for platform identities"),
        (name = "meta", description = "This document")
    )
)]
pub struct ApiDoc;

/// `kubernetes`: a token the API server accepts (TokenReview), authorized per call with a
/// SubjectAccessReview. `session`: the token a Run's hello granted.
struct SecuritySchemes;

impl Modify for SecuritySchemes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "kubernetes",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A Kubernetes bearer token (e.g. `kubectl create token`), checked with a TokenReview; \
                         each call is authorized with a SubjectAccessReview",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "session",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("prs1")
                    .description(Some("The session token a Run's hello was granted"))
                    .build(),
            ),
        );
    }
}

// One reusable response per error status. Never built: only their descriptions and body
// schema are used, by the operations' `responses(...)`.

/// `malformed_json`: the body is not JSON; `bad_request`: a path or query that cannot be
/// decoded, or a body that cannot be read
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct BadRequest(ErrorBody);

/// `unauthenticated`: no bearer token; `invalid_token`: one that is not accepted;
/// `session_expired`, `session_superseded`: a session token that no longer holds; a hello's
/// failed proof: `unknown_identity`, `stale_generation`, `bad_signature`, `clock_skew`,
/// `replayed_nonce`
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct Unauthenticated(ErrorBody);

/// `forbidden`: the caller may not do this (SubjectAccessReview); `session_not_owned`: the
/// session belongs to another identity; `cross_target`: the job is another Run's
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct Forbidden(ErrorBody);

/// `not_found`, `not_registered`, `unknown_identity`, `unknown_server`, `job_not_found`
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct NotFound(ErrorBody);

/// `stale_term`: not the project's current master term; `invalid_state`: the job is not in a
/// state that allows this step
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct Conflict(ErrorBody);

/// `payload_too_large`: the body is over 64 KiB
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct TooLarge(ErrorBody);

/// `unsupported_media_type`: the body must be `Content-Type: application/json`
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct UnsupportedMediaType(ErrorBody);

/// `invalid_request`: well-formed JSON that breaks the schema or a rule of the field
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct Invalid(ErrorBody);

/// `internal`: a bug; the cause is in the operator's log
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct Internal(ErrorBody);

/// `database_unavailable`, `runtime_registry_unavailable`, `kubernetes_unavailable`,
/// `contended`: a dependency did not answer; retry
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct Unavailable(ErrorBody);

/// This document
///
/// The OpenAPI 3.1 document of this API, generated from the handlers. No token needed.
#[utoipa::path(
    get,
    path = "/api/v1/openapi.json",
    tag = "meta",
    responses(
        (status = 200, description = "The OpenAPI document", body = serde_json::Value),
        (status = 500, response = Internal),
    )
)]
pub async fn openapi_json() -> Response {
    // Built once: the document is fixed at compile time.
    static DOCUMENT: OnceLock<Result<String, String>> = OnceLock::new();
    match DOCUMENT.get_or_init(|| super::openapi().to_json().map_err(|e| e.to_string())) {
        Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json.clone()).into_response(),
        Err(e) => ApiError::internal("openapi document", e).into_response(),
    }
}

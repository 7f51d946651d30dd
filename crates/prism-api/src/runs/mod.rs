//! `/api/v1/runtime/*`: Runs prove possession (hello), then use their session token;
//! platform identities enqueue jobs and read safe status with Kubernetes tokens.
//!
//! One module per seam: `hello` (open a session), `heartbeat` (renew it), `jobs` (enqueue,
//! read, list, cancel), `claim` (hand jobs to a Run), `steps` (ack, progress, complete),
//! `server_status`. What every seam shares stays here: optional bodies, the session token
//! and its refusals, job ids and the finished-job refusal.

use std::net::IpAddr;

use axum::http::{HeaderMap, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::Value;
use uuid::Uuid;

use super::AppState;
use super::auth::bearer;
use super::error::ApiError;
use crate::run_registry::jobs::JobState;
use crate::run_registry::service::SessionRefused;
use crate::run_registry::{RunAddress, Session};

mod claim;
mod heartbeat;
mod hello;
mod jobs;
mod server_status;
mod steps;

// Every seam's items at `runs::…`, where the router (`api_routes`), the MCP tools, the
// document's checks and the timeouts name them. A glob, so each handler's OpenAPI
// operation (`__path_…`, what `routes!` reads beside the handler) comes with it.
pub use self::claim::*;
pub use self::heartbeat::*;
pub use self::hello::*;
pub use self::jobs::*;
pub use self::server_status::*;
pub use self::steps::*;

const RESOURCE: &str = "runsessions";

/// A JSON body that may be absent (no bytes at all, or `null`), with our error codes when
/// present but bad; read strictly, as `ApiJson` reads. The whole body must be one JSON
/// value: bytes that are only whitespace are not one (400 `malformed_json`; the API fuzz
/// found a heartbeat of `\r` answered 200).
pub fn optional_json<T: DeserializeOwned>(body: &[u8]) -> Result<Option<T>, ApiError> {
    if body.is_empty() {
        return Ok(None);
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "malformed_json", e.to_string()))?;
    if value.is_null() {
        return Ok(None);
    }
    super::strict::from_value(value).map(Some).map_err(|e| ApiError::invalid(e.to_string()))
}

fn session_token(headers: &HeaderMap) -> Result<&str, ApiError> {
    bearer(headers).ok_or_else(|| ApiError::unauthenticated("unauthenticated", "a session token is required"))
}

/// The request's session token, once its address may spend a look-up on it (a token not
/// seen valid lately is charged to the address: `Limits::session_token`).
fn gated_session_token<'h>(
    state: &AppState,
    headers: &'h HeaderMap,
    peer: Option<IpAddr>,
) -> Result<&'h str, ApiError> {
    let token = session_token(headers)?;
    state.limits.session_token(token, peer)?;
    Ok(token)
}

async fn authenticated(
    state: &AppState,
    headers: &HeaderMap,
    peer: Option<IpAddr>,
) -> Result<(RunAddress, Session), ApiError> {
    let token = gated_session_token(state, headers, peer)?;
    let checked = state.registry.session(token).await?;
    state.limits.session_checked(token, checked.is_ok());
    match checked {
        Ok(s) => {
            super::record_caller(&format_args!("run:{}", s.0));
            Ok(s)
        }
        Err(refused) => Err(session_refused(refused)),
    }
}

fn session_refused(r: SessionRefused) -> ApiError {
    let message = match r {
        SessionRefused::InvalidToken => "not a session token",
        SessionRefused::Superseded => {
            "a newer hello replaced this session, or its key was rotated or its RunSession deleted; say hello again"
        }
        SessionRefused::Expired => "the session lease expired; say hello again",
    };
    ApiError::unauthenticated(r.code(), message)
}

fn job_id(id: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(id).map_err(|_| ApiError::invalid("job id must be a uuid"))
}

fn job_finished(state: JobState) -> ApiError {
    ApiError::conflict("job_finished", format!("the job is {state}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optional_bodies_take_empty_and_null_and_refuse_trailing_bytes() {
        let ask = |max, wait| Some(ClaimAsk { max, wait: std::time::Duration::from_secs(wait) });
        assert_eq!(ClaimBody::parse(b"").ok(), ask(1, 0));
        assert_eq!(ClaimBody::parse(b" null ").ok(), ask(1, 0));
        for not_json in [&b"\r"[..], b" ", b"\n\t"] {
            assert_eq!(ClaimBody::parse(not_json).err().map(|e| e.code), Some("malformed_json"), "{not_json:?}");
            assert_eq!(AckBody::parse(not_json).err().map(|e| e.code), Some("malformed_json"), "{not_json:?}");
        }
        assert_eq!(ClaimBody::parse(br#"{"max": 7}"#).ok(), ask(7, 0));
        assert_eq!(ClaimBody::parse(br#"{"max": 7, "wait_seconds": 60}"#).ok(), ask(7, 60));
        for refused in [&br#"{"wait_seconds": 61}"#[..], br#"{"wait_seconds": -1}"#, br#"{"wait_seconds": "5"}"#] {
            assert!(ClaimBody::parse(refused).is_err_and(|e| e.status.is_client_error()));
        }
        let e = ClaimBody::parse(br#"{"max": 7} x"#).err().map(|e| e.code);
        assert_eq!(e, Some("malformed_json"));
        assert!(ProgressBody::parse(b"null").is_err());
        // A step's attempt: absent, or 1 to 100.
        assert_eq!(AckBody::parse(b"").ok(), Some(None));
        assert_eq!(AckBody::parse(br#"{"attempt": 2}"#).ok(), Some(Some(2)));
        for refused in
            [&br#"{"attempt": 0}"#[..], br#"{"attempt": 101}"#, br#"{"attempt": "1"}"#, br#"{"attempt": 4294967297}"#]
        {
            assert!(AckBody::parse(refused).is_err_and(|e| e.status.is_client_error()), "{refused:?}");
        }
        assert_eq!(
            CompleteBody::parse(br#"{"outcome": "succeeded", "attempt": 3}"#).ok().map(|(_, _, a)| a),
            Some(Some(3))
        );
        assert!(ProgressBody::parse(br#"{"progress": "a\u0000"}"#).is_err());
    }
}

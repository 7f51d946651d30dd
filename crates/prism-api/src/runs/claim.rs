//! `POST /api/v1/runtime/jobs/claim`: a Run's session takes the oldest eligible jobs of
//! its own server/component, at once or by a long poll (SPEC §11).

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use chrono::Utc;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::{authenticated, optional_json, session_refused, session_token};
use crate::AppState;
use crate::docs::{BadRequest, Internal, Invalid, TooLarge, TooManyRequests, Unauthenticated, Unavailable};
use crate::error::{ApiBody, ApiError, ClientAddr};
use crate::run_registry::jobs::Job;

const MAX_CLAIM: i64 = 100;
/// The longest a claim waits (SPEC §11); the request timeout of the route is this plus
/// the usual limit (`transport::timeout::WAITING_ROUTES`).
pub const MAX_CLAIM_WAIT_SECONDS: i64 = 60;

/// A long-poll claim counted while it waits.
struct Waiting<'a>(&'a crate::metrics::Metrics);

impl<'a> Waiting<'a> {
    fn on(metrics: &'a crate::metrics::Metrics) -> Self {
        metrics.claims_waiting.inc();
        Waiting(metrics)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.claims_waiting.dec();
    }
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClaimBody {
    /// How many jobs at most (default 1).
    #[schema(minimum = 1, maximum = 100)]
    #[serde(default, deserialize_with = "crate::json_int::opt_i64")]
    max: Option<i64>,
    /// Long poll (SPEC §11): when nothing is claimable now, wait up to this many seconds
    /// for a job queued for this Run, a slot freed or a cancel requested (default 0:
    /// answer at once). A waiting claim renews nothing: keep heartbeating.
    #[schema(minimum = 0, maximum = 60)]
    #[serde(default, deserialize_with = "crate::json_int::opt_i64")]
    wait_seconds: Option<i64>,
}

/// What a claim asks for, checked.
#[derive(Debug, PartialEq)]
pub struct ClaimAsk {
    pub max: i64,
    pub wait: std::time::Duration,
}

impl ClaimBody {
    /// What a claim body (maybe empty) asks for, checked.
    pub fn parse(body: &[u8]) -> Result<ClaimAsk, ApiError> {
        let b = optional_json::<ClaimBody>(body)?;
        let (max, wait) = b.map(|b| (b.max, b.wait_seconds)).unwrap_or_default();
        let max = max.unwrap_or(1);
        if !(1..=MAX_CLAIM).contains(&max) {
            return Err(ApiError::invalid(format!("max must be 1 to {MAX_CLAIM}")));
        }
        let wait = wait.unwrap_or(0);
        if !(0..=MAX_CLAIM_WAIT_SECONDS).contains(&wait) {
            return Err(ApiError::invalid(format!("wait_seconds must be 0 to {MAX_CLAIM_WAIT_SECONDS}")));
        }
        Ok(ClaimAsk { max, wait: std::time::Duration::from_secs(wait.unsigned_abs()) })
    }
}

#[derive(Serialize, ToSchema)]
pub struct Claimed {
    jobs: Vec<Job>,
    /// Jobs this Run holds whose cancel was requested: stop them (SPEC §5.1).
    cancel: Vec<Uuid>,
}

/// Claim the oldest queued jobs of the session's own server/component
#[utoipa::path(
    post,
    path = "/api/v1/runtime/jobs/claim",
    tag = "runtime",
    request_body(content = Option<ClaimBody>, description = "Optional; an empty body claims one"),
    security(("session" = [])),
    responses(
        (status = 200, description = "The jobs claimed (maybe none)", body = Claimed),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 413, response = TooLarge),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn claim(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiBody(body): ApiBody,
) -> Result<Json<Claimed>, ApiError> {
    let ask = ClaimBody::parse(&body)?;
    // No session (Redis down included) means no job is assigned.
    let started = std::time::Instant::now();
    let (address, session) = authenticated(&state, &headers, peer).await?;
    let claim = if ask.wait.is_zero() {
        let claim = state.registry.claim(&address, &session, ask.max).await?;
        state.metrics.claim_seconds.observe(started.elapsed().as_secs_f64());
        claim
    } else {
        // A held request of the Run's session (SPEC §12): one of its share, for its wait.
        let _held = state.streams.hold(crate::streams::Holder::RunSession(session.session_id))?;
        let _waiting = Waiting::on(&state.metrics);
        let until = tokio::time::Instant::now() + ask.wait;
        let mut stopping = state.stopping.clone();
        let stop = async move {
            // A dropped sender also means the server is stopping.
            let _ = stopping.wait_for(|stop| *stop).await;
        };
        let token = session_token(&headers)?;
        state.registry.claim_waiting(token, &address, session, ask.max, until, stop).await?
    }
    .map_err(session_refused)?;
    let now = Utc::now();
    for job in claim.jobs.iter().filter(|j| j.attempts == 1) {
        state.metrics.job_dispatch_seconds.observe((now - job.created_at).as_seconds_f64().max(0.0));
    }
    Ok(Json(Claimed { jobs: claim.jobs, cancel: claim.cancel }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::any_input::{body_bytes, is_client_error};
    use proptest::prelude::*;
    use serde_json::json;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// `max` and `wait_seconds` are any JSON the caller likes; only 1..=100 and
        /// 0..=60 pass.
        #[test]
        fn claim_bodies(bytes in body_bytes(json!({"max": 5, "wait_seconds": 30}))) {
            match ClaimBody::parse(&bytes) {
                Ok(ask) => prop_assert!((1..=MAX_CLAIM).contains(&ask.max) && ask.wait.as_secs() <= 60),
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
            }
        }
    }
}

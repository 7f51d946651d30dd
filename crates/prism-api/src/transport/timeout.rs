//! The request timeout (SPEC §12 "Bounded": 30 s, long polls and watches excepted): a
//! request whose handler has not answered in time — a body trickled in, a dependency
//! that hangs — is answered 408 `request_timeout` in the API's own error shape, and its
//! handler is dropped.
//!
//! A route that waits on purpose (the long-poll claim, the SSE watch of SPEC §11) is
//! named by its route template in [`WAITING_ROUTES`] (the matched route is known because
//! the layer wraps each route, after routing), with the longest it waits on purpose: its
//! limit is that plus the usual one, or none for a stream that bounds itself. tower-http's `TimeoutLayer` is not used because it answers an empty body
//! and applies to every route it wraps; this is the same tokio timer with our body and
//! the exemptions.

use std::time::Duration;

use axum::Router;
use axum::extract::{MatchedPath, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tracing::warn;

use crate::ApiError;

/// Route templates (as axum writes them: `/api/v1/controller/{project_id}/watch`) that
/// wait on purpose, with the longest wait (`None`: no request timeout at all).
pub const WAITING_ROUTES: &[(&str, Option<Duration>)] = &[
    ("/api/v1/runtime/jobs/claim", Some(Duration::from_secs(crate::runs::MAX_CLAIM_WAIT_SECONDS.unsigned_abs()))),
    // A stream, ended by its client, by revocation or by the server stopping.
    ("/api/v1/controller/{project_id}/watch", None),
];

#[derive(Clone, Copy, Debug)]
pub struct RequestTimeout {
    pub limit: Duration,
    pub waiting: &'static [(&'static str, Option<Duration>)],
}

impl RequestTimeout {
    pub fn new(limit: Duration) -> Self {
        RequestTimeout { limit, waiting: WAITING_ROUTES }
    }

    /// The limit of a request to `route` (None: no limit). The fallback (no route) has
    /// the usual one.
    pub fn limit_for(&self, route: Option<&str>) -> Option<Duration> {
        match self.waiting.iter().find(|(r, _)| Some(*r) == route) {
            Some((_, wait)) => wait.map(|wait| wait + self.limit),
            None => Some(self.limit),
        }
    }

    /// `router` with every route (and the fallback) under the limit. Routes merged into
    /// the router after this are not.
    pub fn apply(self, router: Router) -> Router {
        router.layer(axum::middleware::from_fn_with_state(self, enforce))
    }
}

async fn enforce(State(policy): State<RequestTimeout>, request: Request, next: Next) -> Response {
    let route = request.extensions().get::<MatchedPath>().map(|p| p.as_str().to_owned());
    let Some(limit) = policy.limit_for(route.as_deref()) else {
        return next.run(request).await;
    };
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            warn!(
                route = route.as_deref().unwrap_or("(no route)"),
                limit_seconds = limit.as_secs(),
                "request timed out"
            );
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                format!(
                    "the request was not answered within {} s (a body sent too slowly, or the server is overloaded); retry",
                    limit.as_secs()
                ),
            )
            .into_response()
        }
    }
}

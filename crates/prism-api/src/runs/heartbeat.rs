//! `POST /api/v1/runtime/heartbeat`: a Run renews its session lease, reports a fresh
//! snapshot and whether it drains, and hears which of its jobs to stop.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::{gated_session_token, optional_json, session_refused};
use crate::AppState;
use crate::docs::{BadRequest, Internal, Invalid, TooLarge, TooManyRequests, Unauthenticated, Unavailable};
use crate::error::{ApiBody, ApiError, ClientAddr};
use crate::limits::{Announce, DRAIN_ANNOUNCE_EVERY};
use crate::run_registry::RunAddress;
use crate::run_registry::service::{Renewed, capabilities_schema, capacity_schema, check_snapshot, heartbeat_interval};
use crate::run_registry::sessions::Renewal;

/// A fresh capability/capacity snapshot, and whether the Run is draining (each part
/// optional; the body may be empty).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = RunHeartbeatBody)]
pub struct HeartbeatBody {
    #[schema(schema_with = capabilities_schema)]
    capabilities: Option<Vec<String>>,
    #[serde(default, deserialize_with = "crate::json_int::opt_map_i64")]
    #[schema(schema_with = capacity_schema)]
    capacity: Option<BTreeMap<String, i64>>,
    /// The Run's graceful stop (SPEC §5.1): `true` and its claims hand out no new job
    /// (the jobs it holds still take steps) until a heartbeat says `false`; absent or
    /// null: as it was. A new hello starts not draining.
    #[serde(default)]
    draining: Option<bool>,
}

impl HeartbeatBody {
    pub fn check(&self) -> Result<(), ApiError> {
        check_snapshot(self.capabilities.as_ref(), self.capacity.as_ref()).map_err(|e| ApiError::invalid(e.0))
    }
}

#[derive(Serialize, ToSchema)]
pub struct RunHeartbeatReply {
    /// Seconds the renewed lease has left.
    lease_ttl_seconds: u64,
    heartbeat_interval_seconds: u64,
    /// Jobs this Run holds whose cancel was requested: stop them and complete each with
    /// outcome `cancelled` (SPEC §5.1).
    cancel: Vec<Uuid>,
}

/// Heartbeat of a Run: renews its session lease
#[utoipa::path(
    post,
    path = "/api/v1/runtime/heartbeat",
    operation_id = "runtime_heartbeat",
    tag = "runtime",
    request_body(content = Option<HeartbeatBody>, description = "Optional; an empty body renews only"),
    security(("session" = [])),
    responses(
        (status = 200, description = "Lease renewed", body = RunHeartbeatReply),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 413, response = TooLarge),
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
    ApiBody(body): ApiBody,
) -> Result<Json<RunHeartbeatReply>, ApiError> {
    let token = gated_session_token(&state, &headers, peer)?;
    let body: Option<HeartbeatBody> = optional_json(&body)?;
    if let Some(b) = &body {
        b.check()?;
    }
    let (caps, cap, draining) = body.map(|b| (b.capabilities, b.capacity, b.draining)).unwrap_or_default();
    let renewal = Renewal { capabilities: caps.as_deref(), capacity: cap.as_ref(), draining };
    let renewed = state.registry.renew(token, renewal).await?;
    state.limits.session_checked(token, renewed.is_ok());
    match renewed {
        Ok(Renewed { address, lease }) => {
            if lease.drain_changed {
                // Bounded: one status refresh per address per period, the latest state last.
                let key = address.to_string();
                match state.limits.drain_announce(&key) {
                    Announce::Now => drain_changed_announce(&state, &address).await,
                    Announce::Later => {
                        let (state, address) = (state.clone(), address.clone());
                        tokio::spawn(async move {
                            tokio::time::sleep(DRAIN_ANNOUNCE_EVERY).await;
                            state.limits.drain_announced_late(&key);
                            drain_changed_announce(&state, &address).await;
                        });
                    }
                    Announce::Waiting => {}
                }
            }
            let cancel = state.registry.cancel_requested(&address, &lease).await?;
            let lease = (lease.lease_left.as_millis() as u64).div_ceil(1000);
            Ok(Json(RunHeartbeatReply {
                lease_ttl_seconds: lease,
                heartbeat_interval_seconds: u64::from(heartbeat_interval(u32::try_from(lease).unwrap_or(u32::MAX))),
                cancel,
            }))
        }
        Err(r) => Err(session_refused(r)),
    }
}

/// A Run started or stopped draining: its RunSession's status is refreshed now (phase
/// `Draining`, its condition and Event) rather than at the reconciler's next requeue. The
/// heartbeat succeeded whatever happens here; a lost signal only delays the status.
async fn drain_changed_announce(state: &AppState, address: &RunAddress) {
    let identity = match state.registry.identity(None, address).await {
        Ok(Some(identity)) => identity,
        Ok(None) => return,
        Err(error) => {
            tracing::warn!(%address, %error, "the Run's drain changed, but its RunSession could not be read");
            return;
        }
    };
    if let Err(error) = state.registry.announce_status(&identity.spec).await {
        tracing::warn!(namespace = %identity.spec.namespace, name = %identity.spec.name, %error,
                       "the Run's drain changed, but its RunSession's status refresh could not be announced");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::any_input::{body_bytes, is_client_error};
    use crate::run_registry::service::name_ok;
    use proptest::prelude::*;
    use serde_json::json;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Snapshots that pass are bounded, with known-shape names and amounts >= 0.
        #[test]
        fn run_heartbeat_bodies(bytes in body_bytes(json!({"capabilities": ["lifecycle"], "capacity": {"slots": 4}}))) {
            match optional_json::<HeartbeatBody>(&bytes).and_then(|b| b.map(|b| b.check().map(|()| b)).transpose()) {
                Ok(Some(b)) => {
                    let caps = b.capabilities.unwrap_or_default();
                    prop_assert!(caps.len() <= 32 && caps.iter().all(|c| name_ok(c)));
                    let cap = b.capacity.unwrap_or_default();
                    prop_assert!(cap.len() <= 32 && cap.iter().all(|(k, v)| name_ok(k) && *v >= 0));
                }
                Ok(None) => {}
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
            }
        }
    }
}

//! `POST /api/v1/runtime/hello`: a Run proves possession of its key and gets a session.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use chrono::Utc;

use crate::AppState;
use crate::docs::{
    BadRequest, Internal, Invalid, TooLarge, TooManyRequests, Unauthenticated, Unavailable, UnsupportedMediaType,
};
use crate::error::{ApiError, ApiJson, ClientAddr};
use crate::run_registry::service::{Granted, Hello, HelloError};

/// Prove possession of a Run's key and open a session
///
/// The body is signed as SPEC §8 says. Every failure of proof is a 401 with one of the
/// codes `unknown_identity`, `stale_generation`, `bad_signature`, `clock_skew`,
/// `replayed_nonce`, and nothing more.
#[utoipa::path(
    post,
    path = "/api/v1/runtime/hello",
    tag = "runtime",
    request_body = Hello,
    responses(
        (status = 201, description = "Session granted", body = Granted),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 413, response = TooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn hello(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    ApiJson(body): ApiJson<Hello>,
) -> Result<(StatusCode, Json<Granted>), ApiError> {
    // Before any lookup: a hello costs Postgres reads and a signature check, charged to
    // the source address. The Run identity's own budget is spent only once its proof
    // checks out: hellos signed by anybody else cannot lock it out (SPEC §12).
    state.limits.unauthenticated(peer)?;
    let proven = match state.registry.prove(&body, Utc::now()).await? {
        Ok(proven) => proven,
        Err(refused) => return Err(hello_refused(refused)),
    };
    let address = proven.address();
    state.limits.proven_hello(&format!("{}/{}", address.server_instance_id, address.component_kind))?;
    match state.registry.open(proven).await? {
        Ok((identity, granted)) => {
            // The new token was just proven: its calls are not charged to the address (a
            // Run saying hello again after an outage is served at once, even while a flood
            // of dead tokens from its address spends the address's budget).
            state.limits.session_checked(&granted.session_token, true);
            // The session is granted whatever happens next; a lost signal only delays
            // `Online` in status until the reconciler's own requeue.
            if let Err(error) = state.registry.announce_status(&identity.spec).await {
                tracing::warn!(namespace = %identity.spec.namespace, name = %identity.spec.name, %error,
                               "hello granted, but its RunSession's status refresh could not be announced");
            }
            Ok((StatusCode::CREATED, Json(granted)))
        }
        Err(refused) => Err(hello_refused(refused)),
    }
}

fn hello_refused(e: HelloError) -> ApiError {
    match e {
        HelloError::Invalid(e) => ApiError::invalid(e.0),
        // Every failure of proof says its code and nothing more.
        HelloError::Refused(r) => ApiError::unauthenticated(r.code(), "hello refused"),
    }
}

/// The hello path with every input (SPEC §8): the body through the handler's JSON
/// extractor, the shape check, then the proof against an identity, at any clock.
#[cfg(test)]
mod tests {
    use crate::any_input::{any_string, body_bytes, is_client_error, through_api_json};
    use crate::run_registry::proof;
    use crate::run_registry::service::{
        Hello, ProofRefused, TOKEN_PREFIX, check_hello, check_proof, component_kind_ok, server_instance_id_ok,
        token_address,
    };
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use ed25519_dalek::{Signer, SigningKey};
    use proptest::prelude::*;
    use serde_json::Value;
    use serde_json::json;

    fn any_time() -> impl Strategy<Value = i64> {
        prop_oneof![Just(i64::MIN), Just(i64::MAX), Just(0i64), any::<i64>(), 1_764_399_000i64..1_764_401_000]
    }

    fn good_hello() -> Value {
        json!({
            "server_instance_id": "srv-eu1-7", "component_kind": "run", "key_generation": 3,
            "timestamp": 1_764_400_000i64, "nonce": "Zk3q9-2LwX0aPq7T", "signature": "AAAA",
            "version": "1.4.2", "target": {"os": "linux", "arch": "amd64"},
            "capabilities": ["lifecycle"], "capacity": {"slots": 4}
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Any body, any identity generation and clock: a 4xx-worthy refusal or a
        /// proof refusal, never a panic; an unsigned hello never passes.
        #[test]
        fn every_hello_body_is_answered(
            bytes in body_bytes(good_hello()), generation in any::<i64>(), now in any_time(), seed in any::<[u8; 32]>(),
        ) {
            let public_key = STANDARD.encode(SigningKey::from_bytes(&seed).verifying_key().to_bytes());
            match through_api_json::<Hello>(bytes) {
                Err(e) => prop_assert!(is_client_error(&e), "{} {}", e.status, e.message),
                Ok(h) => {
                    if check_hello(&h).is_ok() {
                        prop_assert!(h.key_generation >= 1 && proof::nonce_ok(&h.nonce));
                        for g in [generation, h.key_generation] {
                            prop_assert!(check_proof(&h, g, &public_key, now).is_err());
                        }
                    }
                }
            }
        }

        /// A hello signed by the identity's key passes exactly when its timestamp is
        /// within the window of `now`, whatever the two integers are.
        #[test]
        fn a_signed_hello_passes_only_in_the_clock_window(
            timestamp in any_time(), now in any_time(), generation in 1i64.., seed in any::<[u8; 32]>(),
            server in "[A-Za-z0-9._-]{1,40}", nonce in "[A-Za-z0-9_-]{16,40}", other in any_string(),
        ) {
            let key = SigningKey::from_bytes(&seed);
            let public_key = STANDARD.encode(key.verifying_key().to_bytes());
            let message = proof::hello_message(&server, "run", generation, timestamp, &nonce);
            let h = Hello {
                server_instance_id: server, component_kind: "run".into(), key_generation: generation, timestamp,
                nonce, signature: STANDARD.encode(key.sign(message.as_bytes()).to_bytes()),
                version: None, target: None, capabilities: None, capacity: None,
            };
            prop_assert_eq!(check_hello(&h), Ok(()));
            let expected = if proof::within_clock_window(timestamp, now) { Ok(()) } else { Err(ProofRefused::ClockSkew) };
            prop_assert_eq!(check_proof(&h, generation, &public_key, now), expected);
            prop_assert_eq!(check_proof(&h, generation.wrapping_add(1), &public_key, now), Err(ProofRefused::StaleGeneration));
            prop_assert!(check_proof(&h, generation, &other, timestamp).is_err());
        }

        /// Session tokens are the caller's text: any string is routed or refused.
        #[test]
        fn any_token_is_routed_or_refused(token in any_string(), route in any_string()) {
            if let Some(a) = token_address(&token) {
                prop_assert!(server_instance_id_ok(&a.server_instance_id) && component_kind_ok(&a.component_kind));
            }
            let forged = format!("{TOKEN_PREFIX}.{}.{}", URL_SAFE_NO_PAD.encode(&route), "a".repeat(43));
            if let Some(a) = token_address(&forged) {
                prop_assert!(server_instance_id_ok(&a.server_instance_id) && component_kind_ok(&a.component_kind));
            }
        }
    }
}

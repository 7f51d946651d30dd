//! Inputs a caller may send, as proptest strategies: any JSON value, with the integers
//! that break arithmetic (i64::MIN/MAX, u64 beyond i64), floats, NUL characters, strings
//! near and over every length limit; and bodies that are one of our request types with
//! any field set to any of those, so the checks behind deserialization get exercised.

use proptest::prelude::*;
use serde_json::{Map, Number, Value, json};

/// Integers and numbers at the edges, as JSON.
pub fn any_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(i64::MIN)),
        Just(json!(i64::MAX)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MAX as u64 + 1)),
        Just(json!(0)),
        Just(json!(-1)),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| Number::from_f64(f).map_or(Value::Null, Value::Number)),
        Just(json!(1.5)),
        Just(json!(1e300)),
    ]
}

/// Strings: short arbitrary ones, ones with NUL and newlines, and long ones around the
/// limits of our fields (63, 128, 253, 256) and of the body (64 KiB).
pub fn any_string() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => ".{0,20}",
        2 => "[a-z0-9-]{0,70}",
        2 => "[A-Za-z0-9._+-]{0,260}",
        1 => "[a-z]{1,8}\u{0}[a-z]{0,8}",
        1 => "[a-z]{1,8}\n",
        1 => prop_oneof![Just(63usize), Just(64), Just(128), Just(129), Just(253), Just(254), Just(256), Just(257)]
            .prop_map(|n| "a".repeat(n)),
        1 => (0usize..3).prop_map(|n| "é".repeat(128 + n)),
        1 => Just("x".repeat(70_000)),
    ]
}

/// Any JSON value, nested a few levels.
pub fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any_number(),
        any_string().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(any_string(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// `valid` (a good body of some request type) with some of its fields replaced by any
/// value, some removed, and maybe an unknown one added.
pub fn mutated(valid: Value) -> impl Strategy<Value = Value> {
    let keys: Vec<String> = valid.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
    let n = keys.len().max(1);
    (
        prop::collection::vec((0..n, any_json()), 0..4),
        prop::collection::vec(0..n, 0..2),
        prop::option::weighted(0.1, (any_string(), any_json())),
    )
        .prop_map(move |(replace, remove, extra)| {
            let mut body = valid.clone();
            if let Some(o) = body.as_object_mut() {
                for (i, v) in replace {
                    if let Some(k) = keys.get(i) {
                        o.insert(k.clone(), v);
                    }
                }
                for i in remove {
                    if let Some(k) = keys.get(i) {
                        o.remove(k);
                    }
                }
                if let Some((k, v)) = extra {
                    o.insert(k, v);
                }
            }
            body
        })
}

/// Bytes of a body: mostly JSON (mutated good bodies, any values), sometimes not.
pub fn body_bytes(valid: Value) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => mutated(valid).prop_map(|v| v.to_string().into_bytes()),
        2 => any_json().prop_map(|v| v.to_string().into_bytes()),
        1 => prop::collection::vec(any::<u8>(), 0..64),
        1 => Just(Vec::new()),
        1 => Just(b"null".to_vec()),
        1 => Just(b"{} trailing".to_vec()),
    ]
}

/// A body through the handlers' own JSON extractor (`ApiJson`: content type, size limit,
/// syntax and shape), as a request with `Content-Type: application/json`.
pub fn through_api_json<T: serde::de::DeserializeOwned>(body: Vec<u8>) -> Result<T, crate::ApiError> {
    use axum::extract::FromRequest;
    let request = axum::http::Request::builder()
        .method("POST")
        .uri("/")
        .header(axum::http::header::CONTENT_TYPE, "application/json")
        .body(axum::body::Body::from(body))
        .map_err(|e| crate::ApiError::internal("test request", e))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| crate::ApiError::internal("test runtime", e))?;
    runtime.block_on(crate::ApiJson::<T>::from_request(request, &())).map(|crate::ApiJson(v)| v)
}

/// The property every refusal of input must have: a 4xx (a 5xx is the operator's fault).
pub fn is_client_error(e: &crate::ApiError) -> bool {
    e.status.is_client_error()
}

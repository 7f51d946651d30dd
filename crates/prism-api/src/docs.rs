//! The OpenAPI 3.1 document of `/api/v1`: generated from the handlers' own request and
//! response types (`#[utoipa::path]` on each handler, `ToSchema` on each type) and served
//! at `GET /api/v1/openapi.json`. What is not a handler's is here: the document's info,
//! the two bearer schemes, and one reusable response per error status, each with the
//! `{"error": {"code", "message"}}` body that `ApiError` answers with.

use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, SchemaType, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Ref, RefOr};
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
        schemas(ErrorBody, JsonbValue),
        responses(
            BadRequest,
            Unauthenticated,
            Forbidden,
            NotFound,
            Conflict,
            TooLarge,
            UnsupportedMediaType,
            Invalid,
            TooManyRequests,
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
/// state that allows this step; `job_finished`: the job is finished (succeeded, failed or
/// cancelled); `idempotency_conflict`: the idempotency key was used with another request;
/// `deadline_exceeded`: the job's attempt passed its `timeout_seconds`; `stale_attempt`: the
/// step is of an attempt that is no longer the job's current one
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

/// `rate_limited`: too many requests that cost the operator a TokenReview, a hello or the
/// look-up of a session token not seen lately from this address (or hellos for this Run
/// identity, or calls of this Kubernetes identity); `quota_exceeded`: the caller, or
/// the namespace, holds as many live registrations (or the namespace as many queued
/// jobs) as its quota allows; `too_many_streams`: the caller holds as many watches, MCP
/// streams and long-poll claims as it may. `Retry-After` says when to try again.
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct TooManyRequests(ErrorBody);

/// `internal`: a bug; the cause is in the operator's log
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct Internal(ErrorBody);

/// `database_unavailable`, `runtime_registry_unavailable`, `kubernetes_unavailable`,
/// `contended`: a dependency did not answer; retry
#[derive(ToResponse)]
#[allow(dead_code)]
pub struct Unavailable(ErrorBody);

/// Any JSON that Postgres `jsonb` can store: no NUL character in any string or key
/// (`check_jsonb`). Recursive, so a named schema of its own.
pub struct JsonbValue;

impl utoipa::PartialSchema for JsonbValue {
    fn schema() -> RefOr<Schema> {
        let no_nul = || ObjectBuilder::new().schema_type(Type::String).pattern(Some("^[^\\u0000]*$"));
        let itself = || Ref::from_schema_name("JsonbValue");
        let scalars =
            ObjectBuilder::new().schema_type(SchemaType::Array(vec![Type::Null, Type::Boolean, Type::Number]));
        let array = ArrayBuilder::new().items(itself());
        let object = ObjectBuilder::new()
            .schema_type(Type::Object)
            .property_names(Some(no_nul()))
            .additional_properties(Some(itself()));
        OneOfBuilder::new()
            .item(scalars)
            .item(no_nul())
            .item(array)
            .item(object)
            .description(Some(
                "Any JSON without a NUL character (`\\u0000`) in a string or key: Postgres `jsonb` cannot store one",
            ))
            .into()
    }
}

impl utoipa::ToSchema for JsonbValue {}

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

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::LazyLock;

    use proptest::prelude::*;
    use serde_json::Value;

    use crate::agents::{check_identifier, check_namespace};
    use crate::run_registry::proof::nonce_ok;
    use crate::run_registry::service::{component_kind_ok, name_ok, server_instance_id_ok, target_part_ok, version_ok};

    static DOCUMENT: LazyLock<Value> = LazyLock::new(|| serde_json::to_value(crate::openapi()).unwrap_or(Value::Null));

    type Routes = BTreeMap<String, BTreeSet<String>>;

    /// path -> methods the router serves under /api/v1, read from the router itself:
    /// axum's `Debug` of a router is the only public view of its route table (route ids
    /// with their `Allow` header, and route ids with their paths). Should axum change
    /// that output, this finds no route and the test fails; it cannot pass on nothing.
    fn served() -> Routes {
        let debug = format!("{:?}", crate::stateless_routes());
        let mut allow = BTreeMap::new();
        let mut paths = BTreeMap::new();
        for chunk in debug.split("RouteId(").skip(1) {
            let Some((id, rest)) = chunk.split_once(')') else { continue };
            if let Some(rest) = rest.strip_prefix(": MethodRouter(") {
                let methods = rest.split("allow_header: Bytes(b\"").nth(1).and_then(|a| a.split('"').next());
                allow.insert(id.to_string(), methods.unwrap_or_default().to_string());
            } else if let Some(rest) = rest.strip_prefix(": \"") {
                paths.insert(id.to_string(), rest.split('"').next().unwrap_or_default().to_string());
            }
        }
        let mut routes = Routes::new();
        for (id, path) in paths {
            if !path.starts_with("/api/v1") {
                continue;
            }
            let methods: BTreeSet<String> = allow
                .get(&id)
                .map(String::as_str)
                .unwrap_or_default()
                .split(',')
                .filter(|m| !m.is_empty())
                .map(str::to_string)
                .collect();
            // axum answers HEAD wherever it answers GET; the document lists the GET.
            let methods = methods.iter().filter(|m| !(*m == "HEAD" && methods.contains("GET"))).cloned().collect();
            routes.insert(path, methods);
        }
        routes
    }

    fn documented() -> Routes {
        let mut routes = Routes::new();
        for (path, item) in DOCUMENT["paths"].as_object().into_iter().flatten() {
            let methods = item.as_object().into_iter().flatten().map(|(m, _)| m.to_uppercase()).collect();
            routes.insert(path.clone(), methods);
        }
        routes
    }

    #[test]
    fn routes_and_document_agree() {
        let served = served();
        assert!(served.len() >= 14, "found only {} routes in the router's Debug output: {served:?}", served.len());
        assert_eq!(served, documented());
        // Every method of every route is one of the routes SPEC §6 lists (or this document).
        assert!(served.contains_key("/api/v1/openapi.json"));
    }

    #[test]
    fn document_is_openapi_3_1_with_every_reference_resolved() {
        assert_eq!(DOCUMENT["openapi"], "3.1.0");
        // The fields OpenAPI 3.1 requires (scripts/fuzz-api also runs a full validator).
        assert!(DOCUMENT["info"]["title"].is_string() && DOCUMENT["info"]["version"].is_string());
        for (path, item) in DOCUMENT["paths"].as_object().into_iter().flatten() {
            for (method, op) in item.as_object().into_iter().flatten() {
                assert!(op["responses"].as_object().is_some_and(|r| !r.is_empty()), "{method} {path}");
                // Every `{name}` of the path is a required path parameter, and no other.
                let templated: BTreeSet<&str> =
                    path.split('/').filter_map(|s| s.strip_prefix('{')?.strip_suffix('}')).collect();
                let params = op["parameters"].as_array().into_iter().flatten();
                let declared: BTreeSet<&str> = params
                    .filter(|p| p["in"] == "path")
                    .inspect(|p| assert_eq!(p["required"], true, "{method} {path}"))
                    .filter_map(|p| p["name"].as_str())
                    .collect();
                assert_eq!(templated, declared, "{method} {path}");
            }
        }
        fn refs(v: &Value, out: &mut Vec<String>) {
            match v {
                Value::Object(o) => {
                    if let Some(Value::String(r)) = o.get("$ref") {
                        out.push(r.clone());
                    }
                    o.values().for_each(|v| refs(v, out));
                }
                Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
                _ => {}
            }
        }
        let mut all = Vec::new();
        refs(&DOCUMENT, &mut all);
        assert!(!all.is_empty());
        for r in all {
            let pointer = r.strip_prefix('#').unwrap_or(&r);
            assert!(DOCUMENT.pointer(pointer).is_some(), "unresolved {r}");
        }
        // Operation ids are unique (clients name their methods after them).
        let ids: Vec<&str> = DOCUMENT["paths"]
            .as_object()
            .into_iter()
            .flatten()
            .flat_map(|(_, item)| {
                item.as_object().into_iter().flatten().filter_map(|(_, op)| op["operationId"].as_str())
            })
            .collect();
        assert_eq!(ids.len(), ids.iter().collect::<BTreeSet<_>>().len(), "{ids:?}");
        // Every error status of every operation answers the one error body.
        for (path, item) in DOCUMENT["paths"].as_object().into_iter().flatten() {
            for (method, op) in item.as_object().into_iter().flatten() {
                let responses = op["responses"].as_object().into_iter().flatten();
                for (status, response) in responses.filter(|(s, _)| s.as_str() >= "400") {
                    let name = response["$ref"].as_str().and_then(|r| r.rsplit('/').next()).unwrap_or_default();
                    let body = &DOCUMENT["components"]["responses"][name]["content"]["application/json"]["schema"];
                    assert_eq!(body["$ref"], "#/components/schemas/ErrorBody", "{method} {path} {status}");
                }
                let security = op.get("security").is_some();
                let open = path.ends_with("/openapi.json") || path.ends_with("/runtime/hello");
                assert_eq!(security, !open, "{method} {path}: security");
            }
        }
    }

    /// A string schema of the document (a property, or a parameter's schema).
    fn at(pointer: &str) -> &'static Value {
        let v = DOCUMENT.pointer(pointer);
        assert!(v.is_some_and(|v| v["type"].is_string() || v["type"].is_array()), "no string schema at {pointer}");
        v.unwrap_or(&Value::Null)
    }

    fn param(path: &str, method: &str, name: &str) -> &'static Value {
        let params = DOCUMENT["paths"][path][method]["parameters"].as_array();
        let p = params.into_iter().flatten().find(|p| p["name"] == name);
        assert!(p.is_some(), "no parameter {name} of {method} {path}");
        p.map(|p| &p["schema"]).unwrap_or(&Value::Null)
    }

    /// A string schema's length bounds and pattern.
    struct StringSchema {
        min: u64,
        max: u64,
        pattern: Option<regex::Regex>,
    }

    impl StringSchema {
        fn of(schema: &Value) -> StringSchema {
            let pattern = schema["pattern"].as_str().map(regex::Regex::new);
            assert!(pattern.as_ref().is_none_or(Result::is_ok), "{pattern:?}");
            StringSchema {
                min: schema["minLength"].as_u64().unwrap_or(0),
                max: schema["maxLength"].as_u64().unwrap_or(u64::MAX),
                pattern: pattern.and_then(Result::ok),
            }
        }

        /// Whether `s` conforms (lengths in Unicode scalar values, as JSON Schema counts).
        fn conforms(&self, s: &str) -> bool {
            let n = s.chars().count() as u64;
            n >= self.min && n <= self.max && self.pattern.as_ref().is_none_or(|r| r.is_match(s))
        }
    }

    type Check = fn(&str) -> bool;

    /// Each schema of a hand-checked string and the check it restates.
    fn pairs() -> Vec<(&'static str, StringSchema, Check)> {
        let ns: Check = |s| check_namespace(s).is_ok();
        let project: Check = |s| check_identifier("", s, crate::crd::PROJECT_ID_MAX).is_ok();
        let session: Check = |s| check_identifier("", s, crate::crd::SESSION_ID_MAX).is_ok();
        let server: Check = server_instance_id_ok;
        let reason: Check = |s| check_identifier("", s, crate::run_registry::jobs::MAX_REASON_CHARS).is_ok();
        let s = "/components/schemas";
        let pairs: Vec<(&str, &Value, Check)> = vec![
            ("RegisterBody.namespace", at(&format!("{s}/RegisterBody/properties/namespace")), ns),
            ("RegisterBody.project_id", at(&format!("{s}/RegisterBody/properties/project_id")), project),
            ("RegisterBody.session_id", at(&format!("{s}/RegisterBody/properties/session_id")), session),
            ("HeartbeatBody.namespace", at(&format!("{s}/HeartbeatBody/properties/namespace")), ns),
            ("HeartbeatBody.session_id", at(&format!("{s}/HeartbeatBody/properties/session_id")), session),
            ("FenceBody.namespace", at(&format!("{s}/FenceBody/properties/namespace")), ns),
            ("FenceBody.project_id", at(&format!("{s}/FenceBody/properties/project_id")), project),
            ("status project_id", param("/api/v1/controller/{project_id}/status", "get", "project_id"), project),
            ("status namespace", param("/api/v1/controller/{project_id}/status", "get", "namespace"), ns),
            ("status session_id", param("/api/v1/controller/{project_id}/status", "get", "session_id"), session),
            ("release namespace", param("/api/v1/controller/{id}/release", "post", "namespace"), ns),
            ("Hello.server_instance_id", at(&format!("{s}/Hello/properties/server_instance_id")), server),
            ("Hello.component_kind", at(&format!("{s}/Hello/properties/component_kind")), component_kind_ok),
            ("Hello.nonce", at(&format!("{s}/Hello/properties/nonce")), nonce_ok),
            ("Hello.version", at(&format!("{s}/Hello/properties/version")), version_ok),
            ("Hello.capabilities[]", at(&format!("{s}/Hello/properties/capabilities/items")), name_ok),
            ("Hello.capacity keys", at(&format!("{s}/Hello/properties/capacity/propertyNames")), name_ok),
            ("RunTarget.os", at(&format!("{s}/RunTarget/properties/os")), target_part_ok),
            ("RunTarget.arch", at(&format!("{s}/RunTarget/properties/arch")), target_part_ok),
            ("EnqueueBody.server_instance_id", at(&format!("{s}/EnqueueBody/properties/server_instance_id")), server),
            (
                "EnqueueBody.component_kind",
                at(&format!("{s}/EnqueueBody/properties/component_kind")),
                component_kind_ok,
            ),
            (
                "server status id",
                param("/api/v1/runtime/servers/{server_instance_id}/status", "get", "server_instance_id"),
                server,
            ),
            ("CompleteBody.error", at(&format!("{s}/CompleteBody/properties/error")), crate::runs::job_error_ok),
            ("CancelBody.reason", at(&format!("{s}/CancelBody/properties/reason")), reason),
            (
                "RunHeartbeatBody.capabilities[]",
                at(&format!("{s}/RunHeartbeatBody/properties/capabilities/items")),
                name_ok,
            ),
            (
                "RunHeartbeatBody.capacity keys",
                at(&format!("{s}/RunHeartbeatBody/properties/capacity/propertyNames")),
                name_ok,
            ),
        ];
        pairs.into_iter().map(|(what, schema, check)| (what, StringSchema::of(schema), check)).collect()
    }

    static PAIRS: LazyLock<Vec<(&'static str, StringSchema, Check)>> = LazyLock::new(pairs);

    fn candidates() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z0-9-]{0,70}",
            "[a-z][a-z0-9_]{0,70}",
            "[A-Za-z0-9._+-]{0,260}",
            "[A-Za-z0-9_-]{10,140}",
            ".{0,300}",
            "[a-z]{1,5}[\\x00\\n\u{e9}A_. -][a-z]{0,5}",
            (0usize..3).prop_map(|n| "\u{e9}".repeat(127 + n)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// The document says what the handlers check: a string conforms to a field's
        /// schema exactly when the handler's check accepts it.
        #[test]
        fn patterns_say_what_the_checks_do(s in candidates()) {
            for (what, schema, check) in PAIRS.iter() {
                prop_assert_eq!(schema.conforms(&s), check(&s), "{} on {:?}", what, s);
            }
        }
    }
}

//! The gate's direct path for `tools/call` (issue 23, cause 3): one parse of the
//! message, the transport's checks on the parsed fields, the tool called in the request's
//! own task, one serialization. Through rmcp's stateless service the same call costs a
//! service built per request, a serve loop and a handler task spawned for it, channels
//! between them, and (2026-07-28) the whole message turned back into a `Value` to check
//! the standard headers.
//!
//! The path takes only what rmcp would answer with the tool's own result: a well-formed
//! call of a known tool whose headers pass every check rmcp makes (`eligible`). Anything
//! else — an unknown tool, a header that does not match, a `q=` in `Accept`, an encoded
//! `Mcp-Name`, an unknown version — goes to rmcp as before, so every refusal, and its
//! exact wording, stays the SDK's. The answer is built the way rmcp builds it
//! (`ServerResult` from the call's response, cache hints for 2026-07-28, the legacy
//! shape before it), and `tests/mcp.rs` compares the two on the wire.

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use rmcp::model::{
    CallToolRequestMethod, CallToolResponse, CallToolResult, JsonObject, JsonRpcVersion2_0, ProtocolVersion, RequestId,
    RequestMetaObject, ServerJsonRpcMessage, ServerResult,
};
use serde::Deserialize;

use super::tools::ToolName;

const PROTOCOL_VERSION_HEADER: &str = "mcp-protocol-version";
const METHOD_HEADER: &str = "mcp-method";
const NAME_HEADER: &str = "mcp-name";

/// Which protocol generation a call is in, as rmcp would classify it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Generation {
    /// Before 2026-07-28: no per-request `_meta` version (a session's, or none).
    SessionBased,
    /// 2026-07-28 and later: the version in `_meta`, the standard headers.
    PerRequest,
}

/// A `tools/call` as the direct path reads it, straight into these fields: rmcp's own
/// parse buffers the whole message (an untagged enum of flattened types) to find its
/// shape, then reads it again, and was the largest part of the JSON an MCP call cost.
/// The fields are the ones rmcp reads for a call, with rmcp's own types where a value's
/// reading matters (the `"2.0"`, the method, the id); a message with any other field —
/// an input-required retry's `inputResponses`, anything unknown — or one of these
/// repeated is not read here and goes to rmcp whole.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ToolCall {
    #[serde(rename = "jsonrpc")]
    _jsonrpc: JsonRpcVersion2_0,
    id: RequestId,
    #[serde(rename = "method")]
    _method: CallToolRequestMethod,
    params: ToolCallParams,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolCallParams {
    name: String,
    #[serde(default)]
    arguments: Option<JsonObject>,
    #[serde(rename = "_meta", default)]
    meta: Option<JsonObject>,
}

impl ToolCall {
    /// The message, if it is a plain `tools/call` (see the type's comment).
    pub(super) fn read(body: &[u8]) -> Option<Self> {
        serde_json::from_slice(body).ok()
    }

    pub(super) fn id(&self) -> &RequestId {
        &self.id
    }
}

/// A `tools/call` the gate answers itself.
pub(super) struct DirectCall {
    pub id: RequestId,
    pub tool: ToolName,
    pub generation: Generation,
    pub arguments: Option<JsonObject>,
    pub meta: RequestMetaObject,
}

/// The call, if rmcp would hand this message straight to the tool: see the module's
/// comment. `headers` are the request's; the body was declared JSON (checked by the gate).
pub(super) fn eligible(headers: &HeaderMap, call: ToolCall) -> Option<DirectCall> {
    let ToolCall { id, params, .. } = call;
    let tool = ToolName::parse(&params.name)?;
    // rmcp keeps an absent `_meta` as an empty one.
    let meta = params.meta.map(RequestMetaObject::from).unwrap_or_default();
    if !accepts_json_and_event_stream(headers) {
        return None;
    }
    let header_version = match single(headers, PROTOCOL_VERSION_HEADER) {
        Single::Absent => None,
        Single::One(v) => Some(v),
        Single::Other => return None,
    };
    let generation = match (meta.protocol_version(), header_version) {
        // No per-request version: the header, if any, names a known revision that has
        // neither required `_meta` nor standard headers.
        (None, None) => Generation::SessionBased,
        (None, Some(h)) if known(h) && h < ProtocolVersion::STANDARD_HEADERS.as_str() => Generation::SessionBased,
        // A per-request version: the header says the same, the version is one we serve,
        // its required `_meta` is there, and the standard headers name this call.
        (Some(m), Some(h))
            if m.as_str() == h
                && known(h)
                && h >= ProtocolVersion::V_2026_07_28.as_str()
                && meta.missing_required_keys(&ProtocolVersion::V_2026_07_28).is_empty()
                && single(headers, METHOD_HEADER) == Single::One("tools/call")
                && single(headers, NAME_HEADER) == Single::One(tool.as_str()) =>
        {
            Generation::PerRequest
        }
        _ => return None,
    };
    Some(DirectCall { id, tool, generation, arguments: params.arguments, meta })
}

/// The JSON-RPC answer to a direct call, shaped as rmcp shapes a tool's result.
pub(super) fn answer(id: RequestId, result: CallToolResult, generation: Generation) -> Response {
    let mut result = ServerResult::from(CallToolResponse::Complete(result));
    match generation {
        Generation::PerRequest => result.fill_missing_cache_hints(),
        Generation::SessionBased => {
            result.strip_result_type_for_legacy_peer();
            result.strip_non_object_output_for_legacy_peer();
        }
    }
    match serde_json::to_vec(&ServerJsonRpcMessage::response(result, id)) {
        Ok(body) => (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], Body::from(body)).into_response(),
        Err(error) => {
            tracing::error!(%error, "mcp: a tool's result could not be serialized");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

fn known(version: &str) -> bool {
    ProtocolVersion::KNOWN_VERSIONS.iter().any(|v| v.as_str() == version)
}

#[derive(Debug, PartialEq, Eq)]
enum Single<'a> {
    Absent,
    One(&'a str),
    /// Repeated, or not visible ASCII: rmcp's to refuse.
    Other,
}

fn single<'a>(headers: &'a HeaderMap, name: &str) -> Single<'a> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => Single::Absent,
        (Some(value), None) => value.to_str().map_or(Single::Other, Single::One),
        (Some(_), Some(_)) => Single::Other,
    }
}

/// Both media types rmcp requires, listed plainly: a list with parameters (a `q=`
/// that might exclude one) is left to rmcp's own reading.
fn accepts_json_and_event_stream(headers: &HeaderMap) -> bool {
    let (mut json, mut events) = (false, false);
    for value in headers.get_all(header::ACCEPT) {
        let Ok(value) = value.to_str() else { return false };
        if value.contains(';') || value.contains('"') {
            return false;
        }
        for essence in value.split(',').map(str::trim) {
            json |= essence.eq_ignore_ascii_case("application/json");
            events |= essence.eq_ignore_ascii_case("text/event-stream");
        }
    }
    json && events
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use serde_json::{Value, json};

    fn read(value: &Value) -> Option<ToolCall> {
        ToolCall::read(value.to_string().as_bytes())
    }

    fn call_message(meta: Option<Value>, name: &str) -> Value {
        let mut params = json!({"name": name, "arguments": {"session_id": "s"}});
        if let Some(meta) = meta {
            params["_meta"] = meta;
        }
        json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params})
    }

    fn call(meta: Option<Value>, name: &str) -> ToolCall {
        read(&call_message(meta, name)).expect("a plain tools/call")
    }

    fn modern_meta() -> Value {
        json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28",
               "io.modelcontextprotocol/clientCapabilities": {},
               "io.modelcontextprotocol/clientInfo": {"name": "claude-code", "version": "1"}})
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, HeaderValue::from_static(value));
        }
        headers
    }

    const ACCEPT: (&str, &str) = ("accept", "application/json, text/event-stream");

    fn modern_headers() -> Vec<(&'static str, &'static str)> {
        vec![
            ACCEPT,
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
            ("mcp-name", "prism_heartbeat"),
        ]
    }

    #[test]
    fn a_session_based_call_is_direct() {
        let direct = eligible(&headers(&[ACCEPT]), call(None, "prism_heartbeat")).expect("direct");
        assert_eq!(
            (direct.tool, direct.generation, direct.id),
            (ToolName::Heartbeat, Generation::SessionBased, RequestId::Number(7))
        );
        let with_version = headers(&[ACCEPT, ("mcp-protocol-version", "2025-11-25")]);
        assert!(eligible(&with_version, call(None, "prism_heartbeat")).is_some());
    }

    #[test]
    fn a_stateless_call_with_its_headers_is_direct_and_keeps_its_client_info() {
        let direct =
            eligible(&headers(&modern_headers()), call(Some(modern_meta()), "prism_heartbeat")).expect("direct");
        assert_eq!(direct.generation, Generation::PerRequest);
        assert_eq!(direct.meta.client_info().map(|c| c.name).as_deref(), Some("claude-code"));
        assert_eq!(direct.arguments.and_then(|a| a.get("session_id").cloned()), Some(json!("s")));
    }

    #[test]
    fn what_rmcp_might_refuse_goes_to_rmcp() {
        let modern = |drop: &str, extra: &[(&'static str, &'static str)]| {
            let mut pairs: Vec<_> = modern_headers().into_iter().filter(|(n, _)| *n != drop).collect();
            pairs.extend_from_slice(extra);
            eligible(&headers(&pairs), call(Some(modern_meta()), "prism_heartbeat")).is_none()
        };
        // Each standard header missing, wrong or repeated.
        assert!(modern("mcp-method", &[]));
        assert!(modern("mcp-name", &[]));
        assert!(modern("mcp-protocol-version", &[]));
        assert!(modern("mcp-name", &[("mcp-name", "prism_status")]));
        assert!(modern("mcp-method", &[("mcp-method", "tools/list")]));
        assert!(modern("", &[("mcp-name", "prism_heartbeat")]));
        // An encoded name rmcp would decode: its to read.
        assert!(modern("mcp-name", &[("mcp-name", "=?base64?cHJpc21faGVhcnRiZWF0?=")]));
        // The header and _meta disagree.
        assert!(modern("mcp-protocol-version", &[("mcp-protocol-version", "2025-11-25")]));
        // Required _meta missing.
        let meta = json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28"});
        assert!(eligible(&headers(&modern_headers()), call(Some(meta), "prism_heartbeat")).is_none());
        // A modern header without _meta; an unknown version; no Accept; a q= in Accept.
        assert!(eligible(&headers(&modern_headers()), call(None, "prism_heartbeat")).is_none());
        let unknown = headers(&[ACCEPT, ("mcp-protocol-version", "1999-01-01")]);
        assert!(eligible(&unknown, call(None, "prism_heartbeat")).is_none());
        assert!(eligible(&HeaderMap::new(), call(None, "prism_heartbeat")).is_none());
        let weighted = headers(&[("accept", "application/json;q=0, text/event-stream")]);
        assert!(eligible(&weighted, call(None, "prism_heartbeat")).is_none());
        let one_kind = headers(&[("accept", "application/json")]);
        assert!(eligible(&one_kind, call(None, "prism_heartbeat")).is_none());
        // An unknown tool.
        assert!(eligible(&headers(&[ACCEPT]), call(None, "prism_nope")).is_none());
    }

    #[test]
    fn only_a_plain_tools_call_is_read_the_rest_is_rmcps() {
        assert!(read(&call_message(None, "prism_heartbeat")).is_some());
        let absent_meta_and_arguments = json!({"jsonrpc": "2.0", "id": "a", "method": "tools/call",
            "params": {"name": "prism_status", "arguments": null, "_meta": null}});
        let call = read(&absent_meta_and_arguments).expect("null is absent, as rmcp reads it");
        let direct = eligible(&headers(&[ACCEPT]), call).expect("direct");
        assert_eq!(
            (direct.id, direct.arguments, direct.meta),
            (RequestId::String("a".into()), None, Default::default())
        );
        // Another method, a notification, another version, no id or a null one.
        for other in [
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
            json!({"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "prism_status"}}),
            json!({"jsonrpc": "1.0", "id": 1, "method": "tools/call", "params": {"name": "prism_status"}}),
            json!({"jsonrpc": "2.0", "id": null, "method": "tools/call", "params": {"name": "prism_status"}}),
            json!({"jsonrpc": "2.0", "id": 1.5, "method": "tools/call", "params": {"name": "prism_status"}}),
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call"}),
        ] {
            assert!(read(&other).is_none(), "{other}");
        }
        // A field the path does not read, at either level: an input-required retry,
        // a stray `result`, anything unknown.
        for (at_params, field) in
            [(true, "inputResponses"), (true, "requestState"), (true, "x"), (false, "result"), (false, "x")]
        {
            let mut message = call_message(None, "prism_heartbeat");
            let target = if at_params { &mut message["params"] } else { &mut message };
            target[field] = json!({});
            assert!(read(&message).is_none(), "{message}");
        }
        // A field repeated.
        let twice = br#"{"jsonrpc":"2.0","id":1,"id":2,"method":"tools/call","params":{"name":"prism_status"}}"#;
        assert!(ToolCall::read(twice).is_none());
    }

    #[test]
    fn the_answer_has_rmcps_shape_for_each_generation() {
        let body = |generation| {
            let mut result = CallToolResult::success(vec![rmcp::model::ContentBlock::text("ok")]);
            result.structured_content = Some(json!({"role": "Master"}));
            let response = answer(RequestId::Number(3), result, generation);
            assert_eq!(response.status(), StatusCode::OK);
            assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
            let bytes = futures::executor::block_on(axum::body::to_bytes(response.into_body(), 1 << 16)).expect("body");
            serde_json::from_slice::<Value>(&bytes).expect("json")
        };
        let legacy = body(Generation::SessionBased);
        assert_eq!((legacy["jsonrpc"].clone(), legacy["id"].clone()), (json!("2.0"), json!(3)));
        assert_eq!(legacy["result"]["structuredContent"]["role"], "Master");
        assert!(legacy["result"].get("resultType").is_none(), "{legacy}");
        let modern = body(Generation::PerRequest);
        assert_eq!(modern["result"]["resultType"], "complete", "{modern}");
    }
}

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
    CallToolRequestParams, CallToolResponse, CallToolResult, ClientJsonRpcMessage, ClientRequest, GetMeta,
    JsonRpcRequest, ProtocolVersion, RequestId, ServerJsonRpcMessage, ServerResult,
};

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

/// A `tools/call` the gate answers itself.
pub(super) struct DirectCall {
    pub id: RequestId,
    pub tool: ToolName,
    pub generation: Generation,
    pub params: CallToolRequestParams,
    pub meta: rmcp::model::RequestMetaObject,
}

/// The call, if rmcp would hand this message straight to the tool: see the module's
/// comment. `headers` are the request's; the body was declared JSON (checked by the gate).
pub(super) fn eligible(headers: &HeaderMap, message: ClientJsonRpcMessage) -> Option<DirectCall> {
    let ClientJsonRpcMessage::Request(JsonRpcRequest { id, mut request, .. }) = message else {
        return None;
    };
    // Taken, not cloned: the request is consumed here (as rmcp moves it into its context).
    let meta = std::mem::take(request.get_meta_mut());
    let ClientRequest::CallToolRequest(call) = request else {
        return None;
    };
    let params = call.params;
    // Input-required retries are rmcp's (none of these tools asks for input).
    if params.input_responses.is_some() || params.request_state.is_some() {
        return None;
    }
    let tool = ToolName::parse(&params.name)?;
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
    Some(DirectCall { id, tool, generation, params, meta })
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

    fn message(value: Value) -> ClientJsonRpcMessage {
        serde_json::from_value(value).expect("a message")
    }

    fn call(meta: Option<Value>, name: &str) -> ClientJsonRpcMessage {
        let mut params = json!({"name": name, "arguments": {"session_id": "s"}});
        if let Some(meta) = meta {
            params["_meta"] = meta;
        }
        message(json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params}))
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
        assert_eq!(direct.params.arguments.and_then(|a| a.get("session_id").cloned()), Some(json!("s")));
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
        // An unknown tool, another method, a notification.
        assert!(eligible(&headers(&[ACCEPT]), call(None, "prism_nope")).is_none());
        let list = message(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}));
        assert!(eligible(&headers(&[ACCEPT]), list).is_none());
        let note = message(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        assert!(eligible(&headers(&[ACCEPT]), note).is_none());
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

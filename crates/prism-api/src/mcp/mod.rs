//! `POST /mcp`: the agent verbs as MCP tools (SPEC §9), Streamable HTTP, on the API
//! listener of every replica.
//!
//! The protocol is the official Rust SDK's (rmcp): its Streamable HTTP service answers
//! both generations, the session-based revisions (`initialize`) and the stateless
//! 2026-07-28 revision (`server/discover`, per-request `_meta`, the standard headers). It
//! runs in its stateless mode: rmcp's own session manager keeps sessions in one
//! process's memory, which a second replica behind the same Service would not know. This
//! module is the gate in front of it and gives the session-based generation its sessions
//! back without memory: on `initialize` it issues an `Mcp-Session-Id` that carries the
//! negotiated version and `clientInfo.name`, signed (`session`), and on every later
//! request any replica verifies it and hands the facts to the tools.
//!
//! The gate, in order: `Host`/`Origin` against the allow-list (before anything else, so
//! a DNS-rebinding page learns nothing), the bearer token (TokenReview; 401 with
//! `WWW-Authenticate`), the body (a malformed JSON-RPC message is a JSON-RPC error), the
//! session id. Authorization is per tool call (`tools`).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use rmcp::model::{ClientJsonRpcMessage, ClientRequest, ErrorData, JsonRpcError, RequestId, SubscriptionFilter};
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::Value;

use super::auth::Caller;
use super::{ApiError, AppState, MAX_BODY_BYTES};

mod direct;
pub mod hosts;
pub mod resources;
pub mod session;
pub mod subscriptions;
pub mod tools;

pub use hosts::AllowedHosts;
pub use session::{SessionFacts, SessionKey};

/// The session id header of the session-based revisions.
const SESSION_HEADER: &str = "mcp-session-id";
/// What a 401 tells an MCP client about the authentication it needs.
const WWW_AUTHENTICATE: &str = "Bearer realm=\"prism\"";

/// The MCP settings of a replica.
pub struct McpConfig {
    pub allowed_hosts: AllowedHosts,
    pub session_key: SessionKey,
    /// `resources/subscribe` of the session-based revisions.
    pub subscriptions: crate::mcp_store::McpStore,
}

type Service = StreamableHttpService<tools::PrismTools, NeverSessionManager>;

/// The `/mcp` endpoint: the gate and the rmcp service behind it.
pub struct Endpoint {
    state: Arc<AppState>,
    service: Service,
    /// The tools the gate calls itself for a plain `tools/call` (`direct`).
    tools: tools::PrismTools,
}

impl Endpoint {
    pub fn new(state: Arc<AppState>) -> Self {
        let tools_state = state.clone();
        let config = StreamableHttpServerConfig::default()
            // Any replica answers any request: nothing lives in one process (see above).
            .with_legacy_session_mode(false)
            // One JSON answer per call, no SSE stream to keep open.
            .with_json_response(true)
            // The gate checks Host and Origin against our own allow-list, before the
            // token; the SDK's loopback-only default would refuse the Service's names.
            .disable_allowed_hosts()
            .disable_allowed_origins()
            .with_sse_keep_alive(None)
            .with_max_request_body_bytes(MAX_BODY_BYTES);
        let service = StreamableHttpService::new(
            move || Ok(tools::PrismTools::new(tools_state.clone())),
            Arc::new(NeverSessionManager::default()),
            config,
        );
        let tools = tools::PrismTools::new(state.clone());
        Endpoint { state, service, tools }
    }

    pub async fn handle(&self, request: Request) -> Response {
        match self.gate(request).await {
            Ok(response) | Err(response) => response,
        }
    }

    async fn gate(&self, request: Request) -> Result<Response, Response> {
        let (mut parts, body) = request.into_parts();
        self.state.mcp.allowed_hosts.check(&parts.uri, &parts.headers).map_err(IntoResponse::into_response)?;
        let peer = parts.extensions.get::<axum::extract::ConnectInfo<std::net::SocketAddr>>().map(|c| c.0.ip());
        let caller = self.state.auth.authenticate(&parts.headers, peer).await.map_err(unauthorized)?;
        let facts = self.session(&parts.headers, &caller).map_err(|r| *r)?;
        if let Some(session) = facts.clone() {
            // A session's own GET stream (its resource notifications) and its end: kept
            // in Postgres, so any replica serves them (`subscriptions`).
            if parts.method == Method::GET && accepts_event_stream(&parts.headers) {
                let follower =
                    resources::Follower { caller, headers: super::watch::auth_headers(&parts.headers), peer };
                return subscriptions::stream(self.state.clone(), follower, session)
                    .map_err(IntoResponse::into_response);
            }
            if parts.method == Method::DELETE {
                self.state
                    .mcp
                    .subscriptions
                    .forget(&session.id_digest)
                    .await
                    .map_err(|e| ApiError::from(e).into_response())?;
                return Ok(StatusCode::OK.into_response());
            }
        }
        if parts.method != Method::POST {
            // GET and DELETE without a session: rmcp's stateless mode answers 405, which
            // the MCP transport allows for both.
            let response = self.service.handle(axum::http::Request::from_parts(parts, Body::empty())).await;
            return Ok(response.map(Body::new));
        }
        let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES).await.map_err(|_| {
            *rpc_error(StatusCode::PAYLOAD_TOO_LARGE, None, ErrorData::invalid_request("request body too large", None))
        })?;
        let json_body = declares_json(&parts.headers);
        let mut peeked = parse(&bytes, json_body).map_err(|r| *r)?;
        if let Some(message) = peeked.call.take()
            && let Some(call) = direct::eligible(&parts.headers, message)
        {
            let cx = tools::CallContext {
                caller: &caller,
                namespace_header: tools::namespace_header(&parts.headers),
                meta: &call.meta,
                session: facts.as_ref(),
            };
            let result = self.tools.complete(call.tool, call.arguments, &cx, tools::Via::Direct).await;
            return Ok(direct::answer(call.id, result, call.generation));
        }
        // A listen is a held stream of its caller (SPEC §12): its place is taken here and
        // held by the response body, which ends at the stream lifetime.
        let held = match &peeked.listen {
            Some(_) => match self.state.streams.hold(crate::streams::Holder::Identity(caller.username.clone())) {
                Ok(permit) => Some(permit),
                Err(e) => {
                    let mut refused = rpc_error(e.status, peeked.id.clone(), resources::rpc_error(&e));
                    if let Some(wait) = e.retry_after {
                        refused.headers_mut().insert(header::RETRY_AFTER, wait.as_secs().max(1).into());
                    }
                    return Err(*refused);
                }
            },
            None => None,
        };
        // rmcp acknowledges a listen before its handler runs: where the followed projects
        // stand is read here, before, so that a change in between is notified.
        if let Some(requested) = &peeked.listen
            && let Some(baseline) = resources::baseline(&self.state, &caller, requested).await
        {
            parts.extensions.insert(baseline);
        }
        parts.extensions.insert(caller.clone());
        if let Some(facts) = facts {
            parts.extensions.insert(facts);
        }
        let response = self.service.handle(axum::http::Request::from_parts(parts, Body::from(bytes))).await;
        let mut response = response.map(Body::new);
        if let Some(permit) = held {
            response = crate::watch::held(response, permit, &self.state);
        }
        if json_body {
            response = rewrite_refusal(response, peeked.id).await;
        }
        match peeked.initialize {
            Some(client_name) => Ok(self.with_session(response, &client_name, &caller).await),
            None => Ok(response),
        }
    }

    /// The facts of the request's session, if it names one. An id that does not verify,
    /// or that another identity initialized, is an unknown session: 404, after which the
    /// MCP client initializes again.
    fn session(&self, headers: &HeaderMap, caller: &Caller) -> Result<Option<SessionFacts>, Refused> {
        let Some(value) = headers.get(SESSION_HEADER) else {
            return Ok(None);
        };
        let facts = value.to_str().ok().and_then(|id| self.state.mcp.session_key.verify(id));
        match facts {
            Some(facts)
                if facts.belongs_to(&caller.username, caller.uid.as_deref(), chrono::Utc::now().timestamp()) =>
            {
                Ok(Some(facts))
            }
            _ => Err(rpc_error(
                StatusCode::NOT_FOUND,
                None,
                ErrorData::invalid_request("unknown or invalid Mcp-Session-Id: initialize a new session", None),
            )),
        }
    }

    /// Adds the signed session id to a successful `initialize` answer.
    async fn with_session(&self, response: Response, client_name: &str, caller: &Caller) -> Response {
        if response.status() != StatusCode::OK {
            return response;
        }
        let (mut parts, body) = response.into_parts();
        let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
            return (StatusCode::BAD_GATEWAY, "initialize: the answer could not be read").into_response();
        };
        let negotiated = negotiated_version(&bytes);
        if let Some(version) = negotiated {
            let id = self.state.mcp.session_key.sign(&SessionFacts::new(
                &version,
                client_name,
                &caller.username,
                caller.uid.as_deref(),
            ));
            if let Ok(value) = HeaderValue::from_str(&id) {
                parts.headers.insert(SESSION_HEADER, value);
            }
        }
        Response::from_parts(parts, Body::from(bytes))
    }
}

fn accepts_event_stream(headers: &HeaderMap) -> bool {
    headers.get_all(header::ACCEPT).iter().any(|v| v.to_str().is_ok_and(|v| v.contains("text/event-stream")))
}

/// 401 answers carry the challenge MCP clients look for.
fn unauthorized(e: ApiError) -> Response {
    let challenge = e.status == StatusCode::UNAUTHORIZED;
    let mut response = e.into_response();
    if challenge {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(WWW_AUTHENTICATE));
    }
    response
}

/// A request the gate answers itself (boxed: a response is large, the happy path small).
type Refused = Box<Response>;

fn rpc_error(status: StatusCode, id: Option<RequestId>, error: ErrorData) -> Refused {
    let body = serde_json::to_vec(&JsonRpcError::new(id, error)).unwrap_or_default();
    Box::new((status, [(header::CONTENT_TYPE, "application/json")], body).into_response())
}

/// The little the gate reads of a message before rmcp parses it in full: the method
/// (is it `initialize`, or `subscriptions/listen`?) and the id (for a refusal).
#[derive(serde::Deserialize)]
struct Peek<'a> {
    #[serde(borrow, default)]
    method: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    id: Option<RequestId>,
}

/// What the gate learned of the body.
#[derive(Debug)]
struct Peeked {
    id: Option<RequestId>,
    /// `clientInfo.name` of an `initialize` request.
    initialize: Option<String>,
    /// What a `subscriptions/listen` request asks to follow.
    listen: Option<SubscriptionFilter>,
    /// A plain `tools/call`, read: the gate may answer it itself (`direct`).
    call: Option<direct::ToolCall>,
}

/// Reads the body as far as the gate needs: a refusal (a JSON-RPC error, never a 5xx)
/// for what is not JSON or not a JSON-RPC object, and the client's name for
/// `initialize`, and a plain `tools/call` in full (the gate's direct path answers it
/// without rmcp's parse). The full parse of every other message is rmcp's; what rmcp
/// refuses becomes a JSON-RPC error too (`rewrite_refusal`). `json_body`: the body was
/// declared JSON, without which rmcp refuses any message (a call is then not read).
fn parse(bytes: &Bytes, json_body: bool) -> Result<Peeked, Refused> {
    // Serde reads a struct from an array too; a message is an object (batches are gone
    // from the protocol since 2025-06-18).
    let object = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    // Most messages are plain calls: read once, straight into the direct path's fields
    // (a first `Peek` of the method, then the call, read every call twice). Another
    // method fails this read at its `method`; the reading below is then as before.
    if object
        && json_body
        && let Some(call) = direct::ToolCall::read(bytes)
    {
        tracing::Span::current().record("mcp.method", "tools/call");
        return Ok(Peeked { id: Some(call.id().clone()), initialize: None, listen: None, call: Some(call) });
    }
    let peek: Peek = serde_json::from_slice(bytes).map_err(|e| {
        if e.is_data() {
            rpc_error(
                StatusCode::BAD_REQUEST,
                None,
                ErrorData::invalid_request(format!("not a JSON-RPC 2.0 message: {e}"), None),
            )
        } else {
            rpc_error(StatusCode::BAD_REQUEST, None, ErrorData::parse_error(format!("not JSON: {e}"), None))
        }
    })?;
    if let Some(method) = peek.method.as_deref() {
        // The caller's own string: on the request's span, cut to a method name's length.
        let method: String = method.chars().take(64).collect();
        tracing::Span::current().record("mcp.method", method.as_str());
    }
    if !object {
        return Err(invalid_message(None, &"a message is one JSON object"));
    }
    // The two other methods the gate reads further are parsed in full, once, as rmcp
    // reads them. A malformed initialize is refused here; a malformed listen (or a call
    // that is not plain) is rmcp's to refuse, in its words (the gate only reads what a
    // good one asks).
    let (mut initialize, mut listen) = (None, None);
    if let Some(method @ ("initialize" | "subscriptions/listen")) = peek.method.as_deref() {
        match serde_json::from_slice::<ClientJsonRpcMessage>(bytes) {
            Ok(ClientJsonRpcMessage::Request(request)) => match request.request {
                ClientRequest::InitializeRequest(init) => initialize = Some(init.params.client_info.name),
                ClientRequest::SubscriptionsListenRequest(l) => listen = Some(l.params.notifications),
                _ => {}
            },
            Ok(_) => {}
            Err(e) if method == "initialize" => return Err(invalid_message(peek.id, &e)),
            Err(_) => {}
        }
    }
    Ok(Peeked { id: peek.id, initialize, listen, call: None })
}

fn invalid_message(id: Option<RequestId>, error: &dyn std::fmt::Display) -> Refused {
    rpc_error(
        StatusCode::BAD_REQUEST,
        id,
        ErrorData::invalid_request(format!("not a JSON-RPC 2.0 message this server knows: {error}"), None),
    )
}

/// Is the request's body declared JSON (what rmcp requires before it parses)?
fn declares_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

/// rmcp answers a JSON body it cannot parse as a message with a plain-text 415; the MCP
/// transport wants a JSON-RPC error.
async fn rewrite_refusal(response: Response, id: Option<RequestId>) -> Response {
    if response.status() != StatusCode::UNSUPPORTED_MEDIA_TYPE {
        return response;
    }
    let detail = match axum::body::to_bytes(response.into_body(), 4096).await {
        Ok(detail) => String::from_utf8_lossy(&detail).into_owned(),
        Err(error) => {
            tracing::warn!(%error, "mcp: the SDK's 415 answer could not be read; answering without its detail");
            "unsupported media type".to_string()
        }
    };
    *invalid_message(id, &detail)
}

/// `result.protocolVersion` of an `initialize` answer.
fn negotiated_version(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    value.get("result")?.get("protocolVersion")?.as_str().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_messages_are_json_rpc_errors_not_5xx() {
        for (body, code) in [
            (&b"{not json"[..], -32700),
            (b"[]", -32600),
            (b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":5}", -32600),
            (b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"initialize\",\"params\":7}", -32600),
        ] {
            let err = parse(&Bytes::from_static(body), true).expect_err("malformed");
            assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(body));
            let body = futures::executor::block_on(axum::body::to_bytes((*err).into_body(), 4096)).expect("body");
            let json: Value = serde_json::from_slice(&body).expect("json");
            assert_eq!(json["error"]["code"], code, "{json}");
        }
        // The rest of a message's shape is rmcp's to check; its refusal is rewritten.
        assert!(parse(&Bytes::from_static(b"{\"jsonrpc\":\"2.0\"}"), true).is_ok());
    }

    #[test]
    fn initialize_names_its_client() {
        let body = serde_json::json!({
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                       "clientInfo": {"name": "claude-code", "version": "2.1"}}
        });
        let parsed = parse(&Bytes::from(body.to_string()), true).expect("valid");
        assert_eq!(parsed.initialize.as_deref(), Some("claude-code"));
        let call = serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
        let parsed = parse(&Bytes::from(call.to_string()), true).expect("valid");
        assert_eq!((parsed.initialize, parsed.id), (None, Some(RequestId::Number(2))));
    }

    #[test]
    fn a_plain_call_is_read_once_and_only_as_one_json_object() {
        let call = serde_json::json!({
            "jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "prism_status", "arguments": {}}
        });
        let parsed = parse(&Bytes::from(call.to_string()), true).expect("valid");
        assert_eq!(parsed.id, Some(RequestId::Number(7)), "the refusal's id comes from the same read");
        assert!(parsed.call.is_some());
        // rmcp refuses a body not declared JSON: nothing of it is read for the direct path.
        let parsed = parse(&Bytes::from(call.to_string()), false).expect("rmcp's to refuse");
        assert!(parsed.call.is_none());
        assert_eq!(parsed.id, Some(RequestId::Number(7)));
        // Serde would read the struct from an array in field order; a message is an object.
        let array = serde_json::json!(["2.0", 7, "tools/call", {"name": "prism_status"}]);
        let err = parse(&Bytes::from(array.to_string()), true).expect_err("not an object");
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn a_listen_says_what_it_follows() {
        let body = serde_json::json!({
            "jsonrpc": "2.0", "id": 3, "method": "subscriptions/listen",
            "params": {"notifications": {"resourceSubscriptions": ["prism://agents/projects/shop"]}}
        });
        let parsed = parse(&Bytes::from(body.to_string()), true).expect("valid");
        let requested = parsed.listen.expect("a listen");
        assert_eq!(requested.resource_subscriptions, Some(vec!["prism://agents/projects/shop".to_string()]));
        // Malformed: rmcp refuses it; the gate reads nothing of it.
        let bad = serde_json::json!({"jsonrpc": "2.0", "id": 4, "method": "subscriptions/listen", "params": 7});
        assert!(parse(&Bytes::from(bad.to_string()), true).expect("rmcp's to refuse").listen.is_none());
    }

    #[test]
    fn the_negotiated_version_is_read_from_the_answer() {
        let body = br#"{"jsonrpc":"2.0","id":1,"result":{"protocolVersion":"2025-06-18","capabilities":{}}}"#;
        assert_eq!(negotiated_version(body).as_deref(), Some("2025-06-18"));
        assert_eq!(negotiated_version(b"{}"), None);
    }
}

//! The seven tools of SPEC §9 over the agent sessions service: parse, resolve the
//! namespace, authorize (SubjectAccessReview, as the HTTP API does), heartbeat the
//! session a call names, call, shape the answer. Refusals and bad input are tool results
//! with `isError: true` whose text is `{"error": {"code", "message"}}` (the HTTP API's
//! codes) and no `structuredContent`; only an unknown tool is a JSON-RPC error.

use std::borrow::Cow;
use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation, InitializeResult,
    JsonObject, ListResourceTemplatesResult, ListResourcesResult, ListToolsResult, PaginatedRequestParams,
    ReadResourceRequestParams, ReadResourceResponse, RequestMetaObject, ServerCapabilities, SubscribeRequestParams,
    SubscriptionFilter, Tool, ToolAnnotations, UnsubscribeRequestParams,
};
use rmcp::service::{RequestContext, SubscriptionContext};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::SessionFacts;
use super::resources::{self, Follower};
use super::subscriptions;
use crate::agent_sessions::{AgentError, HeartbeatReply, RouteEntry};
use crate::agents::{RESOURCE, check_identifier, check_namespace};
use crate::auth::Caller;
use crate::crd::{AgentSurface, PRINTABLE_PATTERN, Role};
use crate::election::LiveRole;
use crate::election::store::{Nudge, NudgeKind};
use crate::run_registry::RunAddress;
use crate::run_registry::jobs::{IDEMPOTENCY_KEY_PATTERN, JobFence, JobKind, JobState, NewJob, idempotency_key_ok};
use crate::run_registry::service::{check_address, check_jsonb};
use crate::runs::enqueue_as;
use crate::{ApiError, AppState};
use prism_core::limits::{COMPONENT_KIND_MAX, NAMESPACE_MAX, PROJECT_ID_MAX, SERVER_INSTANCE_ID_MAX, SESSION_ID_MAX};

/// The header that names a call's namespace when its arguments do not.
pub const NAMESPACE_HEADER: &str = "x-prism-namespace";

const INSTRUCTIONS: &str = "prism coordinates AI agent sessions working on the same project: one session is \
master, the others are peers. Call prism_start once per task with the project_id, keep the session_id it \
returns and pass it to every later prism call (each call is also your heartbeat). If a result says you were \
preempted, another session is master now: stop writing as master. Call prism_wrap with your session_id when \
the task is done.";

const KEEP_SESSION: &str = "Pass the session_id returned by prism_start (each call with it is also the \
session's heartbeat).";

/// The tools, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ToolName {
    Start,
    Wrap,
    Status,
    Heartbeat,
    Fence,
    Enqueue,
    Job,
}

impl ToolName {
    const ALL: [ToolName; 7] = [
        ToolName::Start,
        ToolName::Wrap,
        ToolName::Status,
        ToolName::Heartbeat,
        ToolName::Fence,
        ToolName::Enqueue,
        ToolName::Job,
    ];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            ToolName::Start => "prism_start",
            ToolName::Wrap => "prism_wrap",
            ToolName::Status => "prism_status",
            ToolName::Heartbeat => "prism_heartbeat",
            ToolName::Fence => "prism_fence",
            ToolName::Enqueue => "prism_enqueue",
            ToolName::Job => "prism_job",
        }
    }

    pub(super) fn parse(name: &str) -> Option<ToolName> {
        Self::ALL.into_iter().find(|t| t.as_str() == name)
    }

    /// The SubjectAccessReview verb on controllerregistrations (SPEC §9).
    fn verb(self) -> &'static str {
        match self {
            ToolName::Start | ToolName::Heartbeat => "create",
            ToolName::Wrap => "delete",
            ToolName::Status => "list",
            // Enqueue reads the session's term; job reads the session's role (when given).
            ToolName::Fence | ToolName::Enqueue | ToolName::Job => "get",
        }
    }

    /// The tool's definition, built once (rmcp looks it up on every 2026-07-28 call).
    fn definition(self) -> Tool {
        static DEFINITIONS: std::sync::OnceLock<Vec<Tool>> = std::sync::OnceLock::new();
        let all = DEFINITIONS.get_or_init(|| ToolName::ALL.iter().map(|t| t.build_definition()).collect());
        all.iter().find(|t| t.name == self.as_str()).cloned().unwrap_or_else(|| self.build_definition())
    }

    fn build_definition(self) -> Tool {
        let namespace = json!({"type": "string", "description": "Kubernetes namespace of the project (default: the X-Prism-Namespace header, else your ServiceAccount's namespace)", "maxLength": NAMESPACE_MAX});
        let session = |required: bool| {
            json!({"type": "string", "minLength": 1, "maxLength": SESSION_ID_MAX, "pattern": PRINTABLE_PATTERN, "description":
                if required { KEEP_SESSION } else { "Your session_id from prism_start, if you have one. Omit it on the first call: a new one is minted and returned." }})
        };
        let project = json!({"type": "string", "minLength": 1, "maxLength": PROJECT_ID_MAX, "pattern": PRINTABLE_PATTERN, "description": "The project (the same id every session of the project uses)"});
        let (description, properties, required): (&str, Value, &[&str]) = match self {
            ToolName::Start => (
                "Join a project for this task. Call it ONCE per task, at the start; keep the returned session_id and pass it to every later prism call. Returns whether you are master (the one session that may act as the project's controller) or a peer, the election term, and the routing table. Starting on another project leaves the previous one.",
                json!({
                    "project_id": project,
                    "session_id": session(false),
                    "agent_surface": {"type": "string", "enum": AgentSurface::ALL.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
                                      "description": "Which agent you run in (default: from your MCP client's name). Desktop sessions preempt the others."},
                    "namespace": namespace,
                }),
                &["project_id"],
            ),
            ToolName::Wrap => (
                "The task is done: leave the project (if you were master, the best peer becomes master at once). Pass your session_id.",
                json!({"session_id": session(true), "namespace": namespace}),
                &["session_id"],
            ),
            ToolName::Status => (
                "The project's routing table: who is master, the peers, recently stale sessions. With your session_id, also your own role (and the call is your heartbeat).",
                json!({"project_id": project, "session_id": session(false), "namespace": namespace}),
                &["project_id"],
            ),
            ToolName::Heartbeat => (
                "Keep your session alive and learn your role (master or peer), the project's term, and whether you were preempted. Any prism call with your session_id does this too.",
                json!({"session_id": session(true), "namespace": namespace}),
                &["session_id"],
            ),
            ToolName::Fence => (
                "Check that a term is the project's current master term before acting as master (a demoted master's term is stale). Fails with stale_term otherwise.",
                json!({"project_id": project, "term": {"type": "integer", "minimum": 0, "description": "The term prism_start or prism_heartbeat gave you"},
                       "session_id": session(false), "namespace": namespace}),
                &["project_id", "term"],
            ),
            ToolName::Enqueue => (
                "As master, queue machine work for a Run (a server's component), fenced with your master term: if another session becomes master before a machine claims it, it is cancelled and never runs. Fails with not_master if you are not master. Returns the job; read it later with prism_job.",
                json!({
                    "server_instance_id": {"type": "string", "minLength": 1, "maxLength": SERVER_INSTANCE_ID_MAX, "pattern": "^[A-Za-z0-9._-]+$", "description": "The server the Run is on"},
                    "component_kind": {"type": "string", "minLength": 1, "maxLength": COMPONENT_KIND_MAX, "pattern": "^[a-z0-9-]+$", "description": "The Run's component (e.g. run)"},
                    "kind": {"type": "string", "enum": JobKind::ALL.iter().map(|k| k.as_str()).collect::<Vec<_>>()},
                    "payload": {"type": "object", "description": "What the Run needs to do the work"},
                    "session_id": session(true),
                    "run_namespace": {"type": "string", "maxLength": NAMESPACE_MAX, "description": "The namespace of the RunSession"},
                    "idempotency_key": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": IDEMPOTENCY_KEY_PATTERN, "description": "Repeat a call with the same key to get the same job instead of a second one"},
                    "namespace": namespace,
                }),
                &["server_instance_id", "component_kind", "kind", "payload", "session_id", "run_namespace"],
            ),
            ToolName::Job => (
                "Read a job: its state (queued, claimed, running, succeeded, failed, cancelled), attempts, progress, result and last error.",
                json!({
                    "job_id": {"type": "string", "format": "uuid", "description": "The id prism_enqueue returned"},
                    "run_namespace": {"type": "string", "maxLength": NAMESPACE_MAX, "description": "The namespace of the job's RunSession"},
                    "session_id": session(false),
                    "namespace": namespace,
                }),
                &["job_id", "run_namespace"],
            ),
        };
        let schema =
            json!({"type": "object", "properties": properties, "required": required, "additionalProperties": false});
        Tool::new(self.as_str(), description, Arc::new(object(schema)))
            .with_raw_output_schema(Arc::new(object(self.output_schema())))
            .with_annotations(self.annotations())
    }

    /// SPEC §9: hints for clients (none of these tools destroys anything or reaches
    /// outside the operator).
    fn annotations(self) -> ToolAnnotations {
        let (read_only, idempotent) = match self {
            ToolName::Status | ToolName::Job => (true, true),
            // The same session's start, wrap, heartbeat or fence again changes nothing more.
            ToolName::Start | ToolName::Wrap | ToolName::Heartbeat | ToolName::Fence => (false, true),
            // Idempotent only with an idempotency_key.
            ToolName::Enqueue => (false, false),
        };
        ToolAnnotations::new().read_only(read_only).destructive(false).idempotent(idempotent).open_world(false)
    }

    /// What the tool's `structuredContent` conforms to (SPEC §9); a refused call has none,
    /// its error JSON is the text (`tool_error`). Fields
    /// are listed, not closed: a later version may add some.
    fn output_schema(self) -> Value {
        let text = json!({"type": "string"});
        let nullable = |t: &str| json!({"type": [t, "null"]});
        let roles: Vec<Value> = [Role::Pending, Role::Master, Role::Peer, Role::Released]
            .iter()
            .map(|r| json!(r.as_str()))
            .chain([Value::Null])
            .collect();
        let role = json!({"type": ["string", "null"], "enum": roles});
        let entry = json!({"type": "object", "required": ["id", "namespace", "name", "session_id", "agent_surface", "role", "registered_at", "last_heartbeat"],
            "properties": {"id": {"type": "string", "format": "uuid"}, "namespace": text, "name": text, "session_id": text,
                           "agent_surface": {"type": "string", "enum": AgentSurface::ALL.iter().map(|s| s.as_str()).collect::<Vec<_>>()},
                           "role": role, "registered_at": {"type": "string", "format": "date-time"},
                           "last_heartbeat": {"type": "string", "format": "date-time"}}});
        let entry_or_null = json!({"anyOf": [entry, {"type": "null"}]});
        let routing = json!({"type": "object", "required": ["project_id", "namespace", "term", "master", "peers", "stale"],
            "properties": {"project_id": text, "namespace": text, "term": {"type": "integer"}, "master": entry_or_null,
                           "peers": {"type": "array", "items": entry}, "stale": {"type": "array", "items": entry}, "caller": entry}});
        let nudge = json!({"type": "object", "required": ["id", "kind", "project_id", "payload", "created_at"],
            "properties": {"id": {"type": "string", "format": "uuid"},
                           "kind": {"type": "string", "enum": NudgeKind::ALL.iter().map(|k| k.as_str()).collect::<Vec<_>>()},
                           "project_id": text, "payload": {"type": "object"}, "created_at": {"type": "string", "format": "date-time"}}});
        let job = json!({"type": "object", "required": ["id", "namespace", "server_instance_id", "component_kind", "kind", "state", "attempts", "max_attempts", "cancel_requested", "created_at"],
            "properties": {"id": {"type": "string", "format": "uuid"}, "namespace": text, "server_instance_id": text, "component_kind": text,
                           "kind": {"type": "string", "enum": JobKind::ALL.iter().map(|k| k.as_str()).collect::<Vec<_>>()},
                           "state": {"type": "string", "enum": JobState::ALL.iter().map(|s| s.as_str()).collect::<Vec<_>>()},
                           "attempts": {"type": "integer"}, "max_attempts": {"type": "integer"}, "cancel_requested": {"type": "boolean"},
                           "last_error": nullable("string"), "created_at": {"type": "string", "format": "date-time"}}});
        // D6 (SPEC §9): with a session_id, its role, whether it was preempted, its nudges.
        let session = [
            ("role", role.clone()),
            ("you_were_preempted", json!({"type": "boolean"})),
            ("nudges", json!({"type": "array", "items": nudge})),
        ];
        let mut schema = match self {
            ToolName::Start => {
                json!({"type": "object", "required": ["session_id", "registration", "namespace", "project_id", "role", "is_master", "term", "you_were_preempted", "routing"],
                       "properties": {"session_id": text, "registration": entry, "namespace": text, "project_id": text,
                                      "is_master": {"type": "boolean"}, "term": {"type": "integer"}, "routing": routing}})
            }
            ToolName::Wrap => json!({"type": "object", "required": ["session_id", "released", "routing"],
                       "properties": {"session_id": text, "released": {"type": "array", "items": {"type": "string", "format": "uuid"}}, "routing": routing}}),
            ToolName::Status => routing,
            ToolName::Heartbeat => {
                json!({"type": "object", "required": ["role", "is_master", "you_were_preempted", "term", "nudges"],
                       "properties": {"is_master": {"type": "boolean"}, "term": {"type": "integer"}}})
            }
            ToolName::Fence => json!({"type": "object", "required": ["project_id", "term", "master"],
                       "properties": {"project_id": text, "term": {"type": "integer"}, "master": entry}}),
            ToolName::Enqueue | ToolName::Job => job,
        };
        if let Some(properties) = schema["properties"].as_object_mut() {
            for (name, s) in session {
                properties.insert(name.to_string(), s);
            }
        }
        schema
    }
}

fn object(schema: Value) -> JsonObject {
    match schema {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

/// SPEC §9: the surface of a client that does not say, from its `clientInfo.name`.
pub fn surface_of_client(name: Option<&str>) -> AgentSurface {
    match name {
        Some("claude-code") => AgentSurface::ClaudeCode,
        Some("codex-mcp-client") => AgentSurface::Codex,
        Some("cursor-vscode") => AgentSurface::Cursor,
        Some("claude-ai") => AgentSurface::ClaudeDesktop,
        _ => AgentSurface::Other,
    }
}

/// SPEC §9: the call's namespace: the argument, else the header, else the caller's own
/// namespace when it is a ServiceAccount.
fn resolve_namespace(argument: Option<String>, header: Option<&str>, caller: &Caller) -> Result<String, ApiError> {
    let namespace = argument
        .or_else(|| header.map(str::to_string))
        .or_else(|| {
            let rest = caller.username.strip_prefix("system:serviceaccount:")?;
            rest.split_once(':').map(|(ns, _)| ns.to_string())
        })
        .ok_or_else(|| {
            ApiError::new(
                axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                "namespace_required",
                "no namespace: pass the namespace argument, or the X-Prism-Namespace header",
            )
        })?;
    check_namespace(&namespace)?;
    Ok(namespace)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StartArgs {
    project_id: String,
    session_id: Option<String>,
    agent_surface: Option<AgentSurface>,
    namespace: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionArgs {
    session_id: String,
    namespace: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StatusArgs {
    project_id: String,
    session_id: Option<String>,
    namespace: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FenceArgs {
    project_id: String,
    term: i64,
    session_id: Option<String>,
    namespace: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnqueueArgs {
    server_instance_id: String,
    component_kind: String,
    kind: JobKind,
    payload: JsonObject,
    session_id: String,
    run_namespace: String,
    idempotency_key: Option<String>,
    namespace: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JobArgs {
    job_id: String,
    run_namespace: String,
    session_id: Option<String>,
    namespace: Option<String>,
}

fn arguments<T: DeserializeOwned>(tool: ToolName, args: Option<JsonObject>) -> Result<T, ApiError> {
    let args = args.unwrap_or_default();
    // The schemas say every argument is a string or an integer: an optional one is left
    // out, not sent as null (serde would read null as "absent").
    if let Some((name, _)) = args.iter().find(|(_, v)| v.is_null()) {
        return Err(ApiError::invalid(format!(
            "{}: bad arguments at {name}: null is not allowed (leave the argument out)",
            tool.as_str()
        )));
    }
    let value = Value::Object(args);
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let at = if path == "." { String::new() } else { format!(" at {path}") };
        ApiError::invalid(format!("{}: bad arguments{at}: {}", tool.as_str(), e.inner()))
    })
}

/// Which path answered a tool call (counted in `prism_mcp_tool_calls_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Via {
    /// The gate itself (`direct`).
    Direct,
    /// rmcp's service.
    Sdk,
}

impl Via {
    fn as_str(self) -> &'static str {
        match self {
            Via::Direct => "direct",
            Via::Sdk => "sdk",
        }
    }
}

/// What a call knows about who is calling.
pub(super) struct CallContext<'a> {
    pub caller: &'a Caller,
    pub namespace_header: Option<&'a str>,
    /// The request's `_meta` (its `clientInfo` in the stateless revision).
    pub meta: &'a RequestMetaObject,
    pub session: Option<&'a SessionFacts>,
}

impl CallContext<'_> {
    /// The client's `clientInfo.name`: per request in the stateless revision, from the
    /// signed session id in the session-based ones. Read only by prism_start.
    fn client_name(&self) -> Option<String> {
        self.meta.client_info().map(|c| c.name).or_else(|| self.session.map(|f| f.client_name.clone()))
    }
}

/// A tool's answer: the structured content, a summary line for the text content, and
/// the session facts D6 puts beside them.
struct Answer {
    content: Value,
    summary: String,
    session: Option<SessionState>,
}

/// SPEC §9 D6: the role of the session a call names, and whether it was preempted (with
/// the master that did it, for the text).
struct SessionState {
    role: Option<Role>,
    you_were_preempted: bool,
    master: Option<RouteEntry>,
    /// SPEC §11: its nudges not delivered before, delivered by this answer.
    nudges: Vec<Nudge>,
}

impl SessionState {
    fn unregistered() -> Self {
        SessionState { role: None, you_were_preempted: false, master: None, nudges: Vec::new() }
    }
}

/// The line a nudge adds to the text of an answer (models read the text).
fn nudge_line(nudge: &Nudge) -> String {
    match nudge.kind {
        NudgeKind::WrapSession => format!(
            "Nudge: this session moved on from project {}; wrap up what you were doing there.",
            nudge.project_id
        ),
    }
}

fn role_of(live: &LiveRole) -> Role {
    if live.is_master { Role::Master } else { Role::Peer }
}

/// The preemption line that begins the text of a preempted session's answers.
fn preempted_line(master: Option<&RouteEntry>) -> String {
    match master {
        Some(m) => format!(
            "You were preempted: {} (session {}, {}) is now master of this project. Stop acting as master.",
            m.name, m.session_id, m.agent_surface
        ),
        None => "You were preempted: another session took over as master of this project. Stop acting as master."
            .to_string(),
    }
}

fn render(answer: Answer) -> CallToolResult {
    let mut content = answer.content;
    let mut text = String::new();
    if let (Some(state), Value::Object(map)) = (&answer.session, &mut content) {
        map.insert("role".into(), json!(state.role));
        map.insert("you_were_preempted".into(), json!(state.you_were_preempted));
        map.insert("nudges".into(), json!(state.nudges));
        if state.you_were_preempted && state.role != Some(Role::Master) {
            text.push_str(&preempted_line(state.master.as_ref()));
            text.push('\n');
        }
        for nudge in &state.nudges {
            text.push_str(&nudge_line(nudge));
            text.push('\n');
        }
    }
    text.push_str(&answer.summary);
    text.push('\n');
    // The JSON again as text, for clients that do not read structuredContent (MCP asks
    // tools with structured results to do so).
    text.push_str(&content.to_string());
    let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
    result.structured_content = Some(content);
    result
}

/// A refusal (SPEC §9): `isError` with the HTTP API's error JSON as the text and no
/// `structuredContent`. Clients (the official TypeScript SDK among them) check
/// `structuredContent` against the tool's `outputSchema` even on errors, so an error object
/// there turned every refusal into an opaque schema error and hid the code from the agent.
fn tool_error(e: &ApiError) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(
        json!({"error": {"code": e.code, "message": e.message}}).to_string(),
    )])
}

/// The MCP server: one per request (rmcp's service factory), over the shared state.
pub struct PrismTools {
    state: Arc<AppState>,
}

impl PrismTools {
    pub fn new(state: Arc<AppState>) -> Self {
        PrismTools { state }
    }

    /// A known tool's call, refusals included, as its result: what `call_tool` answers
    /// through rmcp and the gate's direct path (`direct`) answers without it.
    pub(super) async fn complete(
        &self,
        tool: ToolName,
        args: Option<JsonObject>,
        cx: &CallContext<'_>,
        via: Via,
    ) -> CallToolResult {
        self.state.metrics.mcp_tool_called(tool.as_str(), via.as_str());
        match self.call(tool, args, cx).await {
            Ok(answer) => render(answer),
            Err(e) => tool_error(&e),
        }
    }

    async fn call(&self, tool: ToolName, args: Option<JsonObject>, cx: &CallContext<'_>) -> Result<Answer, ApiError> {
        match tool {
            ToolName::Start => self.start(arguments(tool, args)?, cx).await,
            ToolName::Wrap => self.wrap(arguments(tool, args)?, cx).await,
            ToolName::Status => self.status(arguments(tool, args)?, cx).await,
            ToolName::Heartbeat => self.heartbeat(arguments(tool, args)?, cx).await,
            ToolName::Fence => self.fence(arguments(tool, args)?, cx).await,
            ToolName::Enqueue => self.enqueue(arguments(tool, args)?, cx).await,
            ToolName::Job => self.job(arguments(tool, args)?, cx).await,
        }
    }

    /// Namespace, then authorization: before anything is looked up (SPEC §6).
    async fn authorize(
        &self,
        tool: ToolName,
        namespace: Option<String>,
        cx: &CallContext<'_>,
    ) -> Result<String, ApiError> {
        let namespace = resolve_namespace(namespace, cx.namespace_header, cx.caller)?;
        self.state.auth.authorize(cx.caller, tool.verb(), RESOURCE, &namespace).await?;
        Ok(namespace)
    }

    /// D2: the call is the session's heartbeat (coalesced, and refused for another
    /// identity's session) when the caller may heartbeat it (SPEC §4 rule 8: it may
    /// `create` registrations here); a reader's call only reads the role. D6: its role.
    /// A session with no live registration has no role.
    async fn touch(&self, namespace: &str, session_id: &str, cx: &CallContext<'_>) -> Result<SessionState, ApiError> {
        let agents = &self.state.agents;
        let may_beat = self.state.auth.allowed(cx.caller, "create", RESOURCE, namespace, None).await?;
        let live = if may_beat {
            agents.heartbeat(namespace, session_id, &cx.caller.username).await
        } else {
            agents.role(namespace, session_id).await
        };
        match live {
            Ok(live) => {
                let master = if live.preempted && !live.is_master {
                    agents.routing(namespace, &live.project_id, None).await?.master
                } else {
                    None
                };
                // Only a call that heartbeats takes the nudges: a reader's does not.
                let nudges = if may_beat {
                    agents.take_nudges(namespace, session_id, &cx.caller.username).await?
                } else {
                    Vec::new()
                };
                Ok(SessionState { role: Some(role_of(&live)), you_were_preempted: live.preempted, master, nudges })
            }
            Err(AgentError::NotRegistered(_)) => Ok(SessionState::unregistered()),
            Err(e) => Err(e.into()),
        }
    }

    async fn start(&self, args: StartArgs, cx: &CallContext<'_>) -> Result<Answer, ApiError> {
        check_identifier("project_id", &args.project_id, PROJECT_ID_MAX)?;
        if let Some(s) = &args.session_id {
            check_identifier("session_id", s, SESSION_ID_MAX)?;
        }
        let namespace = self.authorize(ToolName::Start, args.namespace, cx).await?;
        // The argument always wins over what the client's name suggests.
        let surface = args.agent_surface.unwrap_or_else(|| surface_of_client(cx.client_name().as_deref()));
        let session_id = args.session_id.unwrap_or_else(|| Uuid::new_v4().to_string());
        let done =
            self.state.agents.register(&namespace, &args.project_id, &session_id, surface, &cx.caller.username).await?;
        let role = done.registration.role;
        let summary = format!(
            "You are {} of project {} (term {}) in namespace {namespace}. Your session_id is {session_id}: pass it to every later prism call.",
            if done.is_master { "master" } else { "a peer" },
            done.project_id,
            done.term
        );
        let session = SessionState {
            role: Some(role),
            you_were_preempted: done.you_were_preempted,
            master: done.routing.master.clone(),
            // The register that wrote a nudge (a context switch) does not deliver it:
            // the session's next call does.
            nudges: Vec::new(),
        };
        Ok(Answer {
            content: json!({
                "session_id": session_id,
                "registration": done.registration,
                "namespace": namespace,
                "project_id": done.project_id,
                "is_master": done.is_master,
                "term": done.term,
                "routing": done.routing,
            }),
            summary,
            session: Some(session),
        })
    }

    async fn wrap(&self, args: SessionArgs, cx: &CallContext<'_>) -> Result<Answer, ApiError> {
        check_identifier("session_id", &args.session_id, SESSION_ID_MAX)?;
        let namespace = self.authorize(ToolName::Wrap, args.namespace, cx).await?;
        let agents = &self.state.agents;
        let row = agents.live_session(&namespace, &args.session_id).await?;
        let routing = agents.release(&row, &cx.caller.username).await?;
        let summary = format!(
            "Session {} left project {}; master now: {}.",
            args.session_id,
            routing.project_id,
            routing.master.as_ref().map_or("none".to_string(), |m| m.name.clone())
        );
        let session = SessionState {
            role: Some(Role::Released),
            you_were_preempted: row.row.preempted,
            master: routing.master.clone(),
            nudges: Vec::new(),
        };
        Ok(Answer {
            content: json!({"session_id": args.session_id, "released": [row.row.id], "routing": routing}),
            summary,
            session: Some(session),
        })
    }

    async fn status(&self, args: StatusArgs, cx: &CallContext<'_>) -> Result<Answer, ApiError> {
        check_identifier("project_id", &args.project_id, PROJECT_ID_MAX)?;
        if let Some(s) = &args.session_id {
            check_identifier("session_id", s, SESSION_ID_MAX)?;
        }
        let namespace = self.authorize(ToolName::Status, args.namespace, cx).await?;
        let session = match &args.session_id {
            Some(s) => Some(self.touch(&namespace, s, cx).await?),
            None => None,
        };
        let routing = self.state.agents.routing(&namespace, &args.project_id, args.session_id.as_deref()).await?;
        let summary = format!(
            "Project {} in {namespace}: term {}, master {}, {} peer(s).",
            routing.project_id,
            routing.term,
            routing.master.as_ref().map_or("none".to_string(), |m| m.name.clone()),
            routing.peers.len()
        );
        let content = serde_json::to_value(&routing).map_err(|e| ApiError::internal("mcp: status", e))?;
        Ok(Answer { content, summary, session })
    }

    async fn heartbeat(&self, args: SessionArgs, cx: &CallContext<'_>) -> Result<Answer, ApiError> {
        check_identifier("session_id", &args.session_id, SESSION_ID_MAX)?;
        let namespace = self.authorize(ToolName::Heartbeat, args.namespace, cx).await?;
        self.state.metrics.heartbeats.inc();
        let live = self.state.agents.heartbeat(&namespace, &args.session_id, &cx.caller.username).await?;
        let reply = HeartbeatReply::from(&live);
        let master = if live.preempted && !live.is_master {
            self.state.agents.routing(&namespace, &live.project_id, None).await?.master
        } else {
            None
        };
        let summary = format!(
            "You are {} of project {} (term {}).",
            if reply.is_master { "master" } else { "a peer" },
            live.project_id,
            reply.term
        );
        let nudges = self.state.agents.take_nudges(&namespace, &args.session_id, &cx.caller.username).await?;
        let content = serde_json::to_value(&reply).map_err(|e| ApiError::internal("mcp: heartbeat", e))?;
        let session =
            SessionState { role: Some(reply.role), you_were_preempted: reply.you_were_preempted, master, nudges };
        Ok(Answer { content, summary, session: Some(session) })
    }

    async fn fence(&self, args: FenceArgs, cx: &CallContext<'_>) -> Result<Answer, ApiError> {
        check_identifier("project_id", &args.project_id, PROJECT_ID_MAX)?;
        if let Some(s) = &args.session_id {
            check_identifier("session_id", s, SESSION_ID_MAX)?;
        }
        let namespace = self.authorize(ToolName::Fence, args.namespace, cx).await?;
        // The term first: a refused call (stale_term) changes nothing, not even a heartbeat.
        let Some(master) = self.state.agents.fence(&namespace, &args.project_id, args.term).await? else {
            return Err(ApiError::conflict(
                "stale_term",
                format!("term {} is not the current master term of {}", args.term, args.project_id),
            ));
        };
        let session = match &args.session_id {
            Some(s) => Some(self.touch(&namespace, s, cx).await?),
            None => None,
        };
        Ok(Answer {
            summary: format!("Term {} is the current master term of {}.", args.term, args.project_id),
            content: json!({"project_id": args.project_id, "term": args.term, "master": master}),
            session,
        })
    }
}

impl PrismTools {
    /// SPEC §5.1: machine work fenced with the calling session's master term. Everything
    /// that can refuse is asked before anything changes; the heartbeat comes last.
    async fn enqueue(&self, args: EnqueueArgs, cx: &CallContext<'_>) -> Result<Answer, ApiError> {
        check_identifier("session_id", &args.session_id, SESSION_ID_MAX)?;
        check_namespace(&args.run_namespace)?;
        check_address(&args.server_instance_id, &args.component_kind).map_err(|e| ApiError::invalid(e.0))?;
        let payload = Value::Object(args.payload);
        check_jsonb("payload", &payload).map_err(|e| ApiError::invalid(e.0))?;
        if let Some(k) = &args.idempotency_key
            && !idempotency_key_ok(k)
        {
            return Err(ApiError::invalid(format!("idempotency_key must match {IDEMPOTENCY_KEY_PATTERN}")));
        }
        let namespace = self.authorize(ToolName::Enqueue, args.namespace, cx).await?;
        let live = self.state.agents.role(&namespace, &args.session_id).await?;
        if live.owner.as_deref().is_some_and(|owner| owner != cx.caller.username) {
            return Err(ApiError::from(AgentError::NotOwned(args.session_id.clone())));
        }
        if !live.is_master {
            return Err(ApiError::conflict(
                "not_master",
                format!(
                    "session {} is not master of project {}: only the master queues work",
                    args.session_id, live.project_id
                ),
            ));
        }
        let address = RunAddress { server_instance_id: args.server_instance_id, component_kind: args.component_kind };
        let new = NewJob {
            kind: args.kind,
            payload,
            max_attempts: None,
            timeout_seconds: None,
            idempotency_key: args.idempotency_key,
            fence: Some(JobFence {
                namespace: namespace.clone(),
                project_id: live.project_id.clone(),
                term: live.project_term,
            }),
        };
        let (status, job) = enqueue_as(&self.state, cx.caller, Some(&args.run_namespace), &address, &new).await?;
        let session = self.touch(&namespace, &args.session_id, cx).await?;
        let summary = format!(
            "{} job {} for {address} (kind {}), fenced with term {} of project {}: it is cancelled if you stop being master before a machine claims it.",
            if status == axum::http::StatusCode::CREATED { "Queued" } else { "Already queued:" },
            job.id,
            job.kind,
            live.project_term,
            live.project_id
        );
        let content = serde_json::to_value(&job).map_err(|e| ApiError::internal("mcp: enqueue", e))?;
        Ok(Answer { content, summary, session: Some(session) })
    }

    /// SPEC §5.1 read, authorized on the job's namespace's RunSessions before the lookup.
    async fn job(&self, args: JobArgs, cx: &CallContext<'_>) -> Result<Answer, ApiError> {
        let id = Uuid::parse_str(&args.job_id).map_err(|_| ApiError::invalid("job_id must be a uuid"))?;
        check_namespace(&args.run_namespace)?;
        if let Some(s) = &args.session_id {
            check_identifier("session_id", s, SESSION_ID_MAX)?;
        }
        self.state.auth.authorize(cx.caller, "get", "runsessions", &args.run_namespace).await?;
        let session = match &args.session_id {
            Some(s) => {
                let namespace = self.authorize(ToolName::Job, args.namespace, cx).await?;
                Some(self.touch(&namespace, s, cx).await?)
            }
            None => None,
        };
        let Some(job) = self.state.registry.job(&args.run_namespace, id).await? else {
            return Err(ApiError::not_found(
                "job_not_found",
                format!("no job {id} in namespace {}", args.run_namespace),
            ));
        };
        let summary = format!(
            "Job {} ({} for {}/{}) is {} after {} of {} attempt(s){}.",
            job.id,
            job.kind,
            job.server_instance_id,
            job.component_kind,
            job.state,
            job.attempts,
            job.max_attempts,
            job.last_error.as_deref().map(|e| format!("; last error: {e}")).unwrap_or_default()
        );
        let content = serde_json::to_value(&job).map_err(|e| ApiError::internal("mcp: job", e))?;
        Ok(Answer { content, summary, session })
    }
}

impl ServerHandler for PrismTools {
    fn get_info(&self) -> InitializeResult {
        // Resources: the routing tables, with subscriptions (SPEC §11); their list never
        // changes shape, so no list_changed.
        let capabilities =
            ServerCapabilities::builder().enable_tools().enable_resources().enable_resources_subscribe().build();
        let mut info = InitializeResult::new(capabilities).with_instructions(INSTRUCTIONS);
        info.server_info = Implementation::new("prism-operator", env!("CARGO_PKG_VERSION"));
        info
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(ToolName::ALL.iter().map(|t| t.definition()).collect()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        ToolName::parse(name).map(ToolName::definition)
    }

    async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        let (caller, parts) = authenticated(&context)?;
        let namespace = resolve_namespace(None, namespace_header(&parts.headers), caller).ok();
        let cursor = request.as_ref().and_then(|r| r.cursor.as_deref());
        resources::list(&self.state, caller, namespace, cursor).await.map_err(|e| resources::rpc_error(&e))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        Ok(resources::templates())
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let (caller, _) = authenticated(&context)?;
        let result = resources::read(&self.state, caller, &request.uri).await.map_err(|e| resources::rpc_error(&e))?;
        Ok(result.into())
    }

    fn accepted_subscription_filter(&self, requested: &SubscriptionFilter) -> Option<SubscriptionFilter> {
        Some(resources::accepted(requested))
    }

    async fn listen(&self, context: SubscriptionContext) -> Result<(), ErrorData> {
        let (caller, parts) = authenticated(context.request_context())?;
        let follower = Follower {
            caller: caller.clone(),
            headers: crate::watch::auth_headers(&parts.headers),
            peer: peer_of(parts),
        };
        // Read by the gate before rmcp acknowledged the listen; none if it could not be.
        let baseline = parts.extensions.get::<resources::Baseline>().cloned().unwrap_or_default();
        resources::listen(self.state.clone(), follower, baseline, context).await
    }

    // rmcp marks these legacy-only (2026-07-28 has `listen`); SPEC §11 serves both.
    #[allow(deprecated)]
    async fn subscribe(
        &self,
        request: SubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let (caller, parts) = authenticated(&context)?;
        let session = parts.extensions.get::<SessionFacts>();
        subscriptions::subscribe(&self.state, caller, session, &request.uri).await.map_err(|e| resources::rpc_error(&e))
    }

    #[allow(deprecated)]
    async fn unsubscribe(
        &self,
        request: UnsubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let (_, parts) = authenticated(&context)?;
        let session = parts.extensions.get::<SessionFacts>();
        subscriptions::unsubscribe(&self.state, session, &request.uri).await.map_err(|e| resources::rpc_error(&e))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let Some(tool) = ToolName::parse(&request.name) else {
            return Err(ErrorData::invalid_params(
                Cow::Owned(format!("unknown tool {:?}; the tools are {}", request.name, tool_names())),
                None,
            ));
        };
        let (caller, parts) = authenticated(&context)?;
        let cx = CallContext {
            caller,
            namespace_header: namespace_header(&parts.headers),
            meta: &context.meta,
            session: parts.extensions.get::<SessionFacts>(),
        };
        Ok(CallToolResponse::Complete(self.complete(tool, request.arguments, &cx, Via::Sdk).await))
    }
}

/// The caller the gate authenticated, and the HTTP request it came with.
fn authenticated(context: &RequestContext<RoleServer>) -> Result<(&Caller, &axum::http::request::Parts), ErrorData> {
    let parts = context.extensions.get::<axum::http::request::Parts>();
    match parts.and_then(|p| p.extensions.get::<Caller>().map(|c| (c, p))) {
        Some(found) => Ok(found),
        // The gate authenticates every request before rmcp sees it.
        None => Err(ErrorData::internal_error("the request reached the tools unauthenticated", None)),
    }
}

pub(super) fn namespace_header(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers.get(NAMESPACE_HEADER).and_then(|v| v.to_str().ok())
}

fn peer_of(parts: &axum::http::request::Parts) -> Option<std::net::IpAddr> {
    parts.extensions.get::<axum::extract::ConnectInfo<std::net::SocketAddr>>().map(|c| c.0.ip())
}

fn tool_names() -> String {
    ToolName::ALL.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(username: &str) -> Caller {
        Caller::new(username.into(), None, vec![], Default::default())
    }

    #[test]
    fn client_names_map_to_surfaces() {
        assert_eq!(surface_of_client(Some("claude-code")), AgentSurface::ClaudeCode);
        assert_eq!(surface_of_client(Some("codex-mcp-client")), AgentSurface::Codex);
        assert_eq!(surface_of_client(Some("cursor-vscode")), AgentSurface::Cursor);
        assert_eq!(surface_of_client(Some("claude-ai")), AgentSurface::ClaudeDesktop);
        assert_eq!(surface_of_client(Some("mcp")), AgentSurface::Other);
        assert_eq!(surface_of_client(None), AgentSurface::Other);
    }

    #[test]
    fn the_namespace_comes_from_argument_header_or_service_account() {
        let sa = caller("system:serviceaccount:agents:claude");
        assert_eq!(resolve_namespace(Some("a".into()), Some("b"), &sa).expect("ns"), "a");
        assert_eq!(resolve_namespace(None, Some("b"), &sa).expect("ns"), "b");
        assert_eq!(resolve_namespace(None, None, &sa).expect("ns"), "agents");
        assert_eq!(resolve_namespace(None, None, &caller("alice")).expect_err("none").code, "namespace_required");
        assert_eq!(resolve_namespace(Some("Not_A_NS".into()), None, &sa).expect_err("bad").code, "invalid_request");
    }

    #[test]
    fn every_tool_has_an_object_schema_and_tells_the_model_about_session_id() {
        for tool in ToolName::ALL {
            let def = tool.definition();
            assert_eq!(def.name, tool.as_str());
            assert_eq!(def.input_schema.get("type"), Some(&json!("object")));
            assert_eq!(ToolName::parse(tool.as_str()), Some(tool));
            let text = serde_json::to_string(&def).expect("json");
            assert!(text.contains("session_id"), "{text}");
        }
        assert!(ToolName::Start.definition().description.unwrap_or_default().contains("ONCE per task"));
        assert_eq!(ToolName::parse("prism_nope"), None);
    }

    #[test]
    fn bad_arguments_are_invalid_requests_naming_the_field() {
        let args = |v: Value| match v {
            Value::Object(m) => Some(m),
            _ => None,
        };
        let e = arguments::<StartArgs>(ToolName::Start, args(json!({"project_id": 5}))).err().expect("error");
        assert_eq!(e.code, "invalid_request");
        assert!(e.message.contains("project_id"), "{}", e.message);
        let e = arguments::<StartArgs>(ToolName::Start, args(json!({}))).err().expect("error");
        assert!(e.message.contains("project_id"), "{}", e.message);
        let e = arguments::<StartArgs>(ToolName::Start, args(json!({"project_id": "p", "agent_surface": "emacs"})))
            .err()
            .expect("error");
        assert!(e.message.contains("agent_surface"), "{}", e.message);
        assert!(arguments::<StartArgs>(ToolName::Start, args(json!({"project_id": "p", "extra": 1}))).is_err());
    }

    #[test]
    fn a_preempted_peer_is_told_first_and_the_fields_sit_at_the_top() {
        let master = RouteEntry {
            id: Uuid::nil(),
            namespace: "ns".into(),
            name: "desk".into(),
            session_id: "s-desk".into(),
            agent_surface: AgentSurface::ClaudeDesktop,
            role: Role::Master,
            registered_at: chrono::DateTime::UNIX_EPOCH,
            last_heartbeat: chrono::DateTime::UNIX_EPOCH,
        };
        let result = render(Answer {
            content: json!({"term": 2}),
            summary: "You are a peer.".into(),
            session: Some(SessionState {
                role: Some(Role::Peer),
                you_were_preempted: true,
                master: Some(master),
                nudges: Vec::new(),
            }),
        });
        let structured = result.structured_content.clone().expect("structured");
        assert_eq!(structured["role"], "Peer");
        assert_eq!(structured["you_were_preempted"], true);
        let text =
            serde_json::to_value(&result.content[0]).expect("json")["text"].as_str().unwrap_or_default().to_string();
        assert!(text.starts_with("You were preempted: desk (session s-desk, claude_desktop)"), "{text}");
        let error = tool_error(&ApiError::not_owned("s"));
        assert_eq!(error.is_error, Some(true));
        assert!(error.structured_content.is_none(), "no outputSchema admits an error object");
        let text =
            serde_json::to_value(&error.content[0]).expect("json")["text"].as_str().unwrap_or_default().to_string();
        let body: Value = serde_json::from_str(&text).expect("the text is the error JSON");
        assert_eq!(body["error"]["code"], "session_not_owned");
    }
}

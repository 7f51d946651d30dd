//! `/mcp` end to end with a client nobody here wrote: the official MCP Python SDK
//! (`mcp` from PyPI, pinned, installed by scripts/mcp-sdk) drives the seed's smoke
//! scenarios over Streamable HTTP in both protocol generations (the initialize handshake
//! with Mcp-Session-Id, and the stateless 2026-07-28 revision) against real operator
//! processes, a real kube-apiserver and Postgres; this file asserts on what the SDK saw
//! and on the database and the resources.

use prism_testkit as support;

use std::time::Duration;

use kube::Api;
use prism_operator::crd::ControllerRegistration;
use serde_json::{Value, json};
use support::{Operator, TestDb, control_plane, eventually};

const MODES: [&str; 2] = ["legacy", "modern"];

/// Runs one scenario of tests/mcp/scenarios.py and returns what it printed.
async fn scenario(name: &str, mode: &str, url: &str, token: &str, extra: &[(&str, &str)]) -> Value {
    support::mcp_scenario(name, mode, url, token, extra).await
}

/// A tool answer that is not an error: its structured content.
fn ok<'a>(answer: &'a Value, what: &str) -> &'a Value {
    assert_eq!(answer["is_error"], false, "{what}: {answer:#}");
    &answer["structured"]
}

/// The code of a tool error.
fn tool_error_code(answer: &Value) -> &str {
    assert_eq!(answer["is_error"], true, "expected a tool error: {answer:#}");
    // SPEC §9: the error JSON is the text; structuredContent would fail a client's
    // outputSchema check (the TypeScript SDK's) and hide the code.
    assert!(answer["structured"].is_null(), "a tool error carries no structuredContent: {answer:#}");
    answer["error"]["code"].as_str().unwrap_or_default()
}

async fn registrations(db: &TestDb, ns: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM controller_registrations WHERE namespace = $1")
        .bind(ns)
        .fetch_one(&db.pool)
        .await
        .expect("count registrations")
}

/// (released_at, last_heartbeat, is_master) of a session's newest registration.
async fn session_row(
    db: &TestDb,
    ns: &str,
    session: &str,
) -> (Option<chrono::DateTime<chrono::Utc>>, chrono::DateTime<chrono::Utc>, bool) {
    sqlx::query_as(
        "SELECT released_at, last_heartbeat, is_master FROM controller_registrations
         WHERE namespace = $1 AND session_id = $2 ORDER BY registered_at DESC LIMIT 1",
    )
    .bind(ns)
    .bind(session)
    .fetch_one(&db.pool)
    .await
    .expect("session row")
}

/// Two replicas (leader election on, pods `<pod>-a` and `<pod>-b`) on one database.
async fn two_replicas(db: &TestDb, ns: &str, pod: &str) -> (Operator, Operator) {
    two_replicas_with(db, ns, pod, &[]).await
}

async fn two_replicas_with(db: &TestDb, ns: &str, pod: &str, env: &[(&str, &str)]) -> (Operator, Operator) {
    let cp = control_plane().await;
    let start = |name: String| async move {
        let mut all = vec![("PRISM_LEADER_ELECTION", "true"), ("POD_NAME", name.as_str())];
        all.extend_from_slice(env);
        Operator::start(cp, &db.url, ns, &all).await
    };
    (start(format!("{pod}-a")).await, start(format!("{pod}-b")).await)
}

fn mcp_url(op: &Operator) -> String {
    op.url("/mcp")
}

async fn smoke_in(mode: &str) {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, &format!("mcp-{mode}")).await;
    let db = TestDb::new().await;
    let op = Operator::start(
        cp,
        &db.url,
        &ns,
        &[("PRISM_SWEEP_INTERVAL_SECONDS", "1"), ("PRISM_CONTROLLER_PEER_STALE_MINUTES", "5")],
    )
    .await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;
    let project = "PID-MCP";
    let out = scenario("smoke", mode, &mcp_url(&op), &token, &[("namespace", &ns), ("project", project)]).await;

    let version = if mode == "legacy" { "2025-11-25" } else { "2026-07-28" };
    for (tool, hints) in out["tool_hints"].as_object().expect("tool hints") {
        let read_only = matches!(tool.as_str(), "prism_status" | "prism_job");
        let idempotent = tool != "prism_enqueue";
        assert_eq!(
            hints,
            &json!({"read_only": read_only, "destructive": false, "idempotent": idempotent, "output_schema": "object"}),
            "{tool}"
        );
    }
    assert_eq!(out["protocol_versions"], json!([version, version, version]), "{mode}");
    assert_eq!(
        out["tools"],
        json!([
            "prism_enqueue",
            "prism_fence",
            "prism_heartbeat",
            "prism_job",
            "prism_start",
            "prism_status",
            "prism_wrap"
        ])
    );
    let sessions = &out["sessions"];
    let (s_code, s_codex, s_desk) = (
        sessions["code"].as_str().expect("s"),
        sessions["codex"].as_str().expect("s"),
        sessions["desk"].as_str().expect("s"),
    );
    assert!(uuid::Uuid::parse_str(s_code).is_ok(), "prism_start mints a uuid session_id: {s_code}");

    // (1) Fresh start: master in term 1, the surface from clientInfo.name.
    let start = ok(&out["code_start"], "code start");
    assert_eq!(start["role"], "Master");
    assert_eq!(start["is_master"], true);
    assert_eq!(start["term"], 1);
    assert_eq!(start["you_were_preempted"], false);
    assert_eq!(start["namespace"], ns.as_str());
    assert_eq!(start["project_id"], project);
    assert_eq!(start["registration"]["agent_surface"], "claude_code");
    assert_eq!(start["routing"]["master"]["session_id"], s_code);
    assert!(out["code_start"]["text"].as_str().unwrap_or_default().contains(s_code), "the text names the session_id");
    // (2) A second non-desktop session is a peer.
    let codex = ok(&out["codex_start"], "codex start");
    assert_eq!(codex["role"], "Peer");
    assert_eq!(codex["registration"]["agent_surface"], "codex");
    // (3) A desktop preempts; the old master's next call says so, naming the new master.
    let desk = ok(&out["desk_start"], "desk start");
    assert_eq!((desk["role"].as_str(), desk["term"].as_i64()), (Some("Master"), Some(2)));
    assert_eq!(desk["registration"]["agent_surface"], "claude_desktop");
    let desk_name = desk["registration"]["name"].as_str().expect("name");
    let told = ok(&out["code_after_preemption"], "heartbeat after preemption");
    assert_eq!(told, &json!({"role": "Peer", "is_master": false, "term": 2, "you_were_preempted": true, "nudges": []}));
    let text = out["code_after_preemption"]["text"].as_str().unwrap_or_default();
    assert!(text.starts_with(&format!("You were preempted: {desk_name} (session {s_desk}")), "{text}");
    // Status shape (SPEC §6), with D6's fields on top.
    let status = ok(&out["status"], "status");
    for key in ["project_id", "namespace", "term", "master", "peers", "stale", "caller", "role", "you_were_preempted"] {
        assert!(status.get(key).is_some(), "status has {key}: {status:#}");
    }
    assert_eq!(status["term"], 2);
    assert_eq!(status["master"]["session_id"], s_desk);
    assert_eq!(status["peers"].as_array().map(Vec::len), Some(2));
    assert_eq!(status["caller"]["session_id"], s_codex);
    assert_eq!((status["role"].as_str(), status["you_were_preempted"].as_bool()), (Some("Peer"), Some(false)));
    for key in ["id", "namespace", "name", "session_id", "agent_surface", "role", "registered_at", "last_heartbeat"] {
        assert!(status["master"].get(key).is_some(), "entry has {key}");
    }
    // Fencing.
    assert_eq!(ok(&out["fence_current"], "fence")["master"]["session_id"], s_desk);
    assert_eq!(tool_error_code(&out["fence_stale"]), "stale_term");
    // (4) The desktop wraps: the earliest non-desktop peer is master at once, term 3.
    let wrap = ok(&out["desk_wrap"], "wrap");
    assert_eq!(wrap["released"], json!([desk["registration"]["id"]]));
    assert_eq!(wrap["role"], "Released");
    assert_eq!(wrap["routing"]["master"]["session_id"], s_code);
    assert_eq!(wrap["routing"]["term"], 3);
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    eventually(10, "the wrapped resource is deleted", || async {
        api.get_opt(desk_name).await.ok()?.is_none().then_some(())
    })
    .await;
    // (5) Context switch: codex leaves PID-MCP (wrap_session nudge) and masters PID-MCP-B.
    let switch = ok(&out["codex_switch"], "context switch");
    assert_eq!((switch["role"].as_str(), switch["project_id"].as_str()), (Some("Master"), Some("PID-MCP-B")));
    let (kind, payload): (String, Value) =
        sqlx::query_as("SELECT kind, payload FROM nudges WHERE namespace = $1 AND session_id = $2")
            .bind(&ns)
            .bind(s_codex)
            .fetch_one(&db.pool)
            .await
            .expect("wrap_session nudge");
    assert_eq!((kind.as_str(), payload["reason"].as_str()), ("wrap_session", Some("context_switch")));
    // A status call with the session_id is its heartbeat: last_heartbeat moved.
    assert_eq!(ok(&out["code_status_beat"], "status beat")["role"], "Master");
    let registered: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT registered_at FROM controller_registrations WHERE namespace = $1 AND session_id = $2 AND released_at IS NULL",
    )
    .bind(&ns)
    .bind(s_code)
    .fetch_one(&db.pool)
    .await
    .expect("registered_at");
    let (_, beat, _) = session_row(&db, &ns, s_code).await;
    assert!(beat - registered >= chrono::TimeDelta::milliseconds(1000), "heartbeat moved: {registered} -> {beat}");
    // Sessions started over MCP are resources like any other.
    eventually(10, "kubectl shows both masters", || async {
        let listed = cp.kubectl_ok(&["get", "creg", "-n", &ns, "--no-headers"]).await;
        (listed.lines().filter(|l| l.contains("Master")).count() == 2).then_some(())
    })
    .await;

    // Another identity using a session_id of the first: refused, nothing changes.
    let intruder = support::agent_token(cp, &ns, "intruder", &["create", "delete", "get", "list"]).await;
    let before = (registrations(&db, &ns).await, session_row(&db, &ns, s_codex).await);
    let refused = scenario(
        "intruder",
        mode,
        &mcp_url(&op),
        &intruder,
        &[("namespace", &ns), ("project", "PID-MCP-B"), ("session", s_codex)],
    )
    .await;
    for call in ["heartbeat", "wrap", "start", "start_elsewhere", "status"] {
        assert_eq!(tool_error_code(&refused[call]), "session_not_owned", "{call}");
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    let after = (registrations(&db, &ns).await, session_row(&db, &ns, s_codex).await);
    assert_eq!(before, after, "nothing changed");

    // The stale sweep: code (master of PID-MCP) stops beating; released, listed as stale.
    sqlx::query(
        "UPDATE controller_registrations SET last_heartbeat = now() - interval '6 minutes'
         WHERE namespace = $1 AND session_id = $2 AND released_at IS NULL",
    )
    .bind(&ns)
    .bind(s_code)
    .execute(&db.pool)
    .await
    .expect("backdate");
    let reason: String = eventually(15, "the sweep releases the stale master", || async {
        sqlx::query_scalar(
            "SELECT release_reason FROM controller_registrations WHERE namespace = $1 AND session_id = $2 AND project_id = $3",
        )
        .bind(&ns)
        .bind(s_code)
        .bind(project)
        .fetch_optional(&db.pool)
        .await
        .ok()
        .flatten()
        .flatten()
    })
    .await;
    assert_eq!(reason, "stale_heartbeat_incident");
    let swept = scenario(
        "after_sweep",
        mode,
        &mcp_url(&op),
        &token,
        &[("namespace", &ns), ("project", project), ("session", s_code)],
    )
    .await;
    let table = ok(&swept["status"], "status after sweep");
    assert!(table["master"].is_null(), "{table:#}");
    assert_eq!(table["stale"][0]["session_id"], s_code, "{table:#}");
    assert_eq!(tool_error_code(&swept["heartbeat"]), "not_registered");
}

#[tokio::test]
async fn seed_smoke_scenarios_over_mcp_session_based_generation() {
    smoke_in("legacy").await;
}

#[tokio::test]
async fn seed_smoke_scenarios_over_mcp_stateless_2026_generation() {
    smoke_in("modern").await;
}

#[tokio::test]
async fn bad_input_and_missing_rights_are_refused_with_codes_and_change_nothing() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "mcp-bad").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;
    let reader = support::agent_token(cp, &ns, "reader", &["get", "list"]).await;
    let http = support::http();
    let post = |token: Option<&str>, body: String| {
        let mut req = http
            .post(mcp_url(&op))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "curl", "version": "1"}}})
    .to_string();

    // No token, or one the API server does not accept: 401 with the challenge.
    for (token, code) in [(None, "unauthenticated"), (Some("not-a-token"), "invalid_token")] {
        let r = post(token, init.clone()).await.expect("post");
        assert_eq!(r.status(), 401);
        assert_eq!(r.headers().get("www-authenticate").and_then(|v| v.to_str().ok()), Some("Bearer realm=\"prism\""));
        assert_eq!(r.json::<Value>().await.expect("json")["error"]["code"], code);
    }
    // A Host outside the allow-list (DNS rebinding), or a foreign browser Origin: 403.
    let r = http.post(mcp_url(&op)).header("host", "evil.example").bearer_auth(&token).body(init.clone()).send().await;
    assert_eq!(r.expect("post").status(), 403);
    let r = http.post(mcp_url(&op)).header("origin", "https://evil.example").bearer_auth(&token).body(init.clone());
    let r = r.header("content-type", "application/json").send().await.expect("post");
    assert_eq!(r.status(), 403);
    assert_eq!(r.json::<Value>().await.expect("json")["error"]["code"], "origin_not_allowed");
    // The handshake works with a token, and hands out a signed session id.
    let r = post(Some(&token), init.clone()).await.expect("post");
    assert_eq!(r.status(), 200);
    let session = r.headers().get("mcp-session-id").and_then(|v| v.to_str().ok()).map(str::to_string);
    assert!(session.as_deref().is_some_and(|s| s.starts_with("ms1.")), "{session:?}");
    // A forged session id is an unknown session.
    let r = http
        .post(mcp_url(&op))
        .bearer_auth(&token)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-session-id", "ms1.e30.AAAA")
        .body(json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}).to_string())
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 404);
    // Malformed JSON-RPC: a JSON-RPC error with a code, never a 5xx.
    for (body, code) in [
        ("{not json".to_string(), -32700),
        (json!({"jsonrpc": "2.0", "id": 7, "method": 5}).to_string(), -32600),
        ("[]".to_string(), -32600),
    ] {
        let r = post(Some(&token), body.clone()).await.expect("post");
        assert_eq!(r.status(), 400, "{body}");
        assert_eq!(r.json::<Value>().await.expect("json")["error"]["code"], code, "{body}");
    }
    let r = post(Some(&token), format!("{{\"pad\":\"{}\"}}", "x".repeat(100_000))).await.expect("post");
    assert_eq!(r.status(), 413);

    for mode in MODES {
        let bad = scenario("bad_input", mode, &mcp_url(&op), &token, &[("namespace", &ns), ("project", "P")]).await;
        for call in [
            "wrong_type",
            "unknown_surface",
            "missing_project",
            "huge_project",
            "unknown_argument",
            "bad_namespace",
            "term_as_text",
        ] {
            assert_eq!(tool_error_code(&bad[call]), "invalid_request", "{mode} {call}: {:#}", bad[call]);
        }
        assert_eq!(tool_error_code(&bad["unknown_session"]), "not_registered", "{mode}");
        assert_eq!(bad["unknown_tool"]["rpc_error"]["code"], -32602, "{mode}: {:#}", bad["unknown_tool"]);
        // A token without the rights: a tool error `forbidden`.
        let refused =
            scenario("forbidden", mode, &mcp_url(&op), &reader, &[("namespace", &ns), ("project", "P")]).await;
        assert_eq!(tool_error_code(&refused["start"]), "forbidden", "{mode}");
        assert_eq!(tool_error_code(&refused["wrap"]), "forbidden", "{mode}");
    }
    let listed = cp.kubectl_ok(&["get", "creg", "-n", &ns, "-o", "wide"]).await;
    assert!(listed.trim().is_empty(), "no resource was created: {listed}");
    assert_eq!(registrations(&db, &ns).await, 0, "no row was written");
}

/// The gate answers a plain `tools/call` itself (issue 23: rmcp's stateless service cost
/// a service, a serve loop and two tasks per call). Its answer on the wire is the SDK's:
/// the same call with an `Accept` the gate leaves to the SDK (a `q=` parameter) gets the
/// same status, headers, envelope and result, in both generations; a call the SDK would
/// refuse (a standard header that does not match) is still the SDK's refusal; the counter
/// says which path answered.
#[tokio::test]
async fn the_gates_direct_answer_is_the_sdks_answer() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "mcp-direct").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;
    support::register(&op, &token, &ns, "PID-DIRECT", "s-direct", "claude_code").await;
    let http = support::http();
    const PLAIN: &str = "application/json, text/event-stream";
    const WEIGHTED: &str = "application/json;q=1, text/event-stream;q=0.9";
    let call = |modern: bool, accept: &'static str, name: &'static str, tool: &'static str| {
        let mut params = json!({"name": tool, "arguments": {"namespace": ns, "session_id": "s-direct"}});
        let mut req = http.post(mcp_url(&op)).bearer_auth(&token).header("accept", accept);
        if modern {
            params["_meta"] = json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {},
                "io.modelcontextprotocol/clientInfo": {"name": "cursor-vscode", "version": "1"}});
            req = req
                .header("mcp-protocol-version", "2026-07-28")
                .header("mcp-method", "tools/call")
                .header("mcp-name", name);
        } else {
            req = req.header("mcp-protocol-version", "2025-11-25");
        }
        let req = req.json(&json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": params}));
        async move {
            let r = req.send().await.expect("POST /mcp");
            let status = r.status().as_u16();
            let content_type = r.headers().get("content-type").and_then(|v| v.to_str().ok()).map(str::to_string);
            let body: Value = r.json().await.expect("a JSON answer");
            (status, content_type, body)
        }
    };
    for modern in [false, true] {
        let direct = call(modern, PLAIN, "prism_heartbeat", "prism_heartbeat").await;
        let sdk = call(modern, WEIGHTED, "prism_heartbeat", "prism_heartbeat").await;
        assert_eq!(direct.0, 200, "modern={modern}: {:#}", direct.2);
        assert_eq!(direct.2["result"]["isError"], false, "{:#}", direct.2);
        assert_eq!(direct.2["result"]["structuredContent"]["role"], "Master", "{:#}", direct.2);
        assert_eq!(direct, sdk, "modern={modern}: the direct answer differs from the SDK's");
        // What the SDK refuses, the gate leaves to it: a name header for another tool.
        if modern {
            let (status, _, body) = call(true, PLAIN, "prism_status", "prism_heartbeat").await;
            assert_eq!(status, 400, "{body:#}");
            assert_eq!(body["error"]["code"], -32020, "{body:#}");
        }
        // An unknown tool: the SDK's JSON-RPC error, whichever path the headers ask for.
        let unknown = call(modern, PLAIN, "prism_nope", "prism_nope").await;
        assert_eq!(unknown, call(modern, WEIGHTED, "prism_nope", "prism_nope").await);
        assert_eq!(unknown.2["error"]["code"], -32602, "{:#}", unknown.2);
    }
    // A field the direct path does not read (here an unknown one) leaves the call to the
    // SDK, which answers it as the direct path answers the plain call.
    let plain = call(false, PLAIN, "prism_heartbeat", "prism_heartbeat").await;
    let extra = http
        .post(mcp_url(&op))
        .bearer_auth(&token)
        .header("accept", PLAIN)
        .header("mcp-protocol-version", "2025-11-25")
        .json(&json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "x-trace": "t1", "params": {
            "name": "prism_heartbeat", "arguments": {"namespace": ns, "session_id": "s-direct"}}}))
        .send()
        .await
        .expect("POST /mcp");
    let status = extra.status().as_u16();
    let content_type = extra.headers().get("content-type").and_then(|v| v.to_str().ok()).map(str::to_string);
    assert_eq!((status, content_type, extra.json::<Value>().await.expect("a JSON answer")), plain);
    let counted = |via: &'static str| support::metric_value(&op, "prism_mcp_tool_calls_total", via);
    assert_eq!(counted("tool=\"prism_heartbeat\",via=\"direct\"").await, 3.0);
    assert_eq!(counted("tool=\"prism_heartbeat\",via=\"sdk\"").await, 3.0);
}

#[tokio::test]
async fn two_replicas_answer_one_client_alternately() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "mcp-ha").await;
    let db = TestDb::new().await;
    let (a, b) = two_replicas(&db, &ns, "mcp-replica").await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;
    let urls = format!("{},{}", mcp_url(&a), mcp_url(&b));
    for (i, mode) in MODES.into_iter().enumerate() {
        // No namespace argument: the ServiceAccount's own namespace (SPEC §9).
        let project = format!("PID-HA-{i}");
        let out = scenario("replicas", mode, &urls, &token, &[("project", &project)]).await;
        let started = ok(&out["start"], "start");
        assert_eq!(started["namespace"], ns.as_str());
        // clientInfo.name maps the surface whichever replica the call reached.
        assert_eq!(started["registration"]["agent_surface"], "cursor", "{mode}");
        for beat in out["heartbeats"].as_array().expect("heartbeats") {
            assert_eq!(ok(beat, "heartbeat")["role"], "Master", "{mode}");
        }
        assert_eq!(ok(&out["status"], "status")["caller"]["session_id"], started["session_id"]);
        let calls: Vec<&Value> =
            out["http_log"].as_array().expect("log").iter().filter(|c| c["rpc"] == "tools/call").collect();
        let ports: std::collections::BTreeSet<i64> = calls.iter().filter_map(|c| c["port"].as_i64()).collect();
        assert_eq!(ports.len(), 2, "{mode}: tool calls reached both replicas: {:#}", out["http_log"]);
        assert!(calls.iter().all(|c| c["status"] == 200), "{mode}: {:#}", out["http_log"]);
        if mode == "legacy" {
            // One Mcp-Session-Id, issued by one replica, honoured by both.
            let ids: std::collections::BTreeSet<&str> = calls.iter().filter_map(|c| c["session"].as_str()).collect();
            assert_eq!(ids.len(), 1, "{:#}", out["http_log"]);
            assert_eq!(calls.iter().filter(|c| c["session"].is_string()).count(), calls.len());
        }
    }
}

/// SPEC §9's namespace rule for a person's token (no ServiceAccount namespace): a call
/// without a namespace argument or header is refused with `namespace_required` and
/// writes nothing; the `X-Prism-Namespace` header places it.
#[tokio::test]
async fn a_persons_token_needs_a_namespace() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "mcp-person").await;
    let db = TestDb::new().await;
    // A person's token (OIDC on a real cluster, a static token here) is valid for the API
    // server's audience only: accepting it is the explicit opt-in of SPEC §12.
    let audiences = format!("{},{}", support::AGENT_AUDIENCE, support::API_SERVER_AUDIENCE);
    let op = Operator::start(cp, &db.url, &ns, &[("PRISM_TOKEN_AUDIENCES", audiences.as_str())]).await;
    let token = support::person_token(cp, &ns, &["create", "delete", "get", "list"]).await;
    for (i, mode) in MODES.into_iter().enumerate() {
        let project = format!("PID-PERSON-{i}");
        let out =
            scenario("person", mode, &mcp_url(&op), &token, &[("namespace-header", &ns), ("project", &project)]).await;
        assert_eq!(tool_error_code(&out["unplaced"]), "namespace_required", "{mode}: {:#}", out["unplaced"]);
        let placed = ok(&out["placed"], "with X-Prism-Namespace");
        assert_eq!((placed["role"].as_str(), placed["namespace"].as_str()), (Some("Master"), Some(ns.as_str())));
        assert_eq!(placed["registration"]["agent_surface"], "claude_code");
    }
    assert_eq!(registrations(&db, &ns).await, 2, "one registration per placed start, none for the refused ones");
}

/// The chart's allow-list value: rendered with the Service's names, refused at install
/// when it is not a host, and admitting those names at a real operator.
#[tokio::test]
async fn the_charts_allow_list_admits_its_service_names() {
    let helm = |args: &[&str]| {
        let tmp = std::env::temp_dir().join(format!("prism-helm-{}", uuid::Uuid::new_v4().simple()));
        let out = std::process::Command::new(support::assets_dir().join("helm"))
            .args(["template", "prism", support::repo_root().join("charts/prism-operator").to_str().expect("utf-8")])
            .args(["--namespace", "prism-system", "--show-only", "templates/deployment.yaml"])
            .args(args)
            .env("HELM_CACHE_HOME", tmp.join("cache"))
            .env("HELM_CONFIG_HOME", tmp.join("config"))
            .output()
            .expect("helm template");
        let _ = std::fs::remove_dir_all(&tmp);
        out
    };
    let out = helm(&["--set", "mcp.allowedHosts={prism.example.com,10.1.2.3:30080}"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let deployment: Value = serde_yaml::from_slice(&out.stdout).expect("yaml");
    let env = deployment["spec"]["template"]["spec"]["containers"][0]["env"].as_array().expect("env").clone();
    let hosts = env.iter().find(|e| e["name"] == "PRISM_MCP_ALLOWED_HOSTS").expect("PRISM_MCP_ALLOWED_HOSTS")["value"]
        .as_str()
        .expect("value")
        .to_string();
    for want in [
        "localhost",
        "127.0.0.1",
        "prism-prism-operator",
        "prism-prism-operator.prism-system.svc",
        "prism-prism-operator.prism-system.svc.cluster.local",
        "prism.example.com",
        "10.1.2.3:30080",
    ] {
        assert!(hosts.split(',').any(|h| h == want), "{want} in {hosts}");
    }
    let bad = helm(&["--set", "mcp.allowedHosts={https://prism.example.com/}"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("schema"));

    // The rendered list at a real operator: the Service's name passes, others do not.
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "mcp-hosts").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[("PRISM_MCP_ALLOWED_HOSTS", &hosts)]).await;
    let http = support::http();
    for (host, status) in [
        ("prism-prism-operator.prism-system.svc:8080", 401),
        ("prism.example.com", 401),
        ("10.1.2.3:30080", 401),
        ("10.1.2.3:8080", 403),
        ("attacker.example", 403),
    ] {
        let r = http.post(mcp_url(&op)).header("host", host).body("{}").send().await.expect("post");
        // 401: past the allow-list, stopped at the (missing) token.
        assert_eq!(r.status(), status, "{host}");
    }
}

/// SPEC §11 over MCP, both generations, two replicas behind one client: the routing
/// table is a resource (template, list, read); a desktop's preemption is notified
/// (`resources/subscribe` + the session's GET stream; `subscriptions/listen`) and the
/// resource then reads the new master; bad URIs and an identity without rights are
/// refused with their codes; a session follows at most 32 resources, and its
/// subscriptions go with it. A preemption made the moment the subscribe or listen is
/// answered is notified too (CI once saw a listen miss one: rmcp acknowledges a listen
/// before its handler reads where the project stands).
#[tokio::test]
async fn the_routing_table_is_a_resource_and_its_changes_are_notified() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "mcp-res").await;
    let db = TestDb::new().await;
    // Each stream reads where its projects stand 0.8 s late, as a replica under load may
    // (a fail point, crates/prism-api/src/failpoints.rs): a preemption in between must still be notified.
    let slow = "mcp-listen-start=return(800);mcp-session-stream-read=return(800)";
    let (a, b) = two_replicas_with(&db, &ns, "mcp-res", &[("FAILPOINTS", slow)]).await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;
    // May watch registrations, not list them: no read of a routing table.
    let outsider = support::agent_token(cp, &ns, "outsider", &["watch"]).await;
    let urls = format!("{},{}", mcp_url(&a), mcp_url(&b));
    for (i, mode) in MODES.into_iter().enumerate() {
        let project = format!("web app/{i}");
        let uri = format!("prism://{ns}/projects/web%20app%2F{i}");
        let out = scenario(
            "resources",
            mode,
            &urls,
            &token,
            &[("namespace", &ns), ("project", &project), ("outsider-token", &outsider)],
        )
        .await;
        assert_eq!(
            out["templates"],
            json!([{"uri_template": "prism://{namespace}/projects/{project_id}", "mime": "application/json"}]),
            "{mode}"
        );
        assert!(out["listed"].as_array().expect("listed").contains(&json!(uri)), "{mode}: {:#}", out["listed"]);
        assert_eq!(out["mime"], "application/json");
        let started = ok(&out["start"], "start");
        assert_eq!(out["before"]["master"]["session_id"], started["session_id"], "{mode}");
        assert_eq!(out["before"]["project_id"], project.as_str());
        assert_eq!(out["bad_uri"]["rpc_error"]["data"]["error"]["code"], "invalid_request", "{mode}: {out:#}");
        ok(&out["desk_start"], "desk start");
        assert_eq!(out["updates"].get(0), Some(&json!(uri)), "{mode}: the preemption was notified: {out:#}");
        println!("{mode}: preemption → resource notification in {} ms", out["latency_ms"]);
        // Sent the moment the subscribe (listen) was answered: notified every time.
        let rounds = out["rounds"].as_array().expect("rounds");
        assert_eq!(rounds.len(), 5, "{mode}");
        for round in rounds {
            assert_eq!(
                round["updates"].get(0),
                Some(&round["uri"]),
                "{mode}: a preemption right after the answer: {out:#}"
            );
        }
        println!("{mode}: right after the answer: {:?} ms", rounds.iter().map(|r| &r["ms"]).collect::<Vec<_>>());
        assert_eq!(out["after"]["master"]["agent_surface"], "claude_desktop", "{mode}");
        assert_eq!(out["after"]["term"], 2, "{mode}");
        assert_eq!(out["outsider_read"]["rpc_error"]["data"]["error"]["code"], "forbidden", "{mode}: {out:#}");
        assert_eq!(out["outsider_list"]["rpc_error"]["data"]["error"]["code"], "forbidden", "{mode}");
        if mode == "legacy" {
            assert_eq!(out["outsider_subscribe"]["rpc_error"]["data"]["error"]["code"], "forbidden", "{out:#}");
            let many = out["many"].as_array().expect("many");
            assert_eq!(many.iter().filter(|r| *r == "ok").count(), 32, "{many:?}");
            assert_eq!(many.last(), Some(&json!("quota_exceeded")));
            // The SDK ends its session on exit (DELETE /mcp): its subscriptions go.
            let left: i64 = sqlx::query_scalar("SELECT count(*) FROM mcp_subscriptions")
                .fetch_one(&db.pool)
                .await
                .expect("count subscriptions");
            assert_eq!(left, 0, "the ended session's subscriptions are deleted");
        } else {
            assert_eq!(out["honored"], json!([uri]), "only project URIs are honoured");
            assert!(out["outsider_listen"]["refused"].is_string(), "{:#}", out["outsider_listen"]);
        }
    }
}

/// The official MCP conformance runner (`@modelcontextprotocol/conformance`, pinned,
/// scripts/mcp-conformance) against a real operator, in its session-based generation
/// (the runner's scenarios are written for 2025-06-18 and 2025-11-25). Every server
/// scenario that applies to this server must pass every check; the others need the
/// runner's own test server (its tools, resources and prompts), and are listed here
/// with why. The runner cannot send a credential: tests/mcp/conformance-token.cjs adds
/// the bearer token to its requests, as a client configured with the header would.
#[tokio::test]
async fn the_official_conformance_runner_passes_what_applies() {
    const APPLY: &[&str] = &[
        "server-initialize",
        "ping",
        "tools-list",
        "resources-list",
        "server-sse-multiple-streams",
        "dns-rebinding-protection",
    ];
    /// Not applicable, and why (each needs what only the runner's test server has).
    const NOT_APPLICABLE: &[(&str, &str)] = &[
        ("logging-set-level", "no logging capability: the server sends no log notifications"),
        ("completion-complete", "no completions: no prompts, and the resource template's arguments are free text"),
        ("tools-call-*", "calls the test server's tools (test_simple_text, test_image_content, ...)"),
        ("json-schema-2020-12", "lists the test server's json_schema_2020_12_tool"),
        ("elicitation-sep1034-defaults, elicitation-sep1330-enums", "the test server's elicitation tools"),
        ("server-sse-polling", "calls the test server's test_reconnection tool"),
        (
            "resources-read-text, resources-read-binary, resources-templates-read",
            "read test://static-text, test://static-binary, test://template/123/data: the test server's resources",
        ),
        (
            "resources-subscribe, resources-unsubscribe",
            "subscribe to test://watched-resource, the test server's; this server refuses a URI that is not one of its \
             prism:// resources (invalid_request), and tests/mcp.rs subscribes to its own with the SDK",
        ),
        ("prompts-*", "no prompts capability"),
    ];
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "mcp-conformance").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;
    let out = std::process::Command::new(support::repo_root().join("scripts/mcp-conformance"))
        .output()
        .expect("run scripts/mcp-conformance");
    assert!(out.status.success(), "scripts/mcp-conformance: {}", String::from_utf8_lossy(&out.stderr));
    let paths = String::from_utf8_lossy(&out.stdout).to_string();
    let mut lines = paths.lines();
    let (node, runner) = (lines.next().expect("node"), lines.next().expect("runner"));
    let preload = support::repo_root().join("tests/mcp/conformance-token.cjs");
    // The runner's DNS-rebinding scenario needs a loopback URL by name.
    let url = mcp_url(&op).replace("127.0.0.1", "localhost");
    for scenario in APPLY {
        let dir = std::env::temp_dir().join(format!("prism-conformance-{}", uuid::Uuid::new_v4()));
        let run = tokio::process::Command::new(node)
            .arg("--require")
            .arg(&preload)
            .arg(runner)
            .args(["server", "--url", &url, "--scenario", scenario, "-o"])
            .arg(&dir)
            .env("PRISM_TOKEN", &token)
            .kill_on_drop(true)
            .output();
        let run = tokio::time::timeout(Duration::from_secs(120), run).await.expect("the runner finishes").expect("run");
        let stdout = String::from_utf8_lossy(&run.stdout);
        let checks = conformance_checks(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(!checks.is_empty(), "{scenario}: no checks recorded\n{stdout}{}", String::from_utf8_lossy(&run.stderr));
        for check in &checks {
            // INFO: what the runner saw (the server's name, a request); no verdict.
            assert!(matches!(check["status"].as_str(), Some("SUCCESS" | "INFO")), "{scenario}: {check:#}\n{stdout}");
        }
        assert!(run.status.success(), "{scenario}: the runner failed\n{stdout}");
        println!("conformance {scenario}: {} checks, all SUCCESS", checks.len());
    }
    for (scenarios, why) in NOT_APPLICABLE {
        println!("conformance {scenarios}: not applicable ({why})");
    }
}

/// Every check result the runner wrote under `dir` (its `checks.json` per scenario).
fn conformance_checks(dir: &std::path::Path) -> Vec<Value> {
    let mut checks = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).expect("read results").flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.file_name().is_some_and(|n| n == "checks.json") {
                let text = std::fs::read_to_string(&path).expect("checks.json");
                let parsed: Value = serde_json::from_str(&text).expect("checks JSON");
                checks.extend(parsed.as_array().cloned().unwrap_or_default());
            }
        }
    }
    checks
}

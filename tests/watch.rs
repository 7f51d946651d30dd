//! SPEC §11 watch: a project's routing table as Server-Sent Events, read with an SSE
//! parser (`eventsource-stream`) over a plain HTTP stream, against two operator replicas
//! sharing Postgres: changes made through one reach a watch on the other at once, ids
//! resume, nudges are delivered once and only to who may take them, and a revoked
//! caller loses the stream.

use prism_testkit as support;

use std::time::Duration;

use eventsource_stream::{Event, Eventsource};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};
use support::{Operator, TestDb, control_plane};

const ALL: [&str; 4] = ["create", "delete", "get", "list"];

type Events = std::pin::Pin<Box<dyn Stream<Item = Result<Event, String>> + Send>>;

/// Opens a watch; the status and, on 200, its events.
async fn watch(
    op: &Operator,
    token: &str,
    ns: &str,
    project: &str,
    session: Option<&str>,
    last: Option<&str>,
) -> (u16, Events) {
    let mut url = format!("{}/api/v1/controller/{project}/watch?namespace={ns}", op.base);
    if let Some(s) = session {
        url.push_str(&format!("&session_id={s}"));
    }
    let mut req = support::http().get(url).bearer_auth(token);
    if let Some(id) = last {
        req = req.header("Last-Event-ID", id);
    }
    let r = req.send().await.expect("GET watch");
    let status = r.status().as_u16();
    if status == 200 {
        let ctype = r.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
        assert!(ctype.starts_with("text/event-stream"), "content-type {ctype}");
    }
    let bytes = futures::stream::unfold(r, |mut r| async move {
        match r.chunk().await {
            Ok(Some(chunk)) => Some((Ok::<_, reqwest::Error>(chunk), r)),
            _ => None,
        }
    });
    (status, Box::pin(bytes.eventsource().map(|e| e.map_err(|e| e.to_string()))))
}

/// The next event within `secs`, or None.
async fn next(events: &mut Events, secs: u64) -> Option<Event> {
    match tokio::time::timeout(Duration::from_secs(secs), events.next()).await {
        Ok(Some(Ok(event))) => Some(event),
        Ok(Some(Err(e))) => panic!("the stream broke: {e}"),
        Ok(None) | Err(_) => None,
    }
}

fn table(event: &Event) -> Value {
    assert_eq!(event.event, "routing", "{event:?}");
    serde_json::from_str(&event.data).expect("routing JSON")
}

fn master_session(t: &Value) -> Option<&str> {
    t["master"]["session_id"].as_str()
}

async fn register(op: &Operator, token: &str, ns: &str, project: &str, session: &str, surface: &str) {
    support::register(op, token, ns, project, session, surface).await;
}

#[tokio::test]
async fn a_watch_on_one_replica_sees_every_change_made_through_another_and_resumes() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "watch").await;
    let db = TestDb::new().await;
    let a = Operator::start(cp, &db.url, &ns, &[]).await;
    let b = Operator::start(cp, &db.url, &ns, &[]).await;
    let alice = support::agent_token(cp, &ns, "alice", &ALL).await;

    register(&a, &alice, &ns, "P", "s-code", "claude_code").await;
    let (status, mut events) = watch(&b, &alice, &ns, "P", None, None).await;
    assert_eq!(status, 200);
    let first = next(&mut events, 5).await.expect("the snapshot first");
    let t = table(&first);
    assert_eq!(master_session(&t), Some("s-code"));
    let first_id = first.id.clone();
    let term: i64 = first_id.split('.').next().and_then(|t| t.parse().ok()).expect("id <term>.<seq>");
    assert_eq!(term, t["term"].as_i64().expect("term"));

    // A desktop session preempts through replica A: the watch on B is told at once.
    let started = std::time::Instant::now();
    register(&a, &alice, &ns, "P", "s-desk", "claude_desktop").await;
    let change = next(&mut events, 5).await.expect("the preemption");
    let took = started.elapsed();
    let t = table(&change);
    assert_eq!(master_session(&t), Some("s-desk"));
    assert!(t["peers"].as_array().is_some_and(|p| p.iter().any(|e| e["session_id"] == "s-code")), "{t}");
    assert_ne!(change.id, first_id);
    assert!(took < Duration::from_secs(2), "commit to event took {took:?}");
    let seen = change.id.clone();
    drop(events);

    // Resumed with the last id: nothing missed, no snapshot; then the next change.
    let (_, mut resumed) = watch(&a, &alice, &ns, "P", None, Some(&seen)).await;
    assert!(next(&mut resumed, 1).await.is_none(), "up to date: no snapshot");
    let _ = support::http()
        .post(a.url("/api/v1/controller/heartbeat"))
        .bearer_auth(&alice)
        .json(&json!({"namespace": ns, "session_id": "s-code"}))
        .send()
        .await;
    assert!(next(&mut resumed, 1).await.is_none(), "a heartbeat is not a change of the table's roles");
    register(&b, &alice, &ns, "P", "s-cursor", "cursor").await;
    let joined = table(&next(&mut resumed, 5).await.expect("a peer joined"));
    assert_eq!(joined["peers"].as_array().map(Vec::len), Some(2));
    // Resumed with an id that is not current: a fresh snapshot at once.
    let (_, mut stale) = watch(&b, &alice, &ns, "P", None, Some(&first_id)).await;
    let snapshot = table(&next(&mut stale, 5).await.expect("snapshot"));
    assert_eq!(snapshot, joined);
}

#[tokio::test]
async fn nudges_reach_their_session_once_and_a_revoked_caller_loses_the_stream() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "watch-nudge").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let alice = support::agent_token(cp, &ns, "alice", &ALL).await;
    let bob = support::agent_token(cp, &ns, "bob", &ALL).await;
    let reader = support::sa_token(cp, &ns, "reader", "controllerregistrations", &["get", "list"]).await;
    let nobody = support::sa_token(cp, &ns, "nobody", "runsessions", &["get"]).await;

    // Refused before any stream, the same for a project that exists and one that does not.
    for project in ["P", "NOPE"] {
        assert_eq!(watch(&op, &nobody, &ns, project, None, None).await.0, 403);
    }
    assert_eq!(watch(&op, "not-a-token", &ns, "P", None, None).await.0, 401);

    register(&op, &alice, &ns, "P", "s-a", "codex").await;
    // Bob and a reader watch Alice's session: they read the table, never her nudges.
    let (_, mut bobs) = watch(&op, &bob, &ns, "P", Some("s-a"), None).await;
    let (_, mut readers) = watch(&op, &reader, &ns, "P", Some("s-a"), None).await;
    let (_, mut hers) = watch(&op, &alice, &ns, "P", Some("s-a"), None).await;
    for events in [&mut bobs, &mut readers, &mut hers] {
        assert_eq!(next(events, 5).await.expect("snapshot").event, "routing");
    }
    // Context switch: her session moves to Q, so P's registration is released and a
    // wrap_session nudge written for her session.
    register(&op, &alice, &ns, "Q", "s-a", "codex").await;
    let mut kinds = Vec::new();
    while let Some(e) = next(&mut hers, 3).await {
        kinds.push(e.event.clone());
        if e.event == "nudge" {
            let nudge: Value = serde_json::from_str(&e.data).expect("nudge JSON");
            assert_eq!((nudge["kind"].as_str(), nudge["project_id"].as_str()), (Some("wrap_session"), Some("P")));
        }
    }
    assert!(kinds.contains(&"routing".to_string()) && kinds.iter().filter(|k| *k == "nudge").count() == 1, "{kinds:?}");
    for events in [&mut bobs, &mut readers] {
        while let Some(e) = next(events, 2).await {
            assert_eq!(e.event, "routing", "not theirs: {e:?}");
        }
    }
    let delivered: Vec<(Option<chrono::DateTime<chrono::Utc>>,)> =
        sqlx::query_as("SELECT delivered_at FROM nudges WHERE namespace = $1 AND session_id = 's-a'")
            .bind(&ns)
            .fetch_all(&db.pool)
            .await
            .expect("nudges");
    assert_eq!(delivered.len(), 1);
    assert!(delivered[0].0.is_some(), "marked delivered");
    // Delivered once: a new watch of her session gets the table only.
    let (_, mut again) = watch(&op, &alice, &ns, "P", Some("s-a"), None).await;
    assert_eq!(next(&mut again, 5).await.expect("snapshot").event, "routing");
    assert!(next(&mut again, 2).await.is_none(), "no nudge twice");

    // The reader's rights go: its stream ends with an error event, within the recheck
    // (15 s) and the authorizer's cache (10 s).
    cp.kubectl_ok(&["-n", &ns, "delete", "rolebinding", "reader"]).await;
    let ended = tokio::time::timeout(Duration::from_secs(40), async {
        loop {
            match readers.next().await {
                Some(Ok(e)) if e.event == "error" => return Some(e),
                Some(Ok(_)) => continue,
                _ => return None,
            }
        }
    })
    .await
    .expect("the stream of a revoked caller ends within 40 s");
    let e = ended.expect("an error event before the end");
    let body: Value = serde_json::from_str(&e.data).expect("error JSON");
    assert_eq!(body["error"]["code"], "forbidden");
}

/// SPEC §11: a nudge rides in the session's next HTTP answer (its heartbeat here), once;
/// another identity's call naming the session never takes it.
#[tokio::test]
async fn a_nudge_rides_in_the_next_heartbeat_once_and_only_its_owners() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "nudge-http").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let alice = support::agent_token(cp, &ns, "alice", &ALL).await;
    let bob = support::agent_token(cp, &ns, "bob", &ALL).await;
    let beat = |token: String| {
        let (url, ns) = (op.url("/api/v1/controller/heartbeat"), ns.clone());
        async move {
            let r = support::http()
                .post(url)
                .bearer_auth(token)
                .json(&json!({"namespace": ns, "session_id": "s-a"}))
                .send()
                .await
                .expect("heartbeat");
            (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    register(&op, &alice, &ns, "P", "s-a", "codex").await;
    let (status, quiet) = beat(alice.clone()).await;
    assert_eq!((status, quiet["nudges"].clone()), (200, json!([])), "{quiet}");
    register(&op, &alice, &ns, "Q", "s-a", "codex").await; // context switch: a nudge for s-a
    let (status, _) = beat(bob.clone()).await;
    assert_eq!(status, 403, "not Bob's session");
    let (_, first) = beat(alice.clone()).await;
    let nudges = first["nudges"].as_array().cloned().unwrap_or_default();
    assert_eq!(nudges.len(), 1, "{first}");
    assert_eq!((nudges[0]["kind"].as_str(), nudges[0]["project_id"].as_str()), (Some("wrap_session"), Some("P")));
    let (_, second) = beat(alice.clone()).await;
    assert_eq!(second["nudges"], json!([]), "delivered once");
}

/// An initialized MCP session's `GET /mcp` stream, open (200, event stream).
async fn mcp_session_stream(op: &Operator, token: &str) -> reqwest::Response {
    let http = support::http();
    let post = |body: Value, session: Option<String>| {
        let mut req = http
            .post(format!("{}/mcp", op.base))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream");
        if let Some(s) = session {
            req = req.header("mcp-session-id", s);
        }
        req.body(body.to_string()).send()
    };
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "watch-test", "version": "1"}}});
    let r = post(init, None).await.expect("initialize");
    assert_eq!(r.status(), 200);
    let session = r.headers().get("mcp-session-id").and_then(|v| v.to_str().ok()).expect("a session id").to_string();
    let r = post(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}), Some(session.clone())).await;
    assert!(r.expect("initialized").status().is_success());
    let r = http
        .get(format!("{}/mcp", op.base))
        .bearer_auth(token)
        .header("accept", "text/event-stream")
        .header("mcp-session-id", session)
        .send()
        .await
        .expect("GET /mcp");
    assert_eq!(r.status(), 200);
    r
}

/// SPEC §11 shutdown: a replica that stops (SIGTERM, a rolling update) ends its watches
/// and MCP session streams cleanly (the stream closes, with no error event, so the client reconnects to another
/// replica) and only then hands its Lease back: its log says so in that order.
#[tokio::test]
async fn a_stopping_replica_ends_its_watches_before_it_hands_back_its_lease() {
    use std::time::Instant;
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "watch-stop").await;
    let db = TestDb::new().await;
    let mut op = Operator::replica(cp, &db.url, &ns, "watch-stop-a").await;
    let token = support::agent_token(cp, &ns, "agent", &ALL).await;
    support::eventually(30, "leadership", || async { op.logs().contains("became leader").then_some(()) }).await;
    let (status, mut events) = watch(&op, &token, &ns, "p-stop", None, None).await;
    assert_eq!(status, 200);
    table(&next(&mut events, 5).await.expect("the snapshot"));
    // And an MCP session's stream (`GET /mcp` of the session-based generation).
    let mut mcp = mcp_session_stream(&op, &token).await;

    let stopped_at = Instant::now();
    let killed = std::process::Command::new("kill").args(["-TERM", &op.pid().to_string()]).status().expect("kill");
    assert!(killed.success());
    // The stream ends (None), with no event before its end.
    let after = tokio::time::timeout(Duration::from_secs(5), events.next()).await.expect("the stream ends");
    assert!(after.is_none(), "no error event, a clean end: {after:?}");
    assert!(stopped_at.elapsed() < Duration::from_secs(3), "ended {:?} after SIGTERM", stopped_at.elapsed());
    // The MCP stream too, cleanly (it was held through the whole shutdown grace, then cut).
    loop {
        match tokio::time::timeout(Duration::from_secs(5), mcp.chunk()).await.expect("the MCP stream ends") {
            Ok(Some(_)) => continue,
            Ok(None) => break,
            Err(e) => panic!("the MCP stream was cut, not ended: {e}"),
        }
    }
    assert!(stopped_at.elapsed() < Duration::from_secs(3), "MCP stream ended {:?} after SIGTERM", stopped_at.elapsed());
    let deadline = Instant::now() + Duration::from_secs(10);
    while op.exited().is_none() {
        assert!(Instant::now() < deadline, "still running 10 s after SIGTERM:\n{}", op.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let logs = op.logs();
    let api_stopped = logs.find("HTTP API stopped").expect("the API's stop is logged");
    let released = logs.find("leadership released on shutdown").expect("the Lease's release is logged");
    assert!(api_stopped < released, "the Lease went back before the API had stopped:\n{logs}");
}

/// SPEC §15: with PRISM_SHUTDOWN_DELAY_SECONDS a stopping replica is not ready at once
/// but still answers new connections (the Service has not forgotten it yet), closing
/// each after its answer, and keeps its watches for the delay; then it ends them and
/// stops.
#[tokio::test]
async fn a_stopping_replica_serves_not_ready_through_its_shutdown_delay() {
    use std::time::Instant;
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "watch-delay").await;
    let db = TestDb::new().await;
    let mut op = Operator::start(cp, &db.url, &ns, &[("PRISM_SHUTDOWN_DELAY_SECONDS", "3")]).await;
    let token = support::agent_token(cp, &ns, "agent", &ALL).await;
    let (status, mut events) = watch(&op, &token, &ns, "p-delay", None, None).await;
    assert_eq!(status, 200);
    table(&next(&mut events, 5).await.expect("the snapshot"));

    let stopped_at = Instant::now();
    let killed = std::process::Command::new("kill").args(["-TERM", &op.pid().to_string()]).status().expect("kill");
    assert!(killed.success());
    let http = support::http();
    let ready = support::eventually(2, "readyz says stopping", || async {
        let r = http.get(op.url("/readyz")).send().await.ok()?;
        (r.status() == 503).then_some(r.json::<Value>().await.ok()?)
    })
    .await;
    assert_eq!(ready["status"], "stopping", "{ready}");
    // A new connection is still served, and an agent's call answered.
    let r = http
        .get(format!("{}/api/v1/controller/p-delay/status?namespace={ns}", op.base))
        .bearer_auth(&token)
        .send()
        .await
        .expect("served while stopping");
    assert_eq!(r.status(), 200);
    // And its connection closed after the answer: a kept-alive client's next call opens
    // one through the Service, to a replica that is not stopping.
    assert_eq!(r.headers().get("connection").and_then(|v| v.to_str().ok()), Some("close"), "{:?}", r.headers());
    // The watch stays open through the delay, then ends cleanly.
    let end = tokio::time::timeout(Duration::from_secs(8), events.next()).await.expect("the stream ends");
    assert!(end.is_none(), "a clean end: {end:?}");
    let took = stopped_at.elapsed();
    assert!(took >= Duration::from_millis(2500) && took < Duration::from_secs(6), "ended {took:?} after SIGTERM");
    let deadline = Instant::now() + Duration::from_secs(10);
    while op.exited().is_none() {
        assert!(Instant::now() < deadline, "still running 10 s after the delay:\n{}", op.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// #43.1: held streams are bounded per caller. One identity holds at most
/// PRISM_MAX_STREAMS_PER_IDENTITY watches at once (429 `too_many_streams` with
/// `Retry-After` beyond, another identity unaffected, a place given back when a watch
/// ends), and a watch lives at most PRISM_MAX_STREAM_SECONDS, then ends cleanly.
#[tokio::test]
async fn watches_are_bounded_per_caller_in_count_and_lifetime() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "watch-bounds").await;
    let db = TestDb::new().await;
    let op = Operator::start(
        cp,
        &db.url,
        &ns,
        &[("PRISM_MAX_STREAMS_PER_IDENTITY", "3"), ("PRISM_MAX_STREAM_SECONDS", "10")],
    )
    .await;
    let alice = support::agent_token(cp, &ns, "alice", &ALL).await;
    let bob = support::agent_token(cp, &ns, "bob", &ALL).await;
    register(&op, &alice, &ns, "P", "s-a", "codex").await;

    let opened = std::time::Instant::now();
    let mut held = Vec::new();
    for n in 0..3 {
        let (status, mut events) = watch(&op, &alice, &ns, "P", None, None).await;
        assert_eq!(status, 200, "watch {n}");
        table(&next(&mut events, 10).await.expect("the table first"));
        held.push(events);
    }
    let r = support::http()
        .get(format!("{}/api/v1/controller/P/watch?namespace={ns}", op.base))
        .bearer_auth(&alice)
        .send()
        .await
        .expect("GET");
    assert_eq!(r.status().as_u16(), 429, "a fourth watch of one identity");
    assert!(r.headers().get("retry-after").is_some(), "with Retry-After");
    let body: Value = r.json().await.expect("json");
    assert_eq!(body["error"]["code"], "too_many_streams", "{body}");
    let (status, _bobs) = watch(&op, &bob, &ns, "P", None, None).await;
    assert_eq!(status, 200, "another identity has its own share");

    // One ends (its client goes away): its place comes back.
    drop(held.pop());
    let _again = support::eventually(10, "a place given back", || async {
        let (status, events) = watch(&op, &alice, &ns, "P", None, None).await;
        (status == 200).then_some(events)
    })
    .await;

    // Past its lifetime a watch ends by itself, after a whole event, with no error.
    let mut oldest = held.remove(0);
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(30), oldest.next()).await {
            Ok(Some(Ok(event))) => assert_ne!(event.event, "error", "a clean end: {event:?}"),
            Ok(Some(Err(e))) => panic!("the stream broke instead of ending: {e}"),
            Ok(None) => break opened.elapsed(),
            Err(_) => panic!("the watch outlived PRISM_MAX_STREAM_SECONDS by 20 s"),
        }
    };
    assert!(ended >= Duration::from_secs(9) && ended < Duration::from_secs(25), "ended after {ended:?}");
}

/// #43.1: a reader that does not read is never buffered for. A client that opens a watch
/// and stops reading while the project changes 300 times (each table larger than the
/// last) finds, when it reads again, a `reset` event and the end of the stream, not every
/// table queued up for it.
#[tokio::test]
async fn a_watch_whose_reader_stalls_ends_with_a_reset() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "watch-stall").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[("PRISM_MAX_SESSIONS_PER_IDENTITY", "1000")]).await;
    let alice = support::agent_token(cp, &ns, "alice", &ALL).await;
    register(&op, &alice, &ns, "P", "s-0", "codex").await;

    // A client with a small receive window that reads nothing after its request.
    let addr: std::net::SocketAddr = op.base.trim_start_matches("http://").parse().expect("plain HTTP address");
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut stalled = socket.connect(addr).await.expect("connect");
    let request = format!(
        "GET /api/v1/controller/P/watch?namespace={ns} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {alice}\r\nAccept: text/event-stream\r\n\r\n"
    );
    stalled.write_all(request.as_bytes()).await.expect("request");
    // 300 changes, each table larger than the last: about 11 MB in all, well past what the
    // kernel's socket buffers on both sides take (the sender's grows to 4 MB) before the
    // server's writes block.
    for n in 1..=300 {
        register(&op, &alice, &ns, "P", &format!("s-{n}"), "codex").await;
    }
    // Past the reader's grace (2 s) for the event it did not take.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut seen = Vec::new();
    let read_all = tokio::time::timeout(Duration::from_secs(30), stalled.read_to_end(&mut seen)).await;
    let text = String::from_utf8_lossy(&seen);
    assert!(read_all.is_ok(), "the stream ended (read {} bytes)", seen.len());
    assert!(text.starts_with("HTTP/1.1 200"), "{}", &text[..text.len().min(200)]);
    assert!(text.contains("event: reset"), "a reset event at the end: ...{}", &text[text.len().saturating_sub(400)..]);
    let tables = text.matches("event: routing").count();
    assert!(tables < 300, "{tables} of 301 tables were kept for a reader that did not read");
}

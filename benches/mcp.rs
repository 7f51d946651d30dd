//! MCP benchmark: `prism_heartbeat` over `POST /mcp` against the HTTP API's
//! `POST /api/v1/controller/heartbeat`, in the same run, against the same operator, with
//! the same number of clients (target: MCP >= 0.5x the HTTP rate), and the p99 latency of
//! both. MCP is measured in both protocol generations: the session-based one (an
//! `Mcp-Session-Id` from `initialize`) and the stateless 2026-07-28 one (per-request
//! `_meta` and headers). Each round has one window of each kind, their order rotating
//! from round to round (benches/common/measure.rs); a ratio is the median over the
//! rounds of each round's MCP rate / HTTP rate.
//!
//!   scripts/bench mcp   (or: cargo bench --bench mcp, with the services up)
//!   BENCH_MCP_ONLY=stateless scripts/bench mcp   (one kind's windows alone, http,
//!   session or stateless: to profile the operator under that kind; no ratios then)

mod common;
use prism_testkit as support;

use std::sync::Arc;
use std::time::Duration;

use common::counts::{PgActivity, cpu_seconds};
use common::measure::{
    CONCURRENCY, Target, Window, interleave, judged, rate, rates, ratios, rounds, spread, window_length,
};
use futures::FutureExt;
use serde_json::{Value, json};

const ACCEPT: &str = "application/json, text/event-stream";

fn p99(windows: &[Window]) -> Duration {
    let mut all: Vec<Duration> = windows.iter().flat_map(|w| w.latencies.iter().copied()).collect();
    all.sort();
    all.get((all.len() * 99 / 100).min(all.len().saturating_sub(1))).copied().unwrap_or_default()
}

/// A tools/call of prism_heartbeat that answered, and answered with a role.
fn heartbeat_ok(body: &Value) -> bool {
    body["result"]["isError"] == false && body["result"]["structuredContent"]["role"].is_string()
}

#[tokio::main]
async fn main() {
    let db = support::TestDb::new().await;
    let cp = support::control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "benchmcp").await;
    let op = support::Operator::start(cp, &db.url, &ns, &common::open_limits(&[("RUST_LOG", "warn")])).await;
    let token = support::agent_token(cp, &ns, "bench", &["create"]).await;
    let http = support::http();
    println!(
        "prism-operator MCP benchmark (concurrency {CONCURRENCY}, {} rounds of {:.1}s windows per kind)\n",
        rounds(),
        window_length().as_secs_f64()
    );

    // One registered session per client, as the HTTP benchmark (election (b)) has.
    for i in 0..CONCURRENCY {
        support::register(&op, &token, &ns, "HB", &format!("hb-{i}"), "claude_code").await;
    }
    // The session-based generation: one MCP session per client, initialized once.
    let mut sessions = Vec::new();
    for i in 0..CONCURRENCY {
        let r = http
            .post(op.url("/mcp"))
            .bearer_auth(&token)
            .header("accept", ACCEPT)
            .json(&json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": format!("bench-{i}"), "version": "1"}}}))
            .send()
            .await
            .expect("initialize");
        let id = r.headers().get("mcp-session-id").and_then(|v| v.to_str().ok()).expect("session id").to_string();
        let done = http
            .post(op.url("/mcp"))
            .bearer_auth(&token)
            .header("accept", ACCEPT)
            .header("mcp-session-id", &id)
            .header("mcp-protocol-version", "2025-11-25")
            .json(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .send()
            .await
            .expect("initialized");
        assert_eq!(done.status(), 202);
        sessions.push(id);
    }
    let sessions = Arc::new(sessions);

    let http_call = {
        let (h, base, tok, ns) = (http.clone(), op.base.clone(), token.clone(), ns.clone());
        move |i: usize, _n: u64| {
            let (h, base, tok, ns) = (h.clone(), base.clone(), tok.clone(), ns.clone());
            async move {
                let r = h
                    .post(format!("{base}/api/v1/controller/heartbeat"))
                    .bearer_auth(&tok)
                    .json(&json!({"namespace": ns, "session_id": format!("hb-{i}")}))
                    .send()
                    .await;
                // Read the answer, as the MCP client below does.
                match r {
                    Ok(r) if r.status().is_success() => r.json::<Value>().await.is_ok_and(|b| b["role"].is_string()),
                    _ => false,
                }
            }
        }
    };
    let legacy_call = {
        let (h, base, tok, ns, sessions) = (http.clone(), op.base.clone(), token.clone(), ns.clone(), sessions.clone());
        move |i: usize, n: u64| {
            let (h, base, tok, ns, session) = (h.clone(), base.clone(), tok.clone(), ns.clone(), sessions[i].clone());
            async move {
                let r = h
                    .post(format!("{base}/mcp"))
                    .bearer_auth(&tok)
                    .header("accept", ACCEPT)
                    .header("mcp-session-id", session)
                    .header("mcp-protocol-version", "2025-11-25")
                    .json(&json!({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {
                        "name": "prism_heartbeat", "arguments": {"namespace": ns, "session_id": format!("hb-{i}")}}}))
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status().is_success() => r.json::<Value>().await.is_ok_and(|b| heartbeat_ok(&b)),
                    _ => false,
                }
            }
        }
    };
    let modern_call = {
        let (h, base, tok, ns) = (http.clone(), op.base.clone(), token.clone(), ns.clone());
        move |i: usize, n: u64| {
            let (h, base, tok, ns) = (h.clone(), base.clone(), tok.clone(), ns.clone());
            async move {
                let r = h
                    .post(format!("{base}/mcp"))
                    .bearer_auth(&tok)
                    .header("accept", ACCEPT)
                    .header("mcp-protocol-version", "2026-07-28")
                    .header("mcp-method", "tools/call")
                    .header("mcp-name", "prism_heartbeat")
                    .json(&json!({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {
                        "name": "prism_heartbeat", "arguments": {"namespace": ns, "session_id": format!("hb-{i}")},
                        "_meta": {
                            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                            "io.modelcontextprotocol/clientCapabilities": {},
                            "io.modelcontextprotocol/clientInfo": {"name": format!("bench-{i}"), "version": "1"}}}}))
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status().is_success() => r.json::<Value>().await.is_ok_and(|b| heartbeat_ok(&b)),
                    _ => false,
                }
            }
        }
    };
    // Each call works before anything is timed (a failing call would stop its task).
    assert!(http_call(0, 0).await, "HTTP heartbeat");
    assert!(legacy_call(0, 0).await, "MCP heartbeat (session-based)");
    assert!(modern_call(0, 0).await, "MCP heartbeat (2026-07-28)");

    // Counted over all windows of all kinds together: they share one operator and one
    // database, and Postgres publishes its counters too late to split them by window.
    let pg_before = PgActivity::settled(&db.pool).await.expect("pg_stat_database");
    // Beside each window, the CPU time the operator and this bench's own clients spent in
    // it: the clients share the machine's two cores with the operator, so a kind whose
    // client works harder leaves the operator less, and the rates alone cannot tell whose
    // cost a ratio is. A count per call, which the load does not move as it moves rates.
    let (op_pid, bench_pid) = (op.pid(), std::process::id());
    let only = std::env::var("BENCH_MCP_ONLY").ok();
    let selected = |kind: usize| only.as_deref().is_none_or(|o| o == ["http", "session", "stateless"][kind]);
    let measured = interleave(3, rounds(), |kind, _| {
        let window = match kind {
            _ if !selected(kind) => futures::future::ready(Window::default()).boxed(),
            0 => rate(http_call.clone()).boxed(),
            1 => rate(legacy_call.clone()).boxed(),
            _ => rate(modern_call.clone()).boxed(),
        };
        async move {
            let before = (cpu_seconds(op_pid), cpu_seconds(bench_pid));
            let w = window.await;
            let calls = (w.ops as f64).max(1.0);
            let per_call = ((cpu_seconds(op_pid) - before.0) / calls, (cpu_seconds(bench_pid) - before.1) / calls);
            (w, per_call)
        }
    })
    .await;
    // Per kind, per round: the window, and the CPU seconds per call (operator, clients).
    type PerCall = Vec<(f64, f64)>;
    let (kinds, cpu): (Vec<Vec<Window>>, Vec<PerCall>) =
        measured.into_iter().map(|kind| kind.into_iter().unzip()).unzip();
    // Microseconds of CPU per call: the operator's, the clients'.
    let cpu_us =
        |kind: usize, side: fn(&(f64, f64)) -> f64| -> Vec<f64> { cpu[kind].iter().map(|c| side(c) * 1e6).collect() };
    let pg = PgActivity::settled(&db.pool).await.expect("pg_stat_database").since(&pg_before);
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let http_rates = rates(&kinds[0]);
    println!(
        "HTTP  POST /api/v1/controller/heartbeat        {} calls/s   p99 {:>5.2} ms",
        spread(&http_rates, 0),
        ms(p99(&kinds[0]))
    );
    for (name, windows) in [("session-based (2025-11-25)", &kinds[1]), ("stateless (2026-07-28)  ", &kinds[2])] {
        println!(
            "MCP   prism_heartbeat, {name}  {} calls/s   p99 {:>5.2} ms",
            spread(&rates(windows), 0),
            ms(p99(windows))
        );
        println!("      ratio to HTTP  {}", judged(&ratios(&rates(windows), &http_rates), 2, Target::AtLeast(0.5)));
    }
    let operator = |c: &(f64, f64)| c.0;
    let clients = |c: &(f64, f64)| c.1;
    for (kind, name) in
        [(0, "HTTP                      "), (1, "MCP session-based (2025-11-25)"), (2, "MCP stateless (2026-07-28)")]
    {
        println!(
            "CPU per call, {name}: operator {} us, bench clients {} us",
            spread(&cpu_us(kind, operator), 1),
            spread(&cpu_us(kind, clients), 1)
        );
    }
    // The operator's own cost of an HTTP call against an MCP one: the rate ratio the
    // operator alone would give if nothing else used the cores.
    for (kind, name) in [(1, "session-based"), (2, "stateless    ")] {
        println!(
            "operator CPU per HTTP call / per MCP call, {name}  {}",
            spread(&ratios(&cpu_us(0, operator), &cpu_us(kind, operator)), 2)
        );
    }
    let calls: u64 = kinds.iter().flatten().map(|w| w.ops).sum();
    println!("counted, all kinds together: {}", pg.per(calls, "heartbeat"));
    let writes: i64 = sqlx::query_scalar("SELECT count(*) FROM controller_registrations WHERE namespace = $1")
        .bind(&ns)
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(writes, CONCURRENCY as i64, "heartbeats created no registration");
}

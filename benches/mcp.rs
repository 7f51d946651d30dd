//! MCP benchmark: `prism_heartbeat` over `POST /mcp` against the HTTP API's
//! `POST /api/v1/controller/heartbeat`, in the same run, against the same operator, with
//! the same number of clients (target: MCP >= 0.5x the HTTP rate), and the p99 latency of
//! both. MCP is measured in both protocol generations: the session-based one (an
//! `Mcp-Session-Id` from `initialize`) and the stateless 2026-07-28 one (per-request
//! `_meta` and headers). Windows alternate (HTTP, MCP, MCP, HTTP, ...) so that a drift of
//! the machine's load shows in both.
//!
//!   scripts/bench mcp   (or: cargo bench --bench mcp, with the services up)

// Only CONCURRENCY and WINDOW: this benchmark times each call, so it has its own loop.
#[allow(dead_code)]
mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{CONCURRENCY, WINDOW};
use serde_json::{Value, json};

const ROUNDS: usize = 4;
const ACCEPT: &str = "application/json, text/event-stream";

/// One window: its length and the latency of each successful call.
struct Window {
    seconds: f64,
    latencies: Vec<Duration>,
}

/// `op(task, n)` on CONCURRENCY tasks for WINDOW, as `common::rate` does, timing each
/// call.
async fn rate_and_latency<F, Fut>(op: F) -> Window
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|i| {
            let (op, latencies) = (op.clone(), latencies.clone());
            tokio::spawn(async move {
                let mut mine = Vec::new();
                let mut n = 0u64;
                while start.elapsed() < WINDOW {
                    let t = Instant::now();
                    if !op(i, n).await {
                        break;
                    }
                    mine.push(t.elapsed());
                    n += 1;
                }
                latencies.lock().expect("latencies").extend(mine);
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let latencies = std::mem::take(&mut *latencies.lock().expect("latencies"));
    Window { seconds, latencies }
}

fn p99(latencies: &mut [Duration]) -> Duration {
    latencies.sort();
    latencies.get((latencies.len() * 99 / 100).min(latencies.len().saturating_sub(1))).copied().unwrap_or_default()
}

/// Totals over the rounds of one kind of call.
#[derive(Default)]
struct Tally {
    calls: f64,
    seconds: f64,
    latencies: Vec<Duration>,
}

impl Tally {
    fn add(&mut self, window: Window) {
        self.calls += window.latencies.len() as f64;
        self.seconds += window.seconds;
        self.latencies.extend(window.latencies);
    }

    fn rate(&self) -> f64 {
        self.calls / self.seconds.max(f64::MIN_POSITIVE)
    }
}

/// A tools/call of prism_heartbeat that answered, and answered with a role.
fn heartbeat_ok(body: &Value) -> bool {
    body["result"]["isError"] == false && body["result"]["structuredContent"]["role"].is_string()
}

#[tokio::main]
async fn main() {
    let db = support::TestDb::new().await;
    let cp = support::control_plane();
    let client = cp.client().await;
    let ns = support::namespace(&client, "benchmcp").await;
    let op = support::Operator::start(cp, &db.url, &ns, &[("RUST_LOG", "warn")]).await;
    let token = support::agent_token(cp, &ns, "bench", &["create"]);
    let http = support::http();
    println!(
        "prism-operator MCP benchmark (concurrency {CONCURRENCY}, {}s windows, {ROUNDS} rounds)\n",
        WINDOW.as_secs()
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

    let (mut api, mut legacy, mut modern) = (Tally::default(), Tally::default(), Tally::default());
    for round in 1..=ROUNDS {
        let h = rate_and_latency(http_call.clone()).await;
        let l = rate_and_latency(legacy_call.clone()).await;
        let m = rate_and_latency(modern_call.clone()).await;
        let r = |w: &Window| w.latencies.len() as f64 / w.seconds;
        println!(
            "round {round}: HTTP {:>7.0}/s   MCP session-based {:>7.0}/s ({:.2}x)   MCP 2026-07-28 {:>7.0}/s ({:.2}x)",
            r(&h),
            r(&l),
            r(&l) / r(&h),
            r(&m),
            r(&m) / r(&h)
        );
        api.add(h);
        legacy.add(l);
        modern.add(m);
    }
    println!();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let http_rate = api.rate();
    let http_p99 = p99(&mut api.latencies);
    println!("HTTP  POST /api/v1/controller/heartbeat       {http_rate:>8.0} calls/s   p99 {:>6.2} ms", ms(http_p99));
    for (name, tally) in [("session-based (2025-11-25)", &mut legacy), ("stateless (2026-07-28)  ", &mut modern)] {
        let rate = tally.rate();
        println!(
            "MCP   prism_heartbeat, {name}  {rate:>8.0} calls/s   p99 {:>6.2} ms   ratio {:.2}x   (target >= 0.5x)",
            ms(p99(&mut tally.latencies)),
            rate / http_rate
        );
    }
    let writes: i64 = sqlx::query_scalar("SELECT count(*) FROM controller_registrations WHERE namespace = $1")
        .bind(&ns)
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(writes, CONCURRENCY as i64, "heartbeats created no registration");
}

//! The limits under attack (SPEC §12 "Bounded", issue #19): a legitimate agent's
//! heartbeat latency on one replica while 2,000 slow-header connections (a slowloris:
//! each sends a request line and then a header byte now and then, never the end of its
//! headers) and a flood of random bearer tokens hit it, against the same agent's latency
//! in quiet windows of the same run. Target: the attacked p99 within 2x of the quiet
//! one, and `/healthz` answering throughout. Prints the counts: connections opened, cut
//! by the server and how soon, random tokens answered 401 (a TokenReview) or 429 (the
//! address's budget spent), health probes failed.
//!
//!   scripts/bench limits   (or: cargo bench --bench limits, with the services up)

mod common;
use prism_testkit as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::measure::{Window, interleave, rounds, window};
use futures::FutureExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Slow-header connections held open at once during an attack window.
const SLOW_CONNECTIONS: usize = 2_000;
/// Random-token requests a second, all from one address (a flood well past the address's
/// budget of 20/s; fixed, so both sides of a round see the same attack whatever the
/// operator's speed).
const FLOOD_PER_SECOND: u64 = 1_000;
/// The agent: this many sessions heartbeating one after another each.
const AGENTS: usize = 4;
/// Long enough for the server's 10 s header read timeout to cut the slow connections
/// inside the window.
const WINDOW: Duration = Duration::from_secs(14);

#[derive(Default)]
struct Attack {
    opened: AtomicU64,
    cut: AtomicU64,
    /// Sum of the lifetimes of the connections the server cut, in ms.
    cut_after_ms: AtomicU64,
    longest_ms: AtomicU64,
    unauthorized: AtomicU64,
    limited: AtomicU64,
    other: AtomicU64,
    health_ok: AtomicU64,
    health_failed: AtomicU64,
    health_slowest_ms: AtomicU64,
}

/// One slow-header connection, opened again whenever the server cuts it, until `stop`.
async fn slowloris(addr: std::net::SocketAddr, attack: Arc<Attack>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut conn) = tokio::net::TcpStream::connect(addr).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        attack.opened.fetch_add(1, Ordering::Relaxed);
        let opened = Instant::now();
        if conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n").await.is_err() {
            continue;
        }
        let mut buf = [0u8; 256];
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            // A header byte a second; the server answers (408) or closes when its
            // header read timeout ends the connection.
            tokio::select! {
                // Whatever comes back (an answer, the end, an error), the server has
                // stopped waiting for this request.
                _ = conn.read(&mut buf) => {
                    let ms = opened.elapsed().as_millis() as u64;
                    attack.cut.fetch_add(1, Ordering::Relaxed);
                    attack.cut_after_ms.fetch_add(ms, Ordering::Relaxed);
                    attack.longest_ms.fetch_max(ms, Ordering::Relaxed);
                    break;
                }
                _ = tokio::time::sleep(Duration::from_secs(1)) => {
                    if conn.write_all(b"X").await.is_err() {
                        break;
                    }
                }
            }
        }
    }
}

/// Random bearer tokens at FLOOD_PER_SECOND, each request on its own task (at most 256
/// in flight), until `stop`.
async fn flood(http: reqwest::Client, url: String, attack: Arc<Attack>, stop: Arc<AtomicBool>) {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(256));
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / FLOOD_PER_SECOND));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let Ok(permit) = in_flight.clone().try_acquire_owned() else {
            attack.other.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let (http, url, attack) = (http.clone(), url.clone(), attack.clone());
        tokio::spawn(async move {
            let token = format!("random-{}", uuid::Uuid::new_v4());
            match http.get(&url).bearer_auth(token).send().await {
                Ok(r) if r.status() == 401 => attack.unauthorized.fetch_add(1, Ordering::Relaxed),
                Ok(r) if r.status() == 429 => attack.limited.fetch_add(1, Ordering::Relaxed),
                _ => attack.other.fetch_add(1, Ordering::Relaxed),
            };
            drop(permit);
        });
    }
}

/// `/healthz` every 200 ms, until `stop`.
async fn probe(http: reqwest::Client, url: String, attack: Arc<Attack>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let ok = matches!(http.get(&url).timeout(Duration::from_secs(2)).send().await, Ok(r) if r.status() == 200);
        let counter = if ok { &attack.health_ok } else { &attack.health_failed };
        counter.fetch_add(1, Ordering::Relaxed);
        attack.health_slowest_ms.fetch_max(t.elapsed().as_millis() as u64, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::main]
async fn main() {
    let db = support::TestDb::new().await;
    let cp = support::control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "benchlimits").await;
    let op = support::Operator::start(cp, &db.url, &ns, &common::open_limits(&[("RUST_LOG", "warn")])).await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "list"]).await;
    for i in 0..AGENTS {
        support::register(&op, &token, &ns, "HB", &format!("hb-{i}"), "claude_code").await;
    }
    let addr: std::net::SocketAddr = op.base.trim_start_matches("http://").parse().expect("operator address");
    println!(
        "prism-operator limits benchmark: {AGENTS} agents heartbeating, quiet vs under {SLOW_CONNECTIONS} slow-header \
         connections and {FLOOD_PER_SECOND} random tokens/s ({} rounds of {} s windows per side)\n",
        rounds(),
        WINDOW.as_secs()
    );
    let http = support::http();
    let heartbeat =
        common::heartbeat_op(http.clone(), op.url("/api/v1/controller/heartbeat"), token.clone(), ns.clone());
    assert!(heartbeat(0, 0).await, "the agent's heartbeat works");

    let attacks: Vec<Arc<Attack>> = (0..rounds()).map(|_| Arc::new(Attack::default())).collect();
    let sides = interleave(2, rounds(), |side, round| {
        let heartbeat = heartbeat.clone();
        let attack = attacks[round].clone();
        let (http, flood_url, health_url) =
            (http.clone(), op.url(&format!("/api/v1/controller/HB/status?namespace={ns}")), op.url("/healthz"));
        async move {
            if side == 0 {
                return window(AGENTS, WINDOW, heartbeat).await;
            }
            let stop = Arc::new(AtomicBool::new(false));
            let mut tasks = Vec::new();
            for _ in 0..SLOW_CONNECTIONS {
                tasks.push(tokio::spawn(slowloris(addr, attack.clone(), stop.clone())));
            }
            // A separate client: the flood's connections are not the agent's.
            tasks.push(tokio::spawn(flood(reqwest::Client::new(), flood_url.clone(), attack.clone(), stop.clone())));
            tasks.push(tokio::spawn(probe(http.clone(), health_url, attack.clone(), stop.clone())));
            // The slow connections are all open before the agent's window starts.
            let deadline = Instant::now() + Duration::from_secs(10);
            while attack.opened.load(Ordering::Relaxed) < SLOW_CONNECTIONS as u64 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let measured = window(AGENTS, WINDOW, heartbeat).await;
            stop.store(true, Ordering::Relaxed);
            for t in tasks {
                t.abort();
            }
            measured
        }
        .boxed()
    })
    .await;
    common::print_attacked_vs_quiet(&sides);
    let calls = |w: &[Window]| w.iter().map(|w| w.ops).sum::<u64>();
    let failed = |w: &[Window]| w.iter().map(|w| w.stopped).sum::<usize>();
    println!(
        "heartbeats: quiet {} (tasks stopped at a failure: {}), attacked {} (stopped: {})",
        calls(&sides[0]),
        failed(&sides[0]),
        calls(&sides[1]),
        failed(&sides[1])
    );
    let total = |f: fn(&Attack) -> &AtomicU64| attacks.iter().map(|a| f(a).load(Ordering::Relaxed)).sum::<u64>();
    let (opened, cut) = (total(|a| &a.opened), total(|a| &a.cut));
    let longest = attacks.iter().map(|a| a.longest_ms.load(Ordering::Relaxed)).max().unwrap_or(0);
    println!(
        "slow-header connections: {opened} opened, {cut} cut by the server, after {:.1} s on average, {:.1} s at the longest",
        total(|a| &a.cut_after_ms) as f64 / 1000.0 / cut.max(1) as f64,
        longest as f64 / 1000.0
    );
    println!(
        "random tokens: {} answered 401 (a TokenReview each), {} answered 429 rate_limited, {} other (failed, or not sent: 256 in flight)",
        total(|a| &a.unauthorized),
        total(|a| &a.limited),
        total(|a| &a.other)
    );
    let slowest = attacks.iter().map(|a| a.health_slowest_ms.load(Ordering::Relaxed)).max().unwrap_or(0);
    println!(
        "/healthz under attack: {} answered, {} failed, slowest {} ms",
        total(|a| &a.health_ok),
        total(|a| &a.health_failed),
        slowest
    );
    assert_eq!(failed(&sides[1]), 0, "the agent's heartbeats failed under attack");
}

//! Push, not poll (SPEC §11): each figure against its baseline in the same run, against
//! one operator on real Postgres, Redis and kube-apiserver.
//!
//! (a) dispatch latency, enqueue → the job in the Run's hands: `BENCH_PUSH_RUNS` (1,000)
//!     Runs long-polling (`wait_seconds` 60) beside as many polling every second
//!     (`wait_seconds` 0), jobs queued at random to each side at the same rate; and each
//!     side's claim requests per second. Goal: the long-poll side's p99 <= 50 ms (the
//!     polling side's is about 1 s) at <= 1/20 of the polling side's requests per second.
//! (b) preemption commit → event, over `BENCH_PUSH_PREEMPTIONS` (50) preemptions (rounds of 10): the
//!     project's watch (SSE) against a Kubernetes watch of the preempted master's
//!     ControllerRegistration (its status turning Peer: the API server's own push).
//!     Goal: the watch's p99 within 2x of the Kubernetes watch's.
//! (c) idle cost: the operator's RSS and CPU with `BENCH_PUSH_CLAIMS` (10,000) waiting
//!     claims and `BENCH_PUSH_WATCHES` (1,000) open watches, all idle, against the same
//!     operator just before they opened. Goal: <= 32 MiB more, <= 0.02 CPU s/s.
//!
//! Each figure of (a) is the median of `BENCH_ROUNDS` (>= 5) windows with its min-max
//! (benches/common/measure.rs), both sides measured in every window.
//!
//!   scripts/bench push   (or: cargo bench --bench push, with the services up)

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::counts::{cpu_seconds, rss_mib};
use common::measure::{Target, judged, percentile, rounds, spread};
use futures::StreamExt;
use kube::Api;
use kube::runtime::watcher;
use prism_operator::crd::{ControllerRegistration, Role, RunSession};
use prism_operator::run_client::RunClient;
use serde_json::json;

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A gauge of the operator's /metrics.
async fn gauge(http: &reqwest::Client, op: &support::Operator, name: &str) -> f64 {
    let text = http.get(op.url("/metrics")).send().await.expect("/metrics").text().await.unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// One side of (a): its Runs, what they received and how fast, how often they asked.
struct Side {
    /// Send instant of each job queued for this side, by its `payload.k`.
    sent: Mutex<HashMap<u64, Instant>>,
    /// Enqueue-to-hands latency of each job received, ms, with the window it was sent in.
    got: Mutex<Vec<(usize, f64)>>,
    claims: AtomicU64,
    /// Claims that failed (the Run said hello again).
    errors: AtomicU64,
}

impl Side {
    fn new() -> Arc<Side> {
        Arc::new(Side {
            sent: Mutex::new(HashMap::new()),
            got: Mutex::new(Vec::new()),
            claims: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        })
    }
}

/// A Run of side `side`: claims (waiting `wait` s, or every second when `wait` is 0),
/// notes each job's latency, completes it; heartbeats every 10 s, during a wait too (a
/// waiting claim renews nothing by itself), and says hello again if its session is gone.
async fn run_loop(
    mut run: RunClient,
    side: Arc<Side>,
    wait: u64,
    phase: Duration,
    window: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) {
    // Polling Runs are spread over their second, as independent machines are.
    tokio::time::sleep(phase).await;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut beat = tokio::time::interval(Duration::from_secs(10));
    beat.tick().await;
    while !stop.load(Ordering::Relaxed) {
        if wait == 0 {
            tick.tick().await;
        }
        side.claims.fetch_add(1, Ordering::Relaxed);
        let claimed = {
            let claim =
                async { if wait == 0 { run.claim_and_cancels(1).await } else { run.claim_waiting(1, wait).await } };
            tokio::pin!(claim);
            loop {
                tokio::select! {
                    claimed = &mut claim => break claimed,
                    _ = beat.tick() => {
                        let _ = run.heartbeat().await;
                    }
                }
            }
        };
        let now = Instant::now();
        match claimed {
            Ok(claimed) => {
                for job in claimed.jobs {
                    if let Some(k) = job.payload["k"].as_u64()
                        && let Some(sent) = side.sent.lock().unwrap_or_else(|e| e.into_inner()).remove(&k)
                    {
                        let ms = (now - sent).as_secs_f64() * 1000.0;
                        let w = window.load(Ordering::Relaxed) as usize;
                        side.got.lock().unwrap_or_else(|e| e.into_inner()).push((w, ms));
                    }
                    let _ = run.step(&job.id, "complete", Some(json!({"outcome": "succeeded"}))).await;
                }
            }
            Err(e) => {
                if side.errors.fetch_add(1, Ordering::Relaxed) < 3 {
                    eprintln!("   a claim failed: {e}");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                let _ = run.hello().await;
            }
        }
    }
}

#[tokio::main]
async fn main() {
    let n_runs = setting("BENCH_PUSH_RUNS", 1000);
    let n_preemptions = setting("BENCH_PUSH_PREEMPTIONS", 50);
    let n_claims = setting("BENCH_PUSH_CLAIMS", 10_000);
    let n_watches = setting("BENCH_PUSH_WATCHES", 1000);
    let cp = support::control_plane();
    let client = cp.client().await;
    let ns = support::namespace(&client, "benchpush").await;
    let db = support::TestDb::new().await;
    let redis = support::PrivateRedis::start();
    let prefix = support::redis_prefix();
    let op = support::Operator::start(
        cp,
        &db.url,
        &ns,
        &[
            ("REDIS_URL", &redis.url),
            ("PRISM_REDIS_PREFIX", &prefix),
            ("RUST_LOG", "warn"),
            ("PRISM_MAX_CONNECTIONS", "20000"),
            ("PRISM_API_DB_CONNECTIONS", "20"),
        ],
    )
    .await;
    let api: Api<RunSession> = Api::namespaced(client.clone(), &ns);
    let http = reqwest::Client::builder().pool_max_idle_per_host(20_000).build().expect("http client");
    let platform = support::sa_token(cp, &ns, "platform", "runsessions", &["get", "list", "update"]);
    let agent = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]);
    println!(
        "prism-operator push benchmark: {n_runs} + {n_runs} Runs, {n_preemptions} preemptions, \
         {n_claims} waiting claims + {n_watches} watches idle\n"
    );

    // (a) dispatch latency
    let t = Instant::now();
    let names: Vec<String> = (0..2 * n_runs).map(|i| format!("d{i:05}")).collect();
    let (waiting, polling) = (Side::new(), Side::new());
    let window = Arc::new(AtomicU64::new(u64::MAX));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = Mutex::new(Vec::new());
    // Each Run starts the moment its hello passed: the hellos of all take longer than a lease.
    common::runs::said_hello(&api, &op.base, &http, &names, |i, run| {
        let (side, wait) = if i < n_runs { (waiting.clone(), 60) } else { (polling.clone(), 0) };
        let phase = Duration::from_millis((i % n_runs) as u64 * 1000 / n_runs as u64);
        let task = tokio::spawn(run_loop(run, side, wait, phase, window.clone(), stop.clone()));
        tasks.lock().unwrap_or_else(|e| e.into_inner()).push(task);
        None
    })
    .await;
    let tasks = tasks.into_inner().unwrap_or_else(|e| e.into_inner());
    println!("   {} RunSessions created and said hello in {:.1}s", tasks.len(), t.elapsed().as_secs_f64());
    // Every long poll is waiting, and the polling Runs are at their pace.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let errors_before = (waiting.errors.load(Ordering::Relaxed), polling.errors.load(Ordering::Relaxed));
    let per_side_rate = 20.0;
    let window_seconds = 12.0;
    let mut k = 0u64;
    let mut claim_rates = (Vec::new(), Vec::new());
    for w in 0..rounds() {
        window.store(w as u64, Ordering::Relaxed);
        let claims_before = (waiting.claims.load(Ordering::Relaxed), polling.claims.load(Ordering::Relaxed));
        let started = Instant::now();
        let mut next = started;
        while started.elapsed().as_secs_f64() < window_seconds {
            next += Duration::from_secs_f64(1.0 / (2.0 * per_side_rate));
            tokio::time::sleep_until(next.into()).await;
            k += 1;
            let to_waiting = k.is_multiple_of(2);
            let (side, offset) = if to_waiting { (&waiting, 0) } else { (&polling, n_runs) };
            // A Run of the side picked at random (a multiplicative hash of the job's number).
            let pick = (k.wrapping_mul(2_654_435_761) >> 7) as usize % n_runs;
            let server = format!("d{:05}", offset + pick);
            side.sent.lock().unwrap_or_else(|e| e.into_inner()).insert(k, Instant::now());
            let body = json!({"namespace": ns, "server_instance_id": server, "component_kind": "run",
                              "kind": "config", "payload": {"k": k}});
            let (http, url, token) = (http.clone(), op.url("/api/v1/runtime/jobs"), platform.clone());
            tokio::spawn(async move {
                let r = http.post(url).bearer_auth(token).json(&body).send().await;
                assert!(r.is_ok_and(|r| r.status() == 201), "enqueue refused");
            });
        }
        let took = started.elapsed().as_secs_f64();
        claim_rates.0.push((waiting.claims.load(Ordering::Relaxed) - claims_before.0) as f64 / took);
        claim_rates.1.push((polling.claims.load(Ordering::Relaxed) - claims_before.1) as f64 / took);
    }
    // The last jobs reach their Runs (a polling Run asks within a second).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let p99_by_window = |side: &Side| -> Vec<f64> {
        let got = side.got.lock().unwrap_or_else(|e| e.into_inner());
        (0..rounds())
            .map(|w| percentile(&got.iter().filter(|(g, _)| *g == w).map(|(_, ms)| *ms).collect::<Vec<_>>(), 0.99))
            .collect()
    };
    let p50_all = |side: &Side| -> f64 {
        let got = side.got.lock().unwrap_or_else(|e| e.into_inner());
        percentile(&got.iter().map(|(_, ms)| *ms).collect::<Vec<_>>(), 0.5)
    };
    let lost = |side: &Side, before: u64| {
        let lost = side.sent.lock().unwrap_or_else(|e| e.into_inner()).len();
        format!("not received {lost}, failed claims {}", side.errors.load(Ordering::Relaxed) - before)
    };
    let (wp99, pp99) = (p99_by_window(&waiting), p99_by_window(&polling));
    println!("(a) enqueue → in the Run's hands, {n_runs} Runs a side, {per_side_rate} jobs/s a side");
    println!(
        "    long poll p99 ms {}   (p50 {:.1} ms; {})",
        judged(&wp99, 1, Target::AtMost(50.0)),
        p50_all(&waiting),
        lost(&waiting, errors_before.0)
    );
    println!(
        "    polling   p99 ms {}   (p50 {:.1} ms; {})",
        spread(&pp99, 1),
        p50_all(&polling),
        lost(&polling, errors_before.1)
    );
    let request_ratio: Vec<f64> = claim_rates.0.iter().zip(&claim_rates.1).map(|(w, p)| w / p).collect();
    println!("    claim requests/s   long poll {}   polling {}", spread(&claim_rates.0, 1), spread(&claim_rates.1, 1));
    println!("    ratio long poll/polling requests {}", judged(&request_ratio, 3, Target::AtMost(1.0 / 20.0)));
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.abort();
    }

    // (b) preemption commit → event
    let regs: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    let (mut sse_ms, mut k8s_ms) = (Vec::new(), Vec::new());
    let per_round = n_preemptions.div_ceil(rounds());
    for i in 0..n_preemptions {
        let project = format!("pre-{i}");
        let first = support::register(&op, &agent, &ns, &project, &format!("code-{i}"), "claude_code").await;
        let name = first["registration"]["name"].as_str().expect("registration name").to_string();
        // The API server's push: a watch of the master's resource, until its status says Peer.
        let regs = regs.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let (seen_tx, seen_rx) = tokio::sync::oneshot::channel::<Instant>();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
        let k8s = tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher(regs, config));
            let (mut ready, mut seen) = (Some(ready_tx), Some(seen_tx));
            while let Some(Ok(event)) = events.next().await {
                let peer = |r: &ControllerRegistration| r.status.as_ref().is_some_and(|s| s.role == Role::Peer);
                match event {
                    watcher::Event::InitDone => {
                        if let Some(tx) = ready.take() {
                            let _ = tx.send(());
                        }
                    }
                    watcher::Event::Apply(r) | watcher::Event::InitApply(r) if peer(&r) => {
                        if let Some(tx) = seen.take() {
                            let _ = tx.send(Instant::now());
                        }
                        return;
                    }
                    _ => {}
                }
            }
        });
        let mut watch = http
            .get(op.url(&format!("/api/v1/controller/{project}/watch?namespace={ns}")))
            .bearer_auth(&agent)
            .send()
            .await
            .expect("watch");
        next_master(&mut watch).await.expect("the snapshot");
        ready_rx.await.expect("the Kubernetes watch is listed");
        let t0 = Instant::now();
        support::register(&op, &agent, &ns, &project, &format!("desk-{i}"), "claude_desktop").await;
        let desk = format!("desk-{i}");
        loop {
            match next_master(&mut watch).await {
                Some(master) if master == desk => break,
                Some(_) => {}
                None => panic!("the watch ended before the preemption"),
            }
        }
        sse_ms.push((i / per_round, t0.elapsed().as_secs_f64() * 1000.0));
        let seen = tokio::time::timeout(Duration::from_secs(10), seen_rx).await.expect("the Kubernetes watch saw it");
        k8s_ms.push((i / per_round, (seen.expect("seen") - t0).as_secs_f64() * 1000.0));
        k8s.abort();
    }
    let of_round =
        |all: &[(usize, f64)], r: usize| all.iter().filter(|(g, _)| *g == r).map(|(_, ms)| *ms).collect::<Vec<_>>();
    let all = |all: &[(usize, f64)]| all.iter().map(|(_, ms)| *ms).collect::<Vec<_>>();
    let rounds_b = n_preemptions.div_ceil(per_round);
    let s99: Vec<f64> = (0..rounds_b).map(|r| percentile(&of_round(&sse_ms, r), 0.99)).collect();
    let k99: Vec<f64> = (0..rounds_b).map(|r| percentile(&of_round(&k8s_ms, r), 0.99)).collect();
    println!("(b) preemption → event, {n_preemptions} preemptions in rounds of {per_round}");
    println!(
        "    watch (SSE) p50 {:.1} ms, p99 ms {}   Kubernetes watch p50 {:.1} ms, p99 ms {}",
        percentile(&all(&sse_ms), 0.5),
        spread(&s99, 1),
        percentile(&all(&k8s_ms), 0.5),
        spread(&k99, 1)
    );
    let ratio: Vec<f64> = s99.iter().zip(&k99).map(|(s, k)| s / k).collect();
    println!("    ratio watch/Kubernetes p99 {}", judged(&ratio, 2, Target::AtMost(2.0)));

    // (c) idle cost
    let pid = op.pid();
    let idle_runs: Vec<String> = (0..100).map(|i| format!("i{i:03}")).collect();
    let idle = Arc::new(common::runs::said_hello(&api, &op.base, &http, &idle_runs, |_, run| Some(run)).await);
    let stop = Arc::new(AtomicBool::new(false));
    // The Runs' heartbeats go on in both windows.
    for i in 0..idle.len() {
        let (idle, stop) = (idle.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_secs(10)).await;
                let _ = idle[i].heartbeat().await;
            }
        });
    }
    // CPU in `rounds()` windows of 8 s each, without and then with the waiting claims and
    // watches (all within the claims' 60 s wait); RSS once each.
    let slice = 8.0;
    let cpu_windows = |n: usize| async move {
        let mut out = Vec::new();
        for _ in 0..n {
            let before = cpu_seconds(pid);
            tokio::time::sleep(Duration::from_secs_f64(slice)).await;
            out.push((cpu_seconds(pid) - before) / slice);
        }
        out
    };
    // (a)'s Runs went silent: their leases end and their status turns Offline first.
    tokio::time::sleep(Duration::from_secs(40)).await;
    let cpu_without = cpu_windows(rounds()).await;
    let rss_without = rss_mib(pid);
    // The watches first (they take longest to open), then the claims: every claim's
    // 60 s wait then spans all the windows.
    let mut streams = Vec::new();
    for w in 0..n_watches {
        let r = http
            .get(op.url(&format!("/api/v1/controller/idle-{}/watch?namespace={ns}", w % 100)))
            .bearer_auth(&agent)
            .send()
            .await
            .expect("watch");
        streams.push(r);
    }
    let mut held = Vec::new();
    for c in 0..n_claims {
        let idle = idle.clone();
        held.push(tokio::spawn(async move { idle[c % idle.len()].claim_waiting(1, 60).await.is_ok() }));
        if c % 500 == 499 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let t = Instant::now();
    while gauge(&http, &op, "prism_runtime_claims_waiting").await < n_claims as f64 {
        assert!(t.elapsed() < Duration::from_secs(30), "the claims never all waited");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Idle: nothing queued, nothing changes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu_with = cpu_windows(rounds()).await;
    let rss_with = rss_mib(pid);
    let still = gauge(&http, &op, "prism_runtime_claims_waiting").await;
    assert!(t.elapsed() < Duration::from_secs(58), "the windows outlasted the claims' wait");
    println!(
        "(c) idle cost, {n_claims} waiting claims + {n_watches} watches ({still} still waiting after {:.0} s of windows)",
        rounds() as f64 * slice
    );
    let more_mib = rss_with - rss_without;
    let met = if Target::AtMost(32.0).met_by(more_mib) { "met" } else { "NOT met" };
    println!("    RSS MiB   without {rss_without:.1}   with {rss_with:.1}   more {more_mib:.1}   target <= 32: {met}");
    println!("    CPU s/s   without {}   with {}", spread(&cpu_without, 4), spread(&cpu_with, 4));
    let more_cpu: Vec<f64> = cpu_with.iter().zip(&cpu_without).map(|(w, o)| w - o).collect();
    println!("    CPU more, s/s {}", judged(&more_cpu, 4, Target::AtMost(0.02)));
    stop.store(true, Ordering::Relaxed);
    drop(streams);
    for h in held {
        h.abort();
    }
}

/// The master's session of the watch's next `routing` event; None when the stream ends
/// (or in 10 s).
async fn next_master(stream: &mut reqwest::Response) -> Option<String> {
    let (_, table) = support::next_sse(stream, "routing").await?;
    Some(table["master"]["session_id"].as_str().unwrap_or_default().to_string())
}

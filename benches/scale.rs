//! Scale benchmark (issue #13): how the operator's costs grow from 1,000 to 10,000 of
//! everything. At each size N (BENCH_SCALE_SIZES, default 1000,2500,5000,10000):
//! N ControllerRegistrations over N/10 projects on the API server, N RunSessions with N
//! simulated Runs heartbeating at their lease's interval, and the N registrations'
//! sessions heartbeating through the HTTP API. Figures, each printed judged (median and
//! min-max over rounds, benches/common/measure.rs) and as one `SCALE n=.. figure=..` line
//! that scripts/bench-plot reads:
//!
//!  1. convergence: seconds until every status is right / seconds the API server took to
//!     accept the creates (goal <= 1.5), a fresh namespace and operator each round;
//!  2. Run heartbeats per core: heartbeats/s the operator served per CPU second of the
//!     operator, vs. the same heartbeats as the raw Lua script straight to Redis per CPU
//!     second of redis-server (the runtime bench's baseline), with Redis round trips and
//!     commands counted per heartbeat;
//!  3. the operator's peak RSS (VmHWM) with N + N live (goal <= 128 MiB at 10k + 10k);
//!  4. status lag of a role change: a project's master deleted, until the watch shows the
//!     new master's status (>= 50 samples, goal p99 <= 1 s), beside a coordination.k8s.io
//!     Lease update seen by the same kind of watch in the same run;
//!  5. steady state: API-server writes/s and Postgres reads/s over a window longer than
//!     the status heartbeat (PRISM_STATUS_HEARTBEAT_SECONDS, the default 240 s), goal
//!     <= 100 writes/s at 10k;
//!  6. /metrics scrape time (goal <= 100 ms at 10k).
//!
//!   scripts/bench scale                      (all sizes: about an hour on 2 cores)
//!   BENCH_SCALE_SIZES=1000 scripts/bench scale
//!
//! Rounds: BENCH_ROUNDS (default 5) below 10,000; BENCH_SCALE_LARGE_ROUNDS (default 3) at
//! 10,000 and above, where five would take too long: those figures are judged
//! inconclusive by measure.rs, as any figure of fewer than 5 rounds. The lag, steady-state
//! and RSS-with-N+N figures are taken once per size (one long window, or many samples).
//! The chart's admission policy is installed (finalizer and label at admission), as the
//! chart does on Kubernetes >= 1.36. Redis is a redis-server of the bench's own per size.
//! Simulated Runs share one HTTP client (a real Run has its own connection).

mod common;
use prism_testkit as support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::converge::{self, Live, PER_PROJECT};
use common::counts::{
    PgActivity, RedisActivity, RedisCounters, apiserver_writes, control_plane_needle, cpu_of, cpu_seconds, info_number,
    peak_rss_mib, redis_counted, writes_since,
};
use common::measure::{CONCURRENCY, Target, Window, interleave, judged, percentile, rate, rounds, scale_line, spread};
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use prism_operator::crd::{Role, RunSession};
use prism_operator::run_client::RunClient;
use prism_operator::run_registry::SessionStore;
use serde_json::{Value, json};

/// The operator's default PRISM_STATUS_HEARTBEAT_SECONDS: the bench runs with it.
const STATUS_HEARTBEAT: Duration = Duration::from_secs(240);

fn env_num<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

fn sizes() -> Vec<usize> {
    std::env::var("BENCH_SCALE_SIZES")
        .unwrap_or_else(|_| "1000,2500,5000,10000".into())
        .split(',')
        .filter_map(|s| s.trim().parse::<usize>().ok())
        // Whole projects of ten.
        .map(|n| n.max(PER_PROJECT) / PER_PROJECT * PER_PROJECT)
        .collect()
}

fn rounds_at(n: usize) -> usize {
    if n >= 10_000 { env_num("BENCH_SCALE_LARGE_ROUNDS").filter(|r| *r > 0).unwrap_or(3) } else { rounds() }
}

/// How often each registration's session heartbeats over HTTP. SPEC §4 gives no interval,
/// only the stale threshold (PRISM_CONTROLLER_PEER_STALE_MINUTES, 10 min); an agent that
/// calls once a minute is well inside it.
fn agent_heartbeat() -> Duration {
    Duration::from_secs(env_num("BENCH_AGENT_HEARTBEAT_SECONDS").unwrap_or(60))
}

/// The steady-state window: longer than the longest time between two periodic reconciles
/// of one object (1.1 status-heartbeat periods), so every live object's periodic write
/// falls in it, and than the life of what the operator holds in memory instead of reading
/// (`UNNOTIFIED_CHANGE_BOUND`, 600 s): the held roles and mirrored identities are made in
/// bursts here (every agent starts within a minute, every RunSession is created within a
/// minute or two), so they expire in waves 600 s apart, and a shorter window holds one
/// wave or none (run I: 36.5 role and 36.6 identity reads/s in 274 s, one whole wave of
/// each, where the average is 16.7). BENCH_SCALE_STEADY_SECONDS shortens it for a quick
/// look (then the rates are not for a whole period).
fn steady_window() -> Duration {
    env_num("BENCH_SCALE_STEADY_SECONDS").map(Duration::from_secs).unwrap_or(
        (STATUS_HEARTBEAT * 11 / 10).max(prism_core::store::UNNOTIFIED_CHANGE_BOUND) + Duration::from_secs(10),
    )
}

fn lag_samples() -> usize {
    env_num("BENCH_SCALE_LAG_SAMPLES").unwrap_or(50)
}

#[tokio::main]
async fn main() {
    assert!(!support::redis_cluster_mode(), "the scale benchmark runs on a standalone Redis (unset PRISM_TEST_REDIS)");
    let cp = support::control_plane().await;
    let client = cp.client().await;
    support::install_admission_policy(cp).await;
    let sizes = sizes();
    println!(
        "prism-operator scale benchmark: sizes {sizes:?}, {} rounds below 10,000 and {} at 10,000 and above, status heartbeat {}s, agents heartbeat every {}s, steady window {}s\n",
        rounds(),
        rounds_at(10_000),
        STATUS_HEARTBEAT.as_secs(),
        agent_heartbeat().as_secs(),
        steady_window().as_secs()
    );
    let started = Instant::now();
    for n in sizes {
        let t = Instant::now();
        scale(cp, &client, n).await;
        println!("    (size {n} took {:.0}s)\n", t.elapsed().as_secs_f64());
    }
    println!("scale benchmark took {:.0}s", started.elapsed().as_secs_f64());
}

/// Counters of the background load: what the simulated clients got answered.
#[derive(Default)]
struct Served {
    run_heartbeats: AtomicU64,
    run_failures: AtomicU64,
    agent_heartbeats: AtomicU64,
    agent_failures: AtomicU64,
    /// What the failed agent heartbeats got: an HTTP status and the API's error code, or
    /// the transport error's kind (a count alone does not say whose fault it was).
    agent_failure_kinds: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
    /// Sessions whose registration figure 4 deleted: their agents are told
    /// `not_registered`, which is the right answer, and stop.
    deleted_sessions: Mutex<std::collections::HashSet<String>>,
    agents_stopped: AtomicU64,
}

impl Served {
    fn agent_failed(&self, kind: String) {
        self.agent_failures.fetch_add(1, Ordering::Relaxed);
        *self.agent_failure_kinds.lock().unwrap_or_else(|e| e.into_inner()).entry(kind).or_default() += 1;
    }

    fn agent_failure_kinds(&self) -> String {
        let kinds = self.agent_failure_kinds.lock().unwrap_or_else(|e| e.into_inner());
        kinds.iter().map(|(k, n)| format!("{k}: {n}")).collect::<Vec<_>>().join(", ")
    }
}

/// Background tasks, aborted when dropped.
struct Tasks(Vec<tokio::task::AbortHandle>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

async fn scale(cp: &'static support::ControlPlane, client: &kube::Client, n: usize) {
    let r = rounds_at(n);
    let projects = n / PER_PROJECT;
    let redis = support::PrivateRedis::start().await;
    let prefix = support::redis_prefix();
    // BENCH_OPERATOR_LOG: the operator's RUST_LOG (e.g. to follow a slow sample of figure 4 in its log).
    let log = std::env::var("BENCH_OPERATOR_LOG").unwrap_or_else(|_| "warn".into());
    // All N registrations live in one namespace: its quota (default 10,000) is raised to N.
    let quota = n.max(10_000).to_string();
    let env = common::open_limits(&[
        ("REDIS_URL", redis.url.as_str()),
        ("PRISM_REDIS_PREFIX", prefix.as_str()),
        ("RUST_LOG", log.as_str()),
        ("PRISM_MAX_SESSIONS_PER_NAMESPACE", quota.as_str()),
    ]);
    let line = |figure: &str, values: &[f64]| println!("{}", scale_line(n, figure, values));
    println!("== N = {n}: {n} registrations over {projects} projects, {n} RunSessions and Runs; {r} rounds");

    // 1. Convergence, a fresh database, namespace and operator each round; the last
    // round's stay up for the rest.
    println!("1. convergence of {n} registrations:");
    let mut all = Vec::new();
    // The operator stops before its database goes (tuple fields drop in order).
    let mut kept: Option<(Live, support::TestDb)> = None;
    for round in 1..=r {
        // The previous round's operator stops before this one starts.
        drop(kept.take());
        let db = support::TestDb::new().await;
        let (result, live) = converge::convergence(cp, client, &db.url, n, &env, round).await;
        all.push(result);
        kept = Some((live, db));
    }
    let Some((live, db)) = kept else { return };
    let ratio: Vec<f64> = all.iter().map(|c| c.ratio).collect();
    let accepted: Vec<f64> = all.iter().map(|c| c.accepted).collect();
    let right: Vec<f64> = all.iter().map(|c| c.right_at.unwrap_or(f64::NAN)).collect();
    let rss: Vec<f64> = all.iter().map(|c| c.peak_rss_mib).collect();
    println!("   ratio right/accepted        {}", judged(&ratio, 2, Target::AtMost(1.5)));
    println!("   accepted s {}   right s {}", spread(&accepted, 1), spread(&right, 1));
    println!("   operator peak RSS MiB, {n} registrations: {}", spread(&rss, 1));
    println!("   counted: {}", converge::writes_per_registration(&all, n));
    line("convergence_ratio", &ratio);
    line("accepted_s", &accepted);
    line("converged_s", &right);
    line("rss_registrations_mib", &rss);

    // The Runs: N in the background at their lease's interval, CONCURRENCY more for the
    // windows of 2.
    let served = Arc::new(Served::default());
    let http = support::http();
    // The registrations' sessions heartbeat from now on, as their agents would: creating
    // the RunSessions takes longer than the stale threshold from 30,000 on (27 min), and
    // registrations nobody heartbeats would be swept meanwhile.
    let token = support::agent_token(cp, &live.ns, "bench", &["create"]).await;
    let every = agent_heartbeat();
    let mut agents = Vec::with_capacity(n);
    for k in 0..n {
        let (http, base, token, ns, served) =
            (http.clone(), live.op.base.clone(), token.clone(), live.ns.clone(), served.clone());
        let phase = every * k as u32 / n as u32;
        agents.push(
            tokio::spawn(heartbeat_agent(http, base, token, ns, format!("conv-{k}"), phase, every, served))
                .abort_handle(),
        );
    }
    let rs_api: Api<RunSession> = Api::namespaced(client.clone(), &live.ns);
    let t = Instant::now();
    let (mut tasks, window_runs) = start_runs(&rs_api, &live.op.base, &http, n, CONCURRENCY, &served).await;
    println!("   {} RunSessions created and said hello in {:.1}s", n + CONCURRENCY, t.elapsed().as_secs_f64());
    tasks.0.extend(agents);
    // Every Run's phase turns Online within a lease of its hello (the reconciler's
    // requeue): that burst is not the steady state.
    tokio::time::sleep(Duration::from_secs(35)).await;

    // 5. Steady state, and 3. peak RSS with N + N live.
    steady_state(client, &db, &live, &redis, &served, n, &line).await;

    // 4. Status lag of a role change vs. a Lease update.
    status_lag(client, &live, projects, &served, &line).await;

    // 2. Heartbeats per core.
    heartbeats_per_core(&live, &redis, &prefix, window_runs, &served, r, &line).await;

    // 6. /metrics scrape.
    let scrapes = interleave(1, r, |_, _| common::scrape::scrapes(http.clone(), live.op.url("/metrics"), None)).await;
    let ms: Vec<f64> = scrapes[0].iter().map(Window::ms_per_op).collect();
    println!("6. GET /metrics, ms per scrape  {}", judged(&ms, 1, Target::AtMost(100.0)));
    line("scrape_ms", &ms);

    let peak = peak_rss_mib(live.op.pid());
    println!("   operator peak RSS after everything (incl. the saturating windows of 2): {peak:.1} MiB");
    line("rss_peak_all_mib", &[peak]);
    println!(
        "   background: {} Run heartbeats ({} failed), {} agent heartbeats ({} failed{}; {} agents stopped when told their registration, deleted by figure 4, was gone)",
        served.run_heartbeats.load(Ordering::Relaxed),
        served.run_failures.load(Ordering::Relaxed),
        served.agent_heartbeats.load(Ordering::Relaxed),
        served.agent_failures.load(Ordering::Relaxed),
        Some(served.agent_failure_kinds()).filter(|k| !k.is_empty()).map(|k| format!(": {k}")).unwrap_or_default(),
        served.agents_stopped.load(Ordering::Relaxed)
    );
    drop(tasks);
}

/// `n + extra` RunSessions (default lease), and a Run for each that said hello, through
/// one shared HTTP client. The first `n` start heartbeating the moment they said hello
/// (at 10,000 the hellos take minutes, longer than a lease); the `extra` are returned.
async fn start_runs(
    api: &Api<RunSession>,
    base: &str,
    http: &reqwest::Client,
    n: usize,
    extra: usize,
    served: &Arc<Served>,
) -> (Tasks, Vec<RunClient>) {
    let names: Vec<String> = (0..n + extra).map(|i| format!("r{i:05}")).collect();
    let tasks = Mutex::new(Tasks(Vec::new()));
    let extras = common::runs::said_hello(api, base, http, &names, |i, run| {
        if i < n {
            let task = tokio::spawn(heartbeat_run(run, i, n, served.clone())).abort_handle();
            tasks.lock().unwrap_or_else(|e| e.into_inner()).0.push(task);
            return None;
        }
        Some(run)
    })
    .await;
    (tasks.into_inner().unwrap_or_else(|e| e.into_inner()), extras)
}

/// A Run's life: heartbeat every `heartbeat_interval_seconds` (the operator's answer),
/// phases spread over the interval; hello again when the session is gone.
async fn heartbeat_run(mut run: RunClient, i: usize, n: usize, served: Arc<Served>) {
    let every = Duration::from_secs(10);
    tokio::time::sleep(every * i as u32 / n as u32).await;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut every_now = every;
    loop {
        tick.tick().await;
        match run.heartbeat().await {
            Ok(answer) => {
                served.run_heartbeats.fetch_add(1, Ordering::Relaxed);
                let told = answer["heartbeat_interval_seconds"].as_u64().map(Duration::from_secs);
                if let Some(told) = told.filter(|t| *t != every_now && !t.is_zero()) {
                    every_now = told;
                    tick = tokio::time::interval(told);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                }
            }
            Err(_) => {
                served.run_failures.fetch_add(1, Ordering::Relaxed);
                let _ = run.hello().await;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn heartbeat_agent(
    http: reqwest::Client,
    base: String,
    token: String,
    ns: String,
    session: String,
    phase: Duration,
    every: Duration,
    served: Arc<Served>,
) {
    tokio::time::sleep(phase).await;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let answer = http
            .post(format!("{base}/api/v1/controller/heartbeat"))
            .bearer_auth(&token)
            .json(&json!({"namespace": ns, "session_id": session}))
            .send()
            .await;
        match answer {
            Ok(r) if r.status().is_success() => {
                served.agent_heartbeats.fetch_add(1, Ordering::Relaxed);
            }
            Ok(r) => {
                let status = r.status().as_u16();
                let code = r.json::<Value>().await.ok().and_then(|b| b["error"]["code"].as_str().map(str::to_string));
                let deleted = served.deleted_sessions.lock().unwrap_or_else(|e| e.into_inner()).contains(&session);
                if status == 404 && code.as_deref() == Some("not_registered") && deleted {
                    served.agents_stopped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                served.agent_failed(format!("{status} {}", code.unwrap_or_default()).trim_end().to_string());
            }
            Err(e) => {
                let kind = if e.is_timeout() {
                    "timeout"
                } else if e.is_connect() {
                    "connect"
                } else {
                    "transport"
                };
                served.agent_failed(kind.to_string());
            }
        }
    }
}

/// The pid of a redis-server, as it says itself.
async fn redis_pid(url: &str) -> u32 {
    let mut conn = redis::Client::open(url)
        .expect("redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connect to Redis");
    let info: String = redis::cmd("INFO").arg("server").query_async(&mut conn).await.expect("INFO server");
    info_number(&info, "process_id") as u32
}

/// Figure 5, API-server writes/s and Postgres reads/s over the steady window, and figure
/// 3, the peak RSS with N + N live.
async fn steady_state(
    client: &kube::Client,
    db: &support::TestDb,
    live: &Live,
    redis: &support::PrivateRedis,
    served: &Served,
    n: usize,
    line: &impl Fn(&str, &[f64]),
) {
    let window = steady_window();
    let pid = live.op.pid();
    let redis_pid = redis_pid(&redis.url).await;
    println!(
        "5. steady state over {}s ({n} + {n} live, status heartbeat {}s):",
        window.as_secs(),
        STATUS_HEARTBEAT.as_secs()
    );
    let writes_before = apiserver_writes(client).await.expect("API server /metrics");
    // Continuous load: Postgres publishes each backend's counters up to 10 s late at both
    // ends alike, so the difference over the window is still its work.
    let pg_before = PgActivity::read(&db.pool).await.expect("pg_stat_database");
    let mine = control_plane_needle(&support::control_plane().await.kubeconfig);
    let cpu_now = || [cpu_seconds(pid), cpu_seconds(redis_pid), cpu_of("kube-apiserver", &mine), cpu_of("etcd", &mine)];
    let cpu_before = cpu_now();
    let runs_before = served.run_heartbeats.load(Ordering::Relaxed);
    let agents_before = served.agent_heartbeats.load(Ordering::Relaxed);
    let counted_before = operator_counts(&live.op).await;
    let t = Instant::now();
    tokio::time::sleep(window).await;
    let secs = t.elapsed().as_secs_f64();
    let writes = writes_since(&apiserver_writes(client).await.expect("API server /metrics"), &writes_before);
    let pg = PgActivity::read(&db.pool).await.expect("pg_stat_database").since(&pg_before);
    let cpu_after = cpu_now();
    let cpu: Vec<f64> = cpu_after.iter().zip(cpu_before).map(|(a, b)| a - b).collect();
    let run_hb = (served.run_heartbeats.load(Ordering::Relaxed) - runs_before) as f64 / secs;
    let agent_hb = (served.agent_heartbeats.load(Ordering::Relaxed) - agents_before) as f64 / secs;
    let total: f64 = writes.values().sum();
    let per_s = total / secs;
    let each: Vec<String> = writes.iter().map(|(k, v)| format!("{k} {:.1}", v / secs)).collect();
    let target = Target::AtMost(100.0);
    println!(
        "   API server writes/s  {per_s:.1} ({})   target at 10,000 {target}: {}",
        each.join(", "),
        if n < 10_000 {
            "-"
        } else if target.met_by(per_s) {
            "PASS"
        } else {
            "FAIL"
        }
    );
    let per_object = total / (2 * n) as f64 * STATUS_HEARTBEAT.as_secs_f64() / secs;
    println!("   counted: {per_object:.2} API server writes per live object per {}s", STATUS_HEARTBEAT.as_secs());
    let rows_read = (pg.tup_fetched + pg.tup_returned) as f64 / secs;
    println!("   Postgres: {}", pg.per(secs.round() as u64, "second"));
    println!("   Postgres scans/s: {}", pg.busiest_scans(8, secs));
    let counted = operator_counts(&live.op).await;
    let (reconciles, project_reads, role_reads) =
        (counted.0 - counted_before.0, counted.1 - counted_before.1, counted.2 - counted_before.2);
    println!(
        "   the operator's reads: {:.1} project reads/s for {:.1} registration reconciles/s ({:.1} reconciles a read), {:.1} role reads/s",
        project_reads / secs,
        reconciles / secs,
        reconciles / project_reads.max(1.0),
        role_reads / secs
    );
    println!(
        "   served: {run_hb:.0} Run heartbeats/s, {agent_hb:.1} agent heartbeats/s; CPU s/s: operator {:.2}, redis-server {:.2}, kube-apiserver {:.2}, etcd {:.2}",
        cpu[0] / secs,
        cpu[1] / secs,
        cpu[2] / secs,
        cpu[3] / secs
    );
    let rss = peak_rss_mib(pid);
    let rss_target = Target::AtMost(128.0);
    println!(
        "3. operator peak RSS with {n} + {n} live: {rss:.1} MiB   target at 10,000 {rss_target}: {}",
        if n < 10_000 {
            "-"
        } else if rss_target.met_by(rss) {
            "PASS"
        } else {
            "FAIL"
        }
    );
    line("api_writes_per_s", &[per_s]);
    line("api_writes_per_object_per_period", &[per_object]);
    line("pg_rows_read_per_s", &[rows_read]);
    line("pg_xact_per_s", &[(pg.xact_commit + pg.xact_rollback) as f64 / secs]);
    line("operator_cpu_steady", &[cpu[0] / secs]);
    line("rss_mib", &[rss]);
}

/// The operator's own counts (its /metrics): registration reconciles, project reads made,
/// agents' role reads made.
async fn operator_counts(op: &support::Operator) -> (f64, f64, f64) {
    (
        support::metric_value(op, "prism_reconciles_total", "controllerregistration").await,
        support::metric_value(op, "prism_controller_project_reads_total", "").await,
        support::metric_value(op, "prism_controller_role_reads_total", "").await,
    )
}

/// When the bench's watches first saw each thing.
#[derive(Default)]
struct Sightings {
    /// Project -> its master as last seen, and when that master was first seen.
    masters: Mutex<HashMap<String, (String, Instant)>>,
    /// Lease holder -> when first seen.
    holders: Mutex<HashMap<String, Instant>>,
    /// Watches whose initial list is complete. Until then a change waits behind the rest
    /// of the list: at 10,000 the masters are all in its first pages, and a sample taken
    /// then measured the list (1-4 s), not the operator.
    listed: AtomicU64,
}

impl Sightings {
    /// An event of one of the watches: the object it carries, if any, and the end of a list.
    fn event<K>(&self, event: Result<watcher::Event<K>, watcher::Error>) -> Option<K> {
        match event {
            Ok(watcher::Event::Apply(obj) | watcher::Event::InitApply(obj)) => Some(obj),
            Ok(watcher::Event::InitDone) => {
                self.listed.fetch_add(1, Ordering::Relaxed);
                None
            }
            _ => None,
        }
    }
}

/// Polls `check` every 2 ms until it returns Some, for up to 30 s.
async fn seen_by<F: Fn() -> Option<Instant>>(check: F) -> Option<Instant> {
    seen_within(Duration::from_secs(30), check).await
}

async fn seen_within<F: Fn() -> Option<Instant>>(limit: Duration, check: F) -> Option<Instant> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(at) = check() {
            return Some(at);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    None
}

/// Figure 4. Samples alternate: a project's master deleted (its peers' best is promoted), then a
/// Lease's holder changed; each timed until the watch shows it.
async fn status_lag(
    client: &kube::Client,
    live: &Live,
    projects: usize,
    served: &Served,
    line: &impl Fn(&str, &[f64]),
) {
    let samples = lag_samples();
    let seen = Arc::new(Sightings::default());
    let leases: Api<Lease> = Api::namespaced(client.clone(), &live.ns);
    let lease_name = "bench-lag";
    let lease = Lease {
        metadata: kube::api::ObjectMeta { name: Some(lease_name.into()), ..Default::default() },
        spec: Some(LeaseSpec { holder_identity: Some("h-start".into()), ..Default::default() }),
    };
    leases.create(&PostParams::default(), &lease).await.expect("create Lease");
    let mut tasks = Tasks(Vec::new());
    let s = seen.clone();
    tasks.0.push(
        tokio::spawn(watcher(live.api.clone(), watcher::Config::default()).default_backoff().for_each(move |event| {
            if let Some(r) = s.event(event)
                && r.status.as_ref().is_some_and(|st| st.role == Role::Master)
            {
                let mut masters = s.masters.lock().unwrap_or_else(|e| e.into_inner());
                let name = r.name_any();
                let entry = masters.entry(r.spec.project_id.clone()).or_insert((String::new(), Instant::now()));
                if entry.0 != name {
                    *entry = (name, Instant::now());
                }
            }
            std::future::ready(())
        }))
        .abort_handle(),
    );
    let s = seen.clone();
    tasks.0.push(
        tokio::spawn(watcher(leases.clone(), watcher::Config::default()).default_backoff().for_each(move |event| {
            if let Some(l) = s.event(event)
                && let Some(h) = l.spec.and_then(|s| s.holder_identity)
            {
                s.holders.lock().unwrap_or_else(|e| e.into_inner()).entry(h).or_insert_with(Instant::now);
            }
            std::future::ready(())
        }))
        .abort_handle(),
    );
    // Both watches have listed everything, every project's master among it (a list of
    // 30,000 objects from a busy API server takes longer than a change's 30 s).
    let ready = seen_within(Duration::from_secs(300), || {
        let masters = seen.masters.lock().unwrap_or_else(|e| e.into_inner()).len();
        let holders = seen.holders.lock().unwrap_or_else(|e| e.into_inner()).contains_key("h-start");
        (masters >= projects && holders && seen.listed.load(Ordering::Relaxed) >= 2).then(Instant::now)
    })
    .await;
    assert!(
        ready.is_some(),
        "the lag watches did not list every project's master: {} of {projects} seen, {} lists done",
        seen.masters.lock().unwrap_or_else(|e| e.into_inner()).len(),
        seen.listed.load(Ordering::Relaxed)
    );

    let (mut role, mut lease_lag) = (Vec::new(), Vec::new());
    // Role-change samples: (lag, when it started, project, the deleted master), to name the slow ones.
    let mut started = Vec::new();
    for i in 0..samples {
        for side in common::measure::order(i, 2) {
            let lag = if side == 0 {
                let project = converge::project(i % projects);
                let old = seen.masters.lock().unwrap_or_else(|e| e.into_inner()).get(&project).map(|m| m.0.clone());
                let Some(old) = old else { continue };
                let t0 = Instant::now();
                started.push((chrono::Utc::now(), project.clone(), old.clone()));
                // Registration c{k:05} is session conv-{k} (converge::registration).
                if let Some(k) = old.strip_prefix('c').and_then(|k| k.parse::<usize>().ok()) {
                    served.deleted_sessions.lock().unwrap_or_else(|e| e.into_inner()).insert(format!("conv-{k}"));
                }
                live.api.delete(&old, &DeleteParams::default()).await.expect("delete the master");
                seen_by(|| {
                    let masters = seen.masters.lock().unwrap_or_else(|e| e.into_inner());
                    masters.get(&project).filter(|(name, at)| *name != old && *at > t0).map(|(_, at)| *at)
                })
                .await
                .map(|at| (at - t0).as_secs_f64())
            } else {
                let holder = format!("h-{i}");
                let t0 = Instant::now();
                let patch = json!({"spec": {"holderIdentity": holder}});
                leases.patch(lease_name, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch Lease");
                seen_by(|| seen.holders.lock().unwrap_or_else(|e| e.into_inner()).get(&holder).copied())
                    .await
                    .map(|at| (at - t0).as_secs_f64())
            };
            let v = lag.unwrap_or(f64::NAN);
            if side == 0 {
                role.push(v)
            } else {
                lease_lag.push(v)
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let missed = role.iter().filter(|v| v.is_nan()).count();
    let (p50, p99, max) = (percentile(&role, 0.5), percentile(&role, 0.99), percentile(&role, 1.0));
    let (l50, l99) = (percentile(&lease_lag, 0.5), percentile(&lease_lag, 0.99));
    let target = Target::AtMost(1.0);
    let verdict = if missed == 0 && target.met_by(p99) { "PASS" } else { "FAIL" };
    println!(
        "4. status lag of a role change ({} samples, {missed} not seen in 30 s): p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms   target p99 {target} s: {verdict}",
        role.len(),
        p50 * 1000.0,
        p99 * 1000.0,
        max * 1000.0
    );
    println!(
        "   baseline, a Lease update to the same kind of watch: p50 {:.0} ms, p99 {:.0} ms; ratio p99 {:.1}, p50 {:.1}",
        l50 * 1000.0,
        l99 * 1000.0,
        p99 / l99,
        p50 / l50
    );
    // The slowest role changes, by name and wall-clock start, to find them in the operator's log.
    let mut slowest: Vec<_> = role.iter().zip(&started).filter(|(v, _)| !v.is_nan() && **v > 2.0 * p50).collect();
    slowest.sort_by(|a, b| b.0.total_cmp(a.0));
    for (v, (at, project, old)) in slowest.iter().take(5) {
        println!("   slow: {:.0} ms from {} ({project}: {old} deleted)", *v * 1000.0, at.format("%H:%M:%S%.3f"));
    }
    line("lag_p50_s", &[p50]);
    line("lag_p99_s", &[p99]);
    line("lease_lag_p99_s", &[l99]);
    line("lag_ratio_p99", &[p99 / l99]);
}

/// One window of 2: heartbeats in it (the window's and the background's), the counted
/// process's CPU seconds, and what Redis counted.
struct PerCore {
    heartbeats: u64,
    cpu: f64,
    redis: RedisActivity,
}

impl PerCore {
    fn per_core(&self) -> f64 {
        self.heartbeats as f64 / self.cpu.max(0.01)
    }
}

/// Figure 2, Run heartbeats per CPU second: through the operator (its CPU) vs. the raw Lua
/// script (redis-server's CPU), in alternating windows at CONCURRENCY. The background
/// Runs heartbeat through the operator in both windows; each side counts them too (the
/// operator serves them; redis-server runs their script).
#[allow(clippy::too_many_arguments)]
async fn heartbeats_per_core(
    live: &Live,
    redis: &support::PrivateRedis,
    prefix: &str,
    mut window_runs: Vec<RunClient>,
    served: &Arc<Served>,
    r: usize,
    line: &impl Fn(&str, &[f64]),
) {
    let pid = live.op.pid();
    let redis_pid = redis_pid(&redis.url).await;
    // Their sessions lapsed while the other figures were taken: new ones (new tokens).
    for run in &mut window_runs {
        run.hello().await.expect("hello of a window's Run");
    }
    let window_runs = Arc::new(window_runs);
    let counters = RedisCounters::connect(std::slice::from_ref(&redis.url)).await.expect("connect to Redis");
    let store = SessionStore::new(&prism_operator::config::RedisEndpoint::Standalone(redis.url.clone()), prefix)
        .expect("redis");
    let conn = redis::Client::open(redis.url.as_str())
        .expect("redis")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let script = common::raw::frozen_heartbeat_script();
    let keys: Arc<Vec<(String, String, String, String)>> = Arc::new(common::raw::heartbeat_keys(&store, &window_runs));
    let sides = interleave(2, r, |side, _| {
        let (runs, conn, script, keys, counters, served) =
            (window_runs.clone(), conn.clone(), script.clone(), keys.clone(), &counters, served.clone());
        async move {
            // The rounds outlast the lease; heartbeats renew it (outside the window).
            for run in runs.iter() {
                run.heartbeat().await.expect("heartbeat before a window");
            }
            let counted_pid = if side == 0 { pid } else { redis_pid };
            let (bg, cpu) = (served.run_heartbeats.load(Ordering::Relaxed), cpu_seconds(counted_pid));
            let (w, act) = match side {
                0 => {
                    redis_counted(
                        counters,
                        rate(move |i, _| {
                            let runs = runs.clone();
                            async move { runs[i].heartbeat().await.is_ok() }
                        }),
                    )
                    .await
                }
                _ => {
                    redis_counted(
                        counters,
                        rate(move |i, _| {
                            let (mut conn, script, keys) = (conn.clone(), script.clone(), keys.clone());
                            async move { common::raw::raw_heartbeat(&mut conn, &script, &keys[i]).await }
                        }),
                    )
                    .await
                }
            };
            let background = served.run_heartbeats.load(Ordering::Relaxed) - bg;
            PerCore { heartbeats: w.ops + background, cpu: cpu_seconds(counted_pid) - cpu, redis: act }
        }
        .boxed()
    })
    .await;
    let per_core = |side: &[PerCore]| side.iter().map(PerCore::per_core).collect::<Vec<f64>>();
    let (api, raw) = (per_core(&sides[0]), per_core(&sides[1]));
    let ratio = common::measure::ratios(&api, &raw);
    let counted = |side: &[PerCore]| {
        let mut all = RedisActivity::default();
        for w in side {
            all.add(&w.redis);
        }
        (side.iter().map(|w| w.heartbeats).sum::<u64>(), all)
    };
    let (api_ops, api_redis) = counted(&sides[0]);
    let (raw_ops, raw_redis) = counted(&sides[1]);
    println!(
        "2. Run heartbeats per CPU second: operator {}   raw Lua per redis-server CPU second {}",
        spread(&api, 0),
        spread(&raw, 0)
    );
    println!("   ratio operator/redis-server  {}", spread(&ratio, 3));
    println!("   counted, operator: {} (incl. its RunSession reconciles' reads)", api_redis.per(api_ops, "heartbeat"));
    println!("   counted, raw Lua:  {}", raw_redis.per(raw_ops, "heartbeat"));
    line("hb_per_core_operator", &api);
    line("hb_per_core_redis", &raw);
    line("hb_core_ratio", &ratio);
    line("redis_round_trips_per_hb", &[api_redis.reads as f64 / (api_ops as f64).max(1.0)]);
    line("redis_commands_per_hb", &[api_redis.total() as f64 / (api_ops as f64).max(1.0)]);
}

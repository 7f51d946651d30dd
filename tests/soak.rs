//! The fault harness (issue #12, SPEC §10): load and seeded random faults together, then
//! an independent check.
//!
//! Load, all through one address in front of the replicas (a loopback balancer that, as a
//! Service does, sends each new connection to a replica that accepts it):
//! * agents over HTTP: sessions register, heartbeat, read status, switch projects and wrap
//!   (or are abandoned), one after another, for the whole run;
//! * agents over MCP: the official MCP Python SDK (tests/mcp/load.py), both generations;
//! * Runs: hello, heartbeat, claim, progress and complete the jobs a dispatcher enqueues;
//!   after a lost session they say hello again.
//!
//! Faults, one at a time at seeded times (PRISM_FAULT_SEED), every kind once per round in
//! a seeded order: `kill -9` of the leader replica and of a follower (each started again
//! under a new pod name, as a Deployment would), Postgres backend kills and a Postgres
//! restart, a Redis restart, FLUSHALL, `CLUSTER FAILOVER` and `kill -9` of a master (on a
//! Redis Cluster with replicas), and Runs killed holding claimed jobs.
//!
//! Afterwards: no replica died or panicked but those killed; every replica is ready; every
//! acknowledged registration and job is in the database and every job ends succeeded;
//! `kubectl get` shows at most one Master per project, the database's; and
//! tests/faults/check_invariants.py (psql, not the project's code) finds SPEC §10's
//! invariants, each acknowledged completion once, and no durable row changed.
//!
//! `scripts/soak --minutes N` runs it for people; scripts/test runs it for a few minutes.
//! Plain `cargo test` leaves it out (#[ignore]: minutes long, on the release binary);
//! scripts/soak runs it with `--ignored`, and scripts/test (so CI) runs scripts/soak. It
//! never skips itself: a missing service fails it.

use prism_testkit as support;

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::Api;
use kube::api::ListParams;
use prism_operator::crd::{ControllerRegistration, Role, RunSession};
use prism_operator::run_client::{ClientError, RunClient};
use serde_json::{Value, json};
use support::faults::{Lcg, backend_killer};
use support::{ControlPlane, Operator, PrivatePostgres, PrivateRedis, control_plane};
use tokio::net::{TcpListener, TcpStream};

/// The job visibility timeout the replicas run with: a job whose Run died comes back
/// this soon.
const VISIBILITY_SECONDS: u64 = 5;
const SURFACES: [&str; 4] = ["claude_code", "codex", "cursor", "claude_desktop"];

struct Settings {
    seconds: u64,
    seed: u64,
    http_agents: u64,
    mcp_agents: u64,
    runs: usize,
    replicas: usize,
    projects: u64,
}

impl Settings {
    fn from_env() -> Settings {
        let num = |name: &str, default: u64| -> u64 {
            std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
        };
        Settings {
            seconds: num("PRISM_SOAK_SECONDS", 120),
            seed: support::faults::seed(),
            http_agents: num("PRISM_SOAK_HTTP_AGENTS", 120),
            mcp_agents: num("PRISM_SOAK_MCP_AGENTS", 30),
            runs: num("PRISM_SOAK_RUNS", 12) as usize,
            replicas: num("PRISM_SOAK_REPLICAS", 3).max(2) as usize,
            projects: num("PRISM_SOAK_PROJECTS", 20),
        }
    }
}

/// What the load saw: calls by (what, outcome), and the answers no fault explains.
#[derive(Default)]
struct Tally {
    calls: Mutex<BTreeMap<(String, String), u64>>,
    unexpected: Mutex<Vec<String>>,
    /// The agent sessions of those answers, whose rows a failure shows.
    sessions: Mutex<Vec<String>>,
}

impl Tally {
    fn count(&self, what: &str, outcome: &str) {
        if let Ok(mut calls) = self.calls.lock() {
            *calls.entry((what.to_string(), outcome.to_string())).or_default() += 1;
        }
    }

    fn unexpected(&self, line: String) {
        if let Ok(mut u) = self.unexpected.lock() {
            u.push(line);
        }
    }
}

fn started() -> &'static Instant {
    static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    T0.get_or_init(Instant::now)
}

fn say(line: &str) {
    println!("[soak {:6.1}s] {line}", started().elapsed().as_secs_f64());
}

// --- The balancer: one address for every client, as a Service ---------------------------

/// Listens on loopback and pipes each connection to the next replica in turn that accepts
/// it; a replica being killed is taken out first, so only connections already open to it
/// are cut.
async fn balancer(backends: Arc<Mutex<Vec<Option<String>>>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the balancer");
    let addr = listener.local_addr().expect("balancer address");
    let turn = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let live: Vec<String> = backends.lock().map(|b| b.iter().flatten().cloned().collect()).unwrap_or_default();
            let first = turn.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(async move {
                for k in 0..live.len() {
                    if let Ok(mut outbound) = TcpStream::connect(&live[(first + k) % live.len()]).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

// --- The replicas -------------------------------------------------------------------------

struct Fleet {
    cp: &'static ControlPlane,
    db_url: String,
    ns: String,
    env: Vec<(String, String)>,
    slots: Vec<Option<(String, Operator)>>,
    backends: Arc<Mutex<Vec<Option<String>>>>,
    started: u32,
    logs: Vec<PathBuf>,
}

impl Fleet {
    async fn start(&mut self, i: usize) -> String {
        let name = format!("soak-{i}-{}", self.started);
        self.started += 1;
        let mut env: Vec<(&str, &str)> = self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        env.push(("POD_NAME", &name));
        let op = Operator::start(self.cp, &self.db_url, &self.ns, &env).await;
        self.logs.push(op.log.clone());
        if let Ok(mut b) = self.backends.lock() {
            b[i] = Some(op.base.trim_start_matches("http://").to_string());
        }
        self.slots[i] = Some((name.clone(), op));
        name
    }

    /// SIGKILL, after the balancer stops sending it new connections.
    fn kill(&mut self, i: usize) -> String {
        if let Ok(mut b) = self.backends.lock() {
            b[i] = None;
        }
        let (name, op) = self.slots[i].take().expect("a running replica");
        let pid = op.pid();
        drop(op); // Operator's drop is SIGKILL: no shutdown, no Lease release
        format!("{name} (pid {pid})")
    }

    async fn holder(&self) -> Option<String> {
        support::lease_holder(&self.cp.client().await).await
    }

    fn index_of(&self, name: &str) -> Option<usize> {
        self.slots.iter().position(|s| s.as_ref().is_some_and(|(n, _)| n == name))
    }
}

// --- HTTP agents ------------------------------------------------------------------------

enum Answer {
    Ok(Value),
    /// 503: a dependency is down; the change was refused as a whole.
    Unavailable,
    /// The connection was cut (a replica killed): applied or not, the caller cannot know.
    Cut,
    Refused(u16, String),
}

async fn post(http: &reqwest::Client, url: String, token: &str, body: Value) -> Answer {
    let sent = http.post(url).bearer_auth(token).json(&body).timeout(Duration::from_secs(30)).send().await;
    answer(sent).await
}

async fn answer(sent: reqwest::Result<reqwest::Response>) -> Answer {
    let Ok(r) = sent else { return Answer::Cut };
    let status = r.status().as_u16();
    let Ok(body) = r.json::<Value>().await else { return Answer::Cut };
    match status {
        200 | 201 => Answer::Ok(body),
        503 => Answer::Unavailable,
        _ => Answer::Refused(status, body["error"]["code"].as_str().unwrap_or("?").to_string()),
    }
}

fn outcome(a: &Answer) -> String {
    match a {
        Answer::Ok(_) => "ok".into(),
        Answer::Unavailable => "503".into(),
        Answer::Cut => "cut".into(),
        Answer::Refused(s, c) => format!("{s} {c}"),
    }
}

struct Agents {
    base: String,
    token: String,
    ns: String,
    projects: u64,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
}

/// One agent: sessions one after another, each registered on a drawn project with a drawn
/// surface, then 2-9 steps (heartbeat, status, switch project), then wrapped (7 in 10) or
/// abandoned. Returns the acknowledged (session, project) pairs.
async fn http_agent(a: u64, seed: u64, ctx: Arc<Agents>) -> Vec<(String, String)> {
    let http = support::http();
    let mut rng = Lcg(seed ^ (a + 1).wrapping_mul(0x9E3779B97F4A7C15));
    let mut acknowledged = Vec::new();
    let (ns, token) = (ctx.ns.as_str(), ctx.token.as_str());
    let mut generation = 0;
    while !ctx.stop.load(Ordering::Relaxed) {
        let session = format!("h{a}-{generation}");
        generation += 1;
        let surface = SURFACES[rng.next(SURFACES.len() as u64) as usize];
        let mut project = format!("PID-SOAK-{}", rng.next(ctx.projects));
        let mut id: Option<String> = None;
        // Whether the session's last change may or may not have been applied.
        let mut uncertain = false;
        let steps = 2 + rng.next(8);
        let mut step = 0;
        while step < steps + 1 && !ctx.stop.load(Ordering::Relaxed) {
            tokio::time::sleep(rng.millis(300, 1500)).await;
            let switch = id.is_some() && rng.chance(20);
            if switch {
                project = format!("PID-SOAK-{}", rng.next(ctx.projects));
            }
            let (what, a) = if id.is_none() || switch {
                let body =
                    json!({"namespace": ns, "project_id": project, "session_id": session, "agent_surface": surface});
                ("register", post(&http, format!("{}/api/v1/controller/register", ctx.base), token, body).await)
            } else if step == steps {
                let url =
                    format!("{}/api/v1/controller/{}/release?namespace={ns}", ctx.base, id.as_deref().unwrap_or(""));
                if !rng.chance(70) {
                    break; // abandoned: it stays live, as a crashed agent's session does
                }
                ("release", post(&http, url, token, json!({})).await)
            } else if rng.chance(85) {
                let body = json!({"namespace": ns, "session_id": session});
                ("heartbeat", post(&http, format!("{}/api/v1/controller/heartbeat", ctx.base), token, body).await)
            } else {
                let url =
                    format!("{}/api/v1/controller/{project}/status?namespace={ns}&session_id={session}", ctx.base);
                let sent = http.get(url).bearer_auth(token).timeout(Duration::from_secs(30)).send().await;
                ("status", answer(sent).await)
            };
            ctx.tally.count(what, &outcome(&a));
            match a {
                Answer::Ok(body) => {
                    // A status answers whether or not the session is live.
                    if what != "status" {
                        uncertain = false;
                    }
                    step += 1;
                    if what == "register" {
                        id = body["registration"]["id"].as_str().map(str::to_string);
                        acknowledged.push((session.clone(), project.clone()));
                    }
                    if what == "release" {
                        break;
                    }
                }
                Answer::Unavailable | Answer::Cut => uncertain = true,
                // Its earlier change may have been applied after all: a release that went
                // through, or a register that did not.
                Answer::Refused(404, _) if uncertain => {
                    if what == "release" {
                        break;
                    }
                    id = None;
                    uncertain = false;
                }
                Answer::Refused(status, code) => {
                    ctx.tally.unexpected(format!("{what} of {session} on {project}: {status} {code}"));
                    if let Ok(mut s) = ctx.tally.sessions.lock() {
                        s.push(session.clone());
                    }
                    break;
                }
            }
        }
    }
    acknowledged
}

// --- Runs ---------------------------------------------------------------------------------

struct RunCtx {
    base: String,
    all_done: Arc<AtomicBool>,
    tally: Arc<Tally>,
    completions: Arc<Mutex<Vec<String>>>,
    abandoned: Arc<AtomicU64>,
}

/// How a refused Run call is taken: `Some(true)` the session is lost (say hello again),
/// `Some(false)` a fault explains it (retry), None: nothing explains it.
fn run_refusal(e: &ClientError) -> Option<bool> {
    match e {
        ClientError::Http(_) => Some(false),
        ClientError::Refused { status: 503, .. } => Some(false),
        ClientError::Refused { status: 401, code, .. } if code == "session_expired" || code == "session_superseded" => {
            Some(true)
        }
        _ => None,
    }
}

fn refusal_outcome(e: &ClientError) -> String {
    match e {
        ClientError::Http(_) => "cut".into(),
        ClientError::Refused { status, code, .. } => format!("{status} {code}"),
        ClientError::Key(_) => "key".into(),
        ClientError::NoSession => "no session".into(),
    }
}

/// A Run process: hello, then heartbeat every second and claim, progress and complete its
/// jobs. `kill` makes it die holding what it claimed next; it starts again (a new process,
/// a new hello) a second later.
async fn run_process(server: String, key: ed25519_dalek::SigningKey, kill: Arc<AtomicBool>, ctx: Arc<RunCtx>) {
    let tally = &ctx.tally;
    'process: while !ctx.all_done.load(Ordering::Relaxed) {
        let mut run = RunClient::new(&ctx.base, &server, "run", 1, key.clone());
        loop {
            if ctx.all_done.load(Ordering::Relaxed) {
                return;
            }
            match run.hello().await {
                Ok(_) => {
                    tally.count("run hello", "ok");
                    break;
                }
                Err(e) => {
                    tally.count("run hello", &refusal_outcome(&e));
                    if run_refusal(&e).is_none() {
                        tally.unexpected(format!("hello of {server}: {e}"));
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            }
        }
        let mut beat = Instant::now();
        while !ctx.all_done.load(Ordering::Relaxed) {
            if beat.elapsed() >= Duration::from_secs(1) {
                beat = Instant::now();
                match run.heartbeat().await {
                    Ok(_) => tally.count("run heartbeat", "ok"),
                    Err(e) => {
                        tally.count("run heartbeat", &refusal_outcome(&e));
                        match run_refusal(&e) {
                            Some(true) => continue 'process,
                            Some(false) => {}
                            None => tally.unexpected(format!("heartbeat of {server}: {e}")),
                        }
                    }
                }
            }
            let jobs = match run.claim(2).await {
                Ok(jobs) => {
                    tally.count("run claim", "ok");
                    jobs
                }
                Err(e) => {
                    tally.count("run claim", &refusal_outcome(&e));
                    match run_refusal(&e) {
                        Some(true) => continue 'process,
                        Some(false) => {}
                        None => tally.unexpected(format!("claim of {server}: {e}")),
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            if jobs.is_empty() {
                tokio::time::sleep(Duration::from_millis(300)).await;
                continue;
            }
            if kill.swap(false, Ordering::Relaxed) {
                ctx.abandoned.fetch_add(jobs.len() as u64, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue 'process;
            }
            let claimed = Instant::now();
            for job in jobs {
                let mode = JobMode::named(job.payload["mode"].as_str().unwrap_or_default());
                let end = match mode {
                    // The first attempt fails, worth another.
                    JobMode::Retry if job.attempts == 1 => {
                        json!({"outcome": "failed", "retryable": true, "error": "first attempt fails", "result": {}})
                    }
                    _ => json!({"outcome": "succeeded", "result": {"by": server}}),
                };
                for (action, body) in [("progress", json!({"progress": {"pct": 50}})), ("complete", end)] {
                    let mut body = body;
                    if action == "complete" {
                        match mode {
                            JobMode::Slow => tokio::time::sleep(Duration::from_millis(2500)).await,
                            JobMode::Cancel => tokio::time::sleep(Duration::from_millis(600)).await,
                            _ => {}
                        }
                    }
                    match run.step(&job.id, action, Some(body.clone())).await {
                        Ok(answer) => {
                            tally.count(&format!("run {action}"), "ok");
                            // Completions that finished the job (a retryable failure
                            // queues it again: not a completion).
                            if action == "complete"
                                && answer.state.finished()
                                && let Ok(mut c) = ctx.completions.lock()
                            {
                                c.push(job.id.to_string());
                            }
                            // Asked to stop: it stops, and says so.
                            if action == "progress" && answer.cancel_requested {
                                body = json!({"outcome": "cancelled"});
                                match run.step(&job.id, "complete", Some(body)).await {
                                    Ok(_) => {
                                        tally.count("run complete cancelled", "ok");
                                        if let Ok(mut c) = ctx.completions.lock() {
                                            c.push(job.id.to_string());
                                        }
                                    }
                                    Err(e) => tally.count("run complete cancelled", &refusal_outcome(&e)),
                                }
                                break;
                            }
                        }
                        Err(e) => {
                            tally.count(&format!("run {action}"), &refusal_outcome(&e));
                            // A claim older than the visibility timeout went back to the
                            // queue: the job is another attempt's now, and this attempt's
                            // steps are stale (SPEC §12).
                            // (A slow job's attempt outlives its 1 s deadline: queued again.)
                            let expired = (claimed.elapsed() >= Duration::from_secs(VISIBILITY_SECONDS - 1)
                                || mode == JobMode::Slow)
                                && matches!(&e, ClientError::Refused { status: 409, code, .. } if code == "stale_attempt" || code == "invalid_state");
                            // Ended under it: cancelled past its grace, a deadline passed,
                            // its term moved on, or the visibility timeout ended it for good.
                            let finished = matches!(&e, ClientError::Refused { status: 409, code, .. } if code == "job_finished" || code == "deadline_exceeded")
                                && (mode != JobMode::Plain
                                    || claimed.elapsed() >= Duration::from_secs(VISIBILITY_SECONDS - 1));
                            match run_refusal(&e) {
                                Some(true) => continue 'process,
                                Some(false) => {}
                                None if expired || finished => {}
                                None => tally.unexpected(format!("{action} of job {} by {server}: {e}", job.id)),
                            }
                            break;
                        }
                    }
                }
            }
        }
    }
}

/// What the dispatcher asks of a job, and so how its Run treats it and where it may end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum JobMode {
    Plain,
    /// The first attempt fails retryably; a later one succeeds.
    Retry,
    /// Cancelled 400 ms after its enqueue.
    Cancel,
    /// Each attempt outlives its 1 s deadline: failed after 2.
    Slow,
    /// Enqueued twice with one idempotency key.
    Idempotent,
    /// Fenced to a project's term, which the agents' churn moves on.
    Fenced,
}

impl JobMode {
    const ALL: [JobMode; 6] =
        [JobMode::Plain, JobMode::Retry, JobMode::Cancel, JobMode::Slow, JobMode::Idempotent, JobMode::Fenced];

    fn of(n: u64) -> JobMode {
        Self::ALL[(n % 6) as usize]
    }

    fn name(self) -> &'static str {
        match self {
            JobMode::Plain => "plain",
            JobMode::Retry => "retry",
            JobMode::Cancel => "cancel",
            JobMode::Slow => "slow",
            JobMode::Idempotent => "idempotent",
            JobMode::Fenced => "fenced",
        }
    }

    fn named(name: &str) -> JobMode {
        Self::ALL.into_iter().find(|m| m.name() == name).unwrap_or(JobMode::Plain)
    }

    /// The states a job of this mode may end in, whatever the faults did.
    fn may_end(self, state: &str, last_error: Option<&str>, cancel_reason: Option<&str>) -> bool {
        match self {
            JobMode::Plain | JobMode::Retry | JobMode::Idempotent => state == "succeeded",
            JobMode::Cancel => state == "cancelled" || state == "succeeded",
            JobMode::Slow => {
                state == "failed" && matches!(last_error, Some("deadline_exceeded" | "visibility_timeout"))
            }
            JobMode::Fenced => state == "succeeded" || (state == "cancelled" && cancel_reason == Some("stale_term")),
        }
    }
}

// --- Faults ---------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    KillLeader,
    KillFollower,
    PostgresBackendKills,
    PostgresRestart,
    RedisRestart,
    RedisFlush,
    RedisFailover,
    RedisMasterKilled,
    RunKilledMidJob,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::KillLeader => "kill -9 of the leader replica",
            Fault::KillFollower => "kill -9 of a follower replica",
            Fault::PostgresBackendKills => "Postgres backends killed (pg_terminate_backend, 2 s)",
            Fault::PostgresRestart => "Postgres restart",
            Fault::RedisRestart => "Redis restart (data lost)",
            Fault::RedisFlush => "Redis FLUSHALL",
            Fault::RedisFailover => "Redis master failover (CLUSTER FAILOVER)",
            Fault::RedisMasterKilled => "kill -9 of a Redis master",
            Fault::RunKilledMidJob => "a Run killed holding claimed jobs",
        }
    }
}

struct Stage {
    fleet: Fleet,
    pg: Arc<PrivatePostgres>,
    redis: PrivateRedis,
    run_kills: Vec<Arc<AtomicBool>>,
}

/// Injects one fault and waits for what it breaks to be back (a replica started again,
/// Postgres or Redis up); returns what was done.
async fn inject(fault: Fault, rng: &mut Lcg, stage: &mut Stage) -> String {
    match fault {
        Fault::KillLeader | Fault::KillFollower => {
            let mut holder = None;
            for _ in 0..100 {
                holder = stage.fleet.holder().await.and_then(|h| stage.fleet.index_of(&h));
                if holder.is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let n = stage.fleet.slots.len();
            let (victim, role) = match (fault, holder) {
                (Fault::KillLeader, Some(h)) => (h, "the leader"),
                (_, Some(h)) => ((h + 1 + rng.next(n as u64 - 1) as usize) % n, "a follower"),
                (_, None) => (rng.next(n as u64) as usize, "a replica (no leader now)"),
            };
            let killed = stage.fleet.kill(victim);
            let down = rng.millis(500, 3000);
            tokio::time::sleep(down).await;
            let name = stage.fleet.start(victim).await;
            format!("killed {role} {killed}; {name} started {:.1} s later", down.as_secs_f64())
        }
        Fault::PostgresBackendKills => {
            let admin = stage.pg.url.clone();
            let (stop, killed, task) = backend_killer(&admin, "postgres", Duration::from_millis(100)).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            stop.store(true, Ordering::Relaxed);
            let _ = task.await;
            format!("{} backends terminated", killed.load(Ordering::Relaxed))
        }
        Fault::PostgresRestart => {
            let down = rng.millis(1000, 4000);
            stage.pg.ctl("stop").await;
            tokio::time::sleep(down).await;
            stage.pg.ctl("start").await;
            format!("down {:.1} s", down.as_secs_f64())
        }
        Fault::RedisRestart => {
            let down = rng.millis(500, 3000);
            stage.redis.down().await;
            tokio::time::sleep(down).await;
            stage.redis.up().await;
            format!("down {:.1} s", down.as_secs_f64())
        }
        Fault::RedisFlush => {
            stage.redis.flushall().await;
            "every key gone".into()
        }
        Fault::RedisFailover | Fault::RedisMasterKilled => {
            let pick = rng.next(3) as usize;
            let done = if fault == Fault::RedisFailover {
                stage.redis.failover(pick).await
            } else {
                stage.redis.kill_master(pick).await
            };
            done.unwrap_or_else(|| "not applicable".into())
        }
        Fault::RunKilledMidJob => {
            let i = rng.next(stage.run_kills.len() as u64) as usize;
            stage.run_kills[i].store(true, Ordering::Relaxed);
            format!("Run srv-soak-{i} dies with its next claim")
        }
    }
}

// --- The harness ------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "the fault harness: scripts/soak runs it (scripts/test for a few minutes)"]
async fn the_fault_harness() {
    let settings = Settings::from_env();
    let seed = settings.seed;
    started();
    say(&format!(
        "seed {seed}, {} s, {} replicas, {} HTTP agents, {} MCP agents, {} Runs, {} projects, Redis {}",
        settings.seconds,
        settings.replicas,
        settings.http_agents,
        settings.mcp_agents,
        settings.runs,
        settings.projects,
        support::redis_mode()
    ));
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "soak").await;
    let pg = Arc::new(PrivatePostgres::start().await);
    let redis = PrivateRedis::start_with_replicas(1).await;
    let redis_url = redis.url.clone();
    let mcp_key = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
    let env = [
        ("PRISM_LEADER_ELECTION", "true".to_string()),
        ("REDIS_URL", redis_url),
        ("PRISM_REDIS_PREFIX", support::redis_prefix()),
        ("PRISM_JOB_VISIBILITY_SECONDS", VISIBILITY_SECONDS.to_string()),
        // The load's agents share one identity and abandon sessions (swept later): more
        // than the default quota of live sessions per identity (tests/hostile.rs proves
        // the quota).
        ("PRISM_MAX_SESSIONS_PER_IDENTITY", "1000000".to_string()),
        // Their 150 agents' calls are one identity's too: its per-identity rate is opened
        // as wide (tests/hostile.rs proves the rate limit).
        ("PRISM_RATE_PER_IDENTITY", "1000000".to_string()),
        ("PRISM_BURST_PER_IDENTITY", "10000000".to_string()),
        // And every agent and Run of the load calls from 127.0.0.1: the per-address budget
        // of unauthenticated work (new tokens, hellos, a Run's new session token) is opened
        // as wide, where each would have its own address.
        ("PRISM_UNAUTHENTICATED_RATE", "100000".to_string()),
        ("PRISM_UNAUTHENTICATED_BURST", "100000".to_string()),
        ("PRISM_MCP_SESSION_KEY", mcp_key),
        ("RUST_LOG", "info".to_string()),
    ];
    let backends = Arc::new(Mutex::new(vec![None; settings.replicas]));
    let mut fleet = Fleet {
        cp,
        db_url: pg.url.clone(),
        ns: ns.clone(),
        env: env.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
        slots: (0..settings.replicas).map(|_| None).collect(),
        backends: backends.clone(),
        started: 0,
        logs: Vec::new(),
    };
    for i in 0..settings.replicas {
        fleet.start(i).await;
    }
    let base = balancer(backends).await;
    say(&format!("{} replicas behind {base}; Postgres {}, Redis {}", settings.replicas, pg.url, redis.url));

    let agent_token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;
    let dispatcher = support::sa_token(cp, &ns, "dispatcher", "runsessions", &["get", "list", "update"]).await;
    // Fenced jobs read the election: the dispatcher may `get` registrations.
    support::grant(cp, &ns, "dispatcher", "controllerregistrations", &["get"]).await;

    // The Runs' identities, mirrored into Postgres by the leader.
    let runs: Api<RunSession> = Api::namespaced(client.clone(), &ns);
    let mut keys = Vec::new();
    for i in 0..settings.runs {
        let server = format!("srv-soak-{i}");
        keys.push(support::create_run_session(&runs, &server, &server, None).await);
    }
    let db = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&pg.url).await.expect("connect");
    support::eventually(60, "every Run identity mirrored", || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM run_identities").fetch_one(&db).await.ok()?;
        (n as usize == settings.runs).then_some(())
    })
    .await;
    let durable = std::env::temp_dir().join(format!("prism-soak-durable-{}", uuid::Uuid::new_v4().simple()));
    let durable = durable.to_str().expect("utf-8").to_string();
    let (ok, out) = support::faults::check_invariants(&pg.url, &["--save-durable", &durable]).await;
    assert!(ok, "save the durable rows: {out}");

    // The load.
    let stop = Arc::new(AtomicBool::new(false));
    let all_done = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let agents = Arc::new(Agents {
        base: base.clone(),
        token: agent_token.clone(),
        ns: ns.clone(),
        projects: settings.projects,
        stop: stop.clone(),
        tally: tally.clone(),
    });
    let http_agents: Vec<_> =
        (0..settings.http_agents).map(|a| tokio::spawn(http_agent(a, seed, agents.clone()))).collect();
    let mcp = tokio::process::Command::new(support::mcp_python().await)
        .arg(support::repo_root().join("tests/mcp/load.py"))
        .args(["--url", &format!("{base}/mcp"), "--token", &agent_token, "--namespace", &ns])
        .args(["--agents", &settings.mcp_agents.to_string(), "--seconds", &settings.seconds.to_string()])
        .args(["--seed", &seed.to_string(), "--projects", &settings.projects.to_string()])
        .kill_on_drop(true)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the MCP agents");
    let run_ctx = Arc::new(RunCtx {
        base: base.clone(),
        all_done: all_done.clone(),
        tally: tally.clone(),
        completions: Arc::new(Mutex::new(Vec::new())),
        abandoned: Arc::new(AtomicU64::new(0)),
    });
    let run_kills: Vec<Arc<AtomicBool>> = (0..settings.runs).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let run_tasks: Vec<_> = keys
        .into_iter()
        .enumerate()
        .map(|(i, key)| tokio::spawn(run_process(format!("srv-soak-{i}"), key, run_kills[i].clone(), run_ctx.clone())))
        .collect();
    let enqueued = Arc::new(Mutex::new(Vec::<String>::new()));
    let dispatcher_task = {
        let (base, stop, tally, enqueued, runs, db) =
            (base.clone(), stop.clone(), tally.clone(), enqueued.clone(), settings.runs as u64, db.clone());
        tokio::spawn(async move {
            let http = support::http();
            let mut rng = Lcg(seed ^ 0xD15);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let mode = JobMode::of(n);
                let mut body = json!({"server_instance_id": format!("srv-soak-{}", rng.next(runs)), "component_kind": "run",
                                      "kind": "config", "payload": {"n": n, "mode": mode.name()}, "max_attempts": 100});
                match mode {
                    // One attempt may run 1 s; the Run takes 2.5 s: each attempt passes its
                    // deadline, and after 2 the job failed for good.
                    JobMode::Slow => {
                        body["timeout_seconds"] = json!(1);
                        body["max_attempts"] = json!(2);
                    }
                    JobMode::Idempotent => body["idempotency_key"] = json!(format!("soak-{n}")),
                    // Fenced with a project's current term, as its master would.
                    JobMode::Fenced => {
                        let current: Option<(String, String, i64)> = sqlx::query_as(
                            "SELECT namespace, project_id, term FROM controller_projects WHERE master_id IS NOT NULL
                             ORDER BY updated_at DESC LIMIT 1",
                        )
                        .fetch_optional(&db)
                        .await
                        .ok()
                        .flatten();
                        match current {
                            Some((namespace, project_id, term)) => {
                                body["fence"] = json!({"namespace": namespace, "project_id": project_id, "term": term})
                            }
                            None => body["payload"]["mode"] = json!(JobMode::Plain.name()),
                        }
                    }
                    _ => {}
                }
                n += 1;
                let a = post(&http, format!("{base}/api/v1/runtime/jobs"), &dispatcher, body.clone()).await;
                tally.count("enqueue", &outcome(&a));
                match a {
                    Answer::Ok(job) => {
                        let id = job["id"].as_str().unwrap_or_default().to_string();
                        if let Ok(mut e) = enqueued.lock() {
                            e.push(id.clone());
                        }
                        match mode {
                            // The same request again: the same job, not a second one.
                            JobMode::Idempotent => {
                                match post(&http, format!("{base}/api/v1/runtime/jobs"), &dispatcher, body).await {
                                    Answer::Ok(again) if again["id"] == job["id"] => {
                                        tally.count("enqueue again", "same job")
                                    }
                                    Answer::Ok(again) => {
                                        tally.unexpected(format!("idempotent enqueue: {id} then {}", again["id"]))
                                    }
                                    Answer::Unavailable | Answer::Cut => tally.count("enqueue again", "503 or cut"),
                                    Answer::Refused(s, c) => {
                                        tally.unexpected(format!("idempotent enqueue again: {s} {c}"))
                                    }
                                }
                            }
                            // Cancelled soon after: queued, or in flight (the Run is told).
                            JobMode::Cancel => {
                                let (http, tally, base, token) =
                                    (http.clone(), tally.clone(), base.clone(), dispatcher.clone());
                                let ns = job["namespace"].as_str().unwrap_or_default().to_string();
                                tokio::spawn(async move {
                                    tokio::time::sleep(Duration::from_millis(400)).await;
                                    let url = format!("{base}/api/v1/runtime/jobs/{id}/cancel?namespace={ns}");
                                    let sent = http
                                        .post(url)
                                        .bearer_auth(&token)
                                        .timeout(Duration::from_secs(30))
                                        .send()
                                        .await;
                                    let status = sent.as_ref().map(|r| r.status().as_u16()).unwrap_or(0);
                                    match status {
                                        200 | 202 | 409 => tally.count("cancel", &status.to_string()),
                                        0 | 503 => tally.count("cancel", "503 or cut"),
                                        other => tally.unexpected(format!("cancel of {id}: {other}")),
                                    }
                                });
                            }
                            _ => {}
                        }
                    }
                    Answer::Unavailable | Answer::Cut => {}
                    // The fence's term moved on between the read and the enqueue.
                    Answer::Refused(409, c) if mode == JobMode::Fenced && c == "stale_term" => {}
                    Answer::Refused(s, c) => tally.unexpected(format!("enqueue: {s} {c}")),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    // The faults: every kind once per round, in a seeded order, at seeded gaps; none in
    // the last 15 s of the load, so that the end is the recovery.
    let mut stage = Stage { fleet, pg: pg.clone(), redis, run_kills };
    let mut rng = Lcg(seed);
    let mut kinds = vec![
        Fault::KillLeader,
        Fault::KillFollower,
        Fault::PostgresBackendKills,
        Fault::PostgresRestart,
        Fault::RedisRestart,
        Fault::RedisFlush,
        Fault::RunKilledMidJob,
    ];
    if support::redis_cluster_mode() {
        kinds.extend([Fault::RedisFailover, Fault::RedisMasterKilled]);
    }
    let mut injected: BTreeMap<Fault, u32> = BTreeMap::new();
    let load_until = Instant::now() + Duration::from_secs(settings.seconds);
    let faults_until = load_until - Duration::from_secs(15.min(settings.seconds / 4));
    let mut count = 0;
    'rounds: loop {
        let mut round = kinds.clone();
        for i in (1..round.len()).rev() {
            round.swap(i, rng.next(i as u64 + 1) as usize);
        }
        for fault in round {
            let gap = rng.millis(2000, 6000);
            if Instant::now() + gap >= faults_until {
                break 'rounds;
            }
            tokio::time::sleep(gap).await;
            count += 1;
            let t = Instant::now();
            let what = inject(fault, &mut rng, &mut stage).await;
            *injected.entry(fault).or_default() += 1;
            say(&format!("fault {count}: {}: {what} ({:.1} s)", fault.name(), t.elapsed().as_secs_f64()));
        }
    }
    tokio::time::sleep(load_until.saturating_duration_since(Instant::now())).await;
    say("load stops; the Runs finish the queue");
    stop.store(true, Ordering::Relaxed);
    let mut acknowledged: Vec<(String, String)> = Vec::new();
    // Each of them stops within a call (30 s at most) of being told: a harness that waits
    // longer fails saying so rather than hanging CI.
    let agents_done = tokio::time::timeout(Duration::from_secs(90), futures::future::join_all(http_agents))
        .await
        .expect("the HTTP agents stop within 90 s of the load's end");
    for a in agents_done {
        acknowledged.extend(a.expect("agent"));
    }
    tokio::time::timeout(Duration::from_secs(90), dispatcher_task)
        .await
        .expect("the dispatcher stops within 90 s of the load's end")
        .expect("dispatcher");
    let mcp = tokio::time::timeout(Duration::from_secs(120), mcp.wait_with_output())
        .await
        .expect("the MCP agents end within 120 s of their time")
        .expect("MCP agents");
    let mcp_out = String::from_utf8_lossy(&mcp.stdout).to_string();
    let mcp_report: Value = serde_json::from_str(mcp_out.lines().last().unwrap_or_default()).unwrap_or_else(|e| {
        panic!("the MCP agents printed no report ({e}):\n{mcp_out}\n{}", String::from_utf8_lossy(&mcp.stderr))
    });
    for pair in mcp_report["acknowledged"].as_array().into_iter().flatten() {
        if let (Some(s), Some(p)) = (pair[0].as_str(), pair[1].as_str()) {
            acknowledged.push((s.to_string(), p.to_string()));
        }
    }

    // Every job enqueued (acknowledged or not) ends succeeded: the Runs drain the queue.
    let drained = {
        let db = &db;
        tokio::time::timeout(Duration::from_secs(120), async move {
            loop {
                let open: Option<i64> = sqlx::query_scalar(
                    "SELECT count(*) FROM runtime_jobs WHERE state NOT IN ('succeeded','failed','cancelled')",
                )
                .fetch_one(db)
                .await
                .ok();
                if open == Some(0) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
        .await
    };
    all_done.store(true, Ordering::Relaxed);
    let stopping: Vec<_> = run_tasks.iter().map(|r| r.abort_handle()).collect();
    if tokio::time::timeout(Duration::from_secs(90), futures::future::join_all(run_tasks)).await.is_err() {
        stopping.iter().for_each(|r| r.abort());
        tally.unexpected("a Run was still busy 90 s after the queue drained (a call that never ended)".to_string());
    }

    // What the load saw.
    let calls = tally.calls.lock().expect("tally").clone();
    let mut by_what: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for ((what, outcome), n) in &calls {
        by_what.entry(what).or_default().push(format!("{outcome} {n}"));
    }
    say(&format!("faults injected: {count}"));
    for (fault, n) in &injected {
        say(&format!("  {:>3} × {}", n, fault.name()));
    }
    say("HTTP calls by outcome (503 and cut connections are what the faults may cause):");
    for (what, outcomes) in &by_what {
        say(&format!("  {what}: {}", outcomes.join(", ")));
    }
    say(&format!("MCP calls by outcome: {}", mcp_report["calls"]));
    let completions = run_ctx.completions.lock().expect("completions").clone();
    let enqueued = enqueued.lock().expect("enqueued").clone();
    say(&format!(
        "{} registrations acknowledged (HTTP and MCP), {} jobs enqueued, {} completions acknowledged, {} claimed jobs abandoned by killed Runs",
        acknowledged.len(),
        enqueued.len(),
        completions.len(),
        run_ctx.abandoned.load(Ordering::Relaxed)
    ));

    // Nothing the faults do not explain; the rows of a session that got such an answer.
    let unexpected = tally.unexpected.lock().expect("unexpected").clone();
    let sessions = tally.sessions.lock().expect("sessions").clone();
    for session in &sessions {
        let rows: Vec<(String, String, String, Option<String>)> = sqlx::query_as(
            "SELECT id::text, project_id, registered_at::text, released_at::text || ' ' || release_reason
             FROM controller_registrations WHERE namespace = $1 AND session_id = $2 ORDER BY registered_at",
        )
        .bind(&ns)
        .bind(session)
        .fetch_all(&db)
        .await
        .unwrap_or_default();
        say(&format!("rows of {session}: {rows:?}"));
    }
    assert!(unexpected.is_empty(), "answers no fault explains ({}):\n{}", unexpected.len(), unexpected.join("\n"));
    assert_eq!(mcp_report["unexpected_count"], 0, "MCP answers no fault explains: {}", mcp_report["unexpected"]);
    for kind in &kinds {
        assert!(injected.contains_key(kind), "{} was never injected: run longer", kind.name());
    }
    assert!(drained.is_ok(), "every job ends finished within 120 s of the load's end");

    // No replica died but those killed, none panicked; every one is ready again.
    let http = support::http();
    for (name, op) in stage.fleet.slots.iter_mut().flatten() {
        assert!(op.exited().is_none(), "replica {name} exited by itself:\n{}", op.logs());
        let url = op.url("/readyz");
        support::eventually(60, &format!("{name} is ready"), || async {
            http.get(&url).send().await.ok()?.status().is_success().then_some(())
        })
        .await;
    }
    for log in &stage.fleet.logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        assert!(!text.contains("panicked"), "a replica panicked ({}):\n{text}", log.display());
    }
    let a = post(
        &http,
        format!("{base}/api/v1/controller/register"),
        &agent_token,
        json!({"namespace": ns, "project_id": "PID-SOAK-AFTER", "session_id": "after", "agent_surface": "codex"}),
    )
    .await;
    assert!(matches!(a, Answer::Ok(_)), "a registration after the faults: {}", outcome(&a));

    // Every acknowledged registration and job is in the database; every job succeeded.
    let rows: Vec<(String, String)> = sqlx::query_as("SELECT session_id, project_id FROM controller_registrations")
        .fetch_all(&db)
        .await
        .expect("rows");
    let rows: HashSet<(String, String)> = rows.into_iter().collect();
    let lost: Vec<_> = acknowledged.iter().filter(|p| !rows.contains(*p)).collect();
    assert!(lost.is_empty(), "acknowledged registrations missing from the database: {lost:?}");
    // Every job ended where its mode allows (SPEC §5.1): plain, retried and idempotent
    // ones succeeded, cancelled ones were cancelled (or had finished first), slow ones
    // failed by their deadline, fenced ones succeeded or were cancelled by a new term.
    type JobRow = (String, String, String, i32, Option<String>, Option<String>);
    let jobs: Vec<JobRow> = sqlx::query_as(
        "SELECT id::text, payload->>'mode', state, attempts, last_error, cancel_reason FROM runtime_jobs",
    )
    .fetch_all(&db)
    .await
    .expect("jobs");
    let mut ends: BTreeMap<String, u32> = BTreeMap::new();
    for (id, mode, state, attempts, last_error, cancel_reason) in &jobs {
        let mode = JobMode::named(mode);
        assert!(
            mode.may_end(state, last_error.as_deref(), cancel_reason.as_deref()),
            "job {id} ({}) ended {state} after {attempts} attempt(s), last error {last_error:?}, cancel reason {cancel_reason:?}",
            mode.name()
        );
        if mode == JobMode::Retry {
            assert!(*attempts >= 2, "retried job {id} succeeded at attempt {attempts}");
        }
        *ends.entry(format!("{} {state}", mode.name())).or_default() += 1;
    }
    say(&format!("jobs by mode and end: {ends:?}"));
    let ids: HashSet<&str> = jobs.iter().map(|j| j.0.as_str()).collect();
    for id in &enqueued {
        assert!(ids.contains(id.as_str()), "acknowledged job {id} is in the database");
    }
    for mode in JobMode::ALL {
        assert!(ends.keys().any(|k| k.starts_with(mode.name())), "no {} job ran: run longer", mode.name());
    }

    // What `kubectl get` shows agrees with the database: at most one Master per project,
    // the project's master; checked once the leader has caught up.
    let cregs: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    let disagreement = || async {
        let masters: Vec<(String, String)> = sqlx::query_as(
            "SELECT project_id, master_id::text FROM controller_projects WHERE master_id IS NOT NULL AND namespace = $1",
        )
        .bind(&ns)
        .fetch_all(&db)
        .await
        .ok()?;
        let masters: BTreeMap<String, String> = masters.into_iter().collect();
        let list = cregs.list(&ListParams::default()).await.ok()?;
        let mut shown: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for c in &list.items {
            if c.status.as_ref().is_some_and(|s| s.role == Role::Master) {
                shown.entry(c.spec.project_id.clone()).or_default().push(c.metadata.uid.clone().unwrap_or_default());
            }
        }
        let wrong: Vec<String> = shown
            .iter()
            .filter(|(p, uids)| uids.len() > 1 || masters.get(*p) != uids.first())
            .map(|(p, uids)| format!("{p}: kubectl shows Master {uids:?}, the database {:?}", masters.get(p)))
            .collect();
        Some(wrong)
    };
    let mut last = Vec::new();
    let agreed = tokio::time::timeout(Duration::from_secs(90), async {
        loop {
            if let Some(wrong) = disagreement().await {
                if wrong.is_empty() {
                    return;
                }
                last = wrong;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
    .await;
    assert!(agreed.is_ok(), "kubectl's Masters agree with the database:\n{}", last.join("\n"));

    // The independent checker.
    let file = std::env::temp_dir().join(format!("prism-soak-completions-{}", uuid::Uuid::new_v4().simple()));
    std::fs::write(&file, completions.join("\n")).expect("write completions");
    let (ok, out) = support::faults::check_invariants(
        &pg.url,
        &["--namespace-prefix", &ns, "--completions", file.to_str().expect("utf-8"), "--durable-before", &durable],
    )
    .await;
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&durable);
    for line in out.lines() {
        say(&format!("checker: {line}"));
    }
    assert!(ok, "SPEC §10's invariants after the faults (seed {seed}):\n{out}");
    for log in &stage.fleet.logs {
        let _ = std::fs::remove_file(log);
    }
    say(&format!("seed {seed}: invariants hold"));
}

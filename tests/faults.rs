//! Faults under load (SPEC §10): the operator's Postgres backends are killed
//! (`pg_terminate_backend`) again and again, Postgres is restarted, and the leader of two
//! operator replicas is killed (SIGKILL), while agents register, preempt and switch
//! projects over HTTP and a Run claims jobs. Afterwards the independent checker
//! (tests/faults/check_invariants.py) finds every invariant holding, every registration the
//! API acknowledged is in the database, and an operator process answers again without a
//! restart.

use prism_testkit as support;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use support::faults::{self, Lcg, backend_killer};
use support::{Operator, TestDb, control_plane};

const WORKERS: u64 = 8;
const CALLS_PER_WORKER: u64 = 40;
const PROJECTS: u64 = 6;
const SURFACES: [&str; 4] = ["claude_code", "codex", "cursor", "claude_desktop"];

type Acknowledged = Vec<(String, String)>;
type Refused = std::collections::BTreeMap<u16, u64>;

/// The storm: each worker registers its session on a project drawn from the seed, with a
/// surface drawn too (desktops preempt), and moves it to other projects (context
/// switches). Returns the (session, project) pairs the API acknowledged and the refusals
/// by status.
async fn storm(op: &Operator, token: &str, ns: &str, seed: u64) -> (Acknowledged, Refused) {
    storm_over(std::slice::from_ref(&op.base), token, ns, seed).await
}

/// The storm against several replicas: worker `w` starts on replica `w % n`; a replica
/// that does not answer at all (killed) counts as status 0, and the worker moves to the
/// next one, as a Service would send it.
async fn storm_over(bases: &[String], token: &str, ns: &str, seed: u64) -> (Acknowledged, Refused) {
    let http = support::http();
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let (http, bases, token, ns) = (http.clone(), bases.to_vec(), token.to_string(), ns.to_string());
        workers.push(tokio::spawn(async move {
            let mut rng = Lcg(seed ^ (w + 1).wrapping_mul(0x9E3779B97F4A7C15));
            let mut acknowledged = Vec::new();
            let mut refused = Refused::new();
            let mut replica = w as usize % bases.len();
            for i in 0..CALLS_PER_WORKER {
                let session = format!("s-{w}-{}", i / 8); // a session lives for 8 calls
                let project = format!("PID-PGF-{}", rng.next(PROJECTS));
                let surface = SURFACES[rng.next(SURFACES.len() as u64) as usize];
                let sent = http
                    .post(format!("{}/api/v1/controller/register", bases[replica]))
                    .bearer_auth(&token)
                    .json(&json!({"namespace": ns, "project_id": project, "session_id": session, "agent_surface": surface}))
                    .send()
                    .await;
                let Ok(r) = sent else {
                    *refused.entry(0).or_default() += 1;
                    replica = (replica + 1) % bases.len();
                    continue;
                };
                let mut status = r.status().as_u16();
                // SPEC §15: a 503 says when to retry (Retry-After); one that does not is
                // counted apart, as 999, and fails the storms' "only 503" checks.
                if status == 503 && !r.headers().contains_key("retry-after") {
                    status = 999;
                }
                if status == 200 {
                    acknowledged.push((session, project));
                } else {
                    *refused.entry(status).or_default() += 1;
                }
            }
            (acknowledged, refused)
        }));
    }
    let mut acknowledged = Vec::new();
    let mut refused = Refused::new();
    for w in workers {
        let (a, r) = w.await.expect("worker");
        acknowledged.extend(a);
        for (k, v) in r {
            *refused.entry(k).or_default() += v;
        }
    }
    (acknowledged, refused)
}

/// What must hold after a storm under faults: the same operator process is ready again and
/// takes a registration, every acknowledged registration has its row, and the independent
/// checker finds SPEC §10's invariants.
async fn after_the_storm(op: &Operator, token: &str, ns: &str, db_url: &str, acknowledged: &Acknowledged, what: &str) {
    let http = support::http();
    support::eventually(60, "the operator is ready again", || async {
        let r = http.get(op.url("/readyz")).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await;
    let r = http
        .post(op.url("/api/v1/controller/register"))
        .bearer_auth(token)
        .json(&json!({"namespace": ns, "project_id": "PID-PGF-AFTER", "session_id": "after", "agent_surface": "codex"}))
        .send()
        .await
        .expect("register after");
    assert_eq!(r.status(), 200, "a registration after the faults");
    assert!(std::path::Path::new(&format!("/proc/{}", op.pid())).exists(), "the operator was not restarted");

    let pool = PgPoolOptions::new().max_connections(1).connect(db_url).await.expect("connect");
    for (session, project) in acknowledged {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM controller_registrations WHERE namespace = $1 AND session_id = $2 AND project_id = $3",
        )
        .bind(ns)
        .bind(session)
        .bind(project)
        .fetch_one(&pool)
        .await
        .expect("count");
        assert!(n >= 1, "acknowledged registration of {session} on {project} is in the database");
    }
    pool.close().await;
    let (ok, stdout) = faults::check_invariants(db_url, &["--namespace-prefix", ns]).await;
    println!("{stdout}");
    assert!(ok, "invariants after {what}:\n{stdout}");
}

#[tokio::test]
async fn killed_backends_mid_election_storm_leave_no_half_applied_change() {
    let seed = faults::seed();
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "pgfaults").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;

    let (stop, killed, killer) =
        backend_killer(&support::admin_database_url(), &db.name, Duration::from_millis(150)).await;

    let (acknowledged, refused) = storm(&op, &token, &ns, seed).await;
    stop.store(true, Ordering::Relaxed);
    killer.await.expect("killer");
    let kills = killed.load(Ordering::Relaxed);
    println!(
        "seed {seed}: {} registrations acknowledged, refused {refused:?}, {kills} backends killed",
        acknowledged.len()
    );
    assert!(kills > 0, "the fault was injected");
    assert!(!acknowledged.is_empty(), "some calls got through between the kills");
    // A killed transaction is refused as a whole, and says so as an unavailable dependency.
    assert!(
        refused.keys().all(|s| *s == 503),
        "calls refused during the kills are 503 (dependency unavailable), not {refused:?}"
    );

    after_the_storm(&op, &token, &ns, &db.url, &acknowledged, &format!("backend kills (seed {seed})")).await;
}

/// Jobs claimed and completed by a Run while the operator's backends are killed: every job
/// ends finished, none is completed twice (the checker reads the completions the Run was
/// told of), lost answers only delay a job (its visibility timeout gives it back).
#[tokio::test]
async fn killed_backends_mid_claims_complete_every_job_at_most_once() {
    use prism_operator::crd::RunSession;
    use prism_operator::run_client::RunClient;

    const JOBS: usize = 300;
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "pgclaims").await;
    let db = TestDb::new().await;
    let redis = support::PrivateRedis::start().await;
    let prefix = support::redis_prefix();
    let op = Operator::start(
        cp,
        &db.url,
        &ns,
        &[
            ("REDIS_URL", redis.url.as_str()),
            ("PRISM_REDIS_PREFIX", prefix.as_str()),
            ("PRISM_JOB_VISIBILITY_SECONDS", "3"),
        ],
    )
    .await;
    let api: kube::Api<RunSession> = kube::Api::namespaced(client.clone(), &ns);
    let key = support::create_run_session(&api, "srv-pgf-run", "srv-pgf", None).await;
    support::eventually(10, "identity mirrored", || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM run_identities WHERE server_instance_id = 'srv-pgf'")
            .fetch_one(&db.pool)
            .await
            .ok()?;
        (n == 1).then_some(())
    })
    .await;
    let token = support::sa_token(cp, &ns, "dispatcher", "runsessions", &["get", "update"]).await;
    let http = support::http();
    for _ in 0..JOBS {
        let r = http
            .post(op.url("/api/v1/runtime/jobs"))
            .bearer_auth(&token)
            .json(&json!({"server_instance_id": "srv-pgf", "component_kind": "run", "kind": "config", "payload": {}}))
            .send()
            .await
            .expect("enqueue");
        assert!(r.status().is_success(), "enqueue: {}", r.status());
    }
    let mut run = RunClient::new(&op.base, "srv-pgf", "run", 1, key);
    run.hello().await.expect("hello");

    let (stop, killed, killer) =
        backend_killer(&support::admin_database_url(), &db.name, Duration::from_millis(30)).await;

    // The Run claims and completes until every job is done; the faults stop after 8 s.
    let started = std::time::Instant::now();
    let mut completions: Vec<String> = Vec::new();
    let mut refused = 0u64;
    let mut twice_refused = 0u64;
    while started.elapsed() < Duration::from_secs(60) {
        if started.elapsed() > Duration::from_secs(8) {
            stop.store(true, Ordering::Relaxed);
        }
        let finished: i64 =
            sqlx::query_scalar("SELECT count(*) FROM runtime_jobs WHERE state IN ('succeeded','failed','cancelled')")
                .fetch_one(&db.pool)
                .await
                .unwrap_or(0);
        if finished as usize == JOBS && stop.load(Ordering::Relaxed) {
            break;
        }
        // The session lease lives in Redis, which this test leaves alone: keep it renewed.
        let _ = run.heartbeat().await;
        let jobs = match run.claim(1).await {
            Ok(jobs) => jobs,
            Err(_) => {
                refused += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if jobs.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for job in jobs {
            match run.step(&job.id, "complete", Some(json!({"outcome": "succeeded", "result": {"by": "faults"}}))).await
            {
                Ok(_) => {
                    completions.push(job.id.to_string());
                    // A second completion of the same job is refused: completed at most once.
                    let again = run.step(&job.id, "complete", Some(json!({"outcome": "failed"}))).await;
                    if again.is_err() {
                        twice_refused += 1;
                    }
                }
                Err(_) => refused += 1,
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    killer.await.expect("killer");
    let kills = killed.load(Ordering::Relaxed);
    println!(
        "{JOBS} jobs: {} completions acknowledged, {refused} calls refused during the faults, {kills} backends killed",
        completions.len()
    );
    assert!(kills > 0, "the fault was injected");
    assert_eq!(twice_refused as usize, completions.len(), "every second completion was refused");
    let states: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM runtime_jobs GROUP BY state ORDER BY state")
            .fetch_all(&db.pool)
            .await
            .expect("states");
    assert_eq!(states, vec![("succeeded".to_string(), JOBS as i64)], "every job ended completed");

    let file = std::env::temp_dir().join(format!("prism-completions-{}", uuid::Uuid::new_v4().simple()));
    std::fs::write(&file, completions.join("\n")).expect("write completions");
    let (ok, stdout) =
        faults::check_invariants(&db.url, &["--namespace-prefix", &ns, "--completions", file.to_str().expect("utf-8")])
            .await;
    let _ = std::fs::remove_file(&file);
    println!("{stdout}");
    assert!(ok, "invariants after backend kills during claims:\n{stdout}");
}

/// A Postgres restart in the middle of the storm: calls during the outage are refused
/// (503) as a whole, and afterwards everything holds as after backend kills.
#[tokio::test]
async fn a_postgres_restart_mid_storm_leaves_no_half_applied_change() {
    let seed = faults::seed();
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "pgrestart-storm").await;
    let pg = Arc::new(support::PrivatePostgres::start().await);
    let op = Operator::start(cp, &pg.url, &ns, &[]).await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;
    let restarter = {
        let pg = pg.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            pg.ctl("stop").await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            pg.ctl("start").await;
        })
    };
    let (acknowledged, refused) = storm(&op, &token, &ns, seed).await;
    restarter.await.expect("restart");
    println!("seed {seed}: {} registrations acknowledged, refused {refused:?}, one restart", acknowledged.len());
    assert!(refused.keys().all(|s| *s == 503), "calls refused during the outage are 503, not {refused:?}");
    after_the_storm(&op, &token, &ns, &pg.url, &acknowledged, &format!("a restart (seed {seed})")).await;
}

/// The leader of two replicas killed (SIGKILL) in the middle of the storm, which both
/// replicas serve: calls to the dead one fail to connect and go to the other; the other
/// takes the Lease; afterwards everything holds as after the Postgres faults.
#[tokio::test]
async fn the_leader_killed_mid_storm_leaves_no_half_applied_change() {
    let seed = faults::seed();
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "leaderkill").await;
    let db = TestDb::new().await;
    let start = |pod: &'static str| {
        let (db_url, ns) = (db.url.clone(), ns.clone());
        async move { Operator::replica(cp, &db_url, &ns, pod).await }
    };
    let mut replicas = [Some(start("faults-a").await), Some(start("faults-b").await)];
    let token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;
    let holder = || support::lease_holder(&client);
    let first = support::eventually(30, "a replica holds the Lease", || async { holder().await }).await;
    let leader = if first == "faults-a" { 0 } else { 1 };
    let bases: Vec<String> = replicas.iter().flatten().map(|op| op.base.clone()).collect();

    let killer = {
        let victim = replicas[leader].take();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(400)).await;
            drop(victim); // Operator's drop is SIGKILL: no shutdown, no Lease release
        })
    };
    let (acknowledged, refused) = storm_over(&bases, &token, &ns, seed).await;
    killer.await.expect("killer");
    let survivor = replicas.iter().flatten().next().expect("the other replica");
    let second = support::eventually(60, "the other replica holds the Lease", || async {
        holder().await.filter(|h| *h != first)
    })
    .await;
    println!(
        "seed {seed}: leader {first} killed, {second} took over; {} registrations acknowledged, refused {refused:?}",
        acknowledged.len()
    );
    assert!(refused.keys().all(|s| *s == 0 || *s == 503), "only the dead replica's connections failed: {refused:?}");
    after_the_storm(survivor, &token, &ns, &db.url, &acknowledged, &format!("the leader killed (seed {seed})")).await;
}

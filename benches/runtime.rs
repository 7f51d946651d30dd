//! Runtime registry benchmark: the project and a baseline side by side in one run, on
//! the same real Redis and Postgres, printing the ratio (absolute numbers on a shared
//! machine are noise; the ratio is the result). Every ratio is the median of
//! `BENCH_ROUNDS` (>= 5) alternating rounds with its min-max (benches/common/measure.rs);
//! counts are printed beside the rates.
//!
//!   scripts/bench runtime   (or: cargo bench --bench runtime, with the services up)
//!
//! (a) heartbeats/s through the HTTP API vs the same Lua renew script run directly
//!     against Redis, at the same concurrency (target >= 0.3);
//! (b) claims/s (1 job per claim) through the HTTP API vs the raw
//!     `UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING`
//!     (target >= 0.5);
//! (c) seconds from a Run's last heartbeat to `phase: Offline` in its status, 20 Runs,
//!     5 s lease (target p99 <= lease + 2 s);
//! (d) claims/s of the eligibility claim (kinds, slots, term fences; SPEC §5.1) straight
//!     to Postgres vs the unfiltered raw SKIP LOCKED claim (target >= 1/1.5: within
//!     1.5x of its cost);
//! (e) index entries read per claim at 1,000 and at 100,000 queued, the store's and the
//!     raw claim's (a claim's cost does not grow with the backlog).
//!
//! Redis is a redis-server of the bench's own (nobody else's commands in its counters);
//! the claims' baseline runs in a Postgres database of its own, so each side's
//! pg_stat_database counts only its own work. Standalone Redis only: the baseline speaks
//! to one redis-server.

mod common;
use prism_testkit as support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::counts::{PgActivity, RedisActivity, RedisCounters, redis_counted};
use common::measure::{
    CONCURRENCY, Target, Window, interleave, judged, percentile, rate, rates, ratios, rounds, spread, window_length,
};
use futures::FutureExt;
use kube::Api;
use prism_operator::config::RedisEndpoint;
use prism_operator::crd::{RunPhase, RunSession};
use prism_operator::run_client::RunClient;
use prism_operator::run_registry::SessionStore;
use prism_operator::run_registry::jobs::JobKind;

async fn runs(api: &Api<RunSession>, base: &str, prefix: &str, n: usize, lease: Option<i32>) -> Vec<RunClient> {
    let mut out = Vec::new();
    for i in 0..n {
        let server = format!("{prefix}-{i}");
        let key = support::create_run_session(api, &server, &server, lease).await;
        out.push(RunClient::new(base, &server, "run", 1, key));
    }
    for run in &mut out {
        // The identity is mirrored by the reconciler: retry until it is known.
        let deadline = Instant::now() + Duration::from_secs(20);
        while run.hello().await.is_err() {
            assert!(Instant::now() < deadline, "hello never succeeded");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    out
}

/// A window of `op`, with what Redis counted during it.
async fn counted<F, Fut>(redis: &RedisCounters, op: F) -> (Window, RedisActivity)
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    redis_counted(redis, rate(op)).await
}

/// The sum of a side's windows and counts.
fn totals(side: &[(Window, RedisActivity)]) -> (Vec<Window>, u64, RedisActivity) {
    let windows: Vec<Window> = side.iter().map(|(w, _)| w.clone()).collect();
    let ops = windows.iter().map(|w| w.ops).sum();
    let mut redis = RedisActivity::default();
    for (_, r) in side {
        redis.add(r);
    }
    (windows, ops, redis)
}

/// The baseline claim: the oldest queued job of one target (and namespace, as every claim
/// asks), unfiltered, the best raw claim the schema allows: the queued jobs' ordered index
/// read in its own order (NULLS FIRST: no other index gives it, whatever the statistics
/// say), `UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1)` (a literal
/// LIMIT 1: one primary-key probe; `= ANY(ARRAY(...))` read a small table whole).
async fn raw_claim(pool: &sqlx::PgPool, server: &str, ns: &str) -> bool {
    let row: Option<(uuid::Uuid,)> = sqlx::query_as(
        "UPDATE runtime_jobs SET state = 'claimed', claimed_at = now(), visible_at = now() + interval '60 seconds',
             deadline_at = now() + interval '600 seconds', attempts = attempts + 1
         WHERE id IN (SELECT id FROM runtime_jobs
                      WHERE namespace = $2 AND server_instance_id = $1 AND component_kind = 'run' AND state = 'queued'
                      ORDER BY created_at NULLS FIRST, id NULLS FIRST LIMIT 1 FOR UPDATE SKIP LOCKED)
         RETURNING id",
    )
    .bind(server)
    .bind(ns)
    .fetch_optional(pool)
    .await
    .ok()
    .flatten();
    row.is_some()
}

/// Both databases' counters once every backend has published them.
async fn settled(a: &support::TestDb, b: &support::TestDb) -> (PgActivity, PgActivity) {
    PgActivity::settled_pair(&a.pool, &b.pool).await.expect("read pg_stat_database")
}

#[tokio::main]
async fn main() {
    assert!(
        !support::redis_cluster_mode(),
        "the runtime benchmark runs on a standalone Redis (unset PRISM_TEST_REDIS)"
    );
    let cp = support::control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "bench").await;
    let db = support::TestDb::new().await;
    let raw_db = support::TestDb::new().await;
    let redis = support::PrivateRedis::start().await;
    let prefix = support::redis_prefix();
    let op = support::Operator::start(
        cp,
        &db.url,
        &ns,
        &common::open_limits(&[("REDIS_URL", &redis.url), ("PRISM_REDIS_PREFIX", &prefix), ("RUST_LOG", "warn")]),
    )
    .await;
    let counters = RedisCounters::connect(std::slice::from_ref(&redis.url)).await.expect("connect to Redis");
    let api: Api<RunSession> = Api::namespaced(client.clone(), &ns);
    println!(
        "prism-operator runtime benchmark (concurrency {CONCURRENCY}, {} rounds of {:.1}s windows per side)\n",
        rounds(),
        window_length().as_secs_f64()
    );

    // (a) heartbeats
    let hb_runs = Arc::new(runs(&api, &op.base, "hb", CONCURRENCY, None).await);
    let store = SessionStore::new(&RedisEndpoint::Standalone(redis.url.clone()), &prefix).expect("redis");
    let raw = redis::Client::open(redis.url.as_str()).expect("redis");
    let conn = raw.get_multiplexed_async_connection().await.expect("connect");
    let script = common::raw::frozen_heartbeat_script();
    let keys: Arc<Vec<(String, String, String, String)>> = Arc::new(common::raw::heartbeat_keys(&store, &hb_runs));
    let pg_before = settled(&db, &raw_db).await;
    let sides = interleave(2, rounds(), |side, _| match side {
        0 => {
            let r = hb_runs.clone();
            counted(&counters, move |i, _| {
                let r = r.clone();
                async move { r[i].heartbeat().await.is_ok() }
            })
            .boxed()
        }
        _ => {
            let (conn, script, keys) = (conn.clone(), script.clone(), keys.clone());
            counted(&counters, move |i, _| {
                let (mut conn, script, keys) = (conn.clone(), script.clone(), keys.clone());
                async move { common::raw::raw_heartbeat(&mut conn, &script, &keys[i]).await }
            })
            .boxed()
        }
    })
    .await;
    let pg_after = settled(&db, &raw_db).await;
    let (api_w, api_ops, api_redis) = totals(&sides[0]);
    let (raw_w, raw_ops, raw_redis) = totals(&sides[1]);
    println!("(a) heartbeats/s   API {}   raw Lua {}", spread(&rates(&api_w), 0), spread(&rates(&raw_w), 0));
    println!("    ratio API/raw  {}", judged(&ratios(&rates(&api_w), &rates(&raw_w)), 2, Target::AtLeast(0.3)));
    println!("    counted, API:     {}", api_redis.per(api_ops, "heartbeat"));
    println!("                      {}", pg_after.0.since(&pg_before.0).per(api_ops, "heartbeat"));
    println!("    counted, raw Lua: {}", raw_redis.per(raw_ops, "heartbeat"));

    // (b) claims, one job per claim: the API's jobs in the operator's database, the
    // baseline's in its own.
    let fill = |pool: sqlx::PgPool, prefix: &'static str, ns: String| async move {
        sqlx::query(
            "INSERT INTO runtime_jobs (namespace, server_instance_id, component_kind, kind)
             SELECT $2, $1 || '-' || (g % 16), 'run', 'config' FROM generate_series(1, 200000) g",
        )
        .bind(prefix)
        .bind(ns)
        .execute(&pool)
        .await
        .expect("fill");
    };
    fill(db.pool.clone(), "cl", ns.clone()).await;
    fill(raw_db.pool.clone(), "raw", ns.clone()).await;
    // Statistics for the planner, as autovacuum would give them after a bulk insert: not
    // left to happen inside one side's window.
    for pool in [&db.pool, &raw_db.pool] {
        sqlx::query("ANALYZE runtime_jobs").execute(pool).await.expect("analyze");
    }
    // The Runs after the fill (it takes longer than a lease).
    let mut claim_runs = runs(&api, &op.base, "cl", CONCURRENCY, None).await;
    // They hold every job they claim: no `slots` (their heartbeats before the windows
    // send an empty capacity), so no limit on what is in flight (slots are (d)).
    for run in &mut claim_runs {
        run.capacity.clear();
    }
    let claim_runs = Arc::new(claim_runs);
    let pg_before = settled(&db, &raw_db).await;
    let sides = interleave(2, rounds(), |side, _| match side {
        0 => {
            let (r, counters) = (claim_runs.clone(), &counters);
            async move {
                // Claims do not renew the lease (30 s): renew it before the window, outside it.
                for run in r.iter() {
                    run.heartbeat().await.expect("heartbeat before the claims");
                }
                counted(counters, move |i, _| {
                    let r = r.clone();
                    async move { r[i].claim(1).await.map(|j| j.len() == 1).unwrap_or(false) }
                })
                .await
            }
            .boxed()
        }
        _ => {
            let pool = raw_db.pool.clone();
            let ns = ns.clone();
            counted(&counters, move |i, _| {
                let (pool, ns) = (pool.clone(), ns.clone());
                async move { raw_claim(&pool, &format!("raw-{i}"), &ns).await }
            })
            .boxed()
        }
    })
    .await;
    let pg_after = settled(&db, &raw_db).await;
    let (api_w, api_ops, api_redis) = totals(&sides[0]);
    let (raw_w, raw_ops, _) = totals(&sides[1]);
    println!("(b) claims/s       API {}   raw SQL {}", spread(&rates(&api_w), 0), spread(&rates(&raw_w), 0));
    println!("    ratio API/raw  {}", judged(&ratios(&rates(&api_w), &rates(&raw_w)), 2, Target::AtLeast(0.5)));
    println!("    counted, API:     {}", pg_after.0.since(&pg_before.0).per(api_ops, "claim"));
    println!("                      {}", api_redis.per(api_ops, "claim"));
    println!("    counted, raw SQL: {}", pg_after.1.since(&pg_before.1).per(raw_ops, "claim"));

    // (d) the eligibility claim (SPEC §5.1) as the API's store runs it — kinds advertised,
    // slots, fences checked against the project's term — against the unfiltered raw
    // SKIP LOCKED claim, both straight to Postgres, one job per claim, on a queue of mixed
    // kinds with a quarter of the jobs fenced.
    let el_db = support::TestDb::new().await;
    let raw2_db = support::TestDb::new().await;
    for pool in [&el_db.pool, &raw2_db.pool] {
        // Project P at term 7 with a live master (the fences of term 7 hold).
        let master = uuid::Uuid::new_v4();
        sqlx::query("INSERT INTO controller_projects (namespace, project_id, term) VALUES ($1, 'P', 7)")
            .bind(&ns)
            .execute(pool)
            .await
            .expect("project");
        for sql in [
            "INSERT INTO controller_registrations (id, namespace, name, project_id, session_id, agent_surface, is_master, master_term)
             VALUES ($2, $1, 'master', 'P', 's', 'other', true, 7)",
            "UPDATE controller_projects SET master_id = $2 WHERE namespace = $1 AND project_id = 'P'",
        ] {
            sqlx::query(sqlx::AssertSqlSafe(sql)).bind(&ns).bind(master).execute(pool).await.expect("project");
        }
        sqlx::query(
            "INSERT INTO runtime_jobs (namespace, server_instance_id, component_kind, kind,
                 fence_namespace, fence_project_id, fence_term)
             SELECT $1, 'el-' || (g % 16), 'run', (ARRAY['config','file','log'])[1 + g % 3],
                    CASE WHEN g % 4 = 0 THEN $1 END, CASE WHEN g % 4 = 0 THEN 'P' END, CASE WHEN g % 4 = 0 THEN 7 END
             FROM generate_series(1, 200000) g",
        )
        .bind(&ns)
        .execute(pool)
        .await
        .expect("fill");
        sqlx::query("ANALYZE runtime_jobs").execute(pool).await.expect("analyze");
    }
    let store = prism_operator::run_registry::jobs::JobStore::new(el_db.pool.clone(), Default::default());
    let eligible = prism_operator::run_registry::jobs::Eligibility {
        kinds: Some(vec![JobKind::Config, JobKind::File]),
        slots: Some(1_000_000),
    };
    let pg_before = settled(&el_db, &raw2_db).await;
    let sides = interleave(2, rounds(), |side, _| match side {
        0 => {
            let (store, eligible, ns) = (store.clone(), eligible.clone(), ns.clone());
            counted(&counters, move |i, _| {
                let (store, eligible, ns) = (store.clone(), eligible.clone(), ns.clone());
                async move {
                    let address = prism_operator::run_registry::RunAddress {
                        server_instance_id: format!("el-{i}"),
                        component_kind: "run".into(),
                    };
                    let jobs = store.claim(&ns, &address, uuid::Uuid::nil(), 1, &eligible).await;
                    jobs.map(|j| j.len() == 1).unwrap_or(false)
                }
            })
            .boxed()
        }
        _ => {
            let (pool, ns) = (raw2_db.pool.clone(), ns.clone());
            counted(&counters, move |i, _| {
                let (pool, ns) = (pool.clone(), ns.clone());
                async move { raw_claim(&pool, &format!("el-{i}"), &ns).await }
            })
            .boxed()
        }
    })
    .await;
    let pg_after = settled(&el_db, &raw2_db).await;
    let (el_w, el_ops, _) = totals(&sides[0]);
    let (raw_w, raw_ops, _) = totals(&sides[1]);
    println!(
        "(d) claims/s       eligibility {}   raw unfiltered {}",
        spread(&rates(&el_w), 0),
        spread(&rates(&raw_w), 0)
    );
    println!(
        "    ratio el./raw  {}  (the eligibility claim within 1.5x of the raw claim's cost)",
        judged(&ratios(&rates(&el_w), &rates(&raw_w)), 2, Target::AtLeast(1.0 / 1.5))
    );
    println!("    counted, eligibility: {}", pg_after.0.since(&pg_before.0).per(el_ops, "claim"));
    println!("    counted, raw SQL:     {}", pg_after.1.since(&pg_before.1).per(raw_ops, "claim"));

    // (e) what one claim reads at 1,000 and at 100,000 queued (SPEC §12: one tenant's
    // backlog does not slow every tenant's claims): each backlog enqueued at once and
    // analyzed (statistics that say "every job is queued"), its oldest 300 claimed (in
    // flight, in front of the queue), then 500 claims one after another, the store's and
    // the raw one's, each in a database of its own.
    for backlog in [1_000i64, 100_000] {
        let (store_db, raw_db) = (support::TestDb::new().await, support::TestDb::new().await);
        for pool in [&store_db.pool, &raw_db.pool] {
            sqlx::query(
                "INSERT INTO runtime_jobs (namespace, server_instance_id, component_kind, kind, created_at)
                 SELECT $1, 'cost', 'run', 'config', now() - make_interval(secs => $2 - g) FROM generate_series(1, $2) g",
            )
            .bind(&ns)
            .bind(backlog)
            .execute(pool)
            .await
            .expect("fill");
            sqlx::query("ANALYZE runtime_jobs").execute(pool).await.expect("analyze");
        }
        let store = prism_operator::run_registry::jobs::JobStore::new(store_db.pool.clone(), Default::default());
        let address = prism_operator::run_registry::RunAddress {
            server_instance_id: "cost".into(),
            component_kind: "run".into(),
        };
        let unlimited = prism_operator::run_registry::jobs::Eligibility { kinds: None, slots: None };
        let mut read = Vec::new();
        for (warm, claims) in [(300, 0), (0, 500)] {
            let before = settled(&store_db, &raw_db).await;
            for _ in 0..warm + claims {
                let got = store.claim(&ns, &address, uuid::Uuid::nil(), 1, &unlimited).await.expect("claim");
                assert_eq!(got.len(), 1, "a queued job to claim");
                assert!(raw_claim(&raw_db.pool, "cost", &ns).await, "a queued job to claim (raw)");
            }
            let after = settled(&store_db, &raw_db).await;
            if claims > 0 {
                read.push((after.0.since(&before.0), after.1.since(&before.1), claims));
            }
        }
        for (store_pg, raw_pg, claims) in read {
            let per = |pg: &PgActivity| pg.tup_returned as f64 / claims as f64;
            println!(
                "(e) at {backlog:>7} queued: index entries/scanned rows read per claim: store {:.1}, raw {:.1}",
                per(&store_pg),
                per(&raw_pg)
            );
        }
    }

    // (c) offline detection
    let lease = 5;
    let off_runs = runs(&api, &op.base, "off", 20, Some(lease)).await;
    let mut last_beat = Vec::new();
    for run in &off_runs {
        run.heartbeat().await.expect("heartbeat");
        last_beat.push((run.server_instance_id.clone(), Instant::now()));
    }
    let mut latencies = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while latencies.len() < last_beat.len() && Instant::now() < deadline {
        for (name, at) in &last_beat {
            if latencies.iter().any(|(n, _)| n == name) {
                continue;
            }
            if let Ok(r) = api.get(name).await
                && r.status.is_some_and(|s| s.phase == RunPhase::Offline)
            {
                latencies.push((name.clone(), at.elapsed().as_secs_f64()));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let secs: Vec<f64> = latencies.iter().map(|(_, s)| *s).collect();
    let pct = |p: f64| percentile(&secs, p);
    let target = Target::AtMost(f64::from(lease + 2));
    let verdict = if secs.len() == last_beat.len() && target.met_by(pct(0.99)) { "PASS" } else { "FAIL" };
    println!(
        "(c) offline after   p50 {:.2}s   p99 {:.2}s   max {:.2}s   ({} of 20 Runs, lease {lease}s)   target p99 {target}: {verdict}",
        pct(0.5),
        pct(0.99),
        pct(1.0),
        secs.len(),
    );
}

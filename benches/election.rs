//! Election benchmark: the project and a baseline side by side in one run, on the same
//! real Postgres (and, for (c), the real kube-apiserver), printing the ratio. Every
//! figure is the median of `BENCH_ROUNDS` (>= 5) rounds with its min-max, judged as
//! benches/common/measure.rs says; counts are printed beside the rates.
//!
//!   scripts/bench election   (or: cargo bench --bench election, with the services up)
//!   BENCH_PARTS=a,c scripts/bench election   (only some of the parts)
//!
//! (a) registrations/s through the store vs. the raw SQL of the same work (one
//!     transaction: advisory lock on the project, read the live master, insert, count
//!     the project's change, notify), at the same concurrency (target >= 0.95, issue 43);
//! (b) heartbeats/s through the HTTP API (coalesced) vs. one `UPDATE ... WHERE id = $1`
//!     per heartbeat (target >= 5x);
//! (c) 1,000 registrations over 100 projects created on the API server: seconds until
//!     every status is right / seconds the API server took to accept the creates (target
//!     <= 1.5), the operator's peak RSS then (target <= 64 MiB), and the API server's
//!     writes per registration; once with the operator adding finalizer and label
//!     itself, once with the chart's admission policy.
//!
//! In (a) and (b) the baseline runs in a database of its own on the same server, so that
//! Postgres's own counters (pg_stat_database) tell what each side cost.

mod common;
use prism_testkit as support;

use std::sync::Arc;

use common::converge::{self, surface};
use common::counts::{PgActivity, cpu_of, cpu_seconds};
use common::measure::{
    CONCURRENCY, Target, Window, interleave, judged, rate, rates, ratios, rounds, spread, window_length,
};
use futures::FutureExt;
use prism_operator::election::{ElectionStore, NewRegistration, Quotas};
use serde_json::json;
use uuid::Uuid;

const PROJECTS: usize = 50;

fn part(name: &str) -> bool {
    std::env::var("BENCH_PARTS").map_or(true, |parts| parts.split(',').any(|p| p.trim() == name))
}

/// Both databases' counters once every backend has published them.
async fn settled(a: &support::TestDb, b: &support::TestDb) -> (PgActivity, PgActivity) {
    PgActivity::settled_pair(&a.pool, &b.pool).await.expect("read pg_stat_database")
}

#[tokio::main]
async fn main() {
    let db = support::TestDb::new().await;
    // The baselines' database: same server, same schema, counted apart.
    let raw_db = support::TestDb::new().await;
    println!(
        "prism-operator election benchmark (concurrency {CONCURRENCY}, {} rounds of {:.1}s windows per side)\n",
        rounds(),
        window_length().as_secs_f64()
    );
    // (a) needs only Postgres: it runs before the API server starts, whose start-up would
    // otherwise share the two cores with the first windows.
    if part("a") {
        bench_registrations(&db, &raw_db).await;
    }
    if !part("b") && !part("c") {
        return;
    }
    let cp = support::control_plane().await;
    let client = cp.client().await;
    if part("b") {
        bench_heartbeats(cp, &client, &db, &raw_db).await;
    }
    if part("c") {
        bench_convergence(cp, &client, &db).await;
    }
}

/// (a) registrations through the store vs. raw SQL, each on PROJECTS projects, in
/// alternating windows.
async fn bench_registrations(db: &support::TestDb, raw_db: &support::TestDb) {
    for p in 0..PROJECTS {
        sqlx::query("INSERT INTO controller_projects (namespace, project_id) VALUES ('bench-raw', $1)")
            .bind(format!("p{p}"))
            .execute(&raw_db.pool)
            .await
            .expect("project");
    }
    // The store on the operator's own pool (its connection settings), the baseline on a
    // plain one of the same size: with the testkit's 8 connections against the
    // operator's 16, the baseline had half as many transactions waiting on the project
    // locks and on the commit lock NOTIFY takes, and ran faster for it (pgbench here:
    // 2,050 against 1,540 transactions/s).
    let pool = prism_operator::db::connect(&db.url).await.expect("operator pool");
    let raw_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(pool.options().get_max_connections())
        .connect(&raw_db.url)
        .await
        .expect("baseline pool");
    let before = settled(db, raw_db).await;
    let sides = interleave(2, rounds(), |side, round| {
        let (pool, raw_pool, db) = (&pool, &raw_pool, if side == 0 { db } else { raw_db });
        async move {
            // The table grows by thousands of rows a second from empty, faster than
            // autovacuum analyses it; plans made from no statistics then read every live
            // row of the namespace (the counts below showed it). Both sides get current
            // statistics before each window, as a table at steady state has them.
            analyze(db, "controller_registrations").await;
            match side {
                0 => store_registrations(pool, round).await,
                _ => raw_registrations(raw_pool, round).await,
            }
        }
        .boxed()
    })
    .await;
    let after = settled(db, raw_db).await;
    let (store, raw) = (&sides[0], &sides[1]);
    println!("(a) registrations/s   store {}   raw SQL {}", spread(&rates(store), 0), spread(&rates(raw), 0));
    println!("    ratio store/raw   {}", judged(&ratios(&rates(store), &rates(raw)), 2, Target::AtLeast(0.95)));
    println!("    counted, store:   {}", after.0.since(&before.0).per(ops(store), "registration"));
    println!("    counted, raw SQL: {}", after.1.since(&before.1).per(ops(raw), "registration"));
}

async fn analyze(db: &support::TestDb, table: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!("ANALYZE {table}"))).execute(&db.pool).await.expect("analyze");
}

fn ops(windows: &[Window]) -> u64 {
    windows.iter().map(|w| w.ops).sum()
}

async fn store_registrations(pool: &sqlx::PgPool, round: usize) -> Window {
    // The bench registers more than a namespace's default quota; the quota's count still
    // runs (every few seconds), its limit is out of the way.
    let s = ElectionStore::with_quotas(pool.clone(), Quotas { per_owner: u32::MAX, per_namespace: u32::MAX });
    rate(move |i, n| {
        let s = s.clone();
        async move {
            let reg = NewRegistration {
                id: Uuid::new_v4(),
                namespace: "bench-store".into(),
                name: format!("r-{round}-{i}-{n}"),
                project_id: format!("p{}", (i as u64 * 7919 + n) % PROJECTS as u64),
                session_id: format!("s-{round}-{i}-{n}"),
                surface: surface(n),
                owner: None,
                through_api: false,
            };
            s.register(&reg).await.map_err(|e| eprintln!("store register failed: {e}")).is_ok()
        }
    })
    .await
}

/// The baseline: the same registration as one transaction of raw SQL (advisory lock on
/// the project, read the live master, insert, count the project's change, and the
/// NOTIFY that tells every replica's watches of it). SPEC §11 makes the last two part
/// of a registration's work: every change of a project is an event with the id
/// `<term>.<seq>` (the count, kept on the project's row), told to every replica's
/// watches in the same transaction. The NOTIFY is the dearest part — a transaction that
/// notifies commits under a lock every notifying transaction of the cluster shares;
/// pgbench here: 3,860 such transactions/s without it, 2,500 with, at 16 clients.
/// `BENCH_BASELINE=lean` leaves the change count out (the baseline before 0.3.0).
async fn raw_registrations(pool: &sqlx::PgPool, round: usize) -> Window {
    let pool = pool.clone();
    let lean = std::env::var("BENCH_BASELINE").is_ok_and(|b| b == "lean");
    rate(move |i, n| {
        let pool = pool.clone();
        async move {
            let project = format!("p{}", (i as u64 * 7919 + n) % PROJECTS as u64);
            let work = async {
                let mut tx = pool.begin().await?;
                sqlx::query("SELECT pg_advisory_xact_lock(hashtext('bench-raw/' || $1))")
                    .bind(&project)
                    .execute(&mut *tx)
                    .await?;
                let master: Option<Uuid> = sqlx::query_scalar(
                    "SELECT id FROM controller_registrations
                     WHERE namespace = 'bench-raw' AND project_id = $1 AND is_master AND released_at IS NULL",
                )
                .bind(&project)
                .fetch_optional(&mut *tx)
                .await?;
                // The row, the change count and the NOTIFY in one statement, as the store
                // writes a peer's.
                sqlx::query(if lean {
                    "WITH inserted AS (
                         INSERT INTO controller_registrations (id, namespace, name, project_id, session_id, agent_surface, is_master, master_term)
                         VALUES ($1, 'bench-raw', $2, $3, $4, $5, $6, CASE WHEN $6 THEN 1 END))
                     SELECT pg_notify('bench_raw_projects', $3)"
                } else {
                    "WITH inserted AS (
                         INSERT INTO controller_registrations (id, namespace, name, project_id, session_id, agent_surface, is_master, master_term)
                         VALUES ($1, 'bench-raw', $2, $3, $4, $5, $6, CASE WHEN $6 THEN 1 END)),
                     counted AS (
                         UPDATE controller_projects SET routing_seq = routing_seq + 1
                          WHERE namespace = 'bench-raw' AND project_id = $3 RETURNING 1)
                     SELECT pg_notify('bench_raw_projects', $3) FROM counted"
                })
                .bind(Uuid::new_v4())
                .bind(format!("r-{round}-{i}-{n}"))
                .bind(&project)
                .bind(format!("s-{round}-{i}-{n}"))
                .bind(surface(n).as_str())
                .bind(master.is_none())
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok::<_, sqlx::Error>(())
            };
            work.await.map_err(|e| eprintln!("raw register failed: {e}")).is_ok()
        }
    })
    .await
}

/// (b) heartbeats: the HTTP API (coalesced) vs. one UPDATE per heartbeat, in
/// alternating windows.
async fn bench_heartbeats(
    cp: &'static support::ControlPlane,
    client: &kube::Client,
    db: &support::TestDb,
    raw_db: &support::TestDb,
) {
    let ns = support::namespace(client, "benchhb").await;
    let op = support::Operator::start(cp, &db.url, &ns, &common::open_limits(&[("RUST_LOG", "warn")])).await;
    let token = support::agent_token(cp, &ns, "bench", &["create"]).await;
    for i in 0..CONCURRENCY {
        support::register(&op, &token, &ns, "HB", &format!("hb-{i}"), "claude_code").await;
    }
    // The baseline's rows: the same sessions, as peers, in its own database.
    sqlx::query("INSERT INTO controller_projects (namespace, project_id) VALUES ('bench-raw', 'HB')")
        .execute(&raw_db.pool)
        .await
        .expect("project");
    let mut ids = Vec::new();
    for i in 0..CONCURRENCY {
        let id = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO controller_registrations (id, namespace, name, project_id, session_id, agent_surface)
             VALUES ($1, 'bench-raw', $2, 'HB', $2, 'claude_code')",
        )
        .bind(id)
        .bind(format!("hb-{i}"))
        .execute(&raw_db.pool)
        .await
        .expect("registration");
        ids.push(id);
    }
    let http = support::http();
    let ids = Arc::new(ids);
    // (a) left thousands of rows that autovacuum may not have analysed yet.
    analyze(db, "controller_registrations").await;
    analyze(raw_db, "controller_registrations").await;
    let before = settled(db, raw_db).await;
    // Beside each window, the CPU time its server side spent (the operator and Postgres
    // for the API, Postgres for the UPDATEs) and this bench's own clients: both share the
    // machine's two cores, so the rates alone cannot tell whose cost the ratio is.
    let (op_pid, bench_pid) = (op.pid(), std::process::id());
    let cpu = move || (cpu_seconds(op_pid) + cpu_of("postgres", ""), cpu_seconds(bench_pid));
    let measured = interleave(2, rounds(), |side, _| {
        let (h, base, tok, ns, pool, ids) =
            (http.clone(), op.base.clone(), token.clone(), ns.clone(), raw_db.pool.clone(), ids.clone());
        let window = match side {
            0 => rate(move |i, _| {
                let (h, base, tok, ns) = (h.clone(), base.clone(), tok.clone(), ns.clone());
                async move {
                    h.post(format!("{base}/api/v1/controller/heartbeat"))
                        .bearer_auth(&tok)
                        .json(&json!({"namespace": ns, "session_id": format!("hb-{i}")}))
                        .send()
                        .await
                        .is_ok_and(|r| r.status().is_success())
                }
            })
            .boxed(),
            _ => rate(move |i, _| {
                let (pool, ids) = (pool.clone(), ids.clone());
                async move {
                    sqlx::query("UPDATE controller_registrations SET last_heartbeat = now() WHERE id = $1")
                        .bind(ids[i])
                        .execute(&pool)
                        .await
                        .is_ok()
                }
            })
            .boxed(),
        };
        async move {
            let before = cpu();
            let w = window.await;
            let (after, calls) = (cpu(), (w.ops as f64).max(1.0));
            // Microseconds of CPU per heartbeat: the server side's, the clients'.
            (w, ((after.0 - before.0) * 1e6 / calls, (after.1 - before.1) * 1e6 / calls))
        }
    })
    .await;
    let after = settled(db, raw_db).await;
    // Per side, per round: the window, and its CPU microseconds per heartbeat.
    type PerHeartbeat = Vec<(f64, f64)>;
    let (sides, cpu_us): (Vec<Vec<Window>>, Vec<PerHeartbeat>) =
        measured.into_iter().map(|side| side.into_iter().unzip()).unzip();
    let (api, raw) = (&sides[0], &sides[1]);
    let (server, clients) = (|c: &(f64, f64)| c.0, |c: &(f64, f64)| c.1);
    let of = |side: usize, f: fn(&(f64, f64)) -> f64| cpu_us[side].iter().map(f).collect::<Vec<f64>>();
    println!("(b) heartbeats/s      API {}   UPDATE each {}", spread(&rates(api), 0), spread(&rates(raw), 0));
    println!("    ratio API/UPDATE  {}", judged(&ratios(&rates(api), &rates(raw)), 1, Target::AtLeast(5.0)));
    println!(
        "    CPU per heartbeat, API: operator + Postgres {} us, bench clients {} us",
        spread(&of(0, server), 1),
        spread(&of(0, clients), 1)
    );
    println!(
        "    CPU per heartbeat, UPDATE: Postgres {} us, bench clients {} us",
        spread(&of(1, server), 1),
        spread(&of(1, clients), 1)
    );
    // The ratio the servers alone would give if the clients cost nothing.
    println!("    server CPU per UPDATE / per API heartbeat  {}", spread(&ratios(&of(1, server), &of(0, server)), 1));
    println!("    counted, API:     {}", after.0.since(&before.0).per(ops(api), "heartbeat"));
    println!("    counted, UPDATE:  {}", after.1.since(&before.1).per(ops(raw), "heartbeat"));
}

/// (c) 1,000 registrations over 100 projects on the API server, in rounds of their own
/// (a fresh namespace and operator each): first as a cluster without the chart's
/// admission policy has it (the operator adds finalizer and label, one more write per
/// resource), then with the policy installed as the chart does.
async fn bench_convergence(cp: &'static support::ControlPlane, client: &kube::Client, db: &support::TestDb) {
    convergence_rounds(cp, client, db, "operator adds finalizer+label").await;
    support::install_admission_policy(cp).await;
    convergence_rounds(cp, client, db, "chart's admission policy").await;
}

async fn convergence_rounds(
    cp: &'static support::ControlPlane,
    client: &kube::Client,
    db: &support::TestDb,
    how: &str,
) {
    println!("(c) 1,000 registrations / 100 projects, {how}:");
    let mut all = Vec::new();
    for round in 1..=rounds() {
        // Each round's namespace and operator end with it.
        all.push(
            converge::convergence(cp, client, &db.url, 1000, &common::open_limits(&[("RUST_LOG", "warn")]), round)
                .await
                .0,
        );
    }
    let ratio: Vec<f64> = all.iter().map(|c| c.ratio).collect();
    let rss: Vec<f64> = all.iter().map(|c| c.peak_rss_mib).collect();
    println!("    ratio right/accepted  {}", judged(&ratio, 2, Target::AtMost(1.5)));
    println!("    operator peak RSS MiB {}", judged(&rss, 1, Target::AtMost(64.0)));
    println!("    counted: {}", converge::writes_per_registration(&all, 1000));
}

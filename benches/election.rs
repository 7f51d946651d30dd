//! Election benchmark: the project and a baseline side by side in one run, on the same
//! real Postgres (and, for (c), the real kube-apiserver), printing the ratio. Every
//! figure is the median of `BENCH_ROUNDS` (>= 5) rounds with its min-max, judged as
//! benches/common/measure.rs says; counts are printed beside the rates.
//!
//!   scripts/bench election   (or: cargo bench --bench election, with the services up)
//!   BENCH_PARTS=a,c scripts/bench election   (only some of the parts)
//!
//! (a) registrations/s through the store vs. the raw SQL of the same work (one
//!     transaction: advisory lock on the project, read the live master, insert), at the
//!     same concurrency (target >= 0.7);
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
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::counts::{PgActivity, apiserver_writes, writes_since};
use common::measure::{
    CONCURRENCY, Target, Window, interleave, judged, rate, rates, ratios, rounds, spread, window_length,
};
use futures::{FutureExt, StreamExt};
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, ResourceExt};
use prism_operator::crd::{AgentSurface, ControllerRegistration, ControllerRegistrationSpec, Role};
use prism_operator::election::{ElectionStore, NewRegistration};
use serde_json::json;
use uuid::Uuid;

const PROJECTS: usize = 50;

fn surface(n: u64) -> AgentSurface {
    AgentSurface::ALL[(n % 5) as usize]
}

fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

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
    let cp = support::control_plane();
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
    // plain one.
    let pool = prism_operator::db::connect(&db.url).await.expect("operator pool");
    let before = settled(db, raw_db).await;
    let sides = interleave(2, rounds(), |side, round| {
        let (pool, db) = (&pool, if side == 0 { db } else { raw_db });
        async move {
            // The table grows by thousands of rows a second from empty, faster than
            // autovacuum analyses it; plans made from no statistics then read every live
            // row of the namespace (the counts below showed it). Both sides get current
            // statistics before each window, as a table at steady state has them.
            analyze(db, "controller_registrations").await;
            match side {
                0 => store_registrations(pool, round).await,
                _ => raw_registrations(raw_db, round).await,
            }
        }
        .boxed()
    })
    .await;
    let after = settled(db, raw_db).await;
    let (store, raw) = (&sides[0], &sides[1]);
    println!("(a) registrations/s   store {}   raw SQL {}", spread(&rates(store), 0), spread(&rates(raw), 0));
    println!("    ratio store/raw   {}", judged(&ratios(&rates(store), &rates(raw)), 2, Target::AtLeast(0.7)));
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
    let s = ElectionStore::new(pool.clone());
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
            };
            s.register(&reg).await.map_err(|e| eprintln!("store register failed: {e}")).is_ok()
        }
    })
    .await
}

/// The baseline: the same registration as one transaction of raw SQL (advisory lock on
/// the project, read the live master, insert).
async fn raw_registrations(db: &support::TestDb, round: usize) -> Window {
    let pool = db.pool.clone();
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
                sqlx::query(
                    "INSERT INTO controller_registrations (id, namespace, name, project_id, session_id, agent_surface, is_master, master_term)
                     VALUES ($1, 'bench-raw', $2, $3, $4, $5, $6, CASE WHEN $6 THEN 1 END)",
                )
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
    let op = support::Operator::start(cp, &db.url, &ns, &[("RUST_LOG", "warn")]).await;
    let token = support::agent_token(cp, &ns, "bench", &["create"]);
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
    let sides = interleave(2, rounds(), |side, _| {
        let (h, base, tok, ns, pool, ids) =
            (http.clone(), op.base.clone(), token.clone(), ns.clone(), raw_db.pool.clone(), ids.clone());
        match side {
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
        }
    })
    .await;
    let after = settled(db, raw_db).await;
    let (api, raw) = (&sides[0], &sides[1]);
    println!("(b) heartbeats/s      API {}   UPDATE each {}", spread(&rates(api), 0), spread(&rates(raw), 0));
    println!("    ratio API/UPDATE  {}", judged(&ratios(&rates(api), &rates(raw)), 1, Target::AtLeast(5.0)));
    println!("    counted, API:     {}", after.0.since(&before.0).per(ops(api), "heartbeat"));
    println!("    counted, UPDATE:  {}", after.1.since(&before.1).per(ops(raw), "heartbeat"));
}

/// Right: every project has one Master (a desktop: each project has two) and nine Peers,
/// and all ten name that Master.
fn all_right(items: &[Arc<ControllerRegistration>]) -> bool {
    #[derive(Default)]
    struct Project {
        masters: usize,
        peers: usize,
        named: std::collections::BTreeSet<String>,
        master: Option<String>,
        desktop_master: bool,
    }
    let mut by_project: BTreeMap<&str, Project> = BTreeMap::new();
    for r in items {
        let e = by_project.entry(r.spec.project_id.as_str()).or_default();
        let Some(st) = &r.status else { return false };
        match st.role {
            Role::Master => {
                e.masters += 1;
                e.master = Some(r.name_any());
                e.desktop_master = r.spec.agent_surface.is_desktop();
            }
            Role::Peer => e.peers += 1,
            _ => {}
        }
        if let Some(m) = &st.master {
            e.named.insert(m.name.clone());
        }
    }
    items.len() == 1000
        && by_project.len() == 100
        && by_project.values().all(|p| {
            p.masters == 1
                && p.peers == 9
                && p.desktop_master
                && p.named.len() == 1
                && p.master.as_ref().is_some_and(|m| p.named.contains(m))
        })
}

/// (c) 1,000 registrations over 100 projects on the API server, in rounds of their own
/// (a fresh namespace and operator each): first as a cluster without the chart's
/// admission policy has it (the operator adds finalizer and label, one more write per
/// resource), then with the policy installed as the chart does.
async fn bench_convergence(cp: &'static support::ControlPlane, client: &kube::Client, db: &support::TestDb) {
    convergence_rounds(cp, client, db, "operator adds finalizer+label").await;
    support::install_admission_policy(cp);
    convergence_rounds(cp, client, db, "chart's admission policy").await;
}

/// One round of (c).
struct Converged {
    /// Seconds until every status was right / seconds the creates took.
    ratio: f64,
    peak_rss_mib: f64,
    /// API server writes during the round, by "VERB resource[/subresource]".
    writes: BTreeMap<String, f64>,
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
        all.push(convergence(cp, client, db, round).await);
    }
    let ratio: Vec<f64> = all.iter().map(|c| c.ratio).collect();
    let rss: Vec<f64> = all.iter().map(|c| c.peak_rss_mib).collect();
    println!("    ratio right/accepted  {}", judged(&ratio, 2, Target::AtMost(1.5)));
    println!("    operator peak RSS MiB {}", judged(&rss, 1, Target::AtMost(64.0)));
    // Counted: the API server's writes per registration, the bench's own creates apart.
    let mut total: BTreeMap<String, f64> = BTreeMap::new();
    for c in &all {
        for (k, v) in &c.writes {
            *total.entry(k.clone()).or_default() += v;
        }
    }
    let per = |v: f64| v / (1000.0 * all.len() as f64);
    let creates = total.remove("POST controllerregistrations").unwrap_or(0.0);
    let operator: f64 = total.values().sum();
    let each: Vec<String> = total.iter().map(|(k, v)| format!("{k} {:.2}", per(*v))).collect();
    println!(
        "    counted: API server writes per registration besides its create ({:.2}): {:.2} ({})",
        per(creates),
        per(operator),
        each.join(", ")
    );
}

async fn convergence(
    cp: &'static support::ControlPlane,
    client: &kube::Client,
    db: &support::TestDb,
    round: usize,
) -> Converged {
    let ns = support::namespace(client, "benchconv").await;
    let op = support::Operator::start(cp, &db.url, &ns, &[("RUST_LOG", "warn")]).await;
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    let (seen, writer) = reflector::store();
    let watch = tokio::spawn(
        watcher(api.clone(), watcher::Config::default())
            .default_backoff()
            .reflect(writer)
            .for_each(|_| std::future::ready(())),
    );
    // Warm up: the operator's watch, connections and pools are up once one registration
    // has its status. Its start-up is not what this measures.
    let spec = ControllerRegistrationSpec {
        project_id: "warm-up".into(),
        session_id: "warm-up".into(),
        agent_surface: AgentSurface::Other,
    };
    api.create(&PostParams::default(), &ControllerRegistration::new("warm-up", spec)).await.expect("create");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !seen.state().iter().any(|r| r.status.as_ref().is_some_and(|s| s.role == Role::Master)) {
        assert!(Instant::now() < deadline, "warm-up registration got no status in 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its last writes (an Event) may trail its status.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let writes_before = apiserver_writes(client).await.expect("API server /metrics");
    let cpu_before = [cpu_of("kube-apiserver"), cpu_of("etcd"), cpu_of("postgres"), cpu_seconds(op.pid())];
    let started = Instant::now();
    futures::stream::iter(0..1000u64)
        .map(|n| {
            let api = api.clone();
            async move {
                let spec = ControllerRegistrationSpec {
                    project_id: format!("P{:03}", n % 100),
                    session_id: format!("conv-{n}"),
                    agent_surface: surface(n / 100),
                };
                api.create(&PostParams::default(), &ControllerRegistration::new(&format!("c{n:04}"), spec))
                    .await
                    .expect("create");
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
    let accepted = started.elapsed();
    // Statuses are read from a watch-fed cache, not by listing: a LIST of 1,000 objects
    // every 100 ms would load the API server more than the operator does.
    let converged = loop {
        let state = seen.state();
        let measured: Vec<_> = state.into_iter().filter(|r| r.name_any().starts_with('c')).collect();
        if all_right(&measured) {
            break Some(started.elapsed());
        }
        if started.elapsed() > Duration::from_secs(300) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    watch.abort();
    let cpu = [
        cpu_of("kube-apiserver") - cpu_before[0],
        cpu_of("etcd") - cpu_before[1],
        cpu_of("postgres") - cpu_before[2],
        cpu_seconds(op.pid()) - cpu_before[3],
    ];
    // Writes that trail the last status (Events) belong to the round.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let writes = writes_since(&apiserver_writes(client).await.expect("API server /metrics"), &writes_before);
    let peak_rss_mib = peak_rss_mib(op.pid());
    let Some(converged) = converged else {
        println!("    round {round}: did not converge within 300 s");
        return Converged { ratio: f64::INFINITY, peak_rss_mib, writes };
    };
    let ratio = converged.as_secs_f64() / accepted.as_secs_f64();
    println!(
        "    round {round}: accepted in {:.2}s, right at {:.2}s, ratio {ratio:.2}, peak RSS {peak_rss_mib:.1} MiB; CPU s: kube-apiserver {:.1}, etcd {:.1}, postgres {:.1}, operator {:.1} (of {:.1})",
        accepted.as_secs_f64(),
        converged.as_secs_f64(),
        cpu[0],
        cpu[1],
        cpu[2],
        cpu[3],
        2.0 * converged.as_secs_f64()
    );
    Converged { ratio, peak_rss_mib, writes }
}

/// User + system CPU seconds of a process.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (which may hold spaces): utime and stime are
    // the 12th and 13th of them, in clock ticks (100 per second on Linux).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU seconds of every process with this name (on this machine: the bench's own
/// control plane and the shared Postgres).
fn cpu_of(comm: &str) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0.0 };
    dir.flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm))
        .map(cpu_seconds)
        .sum()
}

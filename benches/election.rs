//! Election benchmark: the project and a baseline side by side in one run, on the same
//! real Postgres (and, for (c), the real kube-apiserver), printing the ratio.
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
//!     <= 1.5), and the operator's peak RSS then (target <= 64 MiB); once with the
//!     operator adding finalizer and label itself, once with the chart's admission policy.

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{CONCURRENCY, WINDOW, rate};
use futures::StreamExt;
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

#[tokio::main]
async fn main() {
    let db = support::TestDb::new().await;
    println!("prism-operator election benchmark (concurrency {CONCURRENCY}, {}s windows)\n", WINDOW.as_secs());
    // (a) needs only Postgres: it runs before the API server starts, whose start-up would
    // otherwise share the two cores with the first window.
    if part("a") {
        bench_registrations(&db).await;
    }
    if !part("b") && !part("c") {
        return;
    }
    let cp = support::control_plane();
    let client = cp.client().await;
    if part("b") {
        bench_heartbeats(cp, &client, &db).await;
    }
    if part("c") {
        bench_convergence(cp, &client, &db).await;
    }
}

/// (a) registrations through the store vs. raw SQL, each on PROJECTS projects. The two
/// alternate store, raw, raw, store, so drift on the machine (a table that grows, a
/// neighbour's load) weighs on both alike; each side's rate is the mean of its windows.
async fn bench_registrations(db: &support::TestDb) {
    for p in 0..PROJECTS {
        sqlx::query("INSERT INTO controller_projects (namespace, project_id) VALUES ('bench-raw', $1)")
            .bind(format!("p{p}"))
            .execute(&db.pool)
            .await
            .expect("project");
    }
    // The store on the operator's own pool (its connection settings), the baseline on a
    // plain one.
    let pool = prism_operator::db::connect(&db.url).await.expect("operator pool");
    let (mut store_rate, mut raw_rate) = (0.0, 0.0);
    for (round, store_first) in [true, false].into_iter().enumerate() {
        for store_turn in [store_first, !store_first] {
            if store_turn {
                store_rate += store_registrations(&pool, round).await / 2.0;
            } else {
                raw_rate += raw_registrations(db, round).await / 2.0;
            }
        }
    }
    println!(
        "(a) registrations/s  store {store_rate:>8.0}   raw SQL {raw_rate:>8.0}   ratio {:.2}   (target >= 0.7)",
        store_rate / raw_rate
    );
}

async fn store_registrations(pool: &sqlx::PgPool, round: usize) -> f64 {
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
async fn raw_registrations(db: &support::TestDb, round: usize) -> f64 {
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

/// (b) heartbeats: the HTTP API (coalesced) vs. one UPDATE per heartbeat.
async fn bench_heartbeats(cp: &'static support::ControlPlane, client: &kube::Client, db: &support::TestDb) {
    let ns = support::namespace(client, "benchhb").await;
    let op = support::Operator::start(cp, &db.url, &ns, &[("RUST_LOG", "warn")]).await;
    let token = support::agent_token(cp, &ns, "bench", &["create"]);
    let http = support::http();
    let mut ids = Vec::new();
    for i in 0..CONCURRENCY {
        let body = support::register(&op, &token, &ns, "HB", &format!("hb-{i}"), "claude_code").await;
        ids.push(Uuid::parse_str(body["registration"]["id"].as_str().expect("id")).expect("uuid"));
    }
    let (h, base, tok, ns2) = (http.clone(), op.base.clone(), token.clone(), ns.clone());
    let api_hb = rate(move |i, _| {
        let (h, base, tok, ns) = (h.clone(), base.clone(), tok.clone(), ns2.clone());
        async move {
            h.post(format!("{base}/api/v1/controller/heartbeat"))
                .bearer_auth(&tok)
                .json(&json!({"namespace": ns, "session_id": format!("hb-{i}")}))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        }
    })
    .await;
    let (pool, ids) = (db.pool.clone(), Arc::new(ids));
    let raw_hb = rate(move |i, _| {
        let (pool, ids) = (pool.clone(), ids.clone());
        async move {
            sqlx::query("UPDATE controller_registrations SET last_heartbeat = now() WHERE id = $1")
                .bind(ids[i])
                .execute(&pool)
                .await
                .is_ok()
        }
    })
    .await;
    println!(
        "(b) heartbeats/s     API {api_hb:>10.0}   UPDATE each {raw_hb:>6.0}   ratio {:.1}x   (target >= 5x)",
        api_hb / raw_hb
    );
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

/// (c) 1,000 registrations over 100 projects on the API server, twice: as a cluster
/// without the chart's admission policy has it (the operator adds finalizer and label,
/// one more write per resource), then with the policy installed as the chart does.
async fn bench_convergence(cp: &'static support::ControlPlane, client: &kube::Client, db: &support::TestDb) {
    convergence(cp, client, db, "operator adds finalizer+label").await;
    support::install_admission_policy(cp);
    convergence(cp, client, db, "chart's admission policy").await;
}

async fn convergence(cp: &'static support::ControlPlane, client: &kube::Client, db: &support::TestDb, how: &str) {
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
            break started.elapsed();
        }
        if started.elapsed() > Duration::from_secs(300) {
            println!("(c) did not converge within 300 s");
            break started.elapsed();
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
    println!(
        "(c) 1,000 registrations / 100 projects, {how}: accepted in {:.2}s, all statuses right at {:.2}s, ratio {:.2}   (target <= 1.5); operator peak RSS {:.1} MiB (target <= 64)",
        accepted.as_secs_f64(),
        converged.as_secs_f64(),
        converged.as_secs_f64() / accepted.as_secs_f64(),
        peak_rss_mib(op.pid())
    );
    println!(
        "    CPU seconds meanwhile: kube-apiserver {:.1}, etcd {:.1}, postgres {:.1}, operator {:.1} (2 cores: {:.1} available)",
        cpu[0],
        cpu[1],
        cpu[2],
        cpu[3],
        2.0 * converged.as_secs_f64()
    );
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

//! `/metrics` with many Run identities. The operator refreshes its cluster-wide gauges in
//! the background every 10 s (`health::GAUGES_EVERY`; SPEC §12), so a scrape renders
//! what it holds and a flood of scrapes is no flood on Postgres or Redis. Two figures:
//!
//! 1. a whole `GET /metrics` against the operator, one scraper as Prometheus scrapes
//!    (goal: <= 100 ms at 10,000 Run identities);
//! 2. the refresh's Redis part, the runs-online count (`SessionStore::count_live`: EXISTS
//!    of every identity's session key, in pipelines of 1,000 per Redis master) vs. a raw
//!    Redis pipeline of the same reads (one per master, all at once), in alternating
//!    rounds (benches/common/measure.rs), with the operator stopped so that its own
//!    refresh does not run beside them.
//!
//!   scripts/bench metrics                          (10,000 identities, standalone Redis)
//!   BENCH_RUNS=1000 scripts/bench metrics          (another size)
//!   PRISM_TEST_REDIS=cluster scripts/bench metrics (a Redis Cluster of three masters)
//!
//! Identities are written straight into Postgres and three in four get a live session
//! (the store's own hello script): the gauges read what the RunSession reconciler would
//! have mirrored, without 10,000 resources on the API server. Redis is a server (or
//! cluster) of the bench's own, so its counters hold only this bench's commands.

mod common;
use prism_testkit as support;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use common::counts::{RedisActivity, RedisCounters, redis_counted};
use common::measure::{Target, Window, interleave, judged, ratios, rounds, spread, window_length};
use common::scrape::scrapes;
use futures::{FutureExt, StreamExt};
use prism_operator::config::RedisEndpoint;
use prism_operator::run_registry::sessions::NewSession;
use prism_operator::run_registry::{RunAddress, SessionStore};

fn runs() -> usize {
    std::env::var("BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
}

/// The baseline: EXISTS of every key, one pipeline per master, all at once, each on a
/// plain connection to its node.
struct RawPipelines {
    /// (connection to a master, the keys on it)
    groups: Vec<(redis::aio::MultiplexedConnection, Vec<String>)>,
}

impl RawPipelines {
    async fn new(nodes: &[String], keys: &[String], cluster: bool) -> RawPipelines {
        let mut conns = BTreeMap::new();
        for url in nodes {
            let conn = redis::Client::open(url.as_str())
                .expect("node URL")
                .get_multiplexed_async_connection()
                .await
                .expect("connect to a node");
            conns.insert(url.trim_start_matches("redis://").to_string(), conn);
        }
        if !cluster {
            let conn = conns.into_values().next().expect("one node");
            return RawPipelines { groups: vec![(conn, keys.to_vec())] };
        }
        // Which master serves which slots, then each key to its slot's master.
        let mut any = conns.values().next().expect("a node").clone();
        let slots: Vec<redis::Value> = redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut any).await.expect("slots");
        let mut owner: Vec<(u16, u16, String)> = Vec::new();
        for entry in slots {
            let redis::Value::Array(items) = entry else { continue };
            let (Some(redis::Value::Int(start)), Some(redis::Value::Int(end)), Some(redis::Value::Array(master))) =
                (items.first(), items.get(1), items.get(2))
            else {
                continue;
            };
            let host = match master.first() {
                Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                _ => continue,
            };
            let Some(redis::Value::Int(port)) = master.get(1) else { continue };
            owner.push((*start as u16, *end as u16, format!("{host}:{port}")));
        }
        let mut by_node: HashMap<String, Vec<String>> = HashMap::new();
        for key in keys {
            let slot = key_slot(key);
            let node = owner.iter().find(|(s, e, _)| (*s..=*e).contains(&slot)).expect("every slot has a master");
            by_node.entry(node.2.clone()).or_default().push(key.clone());
        }
        let groups = by_node
            .into_iter()
            .map(|(node, keys)| (conns.get(&node).expect("a connection to every master").clone(), keys))
            .collect();
        RawPipelines { groups }
    }

    /// One pass: how many keys exist.
    async fn count(&self) -> bool {
        let passes = self.groups.iter().map(|(conn, keys)| {
            let mut conn = conn.clone();
            async move {
                let mut pipe = redis::pipe();
                for k in keys {
                    pipe.exists(k);
                }
                let found: Vec<bool> = pipe.query_async(&mut conn).await?;
                Ok::<_, redis::RedisError>(found.into_iter().filter(|f| *f).count())
            }
        });
        futures::future::try_join_all(passes).await.is_ok()
    }
}

/// Redis Cluster's slot of a key (its hash tag's, if it has one).
fn key_slot(key: &str) -> u16 {
    let tagged = key
        .find('{')
        .and_then(|open| key[open + 1..].find('}').map(|len| &key[open + 1..open + 1 + len]))
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tagged.as_bytes()) % 16384
}

/// One window of sequential calls (one client, as Prometheus scrapes).
async fn sequential<F, Fut>(op: F) -> Window
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    common::measure::window(1, window_length(), op).await
}

#[tokio::main]
async fn main() {
    let n = runs();
    let cluster = support::redis_cluster_mode();
    let cp = support::control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "benchmetrics").await;
    let db = support::TestDb::new().await;
    let redis = support::PrivateRedis::start().await;
    let prefix = support::redis_prefix();
    let mut op = support::Operator::start(
        cp,
        &db.url,
        &ns,
        &common::open_limits(&[("REDIS_URL", &redis.url), ("PRISM_REDIS_PREFIX", &prefix), ("RUST_LOG", "warn")]),
    )
    .await;
    let nodes: Vec<String> = redis.url.split(',').map(str::to_string).collect();
    let endpoint =
        if cluster { RedisEndpoint::Cluster(nodes.clone()) } else { RedisEndpoint::Standalone(redis.url.clone()) };
    let store = SessionStore::new(&endpoint, &prefix).expect("session store");
    println!(
        "prism-operator /metrics benchmark: {n} Run identities, {} Redis, {} rounds of {:.1}s windows per side\n",
        if cluster { "a 3-master cluster of" } else { "a standalone" },
        rounds(),
        window_length().as_secs_f64()
    );

    // The identities, as the reconciler mirrors them, and a live session for three in four.
    sqlx::query(
        "INSERT INTO run_identities (id, namespace, name, server_instance_id, component_kind, public_key, key_generation)
         SELECT gen_random_uuid(), $1, 'scrape-' || g, 'scrape-' || g, 'run', repeat('A', 43) || '=', 1
         FROM generate_series(1, $2) g",
    )
    .bind(&ns)
    .bind(n as i64)
    .execute(&db.pool)
    .await
    .expect("identities");
    let addresses: Vec<RunAddress> = (1..=n)
        .map(|g| RunAddress { server_instance_id: format!("scrape-{g}"), component_kind: "run".into() })
        .collect();
    let online: Vec<&RunAddress> = addresses.iter().enumerate().filter(|(i, _)| i % 4 != 0).map(|(_, a)| a).collect();
    let started = Instant::now();
    futures::stream::iter(online.iter().copied())
        .map(|a| {
            let store = store.clone();
            async move {
                let session = NewSession {
                    token_hash: "bench",
                    session_id: uuid::Uuid::new_v4(),
                    generation: 1,
                    epoch: 1,
                    now: chrono::Utc::now(),
                    lease: Duration::from_secs(3600),
                    version: None,
                    target: None,
                    capabilities: &[],
                    capacity: &BTreeMap::new(),
                };
                store.hello(a, &uuid::Uuid::new_v4().simple().to_string(), &session, Duration::from_secs(60)).await
            }
        })
        .buffer_unordered(64)
        .for_each(|r| {
            r.expect("hello");
            std::future::ready(())
        })
        .await;
    println!("{} live sessions written in {:.1}s", online.len(), started.elapsed().as_secs_f64());

    let http = support::http();
    let url = op.url("/metrics");
    let expected = format!("prism_runtime_runs_online {}", online.len());
    // The gauge is the background refresh's: wait for it to have counted these sessions.
    support::metric_line(&op, &expected).await;
    let scraped = interleave(1, rounds(), |_, _| scrapes(http.clone(), url.clone(), Some(expected.clone()))).await;
    let scrape_ms: Vec<f64> = scraped[0].iter().map(Window::ms_per_op).collect();
    println!("1. GET /metrics, ms per scrape     {}", judged(&scrape_ms, 3, Target::AtMost(100.0)));
    // Stopped, the operator's refresh no longer runs beside the count and the raw passes,
    // nor in Redis's counters of them.
    op.kill().await;
    let keys: Vec<String> = addresses.iter().map(|a| store.session_keys(a).0).collect();
    let raw = std::sync::Arc::new(RawPipelines::new(&nodes, &keys, cluster).await);
    assert!(raw.count().await, "the raw pipelines answer");
    assert_eq!(store.count_live(&addresses).await.expect("count"), online.len(), "the store counts the live sessions");
    let counters = RedisCounters::connect(&nodes).await.expect("connect to Redis");

    // For reference, once: the same reads one after another, as each scrape did before
    // the count was pipelined (the store's per-identity read).
    let t = Instant::now();
    let mut live = 0;
    for a in &addresses {
        live += usize::from(store.session(a).await.expect("read a session").is_some());
    }
    let one_by_one = t.elapsed();
    assert_eq!(live, online.len());

    let live_count = online.len();
    let addresses = std::sync::Arc::new(addresses);
    let sides = interleave(2, rounds(), |side, _| match side {
        0 => {
            let (store, addresses, want) = (store.clone(), addresses.clone(), live_count);
            redis_counted(
                &counters,
                sequential(move |_, _| {
                    let (store, addresses) = (store.clone(), addresses.clone());
                    async move { store.count_live(&addresses).await.is_ok_and(|n| n == want) }
                }),
            )
            .boxed()
        }
        _ => {
            let raw = raw.clone();
            redis_counted(
                &counters,
                sequential(move |_, _| {
                    let raw = raw.clone();
                    async move { raw.count().await }
                }),
            )
            .boxed()
        }
    })
    .await;
    let ms = |side: &[(Window, RedisActivity)]| side.iter().map(|(w, _)| w.ms_per_op()).collect::<Vec<f64>>();
    let count = |side: &[(Window, RedisActivity)]| {
        let mut all = RedisActivity::default();
        for (_, r) in side {
            all.add(r);
        }
        (side.iter().map(|(w, _)| w.ops).sum::<u64>(), all)
    };
    let (count_ms, raw_ms) = (ms(&sides[0]), ms(&sides[1]));
    println!("2. runs-online count, ms per count {}", spread(&count_ms, 2));
    println!("   raw Redis pipelines, ms per pass {}", spread(&raw_ms, 2));
    println!("   ratio count / raw pipelines      {}", spread(&ratios(&count_ms, &raw_ms), 1));
    let (counts, counted) = count(&sides[0]);
    let (passes, piped) = count(&sides[1]);
    println!("   counted, the store's count: {}", counted.per(counts, "count"));
    println!("   counted, raw pipelines:     {}", piped.per(passes, "pass"));
    println!(
        "reference: the same {n} reads one after another (a scrape's Redis part before the pipelines): {:.0} ms",
        one_by_one.as_secs_f64() * 1000.0
    );
}

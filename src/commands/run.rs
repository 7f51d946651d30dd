//! `prism-operator run`: wires configuration, stores, the Kubernetes client, the
//! controllers, the background loops and the HTTP API together, and shuts down cleanly
//! on SIGTERM.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tracing::{info, warn};

use crate::agent_sessions::AgentService;
use crate::api::{self, AppState};
use crate::config::{RunArgs, redact_url};
use crate::db;
use crate::election::ElectionStore;
use crate::election::heartbeat::HeartbeatCoalescer;
use crate::reconcilers;
use crate::run_registry::RedisStore;
use crate::run_registry::identity::IdentityStore;
use crate::run_registry::jobs::JobStore;
use crate::run_registry::service::RuntimeService;
use crate::telemetry::Metrics;

/// Heartbeats arriving within this window become one UPDATE.
const HEARTBEAT_WINDOW: Duration = Duration::from_millis(250);

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    args.validate()?;
    let database_url = args.database.url()?;
    let pool = connect_with_retry(database_url).await?;
    db::migrate(&pool).await?;
    info!(database = %redact_url(database_url), "migrations applied");

    let redis_url = args.redis_url()?;
    let redis = RedisStore::new(redis_url, &args.redis_prefix)
        .with_context(|| format!("REDIS_URL {} is malformed", redact_url(redis_url)))?;
    if let Err(e) = redis.ping().await {
        warn!(redis = %redact_url(redis_url), error = %e, "Redis is unreachable; the runtime registry is unavailable until it returns");
    }

    let kube = kube::Client::try_default()
        .await
        .context("cannot build a Kubernetes client (in cluster: service account; outside: KUBECONFIG)")?;

    let metrics = Arc::new(Metrics::default());
    let election = ElectionStore::new(pool.clone());
    let heartbeats = HeartbeatCoalescer::spawn(election.clone(), HEARTBEAT_WINDOW, metrics.heartbeat_flushes.clone());
    let runtime = RuntimeService {
        redis: redis.clone(),
        identities: IdentityStore::new(pool.clone()),
        jobs: JobStore::new(pool.clone(), Duration::from_secs(u64::from(args.job_visibility_seconds))),
        default_lease_seconds: args.run_lease_seconds,
    };
    let triggers = reconcilers::Triggers::default();
    let ctx = Arc::new(reconcilers::Context {
        client: kube.clone(),
        election: election.clone(),
        runtime: runtime.clone(),
        recorder: reconcilers::recorder(kube.clone()),
        triggers: triggers.clone(),
        stale_after: chrono::Duration::minutes(i64::from(args.peer_stale_minutes)),
        metrics: metrics.clone(),
        reconcile_concurrency: args.reconcile_concurrency,
        written_registrations: Default::default(),
        written_runsessions: Default::default(),
        failures: Default::default(),
    });
    // Controllers, the stale sweep, the job reaper and the registry watch: on the Lease
    // holder only when leader election is on; every replica serves the HTTP API.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let leader_work = {
        let ctx = ctx.clone();
        let namespace = args.watch_namespace.clone();
        let stale = args.peer_stale_minutes;
        let sweep_every = Duration::from_secs(u64::from(args.sweep_interval_seconds));
        move || reconcilers::lead(ctx.clone(), namespace.clone(), stale, sweep_every)
    };
    if args.leader_election {
        let cfg = crate::leader::LeaseConfig::from_env("prism-operator-leader");
        let mut rx = stop_rx.clone();
        tokio::spawn(crate::leader::run(kube.clone(), cfg, leader_work, async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }));
    } else {
        tokio::spawn(leader_work());
    }

    let agents = AgentService {
        client: kube.clone(),
        store: election,
        heartbeats,
        triggers: triggers.clone(),
        stale_window: chrono::Duration::hours(24),
        views: Default::default(),
    };
    let auth = api::auth::Authorizer::new(kube.clone());
    let state = Arc::new(AppState { db: pool, redis, kube, auth, agents, runtime, triggers, metrics });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {} (PRISM_LISTEN)", args.listen))?;
    info!(listen = %args.listen, "HTTP API serving");
    let mut rx = stop_rx.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    axum::serve(listener, api::router(state))
        .with_graceful_shutdown(async move {
            let _ = rx.wait_for(|stop| *stop).await;
        })
        .await
        .context("HTTP server failed")?;
    // Give the leader loop a moment to hand the Lease back.
    tokio::time::sleep(Duration::from_millis(300)).await;
    info!("stopped");
    Ok(())
}

/// Postgres may start after the operator (a Helm install starts both at once): retry for
/// a while, saying so, then give up with the cause.
async fn connect_with_retry(url: &str) -> anyhow::Result<sqlx::PgPool> {
    let mut last = None;
    for attempt in 1..=15 {
        match db::connect(url).await {
            Ok(pool) => return Ok(pool),
            Err(e) => {
                warn!(attempt, error = %e, "PostgreSQL not reachable yet");
                last = Some(e);
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }
    Err(last.map(anyhow::Error::from).unwrap_or_else(|| anyhow::anyhow!("PostgreSQL not reachable")))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    info!("shutdown signal received");
}

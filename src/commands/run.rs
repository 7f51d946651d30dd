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
use crate::election::heartbeat::{COALESCING_WINDOW, HeartbeatCoalescer};
use crate::mcp_store::McpStore;
use crate::metrics::Metrics;
use crate::reconcilers;
use crate::reconcilers::status::Written;
use crate::refresh;
use crate::run_registry::SessionStore;
use crate::run_registry::identity::IdentityStore;
use crate::run_registry::jobs::{JobSettings, JobStore};
use crate::run_registry::service::RunRegistry;
use crate::signals::Signals;
use crate::transport;
use prism_api::settings::ApiSettings;

/// Between the server's connections learning that keep-alive is over and the stop of
/// waiting claims and streams: long enough for every connection task to take the notice.
const DRAIN_HANDOFF: Duration = Duration::from_millis(100);

/// `prism-operator run`, step by step.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    // Everything checked before anything connects: the operator's settings, then the API's.
    args.validate()?;
    let settings = args.api.read()?;
    // Before anything else connects: a stale CRD is the chart's to fix, and says so.
    check_crds(&kube_client().await?).await?;
    // Two pools: the HTTP API's, and the controllers' and background loops' (SPEC §12: a
    // flood of API calls cannot starve the election's reconciles, and /readyz does not
    // fail because the API pool is busy).
    let (api_pool, controller_pool) = open_database(&args).await?;
    let sessions = open_session_store(&args).await?;
    // Three clients, each with its own connections and request queue (SPEC §12): the
    // callers' TokenReviews, access reviews and creates (`api_kube`) never delay the
    // controllers' calls (`kube`), and neither delays a renewal of the leader Lease
    // (`lease_kube`): a flood of callers cannot cost the operator its leadership.
    let kube = kube_client().await?;
    let api_kube = kube_client().await?;
    let lease_kube = kube_client().await?;
    // SPEC §15: before anything elects or answers, a database that forgot terms it
    // issued (a restore) is raised above every term seen; then the mark follows it.
    let operator_namespace = std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "default".into());
    let mut term_guard = crate::term_guard::TermGuard::new(
        kube.clone(),
        &operator_namespace,
        &args.term_mark,
        crate::election::restore::RestoreGuard::new(controller_pool.clone()),
    );
    term_guard.check_at_start(args.watch_namespace.as_deref()).await?;
    let metrics = Arc::new(Metrics::default());
    let quotas = crate::election::Quotas {
        per_owner: settings.max_sessions_per_identity,
        per_namespace: settings.max_sessions_per_namespace,
    };
    // One for both registries; every replica listens (its API answers heartbeats and claims).
    let signals = Signals::counting_role_reads(metrics.role_reads.clone());
    tokio::spawn(signals.clone().follow(api_pool.clone()));
    let registry_on = |pool: &sqlx::PgPool| {
        let jobs = JobStore::new(
            pool.clone(),
            JobSettings {
                visibility: Duration::from_secs(u64::from(args.job_visibility_seconds)),
                default_max_attempts: i32::from(args.job_max_attempts),
                default_timeout_seconds: i32::try_from(args.job_timeout_seconds).unwrap_or(600),
                cancel_grace: Duration::from_secs(u64::from(args.job_cancel_grace_seconds)),
                max_queued_per_namespace: i64::from(args.max_queued_jobs_per_namespace),
                queued_ttl: Duration::from_secs(u64::from(args.job_queued_ttl_hours) * 3600),
            },
        );
        RunRegistry::new(
            sessions.clone(),
            IdentityStore::new(pool.clone()),
            jobs,
            signals.clone(),
            args.run_lease_seconds,
        )
    };
    let (api_registry, controller_registry) = (registry_on(&api_pool), registry_on(&controller_pool));
    // Both stores answer heartbeats' roles from what the listener keeps, and tell it of their commits.
    let controller_election = ElectionStore::with_quotas(controller_pool.clone(), quotas)
        .with_live_roles(signals.live_roles())
        .counting_project_reads(metrics.project_reads.clone());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // The Lease is handed back only after the API has answered its waiting claims and
    // ended its streams (SPEC §11): until then this replica still leads, and the
    // clients it sends elsewhere find a replica that is not stopping.
    let (lease_stop_tx, lease_stop_rx) = tokio::sync::watch::channel(false);
    let leading = start_leader_work(
        &args,
        LeaderClients { controllers: &kube, lease: &lease_kube },
        &controller_pool,
        &controller_election,
        &controller_registry,
        &metrics,
        lease_stop_rx,
    );
    let election = ElectionStore::with_quotas(api_pool.clone(), quotas).with_live_roles(signals.live_roles());
    let heartbeats = HeartbeatCoalescer::spawn(election.clone(), COALESCING_WINDOW, metrics.heartbeat_flushes.clone());
    let ApiSettings {
        limits,
        allowed_hosts,
        session_key,
        tls,
        audiences,
        listen,
        max_connections,
        max_connections_per_address,
        streams,
        ..
    } = settings;
    let mcp = mcp_config(allowed_hosts, session_key, &api_pool).await?;
    let limits = Arc::new(limits);
    spawn_limit_pruning(limits.clone());
    let health = Arc::new(api::health::Health::default());
    let probes = api::health::Probes {
        election: controller_election.clone(),
        registry: controller_registry,
        kube: kube.clone(),
        metrics: metrics.clone(),
    };
    // Probed once before serving: /readyz answers from the first request on.
    let probes = Arc::new(probes);
    api::health::probe(&health, &probes).await;
    api::health::spawn(health.clone(), probes);
    let state = Arc::new(AppState {
        health,
        auth: api::auth::Authorizer::new(api_kube.clone(), audiences, limits.clone()),
        limits,
        agents: AgentService::new(api_kube.clone(), election, heartbeats, signals.clone()),
        kube: api_kube,
        registry: api_registry,
        metrics,
        mcp,
        stopping: stop_rx.clone(),
        signals: signals.clone(),
        streams,
    });
    let term_mark = tokio::spawn(term_guard.keep(stop_rx.clone()));
    let (stopping_health, delay) = (state.health.clone(), args.shutdown_delay());
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    let (drain_tx, drain_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        // Not ready at once, but serving for `delay` more: until the endpoints without
        // this pod reach every node, new connections still arrive here, and a closed
        // listener would refuse them (or, once the pod is gone, leave them unanswered).
        // Each answer from now on closes its connection, so kept-alive clients move on
        // through the Service (transport::closing).
        stopping_health.stop();
        let _ = closing_tx.send(true);
        if !delay.is_zero() {
            info!(delay_seconds = delay.as_secs(), "not ready; serving until the Service forgets this replica");
            tokio::time::sleep(delay).await;
        }
        // The connections learn first that keep-alive is over, then the waiting claims
        // are answered and the streams end: each such answer then closes its connection,
        // rather than leaving it idle for the client to reuse just as the server drops it.
        let _ = drain_tx.send(true);
        tokio::time::sleep(DRAIN_HANDOFF).await;
        // Receivers live as long as the server and the leader loop; none left is fine.
        let _ = stop_tx.send(true);
    });
    serve_api(listen, (max_connections, max_connections_per_address), tls, state, (closing_rx, drain_rx)).await?;
    info!("HTTP API stopped: waiting claims answered, watches and MCP streams ended");
    // The last changes in the mark (bounded: the mark is written within a second anyway).
    let _ = tokio::time::timeout(Duration::from_secs(5), term_mark).await;
    let _ = lease_stop_tx.send(true);
    if let Some(leading) = leading {
        // Bounded: a Lease that cannot be written now expires by itself.
        let _ = tokio::time::timeout(Duration::from_secs(5), leading).await;
    }
    info!("stopped");
    Ok(())
}

/// Connects (waiting for a Postgres that starts with us), applies the migrations, and
/// opens the API's pool beside the controllers'.
async fn open_database(args: &RunArgs) -> anyhow::Result<(sqlx::PgPool, sqlx::PgPool)> {
    let url = args.database.url()?;
    let controllers = connect_with_retry(url, args.controller_db_connections).await?;
    db::migrate(&controllers).await?;
    info!(database = %redact_url(url), "migrations applied");
    let api = db::connect_with(url, args.api_db_connections).await?;
    Ok((api, controllers))
}

/// The MCP allow-list, and the key that signs MCP session ids: the configured one, else
/// the one every replica of this database shares.
async fn mcp_config(
    allowed_hosts: api::mcp::AllowedHosts,
    session_key: Option<api::mcp::SessionKey>,
    pool: &sqlx::PgPool,
) -> anyhow::Result<api::mcp::McpConfig> {
    let subscriptions = McpStore::new(pool.clone());
    let session_key = match session_key {
        Some(key) => key,
        None => api::mcp::SessionKey::shared(&subscriptions).await?,
    };
    spawn_subscription_pruning(subscriptions.clone());
    Ok(api::mcp::McpConfig { allowed_hosts, session_key, subscriptions })
}

/// The Redis side of the registry. An unreachable Redis is no reason not to start: the
/// registry reports itself unavailable until it returns.
async fn open_session_store(args: &RunArgs) -> anyhow::Result<SessionStore> {
    let endpoint = args.redis_endpoint()?;
    let sessions = SessionStore::new(&endpoint, &args.redis_prefix)
        .with_context(|| format!("REDIS_URL {} is malformed", endpoint.redacted()))?;
    match sessions.ping().await {
        Ok(()) => info!(redis = %endpoint.redacted(), "runtime registry (Redis) reachable"),
        Err(e) => {
            warn!(redis = %endpoint.redacted(), error = %e, "Redis is unreachable; the runtime registry is unavailable until it returns")
        }
    }
    Ok(sessions)
}

async fn kube_client() -> anyhow::Result<kube::Client> {
    kube::Client::try_default()
        .await
        .context("cannot build a Kubernetes client (in cluster: service account; outside: KUBECONFIG)")
}

/// SPEC §15: the operator does not run against a CRD older than its build (the API
/// server would prune the fields it writes); the error names the CRD and what it lacks.
/// An API server that does not answer yet is asked again for a minute.
async fn check_crds(client: &kube::Client) -> anyhow::Result<()> {
    use prism_kube::crd_check::{Checked, CrdCheckError, check_served};
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match check_served(client.clone()).await {
            Ok(Checked::Current) => {
                info!("the served CRDs carry this build's schema");
                return Ok(());
            }
            Ok(Checked::NotAllowed { name }) => {
                warn!(
                    crd = %name,
                    "the served CRDs were not compared with this build's: reading CRDs is not allowed (a ClusterRole older than this release?)"
                );
                return Ok(());
            }
            Err(CrdCheckError::Read { name, source }) if tokio::time::Instant::now() < deadline => {
                warn!(crd = %name, error = %source, "reading a CRD failed; trying again");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Controllers, the stale sweep, the job reaper and the registry watch: on the Lease
/// holder only when leader election is on (every replica serves the HTTP API).
/// The leader's Kubernetes clients: the controllers', and the Lease's own.
struct LeaderClients<'a> {
    controllers: &'a kube::Client,
    lease: &'a kube::Client,
}

fn start_leader_work(
    args: &RunArgs,
    clients: LeaderClients<'_>,
    pool: &sqlx::PgPool,
    election: &ElectionStore,
    registry: &RunRegistry,
    metrics: &Arc<Metrics>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    let status_heartbeat = Duration::from_secs(u64::from(args.status_heartbeat_seconds));
    let kube = clients.controllers;
    let ctx = Arc::new(reconcilers::Context {
        client: kube.clone(),
        election: election.clone(),
        registry: registry.clone(),
        events: reconcilers::EventPublisher::of_this_pod(kube.clone()),
        stale_after: chrono::Duration::minutes(i64::from(args.peer_stale_minutes)),
        metrics: metrics.clone(),
        reconcile_concurrency: args.reconcile_concurrency,
        status_heartbeat,
        written_registrations: Written::new(status_heartbeat),
        written_runsessions: Written::new(status_heartbeat),
        failures: Default::default(),
        trust_owner_annotation: args.trust_owner_annotation,
        fences_owed: moka::sync::Cache::new(100_000),
        mirrored: reconcilers::run_session::MirrorMemo::new(100_000, reconcilers::run_session::MIRROR_MEMO_TTL),
        retention: reconcilers::Retention {
            released_hours: args.released_retention_hours,
            history_days: args.history_retention_days,
            every: Duration::from_secs(u64::from(args.retention_interval_seconds)),
        },
    });
    let namespace = args.watch_namespace.clone();
    let stale = args.peer_stale_minutes;
    let sweep_every = Duration::from_secs(u64::from(args.sweep_interval_seconds));
    // The refresh signals are heard on a connection of the controllers' database.
    let pool = pool.clone();
    // Each term of leadership listens afresh (and so reconciles everything once).
    let leader_work =
        move || reconcilers::lead(ctx.clone(), refresh::listen(pool.clone()), namespace.clone(), stale, sweep_every);
    if args.leader_election {
        let cfg = crate::leader::LeaseConfig::from_env("prism-operator-leader");
        Some(tokio::spawn(crate::leader::run(clients.lease.clone(), cfg, leader_work, async move {
            // A closed channel means the process is stopping: stop leading as well.
            let _ = stop.wait_for(|stop| *stop).await;
        })))
    } else {
        tokio::spawn(leader_work());
        None
    }
}

/// Rate-limit buckets that are full again are forgotten every few seconds, so the
/// limiters hold only the addresses and identities seen lately.
fn spawn_limit_pruning(limits: Arc<api::limits::Limits>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tick.tick().await;
            limits.prune();
        }
    });
}

/// MCP subscriptions nobody renewed for a day are deleted (any replica may; the
/// delete is idempotent).
fn spawn_subscription_pruning(subscriptions: McpStore) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(600));
        loop {
            tick.tick().await;
            match api::mcp::subscriptions::prune(&subscriptions).await {
                Ok(0) => {}
                Ok(n) => info!(subscriptions = n, "retention: deleted MCP subscriptions nobody renewed"),
                Err(error) => warn!(%error, "retention: MCP subscriptions could not be pruned"),
            }
        }
    });
}

/// Serves the HTTP API (TLS when configured, with the server limits of SPEC §12),
/// closing each connection after its answer once `closing`, until `stop` says so.
async fn serve_api(
    listen: std::net::SocketAddr,
    (max_connections, per_address): (usize, Option<usize>),
    tls: Option<transport::CertFiles>,
    state: Arc<AppState>,
    (closing, mut stop): (tokio::sync::watch::Receiver<bool>, tokio::sync::watch::Receiver<bool>),
) -> anyhow::Result<()> {
    let mut limits = transport::Limits::spec(max_connections, per_address);
    limits.tls_refusals = state.metrics.tls_reloads_refused.clone();
    let listener =
        transport::listen(listen, &limits).with_context(|| format!("cannot listen on {listen} (PRISM_LISTEN)"))?;
    if let Some(warning) = transport::plain_http_warning(listen, tls.is_some()) {
        warn!("{warning}");
    }
    info!(%listen, tls = tls.is_some(), max_connections = limits.max_connections, max_connections_per_address = limits.max_connections_per_address, "HTTP API serving");
    let shutdown = async move {
        let _ = stop.wait_for(|stop| *stop).await;
    };
    transport::serve(listener, api::router(state), tls.as_ref(), &limits, closing, shutdown)
        .await
        .context("HTTP server failed")
}

/// Postgres may start after the operator (a Helm install starts both at once): retry for
/// a while, saying so, then give up with the cause.
async fn connect_with_retry(url: &str, max_connections: u32) -> anyhow::Result<sqlx::PgPool> {
    let mut last = None;
    for attempt in 1..=15 {
        match db::connect_with(url, max_connections).await {
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

//! What `/readyz` and `/metrics` answer, measured in the background and served from
//! memory (SPEC §12 "Bounded"): those routes need no token, so a request to them must
//! cost no backend round trip, or a flood of them would be a flood on Postgres, Redis
//! and the API server. Readiness is probed every `READINESS_EVERY` over the controllers'
//! Postgres pool (a saturated API pool is no reason to leave the Service); the
//! cluster-wide gauges are refreshed every `GAUGES_EVERY`, so a scrape is at most that
//! old.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::election::{ElectionError, ElectionStore};
use crate::metrics::Metrics;
use crate::run_registry::RegistryError;
use crate::run_registry::service::RunRegistry;
use serde_json::{Value, json};

pub const READINESS_EVERY: Duration = Duration::from_secs(2);
pub const GAUGES_EVERY: Duration = Duration::from_secs(10);
/// A readiness snapshot older than this says the prober is stuck: not ready.
const STALE_AFTER: Duration = Duration::from_secs(15);
/// One probe's budget (the kubelet's default probe timeout is 1 s; these run apart from
/// the request, so they may take a little longer, but not hang).
const PROBE_BUDGET: Duration = Duration::from_secs(3);

/// One dependency's state at the last probe.
type Check = Result<(), String>;

#[derive(Clone, Debug)]
struct Readiness {
    postgres: Check,
    redis: Check,
    kubernetes: Check,
    at: Instant,
}

/// The last readiness probe, shared by the prober and `/readyz`.
#[derive(Default)]
pub struct Health {
    last: RwLock<Option<Readiness>>,
    /// Set on SIGTERM: not ready from then on, whatever the dependencies say.
    stopping: std::sync::atomic::AtomicBool,
}

/// What the background loops probe with.
pub struct Probes {
    /// The election store on the controllers' pool (not the API's).
    pub election: ElectionStore,
    pub registry: RunRegistry,
    pub kube: kube::Client,
    pub metrics: Arc<Metrics>,
}

impl Health {
    /// `/readyz`: (ready, body). Without Postgres or Kubernetes nothing works (not
    /// ready). Without Redis the runtime registry is unavailable but the controller API
    /// still is: "degraded", still ready, so Runs get a precise 503 rather than a
    /// connection error.
    pub fn readiness(&self) -> (bool, Value) {
        if self.stopping.load(std::sync::atomic::Ordering::Relaxed) {
            return (false, json!({"status": "stopping", "message": "this replica is shutting down"}));
        }
        let last = self.last.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let Some(r) = last.filter(|r| r.at.elapsed() < STALE_AFTER) else {
            return (
                false,
                json!({"status": "unavailable", "message": "dependencies not probed yet (or the prober is stuck)"}),
            );
        };
        let check = |c: &Check| match c {
            Ok(()) => json!({"status": "ok"}),
            Err(e) => json!({"status": "unavailable", "message": e}),
        };
        let ready = r.postgres.is_ok() && r.kubernetes.is_ok();
        let status = match (ready, r.redis.is_ok()) {
            (true, true) => "ready",
            (true, false) => "degraded",
            (false, _) => "unavailable",
        };
        let body = json!({
            "status": status,
            "checked_ms_ago": u64::try_from(r.at.elapsed().as_millis()).unwrap_or(u64::MAX),
            "checks": {"postgres": check(&r.postgres), "runtime_registry": check(&r.redis), "kubernetes": check(&r.kubernetes)},
        });
        (ready, body)
    }

    /// The replica is stopping: `/readyz` says so, so the Service stops sending it new
    /// connections while it still serves them (SPEC §15: a rolling update fails no call).
    pub fn stop(&self) {
        self.stopping.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn record(&self, r: Readiness) {
        *self.last.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(r);
    }
}

async fn within<F: std::future::Future<Output = Check>>(probe: F) -> Check {
    tokio::time::timeout(PROBE_BUDGET, probe)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {} s", PROBE_BUDGET.as_secs())))
}

/// What `/readyz` says of a dependency that failed its probe: a fixed sentence. The
/// backend's own error (addresses, user names, driver internals) goes to the log only:
/// `/readyz` needs no token (SPEC §12).
fn unreachable<E: std::fmt::Display>(dependency: &'static str) -> impl FnOnce(E) -> String {
    move |error| {
        tracing::debug!(dependency, %error, "readiness probe failed");
        format!("{dependency} did not answer the probe")
    }
}

/// Probes every dependency at once and records the answer. A dependency that turns
/// unavailable is logged once, with its error.
pub async fn probe(health: &Health, p: &Probes) {
    let (postgres, redis, kubernetes) = tokio::join!(
        within(async { p.election.ping().await.map_err(unreachable("postgres")) }),
        within(async { p.registry.ping().await.map_err(unreachable("redis")) }),
        within(async { p.kube.apiserver_version().await.map(|_| ()).map_err(unreachable("kubernetes")) }),
    );
    let before = health.last.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    for (name, now, was) in [
        ("postgres", &postgres, before.as_ref().map(|b| b.postgres.is_ok())),
        ("redis", &redis, before.as_ref().map(|b| b.redis.is_ok())),
        ("kubernetes", &kubernetes, before.as_ref().map(|b| b.kubernetes.is_ok())),
    ] {
        if now.is_err() && was != Some(false) {
            tracing::warn!(dependency = name, "readiness: unavailable (the probe's error is logged at debug)");
        }
    }
    p.metrics.set_up("postgres", postgres.is_ok());
    p.metrics.set_up("redis", redis.is_ok());
    health.record(Readiness { postgres, redis, kubernetes, at: Instant::now() });
}

/// Starts the two loops (readiness, gauges); they end with the process.
pub fn spawn(health: Arc<Health>, probes: Arc<Probes>) {
    let p = probes.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(READINESS_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            probe(&health, &p).await;
        }
    });
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(GAUGES_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            refresh_gauges(&probes).await;
        }
    });
}

/// Cluster-wide gauges. A dependency that does not answer is logged and its gauges keep
/// their last value.
async fn refresh_gauges(p: &Probes) {
    if let Err(error) = postgres_gauges(p).await {
        tracing::warn!(%error, "metrics: Postgres gauges not refreshed");
    }
    if let Err(error) = runs_online_gauge(p).await {
        tracing::warn!(%error, "metrics: runs online not refreshed");
    }
}

async fn postgres_gauges(p: &Probes) -> Result<(), ElectionError> {
    let m = &p.metrics;
    let census = p.election.census().await?;
    for (cause, n) in census.events {
        m.set_election_events(cause, n);
    }
    m.set_registrations(census.live);
    match p.registry.census().await {
        Ok(census) => m.set_jobs(&census),
        Err(RegistryError::Database(e)) => return Err(e.into()),
        Err(other) => tracing::warn!(error = %other, "metrics: jobs not counted"),
    };
    Ok(())
}

async fn runs_online_gauge(p: &Probes) -> Result<(), RegistryError> {
    let online = p.registry.online().await?;
    p.metrics.runs_online.set(i64::try_from(online).unwrap_or(i64::MAX));
    Ok(())
}

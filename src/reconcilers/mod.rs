//! Reconcilers (glue only) and the background loops that run beside them.

pub mod registration;
pub mod run_session;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{PredicateConfig, WatchStreamExt, watcher};
use kube::{Api, Client, Resource};

use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::crd::{ControllerRegistration, RunSession};
use crate::election::{ElectionError, ElectionStore};
use crate::refresh::{self, NamespacedName, Receivers};
use crate::run_registry::RegistryError;
use crate::run_registry::service::RuntimeService;
use crate::telemetry::Metrics;
use crate::time::to_k8s;

/// Field manager of every server-side apply this operator makes.
pub const FIELD_MANAGER: &str = "prism-operator";

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error(transparent)]
    Election(#[from] ElectionError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Finalizer(Box<kube::runtime::finalizer::Error<ControllerError>>),
    #[error("resource has no {0}")]
    MissingField(&'static str),
    #[error("{0} kept changing under us; retrying")]
    Conflict(&'static str),
}

pub struct Context {
    pub client: Client,
    pub election: ElectionStore,
    pub runtime: RuntimeService,
    pub recorder: Recorder,
    pub stale_after: chrono::Duration,
    pub metrics: Arc<Metrics>,
    /// Reconciles in flight at once, per controller.
    pub reconcile_concurrency: u16,
    pub written_registrations: Written<crate::crd::ControllerRegistrationStatus>,
    pub written_runsessions: Written<crate::crd::RunSessionStatus>,
}

/// How long a status this replica wrote is preferred over the watch cache's copy.
const WRITTEN_TTL: Duration = Duration::from_secs(10);

/// The statuses this leader wrote in the last few seconds, by resource uid. The watch
/// cache lags our own writes: a reconcile that comes sooner (an election trigger)
/// would compare against the older status, write the same status again and repeat its
/// Event. After `WRITTEN_TTL` the cache is trusted again, so a status changed by
/// someone else is still corrected at the next reconcile.
pub struct Written<S> {
    entries: std::sync::Mutex<std::collections::HashMap<String, (std::time::Instant, S)>>,
}

impl<S> Default for Written<S> {
    fn default() -> Self {
        Self { entries: Default::default() }
    }
}

impl<S: Clone> Written<S> {
    /// The status to compare against: ours if we wrote one lately, else the cached one.
    pub fn previous(&self, uid: Option<&str>, cached: Option<&S>) -> Option<S> {
        let ours = uid.and_then(|uid| {
            let entries = self.entries.lock().ok()?;
            entries.get(uid).filter(|(at, _)| at.elapsed() < WRITTEN_TTL).map(|(_, s)| s.clone())
        });
        ours.or_else(|| cached.cloned())
    }

    pub fn wrote(&self, uid: Option<&str>, status: S) {
        let (Some(uid), Ok(mut entries)) = (uid, self.entries.lock()) else { return };
        if entries.len() >= 1024 {
            entries.retain(|_, (at, _)| at.elapsed() < WRITTEN_TTL);
        }
        entries.insert(uid.to_string(), (std::time::Instant::now(), status));
    }

    /// Forgets everything: another leader may have written since.
    pub fn clear(&self) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.clear();
        }
    }
}

pub fn recorder(client: Client) -> Recorder {
    let instance = std::env::var("POD_NAME").ok();
    Recorder::new(client, Reporter { controller: FIELD_MANAGER.into(), instance })
}

/// A status condition that keeps its lastTransitionTime while its status does not change.
pub fn condition(
    previous: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    type_: &str,
    ok: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: chrono::DateTime<chrono::Utc>,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    let status = if ok { "True" } else { "False" }.to_string();
    let last_transition_time = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| to_k8s(now));
    k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        type_: type_.into(),
        status,
        reason: reason.into(),
        message: message.into(),
        observed_generation: generation,
        last_transition_time,
    }
}

fn error_policy<K>(_obj: Arc<K>, error: &ControllerError, _ctx: Arc<Context>) -> Action {
    warn!(%error, "reconcile failed; retrying in 5 s");
    Action::requeue(Duration::from_secs(5))
}

fn api_for<K>(client: &Client, namespace: &Option<String>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

fn receiver_stream<K>(rx: mpsc::UnboundedReceiver<ObjectRef<K>>) -> impl futures::Stream<Item = ObjectRef<K>>
where
    K: Resource + 'static,
{
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) })
}

/// Logs how each reconcile ended (errors are logged with their object by `error_policy`).
async fn log_outcome<K: Resource, E: std::fmt::Display>(
    res: Result<(ObjectRef<K>, Action), kube::runtime::controller::Error<E, watcher::Error>>,
) where
    K::DynamicType: std::fmt::Debug,
{
    match res {
        Ok((obj, _)) => debug!(%obj, "reconciled"),
        Err(e) => debug!(error = %e, "reconcile error"),
    }
}

/// Everything that runs only on the leader: both controllers (fed by the refresh
/// signals of every replica), the stale sweep, the job reaper and the registry watch.
/// Dropping the future stops all of it.
pub async fn lead(ctx: Arc<Context>, namespace: Option<String>, stale_minutes: u32, sweep_every: Duration) {
    let (receivers, listen) = refresh::listen(ctx.election.pool().clone());
    ctx.written_registrations.clear();
    ctx.written_runsessions.clear();
    tokio::join!(
        run_controllers(ctx.clone(), receivers, namespace),
        run_sweep(ctx.clone(), stale_minutes, sweep_every),
        run_reaper(ctx.clone(), Duration::from_secs(2)),
        run_registry_watch(ctx.clone(), Duration::from_secs(2)),
        listen,
    );
}

/// Runs both controllers until shutdown.
pub async fn run_controllers(ctx: Arc<Context>, receivers: Receivers, namespace: Option<String>) {
    info!(namespace = namespace.as_deref().unwrap_or("<all>"), "controllers started");
    let config = kube::runtime::controller::Config::default().concurrency(ctx.reconcile_concurrency);
    let registrations = controller_for(api_for::<ControllerRegistration>(&ctx.client, &namespace))
        .with_config(config.clone())
        .reconcile_on(receiver_stream(receivers.registrations))
        .shutdown_on_signal()
        .run(registration::reconcile, error_policy, ctx.clone())
        .for_each(log_outcome);
    let runsessions = controller_for(api_for::<RunSession>(&ctx.client, &namespace))
        .with_config(config)
        .reconcile_on(receiver_stream(receivers.run_sessions))
        .shutdown_on_signal()
        .run(run_session::reconcile, error_policy, ctx.clone())
        .for_each(log_outcome);
    futures::join!(registrations, runsessions);
}

/// A controller whose cache keeps no `managedFields` (most of a cached object's bytes,
/// never read here) and which reconciles only on changes that matter to it: a new
/// resource, a new generation, deletion, its finalizers (the RunSession reconciler adds
/// its finalizer and waits for that change). Its status and label writes do not come
/// back as reconciles; elections feed affected resources in through `Triggers`, and the
/// periodic requeue restores a label someone removed.
fn controller_for<K>(api: Api<K>) -> Controller<K>
where
    K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    let (reader, writer) = reflector::store();
    let changes = watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(|obj: &mut K| obj.meta_mut().managed_fields = None)
        .reflect(writer)
        .applied_objects()
        .predicate_filter(changes_that_matter, PredicateConfig::default());
    Controller::for_stream(changes, reader)
}

/// What a reconcile reacts to, as a hash (see `controller_for`).
fn changes_that_matter<K: Resource>(obj: &K) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let meta = obj.meta();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (meta.generation, meta.deletion_timestamp.is_some(), &meta.finalizers).hash(&mut h);
    Some(h.finish())
}

/// The stale sweep: once at start, then every `interval`.
pub async fn run_sweep(ctx: Arc<Context>, stale_minutes: u32, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match ctx.election.sweep(stale_minutes).await {
            Ok(0) => {}
            Ok(released) => info!(registrations = released, "stale sweep released registrations"),
            Err(e) => warn!(error = %e, "stale sweep failed; next attempt at the next interval"),
        }
    }
}

/// The job reaper: claimed jobs past their visibility timeout go back to the queue.
pub async fn run_reaper(ctx: Arc<Context>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match ctx.runtime.jobs.reap().await {
            Ok(0) => {}
            Ok(n) => info!(jobs = n, "visibility timeout: jobs returned to the queue"),
            Err(e) => warn!(error = %e, "job reaper failed; next attempt at the next interval"),
        }
    }
}

/// Watches the runtime registry's availability: when Redis goes away or comes back,
/// every RunSession is reconciled at once, so `Unavailable` (and the return to
/// `Online`/`Offline`) shows within seconds instead of at each lease's next check.
pub async fn run_registry_watch(ctx: Arc<Context>, interval: Duration) {
    let mut was_up = true;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let up = ctx.runtime.sessions.ping().await.is_ok();
        if up == was_up {
            continue;
        }
        was_up = up;
        if up {
            info!("runtime registry (Redis) is back");
        } else {
            warn!("runtime registry (Redis) is unavailable");
        }
        let refreshed = async {
            let all: Vec<NamespacedName> = ctx
                .runtime
                .identities
                .all_live()
                .await?
                .into_iter()
                .map(|(namespace, name)| NamespacedName::new(namespace, name))
                .collect();
            refresh::announce_now(ctx.election.pool(), refresh::Kind::RunSession, &all).await?;
            Ok::<_, RegistryError>(())
        };
        if let Err(error) = refreshed.await {
            warn!(%error, "cannot refresh the RunSessions' status after the registry changed; their requeue will");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_we_just_wrote_wins_over_the_lagging_cache() {
        let written: Written<&str> = Written::default();
        assert_eq!(written.previous(Some("uid-1"), Some(&"cached")), Some("cached"), "nothing written yet");
        written.wrote(Some("uid-1"), "ours");
        assert_eq!(written.previous(Some("uid-1"), Some(&"cached")), Some("ours"));
        assert_eq!(written.previous(Some("uid-2"), Some(&"other")), Some("other"), "per resource");
        assert_eq!(written.previous(None, None), None);
        written.clear();
        assert_eq!(written.previous(Some("uid-1"), Some(&"cached")), Some("cached"), "a new term trusts the cache");
    }

    #[test]
    fn only_generation_deletion_and_finalizers_trigger_a_reconcile() {
        let mut obj = crate::crd::ControllerRegistration::new(
            "r",
            crate::crd::ControllerRegistrationSpec {
                project_id: "P".into(),
                session_id: "s".into(),
                agent_surface: crate::crd::AgentSurface::Codex,
            },
        );
        obj.metadata.generation = Some(1);
        let base = changes_that_matter(&obj);
        let mut status_only = obj.clone();
        status_only.status = Some(Default::default());
        status_only.metadata.resource_version = Some("9".into());
        status_only.metadata.labels = Some([("a".to_string(), "b".to_string())].into());
        assert_eq!(changes_that_matter(&status_only), base, "own status and label writes do not come back");
        let mut finalized = obj.clone();
        finalized.metadata.finalizers = Some(vec!["x".into()]);
        assert_ne!(changes_that_matter(&finalized), base);
        let mut deleting = obj.clone();
        deleting.metadata.deletion_timestamp = Some(to_k8s(chrono::Utc::now()));
        assert_ne!(changes_that_matter(&deleting), base);
        let mut next = obj.clone();
        next.metadata.generation = Some(2);
        assert_ne!(changes_that_matter(&next), base);
    }
}

//! Reconcilers (glue only) and the background loops that run beside them. Both kinds
//! share one reconcile skeleton (`reconcile`): a span naming the object, kube's
//! `finalizer()` helper, the kind's apply or cleanup, metrics, and a per-object
//! exponential backoff on failure (`error_policy`). What differs by kind is `Reconciled`
//! (and `status::ObservedStatus` for the status writer).

pub mod backoff;
pub mod events;
pub mod packed;
pub mod registration;
pub mod run_session;
pub mod status;

#[cfg(test)]
mod fast_tests;
#[cfg(test)]
mod mock_api_tests;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use kube::core::object::HasStatus;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::finalizer::{self, Event as Finalizer, finalizer};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{PredicateConfig, WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};

use tokio::sync::mpsc;
use tracing::{debug, info, instrument, warn};

use crate::crd::{ControllerRegistration, RunSession};
use crate::time::to_k8s;
pub use backoff::Failures;
pub use events::EventPublisher;
use packed::Packed;
use prism_core::store::{Elections, Runs};
pub use status::Written;

/// Field manager of every write this operator makes.
pub const FIELD_MANAGER: &str = "prism-operator";

/// A store's error, as the reconcilers carry it: they tell failures apart through
/// prism-core's `Failure` traits before they box one.
pub type StoreError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A step of the election store failed (its error names the step).
    #[error(transparent)]
    Election(StoreError),
    /// A step of the registry of Runs failed (its error names the step).
    #[error(transparent)]
    Registry(StoreError),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Finalizer(Box<kube::runtime::finalizer::Error<ControllerError>>),
    #[error("resource has no {0}")]
    MissingField(&'static str),
    #[error(transparent)]
    Unpack(#[from] packed::UnpackError),
}

impl ControllerError {
    pub fn election(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        ControllerError::Election(Box::new(e))
    }

    pub fn registry(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        ControllerError::Registry(Box::new(e))
    }
}

/// What the reconcilers and the loops beside them count (the operator's Prometheus
/// metrics implement it).
pub trait ReconcileMetrics: Send + Sync {
    /// One reconcile of `controller` ended after `took`.
    fn reconciled(&self, controller: &str, took: Duration, failed: bool);
    /// The job reaper ended `n` attempts with `outcome` (requeued, failed, cancelled).
    fn attempts_ended(&self, outcome: &str, n: u64);
}

/// What the reconcilers receive besides the watches: single resources whose status must
/// be refreshed, and "everything of this kind" (the sender could not say what changed,
/// or may have missed something).
pub struct Receivers {
    pub registrations: mpsc::UnboundedReceiver<ObjectRef<ControllerRegistration>>,
    pub run_sessions: mpsc::UnboundedReceiver<ObjectRef<RunSession>>,
    pub all_registrations: mpsc::UnboundedReceiver<()>,
    pub all_run_sessions: mpsc::UnboundedReceiver<()>,
}

/// What every reconcile of the leader works with. The stores are prism-core's traits:
/// Postgres and Redis in the operator, maps in memory in the fast tests.
pub struct Context<E, R> {
    pub client: Client,
    pub election: E,
    pub registry: R,
    /// Publishes the Events of changes (no cache: see `events`).
    pub events: EventPublisher,
    pub stale_after: chrono::Duration,
    /// PRISM_STATUS_HEARTBEAT_SECONDS: the period of live registrations' reconciles.
    pub status_heartbeat: std::time::Duration,
    pub metrics: Arc<dyn ReconcileMetrics>,
    /// Reconciles in flight at once, per controller.
    pub reconcile_concurrency: u16,
    pub written_registrations: Written<crate::crd::ControllerRegistrationStatus>,
    pub written_runsessions: Written<crate::crd::RunSessionStatus>,
    /// Consecutive reconcile failures per object, for `error_policy`'s backoff.
    pub failures: Failures,
    /// PRISM_TRUST_OWNER_ANNOTATION: kubectl registrations' owner annotation is stamped
    /// and guarded by an admission policy.
    pub trust_owner_annotation: bool,
    /// RunSessions whose key was rotated and whose Redis fence has not been written yet:
    /// while Redis fails they are retried every second, not every five.
    pub fences_owed: moka::sync::Cache<uuid::Uuid, ()>,
    /// Identities mirrored unchanged: not read again each lease (`MirrorMemo`).
    pub mirrored: run_session::MirrorMemo,
    /// What retention keeps, and how often it looks.
    pub retention: Retention,
}

/// SPEC §12 retention settings.
#[derive(Clone, Copy, Debug)]
pub struct Retention {
    /// PRISM_RELEASED_RETENTION_HOURS: released registrations' resources are deleted after.
    pub released_hours: u32,
    /// PRISM_HISTORY_RETENTION_DAYS: released rows, history, nudges, finished jobs and
    /// revoked identities are deleted after.
    pub history_days: u32,
    /// How often retention runs (it runs once at start too).
    pub every: Duration,
}

/// What a kind brings to the shared reconcile skeleton.
pub trait Reconciled:
    Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
    + HasStatus<Status: status::ObservedStatus>
    + packed::Packable
    + Clone
    + std::fmt::Debug
    + serde::Serialize
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
    /// Held by every resource of the kind until `cleanup` succeeded.
    const FINALIZER: &'static str;
    /// The `controller` label of the reconcile metrics.
    const METRIC: &'static str;

    /// Before kube's `finalizer()` looks at the resource: a chance to write metadata the
    /// resource lacks together with the finalizer (see the registrations'). The default
    /// changes nothing.
    fn prepare(obj: Arc<Self>, _api: &Api<Self>) -> impl Future<Output = Arc<Self>> + Send {
        async move { obj }
    }

    /// The resource exists (and carries the finalizer): bring the world and its status in line.
    fn apply<E: Elections, R: Runs>(
        obj: Arc<Self>,
        api: &Api<Self>,
        ctx: &Context<E, R>,
    ) -> impl Future<Output = Result<Action, ControllerError>> + Send;

    /// The resource is being deleted: undo what it stood for. The finalizer goes after this succeeds.
    fn cleanup<E: Elections, R: Runs>(
        obj: Arc<Self>,
        ctx: &Context<E, R>,
    ) -> impl Future<Output = Result<Action, ControllerError>> + Send;
}

/// One reconcile of either kind.
// Dotted field names, as kube's own "reconciling object" span has: a plain `name` would
// collide with the span's name in JSON logs.
#[instrument(
    name = "reconcile",
    skip_all,
    fields(
        object.kind = %K::kind(&()),
        object.namespace = obj.namespace().as_deref().unwrap_or_default(),
        object.name = %obj.name_any(),
    )
)]
pub async fn reconcile<K: Reconciled, E: Elections, R: Runs>(
    obj: Arc<K>,
    ctx: Arc<Context<E, R>>,
) -> Result<Action, ControllerError> {
    let ns = obj.namespace().ok_or(ControllerError::MissingField("metadata.namespace"))?;
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &ns);
    let started = std::time::Instant::now();
    let prepared = K::prepare(obj.clone(), &api).await;
    let result = finalized(&api, K::FINALIZER, prepared, |event| async {
        match event {
            Finalizer::Apply(obj) => K::apply(obj, &api, &ctx).await,
            Finalizer::Cleanup(obj) => K::cleanup(obj, &ctx).await,
        }
    })
    .await;
    ctx.metrics.reconciled(K::METRIC, started.elapsed(), result.is_err());
    if result.is_ok() {
        ctx.failures.succeeded(&retry_key(&*obj));
    }
    result
}

/// kube's `finalizer()`: adds the finalizer when missing (and waits for that change to
/// come back as the next reconcile), runs `reconcile` with Apply or Cleanup, removes the
/// finalizer after a successful Cleanup.
pub async fn finalized<K, Fut>(
    api: &Api<K>,
    name: &str,
    obj: Arc<K>,
    reconcile: impl FnOnce(Finalizer<K>) -> Fut,
) -> Result<Action, ControllerError>
where
    K: Resource + Clone + std::fmt::Debug + serde::Serialize + serde::de::DeserializeOwned,
    Fut: Future<Output = Result<Action, ControllerError>>,
{
    match finalizer(api, name, obj, reconcile).await {
        // The resource went away before our finalizer was removed (someone else removed
        // it): nothing is left to hold, the cleanup is done.
        Err(finalizer::Error::RemoveFinalizer(kube::Error::Api(s))) if s.code == 404 => Ok(Action::await_change()),
        result => result.map_err(|e| ControllerError::Finalizer(Box::new(e))),
    }
}

/// The object a retry count belongs to.
fn retry_key<K: Resource<DynamicType = ()>>(obj: &K) -> String {
    format!("{}/{}/{}", K::kind(&()), obj.namespace().unwrap_or_default(), obj.name_any())
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

/// A failed reconcile comes back after a wait that doubles with each consecutive
/// failure of the same object (see `backoff`).
fn error_policy<K: Resource<DynamicType = ()>, E, R>(
    obj: Arc<K>,
    error: &ControllerError,
    ctx: Arc<Context<E, R>>,
) -> Action {
    let retry_in = ctx.failures.failed(retry_key(&*obj));
    warn!(
        kind = %K::kind(&()),
        namespace = obj.namespace().as_deref().unwrap_or_default(),
        name = %obj.name_any(),
        %error,
        retry_in_s = retry_in.as_secs(),
        "reconcile failed; retrying"
    );
    Action::requeue(retry_in)
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

fn receiver_stream<T>(rx: mpsc::UnboundedReceiver<T>) -> impl futures::Stream<Item = T> {
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

/// Everything that runs only on the leader: both controllers (fed by `receivers`, the
/// refresh signals of every replica, which `signals` delivers while it runs), the stale
/// sweep, the job reaper and the registry watch. Dropping the future stops all of it.
pub async fn lead<E: Elections, R: Runs>(
    ctx: Arc<Context<E, R>>,
    (receivers, signals): (Receivers, impl Future<Output = ()>),
    namespace: Option<String>,
    stale_minutes: u32,
    sweep_every: Duration,
) {
    ctx.written_registrations.clear();
    ctx.written_runsessions.clear();
    let (registry_changed, registry_changes) = mpsc::unbounded_channel();
    tokio::join!(
        run_controllers(ctx.clone(), receivers, registry_changes, namespace.clone()),
        run_sweep(ctx.clone(), stale_minutes, sweep_every),
        run_reaper(ctx.clone(), Duration::from_secs(2)),
        run_registry_watch(ctx.clone(), Duration::from_secs(2), registry_changed),
        run_retention(ctx.clone(), namespace.clone()),
        signals,
    );
}

/// Runs both controllers until shutdown. `registry_changes`: the registry watch's "every
/// RunSession", beside the signals'.
pub async fn run_controllers<E: Elections, R: Runs>(
    ctx: Arc<Context<E, R>>,
    receivers: Receivers,
    registry_changes: mpsc::UnboundedReceiver<()>,
    namespace: Option<String>,
) {
    info!(namespace = namespace.as_deref().unwrap_or("<all>"), "controllers started");
    let config = kube::runtime::controller::Config::default().concurrency(ctx.reconcile_concurrency);
    let registrations = controller_for::<ControllerRegistration>(api_for(&ctx.client, &namespace))
        .with_config(config.clone())
        .reconcile_on(receiver_stream(receivers.registrations).map(|r| r.into_kind_unchecked(())))
        .reconcile_all_on(receiver_stream(receivers.all_registrations))
        .shutdown_on_signal()
        .run(reconcile_cached::<ControllerRegistration, E, R>, error_policy, ctx.clone())
        .for_each(log_outcome);
    let runsessions = controller_for::<RunSession>(api_for(&ctx.client, &namespace))
        .with_config(config)
        .reconcile_on(receiver_stream(receivers.run_sessions).map(|r| r.into_kind_unchecked(())))
        .reconcile_all_on(futures::stream::select(
            receiver_stream(receivers.all_run_sessions),
            receiver_stream(registry_changes),
        ))
        .shutdown_on_signal()
        .run(reconcile_cached::<RunSession, E, R>, error_policy, ctx.clone())
        .for_each(log_outcome);
    futures::join!(registrations, runsessions);
}

/// A controller whose cache keeps each object packed (`packed::Packed`: the metadata kube
/// reads, the rest compressed, of its metadata only what a reconcile reads) and which
/// reconciles only on changes that matter to it: a new resource, a new generation,
/// deletion, its finalizers (the RunSession reconciler adds its finalizer and waits for
/// that change). Its status and label writes do not come back as reconciles; elections
/// feed affected resources in through `Triggers`, and the periodic requeue restores a
/// label someone removed.
fn controller_for<K: Reconciled>(api: Api<Packed<K>>) -> Controller<Packed<K>> {
    let (reader, writer) = reflector::store();
    let changes = watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .applied_objects()
        .predicate_filter(changes_that_matter, PredicateConfig::default())
        .map_ok(key_only);
    Controller::for_stream(changes, reader)
}

/// What the trigger needs of a changed object: its key. kube's controller makes the
/// scheduler's `ObjectRef` of it, kept twice while the object waits (its queue and its
/// map: every live object waits for its next requeue), and reads the object itself from
/// the store. The uid and resourceVersion would ride along in each copy (the key's
/// `extra`, which no lookup compares); the predicate above has already read the uid.
fn key_only<K: Resource>(mut obj: K) -> K {
    let meta = obj.meta_mut();
    meta.uid = None;
    meta.resource_version = None;
    obj
}

/// One reconcile of a cached object: made whole again (`Packed::unpack`), then `reconcile`.
async fn reconcile_cached<K: Reconciled, E: Elections, R: Runs>(
    cached: Arc<Packed<K>>,
    ctx: Arc<Context<E, R>>,
) -> Result<Action, ControllerError> {
    reconcile(Arc::new(cached.unpack()?), ctx).await
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
pub async fn run_sweep<E: Elections, R: Runs>(ctx: Arc<Context<E, R>>, stale_minutes: u32, interval: Duration) {
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

/// Retention (SPEC §12): once at start, then every `ctx.retention.every`. Released
/// registrations' resources (of the watched namespace) are deleted after
/// `released_hours`, each with a uid precondition (never a later resource of that name);
/// then what is older than `history_days` is pruned. A failure is logged and retried at
/// the next pass.
pub async fn run_retention<E: Elections, R: Runs>(ctx: Arc<Context<E, R>>, namespace: Option<String>) {
    let mut tick = tokio::time::interval(ctx.retention.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(error) = retain(&ctx, namespace.as_deref()).await {
            warn!(%error, "retention failed; next attempt at the next pass");
        }
    }
}

async fn retain<E: Elections, R: Runs>(ctx: &Context<E, R>, namespace: Option<&str>) -> Result<(), ControllerError> {
    let Retention { released_hours, history_days, .. } = ctx.retention;
    let mut deleted = 0;
    loop {
        let batch =
            ctx.election.released_resources(released_hours, namespace, 200).await.map_err(ControllerError::election)?;
        let full = batch.len() == 200;
        for (id, ns, name) in batch {
            let api: Api<ControllerRegistration> = Api::namespaced(ctx.client.clone(), &ns);
            let params = kube::api::DeleteParams {
                preconditions: Some(kube::api::Preconditions { uid: Some(id.to_string()), resource_version: None }),
                ..Default::default()
            };
            match api.delete(&name, &params).await {
                Ok(_) => deleted += 1,
                // Gone already, or the name is a later resource's now.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
            ctx.election.resource_gone(id).await.map_err(ControllerError::election)?;
        }
        if !full {
            break;
        }
    }
    let pruned = ctx.election.prune(history_days).await.map_err(ControllerError::election)?;
    let (jobs, identities) = ctx.registry.prune(history_days).await.map_err(ControllerError::registry)?;
    if deleted + pruned.registrations + pruned.projects + pruned.history + pruned.nudges + jobs + identities > 0 {
        info!(
            resources_deleted = deleted,
            registrations = pruned.registrations,
            projects = pruned.projects,
            history = pruned.history,
            nudges = pruned.nudges,
            jobs,
            identities,
            "retention: deleted what is past its time"
        );
    }
    Ok(())
}

/// The job reaper: attempts past their visibility timeout or deadline end (queued again
/// after a backoff, or failed for good), and cancels past their grace are carried out.
pub async fn run_reaper<E: Elections, R: Runs>(ctx: Arc<Context<E, R>>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match ctx.registry.reap().await {
            Ok(r) if r == Default::default() => {}
            Ok(r) => {
                ctx.metrics.attempts_ended("requeued", r.requeued);
                ctx.metrics.attempts_ended("failed", r.failed);
                ctx.metrics.attempts_ended("cancelled", r.cancelled);
                info!(
                    requeued = r.requeued,
                    failed = r.failed,
                    cancelled = r.cancelled,
                    expired = r.expired,
                    stale_term = r.stale_term,
                    "jobs reaped: attempts ended by their visibility timeout, deadline or cancel grace; jobs left queued past their time, or fenced to a past term, cancelled"
                );
            }
            Err(e) => warn!(error = %e, "job reaper failed; next attempt at the next interval"),
        }
    }
}

/// Watches the runtime registry's availability: when Redis goes away or comes back,
/// every RunSession is reconciled at once (`changed`), so `Unavailable` (and the return to
/// `Online`/`Offline`) shows within seconds instead of at each lease's next check.
pub async fn run_registry_watch<E: Elections, R: Runs>(
    ctx: Arc<Context<E, R>>,
    interval: Duration,
    changed: mpsc::UnboundedSender<()>,
) {
    let mut was_up = true;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let up = ctx.registry.ping().await.is_ok();
        if up == was_up {
            continue;
        }
        was_up = up;
        if up {
            info!("runtime registry (Redis) is back");
        } else {
            warn!("runtime registry (Redis) is unavailable");
        }
        // A closed receiver means the controllers are stopping: nothing left to refresh.
        let _ = changed.send(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheduler_keeps_a_key_without_uid_or_resource_version() {
        let obj = mock_api_tests::registration("4711");
        let full = ObjectRef::from_obj(&obj);
        let key = ObjectRef::from_obj(&key_only(obj));
        assert_eq!(key, full, "the same object to the scheduler and the store");
        assert_eq!((key.extra.uid, key.extra.resource_version), (None, None));
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

//! Reconcilers (glue only) and the background loops that run beside them.

pub mod registration;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::crd::ControllerRegistration;
use crate::election::{ElectionError, ElectionStore, Touched};
use crate::telemetry::Metrics;

/// Field manager of every server-side apply this operator makes.
pub const FIELD_MANAGER: &str = "prism-operator";

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error(transparent)]
    Election(#[from] ElectionError),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Finalizer(Box<kube::runtime::finalizer::Error<ControllerError>>),
    #[error("resource has no {0}")]
    MissingField(&'static str),
}

/// Sends "reconcile this now" for resources an election touched from elsewhere.
#[derive(Clone)]
pub struct Triggers {
    registrations: mpsc::UnboundedSender<ObjectRef<ControllerRegistration>>,
}

impl Triggers {
    pub fn registrations(&self, touched: impl IntoIterator<Item = Touched>) {
        for t in touched {
            let _ = self
                .registrations
                .send(ObjectRef::new(&t.name).within(&t.namespace));
        }
    }
}

pub struct Context {
    pub client: Client,
    pub election: ElectionStore,
    pub recorder: Recorder,
    pub triggers: Triggers,
    pub stale_after: chrono::Duration,
    pub metrics: Arc<Metrics>,
}

pub struct Receivers {
    registrations: mpsc::UnboundedReceiver<ObjectRef<ControllerRegistration>>,
}

/// The triggers to hand out (API, sweep) and the receiving ends for the controllers.
pub fn triggers() -> (Triggers, Receivers) {
    let (tx, rx) = mpsc::unbounded_channel();
    (
        Triggers { registrations: tx },
        Receivers { registrations: rx },
    )
}

pub fn recorder(client: Client) -> Recorder {
    let instance = std::env::var("POD_NAME").ok();
    Recorder::new(
        client,
        Reporter {
            controller: FIELD_MANAGER.into(),
            instance,
        },
    )
}

/// A database time as a Kubernetes `Time` (microsecond precision, as Postgres keeps it).
pub fn to_time(
    t: chrono::DateTime<chrono::Utc>,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Time {
    let ts = k8s_openapi::jiff::Timestamp::from_microsecond(t.timestamp_micros())
        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(ts)
}

fn error_policy<K>(_obj: Arc<K>, error: &ControllerError, _ctx: Arc<Context>) -> Action {
    warn!(%error, "reconcile failed; retrying in 5 s");
    Action::requeue(Duration::from_secs(5))
}

/// Runs the ControllerRegistration controller until shutdown.
pub async fn run_registrations(ctx: Arc<Context>, receivers: Receivers, namespace: Option<String>) {
    let api: Api<ControllerRegistration> = match &namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let triggered = futures::stream::unfold(receivers.registrations, |mut rx| async move {
        rx.recv().await.map(|r| (r, rx))
    });
    info!(
        namespace = namespace.as_deref().unwrap_or("<all>"),
        "ControllerRegistration controller started"
    );
    Controller::new(api, watcher::Config::default())
        .reconcile_on(triggered)
        .shutdown_on_signal()
        .run(registration::reconcile, error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(%obj, "reconciled"),
                Err(e) => debug!(error = %e, "reconcile error"),
            }
        })
        .await;
}

/// The stale sweep: once at start, then every `interval`.
pub async fn run_sweep(ctx: Arc<Context>, stale_minutes: u32, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match ctx.election.sweep(stale_minutes).await {
            Ok(touched) => {
                if !touched.is_empty() {
                    info!(
                        registrations = touched.len(),
                        "stale sweep released registrations"
                    );
                }
                ctx.triggers.registrations(touched);
            }
            Err(e) => warn!(error = %e, "stale sweep failed; next attempt at the next interval"),
        }
    }
}

//! Leader election on a coordination.k8s.io Lease, so that with several replicas only
//! one runs the controllers, the sweep, the reaper and the registry watch (every replica
//! serves the HTTP API).
//!
//! Small on purpose: every write is guarded by the Lease's resourceVersion (a lost race is
//! a 409, never two holders), and the holder stops its leader work when it has not renewed
//! for `renew_deadline`, which is shorter than `lease_duration`: it has stopped before
//! anyone else may take the Lease over. Transient API errors are retried, never fatal.

use std::future::Future;
use std::time::Duration;

use chrono::Utc;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio::time::Instant;
use tracing::{debug, info, warn};

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// In a pod: the pod's name and namespace (downward API). Outside: hostname-pid.
    pub fn from_env(name: &str) -> Self {
        let namespace = std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "default".into());
        let identity = std::env::var("POD_NAME").unwrap_or_else(|_| {
            let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default().trim().to_string();
            format!("{}-{}", if host.is_empty() { "prism-operator" } else { &host }, std::process::id())
        });
        Self {
            namespace,
            name: name.into(),
            identity,
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

fn now() -> MicroTime {
    MicroTime(crate::time::to_k8s(Utc::now()).0)
}

fn expired(spec: &LeaseSpec, duration: Duration) -> bool {
    let Some(renewed) = spec.renew_time.as_ref() else { return true };
    let secs = spec.lease_duration_seconds.map(|s| s as u64).unwrap_or(duration.as_secs());
    let age_us = Utc::now().timestamp_micros() - renewed.0.as_microsecond();
    age_us > (secs as i64) * 1_000_000
}

/// One attempt to acquire or renew. Ok(true): we hold the Lease now.
async fn try_hold(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<bool, kube::Error> {
    let me = Some(cfg.identity.clone());
    let duration = Some(cfg.lease_duration.as_secs() as i32);
    match api.get_opt(&cfg.name).await? {
        None => {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(cfg.name.clone()), ..Default::default() },
                spec: Some(LeaseSpec {
                    holder_identity: me,
                    lease_duration_seconds: duration,
                    acquire_time: Some(now()),
                    renew_time: Some(now()),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
        Some(mut lease) => {
            let spec = lease.spec.clone().unwrap_or_default();
            let mine = spec.holder_identity.as_deref() == Some(cfg.identity.as_str());
            let free = spec.holder_identity.as_deref().is_none_or(str::is_empty);
            if !mine && !free && !expired(&spec, cfg.lease_duration) {
                return Ok(false);
            }
            let mut next = spec.clone();
            if !mine {
                next.holder_identity = me;
                next.acquire_time = Some(now());
                next.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            }
            next.renew_time = Some(now());
            next.lease_duration_seconds = duration;
            lease.spec = Some(next);
            // replace() sends the resourceVersion we read: a concurrent writer makes this a 409.
            match api.replace(&cfg.name, &PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
    }
}

/// `try_hold` bounded by the retry period: a hanging API call must not keep a replica
/// leading past its renew deadline.
async fn attempt(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<bool, String> {
    match tokio::time::timeout(cfg.retry_period, try_hold(api, cfg)).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("Lease request timed out".into()),
    }
}

/// Gives the Lease up (on shutdown), so another replica takes over at once.
async fn release(api: &Api<Lease>, cfg: &LeaseConfig) {
    if let Ok(Some(mut lease)) = api.get_opt(&cfg.name).await
        && let Some(spec) = lease.spec.as_mut()
        && spec.holder_identity.as_deref() == Some(cfg.identity.as_str())
    {
        spec.holder_identity = None;
        spec.renew_time = None;
        if let Err(error) = api.replace(&cfg.name, &PostParams::default(), &lease).await {
            warn!(%error, lease = %cfg.name, "could not hand the Lease back; a standby takes it when it expires");
        }
    }
}

/// Runs `lead` whenever this replica holds the Lease; stops it (drops the future) as soon
/// as the Lease cannot be renewed within the renew deadline, then competes again.
/// Returns when `shutdown` resolves.
pub async fn run<F, Fut>(client: Client, cfg: LeaseConfig, lead: F, shutdown: impl Future<Output = ()>)
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    tokio::pin!(shutdown);
    info!(lease = %cfg.name, namespace = %cfg.namespace, identity = %cfg.identity, "competing for leadership");
    loop {
        // Candidate: retry until we hold the Lease.
        loop {
            match attempt(&api, &cfg).await {
                Ok(true) => break,
                Ok(false) => debug!("another replica leads"),
                Err(e) => warn!(error = %e, "leader election: cannot reach the Lease; retrying"),
            }
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(cfg.retry_period) => {}
            }
        }
        info!(identity = %cfg.identity, "became leader: running controllers, sweep and reaper");
        let work = tokio::spawn(lead());
        let mut last_renew = Instant::now();
        loop {
            tokio::select! {
                _ = &mut shutdown => {
                    work.abort();
                    release(&api, &cfg).await;
                    info!("leadership released on shutdown");
                    return;
                }
                _ = tokio::time::sleep(cfg.retry_period) => {}
            }
            match attempt(&api, &cfg).await {
                Ok(true) => last_renew = Instant::now(),
                Ok(false) => {
                    warn!("lost the Lease to another replica; stopping leader work");
                    break;
                }
                Err(e) => warn!(error = %e, "could not renew the Lease"),
            }
            if last_renew.elapsed() >= cfg.renew_deadline {
                warn!("Lease not renewed within the renew deadline; stopping leader work");
                break;
            }
        }
        work.abort();
        let _ = work.await;
    }
}

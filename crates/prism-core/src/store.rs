//! The stores as the reconcilers see them: what they ask of the election and of the
//! registry of Runs, and nothing of how either is kept. The operator's adapters
//! implement these over Postgres and Redis; the Kubernetes crate's fast tests over maps
//! in memory. Each method says one step; its error says whether the service behind it
//! is down (retry later, show it) or the step failed otherwise.

use std::future::Future;
use std::time::Duration;

use uuid::Uuid;

/// How long a row changed behind the operator's back (a database restored from a backup,
/// a hand-edited row: a change no NOTIFY tells of) may go unseen by what a replica holds
/// in memory instead of reading: the agents' held roles and the RunSessions' mirrored
/// identities. Every change the operator makes is told at once; this only bounds the rest.
pub const UNNOTIFIED_CHANGE_BOUND: Duration = Duration::from_secs(600);

use crate::election::ReleaseReason;
use crate::election::registration::{NewRegistration, ProjectView, Pruned, Quota, RegisterOutcome, Registration};
use crate::run::{Fenced, IdentitySpec, Mirror, Reaped, RunAddress};

/// A store's failure, as its callers tell failures apart.
pub trait Failure: std::error::Error + Send + Sync + 'static {
    /// The service behind the store cannot be reached right now.
    fn unavailable(&self) -> bool;
}

/// Why the election did not take a registration (SPEC §6, §12): an answer about the
/// registration, not a failure of the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The session belongs to another Kubernetes identity.
    NotOwned(String),
    /// A quota of live registrations is full; nothing was written.
    QuotaExceeded(Quota),
}

/// The election's failures: a refusal is one of them for the callers that answer with it.
pub trait ElectionFailure: Failure {
    fn refusal(&self) -> Option<Refusal>;
}

/// The controller election (SPEC §4) as a reconciler drives it.
pub trait Elections: Send + Sync + 'static {
    type Error: ElectionFailure;

    /// The registration of this resource uid, live or released.
    fn get(&self, id: Uuid) -> impl Future<Output = Result<Option<Registration>, Self::Error>> + Send;
    /// Enters a registration (idempotent for its id); the election runs in the same step.
    fn register(&self, new: &NewRegistration) -> impl Future<Output = Result<RegisterOutcome, Self::Error>> + Send;
    /// The project's term, master and live registrations, from a read that starts after
    /// the call (calls for the same project at once may share it).
    fn project(
        &self,
        namespace: &str,
        project_id: &str,
    ) -> impl Future<Output = Result<ProjectView, Self::Error>> + Send;
    /// Releases the registration (promoting a successor); whether it was live.
    fn release(&self, id: Uuid, reason: ReleaseReason) -> impl Future<Output = Result<bool, Self::Error>> + Send;
    /// The registration's resource is gone: its row may be pruned after retention.
    fn resource_gone(&self, id: Uuid) -> impl Future<Output = Result<(), Self::Error>> + Send;
    /// Releases the registrations whose heartbeat is older than `stale_minutes`; how many.
    fn sweep(&self, stale_minutes: u32) -> impl Future<Output = Result<usize, Self::Error>> + Send;
    /// Released registrations older than `hours` whose resource is still there: (uid,
    /// namespace, name), at most `limit`, of `namespace` only when given.
    fn released_resources(
        &self,
        hours: u32,
        namespace: Option<&str>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<(Uuid, String, String)>, Self::Error>> + Send;
    /// Retention: deletes what is older than `days`.
    fn prune(&self, days: u32) -> impl Future<Output = Result<Pruned, Self::Error>> + Send;
}

/// The registry of Runs (SPEC §5) as a reconciler drives it: identities, leases, jobs.
pub trait Runs: Send + Sync + 'static {
    type Error: Failure;

    /// Mirrors a RunSession's identity (durably): who owns the address, in which epoch.
    fn mirror(&self, identity: &IdentitySpec) -> impl Future<Output = Result<Mirror, Self::Error>> + Send;
    /// The lease length of an identity (its own, or the operator's default), in seconds.
    fn lease_seconds(&self, lease_seconds: Option<i32>) -> u32;
    /// Ends the address's sessions of an epoch older than `epoch`; what is left.
    fn fence(&self, address: &RunAddress, epoch: i64) -> impl Future<Output = Result<Fenced, Self::Error>> + Send;
    /// A deleted RunSession: its identity revoked, its unfinished jobs cancelled, its
    /// session ended (the revocation outlives it by `revoked_ttl`). None when the resource
    /// never held the identity; else how many jobs were cancelled.
    fn revoke(
        &self,
        identity: &IdentitySpec,
        revoked_ttl: Duration,
    ) -> impl Future<Output = Result<Option<u64>, Self::Error>> + Send;
    /// Retention: finished jobs and revoked identities older than `days`; how many of each.
    fn prune(&self, days: u32) -> impl Future<Output = Result<(u64, u64), Self::Error>> + Send;
    /// The job reaper's pass: attempts past their time ended, cancels past their grace done.
    fn reap(&self) -> impl Future<Output = Result<Reaped, Self::Error>> + Send;
    /// Whether the lease store answers.
    fn ping(&self) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

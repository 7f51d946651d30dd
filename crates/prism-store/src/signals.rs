//! What this replica hears of change, from any replica (SPEC §11 "push, not poll"): one
//! Postgres LISTEN connection per process, fanned out in memory to whoever waits.
//!
//! * **Cancel requests.** Which Run addresses may hold a job whose cancel was requested,
//!   so that a heartbeat (SPEC §6: its reply lists `cancel`) and a claim read Postgres
//!   only for those. Without it every heartbeat of every Run made two Postgres reads to
//!   answer an empty list almost always, and ran at a tenth of its Redis baseline.
//! * **Run wakes.** A claim that long-polls waits on its address: a job queued for it
//!   (new, retried, requeued; at its `eligible_at` when that is later), a slot freed
//!   there, or a cancel requested for a job it holds wakes it to look again.
//! * **Project wakes.** A watch of a project's routing table waits on the project: a
//!   change of its election (a member joined or left, a change of master) wakes it to
//!   read the table again.
//! * **Pending nudges.** Which agent sessions may have an undelivered nudge, so that
//!   their answers (heartbeat, status, MCP calls, watches) read the `nudges` table only
//!   for those: the coalesced agent heartbeat stays free of Postgres.
//!
//! * **Identity epochs.** The newest epoch of each Run address (`identity_epochs`), so
//!   that a heartbeat refuses a session of a rotated or revoked key even while Redis
//!   does not know it. Read whole at each (re)connection; kept, not forgotten, while
//!   not listening (it only ever refuses what is older than something true).
//! * **MCP subscriptions.** The GET stream of a session-based MCP session waits on the
//!   session: a `resources/subscribe` or `unsubscribe` made through any replica wakes it
//!   to read what the session follows again.
//!
//! Waiting costs a future and no Postgres connection. Triggers and the election's
//! writes NOTIFY (channels below); a signal is delivered at commit, never for a
//! rolled-back change. While this replica is not listening (starting, Postgres
//! restarting) nothing is known: every heartbeat reads Postgres, and every waiter is
//! woken on each (re)connection to look again, so nothing sent in the gap is missed.
//! On each (re)connection, and every `RESCAN_EVERY`, the pending sets are read again:
//! that is how addresses whose cancels are done (sessions whose nudges are delivered)
//! leave them. The replica that took a cancel request notes its address itself before it
//! answers, so the Run's next heartbeat there sees it even before the notification.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::sync::futures::Notified;
use tracing::{debug, warn};

use crate::election::LiveRoles;
use crate::identity_epochs::IdentityEpochs;
use crate::run_registry::RunAddress;

/// A job in flight got a cancel request (migration `20261202000004_cancel_signal.sql`).
pub const JOB_CANCELS: &str = "prism_job_cancels";
/// Something may be claimable at an address (`20261203000001_job_wakes.sql`).
pub const JOB_WAKES: &str = "prism_job_wakes";
/// A project's routing table changed (the election's writes, `election::store`).
pub const PROJECTS: &str = "prism_projects";
/// A session got a nudge (the context switch's write, `election::store`).
pub const NUDGES: &str = "prism_nudges";
/// An MCP session's subscriptions changed (`api::mcp::subscriptions`); the payload is
/// the session's digest.
pub const MCP_SUBSCRIPTIONS: &str = "prism_mcp_subscriptions";
/// A Run identity took a new epoch (`20261206000007_identity_epoch_signal.sql`).
pub const IDENTITY_EPOCHS: &str = "prism_identity_epochs";
/// Addresses whose cancels are all done are forgotten this often.
pub const RESCAN_EVERY: Duration = Duration::from_secs(30);
/// A wake at a job's `eligible_at` further off than this is not scheduled: the job's
/// backoff is at most 600 s, and a claim waits at most 60 s before it asks again.
const LONGEST_DELAYED_WAKE: Duration = Duration::from_secs(660);

/// The payload of a job signal: the job's address, and for a wake the epoch seconds
/// from which the job may be claimed when that is later than now.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct JobSignal {
    server_instance_id: String,
    component_kind: String,
    #[serde(default)]
    eligible_at: Option<f64>,
}

/// The payload of an identity's new epoch.
#[derive(Debug, Deserialize)]
struct EpochSignal {
    server_instance_id: String,
    component_kind: String,
    epoch: i64,
}

impl JobSignal {
    fn address(self) -> RunAddress {
        RunAddress { server_instance_id: self.server_instance_id, component_kind: self.component_kind }
    }
}

/// An agent session, as nudges address it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SessionKey {
    pub namespace: String,
    pub session_id: String,
}

/// A project, as the election keys it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProjectKey {
    pub namespace: String,
    pub project_id: String,
}

#[derive(Clone, Default)]
pub struct Signals {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    cancels: Pending<RunAddress>,
    nudges: Pending<SessionKey>,
    runs: Arc<Waiters<RunAddress>>,
    projects: Arc<Waiters<ProjectKey>>,
    mcp_sessions: Arc<Waiters<String>>,
    epochs: IdentityEpochs,
    /// Heartbeats' roles, held while listening (`election::roles`).
    roles: LiveRoles,
}

/// Keys that may have something pending; `None` while not listening: nothing known,
/// every key may have.
struct Pending<K>(Mutex<Option<HashSet<K>>>);

impl<K> Default for Pending<K> {
    fn default() -> Self {
        Pending(Mutex::new(None))
    }
}

impl<K: Clone + Eq + Hash> Pending<K> {
    fn may_have(&self, key: &K) -> bool {
        locked(&self.0).as_ref().is_none_or(|set| set.contains(key))
    }

    fn note(&self, key: &K) {
        if let Some(set) = locked(&self.0).as_mut() {
            set.insert(key.clone());
        }
    }

    fn replace(&self, set: HashSet<K>) {
        *locked(&self.0) = Some(set);
    }

    fn remove(&self, key: &K) {
        if let Some(set) = locked(&self.0).as_mut() {
            set.remove(key);
        }
    }

    fn forget(&self) {
        *locked(&self.0) = None;
    }
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere while the lock was held leaves a map that is still a map.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Signals {
    /// Whether a session of `epoch` at `address` is known to be of a key since rotated or
    /// revoked (`identity_epochs`).
    pub fn stale_epoch(&self, address: &RunAddress, epoch: i64) -> bool {
        self.inner.epochs.stale(address, epoch)
    }

    /// False only when no job of `address` can have a cancel request pending.
    pub fn may_have_cancel(&self, address: &RunAddress) -> bool {
        self.inner.cancels.may_have(address)
    }

    /// A cancel of a job of `address` was requested (or a notification says so): its
    /// heartbeats read the list, and its waiting claims look again.
    pub fn note_cancel(&self, address: &RunAddress) {
        self.inner.cancels.note(address);
        self.inner.runs.wake(address);
    }

    /// The session got a nudge (written by this replica): its next answer reads it.
    pub fn note_nudge(&self, namespace: &str, session_id: &str) {
        self.inner.nudges.note(&SessionKey { namespace: namespace.to_string(), session_id: session_id.to_string() });
    }

    /// A read found none for the session: its answers stop reading. (A nudge committed
    /// during that read is read again at the next rescan: late, never lost.)
    pub fn no_nudge(&self, namespace: &str, session_id: &str) {
        self.inner.nudges.remove(&SessionKey { namespace: namespace.to_string(), session_id: session_id.to_string() });
    }

    /// False only when the session cannot have an undelivered nudge.
    pub fn may_have_nudge(&self, namespace: &str, session_id: &str) -> bool {
        self.inner.nudges.may_have(&SessionKey { namespace: namespace.to_string(), session_id: session_id.to_string() })
    }

    /// Waits on a Run's address (a long-poll claim).
    pub fn run_waiter(&self, address: &RunAddress) -> Waiter<RunAddress> {
        self.inner.runs.waiter(address)
    }

    /// Waits on a project (a watch of its routing table).
    pub fn project_waiter(&self, project: &ProjectKey) -> Waiter<ProjectKey> {
        self.inner.projects.waiter(project)
    }

    /// Waits on an MCP session's subscriptions (its GET stream), by session digest.
    pub fn mcp_session_waiter(&self, digest: &str) -> Waiter<String> {
        self.inner.mcp_sessions.waiter(&digest.to_string())
    }

    /// Wakes the streams of an MCP session on this replica (the others hear the NOTIFY).
    pub fn wake_mcp_session(&self, digest: &str) {
        self.inner.mcp_sessions.wake(&digest.to_string());
    }

    /// Signals whose held roles count their reads from Postgres in `role_reads`.
    pub fn counting_role_reads(role_reads: prometheus_client::metrics::counter::Counter) -> Self {
        let inner = Inner { roles: LiveRoles::counting(role_reads), ..Inner::default() };
        Signals { inner: Arc::new(inner) }
    }

    /// The roles every election store of this process answers heartbeats from: what
    /// this listener hears of a project's change (and of its own gaps) invalidates them.
    pub fn live_roles(&self) -> LiveRoles {
        self.inner.roles.clone()
    }

    /// How many addresses and projects are waited on now.
    pub fn waited(&self) -> (usize, usize) {
        (self.inner.runs.len(), self.inner.projects.len())
    }

    /// Stopped listening: notifications may be lost from now on.
    fn forget(&self) {
        self.inner.cancels.forget();
        self.inner.nudges.forget();
        self.inner.roles.deaf();
    }

    fn replace_cancels(&self, set: HashSet<RunAddress>) {
        self.inner.cancels.replace(set);
    }

    /// Both pending sets, read again.
    async fn rescan(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        self.replace_cancels(scan_cancels(pool).await?);
        self.inner.nudges.replace(scan_nudges(pool).await?);
        Ok(())
    }

    fn wake_everyone(&self) {
        self.inner.runs.wake_all();
        self.inner.projects.wake_all();
        self.inner.mcp_sessions.wake_all();
    }

    /// Follows the notifications until the process ends: LISTEN on a connection of its
    /// own, the reads on `pool`.
    pub async fn follow(self, pool: PgPool) {
        const RETRY: Duration = Duration::from_secs(2);
        let listening = crate::db::listener_pool(&pool);
        loop {
            if let Err(error) = self.follow_once(&listening, &pool).await {
                warn!(%error, "change signals: not listening; heartbeats read Postgres until it is back");
            }
            self.forget();
            tokio::time::sleep(RETRY).await;
        }
    }

    /// Listens, reads the pending cancels, wakes every waiter, then applies
    /// notifications until the connection is lost. LISTEN comes before the read and the
    /// wake, so a change committed in between is heard one way or the other;
    /// notifications that arrive during a rescan wait in the listener's buffer.
    async fn follow_once(&self, listening: &PgPool, pool: &PgPool) -> Result<(), sqlx::Error> {
        let mut listener = sqlx::postgres::PgListener::connect_with(listening).await?;
        // Not `recv`'s silent reconnection: the gap must be seen, to look again.
        listener.eager_reconnect(false);
        listener.listen_all([JOB_CANCELS, JOB_WAKES, PROJECTS, NUDGES, MCP_SUBSCRIPTIONS, IDENTITY_EPOCHS]).await?;
        // Every change committed from here on is heard: roles read from now on may be held.
        self.inner.roles.listening();
        self.rescan(pool).await?;
        for (server_instance_id, component_kind, epoch) in scan_epochs(pool).await? {
            self.inner.epochs.heard(&RunAddress { server_instance_id, component_kind }, epoch);
        }
        self.wake_everyone();
        let mut rescan = tokio::time::interval(RESCAN_EVERY);
        rescan.tick().await;
        loop {
            tokio::select! {
                received = listener.try_recv() => {
                    // None: lost the connection; what was sent meanwhile is gone.
                    let Some(notification) = received? else { return Ok(()) };
                    if !self.apply(notification.channel(), notification.payload()) {
                        // Unreadable: it may have named anything. Listen afresh.
                        debug!(channel = notification.channel(), payload = notification.payload(),
                               "change signals: unreadable signal; listening again");
                        return Ok(());
                    }
                }
                _ = rescan.tick() => self.rescan(pool).await?,
            }
        }
    }

    /// One notification; false when it cannot be read.
    fn apply(&self, channel: &str, payload: &str) -> bool {
        match channel {
            NUDGES => match serde_json::from_str::<SessionKey>(payload) {
                Ok(session) => {
                    self.inner.nudges.note(&session);
                    true
                }
                Err(_) => false,
            },
            PROJECTS => match serde_json::from_str::<ProjectKey>(payload) {
                Ok(project) => {
                    self.inner.roles.changed(&project.namespace, &project.project_id);
                    self.inner.projects.wake(&project);
                    true
                }
                Err(_) => false,
            },
            IDENTITY_EPOCHS => match serde_json::from_str::<EpochSignal>(payload) {
                Ok(signal) => {
                    let address = RunAddress {
                        server_instance_id: signal.server_instance_id,
                        component_kind: signal.component_kind,
                    };
                    self.inner.epochs.heard(&address, signal.epoch);
                    true
                }
                Err(_) => false,
            },
            MCP_SUBSCRIPTIONS => {
                self.inner.mcp_sessions.wake(&payload.to_string());
                true
            }
            JOB_CANCELS | JOB_WAKES => match serde_json::from_str::<JobSignal>(payload) {
                Ok(signal) if channel == JOB_CANCELS => {
                    self.note_cancel(&signal.address());
                    true
                }
                Ok(signal) => {
                    self.wake_at(signal);
                    true
                }
                Err(_) => false,
            },
            _ => true,
        }
    }

    /// Wakes the signal's address now, and again when its job becomes eligible.
    fn wake_at(&self, signal: JobSignal) {
        let later = signal.eligible_at.map(|at| at - chrono::Utc::now().timestamp_micros() as f64 / 1e6);
        let address = signal.address();
        self.inner.runs.wake(&address);
        if let Some(later) = later.filter(|s| *s > 0.0).map(Duration::from_secs_f64)
            && later <= LONGEST_DELAYED_WAKE
        {
            let signals = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(later).await;
                signals.inner.runs.wake(&address);
            });
        }
    }
}

/// One `Notify` per key someone waits on (the entry goes with its last waiter), and one
/// for all of them.
struct Waiters<K> {
    by_key: Mutex<HashMap<K, Weak<Notify>>>,
    all: Notify,
}

impl<K> Default for Waiters<K> {
    fn default() -> Self {
        Waiters { by_key: Mutex::new(HashMap::new()), all: Notify::new() }
    }
}

impl<K: Clone + Eq + Hash> Waiters<K> {
    fn waiter(self: &Arc<Self>, key: &K) -> Waiter<K> {
        let mut by_key = locked(&self.by_key);
        let notify = match by_key.get(key).and_then(Weak::upgrade) {
            Some(notify) => notify,
            None => {
                let notify = Arc::new(Notify::new());
                by_key.insert(key.clone(), Arc::downgrade(&notify));
                notify
            }
        };
        Waiter { key: key.clone(), notify, waiters: self.clone() }
    }

    fn wake(&self, key: &K) {
        let notify = locked(&self.by_key).get(key).and_then(Weak::upgrade);
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }

    fn wake_all(&self) {
        self.all.notify_waiters();
    }

    fn len(&self) -> usize {
        locked(&self.by_key).len()
    }
}

/// Someone waiting on one key.
pub struct Waiter<K: Clone + Eq + Hash> {
    key: K,
    notify: Arc<Notify>,
    waiters: Arc<Waiters<K>>,
}

impl<K: Clone + Eq + Hash> Waiter<K> {
    /// Registers for the next wake of this key (or of all): make it before looking in
    /// Postgres, then await `woken`, so a wake during the look is kept.
    pub fn armed(&self) -> Armed<'_> {
        let mut mine = Box::pin(self.notify.notified());
        let mut all = Box::pin(self.waiters.all.notified());
        mine.as_mut().enable();
        all.as_mut().enable();
        Armed { mine, all }
    }
}

impl<K: Clone + Eq + Hash> Drop for Waiter<K> {
    fn drop(&mut self) {
        let mut by_key = locked(&self.waiters.by_key);
        // Ours is the last strong reference (taken under this lock): nobody else waits.
        if Arc::strong_count(&self.notify) == 1 {
            by_key.remove(&self.key);
        }
    }
}

/// Wakes registered before a look (see `Waiter::armed`).
pub struct Armed<'a> {
    mine: Pin<Box<Notified<'a>>>,
    all: Pin<Box<Notified<'a>>>,
}

impl Armed<'_> {
    pub async fn woken(self) {
        let Armed { mine, all } = self;
        tokio::select! { _ = mine => {}, _ = all => {} }
    }
}

async fn scan_nudges(pool: &PgPool) -> Result<HashSet<SessionKey>, sqlx::Error> {
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT DISTINCT namespace, session_id FROM nudges WHERE delivered_at IS NULL")
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().map(|(namespace, session_id)| SessionKey { namespace, session_id }).collect())
}

/// The newest epoch of every address (live identities and revoked ones alike).
async fn scan_epochs(pool: &PgPool) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT server_instance_id, component_kind, max(epoch) FROM run_identities GROUP BY 1, 2")
        .fetch_all(pool)
        .await
}

async fn scan_cancels(pool: &PgPool) -> Result<HashSet<RunAddress>, sqlx::Error> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT DISTINCT server_instance_id, component_kind FROM runtime_jobs
          WHERE cancel_requested_at IS NOT NULL AND state IN ('claimed','running')",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(server_instance_id, component_kind)| RunAddress { server_instance_id, component_kind })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(server: &str) -> RunAddress {
        RunAddress { server_instance_id: server.into(), component_kind: "run".into() }
    }

    fn project(id: &str) -> ProjectKey {
        ProjectKey { namespace: "agents".into(), project_id: id.into() }
    }

    async fn woken_within(armed: Armed<'_>, ms: u64) -> bool {
        tokio::time::timeout(Duration::from_millis(ms), armed.woken()).await.is_ok()
    }

    #[test]
    fn cancels_are_unknown_until_listening_then_only_the_noted_addresses() {
        let signals = Signals::default();
        assert!(signals.may_have_cancel(&at("a")), "not listening: every address may have one");
        signals.note_cancel(&at("a"));
        signals.replace_cancels(HashSet::from([at("b")]));
        assert!(!signals.may_have_cancel(&at("a")), "the read replaced what was noted before it");
        assert!(signals.may_have_cancel(&at("b")));
        signals.note_cancel(&at("c"));
        assert!(signals.may_have_cancel(&at("c")));
        assert!(
            !signals.may_have_cancel(&RunAddress { server_instance_id: "c".into(), component_kind: "agent".into() })
        );
        signals.forget();
        assert!(signals.may_have_cancel(&at("z")), "stopped listening: unknown again");
    }

    #[test]
    fn clones_share_one_set() {
        let signals = Signals::default();
        signals.replace_cancels(HashSet::new());
        signals.clone().note_cancel(&at("a"));
        assert!(signals.may_have_cancel(&at("a")));
    }

    #[tokio::test]
    async fn notifications_are_the_json_the_triggers_and_the_election_send() {
        let signals = Signals::default();
        signals.replace_cancels(HashSet::new());
        let run = signals.run_waiter(&at("srv-1"));
        let watch = signals.project_waiter(&project("P1"));
        let (armed_run, armed_watch) = (run.armed(), watch.armed());
        assert!(
            signals.apply(JOB_WAKES, r#"{"server_instance_id":"srv-1","component_kind":"run","eligible_at":null}"#)
        );
        assert!(woken_within(armed_run, 100).await);
        let armed_run = run.armed();
        assert!(signals.apply(JOB_CANCELS, r#"{"server_instance_id":"srv-1","component_kind":"run"}"#));
        assert!(woken_within(armed_run, 100).await, "a cancel wakes the claim too");
        assert!(signals.may_have_cancel(&at("srv-1")));
        assert!(signals.apply(PROJECTS, r#"{"namespace":"agents","project_id":"P1"}"#));
        assert!(woken_within(armed_watch, 100).await);
        assert!(signals.may_have_nudge("agents", "s-1"), "not listening yet: any session may have one");
        signals.inner.nudges.replace(HashSet::new());
        assert!(!signals.may_have_nudge("agents", "s-1"));
        assert!(signals.apply(NUDGES, r#"{"namespace":"agents","session_id":"s-1"}"#));
        assert!(signals.may_have_nudge("agents", "s-1") && !signals.may_have_nudge("other", "s-1"));
        assert!(!signals.apply(PROJECTS, "agents/P1"), "unreadable");
        assert!(!signals.apply(JOB_WAKES, r#"{"server_instance_id":1}"#), "unreadable");
    }

    #[tokio::test]
    async fn a_wake_during_the_look_is_kept_and_reaches_only_its_key() {
        let signals = Signals::default();
        let waiter = signals.run_waiter(&at("a"));
        let other = signals.run_waiter(&at("b"));
        let watch = signals.project_waiter(&project("P"));
        let armed = waiter.armed();
        let armed_other = other.armed();
        let armed_watch = watch.armed();
        signals.inner.runs.wake(&at("a")); // before anyone awaits: kept by the registration
        assert!(woken_within(armed, 1000).await);
        assert!(!woken_within(armed_other, 50).await, "another address is not woken");
        assert!(!woken_within(armed_watch, 50).await, "nor a project");
        let (armed_other, armed_watch) = (other.armed(), watch.armed());
        signals.wake_everyone();
        assert!(woken_within(armed_other, 1000).await && woken_within(armed_watch, 1000).await);
    }

    #[tokio::test]
    async fn a_key_is_forgotten_with_its_last_waiter() {
        let signals = Signals::default();
        let first = signals.run_waiter(&at("a"));
        let second = signals.run_waiter(&at("a"));
        let watch = signals.project_waiter(&project("P"));
        assert_eq!(signals.waited(), (1, 1), "one entry for both");
        drop(first);
        assert_eq!(signals.waited(), (1, 1), "the second still waits");
        drop((second, watch));
        assert_eq!(signals.waited(), (0, 0));
        signals.inner.runs.wake(&at("a")); // nobody waits: nothing to do
    }

    #[tokio::test(start_paused = true)]
    async fn a_wake_for_a_later_eligible_at_comes_then() {
        let signals = Signals::default();
        let waiter = signals.run_waiter(&at("a"));
        let now = chrono::Utc::now().timestamp_micros() as f64 / 1e6;
        let armed = waiter.armed();
        signals.wake_at(JobSignal {
            server_instance_id: "a".into(),
            component_kind: "run".into(),
            eligible_at: Some(now + 5.0),
        });
        assert!(woken_within(armed, 10).await, "woken at once (it may be claimable elsewhere first)");
        let armed = waiter.armed();
        tokio::time::advance(Duration::from_secs(3)).await;
        assert!(!woken_within(armed, 10).await, "not again before the job is eligible");
        let armed = waiter.armed();
        assert!(woken_within(armed, 5000).await, "woken when it is");
    }
}

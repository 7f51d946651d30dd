//! The election's Postgres side. Each event is one transaction that locks the project
//! (an advisory lock), reads its live candidates, applies `rules::decide` and writes the
//! registrations, `controller_projects` (term, master) and one `controller_election_events`
//! row per change of master. A context switch (SPEC §4 rule 7) is two transactions: the
//! release on the old project, then the election on the new one. Races on the partial
//! unique indexes are retried, never surfaced.
//!
//! Every resource whose status an event changes is announced through `refresh` inside
//! the same transaction, so the reconcilers hear of it at commit and only then.

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Postgres};
use tracing::{debug, warn};
use uuid::Uuid;

use super::ElectionError;
use super::roles::LiveRoles;
use super::shared_reads::{self, SharedReads};
use crate::db::{QueryError, Step, text_enum};
use prism_core::election::ReleaseReason;
use prism_core::election::{Cause, Event, decide};

mod transaction;
use transaction::{
    check_owner_quota, lock_and_read, lock_project, plan_registration, write_decision, write_registration,
    write_wrap_nudge,
};

/// How often one operation is tried against concurrent transactions before it reports
/// `Contended`.
pub const MAX_ATTEMPTS: u32 = 8;
/// Key of the advisory lock that lets one replica at a time run the stale sweep.
const SWEEP_LOCK_KEY: i64 = 0x7072_6973_6d5f_7377; // "prism_sw"

/// The unique indexes whose violation by the registration insert is an answer, not a race.
const ID_INDEX: &str = "controller_registrations_pkey";
const SESSION_INDEX: &str = "controller_registrations_one_live_per_session";

// The registration's values are the domain's.
pub use prism_core::election::{NewRegistration, ProjectView, Pruned, Quota, RegisterOutcome, Registration};

/// Bounds on live registrations (SPEC §12), checked by every registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quotas {
    /// Live registrations one owner may hold (exact: counted under the owner's lock).
    pub per_owner: u32,
    /// Live registrations per namespace (approximate: counted at most a few seconds
    /// ago, so a burst may overshoot by what registers meanwhile; exact would serialise
    /// every registration of a namespace on one lock).
    pub per_namespace: u32,
}

impl Default for Quotas {
    fn default() -> Self {
        Quotas { per_owner: 100, per_namespace: 10_000 }
    }
}

/// What a heartbeat answers about a session's live registration.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct LiveRole {
    pub project_id: String,
    pub is_master: bool,
    pub preempted: bool,
    /// The project's current term (what a client fences against).
    pub project_term: i64,
    /// Who registered the session through the API (None: created with kubectl).
    pub owner: Option<String>,
}

/// A registration with its owner (SPEC §6 session ownership): the Kubernetes identity
/// that registered it through the API, None for one created with kubectl.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct OwnedRegistration {
    #[sqlx(flatten)]
    pub row: Registration,
    pub owner: Option<String>,
}

impl OwnedRegistration {
    /// May `caller` act on this registration? Unowned ones are anybody's (authorization
    /// has already said the caller may act in the namespace at all).
    pub fn owned_by(&self, caller: &str) -> bool {
        self.owner.as_deref().is_none_or(|owner| owner == caller)
    }

    /// May a registration of `owner` (None: no owner known) move or stand in for this
    /// session? An owned session only by its owner (SPEC §12: an unowned registration
    /// never displaces a session that has one).
    pub fn yields_to(&self, owner: Option<&str>) -> bool {
        match (self.owner.as_deref(), owner) {
            (None, _) => true,
            (Some(mine), Some(theirs)) => mine == theirs,
            (Some(_), None) => false,
        }
    }
}

const COLUMNS: &str = "id, namespace, name, project_id, session_id, agent_surface, is_master, master_term, \
     registered_at, last_heartbeat, released_at, release_reason, preempted, preempted_by";

/// How one attempt at the election on the new project ended.
enum Attempt {
    Done(Box<Registration>),
    /// A row with this id exists already (the primary key said so).
    IdKnown,
    /// The session has a live registration (the one-live-per-session index said so).
    SessionLive,
    /// The registration to leave (rule 7) was no longer live under the lock.
    AlreadyLeft,
}

/// What the metrics count of the election (`ElectionStore::census`).
#[derive(Debug, Default)]
pub struct ElectionCensus {
    /// Election events by cause, ever (what retention kept).
    pub events: Vec<(Cause, i64)>,
    /// Live registrations by (namespace, is master).
    pub live: Vec<(String, bool, i64)>,
}

#[derive(Clone)]
pub struct ElectionStore {
    pool: PgPool,
    quotas: Quotas,
    /// Live registrations per namespace, as counted lately (see `Quotas::per_namespace`).
    namespace_counts: moka::sync::Cache<String, i64>,
    /// Heartbeats' roles held in memory while the process hears every change (`roles`);
    /// None: every heartbeat reads Postgres.
    roles: Option<LiveRoles>,
    /// Reads of a project asked for at once by the reconcilers, made once.
    project_reads: SharedReads<(String, String), ProjectView>,
    /// Counts the reads `project_gathered` makes (`prism_controller_project_reads_total`).
    project_reads_made: Option<prometheus_client::metrics::counter::Counter>,
}

/// How long a namespace's count of live registrations is used before it is counted again.
const NAMESPACE_COUNT_TTL: std::time::Duration = std::time::Duration::from_secs(2);

impl ElectionStore {
    pub fn new(pool: PgPool) -> Self {
        Self::with_quotas(pool, Quotas::default())
    }

    pub fn with_quotas(pool: PgPool, quotas: Quotas) -> Self {
        let namespace_counts =
            moka::sync::Cache::builder().max_capacity(10_000).time_to_live(NAMESPACE_COUNT_TTL).build();
        Self {
            pool,
            quotas,
            namespace_counts,
            roles: None,
            project_reads: SharedReads::new(shared_reads::GATHER),
            project_reads_made: None,
        }
    }

    /// Counts in `made` the project reads `project_gathered` makes (the rest were shared).
    pub fn counting_project_reads(mut self, made: prometheus_client::metrics::counter::Counter) -> Self {
        self.project_reads_made = Some(made);
        self
    }

    /// Answers heartbeats' roles from `roles` when it may (see `roles`), and tells it of
    /// every change this store commits. Every store of a process shares the one its
    /// signal listener keeps (`Signals::live_roles`).
    pub fn with_live_roles(mut self, roles: LiveRoles) -> Self {
        self.roles = Some(roles);
        self
    }

    /// A decision about the project was committed (or may have been): held roles of it go.
    fn changed(&self, namespace: &str, project_id: &str) {
        if let Some(roles) = &self.roles {
            roles.changed(namespace, project_id);
        }
    }

    /// Whether Postgres answers (readiness).
    pub async fn ping(&self) -> Result<(), ElectionError> {
        sqlx::query("SELECT 1").execute(&self.pool).await.step("readiness: ping Postgres")?;
        Ok(())
    }

    /// Election events by cause, and live registrations by namespace and role (metrics).
    pub async fn census(&self) -> Result<ElectionCensus, ElectionError> {
        let events = sqlx::query_as("SELECT cause, count(*) FROM controller_election_events GROUP BY cause")
            .fetch_all(&self.pool)
            .await
            .step("metrics: count election events")?;
        let live = sqlx::query_as(
            "SELECT namespace, is_master, count(*) FROM controller_registrations WHERE released_at IS NULL GROUP BY 1, 2",
        )
        .fetch_all(&self.pool)
        .await
        .step("metrics: count live registrations")?;
        Ok(ElectionCensus { events, live })
    }

    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn get(&self, id: Uuid) -> Result<Option<Registration>, ElectionError> {
        let sql = format!("SELECT {COLUMNS} FROM controller_registrations WHERE id = $1");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .step("read registration by id")?)
    }

    /// A registration and its owner, by id.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn get_owned(&self, id: Uuid) -> Result<Option<OwnedRegistration>, ElectionError> {
        let sql = format!("SELECT {COLUMNS}, owner FROM controller_registrations WHERE id = $1");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .step("read registration and owner by id")?)
    }

    /// The live registration of a session and its owner, if any.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn live_by_session_owned(
        &self,
        namespace: &str,
        session_id: &str,
    ) -> Result<Option<OwnedRegistration>, ElectionError> {
        let sql = format!(
            "SELECT {COLUMNS}, owner FROM controller_registrations WHERE namespace = $1 AND session_id = $2 AND released_at IS NULL"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(namespace)
            .bind(session_id)
            .fetch_optional(&self.pool)
            .await
            .step("read the session's live registration and owner")?)
    }

    /// The live registration of a session, if any.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn live_by_session(
        &self,
        namespace: &str,
        session_id: &str,
    ) -> Result<Option<Registration>, ElectionError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM controller_registrations WHERE namespace = $1 AND session_id = $2 AND released_at IS NULL"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(namespace)
            .bind(session_id)
            .fetch_optional(&self.pool)
            .await
            .step("read the session's live registration")?)
    }

    /// What a heartbeat answers: held in memory while current (`roles`), else one indexed read.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn live_role(&self, namespace: &str, session_id: &str) -> Result<Option<LiveRole>, ElectionError> {
        let Some(roles) = &self.roles else { return self.read_live_role(namespace, session_id).await };
        if let Some(role) = roles.get(namespace, session_id) {
            return Ok(Some(role));
        }
        let ticket = roles.ticket();
        let role = self.read_live_role(namespace, session_id).await?;
        if let Some(role) = &role {
            roles.put(ticket, namespace, session_id, role);
        }
        Ok(role)
    }

    async fn read_live_role(&self, namespace: &str, session_id: &str) -> Result<Option<LiveRole>, ElectionError> {
        Ok(sqlx::query_as(
            "SELECT r.project_id, r.is_master, r.preempted, p.term AS project_term, r.owner FROM controller_registrations r
             JOIN controller_projects p ON p.namespace = r.namespace AND p.project_id = r.project_id
             WHERE r.namespace = $1 AND r.session_id = $2 AND r.released_at IS NULL",
        )
        .bind(namespace)
        .bind(session_id)
        .fetch_optional(&self.pool)
        .await
        .step("heartbeat: read the session's role")?)
    }

    /// `project`, shared by the callers that ask for the same project at once (its
    /// registrations' reconciles, at their shared slot and after a role change): a read
    /// that starts after each of them asked, `shared_reads::GATHER` later. For the
    /// reconcilers; the API's callers, who wait on the answer, read at once.
    pub async fn project_gathered(&self, namespace: &str, project_id: &str) -> Result<ProjectView, ElectionError> {
        let key = (namespace.to_string(), project_id.to_string());
        self.project_reads
            .read(key, || {
                if let Some(made) = &self.project_reads_made {
                    made.inc();
                }
                self.project(namespace, project_id)
            })
            .await
    }

    /// Term, master and live registrations of a project (master first, then by succession),
    /// in one read when the project has live registrations.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn project(&self, namespace: &str, project_id: &str) -> Result<ProjectView, ElectionError> {
        #[derive(sqlx::FromRow)]
        struct LiveWithTerm {
            #[sqlx(flatten)]
            row: Registration,
            term: i64,
            changes: i64,
        }
        let sql = format!(
            "SELECT {COLUMNS},
                    (SELECT term FROM controller_projects p WHERE p.namespace = $1 AND p.project_id = $2) AS term,
                    (SELECT routing_seq FROM controller_projects p WHERE p.namespace = $1 AND p.project_id = $2) AS changes
             FROM controller_registrations
             WHERE namespace = $1 AND project_id = $2 AND released_at IS NULL
             ORDER BY is_master DESC, (agent_surface = 'claude_desktop') DESC, registered_at, id"
        );
        let rows: Vec<LiveWithTerm> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(namespace)
            .bind(project_id)
            .fetch_all(&self.pool)
            .await
            .step("read the project's live registrations")?;
        let (term, changes) = match rows.first() {
            Some(r) => (r.term, r.changes),
            // No live registration: the project may still have a history (its term).
            None => sqlx::query_as(
                "SELECT term, routing_seq FROM controller_projects WHERE namespace = $1 AND project_id = $2",
            )
            .bind(namespace)
            .bind(project_id)
            .fetch_optional(&self.pool)
            .await
            .step("read the project's term")?
            .unwrap_or((0, 0)),
        };
        let live: Vec<Registration> = rows.into_iter().map(|r| r.row).collect();
        let master = live.iter().find(|r| r.is_master).cloned();
        Ok(ProjectView { term, changes, master, live })
    }

    /// The projects of a namespace with their terms, by project id, from after `after`
    /// (a page of `limit`): what an MCP client lists as resources.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn projects(
        &self,
        namespace: &str,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<(String, i64)>, ElectionError> {
        Ok(sqlx::query_as(
            "SELECT project_id, term FROM controller_projects
              WHERE namespace = $1 AND ($2::text IS NULL OR project_id > $2)
              ORDER BY project_id LIMIT $3",
        )
        .bind(namespace)
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .step("list the namespace's projects")?)
    }

    /// The undelivered nudges of a session, oldest first, marked delivered by this read:
    /// each is delivered once (concurrent readers take disjoint rows). Only for a caller
    /// that may act on the session: its owner, or anyone when none of its registrations
    /// has one (SPEC §6), so nobody takes another's nudges.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn take_nudges(
        &self,
        namespace: &str,
        session_id: &str,
        caller: &str,
    ) -> Result<Vec<Nudge>, ElectionError> {
        Ok(sqlx::query_as(
            "UPDATE nudges SET delivered_at = now()
              WHERE id IN (SELECT n.id FROM nudges n
                            WHERE n.namespace = $1 AND n.session_id = $2 AND n.delivered_at IS NULL
                              AND NOT EXISTS (SELECT 1 FROM controller_registrations r
                                               WHERE r.namespace = n.namespace AND r.session_id = n.session_id
                                                 AND r.owner IS NOT NULL AND r.owner <> $3)
                            ORDER BY n.created_at, n.id LIMIT 100 FOR UPDATE SKIP LOCKED)
             RETURNING id, kind, project_id, payload, created_at",
        )
        .bind(namespace)
        .bind(session_id)
        .bind(caller)
        .fetch_all(&self.pool)
        .await
        .step("take the session's nudges")?)
    }

    /// Nudges taken for a stream that ended before its reader took them: undelivered
    /// again, so the session's next answer or watch has them (SPEC §11: delivered once,
    /// and never lost to a stream that dropped).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn return_nudges(&self, ids: &[Uuid]) -> Result<(), ElectionError> {
        sqlx::query("UPDATE nudges SET delivered_at = NULL WHERE id = ANY($1) AND delivered_at IS NOT NULL")
            .bind(ids)
            .execute(&self.pool)
            .await
            .step("return nudges a stream did not deliver")?;
        Ok(())
    }

    /// Registrations of a project released by the stale sweep since `since`.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn recently_stale(
        &self,
        namespace: &str,
        project_id: &str,
        since: DateTime<Utc>,
    ) -> Result<Vec<Registration>, ElectionError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM controller_registrations
             WHERE namespace = $1 AND project_id = $2 AND release_reason = 'stale_heartbeat_incident' AND released_at >= $3
             ORDER BY released_at DESC LIMIT 100"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(namespace)
            .bind(project_id)
            .bind(since)
            .fetch_all(&self.pool)
            .await
            .step("read the project's stale registrations")?)
    }

    /// Registers (SPEC §4 rules 1-4 and 6) and, when the session is live on another
    /// project, first leaves that one (rule 7). Idempotent: a known id returns its row as
    /// it stands. Callers that usually find the row already (a periodic reconcile) should
    /// `get` it first, which takes no lock. A session owned by someone else than
    /// `new.owner` is neither moved nor stood in for (`NotOwned`); a full quota is
    /// `QuotaExceeded`. Nothing is written in either case.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn register(&self, new: &NewRegistration) -> Result<RegisterOutcome, ElectionError> {
        // The session's live registration on another project, once found: the next
        // attempt leaves it and elects the newcomer in one transaction.
        let mut leaving: Option<Registration> = None;
        for attempt in 1..=MAX_ATTEMPTS {
            match self.elect_newcomer(new, leaving.as_ref()).await {
                Ok(Attempt::Done(row)) => return Ok(RegisterOutcome::Registered(*row)),
                // Inserted before: an earlier attempt whose answer was lost, or a retry.
                Ok(Attempt::IdKnown) => {
                    if let Some(existing) = self.get(new.id).await? {
                        return Ok(RegisterOutcome::Registered(existing));
                    }
                }
                // The registration to leave was released in the meantime: look again.
                Ok(Attempt::AlreadyLeft) => leaving = None,
                Ok(Attempt::SessionLive) => match self.live_by_session_owned(&new.namespace, &new.session_id).await? {
                    // Our own row: an earlier attempt committed, and its answer was lost (a
                    // killed backend); Postgres named the session index, not the id. Not a
                    // duplicate: the API would delete this resource, whose finalizer then
                    // releases the registration it had just answered 200 for (the fault
                    // harness: a session wrapped 3 s after its acknowledged switch).
                    Some(own) if own.row.id == new.id => return Ok(RegisterOutcome::Registered(own.row)),
                    // Another identity's session: not this registration's to move or join.
                    Some(other) if !other.yields_to(new.owner.as_deref()) => {
                        return Err(ElectionError::NotOwned(new.session_id.clone()));
                    }
                    // Rule 6 under another resource: that one stands.
                    Some(existing) if existing.row.project_id == new.project_id => {
                        return Ok(RegisterOutcome::DuplicateSession { existing: existing.row });
                    }
                    // Rule 7: the session is live on another project; leave it, then elect.
                    Some(other) => leaving = Some(other.row),
                    // Released in the meantime: try again.
                    None => leaving = None,
                },
                Err(e) if e.is_race() => debug!(attempt, error = %e, "lost a registration race; retrying"),
                Err(e) => return Err(e),
            }
        }
        Err(ElectionError::Contended("register"))
    }

    /// Live registrations the owner holds now, counted up to its quota (a registration's
    /// cost does not grow with how many live ones there are beyond what the quota allows).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn owned_live(&self, owner: &str) -> Result<i64, ElectionError> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT 1 FROM controller_registrations
                                    WHERE owner = $1 AND released_at IS NULL LIMIT $2) AS held",
        )
        .bind(owner)
        .bind(i64::from(self.quotas.per_owner))
        .fetch_one(&self.pool)
        .await
        .step("quota: count the owner's live registrations")?)
    }

    /// Would one more registration of `owner` in `namespace` exceed a quota? (The cheap
    /// check before any resource is made; `register` checks again, exactly for owners.)
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn check_quota(&self, namespace: &str, owner: Option<&str>) -> Result<(), ElectionError> {
        if let Some(owner) = owner {
            let held = self.owned_live(owner).await?;
            if held >= i64::from(self.quotas.per_owner) {
                return Err(ElectionError::QuotaExceeded(Quota::Owner(self.quotas.per_owner)));
            }
        }
        self.check_namespace_quota(namespace).await
    }

    async fn check_namespace_quota(&self, namespace: &str) -> Result<(), ElectionError> {
        let held = match self.namespace_counts.get(namespace) {
            Some(n) => n,
            None => {
                // The count a trigger keeps (at most 64 shard rows): a registration's cost
                // does not grow with how many are live.
                let n: i64 = sqlx::query_scalar(
                    "SELECT coalesce(sum(live), 0)::int8 FROM controller_registration_counts WHERE namespace = $1",
                )
                .bind(namespace)
                .fetch_one(&self.pool)
                .await
                .step("quota: count the namespace's live registrations")?;
                self.namespace_counts.insert(namespace.to_string(), n);
                n
            }
        };
        if held >= i64::from(self.quotas.per_namespace) {
            return Err(ElectionError::QuotaExceeded(Quota::Namespace(self.quotas.per_namespace)));
        }
        Ok(())
    }

    /// The election on the newcomer's project: lock, plan, insert, write, commit. With
    /// `leaving` (rule 7), the session's registration on another project is released in
    /// the same transaction: the session leaves one project and joins the other, or
    /// neither happens. (Two transactions left a moment, and after a failure between
    /// them for good, in which the session was live nowhere: the fault harness saw a
    /// heartbeat answered not_registered although no call of that session had failed.)
    async fn elect_newcomer(
        &self,
        new: &NewRegistration,
        leaving: Option<&Registration>,
    ) -> Result<Attempt, ElectionError> {
        if leaving.is_none() {
            // A context switch does not add a live registration; a new one may not exceed
            // the namespace's quota.
            self.check_namespace_quota(&new.namespace).await?;
        }
        let mut tx = crate::db::begin(&self.pool).await.step("register: begin")?;
        // Without a project to leave, the plan's first read takes the project's lock.
        if let Some(from) = leaving {
            {
                // Every transaction that holds two project locks takes them in this
                // order, so two context switches cannot wait for each other.
                let mut projects = [
                    (from.namespace.as_str(), from.project_id.as_str()),
                    (new.namespace.as_str(), new.project_id.as_str()),
                ];
                projects.sort();
                for (namespace, project_id) in projects {
                    lock_project(&mut tx, namespace, project_id).await?;
                }
                let (state, names) = lock_and_read(&mut tx, &from.namespace, &from.project_id).await?;
                let decision =
                    decide(&state, &Event::Release { ids: vec![from.id], reason: ReleaseReason::ContextSwitch });
                if decision.transitions.is_empty() {
                    return Ok(Attempt::AlreadyLeft);
                }
                write_decision(&mut tx, &from.namespace, &from.project_id, &state, &decision, &names, None).await?;
                write_wrap_nudge(&mut tx, from).await?;
            }
        }
        let plan = plan_registration(&mut tx, new).await?;
        // The owner's lock after the project's, always in that order.
        if let Some(owner) = &new.owner {
            check_owner_quota(&mut tx, owner, new, self.quotas.per_owner).await?;
        }
        // A kubectl registration's own status follows from the reconcile that is writing
        // this row; one the API writes is announced with the others (its creation may
        // have been reconciled before the row existed).
        let announced = (!new.through_api).then_some(new.id);
        match write_registration(&mut tx, new, &plan, announced).await {
            Ok(()) => {}
            Err(e) if e.constraint() == Some(ID_INDEX) => return Ok(Attempt::IdKnown),
            Err(e) if e.constraint() == Some(SESSION_INDEX) => return Ok(Attempt::SessionLive),
            Err(e) => return Err(e.into()),
        }
        let committed = tx.commit().await;
        if let Some(from) = leaving {
            self.changed(&from.namespace, &from.project_id);
        }
        self.changed(&new.namespace, &new.project_id);
        committed.step("register: commit")?;
        Ok(Attempt::Done(Box::new(plan.newcomer_row(new))))
    }

    /// Releases a registration (wrap, context switch) and promotes a successor if it was
    /// master. Returns whether it was live; releasing an unknown or already released
    /// registration changes nothing.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn release(&self, id: Uuid, reason: ReleaseReason) -> Result<bool, ElectionError> {
        for attempt in 1..=MAX_ATTEMPTS {
            match self.release_once(id, reason).await {
                Err(e) if e.is_race() => debug!(attempt, error = %e, "lost a release race; retrying"),
                other => return other,
            }
        }
        Err(ElectionError::Contended("release"))
    }

    async fn release_once(&self, id: Uuid, reason: ReleaseReason) -> Result<bool, ElectionError> {
        let Some(row) = self.get(id).await?.filter(Registration::is_live) else {
            return Ok(false);
        };
        let mut tx = crate::db::begin(&self.pool).await.step("release: begin")?;
        let (state, names) = lock_and_read(&mut tx, &row.namespace, &row.project_id).await?;
        let decision = decide(&state, &Event::Release { ids: vec![id], reason });
        write_decision(&mut tx, &row.namespace, &row.project_id, &state, &decision, &names, None).await?;
        if reason == ReleaseReason::ContextSwitch && !decision.transitions.is_empty() {
            write_wrap_nudge(&mut tx, &row).await?;
        }
        let committed = tx.commit().await;
        self.changed(&row.namespace, &row.project_id);
        committed.step("release: commit")?;
        Ok(!decision.transitions.is_empty())
    }

    /// Releases live registrations whose heartbeat is older than `stale_minutes`
    /// (`stale_heartbeat_incident`), promoting successors. One replica at a time.
    /// Returns how many it released.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn sweep(&self, stale_minutes: u32) -> Result<usize, ElectionError> {
        let mut lock_conn = crate::db::acquire(&self.pool).await.step("sweep: acquire a connection")?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(SWEEP_LOCK_KEY)
            .fetch_one(&mut *lock_conn)
            .await
            .step("sweep: take the sweep lock")?;
        if !locked {
            debug!("another replica is sweeping");
            return Ok(0);
        }
        let swept = self.sweep_locked(stale_minutes).await;
        // A session lock dies with its connection: if the unlock fails, the connection
        // is broken and the lock went with it.
        if let Err(error) =
            sqlx::query("SELECT pg_advisory_unlock($1)").bind(SWEEP_LOCK_KEY).execute(&mut *lock_conn).await
        {
            warn!(%error, "sweep: could not release the sweep lock (it ends with the connection)");
        }
        swept
    }

    async fn sweep_locked(&self, stale_minutes: u32) -> Result<usize, ElectionError> {
        let projects: Vec<(String, String)> = sqlx::query_as(
            "SELECT DISTINCT namespace, project_id FROM controller_registrations
             WHERE released_at IS NULL AND last_heartbeat < now() - make_interval(mins => $1)",
        )
        .bind(stale_minutes as i32)
        .fetch_all(&self.pool)
        .await
        .step("sweep: find projects with stale registrations")?;
        let mut released = 0;
        for (namespace, project_id) in projects {
            released += self.sweep_project_retrying(&namespace, &project_id, stale_minutes).await?;
        }
        Ok(released)
    }

    async fn sweep_project_retrying(
        &self,
        namespace: &str,
        project_id: &str,
        stale_minutes: u32,
    ) -> Result<usize, ElectionError> {
        for attempt in 1..=MAX_ATTEMPTS {
            match self.sweep_project(namespace, project_id, stale_minutes).await {
                Err(e) if e.is_race() => debug!(attempt, error = %e, "lost a sweep race; retrying"),
                other => return other,
            }
        }
        Err(ElectionError::Contended("sweep"))
    }

    async fn sweep_project(
        &self,
        namespace: &str,
        project_id: &str,
        stale_minutes: u32,
    ) -> Result<usize, ElectionError> {
        let mut tx = crate::db::begin(&self.pool).await.step("sweep: begin")?;
        let (state, names) = lock_and_read(&mut tx, namespace, project_id).await?;
        // Read again under the lock: a heartbeat may have arrived since the scan.
        let stale: Vec<Uuid> = sqlx::query_scalar(
            "SELECT id FROM controller_registrations
             WHERE namespace = $1 AND project_id = $2 AND released_at IS NULL
               AND last_heartbeat < now() - make_interval(mins => $3)",
        )
        .bind(namespace)
        .bind(project_id)
        .bind(stale_minutes as i32)
        .fetch_all(&mut *tx)
        .await
        .step("sweep: read stale registrations under the project lock")?;
        if stale.is_empty() {
            return Ok(0);
        }
        let released = stale.len();
        let decision = decide(&state, &Event::Release { ids: stale, reason: ReleaseReason::StaleHeartbeatIncident });
        write_decision(&mut tx, namespace, project_id, &state, &decision, &names, None).await?;
        let committed = tx.commit().await;
        self.changed(namespace, project_id);
        committed.step("sweep: commit")?;
        Ok(released)
    }

    /// Released registrations whose resource may still exist, released over `hours` ago
    /// (in `namespace` only, when given): what retention deletes.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn released_resources(
        &self,
        hours: u32,
        namespace: Option<&str>,
        limit: i64,
    ) -> Result<Vec<(Uuid, String, String)>, ElectionError> {
        Ok(sqlx::query_as(
            "SELECT id, namespace, name FROM controller_registrations
             WHERE released_at < now() - make_interval(hours => $1) AND NOT resource_gone
               AND ($2::text IS NULL OR namespace = $2)
             ORDER BY released_at LIMIT $3",
        )
        .bind(hours as i32)
        .bind(namespace)
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .step("retention: find released registrations' resources")?)
    }

    /// The registration's resource is gone (its finalizer ran, or retention deleted it):
    /// from now on its row may be pruned.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn resource_gone(&self, id: Uuid) -> Result<(), ElectionError> {
        sqlx::query("UPDATE controller_registrations SET resource_gone = TRUE WHERE id = $1 AND NOT resource_gone")
            .bind(id)
            .execute(&self.pool)
            .await
            .step("retention: mark the resource gone")?;
        Ok(())
    }

    /// Deletes what is older than `days`: released rows whose resource is gone, election
    /// history, nudges. In batches, so no statement holds many locks for long. Returns
    /// how many rows of each went.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn prune(&self, days: u32) -> Result<Pruned, ElectionError> {
        let days = days as i32;
        let registrations = prune_batches(&self.pool, "retention: prune released registrations", || {
            sqlx::query(
                "DELETE FROM controller_registrations WHERE id IN (
                     SELECT id FROM controller_registrations
                     WHERE released_at < now() - make_interval(days => $1) AND resource_gone LIMIT 1000)",
            )
            .bind(days)
        })
        .await?;
        let projects = prune_projects(&self.pool, days).await?;
        let nudges = prune_batches(&self.pool, "retention: prune nudges", || {
            sqlx::query(
                "DELETE FROM nudges WHERE id IN (
                     SELECT id FROM nudges WHERE created_at < now() - make_interval(days => $1) LIMIT 1000)",
            )
            .bind(days)
        })
        .await?;
        // The history is append-only but for this: its trigger lets a DELETE through only
        // in a transaction that says it prunes.
        let mut history = 0;
        loop {
            let mut tx = crate::db::begin(&self.pool).await.step("retention: begin pruning history")?;
            sqlx::query("SET LOCAL prism.pruning = 'on'").execute(&mut *tx).await.step("retention: say so")?;
            let done = sqlx::query(
                "DELETE FROM controller_election_events WHERE id IN (
                     SELECT id FROM controller_election_events
                     WHERE created_at < now() - make_interval(days => $1) LIMIT 1000)",
            )
            .bind(days)
            .execute(&mut *tx)
            .await
            .step("retention: prune election history")?;
            tx.commit().await.step("retention: commit pruned history")?;
            history += done.rows_affected();
            if done.rows_affected() < 1000 {
                break;
            }
        }
        Ok(Pruned { registrations, projects, history, nudges })
    }

    /// Refreshes `last_heartbeat` of the live registrations of these (namespace,
    /// session_id) pairs in one statement (the heartbeat coalescer calls it with a whole
    /// window's sessions). Returns how many registrations it refreshed.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "election"))]
    pub async fn touch(&self, sessions: &[(String, String)]) -> Result<u64, ElectionError> {
        if sessions.is_empty() {
            return Ok(0);
        }
        let (namespaces, ids): (Vec<&str>, Vec<&str>) = sessions.iter().map(|(n, s)| (n.as_str(), s.as_str())).unzip();
        let done = sqlx::query(
            "UPDATE controller_registrations r SET last_heartbeat = now()
             FROM unnest($1::text[], $2::text[]) AS s(namespace, session_id)
             WHERE r.namespace = s.namespace AND r.session_id = s.session_id AND r.released_at IS NULL",
        )
        .bind(&namespaces)
        .bind(&ids)
        .execute(&self.pool)
        .await
        .step("heartbeat: refresh last_heartbeat")?;
        Ok(done.rows_affected())
    }
}

text_enum! {
    /// What a nudge asks of its session (SPEC §11; `nudges.kind`).
    pub enum NudgeKind {
        /// Another registration of the session took it to another project: wrap here.
        WrapSession = "wrap_session",
    }
}

/// A message to an agent session (SPEC §11 "nudges are delivered").
#[derive(Clone, Debug, PartialEq, serde::Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Nudge {
    pub id: Uuid,
    pub kind: NudgeKind,
    /// The project the nudge is about (a context switch: the project left).
    pub project_id: String,
    #[schema(value_type = Object)]
    pub payload: sqlx::types::Json<serde_json::Value>,
    pub created_at: DateTime<Utc>,
}

/// Runs a `DELETE ... LIMIT 1000` until it deletes fewer: how many it deleted in all.
pub(crate) async fn prune_batches<'q, F>(pool: &PgPool, step: &'static str, query: F) -> Result<u64, QueryError>
where
    F: Fn() -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
{
    let mut total = 0;
    loop {
        let done = query().execute(pool).await.step(step)?;
        total += done.rows_affected();
        if done.rows_affected() < 1000 {
            return Ok(total);
        }
    }
}

/// Deletes projects nothing refers to any more (no registration, no master, no unfinished
/// fenced job) and unchanged for `days`, 1,000 at a time, keeping the largest term of
/// each namespace's pruned projects as its floor: a project made again starts above
/// every term its id ever had (migration `20261206000008`). A project whose election
/// lock is held (someone registers to it) waits for the next round.
async fn prune_projects(pool: &PgPool, days: i32) -> Result<u64, QueryError> {
    let mut pruned = 0;
    loop {
        let done: i64 = sqlx::query_scalar(
            "WITH gone AS (
                 DELETE FROM controller_projects WHERE (namespace, project_id) IN (
                     SELECT q.namespace, q.project_id FROM controller_projects q
                     WHERE q.master_id IS NULL AND q.updated_at < now() - make_interval(days => $1)
                       AND NOT EXISTS (SELECT 1 FROM controller_registrations r
                                       WHERE r.namespace = q.namespace AND r.project_id = q.project_id)
                       AND NOT EXISTS (SELECT 1 FROM runtime_jobs j
                                       WHERE j.fence_namespace = q.namespace AND j.fence_project_id = q.project_id
                                         AND j.fence_term IS NOT NULL AND j.state IN ('queued','claimed','running'))
                       AND pg_try_advisory_xact_lock(controller_project_lock_key(q.namespace, q.project_id))
                     ORDER BY q.updated_at LIMIT 1000
                     FOR UPDATE SKIP LOCKED)
                 RETURNING namespace, term),
             floors AS (
                 INSERT INTO controller_term_floors AS f (namespace, term_floor)
                 SELECT namespace, max(term) FROM gone GROUP BY namespace ORDER BY namespace
                 ON CONFLICT (namespace) DO UPDATE SET term_floor = GREATEST(f.term_floor, EXCLUDED.term_floor))
             SELECT count(*) FROM gone",
        )
        .bind(days)
        .fetch_one(pool)
        .await
        .step("retention: prune projects nothing refers to")?;
        pruned += done as u64;
        if done < 1000 {
            return Ok(pruned);
        }
    }
}

/// The election as the reconcilers drive it (prism-core's store trait), over Postgres.
impl prism_core::store::Elections for ElectionStore {
    type Error = ElectionError;

    async fn get(&self, id: Uuid) -> Result<Option<Registration>, ElectionError> {
        ElectionStore::get(self, id).await
    }

    async fn register(&self, new: &NewRegistration) -> Result<RegisterOutcome, ElectionError> {
        ElectionStore::register(self, new).await
    }

    async fn project(&self, namespace: &str, project_id: &str) -> Result<ProjectView, ElectionError> {
        ElectionStore::project_gathered(self, namespace, project_id).await
    }

    async fn release(&self, id: Uuid, reason: ReleaseReason) -> Result<bool, ElectionError> {
        ElectionStore::release(self, id, reason).await
    }

    async fn resource_gone(&self, id: Uuid) -> Result<(), ElectionError> {
        ElectionStore::resource_gone(self, id).await
    }

    async fn sweep(&self, stale_minutes: u32) -> Result<usize, ElectionError> {
        ElectionStore::sweep(self, stale_minutes).await
    }

    async fn released_resources(
        &self,
        hours: u32,
        namespace: Option<&str>,
        limit: i64,
    ) -> Result<Vec<(Uuid, String, String)>, ElectionError> {
        ElectionStore::released_resources(self, hours, namespace, limit).await
    }

    async fn prune(&self, days: u32) -> Result<Pruned, ElectionError> {
        ElectionStore::prune(self, days).await
    }
}

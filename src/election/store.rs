//! The election's Postgres side: each event is one transaction that locks the project
//! (an advisory lock), reads the live candidates, applies `rules::decide` and writes registrations,
//! `controller_projects.term` and a `controller_election_events` row. A context switch is
//! two transactions (D5). Races on the partial unique indexes are retried, never surfaced.

use std::collections::{BTreeSet, HashMap};

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Postgres, Transaction};
use tracing::{debug, warn};
use uuid::Uuid;

use super::ElectionError;
use super::rules::{Candidate, Decision, Event, ProjectState, Transition, decide};
use crate::crd::{AgentSurface, ReleaseReason};

const MAX_ATTEMPTS: u32 = 8;
/// Key of the advisory lock that lets one replica at a time run the stale sweep.
const SWEEP_LOCK_KEY: i64 = 0x7072_6973_6d5f_7377; // "prism_sw"

#[derive(Clone, Debug)]
pub struct NewRegistration {
    /// The resource's metadata.uid.
    pub id: Uuid,
    pub namespace: String,
    pub name: String,
    pub project_id: String,
    pub session_id: String,
    pub surface: AgentSurface,
}

/// One row of `controller_registrations`.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct Registration {
    pub id: Uuid,
    pub namespace: String,
    pub name: String,
    pub project_id: String,
    pub session_id: String,
    pub agent_surface: String,
    pub is_master: bool,
    pub master_term: Option<i64>,
    pub registered_at: DateTime<Utc>,
    pub last_heartbeat: DateTime<Utc>,
    pub released_at: Option<DateTime<Utc>>,
    pub release_reason: Option<String>,
    pub preempted: bool,
    pub preempted_by: Option<Uuid>,
}

impl Registration {
    pub fn surface(&self) -> AgentSurface {
        // The CHECK constraint admits only known surfaces.
        self.agent_surface.parse().unwrap_or(AgentSurface::Other)
    }

    pub fn reason(&self) -> Option<ReleaseReason> {
        match self.release_reason.as_deref()? {
            "wrapped" => Some(ReleaseReason::Wrapped),
            "context_switch" => Some(ReleaseReason::ContextSwitch),
            "stale_heartbeat_incident" => Some(ReleaseReason::StaleHeartbeatIncident),
            _ => None,
        }
    }

    pub fn is_live(&self) -> bool {
        self.released_at.is_none()
    }
}

/// A resource whose status must be refreshed because an election touched it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Touched {
    pub namespace: String,
    pub name: String,
}

/// How one TXN2 attempt ended.
enum Attempt {
    Done(Box<Registration>, BTreeSet<Touched>),
    /// A row with this id exists already (the primary key said so).
    Exists,
    /// The session has a live registration (the one-live-per-session index said so).
    SessionLive,
}

/// The unique indexes whose violation by the registration insert is an answer, not a race.
const ID_INDEX: &str = "controller_registrations_pkey";
const SESSION_INDEX: &str = "controller_registrations_one_live_per_session";

#[derive(Clone, Debug)]
pub enum RegisterOutcome {
    /// Registered now, or already (idempotent): the row as it stands.
    Registered(Registration),
    /// The session already has a live registration on this project under another
    /// resource; this one is not used.
    DuplicateSession { existing: Registration },
}

/// A project's routing view.
#[derive(Clone, Debug, Default)]
pub struct ProjectView {
    pub term: i64,
    pub master: Option<Registration>,
    pub live: Vec<Registration>,
}

const COLUMNS: &str = "id, namespace, name, project_id, session_id, agent_surface, is_master, master_term, \
     registered_at, last_heartbeat, released_at, release_reason, preempted, preempted_by";

#[derive(Clone)]
pub struct ElectionStore {
    pool: PgPool,
}

impl ElectionStore {
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub async fn get(&self, id: Uuid) -> Result<Option<Registration>, ElectionError> {
        let sql = format!("SELECT {COLUMNS} FROM controller_registrations WHERE id = $1");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(id).fetch_optional(&self.pool).await?)
    }

    /// The live registration of a session, if any.
    pub async fn live_by_session(
        &self,
        namespace: &str,
        session_id: &str,
    ) -> Result<Option<Registration>, ElectionError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM controller_registrations WHERE namespace = $1 AND session_id = $2 AND released_at IS NULL"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(namespace).bind(session_id).fetch_optional(&self.pool).await?)
    }

    /// (is_master, preempted, the project's term) of a session's live registration: what a
    /// heartbeat answers, in one indexed read.
    pub async fn heartbeat_view(
        &self,
        namespace: &str,
        session_id: &str,
    ) -> Result<Option<(bool, bool, i64)>, ElectionError> {
        Ok(sqlx::query_as(
            "SELECT r.is_master, r.preempted, p.term FROM controller_registrations r
             JOIN controller_projects p ON p.namespace = r.namespace AND p.project_id = r.project_id
             WHERE r.namespace = $1 AND r.session_id = $2 AND r.released_at IS NULL",
        )
        .bind(namespace)
        .bind(session_id)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Term, master and live registrations of a project (master first, then by succession),
    /// in one read when the project has live registrations.
    pub async fn project(&self, namespace: &str, project_id: &str) -> Result<ProjectView, ElectionError> {
        #[derive(sqlx::FromRow)]
        struct Live {
            #[sqlx(flatten)]
            row: Registration,
            term: i64,
        }
        let sql = format!(
            "SELECT {COLUMNS}, (SELECT term FROM controller_projects p WHERE p.namespace = $1 AND p.project_id = $2) AS term
             FROM controller_registrations
             WHERE namespace = $1 AND project_id = $2 AND released_at IS NULL
             ORDER BY is_master DESC, (agent_surface = 'claude_desktop') DESC, registered_at, id"
        );
        let rows: Vec<Live> =
            sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(namespace).bind(project_id).fetch_all(&self.pool).await?;
        let term = match rows.first() {
            Some(r) => r.term,
            None => sqlx::query_scalar("SELECT term FROM controller_projects WHERE namespace = $1 AND project_id = $2")
                .bind(namespace)
                .bind(project_id)
                .fetch_optional(&self.pool)
                .await?
                .unwrap_or(0),
        };
        let live: Vec<Registration> = rows.into_iter().map(|r| r.row).collect();
        let master = live.iter().find(|r| r.is_master).cloned();
        Ok(ProjectView { term, master, live })
    }

    /// Registrations of a project released by the stale sweep since `since`.
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
            .await?)
    }

    /// Registers (rules 1-4, 6) and, when the session is live on another project, first
    /// leaves that one (rule 7: TXN1 release + nudge, TXN2 election). Idempotent: a known
    /// id returns its row as it stands. Callers that usually find the row already (a
    /// periodic reconcile) should `get` it first, which takes no lock.
    pub async fn register(&self, new: &NewRegistration) -> Result<(RegisterOutcome, BTreeSet<Touched>), ElectionError> {
        let mut touched = BTreeSet::new();
        for attempt in 1..=MAX_ATTEMPTS {
            match self.register_once(new).await {
                Ok(Attempt::Done(row, t)) => {
                    touched.extend(t);
                    return Ok((RegisterOutcome::Registered(*row), touched));
                }
                // Inserted before (or by a concurrent caller: API and reconciler race).
                Ok(Attempt::Exists) => {
                    if let Some(existing) = self.get(new.id).await? {
                        return Ok((RegisterOutcome::Registered(existing), touched));
                    }
                }
                Ok(Attempt::SessionLive) => match self.live_by_session(&new.namespace, &new.session_id).await? {
                    // Rule 6 under another resource: that one stands.
                    Some(existing) if existing.project_id == new.project_id => {
                        return Ok((RegisterOutcome::DuplicateSession { existing }, touched));
                    }
                    // TXN1 (D5): the session is live on another project; leave it, then elect.
                    Some(other) => match self.release_once(other.id, ReleaseReason::ContextSwitch).await {
                        Ok(t) => touched.extend(t),
                        Err(ElectionError::Database(e)) if ElectionError::is_race(&e) => continue,
                        Err(e) => return Err(e),
                    },
                    // Released in the meantime: try again.
                    None => continue,
                },
                Err(ElectionError::Database(e)) if ElectionError::is_race(&e) => {
                    debug!(attempt, error = %e, "lost a registration race; retrying")
                }
                Err(e) => return Err(e),
            }
        }
        Err(ElectionError::Contended(MAX_ATTEMPTS))
    }

    /// TXN2: one election on the new project. The common case, a peer joining a project
    /// that has a master, is decided on the master alone (`rules` proves that enough),
    /// read by primary keys (the project row names its master): lock, one read, insert,
    /// commit. Only when the decision changes the master does it read the whole project,
    /// because then every registration's status changes. Whether the id is known or the
    /// session is live elsewhere, the insert learns from the unique indexes.
    async fn register_once(&self, new: &NewRegistration) -> Result<Attempt, ElectionError> {
        let mut tx = self.pool.begin().await?;
        lock_project(&mut tx, &new.namespace, &new.project_id).await?;
        let head: Option<ProjectHead> = sqlx::query_as(
            "SELECT p.term, clock_timestamp() AS now,
                    r.id, r.name, r.agent_surface, r.registered_at, r.is_master
             FROM controller_projects p
             LEFT JOIN controller_registrations r ON r.id = p.master_id AND r.is_master AND r.released_at IS NULL
             WHERE p.namespace = $1 AND p.project_id = $2",
        )
        .bind(&new.namespace)
        .bind(&new.project_id)
        .fetch_optional(&mut *tx)
        .await?;
        // Registration times follow the order in which the lock was granted (`now` is read
        // after it).
        let elect = |term: i64, now: DateTime<Utc>, rows: &[Row]| {
            let (state, names) = project_state(term, rows);
            let candidate = Candidate { id: new.id, surface: new.surface, registered_at: now, is_master: false };
            let decision = decide(&state, &Event::Register(candidate));
            (state, names, decision, now)
        };
        let fast = head
            .and_then(|head| Some(elect(head.term, head.now, &[head.master.into_row()?])))
            .filter(|(_, _, decision, _)| decision.master_change.is_none());
        let (state, mut names, decision, now) = match fast {
            Some(decided) => decided,
            // A new master (or no project row yet): read the whole project (its term,
            // creating its row on first use, and every live registration, whose
            // status.master changes).
            None => {
                let (term, now) = project_row(&mut tx, &new.namespace, &new.project_id).await?;
                elect(term, now, &read_rows(&mut tx, &new.namespace, &new.project_id).await?)
            }
        };
        names.insert(new.id, new.name.clone());
        let inserted = sqlx::query(
            "INSERT INTO controller_registrations
                 (id, namespace, name, project_id, session_id, agent_surface, registered_at, last_heartbeat)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $7)",
        )
        .bind(new.id)
        .bind(&new.namespace)
        .bind(&new.name)
        .bind(&new.project_id)
        .bind(&new.session_id)
        .bind(new.surface.as_str())
        .bind(now)
        .execute(&mut *tx)
        .await;
        if let Err(sqlx::Error::Database(e)) = &inserted {
            match e.constraint() {
                Some(ID_INDEX) => return Ok(Attempt::Exists),
                Some(SESSION_INDEX) => return Ok(Attempt::SessionLive),
                _ => {}
            }
        }
        inserted?;
        // The newcomer's own status follows from its own reconcile (its creation is a
        // watch event), so only the others are announced.
        let touched = apply(&mut tx, &new.namespace, &new.project_id, &state, &decision, &names, Some(new.id)).await?;
        tx.commit().await?;
        let is_master = decision.next.master().is_some_and(|m| m.id == new.id);
        let row = Registration {
            id: new.id,
            namespace: new.namespace.clone(),
            name: new.name.clone(),
            project_id: new.project_id.clone(),
            session_id: new.session_id.clone(),
            agent_surface: new.surface.as_str().to_string(),
            is_master,
            master_term: is_master.then_some(decision.next.term),
            registered_at: now,
            last_heartbeat: now,
            released_at: None,
            release_reason: None,
            preempted: false,
            preempted_by: None,
        };
        let mut touched = touched;
        touched.insert(Touched { namespace: new.namespace.clone(), name: new.name.clone() });
        Ok(Attempt::Done(Box::new(row), touched))
    }

    /// Releases a registration (wrap, context switch) and promotes a successor if it was
    /// master. Releasing an unknown or already released registration changes nothing.
    pub async fn release(&self, id: Uuid, reason: ReleaseReason) -> Result<BTreeSet<Touched>, ElectionError> {
        for attempt in 1..=MAX_ATTEMPTS {
            match self.release_once(id, reason).await {
                Err(ElectionError::Database(e)) if ElectionError::is_race(&e) => {
                    debug!(attempt, error = %e, "lost a release race; retrying")
                }
                other => return other,
            }
        }
        Err(ElectionError::Contended(MAX_ATTEMPTS))
    }

    async fn release_once(&self, id: Uuid, reason: ReleaseReason) -> Result<BTreeSet<Touched>, ElectionError> {
        let Some(row) = self.get(id).await? else {
            return Ok(BTreeSet::new());
        };
        if !row.is_live() {
            return Ok(BTreeSet::new());
        }
        let mut tx = self.pool.begin().await?;
        let (state, names) = lock_and_read(&mut tx, &row.namespace, &row.project_id).await?;
        let decision = decide(&state, &Event::Release { ids: vec![id], reason });
        let touched = apply(&mut tx, &row.namespace, &row.project_id, &state, &decision, &names, None).await?;
        if reason == ReleaseReason::ContextSwitch && !decision.transitions.is_empty() {
            write_wrap_nudge(&mut tx, &row).await?;
        }
        tx.commit().await?;
        Ok(touched)
    }

    /// Releases live registrations whose heartbeat is older than `stale_minutes`
    /// (`stale_heartbeat_incident`), promoting successors. One replica at a time.
    pub async fn sweep(&self, stale_minutes: u32) -> Result<BTreeSet<Touched>, ElectionError> {
        let mut touched = BTreeSet::new();
        let mut lock_conn = self.pool.acquire().await?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(SWEEP_LOCK_KEY)
            .fetch_one(&mut *lock_conn)
            .await?;
        if !locked {
            debug!("another replica is sweeping");
            return Ok(touched);
        }
        let result = self.sweep_locked(stale_minutes, &mut touched).await;
        let _ = sqlx::query("SELECT pg_advisory_unlock($1)").bind(SWEEP_LOCK_KEY).execute(&mut *lock_conn).await;
        result.map(|()| touched)
    }

    async fn sweep_locked(&self, stale_minutes: u32, touched: &mut BTreeSet<Touched>) -> Result<(), ElectionError> {
        let projects: Vec<(String, String)> = sqlx::query_as(
            "SELECT DISTINCT namespace, project_id FROM controller_registrations
             WHERE released_at IS NULL AND last_heartbeat < now() - make_interval(mins => $1)",
        )
        .bind(stale_minutes as i32)
        .fetch_all(&self.pool)
        .await?;
        for (namespace, project_id) in projects {
            for attempt in 1..=MAX_ATTEMPTS {
                match self.sweep_project(&namespace, &project_id, stale_minutes).await {
                    Ok(t) => {
                        touched.extend(t);
                        break;
                    }
                    Err(ElectionError::Database(e)) if ElectionError::is_race(&e) && attempt < MAX_ATTEMPTS => {
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    async fn sweep_project(
        &self,
        namespace: &str,
        project_id: &str,
        stale_minutes: u32,
    ) -> Result<BTreeSet<Touched>, ElectionError> {
        let mut tx = self.pool.begin().await?;
        let (state, names) = lock_and_read(&mut tx, namespace, project_id).await?;
        // Re-read under the lock: a heartbeat may have arrived since the scan.
        let stale: Vec<Uuid> = sqlx::query_scalar(
            "SELECT id FROM controller_registrations
             WHERE namespace = $1 AND project_id = $2 AND released_at IS NULL
               AND last_heartbeat < now() - make_interval(mins => $3)",
        )
        .bind(namespace)
        .bind(project_id)
        .bind(stale_minutes as i32)
        .fetch_all(&mut *tx)
        .await?;
        if stale.is_empty() {
            return Ok(BTreeSet::new());
        }
        let decision = decide(&state, &Event::Release { ids: stale, reason: ReleaseReason::StaleHeartbeatIncident });
        let touched = apply(&mut tx, namespace, project_id, &state, &decision, &names, None).await?;
        tx.commit().await?;
        Ok(touched)
    }

    /// Refreshes `last_heartbeat` of the live registrations of these sessions in one
    /// statement (the heartbeat coalescer calls it with a whole window's sessions).
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
        .await?;
        Ok(done.rows_affected())
    }
}

/// Serialises every election event of one project (all writers take it): a
/// transaction-scoped advisory lock, so no tuple is written to take it and it is released
/// by commit or rollback, whatever happens to the connection.
async fn lock_project(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
) -> Result<(), ElectionError> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1 || '/' || $2, 0))")
        .bind(namespace)
        .bind(project_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The project's term (creating its row on first use) and the time now, read after the
/// lock, so registration times follow the order in which the lock was granted.
async fn project_row(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
) -> Result<(i64, DateTime<Utc>), ElectionError> {
    const READ: &str =
        "SELECT term, clock_timestamp() FROM controller_projects WHERE namespace = $1 AND project_id = $2";
    if let Some(found) = sqlx::query_as(READ).bind(namespace).bind(project_id).fetch_optional(&mut **tx).await? {
        return Ok(found);
    }
    sqlx::query("INSERT INTO controller_projects (namespace, project_id) VALUES ($1, $2) ON CONFLICT DO NOTHING")
        .bind(namespace)
        .bind(project_id)
        .execute(&mut **tx)
        .await?;
    Ok(sqlx::query_as(READ).bind(namespace).bind(project_id).fetch_one(&mut **tx).await?)
}

/// A live registration of the project, as the election reads it.
#[derive(sqlx::FromRow)]
struct Row {
    id: Uuid,
    name: String,
    agent_surface: String,
    registered_at: DateTime<Utc>,
    is_master: bool,
}

/// What a registration reads in one statement: the project's term, the time the lock
/// was held, and its live master if it has one (all columns NULL otherwise).
#[derive(sqlx::FromRow)]
struct ProjectHead {
    term: i64,
    now: DateTime<Utc>,
    #[sqlx(flatten)]
    master: MaybeRow,
}

#[derive(sqlx::FromRow)]
struct MaybeRow {
    id: Option<Uuid>,
    name: Option<String>,
    agent_surface: Option<String>,
    registered_at: Option<DateTime<Utc>>,
    is_master: Option<bool>,
}

impl MaybeRow {
    fn into_row(self) -> Option<Row> {
        Some(Row {
            id: self.id?,
            name: self.name?,
            agent_surface: self.agent_surface?,
            registered_at: self.registered_at?,
            is_master: self.is_master?,
        })
    }
}

/// The project's live rows.
async fn read_rows(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
) -> Result<Vec<Row>, ElectionError> {
    Ok(sqlx::query_as(
        "SELECT id, name, agent_surface, registered_at, is_master
         FROM controller_registrations
         WHERE namespace = $1 AND project_id = $2 AND released_at IS NULL",
    )
    .bind(namespace)
    .bind(project_id)
    .fetch_all(&mut **tx)
    .await?)
}

fn project_state(term: i64, rows: &[Row]) -> (ProjectState, HashMap<Uuid, String>) {
    let names = rows.iter().map(|r| (r.id, r.name.clone())).collect();
    let live = rows
        .iter()
        .map(|r| Candidate {
            id: r.id,
            surface: r.agent_surface.parse().unwrap_or(AgentSurface::Other),
            registered_at: r.registered_at,
            is_master: r.is_master,
        })
        .collect();
    (ProjectState { term, live }, names)
}

/// Locks the project and reads its term and live candidates (and their names).
async fn lock_and_read(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
) -> Result<(ProjectState, HashMap<Uuid, String>), ElectionError> {
    lock_project(tx, namespace, project_id).await?;
    let (term, _) = project_row(tx, namespace, project_id).await?;
    let rows = read_rows(tx, namespace, project_id).await?;
    Ok(project_state(term, &rows))
}

/// Writes a decision: role changes in order (demotions and releases before promotions),
/// the project's term and master, and the election history. Returns the resources whose
/// status changed: on a change of master, every registration of the project (their
/// `status.master` changed); otherwise only those whose role changed.
async fn apply(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
    before: &ProjectState,
    decision: &Decision,
    names: &HashMap<Uuid, String>,
    already_notified: Option<Uuid>,
) -> Result<BTreeSet<Touched>, ElectionError> {
    let term = decision.next.term;
    for (id, transition) in &decision.transitions {
        match transition {
            Transition::Released { reason, .. } => {
                sqlx::query(
                    "UPDATE controller_registrations SET is_master = FALSE, released_at = now(), release_reason = $2 WHERE id = $1",
                )
                .bind(id)
                .bind(release_reason_str(*reason))
                .execute(&mut **tx)
                .await?;
            }
            Transition::Preempted { by } => {
                sqlx::query(
                    "UPDATE controller_registrations
                     SET is_master = FALSE, preempted = TRUE, preempted_by = $2, preempted_at = now() WHERE id = $1",
                )
                .bind(id)
                .bind(by)
                .execute(&mut **tx)
                .await?;
            }
            Transition::Promoted | Transition::JoinedAsMaster => {
                sqlx::query("UPDATE controller_registrations SET is_master = TRUE, master_term = $2 WHERE id = $1")
                    .bind(id)
                    .bind(term)
                    .execute(&mut **tx)
                    .await?;
            }
            Transition::JoinedAsPeer => {}
        }
    }
    let mut affected: BTreeSet<Uuid> = decision.transitions.iter().map(|(id, _)| *id).collect();
    if let Some(change) = &decision.master_change {
        sqlx::query(
            "UPDATE controller_projects SET term = $3, master_id = $4, updated_at = now()
             WHERE namespace = $1 AND project_id = $2",
        )
        .bind(namespace)
        .bind(project_id)
        .bind(term)
        .bind(change.master)
        .execute(&mut **tx)
        .await?;
        sqlx::query(
            "INSERT INTO controller_election_events (namespace, project_id, term, master_id, previous_master_id, cause)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(namespace)
        .bind(project_id)
        .bind(term)
        .bind(change.master)
        .bind(change.previous)
        .bind(change.cause.as_str())
        .execute(&mut **tx)
        .await?;
        affected.extend(before.live.iter().map(|c| c.id));
        affected.extend(decision.next.live.iter().map(|c| c.id));
    }
    let touched: BTreeSet<Touched> = affected
        .iter()
        .filter_map(|id| names.get(id))
        .map(|name| Touched { namespace: namespace.to_string(), name: name.clone() })
        .collect();
    // Delivered at commit to the leader replica, whichever replica made the change.
    let payloads: Vec<String> = affected
        .iter()
        .filter(|id| Some(**id) != already_notified)
        .filter_map(|id| names.get(id))
        .map(|name| format!("{namespace}/{name}"))
        .collect();
    if !payloads.is_empty() {
        sqlx::query("SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p")
            .bind(crate::reconcilers::NOTIFY_REGISTRATIONS)
            .bind(&payloads)
            .execute(&mut **tx)
            .await?;
    }
    Ok(touched)
}

/// D5: context switch tells the old session to wrap. A missing `nudges` table must not
/// undo the release: the insert runs in a savepoint and its failure is only logged.
async fn write_wrap_nudge(tx: &mut Transaction<'_, Postgres>, row: &Registration) -> Result<(), ElectionError> {
    sqlx::query("SAVEPOINT wrap_nudge").execute(&mut **tx).await?;
    let insert = sqlx::query(
        "INSERT INTO nudges (namespace, session_id, project_id, kind, payload)
         VALUES ($1, $2, $3, 'wrap_session', jsonb_build_object('reason', 'context_switch', 'registration', $4::text))",
    )
    .bind(&row.namespace)
    .bind(&row.session_id)
    .bind(&row.project_id)
    .bind(row.name.as_str())
    .execute(&mut **tx)
    .await;
    match insert {
        Ok(_) => {
            sqlx::query("RELEASE SAVEPOINT wrap_nudge").execute(&mut **tx).await?;
        }
        Err(e) => {
            warn!(namespace = %row.namespace, project = %row.project_id, error = %e,
                  "could not write the wrap_session nudge; the context switch release stands");
            sqlx::query("ROLLBACK TO SAVEPOINT wrap_nudge").execute(&mut **tx).await?;
        }
    }
    Ok(())
}

pub fn release_reason_str(reason: ReleaseReason) -> &'static str {
    match reason {
        ReleaseReason::Wrapped => "wrapped",
        ReleaseReason::ContextSwitch => "context_switch",
        ReleaseReason::StaleHeartbeatIncident => "stale_heartbeat_incident",
    }
}

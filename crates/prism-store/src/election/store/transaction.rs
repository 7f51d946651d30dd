//! The statements one election transaction is made of: the project's lock, what the
//! election reads under it, and how a decision is written and announced. `store` puts
//! them together into registrations, releases and sweeps.

use std::collections::{BTreeSet, HashMap};

use chrono::{DateTime, Utc};
use sqlx::{Postgres, Transaction};
use tracing::warn;
use uuid::Uuid;

use super::{ElectionError, NewRegistration, Quota, Registration};
use crate::db::{QueryError, Step};
use crate::refresh::{self, NamespacedName};
use prism_core::election::AgentSurface;
use prism_core::election::{Candidate, Decision, Event, MasterChange, ProjectState, Transition, decide};

/// Serialises every election event of one project (all writers take it): a
/// transaction-scoped advisory lock, so no tuple is written to take it and it is released
/// by commit or rollback, whatever happens to the connection.
pub(super) async fn lock_project(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
) -> Result<(), QueryError> {
    sqlx::query("SELECT pg_advisory_xact_lock(controller_project_lock_key($1, $2))")
        .bind(namespace)
        .bind(project_id)
        .execute(&mut **tx)
        .await
        .step("lock the project")?;
    Ok(())
}

/// The exact per-owner quota: the owner's registrations are counted under a lock of the
/// owner's (taken after the project locks, always in that order), so two concurrent
/// registrations of one owner cannot both take its last slot.
/// The session's own live registration is not counted: moving it (a context switch)
/// adds no session.
pub(super) async fn check_owner_quota(
    tx: &mut Transaction<'_, Postgres>,
    owner: &str,
    new: &NewRegistration,
    max: u32,
) -> Result<(), ElectionError> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('owner/' || $1, 0))")
        .bind(owner)
        .execute(&mut **tx)
        .await
        .step("quota: lock the owner")?;
    // Counted up to the quota, not every live registration of the owner.
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM controller_registrations
                                WHERE owner = $1 AND released_at IS NULL AND NOT (namespace = $2 AND session_id = $3)
                                LIMIT $4) AS held",
    )
    .bind(owner)
    .bind(&new.namespace)
    .bind(&new.session_id)
    .bind(i64::from(max))
    .fetch_one(&mut **tx)
    .await
    .step("quota: count the owner's live registrations")?;
    if held >= i64::from(max) {
        return Err(ElectionError::QuotaExceeded(Quota::Owner(max)));
    }
    Ok(())
}

/// The project's term (creating its row on first use) and the time now, read after the
/// lock, so registration times follow the order in which the lock was granted.
pub(super) async fn project_row(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
) -> Result<(i64, DateTime<Utc>), QueryError> {
    const READ: &str =
        "SELECT term, clock_timestamp() FROM controller_projects WHERE namespace = $1 AND project_id = $2";
    let found = sqlx::query_as(READ)
        .bind(namespace)
        .bind(project_id)
        .fetch_optional(&mut **tx)
        .await
        .step("read the project's term")?;
    if let Some(found) = found {
        return Ok(found);
    }
    sqlx::query("INSERT INTO controller_projects (namespace, project_id) VALUES ($1, $2) ON CONFLICT DO NOTHING")
        .bind(namespace)
        .bind(project_id)
        .execute(&mut **tx)
        .await
        .step("create the project")?;
    sqlx::query_as(READ).bind(namespace).bind(project_id).fetch_one(&mut **tx).await.step("read the new project's term")
}

/// A live registration of the project, as the election reads it.
#[derive(sqlx::FromRow)]
pub(super) struct CandidateRow {
    id: Uuid,
    name: String,
    agent_surface: AgentSurface,
    registered_at: DateTime<Utc>,
    is_master: bool,
}

/// The project's live rows.
pub(super) async fn read_candidates(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
) -> Result<Vec<CandidateRow>, QueryError> {
    // In the order of controller_registrations_live_by_project, which then gives it with
    // no sort: the plan reads this project's rows whatever the statistics say. Without
    // it a plan cached while the table was small read the namespace's whole live set
    // through the session index (the election bench: 58 entries per registration).
    sqlx::query_as(
        "SELECT id, name, agent_surface, registered_at, is_master
         FROM controller_registrations
         WHERE namespace = $1 AND project_id = $2 AND released_at IS NULL
         ORDER BY registered_at",
    )
    .bind(namespace)
    .bind(project_id)
    .fetch_all(&mut **tx)
    .await
    .step("read the project's candidates")
}

/// What a registration reads first, in one statement by primary keys (the project row
/// names its master): the term, the time the lock was granted, and the live master if
/// there is one (its columns are all NULL otherwise).
#[derive(sqlx::FromRow)]
pub(super) struct ProjectHead {
    term: i64,
    now: DateTime<Utc>,
    master_id: Option<Uuid>,
    master_name: Option<String>,
    master_surface: Option<AgentSurface>,
    master_registered_at: Option<DateTime<Utc>>,
}

impl ProjectHead {
    fn master(&self) -> Option<CandidateRow> {
        Some(CandidateRow {
            id: self.master_id?,
            name: self.master_name.clone()?,
            agent_surface: self.master_surface?,
            registered_at: self.master_registered_at?,
            is_master: true,
        })
    }
}

/// Takes the project's lock and reads its head in one round trip (migration
/// `20261207000001`: a function's queries see what was committed before the lock was
/// granted, which one statement's snapshot would not). None: the project has no row yet.
pub(super) async fn lock_and_read_head(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
) -> Result<Option<ProjectHead>, QueryError> {
    sqlx::query_as(
        "SELECT term, now, master_id, master_name, master_surface, master_registered_at
         FROM controller_lock_project_head($1, $2)",
    )
    .bind(namespace)
    .bind(project_id)
    .fetch_optional(&mut **tx)
    .await
    .step("register: lock the project, read it and its master")
}

pub(super) fn project_state(term: i64, rows: &[CandidateRow]) -> (ProjectState, HashMap<Uuid, String>) {
    let names = rows.iter().map(|r| (r.id, r.name.clone())).collect();
    let live = rows
        .iter()
        .map(|r| Candidate {
            id: r.id,
            surface: r.agent_surface,
            registered_at: r.registered_at,
            is_master: r.is_master,
        })
        .collect();
    (ProjectState { term, live }, names)
}

/// Locks the project and reads its term and live candidates (and their names).
pub(super) async fn lock_and_read(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
) -> Result<(ProjectState, HashMap<Uuid, String>), QueryError> {
    lock_project(tx, namespace, project_id).await?;
    let (term, _) = project_row(tx, namespace, project_id).await?;
    let rows = read_candidates(tx, namespace, project_id).await?;
    Ok(project_state(term, &rows))
}

/// The election of one newcomer, decided before anything is written.
pub(super) struct RegistrationPlan {
    pub(super) before: ProjectState,
    pub(super) names: HashMap<Uuid, String>,
    pub(super) decision: Decision,
    /// Read after the lock was granted: the newcomer's registration time.
    pub(super) now: DateTime<Utc>,
}

impl RegistrationPlan {
    fn new(term: i64, now: DateTime<Utc>, rows: &[CandidateRow], new: &NewRegistration) -> Self {
        let (before, mut names) = project_state(term, rows);
        names.insert(new.id, new.name.clone());
        let candidate = Candidate { id: new.id, surface: new.surface, registered_at: now, is_master: false };
        let decision = decide(&before, &Event::Register(candidate));
        Self { before, names, decision, now }
    }

    /// The newcomer's row as the decision wrote it.
    pub(super) fn newcomer_row(&self, new: &NewRegistration) -> Registration {
        let is_master = self.decision.next.master().is_some_and(|m| m.id == new.id);
        Registration {
            id: new.id,
            namespace: new.namespace.clone(),
            name: new.name.clone(),
            project_id: new.project_id.clone(),
            session_id: new.session_id.clone(),
            agent_surface: new.surface,
            is_master,
            master_term: is_master.then_some(self.decision.next.term),
            registered_at: self.now,
            last_heartbeat: self.now,
            released_at: None,
            release_reason: None,
            preempted: false,
            preempted_by: None,
        }
    }
}

/// Decides the newcomer's election. The common case, a peer joining a project that has a
/// master, is decided on the master alone (`rules` proves that this is enough) from one
/// read by primary keys. Only when the decision changes the master is the whole project
/// read, because then every registration's status changes.
pub(super) async fn plan_registration(
    tx: &mut Transaction<'_, Postgres>,
    new: &NewRegistration,
) -> Result<RegistrationPlan, QueryError> {
    if let Some(head) = lock_and_read_head(tx, &new.namespace, &new.project_id).await?
        && let Some(master) = head.master()
    {
        let plan = RegistrationPlan::new(head.term, head.now, &[master], new);
        if plan.decision.master_change.is_none() {
            return Ok(plan);
        }
    }
    let (term, now) = project_row(tx, &new.namespace, &new.project_id).await?;
    let rows = read_candidates(tx, &new.namespace, &new.project_id).await?;
    Ok(RegistrationPlan::new(term, now, &rows, new))
}

/// Writes a decision: the role changes, the change of master (if any), and the refresh
/// signal for every resource whose status changed (except `announced`, which will
/// refresh anyway).
pub(super) async fn write_decision(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
    before: &ProjectState,
    decision: &Decision,
    names: &HashMap<Uuid, String>,
    announced: Option<Uuid>,
) -> Result<(), QueryError> {
    write_transitions(tx, decision).await?;
    if let Some(change) = &decision.master_change {
        record_master_change(tx, namespace, project_id, decision.next.term, change).await?;
    }
    let changed = changed_names(namespace, before, decision, names, announced);
    announce_changes(tx, namespace, project_id, &changed, None).await
}

/// The resources whose status `decision` changes, but `announced`.
fn changed_names(
    namespace: &str,
    before: &ProjectState,
    decision: &Decision,
    names: &HashMap<Uuid, String>,
    announced: Option<Uuid>,
) -> Vec<NamespacedName> {
    status_changed(before, decision)
        .into_iter()
        .filter(|id| Some(*id) != announced)
        .filter_map(|id| names.get(&id))
        .map(|name| NamespacedName::new(namespace, name.as_str()))
        .collect()
}

/// Writes the newcomer's row and its election's decision (`announced`: as
/// `write_decision`): the row, the routing change and the status signals in one
/// statement, then any role changes and change of master. The row is written as a peer:
/// a master it preempts names it (`preempted_by`) before stepping down, and only then
/// may it be master (the single-master index); its own promotion is one of the role
/// changes. A peer joining — most registrations — is the one statement alone.
pub(super) async fn write_registration(
    tx: &mut Transaction<'_, Postgres>,
    new: &NewRegistration,
    plan: &RegistrationPlan,
    announced: Option<Uuid>,
) -> Result<(), QueryError> {
    let decision = &plan.decision;
    let changed = changed_names(&new.namespace, &plan.before, decision, &plan.names, announced);
    let peer = Registration { is_master: false, master_term: None, ..plan.newcomer_row(new) };
    announce_changes(tx, &new.namespace, &new.project_id, &changed, Some((&peer, new.owner.as_deref()))).await?;
    write_transitions(tx, decision).await?;
    if let Some(change) = &decision.master_change {
        record_master_change(tx, &new.namespace, &new.project_id, decision.next.term, change).await?;
    }
    Ok(())
}

/// Every decision written changes the project's routing table: its change count moves
/// on, and every replica's watches of it are told at commit (SPEC §11); with the refresh
/// signals of `changed`, and a newcomer's row first if given, in one statement (one round
/// trip where there were up to three).
async fn announce_changes(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
    changed: &[NamespacedName],
    newcomer: Option<(&Registration, Option<&str>)>,
) -> Result<(), QueryError> {
    macro_rules! announce {
        () => {
            "bumped AS (
                 UPDATE controller_projects SET routing_seq = routing_seq + 1
                  WHERE namespace = $1 AND project_id = $2 RETURNING 1)
             SELECT pg_notify($3, json_build_object('namespace', $1::text, 'project_id', $2::text)::text) FROM bumped
             UNION ALL SELECT pg_notify($4, p) FROM unnest($5::text[]) AS p"
        };
    }
    let payloads = refresh::payloads(changed);
    let Some((row, owner)) = newcomer else {
        sqlx::query(concat!("WITH ", announce!()))
            .bind(namespace)
            .bind(project_id)
            .bind(crate::signals::PROJECTS)
            .bind(refresh::Kind::Registration.channel())
            .bind(&payloads)
            .execute(&mut **tx)
            .await
            .step("announce the change")?;
        return Ok(());
    };
    // Written whether or not the query reads it (a data-modifying WITH always runs); a
    // violated unique index names itself as the separate insert's did (`Attempt`).
    sqlx::query(concat!(
        "WITH inserted AS (
             INSERT INTO controller_registrations (id, namespace, name, project_id, session_id, agent_surface,
                                                   registered_at, last_heartbeat, owner, is_master, master_term)
             VALUES ($6, $1, $7, $2, $8, $9, $10, $10, $11, $12, $13)),
         ",
        announce!()
    ))
    .bind(namespace)
    .bind(project_id)
    .bind(crate::signals::PROJECTS)
    .bind(refresh::Kind::Registration.channel())
    .bind(&payloads)
    .bind(row.id)
    .bind(&row.name)
    .bind(&row.session_id)
    .bind(row.agent_surface)
    .bind(row.registered_at)
    .bind(owner)
    .bind(row.is_master)
    .bind(row.master_term)
    .execute(&mut **tx)
    .await
    .step("register: insert registration, announce the change")?;
    Ok(())
}

/// Role changes in the decision's order (demotions and releases before promotions, so the
/// single-master index is never violated).
async fn write_transitions(tx: &mut Transaction<'_, Postgres>, decision: &Decision) -> Result<(), QueryError> {
    for (id, transition) in &decision.transitions {
        let update = match transition {
            Transition::Released { reason, .. } => sqlx::query(
                "UPDATE controller_registrations SET is_master = FALSE, released_at = now(), release_reason = $2 WHERE id = $1",
            )
            .bind(id)
            .bind(reason),
            Transition::Preempted { by } => sqlx::query(
                "UPDATE controller_registrations
                 SET is_master = FALSE, preempted = TRUE, preempted_by = $2, preempted_at = now() WHERE id = $1",
            )
            .bind(id)
            .bind(by),
            Transition::Promoted | Transition::JoinedAsMaster => {
                sqlx::query("UPDATE controller_registrations SET is_master = TRUE, master_term = $2 WHERE id = $1")
                    .bind(id)
                    .bind(decision.next.term)
            }
            Transition::JoinedAsPeer => continue,
        };
        update.execute(&mut **tx).await.step("write a change of role")?;
    }
    Ok(())
}

/// The project's new term and master, and one row of election history.
pub(super) async fn record_master_change(
    tx: &mut Transaction<'_, Postgres>,
    namespace: &str,
    project_id: &str,
    term: i64,
    change: &MasterChange,
) -> Result<(), QueryError> {
    sqlx::query(
        "UPDATE controller_projects SET term = $3, master_id = $4, updated_at = now()
         WHERE namespace = $1 AND project_id = $2",
    )
    .bind(namespace)
    .bind(project_id)
    .bind(term)
    .bind(change.master)
    .execute(&mut **tx)
    .await
    .step("record the project's master")?;
    sqlx::query(
        "INSERT INTO controller_election_events (namespace, project_id, term, master_id, previous_master_id, cause)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(namespace)
    .bind(project_id)
    .bind(term)
    .bind(change.master)
    .bind(change.previous)
    .bind(change.cause)
    .execute(&mut **tx)
    .await
    .step("append to the election history")?;
    Ok(())
}

/// The registrations whose status a decision changes: on a change of master, every
/// registration of the project (their `status.master` changed); otherwise only those
/// whose role changed.
pub(super) fn status_changed(before: &ProjectState, decision: &Decision) -> BTreeSet<Uuid> {
    let mut changed: BTreeSet<Uuid> = decision.transitions.iter().map(|(id, _)| *id).collect();
    if decision.master_change.is_some() {
        changed.extend(before.live.iter().map(|c| c.id));
        changed.extend(decision.next.live.iter().map(|c| c.id));
    }
    changed
}

/// A context switch tells the old session to wrap (SPEC §4 rule 7). A missing `nudges`
/// table must not undo the release: the insert runs in a savepoint and its failure is
/// only logged.
pub(super) async fn write_wrap_nudge(tx: &mut Transaction<'_, Postgres>, row: &Registration) -> Result<(), QueryError> {
    sqlx::query("SAVEPOINT wrap_nudge").execute(&mut **tx).await.step("context switch: savepoint")?;
    // Every replica hears of it at commit (`signals`): the session's next answer there
    // carries it, and no answer reads the table for a session with none.
    let insert = sqlx::query(
        "WITH nudged AS (
             INSERT INTO nudges (namespace, session_id, project_id, kind, payload)
             VALUES ($1, $2, $3, 'wrap_session', jsonb_build_object('reason', 'context_switch', 'registration', $4::text))
             RETURNING namespace, session_id)
         SELECT pg_notify($5, json_build_object('namespace', namespace, 'session_id', session_id)::text) FROM nudged",
    )
    .bind(&row.namespace)
    .bind(&row.session_id)
    .bind(&row.project_id)
    .bind(row.name.as_str())
    .bind(crate::signals::NUDGES)
    .execute(&mut **tx)
    .await;
    match insert {
        Ok(_) => {
            sqlx::query("RELEASE SAVEPOINT wrap_nudge")
                .execute(&mut **tx)
                .await
                .step("context switch: release savepoint")?;
        }
        Err(error) => {
            warn!(namespace = %row.namespace, project = %row.project_id, %error,
                  "could not write the wrap_session nudge; the context switch release stands");
            sqlx::query("ROLLBACK TO SAVEPOINT wrap_nudge")
                .execute(&mut **tx)
                .await
                .step("context switch: roll back to savepoint")?;
        }
    }
    Ok(())
}

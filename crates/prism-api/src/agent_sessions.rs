//! What AI agent sessions ask for, as a service over the election: register (create the
//! ControllerRegistration on the agent's behalf and run the election in the same call),
//! release, heartbeat, read the routing table, fence. The HTTP layer parses and
//! authorizes; this layer does the work.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, Client, ResourceExt};
use serde::Serialize;
use serde_json::json;
use tracing::warn;
use uuid::Uuid;

use crate::crd::{
    AgentSurface, ControllerRegistration, ControllerRegistrationSpec, OWNER_ANNOTATION, PROJECT_LABEL,
    REGISTERED_BY_ANNOTATION, REGISTERED_BY_API, REGISTRATION_FINALIZER, ReleaseReason, Role, is_label_value,
};
use crate::db::retry_unavailable;
use crate::election::heartbeat::HeartbeatCoalescer;
use crate::election::shared_reads::{self, SharedReads};
use crate::election::store::Nudge;
use crate::election::{
    ElectionError, ElectionStore, LiveRole, NewRegistration, OwnedRegistration, RegisterOutcome, Registration,
};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Election(#[from] ElectionError),
    #[error("{step}: Kubernetes API: {source}")]
    Kube {
        step: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("session {0} has no live registration")]
    NotRegistered(String),
    /// SPEC §6: the session belongs to another Kubernetes identity.
    #[error("session {0} belongs to another identity")]
    NotOwned(String),
    #[error("register: the API server gave the new resource uid {0:?}, which is not a uuid")]
    BadUid(String),
    #[error("register: the finalizer patch could not be built: {0}")]
    Patch(String),
}

/// `kube::Error` with the step that failed.
trait KubeStep<T> {
    fn step(self, step: &'static str) -> Result<T, AgentError>;
}

impl<T> KubeStep<T> for Result<T, kube::Error> {
    fn step(self, step: &'static str) -> Result<T, AgentError> {
        self.map_err(|source| AgentError::Kube { step, source })
    }
}

/// One row of a routing table (SPEC §6).
#[derive(Clone, Debug, Serialize, PartialEq, utoipa::ToSchema)]
pub struct RouteEntry {
    pub id: Uuid,
    pub namespace: String,
    pub name: String,
    pub session_id: String,
    pub agent_surface: AgentSurface,
    pub role: Role,
    pub registered_at: DateTime<Utc>,
    pub last_heartbeat: DateTime<Utc>,
}

impl From<&Registration> for RouteEntry {
    fn from(r: &Registration) -> Self {
        RouteEntry {
            id: r.id,
            namespace: r.namespace.clone(),
            name: r.name.clone(),
            session_id: r.session_id.clone(),
            agent_surface: r.agent_surface,
            role: r.role(),
            registered_at: r.registered_at,
            last_heartbeat: r.last_heartbeat,
        }
    }
}

#[derive(Clone, Debug, Serialize, PartialEq, utoipa::ToSchema)]
pub struct RoutingTable {
    pub project_id: String,
    pub namespace: String,
    pub term: i64,
    pub master: Option<RouteEntry>,
    pub peers: Vec<RouteEntry>,
    /// Registrations the stale sweep released within the last `STALE_WINDOW`.
    pub stale: Vec<RouteEntry>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caller: Option<RouteEntry>,
    /// With `session_id`, from a caller that may heartbeat it: its nudges not delivered
    /// before (SPEC §11), now delivered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nudges: Option<Vec<Nudge>>,
}

pub use prism_core::election::ChangeId;

/// A project's routing at one change, shared by every watch that read it together: a
/// stream that waits for its reader keeps this (a reference), and its table is made when
/// the reader takes it — 1,000 stalled watches of a large project keep one copy, not
/// 1,000.
#[derive(Clone, Debug)]
pub struct RoutingSnapshot {
    pub id: ChangeId,
    namespace: String,
    project_id: String,
    read: Arc<RoutingRead>,
}

impl RoutingSnapshot {
    /// The table as `session_id` (the caller's own session, if any) sees it.
    pub fn table(&self, session_id: Option<&str>) -> RoutingTable {
        let RoutingRead { view, stale, .. } = &*self.read;
        RoutingTable {
            project_id: self.project_id.clone(),
            namespace: self.namespace.clone(),
            term: view.term,
            master: view.master.as_ref().map(RouteEntry::from),
            peers: view.live.iter().filter(|r| !r.is_master).map(RouteEntry::from).collect(),
            stale: stale.iter().map(RouteEntry::from).collect(),
            caller: session_id.and_then(|s| view.live.iter().find(|r| r.session_id == s)).map(RouteEntry::from),
            nudges: None,
        }
    }

    /// The one rendering of this change's table as no session sees it (a watch's
    /// `routing` event): made by the first reader that asks, shared by every other.
    pub fn rendered_once(&self, render: impl FnOnce(&RoutingSnapshot) -> axum::body::Bytes) -> axum::body::Bytes {
        self.read.rendered.get_or_init(|| render(self)).clone()
    }
}

/// A routing table and the change it shows.
#[derive(Clone, Debug)]
pub struct RoutingChange {
    pub id: ChangeId,
    pub table: RoutingTable,
}

/// The result of a registration call.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct Registered {
    pub registration: RouteEntry,
    pub project_id: String,
    pub is_master: bool,
    pub term: i64,
    pub you_were_preempted: bool,
    pub routing: RoutingTable,
}

#[derive(Clone, Debug, Serialize, PartialEq, utoipa::ToSchema)]
pub struct HeartbeatReply {
    pub role: Role,
    pub is_master: bool,
    pub you_were_preempted: bool,
    /// The project's current term (the master's fencing token).
    pub term: i64,
    /// The session's nudges not delivered before (SPEC §11), now delivered.
    pub nudges: Vec<Nudge>,
}

impl From<&LiveRole> for HeartbeatReply {
    fn from(r: &LiveRole) -> Self {
        HeartbeatReply {
            role: if r.is_master { Role::Master } else { Role::Peer },
            is_master: r.is_master,
            you_were_preempted: r.preempted,
            term: r.project_term,
            nudges: Vec::new(),
        }
    }
}

/// How far back the routing table lists registrations released by the stale sweep.
/// How long an API call keeps retrying an idempotent change while Postgres is out of
/// reach (a killed backend, a restart) before it answers 503: long enough for a restart,
/// well under a client's timeout.
const DATABASE_RETRY: std::time::Duration = std::time::Duration::from_secs(5);

pub const STALE_WINDOW: chrono::TimeDelta = chrono::TimeDelta::hours(24);

#[derive(Clone)]
pub struct AgentService {
    pub client: Client,
    pub store: ElectionStore,
    pub heartbeats: HeartbeatCoalescer,
    /// Which sessions may have a nudge (answers read `nudges` only for those).
    pub signals: crate::signals::Signals,
    /// A project's routing reads asked for at once, made once: every watch and MCP
    /// subscription of a project is woken by the same change and reads the same table
    /// (1,000 watches of a busy project made 1,000 reads of it per change).
    routing_reads: SharedReads<(String, String), Arc<RoutingRead>>,
}

/// What a routing table is made of: the project's live registrations and term, and its
/// recently stale ones (the caller's own entry is picked from the first).
#[derive(Debug)]
struct RoutingRead {
    view: crate::election::ProjectView,
    stale: Vec<Registration>,
    /// `RoutingSnapshot::rendered_once`.
    rendered: std::sync::OnceLock<axum::body::Bytes>,
}

/// A readable, valid resource name for a registration: the project id folded to a DNS
/// label, plus a random suffix from the API server (generateName).
fn name_prefix(project_id: &str) -> String {
    let mut s: String =
        project_id.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    s.truncate(40);
    let s = s.trim_matches('-').to_string();
    if s.is_empty() { "creg-".to_string() } else { format!("{s}-") }
}

/// The resource an agent's registration is: finalizer included, so a delete always
/// releases, and the project label when the project id can be one.
fn new_resource(project_id: &str, session_id: &str, surface: AgentSurface, owner: &str) -> ControllerRegistration {
    let mut obj = ControllerRegistration::new(
        "",
        ControllerRegistrationSpec {
            project_id: project_id.to_string(),
            session_id: session_id.to_string(),
            agent_surface: surface,
        },
    );
    obj.metadata.name = None;
    obj.metadata.generate_name = Some(name_prefix(project_id));
    obj.metadata.finalizers = Some(vec![REGISTRATION_FINALIZER.to_string()]);
    if is_label_value(project_id) {
        obj.metadata.labels = Some([(PROJECT_LABEL.to_string(), project_id.to_string())].into());
    }
    // Who owns it, for `kubectl get -o yaml` readers, and that the API writes its row
    // (the reconciler only reads it): see `crd::REGISTERED_BY_ANNOTATION`.
    obj.metadata.annotations = Some(
        [
            (OWNER_ANNOTATION.to_string(), owner.to_string()),
            (REGISTERED_BY_ANNOTATION.to_string(), REGISTERED_BY_API.to_string()),
        ]
        .into(),
    );
    obj
}

impl AgentService {
    pub fn new(
        client: Client,
        store: ElectionStore,
        heartbeats: HeartbeatCoalescer,
        signals: crate::signals::Signals,
    ) -> Self {
        Self { client, store, heartbeats, signals, routing_reads: SharedReads::new(shared_reads::GATHER) }
    }

    /// Registers the session for the project on behalf of `caller` (the Kubernetes
    /// username), who then owns it: finds its live registration there, or creates the
    /// resource and runs the election at once, so the answer is in this response.
    ///
    /// The API is the one writer of its registrations' rows (the reconciler of such a
    /// resource only reads its row, `crd::REGISTERED_BY_ANNOTATION`). A call that is
    /// refused (another identity's session, a full quota) makes nothing when it can tell
    /// beforehand, and otherwise removes the resource it made: a refused register leaves
    /// no resource and no row. Of concurrent identical calls one resource stands; the
    /// others remove theirs and answer with it.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn register(
        &self,
        namespace: &str,
        project_id: &str,
        session_id: &str,
        surface: AgentSurface,
        caller: &str,
    ) -> Result<Registered, AgentError> {
        let switching = if let Some(existing) = self.store.live_by_session_owned(namespace, session_id).await? {
            check_owner(&existing, caller)?;
            if existing.row.project_id == project_id {
                self.heartbeats.beat(namespace, session_id);
                return self.registered(existing.row).await;
            }
            true
        } else {
            // A new live registration (a context switch is not): no resource for a call
            // the quota refuses.
            self.store.check_quota(namespace, Some(caller)).await?;
            false
        };
        let api: Api<ControllerRegistration> = Api::namespaced(self.client.clone(), namespace);
        let created = api
            .create(&PostParams::default(), &new_resource(project_id, session_id, surface, caller))
            .await
            .step("register: create the ControllerRegistration")?;
        let new = NewRegistration {
            id: resource_id(&created)?,
            namespace: namespace.to_string(),
            name: created.name_any(),
            project_id: project_id.to_string(),
            session_id: session_id.to_string(),
            surface,
            owner: Some(caller.to_string()),
            through_api: true,
        };
        // Registering a resource is idempotent (by its uid): a killed backend or a short
        // restart is retried here rather than surfaced.
        let outcome = retry_unavailable(DATABASE_RETRY, || self.store.register(&new)).await;
        let refusal = match outcome {
            Ok(RegisterOutcome::Registered(row)) => {
                if switching {
                    // The switch wrote a nudge: this replica's next answer to the session
                    // carries it, even before the notification comes back.
                    self.signals.note_nudge(namespace, session_id);
                }
                return self.registered(row).await;
            }
            // Another resource holds this session on this project (a concurrent identical
            // call): that one stands, and this one goes.
            Ok(RegisterOutcome::DuplicateSession { existing }) => {
                self.remove_unused(&new).await?;
                self.heartbeats.beat(namespace, session_id);
                return self.registered(existing).await;
            }
            Err(e @ (ElectionError::NotOwned(_) | ElectionError::QuotaExceeded(_))) => e,
            Err(e) => match self.store.get(new.id).await {
                // Written after all (a commit whose answer was lost on the last try): the
                // call did what it was asked. Deleting the resource now would have its
                // finalizer release the session behind the caller's back.
                Ok(Some(row)) if row.is_live() => return self.registered(row).await,
                Ok(_) => e,
                // Whether the row exists cannot be told: the resource stays. The
                // reconciler never registers it (the API is its writer); if no row comes,
                // it deletes it as an orphan. A retry of the same session is idempotent.
                Err(_) => {
                    warn!(namespace, name = %new.name, session_id, error = %e,
                          "register refused while Postgres is away; the reconciler removes its resource if no row comes");
                    return Err(e.into());
                }
            },
        };
        self.remove_unused(&new).await?;
        Err(match refusal {
            ElectionError::NotOwned(s) => AgentError::NotOwned(s),
            other => other.into(),
        })
    }

    /// Removes a resource this call made and did not use (no row of it was written): its
    /// finalizer would release nothing, so it is taken off first and the resource goes at
    /// once, not whenever the leader's reconciler gets to it.
    async fn remove_unused(&self, new: &NewRegistration) -> Result<(), AgentError> {
        let api: Api<ControllerRegistration> = Api::namespaced(self.client.clone(), &new.namespace);
        let uid = new.id.to_string();
        let patch = json!([
            {"op": "test", "path": "/metadata/uid", "value": uid},
            {"op": "replace", "path": "/metadata/finalizers", "value": Vec::<String>::new()},
        ]);
        let patch: json_patch::Patch = serde_json::from_value(patch).map_err(|e| AgentError::Patch(e.to_string()))?;
        match api.patch(&new.name, &PatchParams::default(), &Patch::<()>::Json(patch)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 422 || s.code == 409 => {}
            Err(e) => {
                return Err(AgentError::Kube { step: "register: drop the unused resource's finalizer", source: e });
            }
        }
        self.delete_resource(&new.id, &new.namespace, &new.name, "register: delete the unused resource").await
    }

    async fn registered(&self, row: Registration) -> Result<Registered, AgentError> {
        let routing = self.routing(&row.namespace, &row.project_id, Some(&row.session_id)).await?;
        Ok(Registered {
            registration: RouteEntry::from(&row),
            project_id: row.project_id.clone(),
            is_master: row.role() == Role::Master,
            term: routing.term,
            you_were_preempted: row.preempted,
            routing,
        })
    }

    /// Wrap on behalf of `caller`: release (promoting a successor) and delete the resource.
    /// The caller must own the registration (or it has no owner).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn release(&self, row: &OwnedRegistration, caller: &str) -> Result<RoutingTable, AgentError> {
        check_owner(row, caller)?;
        let row = &row.row;
        // Releasing a row is idempotent: retried through a short Postgres outage.
        retry_unavailable(DATABASE_RETRY, || self.store.release(row.id, ReleaseReason::Wrapped)).await?;
        self.delete_resource(&row.id, &row.namespace, &row.name, "release: delete the ControllerRegistration").await?;
        Ok(self.routing(&row.namespace, &row.project_id, None).await?)
    }

    /// Deletes the resource of `row`, and only that one: a precondition on its uid, so a
    /// later resource that took the same name (a released registration's name is free
    /// again once its resource is gone) is never deleted in its place. Gone already, or
    /// replaced: nothing to delete.
    async fn delete_resource(
        &self,
        id: &Uuid,
        namespace: &str,
        name: &str,
        step: &'static str,
    ) -> Result<(), AgentError> {
        let api: Api<ControllerRegistration> = Api::namespaced(self.client.clone(), namespace);
        let params = DeleteParams {
            preconditions: Some(Preconditions { uid: Some(id.to_string()), resource_version: None }),
            ..Default::default()
        };
        match api.delete(name, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(AgentError::Kube { step, source: e }),
        }
    }

    /// A registration and its owner, by id; `NotFound` if there is none.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn registration(&self, id: Uuid) -> Result<OwnedRegistration, AgentError> {
        Ok(self.store.get_owned(id).await?.ok_or(ElectionError::NotFound(id))?)
    }

    /// The session's live registration and its owner; `NotRegistered` if there is none.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn live_session(&self, namespace: &str, session_id: &str) -> Result<OwnedRegistration, AgentError> {
        self.store
            .live_by_session_owned(namespace, session_id)
            .await?
            .ok_or_else(|| AgentError::NotRegistered(session_id.to_string()))
    }

    /// The heartbeat of `caller`'s session (SPEC §4 rule 8): its role, and a coalesced
    /// refresh of its registration. Another identity's session is refused and not
    /// refreshed. The role comes from memory only while nothing can have changed it since
    /// it was read (`election::roles`: this process's commits invalidate at once, other
    /// replicas' through their NOTIFY), otherwise from Postgres: a master preempted a
    /// moment ago is told so on its very next call.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn heartbeat(&self, namespace: &str, session_id: &str, caller: &str) -> Result<LiveRole, AgentError> {
        let role = self.role(namespace, session_id).await?;
        if role.owner.as_deref().is_some_and(|owner| owner != caller) {
            return Err(AgentError::NotOwned(session_id.to_string()));
        }
        // The write is coalesced: this call costs Postgres at most one indexed read.
        self.heartbeats.beat(namespace, session_id);
        Ok(role)
    }

    /// The session's role, read only (no heartbeat): what a caller that may read but not
    /// heartbeat is told (SPEC §4 rule 8).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn role(&self, namespace: &str, session_id: &str) -> Result<LiveRole, AgentError> {
        self.store
            .live_role(namespace, session_id)
            .await?
            .ok_or_else(|| AgentError::NotRegistered(session_id.to_string()))
    }

    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn routing(
        &self,
        namespace: &str,
        project_id: &str,
        session_id: Option<&str>,
    ) -> Result<RoutingTable, ElectionError> {
        Ok(self.routing_change(namespace, project_id, session_id).await?.table)
    }

    /// A page of the namespace's projects and their terms (`ElectionStore::projects`).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn projects(
        &self,
        namespace: &str,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<(String, i64)>, ElectionError> {
        self.store.projects(namespace, after, limit).await
    }

    /// The session's undelivered nudges, marked delivered (`ElectionStore::take_nudges`);
    /// Postgres is read only when one may be pending (`Signals`). The caller must be
    /// one that may heartbeat the session (SPEC §4 rule 8).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn take_nudges(
        &self,
        namespace: &str,
        session_id: &str,
        caller: &str,
    ) -> Result<Vec<crate::election::store::Nudge>, ElectionError> {
        if !self.signals.may_have_nudge(namespace, session_id) {
            return Ok(Vec::new());
        }
        // Another identity's call takes nothing, and does not make the owner's next
        // answer skip the read either.
        if let Some(live) = self.store.live_by_session_owned(namespace, session_id).await?
            && !live.owned_by(caller)
        {
            return Ok(Vec::new());
        }
        let nudges = self.store.take_nudges(namespace, session_id, caller).await?;
        if nudges.is_empty() {
            // None left (or none of this caller's to take): stop reading for the session.
            self.signals.no_nudge(namespace, session_id);
        }
        Ok(nudges)
    }

    /// Gives back nudges taken for a stream whose reader never took them.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn return_nudges(
        &self,
        namespace: &str,
        session_id: &str,
        ids: &[uuid::Uuid],
    ) -> Result<(), ElectionError> {
        self.store.return_nudges(ids).await?;
        self.signals.note_nudge(namespace, session_id);
        Ok(())
    }

    /// The routing table, with the change of the project it shows (a watch's event id).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn routing_change(
        &self,
        namespace: &str,
        project_id: &str,
        session_id: Option<&str>,
    ) -> Result<RoutingChange, ElectionError> {
        let snapshot = self.routing_snapshot(namespace, project_id).await?;
        Ok(RoutingChange { id: snapshot.id, table: snapshot.table(session_id) })
    }

    /// What the project's routing tables are made of now, read once for everyone who
    /// asks at the same moment (`routing_reads`), each caller's table made from it later.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn routing_snapshot(&self, namespace: &str, project_id: &str) -> Result<RoutingSnapshot, ElectionError> {
        let key = (namespace.to_string(), project_id.to_string());
        let read = self
            .routing_reads
            .read(key, || async {
                let view = self.store.project(namespace, project_id).await?;
                let stale = self.store.recently_stale(namespace, project_id, Utc::now() - STALE_WINDOW).await?;
                Ok::<_, ElectionError>(Arc::new(RoutingRead { view, stale, rendered: Default::default() }))
            })
            .await?;
        let id = ChangeId { term: read.view.term, seq: read.view.changes };
        Ok(RoutingSnapshot { id, namespace: namespace.to_string(), project_id: project_id.to_string(), read })
    }

    /// The project's master if `term` is its current master term: lets downstream systems
    /// reject writes from a demoted master.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "agents"))]
    pub async fn fence(
        &self,
        namespace: &str,
        project_id: &str,
        term: i64,
    ) -> Result<Option<RouteEntry>, ElectionError> {
        let view = self.store.project(namespace, project_id).await?;
        Ok(view.master.as_ref().filter(|m| m.master_term == Some(term)).map(RouteEntry::from))
    }
}

/// SPEC §6: only the owner acts on an owned session.
fn check_owner(row: &OwnedRegistration, caller: &str) -> Result<(), AgentError> {
    if row.owned_by(caller) { Ok(()) } else { Err(AgentError::NotOwned(row.row.session_id.clone())) }
}

/// The registration id of a resource: its metadata.uid, which the API server always sets.
fn resource_id(obj: &ControllerRegistration) -> Result<Uuid, AgentError> {
    let uid = obj.uid().unwrap_or_default();
    Uuid::parse_str(&uid).map_err(|_| AgentError::BadUid(uid))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1,000 watches of a project share one written table per change, not one each.
    #[test]
    fn a_change_is_rendered_once_for_every_reader_without_a_session() {
        let view = crate::election::ProjectView { term: 3, changes: 9, ..Default::default() };
        let read = Arc::new(RoutingRead { view, stale: Vec::new(), rendered: Default::default() });
        let snapshot = |read: &Arc<RoutingRead>| RoutingSnapshot {
            id: ChangeId { term: 3, seq: 9 },
            namespace: "ns".into(),
            project_id: "p".into(),
            read: read.clone(),
        };
        let renders = std::sync::atomic::AtomicUsize::new(0);
        let render = |s: &RoutingSnapshot| {
            renders.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            axum::body::Bytes::from(s.id.to_string())
        };
        let first = snapshot(&read).rendered_once(render);
        let second = snapshot(&read).rendered_once(render);
        assert_eq!(renders.load(std::sync::atomic::Ordering::SeqCst), 1, "rendered once");
        assert_eq!(first.as_ptr(), second.as_ptr(), "the same bytes, shared");
        let other = Arc::new(RoutingRead { view: read.view.clone(), stale: Vec::new(), rendered: Default::default() });
        snapshot(&other).rendered_once(render);
        assert_eq!(renders.load(std::sync::atomic::Ordering::SeqCst), 2, "another read renders its own");
    }

    #[test]
    fn names_are_dns_labels() {
        assert_eq!(name_prefix("PID-PGR01"), "pid-pgr01-");
        assert_eq!(name_prefix("my project/α"), "my-project-");
        assert_eq!(name_prefix("___"), "creg-");
        assert!(name_prefix(&"x".repeat(128)).len() <= 41);
    }

    #[test]
    fn routing_entries_spell_roles_and_surfaces_as_the_resources_do() {
        let entry = RouteEntry {
            id: Uuid::nil(),
            namespace: "ns".into(),
            name: "r".into(),
            session_id: "s".into(),
            agent_surface: AgentSurface::ClaudeDesktop,
            role: Role::Master,
            registered_at: DateTime::UNIX_EPOCH,
            last_heartbeat: DateTime::UNIX_EPOCH,
        };
        let json = serde_json::to_value(&entry).expect("json");
        assert_eq!(json["role"], "Master");
        assert_eq!(json["agent_surface"], "claude_desktop");
    }
}

//! The service agents (AI sessions) call over HTTP: register (create the resource and run the
//! election in the same call), release, heartbeat, read the routing table, fence.
//! The HTTP layer parses and authorizes; this layer does the work.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde::Serialize;
use uuid::Uuid;

use crate::crd::{
    AgentSurface, ControllerRegistration, ControllerRegistrationSpec, PROJECT_LABEL, REGISTRATION_FINALIZER,
    ReleaseReason, is_label_value,
};
use crate::election::ElectionError;
use crate::election::heartbeat::HeartbeatCoalescer;
use crate::election::store::{ElectionStore, NewRegistration, ProjectView, RegisterOutcome, Registration, Touched};
use crate::triggers::Triggers;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Election(#[from] ElectionError),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("session {0} has no live registration")]
    NotRegistered(String),
}

/// One row of a routing table (SPEC §6).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RouteEntry {
    pub id: Uuid,
    pub namespace: String,
    pub name: String,
    pub session_id: String,
    pub agent_surface: String,
    pub role: &'static str,
    pub registered_at: DateTime<Utc>,
    pub last_heartbeat: DateTime<Utc>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RoutingTable {
    pub project_id: String,
    pub namespace: String,
    pub term: i64,
    pub master: Option<RouteEntry>,
    pub peers: Vec<RouteEntry>,
    pub stale: Vec<RouteEntry>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caller: Option<RouteEntry>,
}

pub fn role_of(r: &Registration) -> &'static str {
    match (r.is_live(), r.is_master) {
        (false, _) => "Released",
        (true, true) => "Master",
        (true, false) => "Peer",
    }
}

fn entry(r: &Registration) -> RouteEntry {
    RouteEntry {
        id: r.id,
        namespace: r.namespace.clone(),
        name: r.name.clone(),
        session_id: r.session_id.clone(),
        agent_surface: r.agent_surface.clone(),
        role: role_of(r),
        registered_at: r.registered_at,
        last_heartbeat: r.last_heartbeat,
    }
}

/// The result of a registration call.
#[derive(Clone, Debug, Serialize)]
pub struct Registered {
    pub registration: RouteEntry,
    pub project_id: String,
    pub is_master: bool,
    pub term: i64,
    pub you_were_preempted: bool,
    pub routing: RoutingTable,
}

#[derive(Clone, Debug, Serialize)]
pub struct HeartbeatReply {
    pub role: &'static str,
    pub is_master: bool,
    pub you_were_preempted: bool,
    /// The project's current term (the master's fencing token).
    pub term: i64,
}

/// How long a heartbeat answer may be reused for the same session: the coalescing
/// window, so a role change shows in heartbeat replies within a quarter second (fencing
/// writes is `/fence`'s job, which always reads Postgres).
const HEARTBEAT_VIEW_TTL: std::time::Duration = std::time::Duration::from_millis(250);

type HeartbeatViews =
    std::sync::Mutex<std::collections::HashMap<(String, String), (std::time::Instant, (bool, bool, i64))>>;

#[derive(Clone)]
pub struct AgentService {
    pub client: Client,
    pub store: ElectionStore,
    pub heartbeats: HeartbeatCoalescer,
    pub triggers: Triggers,
    pub stale_window: chrono::Duration,
    pub views: std::sync::Arc<HeartbeatViews>,
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

impl AgentService {
    /// Registers the session for the project: finds its live registration there, or
    /// creates the resource (finalizer included, so a delete always releases) and runs the
    /// election at once, so the answer is in this response.
    pub async fn register(
        &self,
        namespace: &str,
        project_id: &str,
        session_id: &str,
        surface: AgentSurface,
    ) -> Result<Registered, AgentError> {
        self.heartbeats.beat(namespace, session_id);
        if let Some(existing) = self.store.live_by_session(namespace, session_id).await?
            && existing.project_id == project_id
        {
            return self.registered(existing).await;
        }
        let api: Api<ControllerRegistration> = Api::namespaced(self.client.clone(), namespace);
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
        let created = api.create(&PostParams::default(), &obj).await?;
        let id = created.uid().and_then(|u| Uuid::parse_str(&u).ok()).ok_or(ElectionError::NotFound(Uuid::nil()))?;
        let new = NewRegistration {
            id,
            namespace: namespace.to_string(),
            name: created.name_any(),
            project_id: project_id.to_string(),
            session_id: session_id.to_string(),
            surface,
        };
        let (outcome, mut touched) = self.store.register(&new).await?;
        touched.insert(Touched { namespace: namespace.to_string(), name: created.name_any() });
        self.triggers.registrations(touched);
        match outcome {
            RegisterOutcome::Registered(row) => self.registered(row).await,
            // A concurrent call registered the same session first: keep that one.
            RegisterOutcome::DuplicateSession { existing } => {
                let _ = api.delete(&created.name_any(), &DeleteParams::default()).await;
                self.registered(existing).await
            }
        }
    }

    async fn registered(&self, row: Registration) -> Result<Registered, AgentError> {
        let routing = self.routing(&row.namespace, &row.project_id, Some(&row.session_id)).await?;
        Ok(Registered {
            registration: entry(&row),
            project_id: row.project_id.clone(),
            is_master: row.is_master && row.is_live(),
            term: routing.term,
            you_were_preempted: row.preempted,
            routing,
        })
    }

    /// Wrap: release (promoting a successor) and delete the resource.
    pub async fn release(&self, id: Uuid) -> Result<RoutingTable, AgentError> {
        let row = self.store.get(id).await?.ok_or(ElectionError::NotFound(id))?;
        let touched: BTreeSet<Touched> = self.store.release(id, ReleaseReason::Wrapped).await?;
        self.triggers.registrations(touched);
        let api: Api<ControllerRegistration> = Api::namespaced(self.client.clone(), &row.namespace);
        match api.delete(&row.name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
        Ok(self.routing(&row.namespace, &row.project_id, None).await?)
    }

    pub async fn registration(&self, id: Uuid) -> Result<Registration, AgentError> {
        Ok(self.store.get(id).await?.ok_or(ElectionError::NotFound(id))?)
    }

    pub async fn heartbeat(&self, namespace: &str, session_id: &str) -> Result<HeartbeatReply, AgentError> {
        let key = (namespace.to_string(), session_id.to_string());
        let cached = self
            .views
            .lock()
            .ok()
            .and_then(|v| v.get(&key).filter(|(at, _)| at.elapsed() < HEARTBEAT_VIEW_TTL).map(|(_, view)| *view));
        let (is_master, preempted, term) = match cached {
            Some(view) => view,
            None => {
                let view = self
                    .store
                    .heartbeat_view(namespace, session_id)
                    .await?
                    .ok_or_else(|| AgentError::NotRegistered(session_id.to_string()))?;
                if let Ok(mut views) = self.views.lock() {
                    if views.len() > 100_000 {
                        views.retain(|_, (at, _)| at.elapsed() < HEARTBEAT_VIEW_TTL);
                    }
                    views.insert(key, (std::time::Instant::now(), view));
                }
                view
            }
        };
        // The write is coalesced: this call costs Postgres one indexed read.
        self.heartbeats.beat(namespace, session_id);
        let role = if is_master { "Master" } else { "Peer" };
        Ok(HeartbeatReply { role, is_master, you_were_preempted: preempted, term })
    }

    pub async fn routing(
        &self,
        namespace: &str,
        project_id: &str,
        session_id: Option<&str>,
    ) -> Result<RoutingTable, ElectionError> {
        let view: ProjectView = self.store.project(namespace, project_id).await?;
        let stale = self.store.recently_stale(namespace, project_id, Utc::now() - self.stale_window).await?;
        let caller = match session_id {
            Some(s) => {
                self.heartbeats.beat(namespace, s);
                view.live.iter().find(|r| r.session_id == s).map(entry)
            }
            None => None,
        };
        Ok(RoutingTable {
            project_id: project_id.to_string(),
            namespace: namespace.to_string(),
            term: view.term,
            master: view.master.as_ref().map(entry),
            peers: view.live.iter().filter(|r| !r.is_master).map(entry).collect(),
            stale: stale.iter().map(entry).collect(),
            caller,
        })
    }

    /// Is `term` the project's current master term? Lets downstream systems reject writes
    /// from a demoted master.
    pub async fn fence(
        &self,
        namespace: &str,
        project_id: &str,
        term: i64,
    ) -> Result<Option<RouteEntry>, ElectionError> {
        let view = self.store.project(namespace, project_id).await?;
        Ok(match &view.master {
            Some(m) if m.master_term == Some(term) => Some(entry(m)),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::name_prefix;

    #[test]
    fn names_are_dns_labels() {
        assert_eq!(name_prefix("PID-PGR01"), "pid-pgr01-");
        assert_eq!(name_prefix("my project/α"), "my-project-");
        assert_eq!(name_prefix("___"), "creg-");
        assert!(name_prefix(&"x".repeat(128)).len() <= 41);
    }
}

//! `prism-operator status <project_id>`: the routing table from the resources' status,
//! through the Kubernetes API with the user's own kubeconfig and RBAC (it also works as
//! `kubectl prism status` when installed as `kubectl-prism`).

use chrono::{DateTime, Utc};
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use uuid::Uuid;

use crate::agent_sessions::{RouteEntry, RoutingTable};
use crate::config::OutputFormat;
use crate::crd::{ControllerRegistration, ReleaseReason, Role};
use crate::time::{age, from_k8s};

/// The routing table of one project, built from the registrations' status (pure).
pub fn routing_table(namespace: &str, project_id: &str, regs: &[ControllerRegistration]) -> RoutingTable {
    let mut table = RoutingTable {
        project_id: project_id.to_string(),
        namespace: namespace.to_string(),
        term: 0,
        master: None,
        peers: vec![],
        stale: vec![],
        caller: None,
    };
    for r in regs {
        let status = r.status.clone().unwrap_or_default();
        let entry = RouteEntry {
            // A uid is a uuid on every API server; nil marks the impossible case.
            id: r.uid().and_then(|u| Uuid::parse_str(&u).ok()).unwrap_or_default(),
            namespace: namespace.to_string(),
            name: r.name_any(),
            session_id: r.spec.session_id.clone(),
            agent_surface: r.spec.agent_surface,
            role: status.role,
            registered_at: status.registered_at.as_ref().map(from_k8s).unwrap_or(DateTime::UNIX_EPOCH),
            last_heartbeat: status.last_heartbeat.as_ref().map(from_k8s).unwrap_or(DateTime::UNIX_EPOCH),
        };
        match status.role {
            Role::Master => {
                table.term = status.term.unwrap_or_default();
                table.master = Some(entry);
            }
            Role::Peer => table.peers.push(entry),
            Role::Released if status.release_reason == Some(ReleaseReason::StaleHeartbeatIncident) => {
                table.stale.push(entry)
            }
            _ => {}
        }
    }
    table.peers.sort_by(|a, b| a.registered_at.cmp(&b.registered_at).then(a.name.cmp(&b.name)));
    table
}

/// Renders the table as a person reads it.
pub fn render(table: &RoutingTable, now: DateTime<Utc>) -> String {
    let mut rows = vec![["NAME", "ROLE", "SURFACE", "SESSION", "HEARTBEAT"].map(String::from).to_vec()];
    for e in table.master.iter().chain(&table.peers).chain(&table.stale) {
        let role = if e.role == Role::Released { "Stale" } else { e.role.as_str() };
        rows.push(vec![
            e.name.clone(),
            role.into(),
            e.agent_surface.to_string(),
            e.session_id.clone(),
            age(e.last_heartbeat, now),
        ]);
    }
    let widths: Vec<usize> = (0..5).map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0)).collect();
    let mut out = format!(
        "project {} in namespace {}: term {}, master {}\n",
        table.project_id,
        table.namespace,
        table.term,
        table.master.as_ref().map(|m| m.name.as_str()).unwrap_or("none")
    );
    for r in rows {
        let line: Vec<String> = r.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str(line.join("   ").trim_end());
        out.push('\n');
    }
    out
}

pub async fn run(project_id: &str, namespace: Option<String>, output: OutputFormat) -> anyhow::Result<()> {
    let client = Client::try_default().await?;
    let namespace = namespace.unwrap_or_else(|| client.default_namespace().to_string());
    let api: Api<ControllerRegistration> = Api::namespaced(client, &namespace);
    let list = api.list(&ListParams::default().fields(&format!("spec.projectId={project_id}"))).await?;
    let table = routing_table(&namespace, project_id, &list.items);
    match output {
        OutputFormat::Table => print!("{}", render(&table, Utc::now())),
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&table)?),
        OutputFormat::Yaml => print!("{}", serde_yaml::to_string(&table)?),
    }
    Ok(())
}

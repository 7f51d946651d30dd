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
        nudges: None,
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

pub async fn run(project_id: &str, namespace: Option<String>, output: OutputFormat, watch: bool) -> anyhow::Result<()> {
    let client = Client::try_default().await?;
    let namespace = namespace.unwrap_or_else(|| client.default_namespace().to_string());
    let api: Api<ControllerRegistration> = Api::namespaced(client, &namespace);
    let selector = format!("spec.projectId={project_id}");
    if watch {
        return watch_tables(api, &namespace, project_id, &selector, output).await;
    }
    let list = api.list(&ListParams::default().fields(&selector)).await?;
    print!("{}", show(&routing_table(&namespace, project_id, &list.items), output, false)?);
    Ok(())
}

/// One table as `-o` asks; `stream`: JSON on one line and YAML as a document of its own,
/// so that a reader of a watch can split them.
fn show(table: &RoutingTable, output: OutputFormat, stream: bool) -> anyhow::Result<String> {
    Ok(match output {
        OutputFormat::Table => render(table, Utc::now()),
        OutputFormat::Json if stream => format!("{}\n", serde_json::to_string(table)?),
        OutputFormat::Json => format!("{}\n", serde_json::to_string_pretty(table)?),
        OutputFormat::Yaml if stream => format!("---\n{}", serde_yaml::to_string(table)?),
        OutputFormat::Yaml => serde_yaml::to_string(table)?,
    })
}

/// What a change is: the term, and who holds which role. A heartbeat moves none of it.
fn shape(table: &RoutingTable) -> (i64, Vec<(String, Role)>) {
    let members =
        table.master.iter().chain(&table.peers).chain(&table.stale).map(|e| (e.name.clone(), e.role)).collect();
    (table.term, members)
}

/// `status -w`: a Kubernetes watch of the project's registrations (the API server's
/// push, resumed by kube's watcher after a dropped connection); the table again at each
/// change of its shape.
async fn watch_tables(
    api: Api<ControllerRegistration>,
    namespace: &str,
    project_id: &str,
    selector: &str,
    output: OutputFormat,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, reflector, watcher};
    let (reader, writer) = reflector::store();
    let events = reflector(writer, watcher(api, watcher::Config::default().fields(selector)).default_backoff());
    let mut events = std::pin::pin!(events);
    let mut shown = None;
    let mut ready = false;
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        match event {
            Some(Ok(watcher::Event::InitDone)) => ready = true,
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                eprintln!("watch: {e}; retrying");
                continue;
            }
            None => return Ok(()),
        }
        if !ready {
            continue;
        }
        let regs: Vec<ControllerRegistration> = reader.state().iter().map(|r| (**r).clone()).collect();
        let table = routing_table(namespace, project_id, &regs);
        let now = Some(shape(&table));
        if now != shown {
            print!("{}", show(&table, output, true)?);
            use std::io::Write as _;
            std::io::stdout().flush()?;
            shown = now;
        }
    }
}

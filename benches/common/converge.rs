//! One convergence round: `n` ControllerRegistrations over `n / 10` projects created on the
//! API server against a fresh operator in a fresh namespace, timed until every status is
//! right, beside the time the API server took to accept the creates. Election (c) runs it
//! at 1,000; the scale bench at every size, and keeps the last round's operator running.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, ResourceExt};
use prism_operator::crd::{AgentSurface, ControllerRegistration, ControllerRegistrationSpec, Role};

use super::counts::{apiserver_writes, control_plane_needle, cpu_of, cpu_seconds, peak_rss_mib, writes_since};
use crate::support;

/// Registrations per project.
pub const PER_PROJECT: usize = 10;

pub fn surface(n: u64) -> AgentSurface {
    AgentSurface::ALL[(n % 5) as usize]
}

/// Registration `k` of a round: its name, project and session. Project `k % projects`,
/// the `k / projects`-th of that project, so every project gets each surface twice (two
/// desktops among ten).
pub fn registration(k: usize, projects: usize) -> (String, ControllerRegistrationSpec) {
    let spec = ControllerRegistrationSpec {
        project_id: project(k % projects),
        session_id: format!("conv-{k}"),
        agent_surface: surface((k / projects) as u64),
    };
    (format!("c{k:05}"), spec)
}

pub fn project(p: usize) -> String {
    format!("P{p:04}")
}

/// Right: every one of `projects` projects has one Master (a desktop: each project has
/// two) and the rest Peers, `n` in all, and all of a project name that Master.
pub fn all_right(items: &[Arc<ControllerRegistration>], n: usize, projects: usize) -> bool {
    #[derive(Default)]
    struct Project {
        masters: usize,
        peers: usize,
        named: BTreeSet<String>,
        master: Option<String>,
        desktop_master: bool,
    }
    let mut by_project: BTreeMap<&str, Project> = BTreeMap::new();
    for r in items {
        let e = by_project.entry(r.spec.project_id.as_str()).or_default();
        let Some(st) = &r.status else { return false };
        match st.role {
            Role::Master => {
                e.masters += 1;
                e.master = Some(r.name_any());
                e.desktop_master = r.spec.agent_surface.is_desktop();
            }
            Role::Peer => e.peers += 1,
            _ => {}
        }
        if let Some(m) = &st.master {
            e.named.insert(m.name.clone());
        }
    }
    let per_project = n / projects;
    items.len() == n
        && by_project.len() == projects
        && by_project.values().all(|p| {
            p.masters == 1
                && p.peers == per_project - 1
                && p.desktop_master
                && p.named.len() == 1
                && p.master.as_ref().is_some_and(|m| p.named.contains(m))
        })
}

/// What one round measured.
pub struct Round {
    /// Seconds the API server took to accept the creates.
    pub accepted: f64,
    /// Seconds until every status was right (None: not within the time allowed).
    pub right_at: Option<f64>,
    /// right_at / accepted (infinite when it never converged).
    pub ratio: f64,
    /// The operator's VmHWM once converged.
    pub peak_rss_mib: f64,
    /// API server writes during the round, by "VERB resource[/subresource]".
    pub writes: BTreeMap<String, f64>,
}

/// The round's namespace and operator, still running, with a watch-fed cache of the
/// registrations (aborted on drop).
pub struct Live {
    pub ns: String,
    pub op: support::Operator,
    pub api: Api<ControllerRegistration>,
    pub seen: reflector::Store<ControllerRegistration>,
    watch: tokio::task::JoinHandle<()>,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

/// One round at size `n` (a multiple of PER_PROJECT): a fresh namespace and operator
/// (`env` added to its environment) on `db_url`.
pub async fn convergence(
    cp: &'static support::ControlPlane,
    client: &kube::Client,
    db_url: &str,
    n: usize,
    env: &[(&str, &str)],
    round: usize,
) -> (Round, Live) {
    let projects = n / PER_PROJECT;
    let ns = support::namespace(client, "benchconv").await;
    let op = support::Operator::start(cp, db_url, &ns, env).await;
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    let (seen, writer) = reflector::store();
    let watch = tokio::spawn(
        watcher(api.clone(), watcher::Config::default())
            .default_backoff()
            .reflect(writer)
            .for_each(|_| std::future::ready(())),
    );
    // Warm up: the operator's watch, connections and pools are up once one registration
    // has its status. Its start-up is not what this measures.
    let spec = ControllerRegistrationSpec {
        project_id: "warm-up".into(),
        session_id: "warm-up".into(),
        agent_surface: AgentSurface::Other,
    };
    api.create(&PostParams::default(), &ControllerRegistration::new("warm-up", spec)).await.expect("create");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !seen.state().iter().any(|r| r.status.as_ref().is_some_and(|s| s.role == Role::Master)) {
        assert!(Instant::now() < deadline, "warm-up registration got no status in 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its last writes (an Event) may trail its status.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let writes_before = apiserver_writes(client).await.expect("API server /metrics");
    let mine = control_plane_needle(&cp.kubeconfig);
    let cpu_now =
        || [cpu_of("kube-apiserver", &mine), cpu_of("etcd", &mine), cpu_of("postgres", ""), cpu_seconds(op.pid())];
    let cpu_before = cpu_now();
    let started = Instant::now();
    futures::stream::iter(0..n)
        .map(|k| {
            let api = api.clone();
            async move {
                let (name, spec) = registration(k, projects);
                api.create(&PostParams::default(), &ControllerRegistration::new(&name, spec)).await.expect("create");
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
    let accepted = started.elapsed();
    // Statuses are read from a watch-fed cache, not by listing: a LIST of thousands of
    // objects every 100 ms would load the API server more than the operator does.
    let allowed = Duration::from_secs(300).max(accepted * 10);
    let converged = loop {
        let state = seen.state();
        let measured: Vec<_> = state.into_iter().filter(|r| r.name_any().starts_with('c')).collect();
        if all_right(&measured, n, projects) {
            break Some(started.elapsed());
        }
        if started.elapsed() > allowed {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20).max(Duration::from_micros(n as u64 * 5))).await;
    };
    let cpu_after = cpu_now();
    let cpu: Vec<f64> = cpu_after.iter().zip(cpu_before).map(|(a, b)| a - b).collect();
    // Writes that trail the last status (Events) belong to the round.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let writes = writes_since(&apiserver_writes(client).await.expect("API server /metrics"), &writes_before);
    let peak_rss_mib = peak_rss_mib(op.pid());
    let live = Live { ns, op, api, seen, watch };
    let accepted = accepted.as_secs_f64();
    let Some(converged) = converged else {
        println!("    round {round}: did not converge within {}s", allowed.as_secs());
        return (Round { accepted, right_at: None, ratio: f64::INFINITY, peak_rss_mib, writes }, live);
    };
    let right_at = converged.as_secs_f64();
    let ratio = right_at / accepted;
    println!(
        "    round {round}: accepted in {accepted:.2}s, right at {right_at:.2}s, ratio {ratio:.2}, peak RSS {peak_rss_mib:.1} MiB; CPU s: kube-apiserver {:.1}, etcd {:.1}, postgres (shared) {:.1}, operator {:.1} (of {:.1})",
        cpu[0],
        cpu[1],
        cpu[2],
        cpu[3],
        2.0 * right_at
    );
    (Round { accepted, right_at: Some(right_at), ratio, peak_rss_mib, writes }, live)
}

/// "API server writes per registration besides its create (1.00): 1.16 (PATCH
/// controllerregistrations/status 1.03, ...)" over some rounds of `n` registrations.
pub fn writes_per_registration(rounds: &[Round], n: usize) -> String {
    let mut total: BTreeMap<String, f64> = BTreeMap::new();
    for r in rounds {
        for (k, v) in &r.writes {
            *total.entry(k.clone()).or_default() += v;
        }
    }
    let per = |v: f64| v / (n as f64 * rounds.len().max(1) as f64);
    let creates = total.remove("POST controllerregistrations").unwrap_or(0.0);
    let operator: f64 = total.values().sum();
    let each: Vec<String> = total.iter().map(|(k, v)| format!("{k} {:.2}", per(*v))).collect();
    format!(
        "API server writes per registration besides its create ({:.2}): {:.2} ({})",
        per(creates),
        per(operator),
        each.join(", ")
    )
}

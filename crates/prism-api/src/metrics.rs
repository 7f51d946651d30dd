//! The Prometheus metrics of the process: what the API, the background prober and the
//! reconcilers record, rendered from memory at `/metrics`.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabels {
    pub cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleLabels {
    pub namespace: String,
    pub role: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DependencyLabels {
    pub dependency: String,
}

/// Prometheus metrics, served as text on /metrics. Counters and histograms are this
/// replica's; gauges read from Postgres and Redis at scrape time (`refresh`), so every
/// replica reports the same cluster-wide state.
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ControllerLabels, Counter>,
    reconcile_errors: Family<ControllerLabels, Counter>,
    reconcile_seconds: Family<ControllerLabels, Histogram>,
    pub heartbeats: Counter,
    pub heartbeat_flushes: Counter,
    /// Agents' roles read from Postgres; the other heartbeats were answered from memory.
    pub role_reads: Counter,
    /// Project views the reconcilers read from Postgres; reconciles of one project at once
    /// share a read (`shared_reads`).
    pub project_reads: Counter,
    pub claim_seconds: Histogram,
    pub claims_waiting: Gauge,
    election_events: Family<CauseLabels, Gauge>,
    registrations: Family<RoleLabels, Gauge>,
    pub runs_online: Gauge,
    pub jobs_queued: Gauge,
    jobs: Family<StateLabels, Gauge>,
    job_cancellations: Family<ReasonLabels, Gauge>,
    pub job_dispatch_seconds: Histogram,
    job_attempts: Family<OutcomeLabels, Counter>,
    mcp_tool_calls: Family<ToolCallLabels, Counter>,
    up: Family<DependencyLabels, Gauge>,
    /// Certificates the TLS reload refused (expired, for other names, unusable).
    pub tls_reloads_refused: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// A fixed cause (`CancelCause`), never a caller's text: /metrics is unauthenticated.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

/// Static strings: counted on every MCP tool call, so no allocation for the labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolCallLabels {
    pub tool: &'static str,
    pub via: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("prism");
        let reconciles = Family::<ControllerLabels, Counter>::default();
        let reconcile_errors = Family::<ControllerLabels, Counter>::default();
        let reconcile_seconds = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 14))
        });
        let heartbeats = Counter::default();
        let heartbeat_flushes = Counter::default();
        let role_reads = Counter::default();
        let project_reads = Counter::default();
        let claim_seconds = Histogram::new(exponential_buckets(0.0005, 2.0, 14));
        let claims_waiting = Gauge::default();
        let election_events = Family::<CauseLabels, Gauge>::default();
        let registrations = Family::<RoleLabels, Gauge>::default();
        let runs_online = Gauge::default();
        let jobs_queued = Gauge::default();
        let jobs = Family::<StateLabels, Gauge>::default();
        let job_cancellations = Family::<ReasonLabels, Gauge>::default();
        let job_dispatch_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 20));
        let job_attempts = Family::<OutcomeLabels, Counter>::default();
        let mcp_tool_calls = Family::<ToolCallLabels, Counter>::default();
        let up = Family::<DependencyLabels, Gauge>::default();
        let tls_reloads_refused = Counter::default();
        // 1, labelled with the release: during a rolling upgrade each replica's scrape
        // says which version answered (SPEC §15).
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info.get_or_create(&BuildLabels { version: prism_core::release::VERSION }).set(1);
        registry.register("build_info", "The release this replica runs (label version), always 1", build_info);
        registry.register(
            "tls_reloads_refused",
            "TLS certificate files that changed but were not served (not valid now, not for the served names, unusable); the previous certificate is served",
            tls_reloads_refused.clone(),
        );
        registry.register(
            "runtime_claim_duration_seconds",
            "Job claim latency (token check + claim)",
            claim_seconds.clone(),
        );
        registry.register(
            "runtime_claims_waiting",
            "Long-poll claims waiting on this replica for a job (SPEC §11)",
            claims_waiting.clone(),
        );
        registry.register(
            "election_events",
            "Changes of master by cause (all replicas, from Postgres)",
            election_events.clone(),
        );
        registry.register(
            "controller_registrations",
            "Live registrations per namespace and role",
            registrations.clone(),
        );
        registry.register("runtime_runs_online", "Runs holding a session lease", runs_online.clone());
        registry.register("runtime_jobs_queued", "Jobs waiting to be claimed", jobs_queued.clone());
        registry.register("runtime_jobs", "Jobs by state (all replicas, from Postgres)", jobs.clone());
        registry.register(
            "runtime_job_cancellations",
            "Cancelled jobs by cause: requested, stale_term, identity_deleted, expired, grace, run_cancelled (all replicas, from Postgres; finished jobs are pruned after the retention)",
            job_cancellations.clone(),
        );
        registry.register(
            "runtime_job_dispatch_seconds",
            "Enqueue to first claim of a job (this replica's claims)",
            job_dispatch_seconds.clone(),
        );
        registry.register(
            "runtime_job_attempts_ended",
            "Job attempts ended, by outcome: succeeded, failed (for good), requeued (retried), cancelled",
            job_attempts.clone(),
        );
        registry.register("dependency_up", "1 when the dependency answers (postgres, redis)", up.clone());
        registry.register("reconciles", "Reconciliations per controller", reconciles.clone());
        registry.register("reconcile_errors", "Failed reconciliations per controller", reconcile_errors.clone());
        registry.register("reconcile_duration_seconds", "Reconciliation duration", reconcile_seconds.clone());
        registry.register("controller_heartbeats", "Agent heartbeats received", heartbeats.clone());
        registry.register(
            "controller_heartbeat_flushes",
            "Batched heartbeat UPDATEs written",
            heartbeat_flushes.clone(),
        );
        registry.register(
            "controller_role_reads",
            "Agents' roles read from Postgres for an answer (the others came from memory)",
            role_reads.clone(),
        );
        registry.register(
            "controller_project_reads",
            "Project views the reconcilers read from Postgres (a project's registrations reconciled together share one)",
            project_reads.clone(),
        );
        registry.register(
            "mcp_tool_calls",
            "MCP tool calls by tool, answered by the /mcp gate itself (via=direct) or through the MCP SDK (via=sdk)",
            mcp_tool_calls.clone(),
        );
        Self {
            registry,
            reconciles,
            reconcile_errors,
            reconcile_seconds,
            heartbeats,
            heartbeat_flushes,
            role_reads,
            project_reads,
            claim_seconds,
            claims_waiting,
            election_events,
            registrations,
            runs_online,
            jobs_queued,
            jobs,
            job_cancellations,
            job_dispatch_seconds,
            job_attempts,
            mcp_tool_calls,
            up,
            tls_reloads_refused,
        }
    }
}

impl Metrics {
    pub fn set_up(&self, dependency: &str, up: bool) {
        self.up.get_or_create(&DependencyLabels { dependency: dependency.to_string() }).set(i64::from(up));
    }

    pub fn set_election_events(&self, cause: crate::election::Cause, n: i64) {
        self.election_events.get_or_create(&CauseLabels { cause: cause.to_string() }).set(n);
    }

    /// Live registrations per (namespace, is_master); a namespace with none left drops out.
    pub fn set_registrations(&self, counts: Vec<(String, bool, i64)>) {
        self.registrations.clear();
        for (namespace, master, n) in counts {
            let role = if master { "master" } else { "peer" }.to_string();
            self.registrations.get_or_create(&RoleLabels { namespace, role }).set(n);
        }
    }

    /// Jobs by state and cancellations by reason, as counted in Postgres.
    pub fn set_jobs(&self, census: &crate::run_registry::jobs::JobCensus) {
        self.jobs.clear();
        for state in crate::run_registry::jobs::JobState::ALL {
            let n = census.by_state.iter().find(|(s, _)| s == state).map(|(_, n)| *n).unwrap_or(0);
            self.jobs.get_or_create(&StateLabels { state: state.to_string() }).set(n);
        }
        self.jobs_queued.set(
            census
                .by_state
                .iter()
                .find(|(s, _)| *s == crate::run_registry::jobs::JobState::Queued)
                .map(|(_, n)| *n)
                .unwrap_or(0),
        );
        self.job_cancellations.clear();
        for (reason, n) in &census.cancelled {
            self.job_cancellations.get_or_create(&ReasonLabels { reason: reason.as_str() }).set(*n);
        }
    }

    /// An MCP tool call, by tool and by the path that answered it (`mcp::direct`).
    pub fn mcp_tool_called(&self, tool: &'static str, via: &'static str) {
        self.mcp_tool_calls.get_or_create(&ToolCallLabels { tool, via }).inc();
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// The reconcilers count through the same families (`prism_kube::reconcilers`).
impl crate::reconcilers::ReconcileMetrics for Metrics {
    fn reconciled(&self, controller: &str, took: Duration, failed: bool) {
        let labels = ControllerLabels { controller: controller.to_string() };
        self.reconciles.get_or_create(&labels).inc();
        self.reconcile_seconds.get_or_create(&labels).observe(took.as_secs_f64());
        if failed {
            self.reconcile_errors.get_or_create(&labels).inc();
        }
    }

    /// `n` job attempts ended with `outcome`.
    fn attempts_ended(&self, outcome: &str, n: u64) {
        if n > 0 {
            self.job_attempts.get_or_create(&OutcomeLabels { outcome: outcome.to_string() }).inc_by(n);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_scrape_says_which_release_answered() {
        let text = super::Metrics::default().render();
        let line = format!("prism_build_info{{version=\"{}\"}} 1", prism_core::release::VERSION);
        assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
    }
}

//! Command line and environment configuration. Every setting is a flag with an env
//! fallback; a missing or malformed one is a one-line error at start, never a panic.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
// Where the stores are, said in their own terms (prism-store), parsed here.
pub use prism_api::settings::{ApiArgs, SettingsError};
pub use prism_store::db::redact_url;
pub use prism_store::run_registry::RedisEndpoint;

#[derive(Debug, Parser)]
#[command(name = "prism-operator", version, about = "Kubernetes operator for controller elections and Run sessions")]
pub struct Cli {
    #[command(flatten)]
    pub log: LogArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the controllers, the HTTP API, the stale sweep and the job reaper.
    Run(Box<RunArgs>),
    /// Print both CRDs as YAML (or write one file per CRD with --out-dir).
    Crdgen {
        /// Write `<crd name>.yaml` files into this directory instead of printing.
        #[arg(long)]
        out_dir: Option<PathBuf>,
    },
    /// Apply the database migrations (idempotent).
    Migrate(DatabaseArgs),
    /// Key pairs for Runs.
    #[command(subcommand)]
    Credential(CredentialCommand),
    /// A minimal Run: hello with a key file, heartbeat, claim jobs (watch its RunSession
    /// go Online in `kubectl get rsess`).
    #[command(alias = "run-agent")]
    DemoRun(DemoRunArgs),
    /// Print a project's routing table (master, peers, stale) from the resources' status.
    Status {
        project_id: String,
        /// Namespace of the project (default: the kubeconfig context's).
        #[arg(short, long)]
        namespace: Option<String>,
        #[arg(short, long, value_enum, default_value = "table")]
        output: OutputFormat,
        /// After the table, print it again at each change of a role, the term or the
        /// members (as `kubectl get -w`), until interrupted.
        #[arg(short, long)]
        watch: bool,
    },
    /// Durable jobs of Runs (list, get, cancel), through the operator's HTTP API.
    #[command(subcommand)]
    Jobs(JobsCommand),
    /// An agent's round trip through a running operator: readyz, register, status, fence,
    /// wrap (what the chart's `helm test` Pod runs).
    Selftest(SelftestArgs),
}

/// `selftest`: where the API is and who calls it.
#[derive(Debug, Args)]
pub struct SelftestArgs {
    /// The operator's HTTP API.
    #[arg(long, env = "PRISM_API", default_value = "http://127.0.0.1:8080")]
    pub api: String,
    /// A file holding the bearer token: a ServiceAccount token for the operator's
    /// audience (in a Pod, a projected token volume).
    #[arg(long, env = "PRISM_TOKEN_FILE", default_value = "/var/run/secrets/prism/token")]
    pub token_file: PathBuf,
    /// A CA certificate (PEM) to trust beside the system's; skipped with a note when the
    /// file is absent (a TLS Secret without ca.crt).
    #[arg(long, env = "PRISM_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// The namespace to register in (the caller may create ControllerRegistrations there).
    #[arg(short, long)]
    pub namespace: String,
}

/// How the CLI reaches the operator's HTTP API (not the Kubernetes API).
#[derive(Debug, Args)]
pub struct ApiClientArgs {
    /// The operator's HTTP API.
    #[arg(long, env = "PRISM_API", default_value = "http://127.0.0.1:8080")]
    pub api: String,
    /// Bearer token: a Kubernetes token for the operator's audience
    /// (`kubectl create token <serviceaccount> --audience prism-operator`).
    #[arg(long, env = "PRISM_TOKEN", hide_env_values = true)]
    pub token: String,
    /// A CA certificate (PEM) to trust beside the system's, for an operator serving TLS
    /// with a private CA (the chart's Secret has it as `ca.crt`).
    #[arg(long, env = "PRISM_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
}

/// The states of a job (SPEC §5.1), as `--state` takes them.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum JobStateArg {
    Queued,
    Claimed,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobStateArg {
    pub fn as_str(self) -> &'static str {
        match self {
            JobStateArg::Queued => "queued",
            JobStateArg::Claimed => "claimed",
            JobStateArg::Running => "running",
            JobStateArg::Succeeded => "succeeded",
            JobStateArg::Failed => "failed",
            JobStateArg::Cancelled => "cancelled",
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum JobsCommand {
    /// List a namespace's jobs, newest first.
    List(JobsListArgs),
    /// Show one job.
    Get(JobsGetArgs),
    /// Cancel a job: a queued one at once, one in flight by telling its Run.
    Cancel(JobsCancelArgs),
}

#[derive(Debug, Args)]
pub struct JobsListArgs {
    /// Namespace that owns the jobs (the namespace of their RunSession).
    #[arg(short, long)]
    pub namespace: String,
    /// Only jobs for this server instance.
    #[arg(long = "server", value_name = "SERVER_INSTANCE_ID")]
    pub server_instance_id: Option<String>,
    /// Only jobs for this component kind.
    #[arg(long = "component", value_name = "COMPONENT_KIND")]
    pub component_kind: Option<String>,
    /// Only jobs in this state.
    #[arg(long, value_enum)]
    pub state: Option<JobStateArg>,
    /// Jobs per page (default: the API's).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=500))]
    pub limit: Option<u32>,
    /// Start after this cursor (the `next_cursor` of an earlier page).
    #[arg(long, value_name = "CURSOR", conflicts_with = "all")]
    pub after: Option<String>,
    /// Follow the cursors to the last page and print every job.
    #[arg(long)]
    pub all: bool,
    #[arg(short, long, value_enum, default_value = "table")]
    pub output: OutputFormat,
    #[command(flatten)]
    pub api: ApiClientArgs,
}

#[derive(Debug, Args)]
pub struct JobsGetArgs {
    /// The job's id (a uuid).
    pub id: uuid::Uuid,
    /// Namespace that owns the job.
    #[arg(short, long)]
    pub namespace: String,
    #[arg(short, long, value_enum, default_value = "table")]
    pub output: OutputFormat,
    #[command(flatten)]
    pub api: ApiClientArgs,
}

#[derive(Debug, Args)]
pub struct JobsCancelArgs {
    /// The job's id (a uuid).
    pub id: uuid::Uuid,
    /// Namespace that owns the job.
    #[arg(short, long)]
    pub namespace: String,
    /// Why (kept as the job's cancel_reason).
    #[arg(long)]
    pub reason: Option<String>,
    #[command(flatten)]
    pub api: ApiClientArgs,
}

#[derive(Debug, Subcommand)]
pub enum CredentialCommand {
    /// Create an Ed25519 key pair for a Run: the private key goes to a file (mode 0600),
    /// the `spec.credential` block for its RunSession is printed.
    New {
        /// Where to write the private key (refuses to overwrite without --force).
        #[arg(long, default_value = "run.key")]
        key_file: PathBuf,
        /// The credential generation (raise it to rotate: older keys stop working).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i64).range(1..))]
        generation: i64,
        #[arg(long)]
        force: bool,
    },
}

#[derive(Debug, Args)]
pub struct DemoRunArgs {
    /// The operator's HTTP API.
    #[arg(long, env = "PRISM_API", default_value = "http://127.0.0.1:8080")]
    pub api: String,
    #[arg(long)]
    pub server_instance_id: String,
    #[arg(long, default_value = "run")]
    pub component_kind: String,
    #[arg(long, default_value_t = 1)]
    pub generation: i64,
    /// Private key file from `credential new`.
    #[arg(long, default_value = "run.key")]
    pub key_file: PathBuf,
    /// Complete claimed jobs as succeeded (a demo worker); without it jobs are only acknowledged.
    #[arg(long)]
    pub complete_jobs: bool,
    /// A CA certificate (PEM) to trust beside the system's, for an operator serving TLS
    /// with a private CA (the chart's Secret has it as `ca.crt`).
    #[arg(long, env = "PRISM_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum OutputFormat {
    Table,
    Json,
    Yaml,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct LogArgs {
    /// Log format; the filter comes from RUST_LOG (default `info`).
    #[arg(long, env = "PRISM_LOG_FORMAT", value_enum, default_value = "text", global = true)]
    pub log_format: LogFormat,
}

#[derive(Debug, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL (postgres://user:password@host:port/db).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Redis URL (redis://host:port); with --redis-mode cluster, a comma-separated list of
    /// seed nodes of a Redis Cluster. Redis is required: there is no in-memory fallback.
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// `standalone` (one Redis) or `cluster` (a Redis Cluster; REDIS_URL lists seed nodes).
    /// Checked by `validate`, not clap, so a bad value is an error naming the variable.
    #[arg(long, env = "PRISM_REDIS_MODE", default_value = "standalone")]
    pub redis_mode: String,
    /// Prefix of every Redis key this operator writes.
    #[arg(long, env = "PRISM_REDIS_PREFIX", default_value = "prism")]
    pub redis_prefix: String,
    /// The HTTP and MCP API: its listener, tokens, limits and TLS (prism-api reads them).
    #[command(flatten)]
    pub api: ApiArgs,
    /// A registration whose last heartbeat is older than this is released as stale.
    #[arg(long, env = "PRISM_CONTROLLER_PEER_STALE_MINUTES", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(1..=10_080))]
    pub peer_stale_minutes: u32,
    /// How often the stale sweep runs (it also runs once at start).
    #[arg(long, env = "PRISM_SWEEP_INTERVAL_SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u32).range(1..=86_400))]
    pub sweep_interval_seconds: u32,
    /// Default Run session lease; a RunSession's spec.leaseSeconds overrides it.
    #[arg(long, env = "PRISM_RUN_LEASE_SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u32).range(5..=3600))]
    pub run_lease_seconds: u32,
    /// How often a live registration's or Run's `status.lastHeartbeat` is refreshed when
    /// nothing else changed, and how often live registrations are reconciled for it. Every
    /// live object costs the API server one status write per this many seconds (10,000
    /// registrations + 10,000 Runs: ~80 writes/s at 240, measured 151-158/s at 120, so the
    /// default is 240 for the <= 100/s goal); roles, phases and the Stale condition are
    /// written when they change, whatever this says.
    #[arg(long, env = "PRISM_STATUS_HEARTBEAT_SECONDS", default_value_t = 240,
          value_parser = clap::value_parser!(u32).range(10..=3600))]
    pub status_heartbeat_seconds: u32,
    /// A claimed job not progressed within this many seconds returns to the queue.
    #[arg(long, env = "PRISM_JOB_VISIBILITY_SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u32).range(1..=86_400))]
    pub job_visibility_seconds: u32,
    /// Attempts a job gets when its enqueue names none (SPEC §5.1).
    #[arg(long, env = "PRISM_JOB_MAX_ATTEMPTS", default_value_t = 3,
          value_parser = clap::value_parser!(u8).range(1..=100))]
    pub job_max_attempts: u8,
    /// How long one attempt may run when its enqueue names no `timeout_seconds`.
    #[arg(long, env = "PRISM_JOB_TIMEOUT_SECONDS", default_value_t = 600,
          value_parser = clap::value_parser!(u32).range(1..=86_400))]
    pub job_timeout_seconds: u32,
    /// How long a Run has to stop a job whose cancel was requested before it is
    /// cancelled anyway (its later steps are then 409 `job_finished`).
    #[arg(long, env = "PRISM_JOB_CANCEL_GRACE_SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u32).range(1..=86_400))]
    pub job_cancel_grace_seconds: u32,
    /// Queued jobs one namespace may hold at once; an enqueue beyond is 429
    /// `quota_exceeded` (SPEC §12).
    #[arg(long, env = "PRISM_MAX_QUEUED_JOBS_PER_NAMESPACE", default_value_t = 100_000,
          value_parser = clap::value_parser!(u32).range(1..=100_000_000))]
    pub max_queued_jobs_per_namespace: u32,
    /// A job still queued this many hours after its enqueue is cancelled (reason
    /// `expired`): nothing waits for a Run forever.
    #[arg(long, env = "PRISM_JOB_QUEUED_TTL_HOURS", default_value_t = 72,
          value_parser = clap::value_parser!(u32).range(1..=87_600))]
    pub job_queued_ttl_hours: u32,
    /// Reconciles in flight at once per controller: bounds the operator's connections to
    /// the API server (and its memory) when many resources change together. Reconciles
    /// mostly wait on the API server and Postgres, so this is well above the core count.
    #[arg(long, env = "PRISM_RECONCILE_CONCURRENCY", default_value_t = 64,
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub reconcile_concurrency: u16,
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "PRISM_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,
    /// The ConfigMap (in the operator's namespace, POD_NAMESPACE) that keeps how far the
    /// election history went, so that a restored database never reissues a term (SPEC §15).
    #[arg(long, env = "PRISM_TERM_MARK", default_value = "prism-operator-terms")]
    pub term_mark: String,
    /// Released registrations' resources are deleted this many hours after their release.
    #[arg(long, env = "PRISM_RELEASED_RETENTION_HOURS", default_value_t = 24,
          value_parser = clap::value_parser!(u32).range(1..=87_600))]
    pub released_retention_hours: u32,
    /// Released rows, election history and nudges are deleted after this many days.
    #[arg(long, env = "PRISM_HISTORY_RETENTION_DAYS", default_value_t = 30,
          value_parser = clap::value_parser!(u32).range(1..=36_500))]
    pub history_retention_days: u32,
    /// How often retention runs (deletes released resources and prunes old rows).
    #[arg(long, env = "PRISM_RETENTION_INTERVAL_SECONDS", default_value_t = 600,
          value_parser = clap::value_parser!(u32).range(1..=86_400))]
    pub retention_interval_seconds: u32,
    /// Postgres connections of the HTTP API (agents, Runs), and of the controllers and
    /// background loops: two pools, so a flood of API calls cannot starve the election's
    /// reconciles or the sweep, and /readyz does not fail because the API pool is busy.
    /// (Defaults 12 + 8: three replicas stay well inside Postgres' default of 100.)
    #[arg(long, env = "PRISM_API_DB_CONNECTIONS", default_value_t = 12,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub api_db_connections: u32,
    #[arg(long, env = "PRISM_CONTROLLER_DB_CONNECTIONS", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub controller_db_connections: u32,
    /// Trust the owner annotation (`prism.ntecdev.ai/owner`) of ControllerRegistrations:
    /// only when an admission policy stamps it with the creator's username and forbids
    /// every other value, as the chart's does (the chart sets this when it installs the
    /// policy). Without it a kubectl registration has no known owner.
    #[arg(long, env = "PRISM_TRUST_OWNER_ANNOTATION", default_value = "false", value_parser = parse_switch, action = clap::ArgAction::Set)]
    pub trust_owner_annotation: bool,
    /// Run controllers and the sweep only on the holder of a coordination.k8s.io Lease.
    #[arg(long, env = "PRISM_LEADER_ELECTION", default_value = "true", value_parser = parse_switch, action = clap::ArgAction::Set)]
    pub leader_election: bool,
    /// On SIGTERM: seconds not ready but still serving, before the listener closes and
    /// streams end (the time a Service takes to stop sending new connections; the chart
    /// sets 5). 0: close at once.
    #[arg(long, env = "PRISM_SHUTDOWN_DELAY_SECONDS", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=60))]
    pub shutdown_delay_seconds: u32,
}

/// `true/false`, `on/off`, `1/0`, `yes/no`: what people write in Helm values and env.
fn parse_switch(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "on" | "1" | "yes" => Ok(true),
        "false" | "off" | "0" | "no" => Ok(false),
        other => Err(format!("expected true or false, got {other:?}")),
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{0} is not set (flag --{1})")]
    Missing(&'static str, &'static str),
    #[error("{0} is malformed: {1}")]
    Malformed(&'static str, String),
    #[error("{0} is set but {1} is not: set both or neither")]
    Unpaired(&'static str, &'static str),
    #[error("{0}: {1}")]
    Unusable(&'static str, String),
    /// A setting of the API's (prism-api reads them).
    #[error(transparent)]
    Api(#[from] SettingsError),
}

impl DatabaseArgs {
    /// The URL, checked for shape only (the connection is tried later).
    pub fn url(&self) -> Result<&str, ConfigError> {
        let url = self.database_url.as_deref().filter(|u| !u.trim().is_empty());
        let url = url.ok_or(ConfigError::Missing("DATABASE_URL", "database-url"))?;
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(ConfigError::Malformed(
                "DATABASE_URL",
                "expected postgres://user:password@host:port/database".into(),
            ));
        }
        Ok(url)
    }
}

fn is_redis_url(url: &str) -> bool {
    url.starts_with("redis://") || url.starts_with("rediss://")
}

impl RunArgs {
    pub fn shutdown_delay(&self) -> std::time::Duration {
        std::time::Duration::from_secs(u64::from(self.shutdown_delay_seconds))
    }

    /// REDIS_URL read as PRISM_REDIS_MODE says, checked for shape only.
    pub fn redis_endpoint(&self) -> Result<RedisEndpoint, ConfigError> {
        let cluster = match self.redis_mode.trim().to_ascii_lowercase().as_str() {
            "standalone" => false,
            "cluster" => true,
            other => {
                return Err(ConfigError::Malformed(
                    "PRISM_REDIS_MODE",
                    format!("expected standalone or cluster, got {other:?}"),
                ));
            }
        };
        let url = self.redis_url.as_deref().map(str::trim).filter(|u| !u.is_empty());
        let url = url.ok_or(ConfigError::Missing("REDIS_URL", "redis-url"))?;
        if !cluster {
            if url.contains(',') {
                return Err(ConfigError::Malformed(
                    "REDIS_URL",
                    "a list of seed nodes needs PRISM_REDIS_MODE=cluster".into(),
                ));
            }
            if !is_redis_url(url) {
                return Err(ConfigError::Malformed("REDIS_URL", "expected redis://host:port".into()));
            }
            return Ok(RedisEndpoint::Standalone(url.to_string()));
        }
        let nodes: Vec<String> = url.split(',').map(str::trim).filter(|n| !n.is_empty()).map(String::from).collect();
        if nodes.is_empty() || !nodes.iter().all(|n| is_redis_url(n)) {
            return Err(ConfigError::Malformed(
                "REDIS_URL",
                "expected seed nodes redis://host:port,redis://host:port,... (PRISM_REDIS_MODE=cluster)".into(),
            ));
        }
        // The cluster client speaks one scheme to every node: a mix is a typo, not a plan.
        if nodes.iter().any(|n| n.starts_with("rediss://") != nodes[0].starts_with("rediss://")) {
            return Err(ConfigError::Malformed("REDIS_URL", "seed nodes mix redis:// and rediss://".into()));
        }
        Ok(RedisEndpoint::Cluster(nodes))
    }

    /// Checks everything that can be checked without connecting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.database.url()?;
        self.redis_endpoint()?;
        let prefix_ok = !self.redis_prefix.is_empty()
            && self.redis_prefix.len() <= 64
            && self.redis_prefix.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if !prefix_ok {
            return Err(ConfigError::Malformed("PRISM_REDIS_PREFIX", "use 1-64 characters of [A-Za-z0-9._-]".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(args: &[&str]) -> Result<RunArgs, clap::Error> {
        let mut argv = vec!["prism-operator", "run"];
        argv.extend_from_slice(args);
        match Cli::try_parse_from(argv)?.command {
            Command::Run(r) => Ok(*r),
            _ => unreachable!("parsed the run subcommand"),
        }
    }

    #[test]
    fn defaults_follow_the_spec() {
        let a = run_args(&["--database-url", "postgres://a@b/c", "--redis-url", "redis://x"]).unwrap();
        assert_eq!(a.redis_prefix, "prism");
        assert_eq!(a.api.listen.to_string(), "0.0.0.0:8080");
        assert_eq!(a.peer_stale_minutes, 10);
        assert_eq!(a.sweep_interval_seconds, 60);
        assert_eq!(a.run_lease_seconds, 30);
        assert!(a.leader_election);
        assert!(a.watch_namespace.is_none());
        assert_eq!(a.redis_mode, "standalone");
        assert_eq!(a.redis_endpoint(), Ok(RedisEndpoint::Standalone("redis://x".into())));
        assert_eq!(a.api.token_audiences, ["prism-operator"]);
        assert_eq!((a.released_retention_hours, a.history_retention_days), (24, 30));
        assert!(!a.trust_owner_annotation);
        assert_eq!(a.validate(), Ok(()));
    }

    #[test]
    fn redis_mode_decides_how_redis_url_is_read() {
        let mut a = run_args(&["--database-url", "postgres://a@b/c"]).unwrap();
        a.redis_mode = "cluster".into();
        a.redis_url = Some(" redis://n1:7001, redis://n2:7002 ,".into());
        assert_eq!(
            a.redis_endpoint(),
            Ok(RedisEndpoint::Cluster(vec!["redis://n1:7001".into(), "redis://n2:7002".into()]))
        );
        a.redis_url = Some("rediss://n1:7001".into());
        assert_eq!(a.redis_endpoint(), Ok(RedisEndpoint::Cluster(vec!["rediss://n1:7001".into()])));
        a.redis_url = Some("redis://n1:7001,n2:7002".into());
        assert!(a.validate().unwrap_err().to_string().starts_with("REDIS_URL is malformed"));
        a.redis_url = Some("redis://n1:7001,rediss://n2:7002".into());
        assert!(a.validate().unwrap_err().to_string().contains("mix"));
        a.redis_url = Some(",".into());
        assert!(a.validate().unwrap_err().to_string().starts_with("REDIS_URL is malformed"));
        a.redis_mode = "Cluster".into();
        a.redis_url = Some("redis://n1:7001".into());
        assert_eq!(a.validate(), Ok(()));

        // A list without cluster mode is a mistake worth naming; a bad mode names the variable.
        a.redis_mode = "standalone".into();
        a.redis_url = Some("redis://n1:7001,redis://n2:7002".into());
        assert!(a.validate().unwrap_err().to_string().contains("PRISM_REDIS_MODE=cluster"));
        a.redis_mode = "sentinel".into();
        assert_eq!(
            a.validate().unwrap_err().to_string(),
            "PRISM_REDIS_MODE is malformed: expected standalone or cluster, got \"sentinel\""
        );
        let cluster = RedisEndpoint::Cluster(vec!["redis://u:pw@n1:1".into(), "redis://n2:2".into()]);
        assert_eq!(cluster.redacted(), "cluster redis://u:***@n1:1,redis://n2:2");
    }

    #[test]
    fn missing_and_malformed_urls_are_named() {
        // Set fields directly: the environment of the test process may carry real URLs
        // (the binary's own env handling is tested in tests/cli.rs).
        let mut a = run_args(&[]).unwrap();
        a.database.database_url = None;
        a.redis_url = Some("redis://x".into());
        assert_eq!(a.validate().unwrap_err().to_string(), "DATABASE_URL is not set (flag --database-url)");
        a.database.database_url = Some("mysql://x".into());
        assert!(a.validate().unwrap_err().to_string().starts_with("DATABASE_URL is malformed"));
        a.database.database_url = Some("postgres://x/y".into());
        a.redis_url = Some("  ".into());
        assert_eq!(a.validate().unwrap_err(), ConfigError::Missing("REDIS_URL", "redis-url"));
        a.redis_url = Some("redis://x".into());
        a.redis_prefix = "has space".into();
        assert!(a.validate().unwrap_err().to_string().starts_with("PRISM_REDIS_PREFIX is malformed"));
    }

    #[test]
    fn out_of_range_numbers_are_rejected_by_the_parser() {
        assert!(run_args(&["--run-lease-seconds", "1"]).is_err());
        assert!(run_args(&["--peer-stale-minutes", "0"]).is_err());
        assert!(run_args(&["--listen", "nonsense"]).is_err());
        assert!(run_args(&["--leader-election", "maybe"]).is_err());
        assert!(!run_args(&["--leader-election", "off"]).unwrap().leader_election);
    }

    #[test]
    fn jobs_subcommands_parse_as_the_spec_writes_them() {
        let parse = |args: &[&str]| {
            let mut argv = vec!["prism-operator", "jobs"];
            argv.extend_from_slice(args);
            Cli::try_parse_from(argv).map(|c| c.command)
        };
        let api = ["--api", "https://op.example", "--token", "t0k"];
        let mut list = vec!["list", "-n", "runtime", "--server", "srv-1", "--component", "run", "--state", "queued"];
        list.extend(["--limit", "1", "--all", "-o", "json"]);
        list.extend(api);
        match parse(&list).unwrap() {
            Command::Jobs(JobsCommand::List(a)) => {
                assert_eq!(a.namespace, "runtime");
                assert_eq!(a.server_instance_id.as_deref(), Some("srv-1"));
                assert_eq!(a.component_kind.as_deref(), Some("run"));
                assert_eq!(a.state, Some(JobStateArg::Queued));
                assert_eq!((a.limit, a.all, a.output), (Some(1), true, OutputFormat::Json));
                assert_eq!((a.api.api.as_str(), a.api.token.as_str()), ("https://op.example", "t0k"));
            }
            other => panic!("{other:?}"),
        }
        let id = "7f6c0e2a-8d1b-4c3e-9f00-1a2b3c4d5e6f";
        match parse(&["cancel", id, "-n", "runtime", "--reason", "no longer needed", "--token", "t"]).unwrap() {
            Command::Jobs(JobsCommand::Cancel(a)) => {
                assert_eq!(a.id.to_string(), id);
                assert_eq!(a.reason.as_deref(), Some("no longer needed"));
            }
            other => panic!("{other:?}"),
        }
        match parse(&["get", id, "-n", "runtime", "-o", "yaml", "--token", "t"]).unwrap() {
            Command::Jobs(JobsCommand::Get(a)) => assert_eq!(a.output, OutputFormat::Yaml),
            other => panic!("{other:?}"),
        }
        // Bad input is clap's error, before anything is sent.
        assert!(parse(&["get", "not-a-uuid", "-n", "runtime", "--token", "t"]).is_err());
        assert!(parse(&["list", "-n", "runtime", "--state", "done", "--token", "t"]).is_err());
        assert!(parse(&["list", "-n", "runtime", "--limit", "501", "--token", "t"]).is_err());
        assert!(parse(&["list", "-n", "runtime", "--limit", "0", "--token", "t"]).is_err());
        assert!(parse(&["list", "-n", "runtime", "--all", "--after", "c", "--token", "t"]).is_err());
        assert!(parse(&["list", "--token", "t"]).is_err(), "the namespace is required");
    }

    #[test]
    fn redaction_hides_the_password_only() {
        assert_eq!(redact_url("postgres://prism:s3cret@db:5432/prism"), "postgres://prism:***@db:5432/prism");
        assert_eq!(redact_url("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
    }
}

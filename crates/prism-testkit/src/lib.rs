//! The test kit of prism-operator's suites and benches: a real kube-apiserver + etcd
//! (one per test binary, shared by its tests, which isolate themselves by namespace), a
//! Postgres database per test and a Redis key prefix per test, private Postgres and Redis
//! servers to stop and start, operator processes, RBAC, tokens and waits. Nothing here
//! skips: a missing service fails the test that needs it.
//!
//! Every child process a test waits for runs through tokio (`tokio::process`), so a test
//! waiting on kubectl, redis-cli or pg_ctl leaves its runtime free for the operator
//! clients and watches it also drives.
//!
//! The control plane is started by `scripts/control-plane` (a harness of our own rather
//! than the `envtest` crate: that crate drives controller-runtime's Go envtest through a
//! Go bridge and configures the API server without RBAC and ServiceAccount token issuing,
//! which the operator's TokenReview/SubjectAccessReview paths need).
pub mod faults;
pub mod releases;
pub mod runs;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tokio::io::AsyncWriteExt as _;
use tokio::process::{Child, Command};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::events::v1::Event;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use prism_kube::crd::{
    AgentSurface, ControllerRegistration, ControllerRegistrationSpec, ControllerRegistrationStatus, Role, RunPhase,
    RunSession,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

/// The checkout the tests run from. Cargo sets CARGO_MANIFEST_DIR (the root package's
/// directory) when it runs a test or a bench, and that is the one to use: the compile-time
/// value can name another clone, because cargo reuses a test binary built from identical
/// sources in another checkout that shares the target directory (CI clones share
/// `~/.cache/prism-operator/target`).
pub fn repo_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| match std::env::var_os("CARGO_MANIFEST_DIR") {
        Some(dir) => PathBuf::from(dir),
        // This crate lives in crates/prism-testkit of the checkout.
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the checkout"),
    })
}

/// KUBEBUILDER_ASSETS, the envtest convention: the directory with kube-apiserver, etcd
/// and kubectl (scripts/envtest-assets prints it).
pub fn assets_dir() -> PathBuf {
    match std::env::var_os("KUBEBUILDER_ASSETS") {
        Some(dir) => PathBuf::from(dir),
        None => panic!(
            "KUBEBUILDER_ASSETS is not set: run tests through scripts/test, or export KUBEBUILDER_ASSETS=$(scripts/envtest-assets)"
        ),
    }
}

pub struct ControlPlane {
    /// Cluster admin: what tests use to set things up and look.
    pub kubeconfig: PathBuf,
    /// What operator processes use: the admin kubeconfig, or (PRISM_TEST_OPERATOR_RBAC=chart)
    /// a token of the Helm chart's ServiceAccount with exactly the chart's RBAC.
    pub operator_kubeconfig: PathBuf,
    // Holding the pipe keeps the control plane alive; when this process ends, however it
    // ends, the pipe closes and scripts/control-plane stops etcd and kube-apiserver. A
    // std child: it outlives the runtime of the test that started it.
    _stdin: Mutex<ChildStdin>,
    _child: Mutex<std::process::Child>,
}

static CONTROL_PLANE: tokio::sync::OnceCell<ControlPlane> = tokio::sync::OnceCell::const_new();

/// The test binary's control plane, started on first use, with both CRDs installed.
/// Tests of one binary run on runtimes of their own; they share this one.
pub async fn control_plane() -> &'static ControlPlane {
    CONTROL_PLANE.get_or_init(start_control_plane).await
}

async fn start_control_plane() -> ControlPlane {
    let assets = assets_dir();
    let dir = std::env::temp_dir().join(format!("prism-cp-{}-{}", std::process::id(), uuid::Uuid::new_v4().simple()));
    let mut child = std::process::Command::new(repo_root().join("scripts/control-plane"))
        .arg("run")
        .arg(&dir)
        .arg("--stop-on-eof")
        .env("KUBEBUILDER_ASSETS", &assets)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn scripts/control-plane");
    let stdin = child.stdin.take().expect("control plane stdin");
    let stdout = child.stdout.take().expect("control plane stdout");
    // Its first lines are read on a thread of their own: the pipe is a std one.
    let kubeconfig = tokio::task::spawn_blocking(move || {
        for line in BufReader::new(stdout).lines() {
            let line = line.expect("read control plane output");
            if let Some(path) = line.strip_prefix("KUBECONFIG=") {
                return Some(PathBuf::from(path));
            }
        }
        None
    })
    .await
    .expect("read the control plane's output");
    let kubeconfig = kubeconfig.unwrap_or_else(|| panic!("control plane did not start; logs in {}", dir.display()));
    let mut cp = ControlPlane {
        operator_kubeconfig: kubeconfig.clone(),
        kubeconfig,
        _stdin: Mutex::new(stdin),
        _child: Mutex::new(child),
    };
    cp.kubectl_ok(&["apply", "--server-side", "-f", repo_root().join("crds").to_str().expect("utf-8 path")]).await;
    // `kubectl wait` fails outright ("status.conditions accessor error") when it reads a
    // CRD before the API server gave it any condition: a CI run met it. Ask again.
    let wait = [
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/controllerregistrations.prism.ntecdev.ai",
        "crd/runsessions.prism.ntecdev.ai",
    ];
    for attempt in 1.. {
        let out = cp.kubectl(&wait, None).await;
        if out.ok {
            break;
        }
        assert!(attempt < 20 && out.stderr.contains("accessor error"), "kubectl {wait:?} failed: {}", out.stderr);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    cp.kubectl_ok(&["create", "namespace", OPERATOR_NAMESPACE]).await;
    if chart_mode() {
        cp.operator_kubeconfig = chart_rbac_kubeconfig(&cp, &dir).await;
        // As the chart installs it; without it (the default run) the operator adds the
        // finalizer and label itself, so both paths are tested.
        install_admission_policy(&cp).await;
    }
    cp
}

/// The chart's MutatingAdmissionPolicy (finalizer and project label at admission), as
/// `helm install` renders it on a 1.36 cluster; returns once the API server applies it.
pub async fn install_admission_policy(cp: &ControlPlane) {
    let chart = repo_root().join("charts/prism-operator");
    let tmp = std::env::temp_dir().join(format!("prism-helm-{}", uuid::Uuid::new_v4().simple()));
    let out = Command::new(assets_dir().join("helm"))
        .args(["template", "prism", chart.to_str().expect("utf-8"), "--namespace", OPERATOR_NAMESPACE])
        .args(["--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"])
        .args(["--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"])
        .args(["--show-only", "templates/admission-policy.yaml"])
        .env("HELM_CACHE_HOME", tmp.join("cache"))
        .env("HELM_CONFIG_HOME", tmp.join("config"))
        .output()
        .await
        .expect("helm template");
    let _ = std::fs::remove_dir_all(&tmp);
    assert!(out.status.success(), "helm template: {}", String::from_utf8_lossy(&out.stderr));
    let applied = cp.kubectl(&["apply", "-f", "-"], Some(&String::from_utf8_lossy(&out.stdout))).await;
    assert!(applied.ok, "apply the admission policy: {}", applied.stderr);
    // Policies take effect asynchronously: probe with server-side dry runs.
    let probe = "apiVersion: prism.ntecdev.ai/v1alpha1\nkind: ControllerRegistration\nmetadata: {name: policy-probe, namespace: default}\nspec: {projectId: probe, sessionId: probe, agentSurface: other}\n";
    // The operator's mark must be refused to anybody else by the ValidatingAdmissionPolicy
    // (a forged owner is overwritten by the mutating policy before validation).
    let forged = "apiVersion: prism.ntecdev.ai/v1alpha1\nkind: ControllerRegistration\nmetadata: {name: policy-probe, namespace: default, annotations: {prism.ntecdev.ai/registered-by: api}}\nspec: {projectId: probe, sessionId: probe, agentSurface: other}\n";
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = cp
            .kubectl(&["create", "--dry-run=server", "-o", "jsonpath={.metadata.finalizers}", "-f", "-"], Some(probe))
            .await;
        let refused = cp.kubectl(&["create", "--dry-run=server", "-f", "-"], Some(forged)).await;
        if out.ok && out.stdout.contains("prism.ntecdev.ai/release") && !refused.ok {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "admission policy not in effect after 30 s: {}", out.stderr);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether this test run uses the chart's RBAC and admission policy
/// (PRISM_TEST_OPERATOR_RBAC=chart).
pub fn chart_mode() -> bool {
    std::env::var("PRISM_TEST_OPERATOR_RBAC").as_deref() == Ok("chart")
}

/// The namespace the operator "runs in" (its Lease lives there).
pub const OPERATOR_NAMESPACE: &str = "prism-system";

/// helm from the test assets, with homes of its own (no user's repositories, plugins or
/// registry logins): every suite that renders or installs the chart runs it so.
pub fn helm_command() -> std::process::Command {
    let home = std::env::temp_dir().join("prism-helm");
    let mut cmd = std::process::Command::new(assets_dir().join("helm"));
    cmd.env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"));
    cmd
}

/// Installs the chart's ServiceAccount and RBAC (rendered by helm, as a user's install
/// would) and returns a kubeconfig authenticating as that ServiceAccount.
async fn chart_rbac_kubeconfig(cp: &ControlPlane, dir: &Path) -> PathBuf {
    let chart = repo_root().join("charts/prism-operator");
    let mut helm = Command::from(helm_command());
    let out = helm
        .args(["template", "prism", chart.to_str().expect("utf-8"), "--namespace", OPERATOR_NAMESPACE])
        .args(["--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml"])
        .output()
        .await
        .expect("helm template");
    assert!(out.status.success(), "helm template: {}", String::from_utf8_lossy(&out.stderr));
    let rbac = String::from_utf8(out.stdout).expect("utf-8");
    let applied = cp.kubectl(&["apply", "-f", "-"], Some(&rbac)).await;
    assert!(applied.ok, "apply chart RBAC: {}", applied.stderr);
    let token =
        cp.kubectl_ok(&["create", "token", "prism-prism-operator", "-n", OPERATOR_NAMESPACE, "--duration", "6h"]).await;
    let path = dir.join("operator-kubeconfig");
    write_token_kubeconfig(cp, token.trim(), &path);
    eprintln!("operator processes run with the chart's ServiceAccount (PRISM_TEST_OPERATOR_RBAC=chart)");
    path
}

/// A kubeconfig for this control plane that authenticates with `token` (and nothing else).
pub fn write_token_kubeconfig(cp: &ControlPlane, token: &str, path: &Path) {
    let admin: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(&cp.kubeconfig).expect("kubeconfig")).expect("yaml");
    let cluster = &admin["clusters"][0]["cluster"];
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {}\n    certificate-authority-data: {}\nusers:\n- name: u\n  user:\n    token: {}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\n",
        cluster["server"].as_str().expect("server"),
        cluster["certificate-authority-data"].as_str().expect("ca"),
        token.trim()
    );
    std::fs::write(path, kubeconfig).expect("write kubeconfig");
}

/// kubectl with `kubeconfig`, fed `stdin`.
async fn kubectl_with(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(assets_dir().join("kubectl"))
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn kubectl");
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes()).await.expect("write kubectl stdin");
    }
    let out = child.wait_with_output().await.expect("kubectl output");
    Output {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

pub struct Output {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl ControlPlane {
    /// Runs the kubectl built with the API server (same version) against this control plane.
    pub async fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Output {
        kubectl_with(&self.kubeconfig, args, stdin).await
    }

    /// kubectl as the holder of `token` (a token for the API server's audience), not as admin.
    pub async fn kubectl_as(&self, token: &str, args: &[&str], stdin: Option<&str>) -> Output {
        let path = std::env::temp_dir().join(format!("prism-kubeconfig-{}", uuid::Uuid::new_v4().simple()));
        write_token_kubeconfig(self, token, &path);
        let out = kubectl_with(&path, args, stdin).await;
        let _ = std::fs::remove_file(&path);
        out
    }

    pub async fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args, None).await;
        assert!(out.ok, "kubectl {args:?} failed: {}", out.stderr);
        out.stdout
    }

    /// A client for the calling test's own runtime (a client's connections belong to the
    /// runtime that made them, and every #[tokio::test] has its own).
    pub async fn client(&self) -> Client {
        prism_api::install_crypto_provider();
        let kc = Kubeconfig::read_from(&self.kubeconfig).expect("read kubeconfig");
        let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.expect("kubeconfig");
        Client::try_from(config).expect("kube client")
    }
}

/// GET with a bearer token, the answer's JSON body (whatever its status code).
pub async fn get_json(url: &str, token: &str) -> serde_json::Value {
    http().get(url).bearer_auth(token).send().await.expect("GET").json().await.expect("JSON body")
}

/// A fresh namespace for one test.
pub async fn namespace(client: &Client, hint: &str) -> String {
    let name = format!("t-{hint}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).expect("namespace");
    Api::<Namespace>::all(client.clone()).create(&Default::default(), &ns).await.expect("create namespace");
    name
}

/// The Postgres server's URL for the `prism` role (scripts/services prints it).
pub fn admin_database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        panic!("DATABASE_URL is not set: run tests through scripts/test, or eval \"$(scripts/services)\"")
    })
}

/// Whether the operators of this run use the local Redis Cluster: `PRISM_TEST_REDIS=cluster`
/// (scripts/test's second pass) runs the suites with PRISM_REDIS_MODE=cluster against
/// REDIS_CLUSTER_URL; otherwise they use the standalone REDIS_URL.
pub fn redis_cluster_mode() -> bool {
    std::env::var("PRISM_TEST_REDIS").as_deref() == Ok("cluster")
}

/// PRISM_REDIS_MODE for the operators of this run.
pub fn redis_mode() -> &'static str {
    if redis_cluster_mode() { "cluster" } else { "standalone" }
}

/// REDIS_URL for the operators of this run (the cluster's seed nodes in cluster mode).
pub fn redis_url() -> String {
    if redis_cluster_mode() {
        return redis_cluster_url();
    }
    std::env::var("REDIS_URL").unwrap_or_else(|_| {
        panic!("REDIS_URL is not set: run tests through scripts/test, or eval \"$(scripts/services)\"")
    })
}

/// The seed nodes of scripts/services' local Redis Cluster.
pub fn redis_cluster_url() -> String {
    std::env::var("REDIS_CLUSTER_URL").unwrap_or_else(|_| {
        panic!("REDIS_CLUSTER_URL is not set: run tests through scripts/test, or eval \"$(scripts/services)\"")
    })
}

/// `redis-cli -p port args…` on loopback; its stdout (RESP errors included, as text).
pub async fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .await
        .expect("redis-cli (scripts/services installs it)");
    String::from_utf8_lossy(&out.stdout).replace('\r', "")
}

/// A `key:value` line of `INFO` or `CLUSTER INFO` output.
pub fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':').map(|v| v.trim().to_string()))
}

/// A database of the test's own, migrated; dropped when the value is dropped.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

fn with_database(url: &str, db: &str) -> String {
    match url.rfind('/') {
        Some(i) if i > "postgres://".len() => format!("{}/{db}", &url[..i]),
        _ => panic!("DATABASE_URL has no database part: {url}"),
    }
}

impl TestDb {
    pub async fn new() -> TestDb {
        Self::create(true).await
    }

    /// An empty database, without migrations.
    pub async fn empty() -> TestDb {
        Self::create(false).await
    }

    async fn create(migrate: bool) -> TestDb {
        let admin = admin_database_url();
        // The creation time in the name lets scripts/test drop only leftovers of runs
        // that are long over, never the databases of a run going on beside it.
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let name = format!("prism_test_{secs}_{}", uuid::Uuid::new_v4().simple());
        let admin_pool = PgPoolOptions::new().max_connections(1).connect(&admin).await.expect("connect to Postgres");
        // The name is ours (a uuid), not input.
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin_pool)
            .await
            .expect("create test database");
        admin_pool.close().await;
        let url = with_database(&admin, &name);
        let pool = PgPoolOptions::new().max_connections(8).connect(&url).await.expect("connect to test database");
        if migrate {
            prism_store::db::migrate(&pool).await.expect("migrations apply");
        }
        TestDb { name, url, pool }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Async work cannot run in Drop; a short-lived thread with its own runtime can.
        // The pool is not closed there: its connections belong to the test's runtime,
        // which is blocked on this join. FORCE ends them on the server side instead.
        let name = self.name.clone();
        let admin = admin_database_url();
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            rt.block_on(async move {
                if let Ok(admin_pool) = PgPoolOptions::new().max_connections(1).connect(&admin).await {
                    let _ = sqlx::query(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")))
                        .execute(&admin_pool)
                        .await;
                    admin_pool.close().await;
                }
            });
        })
        .join();
    }
}

/// A Redis key prefix of the test's own.
pub fn redis_prefix() -> String {
    format!("prism-test-{}", uuid::Uuid::new_v4().simple())
}

/// Where test servers' ports come from: below the kernel's ephemeral range
/// (/proc/sys/net/ipv4/ip_local_port_range), which every outgoing connection draws its
/// local port from (ours, the operator's, the API server's to etcd). A port found free
/// there cannot be taken by somebody's connect() before its server binds it; a port that
/// the kernel handed out for `bind(0)` can.
fn test_port_range() -> std::ops::Range<u16> {
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let end = ephemeral_start.min(32000);
    let start = end.saturating_sub(12000).max(1024);
    assert!(
        end >= start + 1000,
        "the ephemeral port range starts at {ephemeral_start}: no room below it for test ports"
    );
    start..end
}

/// Ports this process handed out already: two tests of one binary never get the same one.
static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// A loopback port nobody listens on right now, outside the ephemeral range (see
/// `test_port_range`), picked at random so concurrent test runs rarely meet; a server that
/// still loses its port to a race fails with a bind error, which `Operator::start` retries.
pub fn free_port() -> u16 {
    let range = test_port_range();
    let span = u32::from(range.end - range.start);
    for _ in 0..1000 {
        let random = u32::from_le_bytes(uuid::Uuid::new_v4().as_bytes()[..4].try_into().expect("4 bytes"));
        let port = range.start + (random % span) as u16;
        let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
        if handed_out.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed_out.insert(port);
            return port;
        }
    }
    panic!("no free loopback port in {range:?} after 1000 tries")
}

/// The operator binary the tests start: the one PRISM_TEST_OPERATOR_BIN names (scripts/soak
/// runs the fault harness on the release build), or cargo's build beside the running test
/// or bench (cargo builds the package's binary for its tests and benches: the test is
/// `<profile>/deps/<name>-<hash>`, the binary `<profile>/prism-operator`).
pub fn operator_binary() -> PathBuf {
    match std::env::var_os("PRISM_TEST_OPERATOR_BIN") {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => {
            let exe = std::env::current_exe().expect("the test's own path");
            let profile = exe.parent().and_then(Path::parent).expect("a test under <target>/<profile>/deps");
            let binary = profile.join(format!("prism-operator{}", std::env::consts::EXE_SUFFIX));
            assert!(binary.exists(), "no operator binary at {} (build it: cargo build)", binary.display());
            binary
        }
    }
}

/// The term mark (a ConfigMap name) of the operators on the database at `url`.
pub fn term_mark_of(url: &str) -> String {
    let db = url.rsplit('/').next().unwrap_or_default().split('?').next().unwrap_or_default();
    format!("terms-{}", db.to_ascii_lowercase().replace('_', "-"))
}

/// A `prism-operator run` process of the test's own, watching one namespace, killed on drop.
pub struct Operator {
    pub base: String,
    /// Everything the process printed (stdout and stderr).
    pub log: PathBuf,
    child: Child,
}

impl Operator {
    /// Starts the process and returns once it answers /healthz. A port lost to another
    /// process between `free_port` and the operator's bind is retried with a new port.
    pub async fn start(cp: &ControlPlane, database_url: &str, namespace: &str, env: &[(&str, &str)]) -> Operator {
        const ATTEMPTS: u32 = 3;
        for attempt in 1..=ATTEMPTS {
            let port = free_port();
            let log = std::env::temp_dir().join(format!("prism-operator-{port}-{}.log", uuid::Uuid::new_v4().simple()));
            let out = std::fs::File::create(&log).expect("log file");
            let err = out.try_clone().expect("log file");
            let child = Command::new(operator_binary())
                .arg("run")
                .env("DATABASE_URL", database_url)
                .env("REDIS_URL", redis_url())
                .env("PRISM_REDIS_MODE", redis_mode())
                .env("PRISM_REDIS_PREFIX", redis_prefix())
                .env("KUBECONFIG", &cp.operator_kubeconfig)
                .env("POD_NAMESPACE", OPERATOR_NAMESPACE)
                .env("PRISM_LISTEN", format!("127.0.0.1:{port}"))
                .env("PRISM_WATCH_NAMESPACE", namespace)
                .env("PRISM_LEADER_ELECTION", "false")
                .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
                .env("PRISM_LOG_FORMAT", "json")
                // With the chart's RBAC the chart's admission policy is installed too,
                // and the operator trusts the owner annotation it guards, as the chart
                // configures it.
                .env("PRISM_TRUST_OWNER_ANNOTATION", chart_mode().to_string())
                // The term mark of this test's database: the tests share a control
                // plane and a namespace, each its own database (SPEC §15).
                .env("PRISM_TERM_MARK", term_mark_of(database_url))
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .kill_on_drop(true)
                .spawn()
                .expect("prism-operator run starts");
            // An operator given a certificate (tests/transport.rs) serves https only; the
            // wait for it needs no trust, the tests check the certificate themselves.
            let tls = env.iter().any(|(k, _)| *k == "PRISM_TLS_CERT_FILE");
            let scheme = if tls { "https" } else { "http" };
            let mut op = Operator { base: format!("{scheme}://127.0.0.1:{port}"), log, child };
            let http = if tls {
                prism_api::install_crypto_provider();
                reqwest::Client::builder().tls_danger_accept_invalid_certs(true).build().expect("client")
            } else {
                http()
            };
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                if http.get(op.url("/healthz")).send().await.is_ok() {
                    return op;
                }
                if let Some(status) = op.child.try_wait().expect("operator status") {
                    let logs = op.logs();
                    let lost_port = logs.contains("cannot listen on") && logs.contains("in use");
                    if lost_port && attempt < ATTEMPTS {
                        eprintln!("operator lost port {port} to another process; retrying with a new port");
                        break;
                    }
                    panic!("operator exited ({status}) before answering /healthz:\n{logs}");
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "operator did not answer /healthz within 30 s:\n{}",
                    op.logs()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// One replica of several on one database and namespace: leader election on, `pod`
    /// its identity in the Lease.
    pub async fn replica(cp: &ControlPlane, database_url: &str, namespace: &str, pod: &str) -> Operator {
        Operator::start(cp, database_url, namespace, &[("PRISM_LEADER_ELECTION", "true"), ("POD_NAME", pod)]).await
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("the operator is running")
    }

    /// How the process ended, if it has (a test that expects it to carry on checks None).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("operator status")
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `kill -9`: no graceful anything; returns once the process is gone.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

// Dropped, the process is killed (`kill_on_drop`) and reaped by tokio in the background.

/// Polls `check` until it returns Some, or fails the test after `secs` seconds.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "timed out after {secs}s waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How long the operator's /metrics may lag the truth: its gauges are refreshed in the
/// background every 10 s (SPEC §12: a snapshot at most 15 s old).
pub const METRICS_LAG_SECS: u64 = 20;

/// Waits until the operator's /metrics has a line `line`; returns the whole text.
pub async fn metric_line(op: &Operator, line: &str) -> String {
    let url = op.url("/metrics");
    eventually(METRICS_LAG_SECS, &format!("/metrics line {line}"), || async {
        let text = http().get(&url).send().await.ok()?.text().await.ok()?;
        text.lines().any(|l| l == line).then_some(text)
    })
    .await
}

/// The value of the operator's metric `name` (a counter's `_total`, a gauge) on the first
/// line of it whose labels contain `labels` ("" for one without labels); 0 when there is
/// none yet.
pub async fn metric_value(op: &Operator, name: &str, labels: &str) -> f64 {
    let text = match http().get(op.url("/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(e) => panic!("GET /metrics: {e}"),
    };
    text.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{')))
        .find(|l| l.contains(labels))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Polls the named object until `pred` holds for it; returns it (fails the test after
/// `secs` seconds).
pub async fn wait_for<K>(api: &Api<K>, name: &str, secs: u64, what: &str, pred: impl Fn(&K) -> bool) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    eventually(secs, what, || async {
        let obj = api.get_opt(name).await.ok().flatten()?;
        pred(&obj).then_some(obj)
    })
    .await
}

/// A ControllerRegistration as an agent creates it.
pub fn creg(name: &str, project: &str, session: &str, surface: AgentSurface) -> ControllerRegistration {
    ControllerRegistration::new(
        name,
        ControllerRegistrationSpec { project_id: project.into(), session_id: session.into(), agent_surface: surface },
    )
}

/// Waits (10 s) until the named registration's status satisfies `pred`.
pub async fn wait_status(
    api: &Api<ControllerRegistration>,
    name: &str,
    what: &str,
    pred: impl Fn(&ControllerRegistrationStatus) -> bool,
) -> ControllerRegistration {
    wait_for(api, name, 10, what, |r| r.status.as_ref().is_some_and(&pred)).await
}

/// Waits until the named registration's status shows `want`.
pub async fn role(api: &Api<ControllerRegistration>, name: &str, want: Role, secs: u64) -> ControllerRegistration {
    wait_for(api, name, secs, &format!("{name} {want:?}"), |r| r.status.as_ref().is_some_and(|s| s.role == want)).await
}

/// Waits until the named RunSession's status shows `want`.
pub async fn phase(api: &Api<RunSession>, name: &str, want: RunPhase, secs: u64) -> RunSession {
    wait_for(api, name, secs, &format!("{name} {want:?}"), |r| r.status.as_ref().is_some_and(|s| s.phase == want)).await
}

/// Live masters of a project in Postgres (the election's source of truth).
pub async fn live_masters(pool: &PgPool, ns: &str, project: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM controller_registrations WHERE namespace = $1 AND project_id = $2 AND is_master AND released_at IS NULL",
    )
    .bind(ns)
    .bind(project)
    .fetch_one(pool)
    .await
    .expect("count masters")
}

/// The events.k8s.io Events about the named object in `ns`.
pub async fn events_about(client: &Client, ns: &str, name: &str) -> Vec<Event> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let list = events.list(&Default::default()).await.expect("list events");
    list.items.into_iter().filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)).collect()
}

/// A ServiceAccount in `namespace` bound to `verbs` on controllerregistrations there,
/// and a token for it (TokenRequest, as `kubectl create token` does).
pub async fn agent_token(cp: &ControlPlane, namespace: &str, sa: &str, verbs: &[&str]) -> String {
    sa_token(cp, namespace, sa, "controllerregistrations", verbs).await
}

/// The bearer token of user `prism-person` (scripts/control-plane's static token: a
/// person, as OIDC gives one, not a ServiceAccount), bound to `verbs` on registrations
/// in `namespace`.
pub async fn person_token(cp: &ControlPlane, namespace: &str, verbs: &[&str]) -> String {
    let subject = serde_json::json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "prism-person"});
    bind(cp, namespace, "person", subject, "controllerregistrations", verbs, None).await;
    let dir = cp.kubeconfig.parent().expect("control plane dir");
    std::fs::read_to_string(dir.join("person-token")).expect("scripts/control-plane writes person-token")
}

/// A ServiceAccount bound to `verbs` on `resource` (group prism.ntecdev.ai) in `namespace`,
/// and a token for it.
pub async fn sa_token(cp: &ControlPlane, namespace: &str, sa: &str, resource: &str, verbs: &[&str]) -> String {
    let account = serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": namespace}});
    let subject = serde_json::json!({"kind": "ServiceAccount", "name": sa, "namespace": namespace});
    bind(cp, namespace, sa, subject, resource, verbs, Some(account)).await;
    // Six hours, not the default one: a scale bench at 30,000 runs longer than an hour, and
    // its agents' heartbeats after the first were refused as expired (run K, BENCHMARKS.md).
    cp.kubectl_ok(&["create", "token", sa, "-n", namespace, "--audience", AGENT_AUDIENCE, "--duration", "6h"])
        .await
        .trim()
        .to_string()
}

/// One more Role for ServiceAccount `sa` (made by `sa_token`): `verbs` on `resource`.
pub async fn grant(cp: &ControlPlane, namespace: &str, sa: &str, resource: &str, verbs: &[&str]) {
    let subject = serde_json::json!({"kind": "ServiceAccount", "name": sa, "namespace": namespace});
    // A subresource (`controllerregistrations/owned`) names the Role without its slash.
    bind(cp, namespace, &format!("{sa}-{}", resource.replace('/', "-")), subject, resource, verbs, None).await;
}

/// The audience agents' tokens are made for, as the MCP guide says (SPEC §12).
pub const AGENT_AUDIENCE: &str = "prism-operator";
/// The control plane's own audience (its ServiceAccount issuer): what a token made
/// without `--audience`, and a person's static token, are valid for.
pub const API_SERVER_AUDIENCE: &str = "https://kubernetes.default.svc.cluster.local";

/// A token of ServiceAccount `sa` for the API server's own audience (no `--audience`):
/// a full credential for the cluster, which the operator refuses by default.
pub async fn api_server_token(cp: &ControlPlane, namespace: &str, sa: &str) -> String {
    cp.kubectl_ok(&["create", "token", sa, "-n", namespace]).await.trim().to_string()
}

/// A Role `name` with `verbs` on `resource` (group prism.ntecdev.ai) in `namespace`,
/// bound to `subject`, applied together with `extra` (the subject itself, if it is made).
async fn bind(
    cp: &ControlPlane,
    namespace: &str,
    name: &str,
    subject: serde_json::Value,
    resource: &str,
    verbs: &[&str],
    extra: Option<serde_json::Value>,
) {
    let meta = serde_json::json!({"name": name, "namespace": namespace});
    let mut items: Vec<serde_json::Value> = extra.into_iter().collect();
    items.push(serde_json::json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
        "rules": [{"apiGroups": ["prism.ntecdev.ai"], "resources": [resource], "verbs": verbs}]}));
    items.push(
        serde_json::json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}, "subjects": [subject]}),
    );
    let manifest = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string();
    let out = cp.kubectl(&["apply", "-f", "-"], Some(&manifest)).await;
    assert!(out.ok, "RBAC setup failed: {}", out.stderr);
}

/// A PostgreSQL server of the test's own (initdb in a temp dir, loopback port), for
/// tests that stop and start the database under the operator.
pub struct PrivatePostgres {
    pub url: String,
    dir: PathBuf,
    bin: PathBuf,
}

impl PrivatePostgres {
    /// A PostgreSQL tool's command line, run as the `postgres` user when we are root
    /// (PostgreSQL refuses to run as root).
    fn as_postgres_user(args: &[&str]) -> std::process::Command {
        let line = args.iter().map(|a| format!("'{a}'")).collect::<Vec<_>>().join(" ");
        let mut cmd = if is_root() {
            let mut su = std::process::Command::new("su");
            su.args(["postgres", "-s", "/bin/sh"]);
            su
        } else {
            std::process::Command::new("sh")
        };
        cmd.args(["-c", &line]);
        cmd
    }

    async fn run_as_postgres_user(args: &[&str]) -> std::process::Output {
        Command::from(Self::as_postgres_user(args)).output().await.expect("run a PostgreSQL tool")
    }

    pub async fn start() -> PrivatePostgres {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL server binaries (scripts/services installs them)")
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|p| p.join("initdb").exists())
            .max()
            .expect("an initdb");
        let dir = std::env::temp_dir().join(format!("prism-pg-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("pg dir");
        if is_root() {
            let ok =
                Command::new("chown").args(["postgres", dir.to_str().expect("utf-8")]).status().await.expect("chown");
            assert!(ok.success());
        }
        let port = free_port();
        let pg = PrivatePostgres { url: format!("postgres://postgres@127.0.0.1:{port}/postgres"), dir, bin };
        let data = pg.dir.join("data");
        let out = Self::run_as_postgres_user(&[
            pg.bin.join("initdb").to_str().expect("utf-8"),
            "-D",
            data.to_str().expect("utf-8"),
            "--auth=trust",
            "-U",
            "postgres",
        ])
        .await;
        assert!(out.status.success(), "initdb: {}", String::from_utf8_lossy(&out.stderr));
        let conf = format!(
            "port = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nfsync = off\n",
            pg.dir.display()
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .and_then(|mut f| std::io::Write::write_all(&mut f, conf.as_bytes()))
            .expect("configure");
        pg.ctl("start").await;
        pg
    }

    /// `pg_ctl <action>` (start, stop, restart), waiting for it to finish.
    pub async fn ctl(&self, action: &str) {
        let data = self.dir.join("data");
        let log = self.dir.join("log");
        let args = [
            self.bin.join("pg_ctl").to_str().expect("utf-8").to_string(),
            "-D".into(),
            data.to_str().expect("utf-8").into(),
            "-l".into(),
            log.to_str().expect("utf-8").into(),
            "-w".into(),
            "-m".into(),
            "fast".into(),
            action.into(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = Self::run_as_postgres_user(&args).await;
        assert!(out.status.success(), "pg_ctl {action}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        // Drop cannot wait asynchronously: a blocking `pg_ctl stop -m immediate`, brief.
        let data = self.dir.join("data");
        let _ = Self::as_postgres_user(&[
            self.bin.join("pg_ctl").to_str().unwrap_or_default(),
            "-D",
            data.to_str().unwrap_or_default(),
            "-m",
            "immediate",
            "stop",
        ])
        .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether this process's effective user is root (the second `Uid:` field of
/// /proc/self/status).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Uid:")).map(|u| u.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

/// A Redis of the test's own on loopback, to stop, start and flush: one redis-server, or
/// in cluster mode (`redis_cluster_mode`) a Redis Cluster of three masters, each on a
/// port and a bus port of its own (`cluster-port`: the default, port + 10000, may fall
/// in the ephemeral range where connect() takes ports).
pub struct PrivateRedis {
    /// The operator's REDIS_URL: the server, or the cluster's seed nodes.
    pub url: String,
    nodes: Vec<PrivateNode>,
    dir: PathBuf,
    cluster: bool,
}

struct PrivateNode {
    port: u16,
    bus: u16,
    child: Option<Child>,
}

impl PrivateRedis {
    pub async fn start() -> PrivateRedis {
        PrivateRedis::start_with_replicas(0).await
    }

    /// In cluster mode, `replicas` replicas per master (a master can then fail over);
    /// standalone, one server whatever `replicas` says.
    pub async fn start_with_replicas(replicas: usize) -> PrivateRedis {
        PrivateRedis::start_as(redis_cluster_mode(), replicas).await
    }

    /// A private Redis Cluster whatever PRISM_TEST_REDIS says: 3 masters, `replicas` each.
    pub async fn cluster(replicas: usize) -> PrivateRedis {
        PrivateRedis::start_as(true, replicas).await
    }

    async fn start_as(cluster: bool, replicas: usize) -> PrivateRedis {
        let count = if cluster { 3 * (1 + replicas) } else { 1 };
        let nodes: Vec<PrivateNode> =
            (0..count).map(|_| PrivateNode { port: free_port(), bus: free_port(), child: None }).collect();
        let url = nodes.iter().map(|n| format!("redis://127.0.0.1:{}", n.port)).collect::<Vec<_>>().join(",");
        let dir = std::env::temp_dir().join(format!("prism-redis-{}", uuid::Uuid::new_v4().simple()));
        let mut r = PrivateRedis { url, nodes, dir, cluster };
        r.spawn().await;
        if cluster {
            let addrs: Vec<String> = r.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
            let out = Command::new("redis-cli")
                .args(["--cluster", "create"])
                .args(&addrs)
                .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
                .output()
                .await
                .expect("redis-cli --cluster create");
            assert!(out.status.success(), "redis-cli --cluster create: {}", String::from_utf8_lossy(&out.stdout));
            r.wait_cluster_ok().await;
        }
        r
    }

    async fn spawn(&mut self) {
        for i in 0..self.nodes.len() {
            self.spawn_node(i);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        for n in &self.nodes {
            while tokio::net::TcpStream::connect(("127.0.0.1", n.port)).await.is_err() {
                assert!(std::time::Instant::now() < deadline, "redis-server did not start on port {}", n.port);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    fn spawn_node(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        if n.child.is_some() {
            return;
        }
        let dir = self.dir.join(n.port.to_string());
        std::fs::create_dir_all(&dir).expect("redis dir");
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &n.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--dir", dir.to_str().expect("utf-8")]);
        if self.cluster {
            // nodes.conf (in --dir) keeps the slots: a restarted node rejoins its cluster.
            cmd.args(["--cluster-enabled", "yes", "--cluster-port", &n.bus.to_string()]).args([
                "--cluster-node-timeout",
                "2000",
                "--cluster-require-full-coverage",
                "no",
            ]);
        }
        n.child = Some(
            cmd.stdout(Stdio::null()).kill_on_drop(true).spawn().expect("redis-server (scripts/services installs it)"),
        );
    }

    /// The role a running node reports (`master` or `slave`), None if it does not answer.
    async fn role(port: u16) -> Option<String> {
        redis_cli(port, &["ROLE"]).await.lines().next().map(|l| l.trim().to_string()).filter(|r| !r.is_empty())
    }

    fn running_ports(&self) -> Vec<u16> {
        self.nodes.iter().filter(|n| n.child.is_some()).map(|n| n.port).collect()
    }

    /// The ports of the running masters.
    pub async fn masters(&self) -> Vec<u16> {
        self.running_with_role("master").await
    }

    /// The ports of the running nodes whose role is `role`.
    async fn running_with_role(&self, role: &str) -> Vec<u16> {
        let mut ports = Vec::new();
        for port in self.running_ports() {
            if Self::role(port).await.as_deref() == Some(role) {
                ports.push(port);
            }
        }
        ports
    }

    /// A graceful failover: `CLUSTER FAILOVER` on the replica of the `pick`-th master;
    /// returns once the replica is a master and every node is ok. None when there is no
    /// replica (standalone, or a cluster without replicas).
    pub async fn failover(&self, pick: usize) -> Option<String> {
        if !self.cluster {
            return None;
        }
        let replicas = self.running_with_role("slave").await;
        if replicas.is_empty() {
            return None;
        }
        let port = replicas[pick % replicas.len()];
        // A manual failover waits for the replica to catch up with its master: only a
        // replica whose link is up (synced) can take over.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while info_field(&redis_cli(port, &["INFO", "replication"]).await, "master_link_status").as_deref()
            != Some("up")
        {
            assert!(std::time::Instant::now() < deadline, "replica {port} never synced with its master");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut asked = None;
        while Self::role(port).await.as_deref() != Some("master") {
            assert!(std::time::Instant::now() < deadline, "replica {port} did not become a master");
            // Asked again after 10 s: a manual failover that timed out is dropped.
            if asked.is_none_or(|t: std::time::Instant| t.elapsed() > Duration::from_secs(10)) {
                let out = redis_cli(port, &["CLUSTER", "FAILOVER"]).await;
                assert_eq!(out.trim(), "OK", "CLUSTER FAILOVER on {port}");
                asked = Some(std::time::Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.wait_cluster_ok().await;
        Some(format!("CLUSTER FAILOVER: replica {port} is master"))
    }

    /// `kill -9` of the `pick`-th master; once its replica has taken over (the cluster is
    /// ok without it), the killed node is started again and rejoins as a replica. None
    /// when no master has a replica to take over.
    pub async fn kill_master(&mut self, pick: usize) -> Option<String> {
        if !self.cluster || self.nodes.len() <= 3 {
            return None;
        }
        let masters = self.masters().await;
        let port = masters[pick % masters.len()];
        let i = self.nodes.iter().position(|n| n.port == port).expect("a node of ours");
        if let Some(mut c) = self.nodes[i].child.take() {
            let _ = c.kill().await;
        }
        let started = std::time::Instant::now();
        let deadline = started + Duration::from_secs(30);
        while self.masters().await.len() < 3 {
            assert!(std::time::Instant::now() < deadline, "no replica took over from killed master {port}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let took = started.elapsed();
        self.wait_cluster_ok().await;
        self.spawn_node(i);
        while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
            assert!(std::time::Instant::now() < deadline, "redis-server did not restart on port {port}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.wait_cluster_ok().await;
        Some(format!("kill -9 of master {port}: a replica took over in {:.1} s; {port} rejoined", took.as_secs_f64()))
    }

    /// Every running node of the private cluster says `cluster_state:ok`.
    async fn wait_cluster_ok(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        for port in self.running_ports() {
            loop {
                let info = redis_cli(port, &["CLUSTER", "INFO"]).await;
                if info_field(&info, "cluster_state").as_deref() == Some("ok") {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "private Redis Cluster not ok: {info}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// Starts every node again (after `down`); returns once they serve.
    pub async fn up(&mut self) {
        self.spawn().await;
        if self.cluster {
            self.wait_cluster_ok().await;
        }
    }

    /// `kill -9` of every node; returns once they are gone.
    pub async fn down(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill().await;
            }
        }
    }

    /// Every node loses its data (on a cluster FLUSHALL is per master; replicas follow).
    pub async fn flushall(&self) {
        for port in self.running_ports() {
            if self.cluster && Self::role(port).await.as_deref() != Some("master") {
                continue;
            }
            let out = redis_cli(port, &["FLUSHALL"]).await;
            assert_eq!(out.trim(), "OK", "FLUSHALL on port {port}");
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        // The nodes are killed as their handles drop (`kill_on_drop`); tokio reaps them.
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The name of the operator replicas' leader-election Lease (in OPERATOR_NAMESPACE).
pub const LEADER_LEASE: &str = "prism-operator-leader";

/// Who holds the replicas' leader-election Lease now, if anyone (None also when it
/// cannot be read).
pub async fn lease_holder(client: &Client) -> Option<String> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(client.clone(), OPERATOR_NAMESPACE);
    leases.get_opt(LEADER_LEASE).await.ok().flatten()?.spec?.holder_identity
}

/// Creates RunSession `name` for (`server`, `run`) with a fresh key of generation 1 and
/// the given lease; returns the key, for the Run's client.
pub async fn create_run_session(
    api: &Api<RunSession>,
    name: &str,
    server: &str,
    lease_seconds: Option<i32>,
) -> ed25519_dalek::SigningKey {
    let (key, public) = prism_api::run_client::new_key().expect("key");
    let spec = prism_kube::crd::RunSessionSpec {
        server_instance_id: server.into(),
        component_kind: "run".into(),
        credential: prism_kube::crd::RunCredential { public_key: public, generation: 1 },
        lease_seconds,
        paused: false,
    };
    api.create(&Default::default(), &RunSession::new(name, spec)).await.expect("create RunSession");
    key
}

/// The virtualenv python with the pinned official MCP SDK (scripts/mcp-sdk installs it on
/// first use), which runs tests/mcp/*.py.
pub async fn mcp_python() -> &'static PathBuf {
    static PYTHON: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    PYTHON
        .get_or_init(|| async {
            let out = Command::new(repo_root().join("scripts/mcp-sdk")).output().await.expect("run scripts/mcp-sdk");
            assert!(out.status.success(), "scripts/mcp-sdk failed: {}", String::from_utf8_lossy(&out.stderr));
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        })
        .await
}

/// Runs scenario `name` of tests/mcp/scenarios.py (the official MCP Python SDK) in protocol
/// generation `mode` (`legacy` or `modern`) against `url` with `token`; `extra` are more
/// `--key value` arguments. Returns the JSON the scenario printed.
pub async fn mcp_scenario(name: &str, mode: &str, url: &str, token: &str, extra: &[(&str, &str)]) -> serde_json::Value {
    let python = mcp_python().await.clone();
    let mut cmd = Command::new(python);
    cmd.arg(repo_root().join("tests/mcp/scenarios.py"))
        .args([name, "--mode", mode, "--url", url, "--token", token])
        .kill_on_drop(true);
    for (k, v) in extra {
        cmd.arg(format!("--{k}")).arg(v);
    }
    let out = tokio::time::timeout(Duration::from_secs(180), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("scenario {name} ({mode}) did not finish within 180 s"))
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "scenario {name} ({mode}) failed:\n{stderr}\n{stdout}");
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("scenario {name} printed no JSON ({e}):\n{stdout}\n{stderr}"))
}

/// An HTTP client for talking to the operator (plain HTTP on loopback).
pub fn http() -> reqwest::Client {
    prism_api::install_crypto_provider();
    reqwest::Client::new()
}

/// `POST /api/v1/controller/register` as an agent with `token`; asserts 200 and returns the
/// answer.
pub async fn register(
    op: &Operator,
    token: &str,
    ns: &str,
    project: &str,
    session: &str,
    surface: &str,
) -> serde_json::Value {
    let r = http()
        .post(op.url("/api/v1/controller/register"))
        .bearer_auth(token)
        .json(&serde_json::json!({"namespace": ns, "project_id": project, "session_id": session, "agent_surface": surface}))
        .send()
        .await
        .expect("register");
    assert_eq!(r.status(), 200, "register {session} on {project}");
    r.json().await.expect("json")
}

/// The next Server-Sent Event named `event` of a response being read (its `id` and its
/// `data` as JSON), or None when the stream ends first or in 10 s. The framing is read by
/// hand (`event:`, `id:`, `data:` lines), as a client in any language would.
pub async fn next_sse(stream: &mut reqwest::Response, event: &str) -> Option<(Option<String>, serde_json::Value)> {
    let mut buffer = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            let field =
                |name: &str| frame.lines().find_map(|l| l.strip_prefix(name).map(|v| v.trim_start().to_string()));
            if field("event:").as_deref() == Some(event) {
                let data = serde_json::from_str(&field("data:")?).ok()?;
                return Some((field("id:"), data));
            }
        }
        match tokio::time::timeout_at(deadline, stream.chunk()).await {
            Ok(Ok(Some(chunk))) => buffer.push_str(&String::from_utf8_lossy(&chunk)),
            _ => return None,
        }
    }
}

/// A CA and a server certificate it signed for 127.0.0.1 and localhost, as PEM:
/// (ca, cert, key).
pub use prism_api::transport::tls::test_pair as tls_pair;

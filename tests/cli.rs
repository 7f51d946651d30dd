//! The binary as a user runs it: subcommands, one-line configuration errors, `run`
//! answering /healthz and /readyz against real Postgres, Redis and kube-apiserver, and
//! `jobs list|get|cancel` (also as `kubectl prism jobs`) against a real operator's API.

use prism_testkit as support;

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::{ControlPlane, Operator, TestDb, control_plane, eventually};

/// Settings of the environment a test run may carry that no test here wants inherited.
const INHERITED: [&str; 10] = [
    "RUST_LOG",
    "DATABASE_URL",
    "REDIS_URL",
    "KUBECONFIG",
    "PRISM_LISTEN",
    "PRISM_REDIS_PREFIX",
    "PRISM_REDIS_MODE",
    "PRISM_API",
    "PRISM_TOKEN",
    "PRISM_CA_CERT",
];

fn bin() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_prism-operator"));
    // Only what each test sets: no DATABASE_URL etc. leaking in from the test environment.
    for var in INHERITED {
        cmd.env_remove(var);
    }
    cmd
}

/// `kubectl <args>` with the binary installed as `kubectl-prism` on PATH, as a user
/// installs the plugin; `envs` are set for kubectl (and so for the plugin it runs).
fn kubectl_prism(cp: &ControlPlane, args: &[&str], envs: &[(&str, &str)]) -> std::process::Output {
    let bin_dir = std::env::temp_dir().join(format!("prism-plugin-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&bin_dir).expect("dir");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_prism-operator"), bin_dir.join("kubectl-prism")).expect("symlink");
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut cmd = Command::new(support::assets_dir().join("kubectl"));
    for var in INHERITED {
        cmd.env_remove(var);
    }
    let out = cmd
        .args(args)
        .env("PATH", path)
        .env("KUBECONFIG", &cp.kubeconfig)
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("kubectl runs");
    let _ = std::fs::remove_dir_all(&bin_dir);
    out
}

#[test]
fn crdgen_prints_both_crds() {
    let out = bin().arg("crdgen").output().expect("crdgen runs");
    assert!(out.status.success());
    let yaml = String::from_utf8(out.stdout).expect("utf-8");
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&yaml)
        .map(|d| serde::Deserialize::deserialize(d).expect("valid YAML document"))
        .collect();
    let names: Vec<&str> = docs.iter().filter_map(|d| d["metadata"]["name"].as_str()).collect();
    assert_eq!(names, ["controllerregistrations.prism.ntecdev.ai", "runsessions.prism.ntecdev.ai"]);
}

fn one_line_error(args: &[&str], envs: &[(&str, &str)]) -> String {
    let out = bin().args(args).envs(envs.iter().copied()).stdin(Stdio::null()).output().expect("runs");
    assert!(!out.status.success(), "{args:?} should fail");
    let stderr = String::from_utf8_lossy(&out.stderr).trim_end().to_string();
    assert_eq!(stderr.lines().count(), 1, "exactly one line, got: {stderr:?}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

#[test]
fn bad_configuration_is_a_one_line_error() {
    let e = one_line_error(&["run"], &[("REDIS_URL", "redis://127.0.0.1:1")]);
    assert_eq!(e, "error: DATABASE_URL is not set (flag --database-url)");
    let e = one_line_error(&["run"], &[("DATABASE_URL", "postgres://u:pw@127.0.0.1:1/db")]);
    assert_eq!(e, "error: REDIS_URL is not set (flag --redis-url)");
    let e = one_line_error(&["run"], &[("PRISM_LISTEN", "everywhere")]);
    assert!(e.contains("everywhere") && e.contains("--listen"), "{e}");
    let e = one_line_error(&["run"], &[("PRISM_RUN_LEASE_SECONDS", "0")]);
    assert!(e.contains("--run-lease-seconds"), "{e}");
    let e = one_line_error(&["run"], &[("PRISM_RECONCILE_CONCURRENCY", "0")]);
    assert!(e.contains("--reconcile-concurrency"), "{e}");
    let e = one_line_error(&["run"], &[("PRISM_LEADER_ELECTION", "perhaps")]);
    assert!(e.contains("perhaps"), "{e}");
    let urls = [("DATABASE_URL", "postgres://u:pw@127.0.0.1:1/db"), ("REDIS_URL", "redis://127.0.0.1:1")];
    let e = one_line_error(&["run"], &[urls[0], urls[1], ("PRISM_REDIS_MODE", "sentinel")]);
    assert_eq!(e, "error: PRISM_REDIS_MODE is malformed: expected standalone or cluster, got \"sentinel\"");
    let e = one_line_error(&["run"], &[urls[0], ("REDIS_URL", "redis://127.0.0.1:1,redis://127.0.0.1:2")]);
    assert!(e.starts_with("error: REDIS_URL is malformed") && e.contains("PRISM_REDIS_MODE=cluster"), "{e}");
    // A password in a bad URL never reaches the terminal.
    let e = one_line_error(&["migrate"], &[("DATABASE_URL", "postgres://prism:hunter2@127.0.0.1:1/db")]);
    assert!(e.contains("cannot connect to PostgreSQL") && !e.contains("hunter2"), "{e}");
}

#[tokio::test]
async fn migrate_subcommand_is_idempotent() {
    let db = TestDb::empty().await;
    for _ in 0..2 {
        let out = bin().arg("migrate").env("DATABASE_URL", &db.url).output().expect("migrate runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    assert_eq!(
        prism_store::migrations::applied(&db.pool).await.expect("ledgers"),
        prism_store::migrations::ALL.iter().count()
    );
}

#[tokio::test]
async fn run_serves_health_and_readiness() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "run").await;
    let db = TestDb::empty().await;
    // Returns once /healthz answers.
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let http = support::http();
    let r = http.get(op.url("/healthz")).send().await.expect("healthz");
    assert_eq!(r.status(), 200);
    let r = http.get(op.url("/readyz")).send().await.expect("readyz");
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.expect("json");
    assert_eq!(body["status"], "ready", "{body}");
    for dep in ["postgres", "runtime_registry", "kubernetes"] {
        assert_eq!(body["checks"][dep]["status"], "ok", "{dep}: {body}");
    }
    // Transparent huge pages are off in the process (src/main.rs), as the kernel says.
    let status = std::fs::read_to_string(format!("/proc/{}/status", op.pid())).expect("/proc/<pid>/status");
    let thp = status.lines().find(|l| l.starts_with("THP_enabled:")).expect("THP_enabled (Linux >= 5.0)");
    assert_eq!(thp.split_whitespace().nth(1), Some("0"), "{thp}");
    // `run` applied every migration at start.
    assert_eq!(
        prism_store::migrations::applied(&db.pool).await.expect("ledgers"),
        prism_store::migrations::ALL.iter().count()
    );
}

#[tokio::test]
async fn readyz_reports_an_unreachable_redis() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "noredis").await;
    let db = TestDb::empty().await;
    // Nothing listens on the port: Redis is down from the start.
    let dead_redis = format!("redis://127.0.0.1:{}", support::free_port());
    let op = Operator::start(cp, &db.url, &ns, &[("REDIS_URL", &dead_redis)]).await;
    let r = support::http().get(op.url("/readyz")).send().await.expect("readyz");
    // Degraded, still ready: the controller API works without Redis.
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.expect("json");
    assert_eq!(body["checks"]["runtime_registry"]["status"], "unavailable", "{body}");
    // A fixed sentence: no driver error, address or port of the backend (#43.9).
    assert_eq!(body["checks"]["runtime_registry"]["message"], "redis did not answer the probe", "{body}");
    assert!(!body.to_string().contains(&dead_redis[8..]), "the backend's address in /readyz: {body}");
    assert_eq!(body["checks"]["postgres"]["status"], "ok", "{body}");
    assert_eq!(body["status"], "degraded", "{body}");
}

#[tokio::test]
async fn works_as_a_kubectl_plugin() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "plugin").await;
    // Installed as `kubectl-prism` on PATH, kubectl finds it as `kubectl prism`.
    let out = kubectl_prism(cp, &["prism", "status", "PID-NONE", "-n", &ns, "-o", "json"], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(table["project_id"], "PID-NONE");
    assert_eq!(table["namespace"], ns.as_str());
    assert!(table["master"].is_null());
}

#[test]
fn credential_new_writes_a_private_key_only_its_owner_can_read() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("prism-cred-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let key = dir.join("run.key");
    let out = bin()
        .args(["credential", "new", "--key-file", key.to_str().expect("utf-8"), "--generation", "3"])
        .output()
        .expect("runs");
    assert!(out.status.success());
    let block = String::from_utf8(out.stdout).expect("utf-8");
    let doc: serde_yaml::Value = serde_yaml::from_str(&block).expect("YAML block");
    assert_eq!(doc["credential"]["generation"], 3);
    let public = doc["credential"]["publicKey"].as_str().expect("publicKey");
    assert_eq!(public.len(), 44);
    assert_eq!(std::fs::metadata(&key).expect("key file").permissions().mode() & 0o777, 0o600);
    assert!(!block.contains(std::fs::read_to_string(&key).expect("key").trim()), "the private key is not printed");
    // Never overwrites a key by accident.
    let again = bin().args(["credential", "new", "--key-file", key.to_str().expect("utf-8")]).output().expect("runs");
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("exists; use --force"));
}

/// An operator, a RunSession `jobs-run` (server `srv-cli`, component `run`) in a namespace of
/// the test's own, and a platform's token there (enqueue, read, cancel).
struct JobsWorld {
    cp: &'static ControlPlane,
    ns: String,
    op: Operator,
    /// Trusts the operator's CA when it serves TLS.
    http: reqwest::Client,
    token: String,
    key: ed25519_dalek::SigningKey,
    _db: TestDb,
}

const JOBS_SERVER: &str = "srv-cli";

async fn jobs_world(hint: &str, env: &[(&str, &str)], http: reqwest::Client) -> JobsWorld {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, hint).await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, env).await;
    let api: kube::Api<prism_operator::crd::RunSession> = kube::Api::namespaced(client, &ns);
    let key = support::create_run_session(&api, "jobs-run", JOBS_SERVER, None).await;
    let token = support::sa_token(cp, &ns, "dispatcher", "runsessions", &["get", "list", "update"]).await;
    JobsWorld { cp, ns, op, http, token, key, _db: db }
}

impl JobsWorld {
    /// `POST /api/v1/runtime/jobs` as the platform; the new job's id. The first one waits
    /// for the RunSession's identity to be mirrored (until then the address is unknown).
    async fn enqueue(&self, kind: &str, n: i64) -> String {
        let body = json!({"namespace": self.ns, "server_instance_id": JOBS_SERVER, "component_kind": "run",
            "kind": kind, "payload": {"n": n, "marker": "payload-marker"}});
        eventually(15, "enqueue answered 201", || async {
            let r = self
                .http
                .post(self.op.url("/api/v1/runtime/jobs"))
                .bearer_auth(&self.token)
                .json(&body)
                .send()
                .await
                .ok()?;
            if r.status() != 201 {
                return None;
            }
            let job: Value = r.json().await.ok()?;
            Some(job["id"].as_str()?.to_string())
        })
        .await
    }

    /// `prism-operator jobs <args>` against the world's operator with `token`.
    fn jobs(&self, token: &str, args: &[&str]) -> Ran {
        let out = bin()
            .arg("jobs")
            .args(args)
            .env("PRISM_API", &self.op.base)
            .env("PRISM_TOKEN", token)
            .stdin(Stdio::null())
            .output()
            .expect("prism-operator jobs runs");
        Ran::from(out)
    }
}

/// A finished CLI process, its output as text.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl From<std::process::Output> for Ran {
    fn from(out: std::process::Output) -> Ran {
        Ran {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

impl Ran {
    /// Succeeded; its stdout.
    fn ok(&self) -> &str {
        assert_eq!(self.code, Some(0), "stdout: {}\nstderr: {}", self.stdout, self.stderr);
        &self.stdout
    }

    fn json(&self) -> Value {
        serde_json::from_str(self.ok()).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.stdout))
    }

    /// Failed with exit 1, printed nothing on stdout and one line on stderr; that line.
    fn refused(&self) -> &str {
        assert_eq!(self.code, Some(1), "stdout: {}\nstderr: {}", self.stdout, self.stderr);
        assert_eq!(self.stdout, "", "nothing on stdout when refused");
        let line = self.stderr.trim_end();
        assert_eq!(line.lines().count(), 1, "one line: {line:?}");
        assert!(!line.contains("panicked"), "{line}");
        line
    }
}

/// The ids of a `-o json` page, in order.
fn ids(page: &Value) -> Vec<String> {
    let jobs = page["jobs"].as_array().unwrap_or_else(|| panic!("a page of jobs: {page}"));
    jobs.iter().map(|j| j["id"].as_str().expect("id").to_string()).collect()
}

#[tokio::test]
async fn jobs_list_get_and_cancel_through_the_api() {
    let w = jobs_world("jobs", &[], support::http()).await;
    let mut enqueued = vec![];
    for (n, kind) in ["config", "log", "lifecycle"].into_iter().enumerate() {
        enqueued.push(w.enqueue(kind, n as i64).await);
    }
    let newest_first: Vec<String> = enqueued.iter().rev().cloned().collect();
    let ns = w.ns.as_str();

    // The table, as `kubectl get` prints one.
    let table = w.jobs(&w.token, &["list", "-n", ns]);
    let lines: Vec<&str> = table.ok().lines().collect();
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(header, ["ID", "SERVER", "COMPONENT", "KIND", "STATE", "ATTEMPTS", "AGE", "LAST", "ERROR"]);
    assert_eq!(lines.len(), 4, "{}", table.stdout);
    for (line, (id, kind)) in lines[1..].iter().zip(newest_first.iter().zip(["lifecycle", "log", "config"])) {
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cells[..6], [id.as_str(), JOBS_SERVER, "run", kind, "queued", "0/3"], "{line}");
        assert!(cells[6].ends_with('s') && cells[6][..cells[6].len() - 1].parse::<u32>().is_ok(), "AGE: {line}");
        assert_eq!(cells[7], "<none>", "{line}");
    }
    // Every column starts where its header does.
    let at = |name: &str| lines[0].find(name).expect("header");
    for line in &lines[1..] {
        assert_eq!(line.find(" run ").map(|i| i + 1), Some(at("COMPONENT")), "{line}");
        assert_eq!(line.find("queued"), Some(at("STATE")), "{line}");
    }

    // -o json: the page (newest first, no next page), each job in the shape of SPEC §8.
    let page = w.jobs(&w.token, &["list", "-n", ns, "-o", "json"]).json();
    assert_eq!(ids(&page), newest_first);
    assert!(page["next_cursor"].is_null(), "{page}");
    for job in page["jobs"].as_array().expect("jobs") {
        assert_eq!((job["namespace"].as_str(), job["state"].as_str()), (Some(ns), Some("queued")), "{job}");
        assert_eq!((job["attempts"].as_i64(), job["max_attempts"].as_i64()), (Some(0), Some(3)), "{job}");
        assert_eq!(job["payload"]["marker"], "payload-marker");
        assert_eq!(job["cancel_requested"], false);
    }
    let yaml: serde_yaml::Value =
        serde_yaml::from_str(w.jobs(&w.token, &["list", "-n", ns, "-o", "yaml"]).ok()).expect("YAML");
    assert_eq!(yaml["jobs"].as_sequence().map(Vec::len), Some(3));
    assert_eq!(yaml["jobs"][0]["id"].as_str(), Some(newest_first[0].as_str()));

    // Filters.
    let page = w.jobs(&w.token, &["list", "-n", ns, "--state", "queued", "-o", "json"]).json();
    assert_eq!(ids(&page), newest_first);
    let page = w.jobs(&w.token, &["list", "-n", ns, "--server", JOBS_SERVER, "--component", "run", "-o", "json"]);
    assert_eq!(ids(&page.json()), newest_first);
    let none = w.jobs(&w.token, &["list", "-n", ns, "--server", "srv-other", "-o", "json"]).json();
    assert_eq!(ids(&none), Vec::<String>::new());
    let none = w.jobs(&w.token, &["list", "-n", ns, "--state", "running"]);
    assert_eq!(none.ok(), "", "an empty table prints nothing on stdout");
    assert!(none.stderr.contains("No jobs found in namespace"), "{}", none.stderr);

    // Pages: one at a time with the cursor, or every page with --all.
    let first = w.jobs(&w.token, &["list", "-n", ns, "--limit", "1", "-o", "json"]).json();
    assert_eq!(ids(&first), newest_first[..1]);
    let cursor = first["next_cursor"].as_str().unwrap_or_else(|| panic!("a next page: {first}"));
    let second = w.jobs(&w.token, &["list", "-n", ns, "--limit", "1", "--after", cursor, "-o", "json"]).json();
    assert_eq!(ids(&second), newest_first[1..2]);
    let table = w.jobs(&w.token, &["list", "-n", ns, "--limit", "1"]);
    assert_eq!(table.ok().lines().count(), 2);
    assert!(table.stderr.contains("--all") && table.stderr.contains("--after"), "{}", table.stderr);
    for limit in ["1", "2"] {
        let all = w.jobs(&w.token, &["list", "-n", ns, "--limit", limit, "--all", "-o", "json"]).json();
        assert_eq!(ids(&all), newest_first, "--limit {limit} --all");
        assert!(all["next_cursor"].is_null());
    }
    let all = w.jobs(&w.token, &["list", "-n", ns, "--limit", "1", "--all"]);
    assert_eq!(all.ok().lines().count(), 4);

    // One job.
    let one = w.jobs(&w.token, &["get", &enqueued[1], "-n", ns]);
    let lines: Vec<&str> = one.ok().lines().collect();
    assert_eq!(lines.len(), 2, "{}", one.stdout);
    assert!(lines[0].starts_with("ID") && lines[1].starts_with(&enqueued[1]) && lines[1].contains("queued"));
    let job = w.jobs(&w.token, &["get", &enqueued[1], "-n", ns, "-o", "json"]).json();
    assert_eq!((job["id"].as_str(), job["kind"].as_str()), (Some(enqueued[1].as_str()), Some("log")));
    assert_eq!(job["payload"]["n"], 1);
    let yaml: serde_yaml::Value =
        serde_yaml::from_str(w.jobs(&w.token, &["get", &enqueued[1], "-n", ns, "-o", "yaml"]).ok()).expect("YAML");
    assert_eq!(yaml["state"].as_str(), Some("queued"));

    // Cancel a queued job: cancelled at once, with the reason.
    let id = enqueued[0].as_str();
    let cancelled = w.jobs(&w.token, &["cancel", id, "-n", ns, "--reason", "cli test"]);
    assert_eq!(cancelled.ok(), format!("job {id} cancelled\n"));
    let job = w.jobs(&w.token, &["get", id, "-n", ns, "-o", "json"]).json();
    assert_eq!((job["state"].as_str(), job["cancel_reason"].as_str()), (Some("cancelled"), Some("cli test")), "{job}");
    assert!(job["completed_at"].is_string(), "{job}");
    let row = w.jobs(&w.token, &["get", id, "-n", ns]);
    assert!(row.ok().contains("cancelled (cli test)"), "{}", row.stdout);
    let queued = w.jobs(&w.token, &["list", "-n", ns, "--state", "queued", "-o", "json"]).json();
    assert_eq!(ids(&queued), newest_first[..2]);
    let gone = w.jobs(&w.token, &["list", "-n", ns, "--state", "cancelled", "-o", "json"]).json();
    assert_eq!(ids(&gone), [id]);
    // Again (and without a reason: an empty body): it is finished.
    let again = w.jobs(&w.token, &["cancel", id, "-n", ns]);
    assert!(again.refused().starts_with("error: job_finished: "), "{}", again.stderr);
    // A job that does not exist in the namespace.
    let missing = uuid::Uuid::new_v4().to_string();
    assert!(w.jobs(&w.token, &["get", &missing, "-n", ns]).refused().starts_with("error: "));

    // Another tenant's platform: refused, and nothing of the jobs is printed.
    let client = w.cp.client().await;
    let other_ns = support::namespace(&client, "jobs-other").await;
    let other = support::sa_token(w.cp, &other_ns, "dispatcher", "runsessions", &["get", "list", "update"]).await;
    let leaks = |line: &str| {
        enqueued.iter().filter(|j| j.as_str() != enqueued[1]).any(|j| line.contains(j.as_str()))
            || line.contains("payload-marker")
            || line.contains(JOBS_SERVER)
    };
    for args in [
        vec!["list", "-n", ns],
        vec!["list", "-n", ns, "-o", "json"],
        vec!["get", enqueued[1].as_str(), "-n", ns, "-o", "json"],
        vec!["cancel", enqueued[1].as_str(), "-n", ns],
    ] {
        let ran = w.jobs(&other, &args);
        let line = ran.refused();
        assert!(line.starts_with("error: forbidden: "), "{args:?}: {line}");
        assert!(!leaks(line), "{args:?} names another tenant's job: {line}");
    }
    // A reader may read, not cancel.
    let reader = support::sa_token(w.cp, ns, "reader", "runsessions", &["get", "list"]).await;
    assert_eq!(ids(&w.jobs(&reader, &["list", "-n", ns, "-o", "json"]).json()).len(), 3);
    let refused = w.jobs(&reader, &["cancel", &enqueued[1], "-n", ns]);
    assert!(refused.refused().starts_with("error: forbidden: "), "{}", refused.stderr);
    let job = w.jobs(&w.token, &["get", &enqueued[1], "-n", ns, "-o", "json"]).json();
    assert_eq!(job["state"], "queued", "refused cancels changed nothing");
    // A token the API server does not know: refused by the API.
    let ran = Ran::from(
        bin().args(["jobs", "list", "-n", ns, "--api", &w.op.base, "--token", "not-a-token"]).output().expect("runs"),
    );
    assert!(ran.refused().starts_with("error: "), "{}", ran.stderr);

    // `kubectl prism jobs …` is the same command, flags passed through kubectl.
    let api = [("PRISM_API", w.op.base.as_str()), ("PRISM_TOKEN", w.token.as_str())];
    let out = Ran::from(kubectl_prism(w.cp, &["prism", "jobs", "list", "-n", ns, "-o", "json"], &api));
    assert_eq!(ids(&out.json()), newest_first);
    let out = Ran::from(kubectl_prism(w.cp, &["prism", "jobs", "get", &enqueued[2], "-n", ns], &api));
    assert!(out.ok().lines().nth(1).is_some_and(|l| l.starts_with(&enqueued[2])), "{}", out.stdout);
    let flags = ["--api", w.op.base.as_str(), "--token", w.token.as_str()];
    let mut args = vec!["prism", "jobs", "cancel", enqueued[2].as_str(), "-n", ns, "--reason", "by kubectl"];
    args.extend(flags);
    let out = Ran::from(kubectl_prism(w.cp, &args, &[]));
    assert_eq!(out.ok(), format!("job {} cancelled\n", enqueued[2]));
    let out = Ran::from(kubectl_prism(w.cp, &["prism", "jobs", "cancel", &enqueued[2], "-n", ns], &api));
    assert!(out.refused().starts_with("error: job_finished: "), "{}", out.stderr);
}

/// A CA of the test's own and a certificate it signs for 127.0.0.1, as PEM files in
/// `dir`: (ca.crt, tls.crt, tls.key).
fn test_pki(dir: &std::path::Path) -> (String, String, String) {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, "prism cli test CA");
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).expect("CA");
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    params.subject_alt_names = vec![rcgen::SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into())];
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = params.signed_by(&key, &ca).expect("sign");
    std::fs::create_dir_all(dir).expect("dir");
    let paths = ["ca.crt", "tls.crt", "tls.key"].map(|f| dir.join(f).to_string_lossy().into_owned());
    for (path, pem) in paths.iter().zip([ca.pem(), cert.pem(), key.serialize_pem()]) {
        std::fs::write(path, pem).expect("write PEM");
    }
    let [ca, cert, key] = paths;
    (ca, cert, key)
}

#[tokio::test]
async fn jobs_cancel_of_a_job_in_flight_asks_its_run_over_tls() {
    use prism_operator::run_client::{self, RunClient};
    prism_operator::install_crypto_provider();
    let dir = std::env::temp_dir().join(format!("prism-cli-tls-{}", uuid::Uuid::new_v4().simple()));
    let (ca, cert, key) = test_pki(&dir);
    let http = run_client::http_client(Some(std::path::Path::new(&ca))).expect("client");
    let env = [("PRISM_TLS_CERT_FILE", cert.as_str()), ("PRISM_TLS_KEY_FILE", key.as_str())];
    let w = jobs_world("jobs-tls", &env, http.clone()).await;
    assert!(w.op.base.starts_with("https://"), "{}", w.op.base);
    let ns = w.ns.as_str();
    let id = w.enqueue("config", 7).await;

    // A Run claims it: the job is in flight.
    let mut run = RunClient::new(&w.op.base, JOBS_SERVER, "run", 1, w.key.clone()).with_http(http);
    run.hello().await.expect("hello");
    let claimed = run.claim(1).await.expect("claim");
    assert_eq!(claimed.iter().map(|j| j.id.to_string()).collect::<Vec<_>>(), [id.as_str()]);

    let tls = ["--ca-cert", ca.as_str()];
    let with_ca = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(tls);
        w.jobs(&w.token, &all)
    };
    // Without the CA the API's certificate is not trusted: one line, exit 1.
    let untrusted = w.jobs(&w.token, &["list", "-n", ns]);
    assert!(
        untrusted.refused().starts_with("error: cannot reach the operator's API at https://"),
        "{}",
        untrusted.stderr
    );
    let bad_ca = w.jobs(&w.token, &["list", "-n", ns, "--ca-cert", &key]);
    assert!(bad_ca.refused().contains("--ca-cert"), "{}", bad_ca.stderr);

    let row = with_ca(&["get", &id, "-n", ns]);
    assert!(row.ok().contains("claimed") && row.stdout.contains("1/3"), "{}", row.stdout);
    let requested = with_ca(&["cancel", &id, "-n", ns, "--reason", "operator said so"]);
    assert!(
        requested.ok().starts_with(&format!("job {id}: cancel requested, the Run is told")),
        "{}",
        requested.stdout
    );
    let job = with_ca(&["get", &id, "-n", ns, "-o", "json"]).json();
    assert_eq!((job["state"].as_str(), job["cancel_requested"].as_bool()), (Some("claimed"), Some(true)), "{job}");
    let row = with_ca(&["get", &id, "-n", ns]);
    assert!(row.ok().contains("claimed (cancel requested)"), "{}", row.stdout);

    // The Run stops it: cancelled, as the list shows.
    run.step(&claimed[0].id, "complete", Some(json!({"outcome": "cancelled"}))).await.expect("complete as cancelled");
    let page = with_ca(&["list", "-n", ns, "--state", "cancelled", "-o", "json"]).json();
    assert_eq!(ids(&page), [id.as_str()]);
    let again = with_ca(&["cancel", &id, "-n", ns]);
    assert!(again.refused().starts_with("error: job_finished: "), "{}", again.stderr);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn jobs_without_a_token_or_with_bad_flags_is_a_one_line_error() {
    let id = uuid::Uuid::new_v4().to_string();
    let e = one_line_error(&["jobs", "list", "-n", "runtime"], &[]);
    assert!(e.contains("--token"), "{e}");
    let e = one_line_error(&["jobs", "list", "-n", "runtime", "--state", "done", "--token", "t"], &[]);
    assert!(e.contains("done") && e.contains("--state"), "{e}");
    let e = one_line_error(&["jobs", "get", "not-a-uuid", "-n", "runtime", "--token", "t"], &[]);
    assert!(e.contains("not-a-uuid"), "{e}");
    let e = one_line_error(&["jobs", "cancel", &id, "--token", "t"], &[]);
    assert!(e.contains("--namespace"), "{e}");
    let e = one_line_error(&["jobs", "list", "-n", "runtime", "--api", "127.0.0.1:8080", "--token", "t"], &[]);
    assert!(e.starts_with("error: --api / PRISM_API"), "{e}");
    // Nothing listens there: named, with the address, in one line (and the token never).
    let api = format!("http://127.0.0.1:{}", support::free_port());
    let e =
        one_line_error(&["jobs", "get", &id, "-n", "runtime"], &[("PRISM_API", &api), ("PRISM_TOKEN", "s3cret-token")]);
    assert!(e.starts_with(&format!("error: cannot reach the operator's API at {api}")), "{e}");
    assert!(!e.contains("s3cret-token"), "{e}");
}

/// `kubectl prism status -w`: the table, then again at each change of a role (as
/// `kubectl get -w`), not at each heartbeat; `-o json` one table per line.
#[tokio::test]
async fn status_watch_prints_the_table_again_at_each_change() {
    use tokio::io::AsyncBufReadExt;
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "status-w").await;
    let db = support::TestDb::new().await;
    let op = support::Operator::start(cp, &db.url, &ns, &[]).await;
    let agent = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;

    let bin_dir = std::env::temp_dir().join(format!("prism-plugin-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&bin_dir).expect("dir");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_prism-operator"), bin_dir.join("kubectl-prism")).expect("symlink");
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut cmd = tokio::process::Command::new(support::assets_dir().join("kubectl"));
    for var in INHERITED {
        cmd.env_remove(var);
    }
    let mut child = cmd
        .args(["prism", "status", "P", "-n", &ns, "-w", "-o", "json"])
        .env("PATH", path)
        .env("KUBECONFIG", &cp.kubeconfig)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("kubectl prism status -w");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut next_table = async || -> serde_json::Value {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("a table within 20 s")
            .expect("read")
            .expect("a line");
        serde_json::from_str(&line).expect("one JSON table per line")
    };
    let empty = next_table().await;
    assert!(empty["master"].is_null(), "{empty}");

    support::register(&op, &agent, &ns, "P", "s-code", "claude_code").await;
    let first = next_table().await;
    assert_eq!(first["master"]["session_id"], "s-code", "{first}");
    support::register(&op, &agent, &ns, "P", "s-desk", "claude_desktop").await;
    // The status of both registrations changes; tables in between may show one of them.
    let mut last = next_table().await;
    while last["master"]["session_id"] != "s-desk" || last["peers"].as_array().map(Vec::len) != Some(1) {
        last = next_table().await;
    }
    assert_eq!(last["peers"][0]["session_id"], "s-code", "{last}");
    assert!(last["term"].as_i64() > first["term"].as_i64(), "{last}");
    // Heartbeats move lastHeartbeat only: no new table.
    for _ in 0..3 {
        let _ = support::http()
            .post(op.url("/api/v1/controller/heartbeat"))
            .bearer_auth(&agent)
            .json(&serde_json::json!({"namespace": ns, "session_id": "s-code"}))
            .send()
            .await;
    }
    let quiet = tokio::time::timeout(Duration::from_secs(3), lines.next_line()).await;
    assert!(quiet.is_err(), "a heartbeat printed a table: {quiet:?}");
    let _ = child.kill().await;
    let _ = std::fs::remove_dir_all(&bin_dir);
}

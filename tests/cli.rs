//! The binary as a user runs it: subcommands, one-line configuration errors, and `run`
//! answering /healthz and /readyz against real Postgres, Redis and kube-apiserver.

mod support;

use std::process::{Command, Stdio};

use support::{Operator, TestDb, control_plane};

fn bin() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_prism-operator"));
    // Only what each test sets: no DATABASE_URL etc. leaking in from the test environment.
    for var in ["DATABASE_URL", "REDIS_URL", "KUBECONFIG", "PRISM_LISTEN", "PRISM_REDIS_PREFIX", "PRISM_REDIS_MODE"] {
        cmd.env_remove(var);
    }
    cmd
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
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(&db.pool)
        .await
        .expect("migrations table");
    assert_eq!(applied as usize, prism_operator::db::MIGRATOR.iter().count());
}

#[tokio::test]
async fn run_serves_health_and_readiness() {
    let cp = control_plane();
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
    // `run` applied every migration at start.
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(&db.pool)
        .await
        .expect("migrated");
    assert_eq!(applied as usize, prism_operator::db::MIGRATOR.iter().count());
}

#[tokio::test]
async fn readyz_reports_an_unreachable_redis() {
    let cp = control_plane();
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
    assert_eq!(body["checks"]["postgres"]["status"], "ok", "{body}");
    assert_eq!(body["status"], "degraded", "{body}");
}

#[tokio::test]
async fn works_as_a_kubectl_plugin() {
    let cp = control_plane();
    let client = cp.client().await;
    let ns = support::namespace(&client, "plugin").await;
    // Installed as `kubectl-prism` on PATH, kubectl finds it as `kubectl prism`.
    let bin_dir = std::env::temp_dir().join(format!("prism-plugin-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&bin_dir).expect("dir");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_prism-operator"), bin_dir.join("kubectl-prism")).expect("symlink");
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let out = Command::new(support::assets_dir().join("kubectl"))
        .args(["prism", "status", "PID-NONE", "-n", &ns, "-o", "json"])
        .env("PATH", path)
        .env("KUBECONFIG", &cp.kubeconfig)
        .output()
        .expect("kubectl prism runs");
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

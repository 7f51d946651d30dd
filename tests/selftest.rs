//! `prism-operator selftest`, what the chart's `helm test` Pod runs (SPEC §15), against a
//! real operator: with the verbs the chart's test Role grants it does the round trip and
//! leaves nothing registered; with fewer it stops at the step refused, naming it.

use prism_testkit as support;

use kube::Api;
use kube::api::ListParams;
use support::{Operator, TestDb, control_plane, repo_root};

use prism_operator::crd::ControllerRegistration;

/// The verbs the chart's test Role grants on controllerregistrations.
fn chart_test_verbs() -> Vec<String> {
    let out = support::helm_command()
        .args(["template", "prism", repo_root().join("charts/prism-operator").to_str().expect("utf-8")])
        .args(["--show-only", "templates/tests/selftest.yaml"])
        .output()
        .expect("helm runs");
    assert!(out.status.success(), "helm template: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let role = serde_yaml::Deserializer::from_str(&text)
        .map(|d| <serde_yaml::Value as serde::Deserialize>::deserialize(d).expect("yaml"))
        .find(|d| d["kind"] == "Role")
        .expect("the test Role");
    role["rules"][0]["verbs"]
        .as_sequence()
        .expect("verbs")
        .iter()
        .filter_map(|v| v.as_str().map(String::from))
        .collect()
}

async fn selftest(op: &Operator, token: &str, namespace: &str) -> std::process::Output {
    let file = std::env::temp_dir().join(format!("prism-selftest-token-{}", uuid::Uuid::new_v4().simple()));
    std::fs::write(&file, token).expect("token file");
    let out = tokio::process::Command::new(support::operator_binary())
        .args(["selftest", "--api", &op.base, "--namespace", namespace])
        .arg("--token-file")
        .arg(&file)
        .output()
        .await
        .expect("selftest runs");
    let _ = std::fs::remove_file(&file);
    out
}

#[tokio::test]
async fn the_helm_test_round_trip_passes_with_the_chart_s_role_and_leaves_nothing() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "selftest").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let verbs = chart_test_verbs();
    let verbs: Vec<&str> = verbs.iter().map(String::as_str).collect();
    let token = support::agent_token(cp, &ns, "selftest", &verbs).await;

    let out = selftest(&op, &token, &ns).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "selftest failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for step in ["readyz", "register", "status", "fence", "wrap"] {
        assert!(stdout.lines().any(|l| l.starts_with(&format!("ok  {step}:"))), "no `ok  {step}` line:\n{stdout}");
    }
    assert!(stdout.contains("refused stale_term"), "the term before is refused:\n{stdout}");
    let regs: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    support::eventually(30, "the wrapped registration's resource deleted", || {
        let regs = regs.clone();
        async move { regs.list(&ListParams::default()).await.expect("list").items.is_empty().then_some(()) }
    })
    .await;
}

#[tokio::test]
async fn without_create_it_stops_at_register_and_registers_nothing() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "selftest-denied").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let token = support::agent_token(cp, &ns, "reader", &["get", "list"]).await;

    let out = selftest(&op, &token, &ns).await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.starts_with("error: step register: forbidden"), "one line naming the step and the refusal:\n{stderr}");
    let regs: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    assert!(regs.list(&ListParams::default()).await.expect("list").items.is_empty(), "nothing registered");
}

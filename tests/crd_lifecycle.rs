//! The CRDs follow the release (SPEC §15), on a real API server with real helm: a
//! cluster installed with the previous release's chart (CRDs from its `crds/` folder,
//! owned by no release) upgrades to this one, which adopts them; a changed CRD in a later
//! chart reaches the API server with `helm upgrade`; `helm uninstall` keeps them; and
//! the operator refuses to start on a stale CRD, naming it in one line.
//!
//! One test, alone in its binary: it deletes the CRDs the test control plane starts with.

use prism_testkit as support;

use std::path::Path;
use std::time::Duration;

use kube::CustomResourceExt;
use support::releases;
use support::{TestDb, control_plane, repo_root};

const CRDS: [&str; 2] = ["controllerregistrations.prism.ntecdev.ai", "runsessions.prism.ntecdev.ai"];

async fn helm(args: &[&str], kubeconfig: &Path) -> (bool, String) {
    let mut helm = support::helm_command();
    helm.args(args).env("KUBECONFIG", kubeconfig);
    let out = tokio::process::Command::from(helm).output().await.expect("helm runs");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

async fn crd_json(cp: &support::ControlPlane, name: &str) -> serde_json::Value {
    serde_json::from_str(&cp.kubectl_ok(&["get", "crd", name, "-o", "json"]).await).expect("json")
}

fn spec_fields(crd: &serde_json::Value) -> Vec<String> {
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        .as_object()
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn crds_follow_the_release_from_the_previous_one_and_are_kept() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let dir = std::env::temp_dir().join(format!("prism-crds-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let (previous, commit) = releases::previous_of(env!("CARGO_PKG_VERSION"));
    let commit = commit.as_str();
    let old_chart = releases::checkout(commit, "charts/prism-operator", dir.as_path());

    // A cluster as the previous release left it: no CRD until its chart installs them.
    let mut args = vec!["delete", "crd", "--wait=true"];
    args.extend(CRDS);
    cp.kubectl_ok(&args).await;
    let ns = support::namespace(&client, "crds").await;
    let (ok, out) = helm(&["install", "prism", old_chart.to_str().expect("utf-8"), "-n", &ns], &cp.kubeconfig).await;
    assert!(ok, "helm install of {} ({commit}): {out}", previous.version_string());
    let before = crd_json(cp, CRDS[1]).await;
    assert!(before["metadata"]["annotations"]["meta.helm.sh/release-name"].is_null(), "crds/ is owned by no release");

    // From a chart with a `crds/` folder (0.2.0 and older), a plain upgrade stops before
    // changing anything (Helm adopts only when told): CHANGELOG.md's upgrade note says
    // to add --take-ownership once.
    let chart = repo_root().join("charts/prism-operator");
    let chart = chart.to_str().expect("utf-8");
    let (ok, out) = helm(&["upgrade", "prism", chart, "-n", &ns], &cp.kubeconfig).await;
    if old_chart.join("crds").exists() {
        assert!(!ok && out.contains("cannot be imported into the current release"), "plain upgrade: {out}");
        let (ok, out) = helm(&["upgrade", "prism", chart, "-n", &ns, "--take-ownership"], &cp.kubeconfig).await;
        assert!(ok, "helm upgrade --take-ownership: {out}");
    } else {
        assert!(ok, "helm upgrade from a release whose CRDs are templates already: {out}");
    }
    for name in CRDS {
        let crd = crd_json(cp, name).await;
        let annotations = &crd["metadata"]["annotations"];
        assert_eq!(annotations["meta.helm.sh/release-name"], "prism", "{name} adopted by the release");
        assert_eq!(annotations["helm.sh/resource-policy"], "keep", "{name}");
    }

    // A later chart whose CRD names one more field: `helm upgrade` applies it (a `crds/`
    // folder would have kept the old schema, and the API server would prune the field).
    let next = dir.as_path().join("next");
    copy_dir(Path::new(chart), &next);
    let file = next.join("files/crds").join(format!("{}.yaml", CRDS[1]));
    let mut crd: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(&file).expect("read")).expect("yaml");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["laterField"] =
        serde_yaml::from_str("{type: string}").expect("yaml");
    std::fs::write(&file, serde_yaml::to_string(&crd).expect("yaml")).expect("write");
    let (ok, out) = helm(&["upgrade", "prism", next.to_str().expect("utf-8"), "-n", &ns], &cp.kubeconfig).await;
    assert!(ok, "helm upgrade to a chart with a changed CRD: {out}");
    assert!(spec_fields(&crd_json(cp, CRDS[1]).await).contains(&"laterField".to_string()), "the changed CRD is served");

    // Uninstall keeps them, and the custom resources with them.
    let (ok, out) = helm(&["uninstall", "prism", "-n", &ns, "--wait=false"], &cp.kubeconfig).await;
    assert!(ok, "helm uninstall: {out}");
    for name in CRDS {
        let out = cp.kubectl(&["get", "crd", name, "-o", "name"], None).await;
        assert!(out.ok, "helm uninstall removed {name}: {}", out.stderr);
    }

    // A stale CRD (this build's RunSession without `spec.paused`): the operator exits
    // with one line that names it and what it lacks.
    let mut stale = prism_operator::crd::RunSession::crd();
    let spec = stale.spec.versions[0]
        .schema
        .as_mut()
        .and_then(|s| s.open_api_v3_schema.as_mut())
        .and_then(|s| s.properties.as_mut())
        .and_then(|p| p.get_mut("spec"))
        .expect("spec");
    spec.properties.as_mut().map(|p| p.remove("paused"));
    let stale = serde_yaml::to_string(&stale).expect("yaml");
    let applied = cp.kubectl(&["apply", "--server-side", "--force-conflicts", "-f", "-"], Some(&stale)).await;
    assert!(applied.ok, "apply the stale CRD: {}", applied.stderr);
    let db = TestDb::new().await;
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(support::operator_binary())
            .arg("run")
            .env("DATABASE_URL", &db.url)
            .env("REDIS_URL", support::redis_url())
            .env("PRISM_REDIS_MODE", support::redis_mode())
            .env("KUBECONFIG", &cp.operator_kubeconfig)
            .env("POD_NAMESPACE", support::OPERATOR_NAMESPACE)
            .env("PRISM_LISTEN", format!("127.0.0.1:{}", support::free_port()))
            .env("PRISM_LEADER_ELECTION", "false")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the operator exits instead of running on a stale CRD")
    .expect("the operator runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: CRD runsessions.prism.ntecdev.ai is stale: it lacks spec.paused")
            && last.contains("helm upgrade"),
        "one line naming the stale CRD and the way out; stderr:\n{stderr}"
    );

    // The right CRDs again: the same operator starts.
    let crds = repo_root().join("crds");
    cp.kubectl_ok(&["apply", "--server-side", "--force-conflicts", "-f", crds.to_str().expect("utf-8")]).await;
    let ns = support::namespace(&client, "crds-ok").await;
    let op = support::Operator::start(cp, &db.url, &ns, &[]).await;
    assert!(op.logs().contains("the served CRDs carry this build's schema"), "{}", op.logs());
}

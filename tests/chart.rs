//! The Helm chart: lint, render, schema, CRDs in sync, and a real install into the test
//! control plane (no kubelet runs there, so objects are checked as accepted, not run).

mod support;

use std::process::Command;

use support::{assets_dir, control_plane, repo_root};

fn helm(args: &[&str], kubeconfig: Option<&std::path::Path>) -> (bool, String, String) {
    let mut cmd = Command::new(assets_dir().join("helm"));
    cmd.args(args).env("HELM_CACHE_HOME", std::env::temp_dir().join("prism-helm-cache"));
    cmd.env("HELM_CONFIG_HOME", std::env::temp_dir().join("prism-helm-config"));
    cmd.env("HELM_DATA_HOME", std::env::temp_dir().join("prism-helm-data"));
    if let Some(k) = kubeconfig {
        cmd.env("KUBECONFIG", k);
    }
    let out = cmd.output().expect("helm runs (scripts/envtest-assets builds it)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn chart() -> String {
    repo_root().join("charts/prism-operator").to_string_lossy().into_owned()
}

fn render(extra: &[&str]) -> Vec<serde_yaml::Value> {
    let chart = chart();
    let mut args = vec!["template", "prism", chart.as_str(), "--namespace", "prism-system"];
    args.extend_from_slice(extra);
    let (ok, out, err) = helm(&args, None);
    assert!(ok, "helm template {extra:?}: {err}");
    serde_yaml::Deserializer::from_str(&out)
        .map(|d| serde::Deserialize::deserialize(d).expect("YAML"))
        .filter(|v: &serde_yaml::Value| !v.is_null())
        .collect()
}

fn kinds(docs: &[serde_yaml::Value]) -> Vec<String> {
    let mut k: Vec<String> = docs
        .iter()
        .map(|d| format!("{}/{}", d["kind"].as_str().unwrap_or("?"), d["metadata"]["name"].as_str().unwrap_or("?")))
        .collect();
    k.sort();
    k
}

#[test]
fn chart_lints_and_its_crds_are_the_generated_ones() {
    let (ok, out, err) = helm(&["lint", &chart()], None);
    assert!(ok, "helm lint: {out}{err}");
    for (file, yaml) in prism_operator::crd::crd_files().expect("crds") {
        let in_chart =
            std::fs::read_to_string(repo_root().join("charts/prism-operator/crds").join(&file)).unwrap_or_default();
        assert!(
            in_chart == yaml,
            "charts/prism-operator/crds/{file} differs: cp crds/*.yaml charts/prism-operator/crds/"
        );
    }
}

#[test]
fn default_ha_and_demo_values_render() {
    let default = render(&[]);
    let k = kinds(&default);
    for want in [
        "ClusterRole/prism-prism-operator",
        "ClusterRoleBinding/prism-prism-operator",
        "Deployment/prism-prism-operator",
        "Role/prism-prism-operator-leader",
        "Service/prism-prism-operator",
        "ServiceAccount/prism-prism-operator",
    ] {
        assert!(k.iter().any(|x| x == want), "{want} in {k:?}");
    }
    assert!(!k.iter().any(|x| x.starts_with("PodDisruptionBudget/")), "no PDB for one replica");
    let deploy = default.iter().find(|d| d["kind"] == "Deployment").expect("deployment");
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    let c = &pod["containers"][0];
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["capabilities"]["drop"][0], "ALL");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    // The ClusterRole grants nothing on Secrets.
    let role = default.iter().find(|d| d["kind"] == "ClusterRole").expect("role");
    let text = serde_yaml::to_string(&role["rules"]).expect("yaml");
    assert!(!text.contains("secrets"), "{text}");

    let ha = render(&["--set", "replicas=3"]);
    assert!(kinds(&ha).iter().any(|x| x == "PodDisruptionBudget/prism-prism-operator"));
    let deploy = ha.iter().find(|d| d["kind"] == "Deployment").expect("deployment");
    assert_eq!(deploy["spec"]["replicas"], 3);

    let extras = render(&["--set", "serviceMonitor.enabled=true", "--set", "networkPolicy.enabled=true"]);
    let k = kinds(&extras);
    assert!(k.iter().any(|x| x == "ServiceMonitor/prism-prism-operator"), "{k:?}");
    assert!(k.iter().any(|x| x == "NetworkPolicy/prism-prism-operator"), "{k:?}");

    // The admission policy: rendered where the cluster serves its API, off on request,
    // and bound only to the watched namespace when there is one.
    assert!(!k.iter().any(|x| x.starts_with("MutatingAdmissionPolicy")), "no policy without the API: {k:?}");
    let api = ["--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"];
    let k = kinds(&render(&api));
    for want in [
        "MutatingAdmissionPolicy/prism-prism-operator-registration-defaults",
        "MutatingAdmissionPolicyBinding/prism-prism-operator-registration-defaults",
    ] {
        assert!(k.iter().any(|x| x == want), "{want} in {k:?}");
    }
    let off = kinds(&render(&[&api[..], &["--set", "admissionPolicy.enabled=false"]].concat()));
    assert!(!off.iter().any(|x| x.starts_with("MutatingAdmissionPolicy")), "{off:?}");
    let scoped = render(&[&api[..], &["--set", "config.watchNamespace=team-a"]].concat());
    let binding = scoped.iter().find(|d| d["kind"] == "MutatingAdmissionPolicyBinding").expect("binding");
    assert_eq!(
        binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        "team-a"
    );

    let demo = render(&["--set", "demo.enabled=true"]);
    let k = kinds(&demo);
    for want in [
        "Deployment/prism-prism-operator-postgres",
        "Deployment/prism-prism-operator-redis",
        "Secret/prism-operator-db",
        "Secret/prism-operator-redis",
    ] {
        assert!(k.iter().any(|x| x == want), "{want} in {k:?}");
    }
}

#[test]
fn bad_values_fail_at_install_time() {
    let chart = chart();
    for bad in [
        "replicas=0",
        "config.runLeaseSeconds=2",
        "config.logFormat=xml",
        "service.type=Magic",
        "nope=1",
        "redis.mode=sentinel",
    ] {
        let (ok, _, err) = helm(&["template", "prism", chart.as_str(), "--set", bad], None);
        assert!(!ok, "{bad} must be rejected");
        assert!(err.contains("schema"), "{bad}: {err}");
    }
    // The demo's one Redis is not a cluster.
    let (ok, _, err) =
        helm(&["template", "prism", chart.as_str(), "--set", "demo.enabled=true", "--set", "redis.mode=cluster"], None);
    assert!(!ok && err.contains("redis.mode=standalone"), "{err}");
}

#[test]
fn redis_mode_reaches_the_operator() {
    let env_of = |extra: &[&str]| {
        let docs = render(extra);
        let deploy = docs.iter().find(|d| d["kind"] == "Deployment").expect("deployment").clone();
        let env = deploy["spec"]["template"]["spec"]["containers"][0]["env"].as_sequence().expect("env").clone();
        env.iter()
            .find(|e| e["name"] == "PRISM_REDIS_MODE")
            .and_then(|e| e["value"].as_str().map(str::to_string))
            .expect("PRISM_REDIS_MODE in the operator's env")
    };
    assert_eq!(env_of(&[]), "standalone");
    assert_eq!(env_of(&["--set", "redis.mode=cluster"]), "cluster");
}

#[tokio::test]
async fn installs_into_a_real_api_server_and_uninstalls() {
    let cp = control_plane();
    let client = cp.client().await;
    let ns = support::namespace(&client, "helm").await;
    let chart = chart();
    let (ok, out, err) = helm(
        &["install", "prism", chart.as_str(), "--namespace", &ns, "--set", "demo.enabled=true", "--set", "replicas=2"],
        Some(&cp.kubeconfig),
    );
    assert!(ok, "helm install: {out}{err}");
    assert!(out.contains("kubectl get prism"), "NOTES tell what to run next: {out}");
    let deploys = cp.kubectl_ok(&["get", "deploy", "-n", &ns, "-o", "name"]);
    for d in ["prism-prism-operator", "prism-prism-operator-postgres", "prism-prism-operator-redis"] {
        assert!(deploys.contains(d), "{deploys}");
    }
    // Least privilege: the ServiceAccount may reconcile, may not read Secrets anywhere.
    let sa = format!("system:serviceaccount:{ns}:prism-prism-operator");
    let can = |verb: &str, what: &str, in_ns: &str| {
        cp.kubectl(&["auth", "can-i", verb, what, "-n", in_ns, "--as", &sa], None).stdout.trim().to_string()
    };
    assert_eq!(can("patch", "controllerregistrations.prism.ntecdev.ai/status", "default"), "yes");
    assert_eq!(can("create", "tokenreviews.authentication.k8s.io", "default"), "yes");
    assert_eq!(can("update", "leases.coordination.k8s.io", &ns), "yes");
    assert_eq!(can("update", "leases.coordination.k8s.io", "default"), "no", "leases only in its namespace");
    assert_eq!(can("get", "secrets", "default"), "no");
    assert_eq!(can("get", "secrets", &ns), "no");
    assert_eq!(can("list", "secrets", "kube-system"), "no");

    // The cluster serves MutatingAdmissionPolicy, so the install brought the policy: a
    // ControllerRegistration applied as a user would gets the finalizer and project label
    // at admission (server-side dry run: admission runs, nothing is stored), and a
    // project id that is no valid label value gets the finalizer only.
    let registration = |project: &str, finalizers: &str| {
        format!(
            "apiVersion: prism.ntecdev.ai/v1alpha1\nkind: ControllerRegistration\nmetadata: {{name: probe, namespace: {ns}, finalizers: [{finalizers}]}}\nspec: {{projectId: '{project}', sessionId: s, agentSurface: codex}}\n"
        )
    };
    let admitted_with = |project: &str, finalizers: &str| -> serde_json::Value {
        let yaml = registration(project, finalizers);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let out = cp.kubectl(&["create", "--dry-run=server", "-o", "json", "-f", "-"], Some(&yaml));
            if out.ok {
                return serde_json::from_str(&out.stdout).expect("json");
            }
            // The documented window after a CRD is created (see the policy's template).
            assert!(
                out.stderr.contains("There can be a delay") && std::time::Instant::now() < deadline,
                "dry-run create: {}",
                out.stderr
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    };
    let admitted = |project: &str| admitted_with(project, "");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let obj = loop {
        let obj = admitted("PID-PGR01");
        if obj["metadata"]["finalizers"].is_array() || std::time::Instant::now() > deadline {
            break obj;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(obj["metadata"]["finalizers"], serde_json::json!(["prism.ntecdev.ai/release"]), "{obj}");
    assert_eq!(obj["metadata"]["labels"]["prism.ntecdev.ai/project"], "PID-PGR01");
    let kept = admitted_with("PID-PGR01", "other.io/keep");
    assert_eq!(kept["metadata"]["finalizers"], serde_json::json!(["other.io/keep", "prism.ntecdev.ai/release"]));
    let once = admitted_with("PID-PGR01", "prism.ntecdev.ai/release");
    assert_eq!(once["metadata"]["finalizers"], serde_json::json!(["prism.ntecdev.ai/release"]), "not twice");
    let long = admitted("not a label value");
    assert_eq!(long["metadata"]["finalizers"], serde_json::json!(["prism.ntecdev.ai/release"]));
    assert!(long["metadata"]["labels"]["prism.ntecdev.ai/project"].is_null(), "{long}");

    let (ok, _, err) = helm(&["uninstall", "prism", "--namespace", &ns, "--wait=false"], Some(&cp.kubeconfig));
    assert!(ok, "helm uninstall: {err}");
    let left = cp.kubectl_ok(&[
        "get",
        "deploy,clusterrole,mutatingadmissionpolicy,mutatingadmissionpolicybinding",
        "-A",
        "-l",
        "app.kubernetes.io/instance=prism",
        "-o",
        "name",
    ]);
    assert!(left.trim().is_empty(), "left behind: {left}");
}

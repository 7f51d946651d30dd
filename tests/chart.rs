//! The Helm chart: lint, render, schema, CRDs in sync, and a real install into the test
//! control plane (no kubelet runs there, so objects are checked as accepted, not run).

use prism_testkit as support;

use std::process::Command;

use kube::CustomResourceExt;

use support::{control_plane, repo_root};

fn helm_command(args: &[&str], kubeconfig: Option<&std::path::Path>) -> Command {
    let mut cmd = support::helm_command();
    cmd.args(args);
    if let Some(k) = kubeconfig {
        cmd.env("KUBECONFIG", k);
    }
    cmd
}

fn helm_result(out: std::io::Result<std::process::Output>) -> (bool, String, String) {
    let out = out.expect("helm runs (scripts/envtest-assets builds it)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// helm for the tests that render (no runtime of their own).
fn helm(args: &[&str], kubeconfig: Option<&std::path::Path>) -> (bool, String, String) {
    helm_result(helm_command(args, kubeconfig).output())
}

/// helm for the tests that install (on their runtime, which it leaves free meanwhile).
async fn helm_async(args: &[&str], kubeconfig: Option<&std::path::Path>) -> (bool, String, String) {
    helm_result(tokio::process::Command::from(helm_command(args, kubeconfig)).output().await)
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
        let in_chart = std::fs::read_to_string(repo_root().join("charts/prism-operator/files/crds").join(&file))
            .unwrap_or_default();
        assert!(
            in_chart == yaml,
            "charts/prism-operator/files/crds/{file} differs: cp crds/*.yaml charts/prism-operator/files/crds/"
        );
    }
}

/// A schema as JSON with every number a float: the chart's template reads the YAML
/// (Helm decodes numbers as floats) and writes `minimum: 0` where crdgen wrote `0.0`.
fn numbers_as_floats(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Number(n) => n.as_f64().map(Value::from).unwrap_or(Value::Number(n)),
        Value::Array(a) => Value::Array(a.into_iter().map(numbers_as_floats).collect()),
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, numbers_as_floats(v))).collect()),
        other => other,
    }
}

#[test]
fn the_crds_are_templates_that_follow_the_release_and_are_kept() {
    let docs = render(&[]);
    let crds: Vec<&serde_yaml::Value> = docs.iter().filter(|d| d["kind"] == "CustomResourceDefinition").collect();
    assert_eq!(crds.len(), 2, "both CRDs render from templates: {:?}", kinds(&docs));
    for crd in [prism_operator::crd::ControllerRegistration::crd(), prism_operator::crd::RunSession::crd()] {
        let name = crd.metadata.name.clone().expect("name");
        let rendered = crds.iter().find(|d| d["metadata"]["name"] == name.as_str()).expect("rendered");
        let meta = &rendered["metadata"];
        assert_eq!(meta["annotations"]["helm.sh/resource-policy"], "keep", "helm uninstall keeps {name}");
        assert_eq!(meta["labels"]["helm.sh/chart"].as_str().map(|c| c.starts_with("prism-operator-")), Some(true));
        let mut rendered: serde_json::Value = serde_json::to_value(rendered).expect("json");
        rendered["metadata"] = serde_json::json!({"name": name});
        let generated = serde_json::to_value(&crd).expect("json");
        assert_eq!(numbers_as_floats(rendered), numbers_as_floats(generated), "{name} renders as crdgen makes it");
    }
    let without = render(&["--set", "crds.install=false"]);
    assert!(without.iter().all(|d| d["kind"] != "CustomResourceDefinition"), "crds.install=false renders no CRD");
    assert!(
        !repo_root().join("charts/prism-operator/crds").exists(),
        "a crds/ folder is installed once and never upgraded by Helm: the CRDs are templates"
    );
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
        "tls.enabled=maybe",
        "tls.secretName=Not_A_Name",
        "tracing.otlpEndpoint=collector:4318",
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

#[test]
fn traces_are_exported_only_when_an_endpoint_is_given() {
    let off = operator_container(&render(&[]));
    assert_eq!(env_value(&off, "OTEL_EXPORTER_OTLP_ENDPOINT"), None, "no export by default");
    let on = operator_container(&render(&[
        "--set",
        "tracing.otlpEndpoint=http://otel-collector.observability:4318",
        "--set",
        "tracing.filter=warn\\,prism_operator=info",
    ]));
    assert_eq!(
        env_value(&on, "OTEL_EXPORTER_OTLP_ENDPOINT").as_deref(),
        Some("http://otel-collector.observability:4318")
    );
    assert_eq!(env_value(&on, "PRISM_TRACE_FILTER").as_deref(), Some("warn,prism_operator=info"));
}

fn find<'a>(docs: &'a [serde_yaml::Value], kind: &str, name: &str) -> Option<&'a serde_yaml::Value> {
    docs.iter().find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
}

fn operator_container(docs: &[serde_yaml::Value]) -> serde_yaml::Value {
    let deploy = find(docs, "Deployment", "prism-prism-operator").expect("operator deployment");
    deploy["spec"]["template"]["spec"]["containers"][0].clone()
}

fn env_value(container: &serde_yaml::Value, name: &str) -> Option<String> {
    container["env"].as_sequence()?.iter().find(|e| e["name"] == name)?["value"].as_str().map(str::to_string)
}

fn secret_bytes(secret: &serde_yaml::Value, key: &str) -> Vec<u8> {
    use base64::Engine as _;
    let b64 = secret["data"][key].as_str().unwrap_or_else(|| panic!("{key} in the Secret"));
    base64::engine::general_purpose::STANDARD.decode(b64).expect("base64")
}

/// The certificate the chart makes verifies, against the `ca.crt` beside it, for every
/// name a client in or outside the cluster uses, and the operator accepts the pair.
fn assert_serves_names(secret: &serde_yaml::Value, names: &[&str]) {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    prism_operator::install_crypto_provider();
    let (crt, key, ca) =
        (secret_bytes(secret, "tls.crt"), secret_bytes(secret, "tls.key"), secret_bytes(secret, "ca.crt"));
    let files = prism_operator::transport::CertFiles { cert: "tls.crt".into(), key: "tls.key".into() };
    files.parse(&crt, &key).expect("the operator serves the chart's certificate and key");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(&ca).expect("ca.crt PEM")).expect("CA");
    let verifier = rustls::client::WebPkiServerVerifier::builder(std::sync::Arc::new(roots)).build().expect("verifier");
    let leaf = CertificateDer::from_pem_slice(&crt).expect("tls.crt PEM");
    for name in names {
        let server = ServerName::try_from(name.to_string()).expect("server name");
        rustls::client::danger::ServerCertVerifier::verify_server_cert(
            verifier.as_ref(),
            &leaf,
            &[],
            &server,
            &[],
            UnixTime::now(),
        )
        .unwrap_or_else(|e| panic!("the chart's certificate for {name}: {e}"));
    }
    let other = ServerName::try_from("elsewhere.example").expect("name");
    assert!(
        rustls::client::danger::ServerCertVerifier::verify_server_cert(
            verifier.as_ref(),
            &leaf,
            &[],
            &other,
            &[],
            UnixTime::now()
        )
        .is_err(),
        "and for no other name"
    );
}

#[test]
fn tls_is_on_by_default_with_a_certificate_for_the_service() {
    let docs = render(&[]);
    let secret = find(&docs, "Secret", "prism-prism-operator-tls").expect("the chart makes the TLS Secret");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    assert_serves_names(
        secret,
        &[
            "prism-prism-operator",
            "prism-prism-operator.prism-system",
            "prism-prism-operator.prism-system.svc",
            "prism-prism-operator.prism-system.svc.cluster.local",
            "localhost",
            "127.0.0.1",
        ],
    );
    let c = operator_container(&docs);
    assert_eq!(env_value(&c, "PRISM_TLS_CERT_FILE").as_deref(), Some("/etc/prism/tls/tls.crt"));
    assert_eq!(env_value(&c, "PRISM_TLS_KEY_FILE").as_deref(), Some("/etc/prism/tls/tls.key"));
    assert_eq!(c["livenessProbe"]["httpGet"]["scheme"], "HTTPS");
    assert_eq!(c["readinessProbe"]["httpGet"]["scheme"], "HTTPS");
    assert_eq!(c["volumeMounts"][0]["mountPath"], "/etc/prism/tls");
    assert_eq!(c["volumeMounts"][0]["readOnly"], true);
    let pod = &find(&docs, "Deployment", "prism-prism-operator").expect("deployment")["spec"]["template"]["spec"];
    assert_eq!(pod["volumes"][0]["secret"]["secretName"], "prism-prism-operator-tls");
    assert_eq!(pod["volumes"][0]["secret"]["defaultMode"], 0o440);
    assert_eq!(pod["securityContext"]["fsGroup"], 65532, "the non-root operator reads its 0440 key");
    let svc = find(&docs, "Service", "prism-prism-operator").expect("service");
    assert_eq!(svc["spec"]["ports"][0]["name"], "https");

    // More names on request; Prometheus follows with the CA.
    let docs = render(&["--set", "tls.extraDnsNames={prism.example.com}", "--set", "serviceMonitor.enabled=true"]);
    let secret = find(&docs, "Secret", "prism-prism-operator-tls").expect("secret");
    assert_serves_names(secret, &["prism.example.com", "prism-prism-operator.prism-system.svc"]);
    let monitor = find(&docs, "ServiceMonitor", "prism-prism-operator").expect("monitor");
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["scheme"], "https");
    assert_eq!(endpoint["tlsConfig"]["ca"]["secret"]["name"], "prism-prism-operator-tls");
    assert_eq!(endpoint["tlsConfig"]["serverName"], "prism-prism-operator.prism-system.svc");

    // The user's Secret (cert-manager's, say): mounted, none made.
    let docs = render(&["--set", "tls.secretName=prism-api-cert"]);
    assert!(find(&docs, "Secret", "prism-prism-operator-tls").is_none());
    let pod = &find(&docs, "Deployment", "prism-prism-operator").expect("deployment")["spec"]["template"]["spec"];
    assert_eq!(pod["volumes"][0]["secret"]["secretName"], "prism-api-cert");

    // Off: plain HTTP, as before.
    let docs = render(&["--set", "tls.enabled=false"]);
    assert!(!docs.iter().any(|d| d["kind"] == "Secret"), "no Secret without TLS (and no demo)");
    let c = operator_container(&docs);
    assert_eq!(env_value(&c, "PRISM_TLS_CERT_FILE"), None);
    assert_eq!(c["livenessProbe"]["httpGet"]["scheme"], "HTTP");
    assert!(c["volumeMounts"].is_null());
    let svc = find(&docs, "Service", "prism-prism-operator").expect("service");
    assert_eq!(svc["spec"]["ports"][0]["name"], "http");
}

fn rules(role: &serde_yaml::Value) -> Vec<(String, Vec<String>)> {
    let strings = |v: &serde_yaml::Value| -> Vec<String> {
        v.as_sequence().map(|s| s.iter().filter_map(|x| x.as_str().map(str::to_string)).collect()).unwrap_or_default()
    };
    let mut out = Vec::new();
    for rule in role["rules"].as_sequence().expect("rules") {
        for resource in strings(&rule["resources"]) {
            out.push((resource, strings(&rule["verbs"])));
        }
    }
    out
}

fn verbs_on(rules: &[(String, Vec<String>)], resource: &str) -> Vec<String> {
    let mut v: Vec<String> = rules.iter().filter(|(r, _)| r == resource).flat_map(|(_, v)| v.clone()).collect();
    v.sort();
    v
}

#[test]
fn rbac_grants_what_is_used_and_follows_the_watched_namespace() {
    let docs = render(&[]);
    let cluster = rules(find(&docs, "ClusterRole", "prism-prism-operator").expect("cluster role"));
    assert_eq!(verbs_on(&cluster, "controllerregistrations"), ["create", "delete", "get", "list", "patch", "watch"]);
    assert_eq!(
        verbs_on(&cluster, "runsessions"),
        ["get", "list", "patch", "watch"],
        "nothing creates or deletes RunSessions"
    );
    assert_eq!(verbs_on(&cluster, "tokenreviews"), ["create"]);
    assert_eq!(verbs_on(&cluster, "events"), ["create", "patch"]);
    assert_eq!(verbs_on(&cluster, "customresourcedefinitions"), ["get"], "its CRDs read at start, nothing else");
    assert!(find(&docs, "Role", "prism-prism-operator").is_none());

    let docs = render(&["--set", "config.watchNamespace=team-a"]);
    let cluster = rules(find(&docs, "ClusterRole", "prism-prism-operator").expect("cluster role"));
    let resources: Vec<&str> = cluster.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(
        resources,
        ["tokenreviews", "subjectaccessreviews", "customresourcedefinitions"],
        "only the cluster-scoped reviews and the read of its own CRDs stay cluster-wide"
    );
    let role = find(&docs, "Role", "prism-prism-operator").expect("a Role in the watched namespace");
    assert_eq!(role["metadata"]["namespace"], "team-a");
    let scoped = rules(role);
    assert_eq!(verbs_on(&scoped, "controllerregistrations"), ["create", "delete", "get", "list", "patch", "watch"]);
    assert_eq!(verbs_on(&scoped, "runsessions"), ["get", "list", "patch", "watch"]);
    assert_eq!(verbs_on(&scoped, "runsessions/status"), ["get", "patch"]);
    assert_eq!(verbs_on(&scoped, "events"), ["create", "patch"]);
    let binding = find(&docs, "RoleBinding", "prism-prism-operator").expect("binding");
    assert_eq!(binding["metadata"]["namespace"], "team-a");
    assert_eq!(binding["subjects"][0]["namespace"], "prism-system");
    let leader = find(&docs, "Role", "prism-prism-operator-leader").expect("leader role");
    assert_eq!(leader["metadata"]["namespace"], "prism-system", "the Lease stays in the release namespace");
}

#[test]
fn the_demo_redis_has_a_password() {
    let docs = render(&["--set", "demo.enabled=true"]);
    let secret = find(&docs, "Secret", "prism-operator-redis").expect("redis secret");
    let password = secret["stringData"]["password"].as_str().expect("password");
    assert!(password.len() >= 24 && password.chars().all(|c| c.is_ascii_alphanumeric()), "{password}");
    let url = secret["stringData"]["REDIS_URL"].as_str().expect("url");
    assert_eq!(url, format!("redis://:{password}@prism-prism-operator-redis:6379"));
    let redis = find(&docs, "Deployment", "prism-prism-operator-redis").expect("redis");
    let c = &redis["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = c["args"].as_sequence().expect("args").iter().filter_map(|a| a.as_str()).collect();
    assert!(args.windows(2).any(|w| w == ["--requirepass", "$(REDIS_PASSWORD)"]), "{args:?}");
    assert_eq!(c["env"][0]["valueFrom"]["secretKeyRef"]["key"], "password");
    assert!(!serde_yaml::to_string(c).expect("yaml").contains(password), "the password only in the Secret");
}

#[tokio::test]
async fn installs_into_a_real_api_server_and_uninstalls() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "helm").await;
    let chart = chart();
    // The test binary's control plane has the CRDs already (not the release's):
    // tests/crd_lifecycle.rs installs them with a release.
    let release = |verb: &'static str| {
        let args = [verb, "prism", chart.as_str(), "--namespace", &ns, "--set", "demo.enabled=true"];
        let more = ["--set", "replicas=2", "--set", "crds.install=false"];
        let args: Vec<&str> = args.into_iter().chain(more).collect();
        async move { helm_async(&args, Some(&cp.kubeconfig)).await }
    };
    let (ok, out, err) = release("install").await;
    assert!(ok, "helm install: {out}{err}");
    assert!(out.contains("kubectl get prism"), "NOTES tell what to run next: {out}");
    let deploys = cp.kubectl_ok(&["get", "deploy", "-n", &ns, "-o", "name"]).await;
    for d in ["prism-prism-operator", "prism-prism-operator-postgres", "prism-prism-operator-redis"] {
        assert!(deploys.contains(d), "{deploys}");
    }
    // Least privilege: the ServiceAccount may reconcile, may not read Secrets anywhere.
    let sa = format!("system:serviceaccount:{ns}:prism-prism-operator");
    let can = async |verb: &str, what: &str, in_ns: &str| {
        cp.kubectl(&["auth", "can-i", verb, what, "-n", in_ns, "--as", &sa], None).await.stdout.trim().to_string()
    };
    assert_eq!(can("patch", "controllerregistrations.prism.ntecdev.ai/status", "default").await, "yes");
    assert_eq!(can("create", "controllerregistrations.prism.ntecdev.ai", "default").await, "yes");
    assert_eq!(can("create", "runsessions.prism.ntecdev.ai", "default").await, "no");
    assert_eq!(can("delete", "runsessions.prism.ntecdev.ai", "default").await, "no");
    assert_eq!(can("create", "tokenreviews.authentication.k8s.io", "default").await, "yes");
    assert_eq!(can("update", "leases.coordination.k8s.io", &ns).await, "yes");
    assert_eq!(can("update", "leases.coordination.k8s.io", "default").await, "no", "leases only in its namespace");
    assert_eq!(can("get", "secrets", "default").await, "no");
    assert_eq!(can("get", "secrets", &ns).await, "no");
    assert_eq!(can("list", "secrets", "kube-system").await, "no");

    // The cluster serves MutatingAdmissionPolicy, so the install brought the policy: a
    // ControllerRegistration applied as a user would gets the finalizer and project label
    // at admission (server-side dry run: admission runs, nothing is stored), and a
    // project id that is no valid label value gets the finalizer only.
    let registration = |project: &str, finalizers: &str| {
        format!(
            "apiVersion: prism.ntecdev.ai/v1alpha1\nkind: ControllerRegistration\nmetadata: {{name: probe, namespace: {ns}, finalizers: [{finalizers}]}}\nspec: {{projectId: '{project}', sessionId: s, agentSurface: codex}}\n"
        )
    };
    let admitted_with = async |project: &str, finalizers: &str| -> serde_json::Value {
        let yaml = registration(project, finalizers);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let out = cp.kubectl(&["create", "--dry-run=server", "-o", "json", "-f", "-"], Some(&yaml)).await;
            if out.ok {
                return serde_json::from_str(&out.stdout).expect("json");
            }
            // The documented window after a CRD is created (see the policy's template).
            assert!(
                out.stderr.contains("There can be a delay") && std::time::Instant::now() < deadline,
                "dry-run create: {}",
                out.stderr
            );
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    };
    let admitted = async |project: &str| admitted_with(project, "").await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let obj = loop {
        let obj = admitted("PID-PGR01").await;
        if obj["metadata"]["finalizers"].is_array() || std::time::Instant::now() > deadline {
            break obj;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert_eq!(obj["metadata"]["finalizers"], serde_json::json!(["prism.ntecdev.ai/release"]), "{obj}");
    assert_eq!(obj["metadata"]["labels"]["prism.ntecdev.ai/project"], "PID-PGR01");
    let kept = admitted_with("PID-PGR01", "other.io/keep").await;
    assert_eq!(kept["metadata"]["finalizers"], serde_json::json!(["other.io/keep", "prism.ntecdev.ai/release"]));
    let once = admitted_with("PID-PGR01", "prism.ntecdev.ai/release").await;
    assert_eq!(once["metadata"]["finalizers"], serde_json::json!(["prism.ntecdev.ai/release"]), "not twice");
    let long = admitted("not a label value").await;
    assert_eq!(long["metadata"]["finalizers"], serde_json::json!(["prism.ntecdev.ai/release"]));
    assert!(long["metadata"]["labels"]["prism.ntecdev.ai/project"].is_null(), "{long}");

    // The generated certificate and passwords are kept across an upgrade (lookup).
    let secrets = async || {
        let mut data = Vec::new();
        for name in ["prism-prism-operator-tls", "prism-operator-db", "prism-operator-redis"] {
            data.push(cp.kubectl_ok(&["get", "secret", name, "-n", &ns, "-o", "jsonpath={.data}"]).await);
        }
        data
    };
    let before = secrets().await;
    assert!(before[0].contains("ca.crt") && before[2].contains("password"), "{before:?}");
    let (ok, out, err) = release("upgrade").await;
    assert!(ok, "helm upgrade: {out}{err}");
    let after = secrets().await;
    assert_eq!(before, after, "helm upgrade made new certificates or passwords");

    let (ok, _, err) =
        helm_async(&["uninstall", "prism", "--namespace", &ns, "--wait=false"], Some(&cp.kubeconfig)).await;
    assert!(ok, "helm uninstall: {err}");
    let left = cp
        .kubectl_ok(&[
            "get",
            "deploy,clusterrole,mutatingadmissionpolicy,mutatingadmissionpolicybinding",
            "-A",
            "-l",
            "app.kubernetes.io/instance=prism",
            "-o",
            "name",
        ])
        .await;
    assert!(left.trim().is_empty(), "left behind: {left}");
}

#[tokio::test]
async fn with_a_watched_namespace_the_operator_may_act_there_only() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "helm-scoped").await;
    let team = support::namespace(&client, "team").await;
    let chart = chart();
    let (ok, out, err) = helm_async(
        &[
            "install",
            "scoped",
            chart.as_str(),
            "--namespace",
            &ns,
            "--set",
            &format!("config.watchNamespace={team}"),
            "--set",
            "admissionPolicy.enabled=false",
            "--set",
            "tls.secretName=scoped-cert",
            // The test binary's control plane has the CRDs already (not the release's).
            "--set",
            "crds.install=false",
        ],
        Some(&cp.kubeconfig),
    )
    .await;
    assert!(ok, "helm install: {out}{err}");
    let sa = format!("system:serviceaccount:{ns}:scoped-prism-operator");
    let can = async |verb: &str, what: &str, in_ns: &str| {
        cp.kubectl(&["auth", "can-i", verb, what, "-n", in_ns, "--as", &sa], None).await.stdout.trim().to_string()
    };
    assert_eq!(can("watch", "controllerregistrations.prism.ntecdev.ai", &team).await, "yes");
    assert_eq!(can("create", "controllerregistrations.prism.ntecdev.ai", &team).await, "yes");
    assert_eq!(can("patch", "runsessions.prism.ntecdev.ai/status", &team).await, "yes");
    assert_eq!(can("create", "events.events.k8s.io", &team).await, "yes");
    for elsewhere in ["default", ns.as_str()] {
        assert_eq!(can("list", "controllerregistrations.prism.ntecdev.ai", elsewhere).await, "no", "{elsewhere}");
    }
    assert_eq!(can("create", "events.events.k8s.io", "default").await, "no");
    // Its own namespace: the term mark (a ConfigMap) and the Event of a restore (SPEC §15).
    assert_eq!(can("create", "events.events.k8s.io", &ns).await, "yes");
    assert_eq!(can("update", "configmaps", &ns).await, "yes");
    assert_eq!(can("update", "configmaps", "default").await, "no");
    assert_eq!(can("create", "tokenreviews.authentication.k8s.io", "default").await, "yes");
    assert_eq!(can("create", "subjectaccessreviews.authorization.k8s.io", "default").await, "yes");
    // The user's Secret is theirs: the chart made none.
    let secrets = cp.kubectl_ok(&["get", "secrets", "-n", &ns, "-o", "name"]).await;
    assert!(!secrets.contains("scoped-cert") && !secrets.contains("-tls"), "{secrets}");
    let (ok, _, err) =
        helm_async(&["uninstall", "scoped", "--namespace", &ns, "--wait=false"], Some(&cp.kubeconfig)).await;
    assert!(ok, "helm uninstall: {err}");
    let left = cp
        .kubectl_ok(&["get", "role,rolebinding", "-n", &team, "-l", "app.kubernetes.io/instance=scoped", "-o", "name"])
        .await;
    assert!(left.trim().is_empty(), "left behind: {left}");
}

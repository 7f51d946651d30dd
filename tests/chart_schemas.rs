//! The Helm chart against the Kubernetes API's own schemas: `helm lint --strict`, and
//! kubeconform `-strict` over the chart rendered with every documented values combination
//! (CRDs included), so a misspelled or misplaced field in a template fails here rather
//! than at a user's `helm install`.
//!
//! kubeconform is built from the Go module proxy (scripts/kubeconform). Its default
//! schemas are downloaded from GitHub, which CI cannot reach, so the schemas are made here
//! from the OpenAPI v3 document the test control plane's kube-apiserver (the one of
//! KUBEBUILDER_ASSETS) serves, with the Prometheus Operator's CRDs applied to it first
//! (ServiceMonitor is not built in; its CRDs come from that project's Go module). They are
//! cached in ~/.cache/prism-operator/kube-schemas-<version>-...: later runs start no
//! control plane.

use prism_testkit as support;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use support::{assets_dir, repo_root};

/// The Prometheus Operator release whose CRDs give ServiceMonitor (and PrometheusRule)
/// their schemas: its Go module holds them in example/prometheus-operator-crd/.
const PROMETHEUS_OPERATOR: &str = "v0.85.0";
const MONITORING_CRDS: [&str; 2] =
    ["monitoring.coreos.com_servicemonitors.yaml", "monitoring.coreos.com_prometheusrules.yaml"];
/// In the cache's name: bump it when `json_schemas` (or what is applied before the
/// OpenAPI is read) changes, so that schemas cached the old way are not used.
const CONVERSION: u32 = 1;

// --- helm -------------------------------------------------------------------------------

fn chart() -> String {
    repo_root().join("charts/prism-operator").to_string_lossy().into_owned()
}

/// helm with homes of its own (no user's repositories or plugins), as tests/chart.rs runs it.
fn helm(args: &[String]) -> Result<String, String> {
    let out = support::helm_command().args(args).output().expect("helm runs (scripts/envtest-assets builds it)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() { Ok(stdout) } else { Err(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr))) }
}

/// The Kubernetes version of KUBEBUILDER_ASSETS' API server ("1.37.2"): what the chart is
/// rendered for and the schemas are made from.
fn kube_version() -> &'static str {
    static VERSION: OnceLock<String> = OnceLock::new();
    VERSION.get_or_init(|| {
        let out = Command::new(assets_dir().join("kube-apiserver")).arg("--version").output().expect("kube-apiserver");
        let text = String::from_utf8_lossy(&out.stdout);
        // "Kubernetes v1.37.2"
        let version = text.split_whitespace().last().and_then(|v| v.strip_prefix('v'));
        version.unwrap_or_else(|| panic!("kube-apiserver --version said {text:?}")).to_string()
    })
}

/// `helm template` of the release "prism" in prism-system, as the docs install it, with
/// the CRDs (they are API objects too) and the chart's `Capabilities` of this version.
fn render(c: &Combination) -> Result<String, String> {
    let mut args: Vec<String> = ["template", "prism", &chart(), "--namespace", "prism-system", "--include-crds"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(["--kube-version".to_string(), kube_version().to_string()]);
    for api in c.api_versions {
        args.extend(["--api-versions".to_string(), api.to_string()]);
    }
    args.extend(c.values());
    helm(&args)
}

/// `helm lint --strict`: warnings fail too. Helm 4's lint lets a template's `fail` pass
/// (it logs it), so each combination is also rendered, which does fail on it.
fn lint(c: &Combination) -> Result<String, String> {
    let mut args: Vec<String> =
        ["lint", "--strict", &chart(), "--kube-version", kube_version()].iter().map(|s| s.to_string()).collect();
    args.extend(c.values());
    helm(&args)
}

fn documents(manifest: &str) -> Vec<serde_yaml::Value> {
    serde_yaml::Deserializer::from_str(manifest)
        .map(|d| serde::Deserialize::deserialize(d).expect("helm's output is YAML"))
        .filter(|v: &serde_yaml::Value| !v.is_null())
        .collect()
}

/// "Kind/name" of each object.
fn kinds(docs: &[serde_yaml::Value]) -> Vec<String> {
    docs.iter()
        .map(|d| format!("{}/{}", d["kind"].as_str().unwrap_or("?"), d["metadata"]["name"].as_str().unwrap_or("?")))
        .collect()
}

// --- the schemas ------------------------------------------------------------------------

/// The JSON schemas kubeconform reads, one file per kind under the name its templates
/// give (`{{ .ResourceKind }}{{ .KindSuffix }}.json`: deployment-apps-v1.json,
/// service-v1.json, servicemonitor-monitoring-v1.json), from OpenAPI v3 documents (one per
/// group version, as /openapi/v3/<path> serves them). Each file stands alone: the
/// definitions it refers to, transitively, are copied into it. And each is strict, as
/// kubeconform's own "-strict" schemas are: an object with listed properties takes no
/// others (what kubectl's client-side validation refuses and the API server drops).
fn json_schemas(docs: &[Value]) -> BTreeMap<String, Value> {
    let mut files: BTreeMap<String, (String, Value)> = BTreeMap::new();
    for doc in docs {
        let Some(schemas) = doc["components"]["schemas"].as_object() else { continue };
        for (name, schema) in schemas {
            let Some(gvks) = schema["x-kubernetes-group-version-kind"].as_array() else { continue };
            for gvk in gvks {
                let (group, version, kind) = (
                    gvk["group"].as_str().unwrap_or(""),
                    gvk["version"].as_str().unwrap_or(""),
                    gvk["kind"].as_str().unwrap_or(""),
                );
                // kubeconform's KindSuffix: the group's first label only ("-apps-v1",
                // "-networking-v1"), nothing for the core group ("-v1").
                let suffix = match group.split('.').next() {
                    Some(first) if !first.is_empty() => format!("-{first}-{version}"),
                    _ => format!("-{version}"),
                };
                let file = format!("{kind}{suffix}.json").to_lowercase();
                let api_version = if group.is_empty() { version.to_string() } else { format!("{group}/{version}") };
                if let Some((other, _)) = files.get(&file) {
                    // Meta kinds (DeleteOptions, WatchEvent) are in every document.
                    assert_eq!(other, &api_version, "two kinds map to {file}: kubeconform could not tell them apart");
                    continue;
                }
                files.insert(file, (api_version, standalone(name, schemas)));
            }
        }
    }
    files.into_iter().map(|(file, (_, schema))| (file, schema)).collect()
}

/// `name`'s schema with every definition it reaches under `definitions` (refs rewritten to
/// point there: kubeconform compiles each file on its own, as JSON schema draft 4).
fn standalone(name: &str, schemas: &Map<String, Value>) -> Value {
    let mut root = strict(&schemas[name]);
    let mut definitions = Map::new();
    let mut todo = refs(&root);
    while let Some(def) = todo.pop() {
        if definitions.contains_key(&def) {
            continue;
        }
        let schema = strict(schemas.get(&def).unwrap_or_else(|| panic!("{name} refers to {def}, which is not there")));
        todo.extend(refs(&schema));
        definitions.insert(def, schema);
    }
    if !definitions.is_empty() {
        root["definitions"] = Value::Object(definitions);
    }
    root
}

const REF_PREFIX: &str = "#/components/schemas/";
const DEF_PREFIX: &str = "#/definitions/";

/// The definitions `schema` refers to (after `strict`: `#/definitions/<name>`).
fn refs(schema: &Value) -> Vec<String> {
    let mut out = Vec::new();
    match schema {
        Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("$ref", Value::String(r)) => out.extend(r.strip_prefix(DEF_PREFIX).map(str::to_string)),
                    _ => out.extend(refs(v)),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| out.extend(refs(v))),
        _ => {}
    }
    out
}

/// One OpenAPI v3 schema as a strict JSON schema (draft 4, which kubeconform compiles):
/// refs into `definitions`, no other properties beside listed ones (unless the API keeps
/// unknown fields there), `nullable` as a "null" type. Only schema positions are walked,
/// so a property that happens to be called "properties" or "nullable" is left alone.
fn strict(schema: &Value) -> Value {
    let Value::Object(map) = schema else { return schema.clone() };
    let mut out = Map::new();
    for (k, v) in map {
        let v = match k.as_str() {
            "$ref" => match v.as_str().and_then(|r| r.strip_prefix(REF_PREFIX)) {
                Some(def) => Value::String(format!("{DEF_PREFIX}{def}")),
                None => panic!("a $ref outside the document's schemas: {v}"),
            },
            "properties" | "patternProperties" => match v {
                Value::Object(props) => Value::Object(props.iter().map(|(p, s)| (p.clone(), strict(s))).collect()),
                other => other.clone(),
            },
            "items" | "additionalProperties" | "not" => match v {
                Value::Array(list) => Value::Array(list.iter().map(strict).collect()),
                other => strict(other),
            },
            "allOf" | "anyOf" | "oneOf" => match v {
                Value::Array(list) => Value::Array(list.iter().map(strict).collect()),
                other => other.clone(),
            },
            _ => v.clone(),
        };
        out.insert(k.clone(), v);
    }
    let keeps_unknown = map.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    if map.contains_key("properties") && !map.contains_key("additionalProperties") && !keeps_unknown {
        out.insert("additionalProperties".into(), Value::Bool(false));
    }
    if map.get("nullable") == Some(&Value::Bool(true)) {
        match out.get("type").cloned() {
            Some(Value::String(t)) => {
                out.insert("type".into(), json!([t, "null"]));
            }
            Some(_) => {}
            None => return json!({"anyOf": [{"type": "null"}, Value::Object(out)]}),
        }
    }
    Value::Object(out)
}

/// The directory of schema files, made once per machine (per Kubernetes version, Prometheus
/// Operator version and conversion) and cached: the control plane starts only to make it.
fn schemas_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let cache = match std::env::var_os("HOME") {
            Some(home) => PathBuf::from(home).join(".cache/prism-operator"),
            None => std::env::temp_dir(),
        };
        let dir =
            cache.join(format!("kube-schemas-v{}-monitoring-{PROMETHEUS_OPERATOR}-r{CONVERSION}", kube_version()));
        if dir.join("deployment-apps-v1.json").is_file() {
            return dir;
        }
        let started = Instant::now();
        let docs = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(openapi_documents());
        let files = json_schemas(&docs);
        // Written aside, then renamed into place: a run killed halfway, or another test
        // binary doing the same, never leaves a partial directory under the cached name.
        let tmp = cache.join(format!(".kube-schemas-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&tmp).expect("create the schemas' directory");
        for (file, schema) in &files {
            std::fs::write(tmp.join(file), serde_json::to_vec(schema).expect("JSON")).expect("write a schema");
        }
        if std::fs::rename(&tmp, &dir).is_err() {
            // Another process put it there first: theirs is as good.
            let _ = std::fs::remove_dir_all(&tmp);
            assert!(dir.join("deployment-apps-v1.json").is_file(), "no schemas in {}", dir.display());
        }
        eprintln!("{} JSON schemas made in {:?}: {}", files.len(), started.elapsed(), dir.display());
        dir
    })
}

fn unique() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// The control plane's OpenAPI v3 documents, one per group version, once the Prometheus
/// Operator's CRDs are applied and served.
async fn openapi_documents() -> Vec<Value> {
    let cp = support::control_plane().await;
    let module = prometheus_operator_module();
    let mut apply = vec!["apply".to_string(), "--server-side".to_string()];
    for crd in MONITORING_CRDS {
        apply
            .extend(["-f".to_string(), module.join("example/prometheus-operator-crd").join(crd).display().to_string()]);
    }
    cp.kubectl_ok(&apply.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let get = move |path: String| async move {
        let text = cp.kubectl_ok(&["get", "--raw", &path]).await;
        serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    // The API server publishes a CRD's OpenAPI a moment after it is established.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let index = get("/openapi/v3".to_string()).await;
        if let Some(url) = index["paths"]["apis/monitoring.coreos.com/v1"]["serverRelativeURL"].as_str() {
            let doc = get(url.to_string()).await;
            let served =
                |kind: &str| doc["components"]["schemas"][format!("com.coreos.monitoring.v1.{kind}")].is_object();
            if served("ServiceMonitor") && served("PrometheusRule") {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the Prometheus Operator's CRDs not in /openapi/v3 after 60 s");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let index = get("/openapi/v3".to_string()).await;
    let urls: Vec<String> = index["paths"]
        .as_object()
        .expect("/openapi/v3 lists paths")
        .values()
        .filter_map(|p| p["serverRelativeURL"].as_str().map(str::to_string))
        .collect();
    futures::future::join_all(urls.into_iter().map(get)).await
}

/// The Prometheus Operator's Go module (downloaded by `go mod download` from the Go module
/// proxy into the module cache, checked against the checksum database).
fn prometheus_operator_module() -> PathBuf {
    let out = Command::new("go")
        .args([
            "mod",
            "download",
            "-json",
            &format!("github.com/prometheus-operator/prometheus-operator@{PROMETHEUS_OPERATOR}"),
        ])
        .current_dir(std::env::temp_dir())
        .output()
        .expect("go runs (https://go.dev/dl; scripts/kubeconform needs it too)");
    assert!(
        out.status.success(),
        "go mod download: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let info: Value = serde_json::from_slice(&out.stdout).expect("go mod download -json");
    PathBuf::from(info["Dir"].as_str().expect("the module's directory"))
}

// --- kubeconform ------------------------------------------------------------------------

fn kubeconform_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        // Builds it the first time (a fresh clone, CI); prints the cached path after that.
        let out = Command::new(repo_root().join("scripts/kubeconform")).output().expect("run scripts/kubeconform");
        assert!(out.status.success(), "scripts/kubeconform: {}", String::from_utf8_lossy(&out.stderr));
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
}

/// kubeconform -strict over a manifest: Ok(how many objects it found valid) when every
/// object validates, Err(what it said) otherwise. An object of a kind without a schema is
/// an error, not a skip (no -ignore-missing-schemas): nothing passes unchecked. The
/// schemas are strict already; `-strict` adds duplicate keys to what is refused.
fn validate(manifest: &str) -> Result<usize, String> {
    let template = format!("{}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json", schemas_dir().display());
    let mut child = Command::new(kubeconform_bin())
        .args(["-strict", "-summary", "-output", "json", "-verbose", "-schema-location", &template, "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kubeconform");
    child.stdin.take().expect("stdin").write_all(manifest.as_bytes()).expect("write the manifest");
    let out = child.wait_with_output().expect("kubeconform");
    let report: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "kubeconform's output is not JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let results = report["resources"].as_array().cloned().unwrap_or_default();
    let bad: Vec<String> = results
        .iter()
        .filter(|r| r["status"] != "statusValid")
        .map(|r| {
            let field = |k: &str| r[k].as_str().unwrap_or("?");
            // "problem validating schema. Check JSON formatting: jsonschema validation failed
            // with 'file:///…/deployment-apps-v1.json#' - at '/spec': …": from the schema on.
            let msg = field("msg");
            let msg = msg.split_once(".json#' ").map_or(msg, |(_, causes)| causes);
            let msg = msg.split_whitespace().collect::<Vec<_>>().join(" ");
            format!("{} {} ({}): {msg}", field("kind"), field("name"), field("status"))
        })
        .collect();
    if !out.status.success() || !bad.is_empty() {
        return Err(format!("{}\n{}", bad.join("\n"), String::from_utf8_lossy(&out.stderr)));
    }
    Ok(results.len())
}

// --- the documented combinations ---------------------------------------------------------

struct Combination {
    /// What it is and where it is documented.
    name: &'static str,
    /// `--set` and `--set-json` values, given to both `helm lint` and `helm template`.
    set: &'static [&'static str],
    set_json: &'static [&'static str],
    /// `--api-versions` the cluster would serve (`helm template` only).
    api_versions: &'static [&'static str],
    /// Objects ("Kind/name") the combination is documented to add, or to leave out: so a
    /// combination cannot pass by rendering what the defaults do.
    renders: &'static [&'static str],
    absent: &'static [&'static str],
}

impl Combination {
    fn values(&self) -> Vec<String> {
        let set = self.set.iter().flat_map(|v| ["--set".to_string(), v.to_string()]);
        set.chain(self.set_json.iter().flat_map(|v| ["--set-json".to_string(), v.to_string()])).collect()
    }
}

const NONE: Combination =
    Combination { name: "", set: &[], set_json: &[], api_versions: &[], renders: &[], absent: &[] };

/// The API that the admission policies need (Kubernetes 1.36+; docs/src/guides/install.md).
const POLICY_APIS: &[&str] = &[
    "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy",
    "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
];

/// Two constraints: one left to the chart's labelSelector, one with its own.
const SPREAD: &str = r#"topologySpreadConstraints=[{"maxSkew":1,"topologyKey":"topology.kubernetes.io/zone","whenUnsatisfiable":"ScheduleAnyway"},{"maxSkew":1,"topologyKey":"kubernetes.io/hostname","whenUnsatisfiable":"DoNotSchedule","labelSelector":{"matchLabels":{"app.kubernetes.io/name":"prism-operator"}},"matchLabelKeys":["pod-template-hash"]}]"#;

const DEPLOYMENT: &str = "Deployment/prism-prism-operator";
const TLS_SECRET: &str = "Secret/prism-prism-operator-tls";
const PDB: &str = "PodDisruptionBudget/prism-prism-operator";
const MONITOR: &str = "ServiceMonitor/prism-prism-operator";
const RULE: &str = "PrometheusRule/prism-prism-operator";
const CRDS: [&str; 2] = [
    "CustomResourceDefinition/controllerregistrations.prism.ntecdev.ai",
    "CustomResourceDefinition/runsessions.prism.ntecdev.ai",
];
const POLICIES: [&str; 4] = [
    "MutatingAdmissionPolicy/prism-prism-operator-registration-defaults",
    "MutatingAdmissionPolicyBinding/prism-prism-operator-registration-defaults",
    "ValidatingAdmissionPolicy/prism-prism-operator-registration-owner",
    "ValidatingAdmissionPolicyBinding/prism-prism-operator-registration-owner",
];

/// Every combination values.yaml and the guides (install.md, operating.md,
/// tls-and-limits.md, metrics.md) document.
const COMBINATIONS: &[Combination] = &[
    Combination {
        name: "defaults",
        renders: &[
            DEPLOYMENT,
            "Service/prism-prism-operator",
            "ServiceAccount/prism-prism-operator",
            "ClusterRole/prism-prism-operator",
            "ClusterRoleBinding/prism-prism-operator",
            TLS_SECRET,
            CRDS[0],
            CRDS[1],
        ],
        absent: &[PDB, MONITOR, RULE, POLICIES[0]],
        ..NONE
    },
    Combination { name: "HA: replicas 2 (operating.md)", set: &["replicas=2"], renders: &[PDB], ..NONE },
    Combination {
        name: "the kind quick start: demo, replicas 2, NodePort 30080 (install.md)",
        set: &["demo.enabled=true", "replicas=2", "service.type=NodePort", "service.nodePort=30080"],
        renders: &[
            "Deployment/prism-prism-operator-postgres",
            "Deployment/prism-prism-operator-redis",
            "Secret/prism-operator-db",
            "Secret/prism-operator-redis",
            PDB,
        ],
        ..NONE
    },
    Combination { name: "TLS off", set: &["tls.enabled=false"], renders: &[DEPLOYMENT], absent: &[TLS_SECRET], ..NONE },
    Combination {
        name: "TLS: the chart's certificate with extra names and a shorter life (tls-and-limits.md)",
        set: &["tls.validityDays=365"],
        set_json: &[r#"tls.extraDnsNames=["prism.example.com"]"#],
        renders: &[TLS_SECRET],
        ..NONE
    },
    Combination {
        name: "TLS: your Secret, e.g. cert-manager's (tls-and-limits.md)",
        set: &["tls.secretName=prism-api-cert"],
        renders: &[DEPLOYMENT],
        absent: &[TLS_SECRET],
        ..NONE
    },
    Combination {
        name: "the CRDs applied another way (crds.install=false)",
        set: &["crds.install=false"],
        renders: &[DEPLOYMENT],
        absent: &CRDS,
        ..NONE
    },
    Combination {
        name: "network policy with namespaces allowed",
        set: &["networkPolicy.enabled=true"],
        set_json: &[r#"networkPolicy.allowFrom=[{"matchLabels":{"kubernetes.io/metadata.name":"agents"}}]"#],
        renders: &["NetworkPolicy/prism-prism-operator"],
        ..NONE
    },
    Combination {
        name: "ServiceMonitor over TLS (metrics.md)",
        set: &["serviceMonitor.enabled=true"],
        renders: &[MONITOR],
        ..NONE
    },
    Combination {
        name: "ServiceMonitor with its own tlsConfig",
        set: &["serviceMonitor.enabled=true", "serviceMonitor.interval=15s"],
        set_json: &[
            r#"serviceMonitor.tlsConfig={"ca":{"configMap":{"name":"prism-ca","key":"ca.crt"}},"serverName":"prism.example.com"}"#,
        ],
        renders: &[MONITOR],
        ..NONE
    },
    Combination {
        name: "ServiceMonitor without TLS",
        set: &["serviceMonitor.enabled=true", "tls.enabled=false"],
        renders: &[MONITOR],
        ..NONE
    },
    Combination {
        name: "alerts: PrometheusRule beside the ServiceMonitor, runbooks on a site",
        set: &[
            "serviceMonitor.enabled=true",
            "prometheusRule.enabled=true",
            "prometheusRule.runbookBaseUrl=https://docs.example.com/prism-operator",
        ],
        set_json: &[
            r#"prometheusRule.labels={"release":"kube-prometheus-stack"}"#,
            r#"prometheusRule.alertLabels={"team":"platform"}"#,
        ],
        renders: &[MONITOR, RULE],
        ..NONE
    },
    Combination {
        name: "Grafana dashboard ConfigMap",
        set: &["grafanaDashboard.enabled=true", "grafanaDashboard.namespace=monitoring"],
        set_json: &[r#"grafanaDashboard.annotations={"grafana_folder":"prism"}"#],
        renders: &["ConfigMap/prism-prism-operator-dashboard"],
        ..NONE
    },
    Combination {
        name: "admission policies on a 1.36+ cluster (install.md)",
        api_versions: POLICY_APIS,
        renders: &POLICIES,
        ..NONE
    },
    Combination {
        name: "admission policies off on a 1.36+ cluster",
        set: &["admissionPolicy.enabled=false"],
        api_versions: POLICY_APIS,
        renders: &[DEPLOYMENT],
        absent: &POLICIES,
        ..NONE
    },
    Combination {
        name: "one watched namespace, admission policies bound to it (install.md)",
        set: &["config.watchNamespace=team-a"],
        api_versions: POLICY_APIS,
        renders: &["Role/prism-prism-operator", "RoleBinding/prism-prism-operator", POLICIES[1]],
        ..NONE
    },
    Combination { name: "Redis Cluster (install.md)", set: &["redis.mode=cluster"], renders: &[DEPLOYMENT], ..NONE },
    Combination {
        name: "traces to a collector (metrics.md)",
        set: &["tracing.otlpEndpoint=http://otel-collector.observability:4318", "tracing.filter=info"],
        renders: &[DEPLOYMENT],
        ..NONE
    },
    Combination {
        name: "MCP host names and text logs",
        set: &["config.logFormat=text"],
        set_json: &[r#"mcp.allowedHosts=["prism.example.com","10.0.0.5:30080"]"#],
        renders: &[DEPLOYMENT],
        ..NONE
    },
    Combination {
        name: "LoadBalancer Service, no leader election",
        set: &["service.type=LoadBalancer", "leaderElection.enabled=false"],
        renders: &["Service/prism-prism-operator"],
        ..NONE
    },
    Combination {
        name: "scheduling: nodeSelector, tolerations, affinity, topologySpreadConstraints (install.md)",
        set: &["replicas=3"],
        set_json: &[
            r#"nodeSelector={"kubernetes.io/os":"linux"}"#,
            r#"tolerations=[{"key":"dedicated","operator":"Equal","value":"prism","effect":"NoSchedule"}]"#,
            r#"affinity={"podAntiAffinity":{"preferredDuringSchedulingIgnoredDuringExecution":[{"weight":100,"podAffinityTerm":{"topologyKey":"kubernetes.io/hostname","labelSelector":{"matchLabels":{"app.kubernetes.io/name":"prism-operator"}}}}]}}"#,
            SPREAD,
        ],
        renders: &[PDB],
        ..NONE
    },
    Combination {
        // Not the demo: it runs a standalone Redis, and the chart refuses it with
        // redis.mode=cluster (templates/demo.yaml).
        name: "everything at once",
        set: &[
            "replicas=3",
            "tls.secretName=prism-api-cert",
            "networkPolicy.enabled=true",
            "serviceMonitor.enabled=true",
            "prometheusRule.enabled=true",
            "grafanaDashboard.enabled=true",
            "config.watchNamespace=team-a",
            "redis.mode=cluster",
            "tracing.otlpEndpoint=https://otel.example.com:4318",
            "service.type=NodePort",
            "service.nodePort=30080",
        ],
        set_json: &[SPREAD],
        api_versions: POLICY_APIS,
        renders: &[
            PDB,
            "NetworkPolicy/prism-prism-operator",
            MONITOR,
            RULE,
            "ConfigMap/prism-prism-operator-dashboard",
            POLICIES[0],
            "Role/prism-prism-operator",
        ],
        ..NONE
    },
];

/// What is wrong with one combination, or nothing.
fn check(c: &Combination) -> Vec<String> {
    let mut problems = Vec::new();
    if let Err(e) = lint(c) {
        problems.push(format!("helm lint --strict: {e}"));
    }
    let manifest = match render(c) {
        Ok(m) => m,
        Err(e) => {
            problems.push(format!("helm template: {e}"));
            return problems;
        }
    };
    let docs = documents(&manifest);
    let k = kinds(&docs);
    for want in c.renders {
        if !k.iter().any(|x| x == want) {
            problems.push(format!("{want} not rendered (rendered: {k:?})"));
        }
    }
    for unwanted in c.absent {
        if k.iter().any(|x| x == unwanted) {
            problems.push(format!("{unwanted} rendered"));
        }
    }
    match validate(&manifest) {
        Ok(n) if n == docs.len() => {}
        Ok(n) => problems.push(format!("kubeconform checked {n} objects of {}", docs.len())),
        Err(e) => problems.push(format!("kubeconform: {e}")),
    }
    problems
}

#[test]
fn every_documented_values_combination_lints_and_validates_against_the_api_schemas() {
    // Two at a time: helm and kubeconform are processes, the machine has two cores.
    let started = Instant::now();
    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = COMBINATIONS
            .chunks(COMBINATIONS.len().div_ceil(2))
            .map(|chunk| {
                s.spawn(move || {
                    chunk
                        .iter()
                        .flat_map(|c| check(c).into_iter().map(move |p| format!("[{}] {p}", c.name)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("a checking thread")).collect()
    });
    assert!(failures.is_empty(), "{} problems:\n{}", failures.len(), failures.join("\n"));
    eprintln!("{} combinations linted, rendered and validated in {:?}", COMBINATIONS.len(), started.elapsed());
}

/// The check is not vacuous: the same function refuses what the API server would not
/// take as written, and an object it has no schema for.
#[test]
fn the_validation_refuses_misspelled_misplaced_and_unknown_fields_and_kinds() {
    let manifest = render(&COMBINATIONS[0]).expect("helm template");
    let deployment = documents(&manifest)
        .into_iter()
        .find(|d| d["kind"] == "Deployment")
        .map(|d| serde_yaml::to_string(&d).expect("YAML"))
        .expect("a Deployment");
    assert_eq!(validate(&deployment), Ok(1), "the Deployment as rendered is valid");

    // A misspelled field.
    let misspelled = deployment.replacen("imagePullPolicy:", "imagePullPolicyy:", 1);
    assert_ne!(misspelled, deployment);
    let err = validate(&misspelled).expect_err("a misspelled field is refused");
    assert!(err.contains("imagePullPolicyy"), "{err}");

    // topologySpreadConstraints one level too deep (in the container, not the pod spec).
    let line = deployment.lines().find(|l| l.trim_start().starts_with("imagePullPolicy:")).expect("imagePullPolicy");
    let indent = &line[..line.len() - line.trim_start().len()];
    let misplaced = deployment.replacen(line, &format!("{indent}topologySpreadConstraints: []\n{line}"), 1);
    let err = validate(&misplaced).expect_err("a pod field in the container is refused");
    assert!(err.contains("topologySpreadConstraints"), "{err}");

    // A value of the wrong type, and a missing required field.
    let err = validate(&deployment.replacen("replicas: 1", "replicas: one", 1)).expect_err("replicas: one");
    assert!(err.contains("replicas"), "{err}");
    let service = "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {ports: [{name: http}]}\n";
    let err = validate(service).expect_err("a port without its number");
    assert!(err.contains("port"), "{err}");

    // A misspelled field in a ServiceMonitor, whose schema comes from the Prometheus
    // Operator's CRD: custom kinds are checked as strictly as built-in ones.
    let monitor = "apiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\nmetadata: {name: m}\nspec:\n  selector: {}\n  endpoints: [{port: https, intervall: 30s}]\n";
    let err = validate(monitor).expect_err("a misspelled ServiceMonitor field");
    assert!(err.contains("intervall"), "{err}");
    assert_eq!(validate(&monitor.replace("intervall", "interval")), Ok(1));

    // A key twice in one mapping (a template setting a field in two places): the API
    // server's strict decoding refuses it, and so does kubeconform -strict.
    let twice = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: x}\ndata: {b: y}\n";
    let err = validate(twice).expect_err("a duplicate key");
    assert!(err.contains("already set"), "{err}");

    // A kind without a schema fails rather than passing unchecked.
    let unknown = "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\n";
    let err = validate(unknown).expect_err("a kind with no schema");
    assert!(err.contains("could not find schema"), "{err}");
}

/// topologySpreadConstraints reach the pod spec: a constraint without a labelSelector
/// gets the release's pods (else it would count none), one with a selector keeps it; by
/// default there are none; values.schema.json refuses a constraint missing its fields.
#[test]
fn topology_spread_constraints_are_rendered_into_the_pod_spec() {
    let pod_spec = |set_json: &'static [&'static str]| {
        let docs = documents(&render(&Combination { set_json, ..NONE }).expect("helm template"));
        let deployment = docs.into_iter().find(|d| d["kind"] == "Deployment").expect("a Deployment");
        (deployment["spec"]["template"]["spec"].clone(), deployment["spec"]["selector"]["matchLabels"].clone())
    };
    let (spec, _) = pod_spec(&[]);
    assert!(spec.get("topologySpreadConstraints").is_none(), "none by default: {spec:?}");

    let (spec, selector) = pod_spec(&[SPREAD]);
    let constraints = spec["topologySpreadConstraints"].as_sequence().expect("constraints in the pod spec");
    assert_eq!(constraints.len(), 2);
    assert_eq!(constraints[0]["topologyKey"], "topology.kubernetes.io/zone");
    assert_eq!(constraints[0]["whenUnsatisfiable"], "ScheduleAnyway");
    assert_eq!(constraints[0]["labelSelector"]["matchLabels"], selector, "the release's pods");
    assert_eq!(constraints[1]["labelSelector"]["matchLabels"]["app.kubernetes.io/name"], "prism-operator");
    assert!(
        constraints[1]["labelSelector"]["matchLabels"].get("app.kubernetes.io/instance").is_none(),
        "kept as given"
    );
    assert_eq!(constraints[1]["matchLabelKeys"][0], "pod-template-hash");

    let c = Combination { set_json: &[r#"topologySpreadConstraints=[{"maxSkew":1}]"#], ..NONE };
    let err = render(&c).expect_err("a constraint without topologyKey and whenUnsatisfiable");
    assert!(err.contains("topologyKey"), "{err}");
}

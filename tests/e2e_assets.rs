//! Assets the chart ships for a real cluster: the Grafana dashboard is valid JSON, every
//! query names only metrics the operator exports (read from the operator's own
//! /metrics exposition, not a copied list), the topics the dashboard promises are
//! there, and the chart renders it as a `grafana_dashboard` ConfigMap only when asked.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use prism_operator::election::Cause;
use prism_operator::metrics::Metrics;
use prism_operator::reconcilers::ReconcileMetrics as _;
use support::repo_root;

use prism_testkit as support;

fn dashboard() -> serde_json::Value {
    let path = repo_root().join("charts/prism-operator/dashboards/prism-operator.json");
    let text = std::fs::read_to_string(&path).expect("dashboard file");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: not valid JSON: {e}", path.display()))
}

/// Every sample name the exposition can carry: gauges as named, counters with `_total`,
/// histograms with `_bucket`, `_sum` and `_count` (OpenMetrics text, prometheus-client).
fn exported_metrics() -> BTreeSet<String> {
    // Families without a sample are not rendered: give each one a sample first.
    let metrics = Metrics::default();
    metrics.reconciled("controllerregistration", Duration::from_millis(3), true);
    metrics.set_up("postgres", true);
    metrics.set_election_events(Cause::Elected, 1);
    metrics.set_registrations(vec![("agents".into(), true, 1), ("agents".into(), false, 2)]);
    metrics.heartbeats.inc();
    metrics.heartbeat_flushes.inc();
    metrics.claim_seconds.observe(0.002);
    metrics.runs_online.set(1);
    metrics.jobs_queued.set(1);
    let text = metrics.render();
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else { continue };
        let mut parts = rest.split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else { continue };
        match kind {
            "counter" => {
                names.insert(format!("{name}_total"));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                names.insert(name.to_string());
            }
        }
    }
    // And every sample line's name, as rendered.
    for line in text.lines().filter(|l| l.starts_with("prism_")) {
        let end = line.find(['{', ' ']).unwrap_or(line.len());
        names.insert(line[..end].to_string());
    }
    assert!(names.len() >= 8, "the exposition lists the operator's metrics: {text}");
    names
}

/// `prism_…` identifiers in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let bytes = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(pos) = expr[i..].find("prism_") {
        let start = i + pos;
        let boundary = start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        if boundary {
            out.push(expr[start..end].to_string());
        }
        i = end;
    }
    out
}

fn panels(d: &serde_json::Value) -> Vec<&serde_json::Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        out.push(p);
        if let Some(inner) = p["panels"].as_array() {
            out.extend(inner);
        }
    }
    out
}

#[test]
fn dashboard_queries_name_exported_metrics() {
    let d = dashboard();
    let exported = exported_metrics();
    let mut exprs = Vec::new();
    for p in panels(&d) {
        let title = p["title"].as_str().unwrap_or("?");
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("panel {title:?} has targets"));
        assert!(!targets.is_empty(), "panel {title:?} has a query");
        for t in targets {
            let expr = t["expr"].as_str().unwrap_or_else(|| panic!("panel {title:?}: target has an expr"));
            exprs.push((title.to_string(), expr.to_string()));
        }
    }
    // Template variables query metrics too.
    for v in d["templating"]["list"].as_array().into_iter().flatten() {
        if let Some(q) = v["definition"].as_str() {
            exprs.push((format!("variable {}", v["name"]), q.to_string()));
        }
    }
    let mut used = BTreeSet::new();
    for (title, expr) in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{title}: {expr:?} names no prism_ metric");
        for n in names {
            assert!(exported.contains(&n), "{title}: {n} is not exported by the operator (exported: {exported:?})");
            used.insert(n);
        }
    }
    // What the dashboard is for (issue 11): masters/peers per namespace, election events by
    // cause, Runs online, queued jobs, claim latency, dependency up.
    for needed in [
        "prism_controller_registrations",
        "prism_election_events",
        "prism_runtime_runs_online",
        "prism_runtime_jobs_queued",
        "prism_runtime_claim_duration_seconds_bucket",
        "prism_dependency_up",
    ] {
        assert!(used.contains(needed), "the dashboard shows {needed}");
    }
    let all = exprs.iter().map(|(_, e)| e.as_str()).collect::<Vec<_>>().join("\n");
    assert!(all.contains("role=\"master\"") && all.contains("role=\"peer\""), "masters and peers per namespace");
    assert!(all.contains("by (cause)"), "election events by cause");
}

#[test]
fn dashboard_panels_are_well_formed() {
    let d = dashboard();
    assert_eq!(d["uid"], "prism-operator");
    let mut ids = BTreeSet::new();
    for p in panels(&d) {
        let id = p["id"].as_u64().expect("panel id");
        assert!(ids.insert(id), "panel id {id} is unique");
        for k in ["x", "y", "w", "h"] {
            assert!(p["gridPos"][k].is_u64(), "panel {id}: gridPos.{k}");
        }
        // Every query goes to the dashboard's data source variable, so the dashboard works
        // with whatever Prometheus the Grafana it is loaded into calls its data source.
        assert_eq!(p["datasource"]["uid"], "${datasource}", "panel {id} uses the datasource variable");
    }
}

fn helm() -> PathBuf {
    match std::env::var_os("KUBEBUILDER_ASSETS") {
        Some(dir) => PathBuf::from(dir).join("helm"),
        None => panic!(
            "KUBEBUILDER_ASSETS is not set: run tests through scripts/test, or export KUBEBUILDER_ASSETS=$(scripts/envtest-assets)"
        ),
    }
}

fn render(extra: &[&str]) -> String {
    let chart = repo_root().join("charts/prism-operator");
    let mut args = vec!["template", "prism", chart.to_str().unwrap(), "--namespace", "prism-system"];
    args.extend_from_slice(extra);
    let tmp = std::env::temp_dir();
    let out = Command::new(helm())
        .args(&args)
        .env("HELM_CACHE_HOME", tmp.join("prism-helm-cache"))
        .env("HELM_CONFIG_HOME", tmp.join("prism-helm-config"))
        .env("HELM_DATA_HOME", tmp.join("prism-helm-data"))
        .output()
        .expect("helm runs (scripts/envtest-assets builds it)");
    assert!(out.status.success(), "helm template {extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8")
}

#[test]
fn chart_ships_the_dashboard_only_when_enabled() {
    assert!(!render(&[]).contains("grafana_dashboard"), "off by default");
    let out = render(&["--set", "grafanaDashboard.enabled=true"]);
    let cm = serde_yaml::Deserializer::from_str(&out)
        .map(|d| <serde_yaml::Value as serde::Deserialize>::deserialize(d).expect("YAML"))
        .find(|v| v["kind"] == "ConfigMap" && v["metadata"]["labels"]["grafana_dashboard"].is_string())
        .expect("a ConfigMap labelled grafana_dashboard");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(cm["metadata"]["namespace"], "prism-system");
    let json = cm["data"]["prism-operator.json"].as_str().expect("the dashboard in the ConfigMap");
    let shipped: serde_json::Value = serde_json::from_str(json).expect("valid JSON in the ConfigMap");
    assert_eq!(shipped, dashboard(), "the ConfigMap carries the dashboard file unchanged");
}

/// The image's dependency layer is built against stand-ins of every workspace crate: a
/// crate the Dockerfile does not know fails `docker build` (cargo cannot load the
/// workspace), which only the kind run would show, an hour later.
#[test]
fn the_dockerfile_knows_every_workspace_crate() {
    let manifest: toml_edit::DocumentMut =
        std::fs::read_to_string(repo_root().join("Cargo.toml")).expect("Cargo.toml").parse().expect("TOML");
    let members: Vec<String> = manifest["workspace"]["members"]
        .as_array()
        .expect("workspace members")
        .iter()
        .filter_map(|m| m.as_str())
        .filter(|m| *m != ".")
        .map(str::to_string)
        .collect();
    assert!(members.len() >= 4, "the workspace was read: {members:?}");
    let dockerfile = std::fs::read_to_string(repo_root().join("Dockerfile")).expect("Dockerfile");
    for member in &members {
        let crate_name = member.rsplit('/').next().unwrap_or(member);
        assert!(
            dockerfile.contains(&format!("COPY {member}/Cargo.toml")) && dockerfile.contains(crate_name),
            "the Dockerfile's dependency layer does not copy {member}/Cargo.toml nor make its stand-in"
        );
    }
}

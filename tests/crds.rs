//! CRD behaviour through a real kube-apiserver: what `kubectl apply` users hit.

use prism_testkit as support;

use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Resource};
use prism_operator::crd::{ControllerRegistration, RunSession};
use serde_json::json;
use support::control_plane;

#[test]
fn crds_dir_matches_crdgen() {
    for (file, yaml) in prism_operator::crd::crd_files().expect("crds render") {
        let path = support::repo_root().join("crds").join(&file);
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            on_disk == yaml,
            "crds/{file} differs from the Rust types: run `cargo run -- crdgen --out-dir crds` and commit"
        );
    }
    let files: Vec<_> = std::fs::read_dir(support::repo_root().join("crds"))
        .expect("crds/ exists")
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    assert_eq!(files.len(), 2, "crds/ holds exactly the two generated CRDs, found {files:?}");
}

/// A registration as untyped JSON: any surface string, valid or not, reaches the API server.
fn creg_json(name: &str, project: &str, session: &str, surface: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "prism.ntecdev.ai/v1alpha1",
        "kind": "ControllerRegistration",
        "metadata": {"name": name},
        "spec": {"projectId": project, "sessionId": session, "agentSurface": surface}
    }))
    .expect("object")
}

fn rsess(name: &str, server: &str, component: &str, key: &str, generation: i64) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "prism.ntecdev.ai/v1alpha1",
        "kind": "RunSession",
        "metadata": {"name": name},
        "spec": {"serverInstanceId": server, "componentKind": component,
                 "credential": {"publicKey": key, "generation": generation}}
    }))
    .expect("object")
}

const KEY_A: &str = "11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=";
const KEY_B: &str = "Pz8/Pz8/Pz8/Pz8/Pz8/Pz8/Pz8/Pz8/Pz8/Pz8/Pz8=";

fn api_error(e: kube::Error) -> (u16, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.message),
        other => panic!("expected an API error, got {other}"),
    }
}

#[tokio::test]
async fn valid_registration_is_accepted_and_bad_surface_rejected() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "creg").await;
    let ar = ApiResource::erase::<ControllerRegistration>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);

    let created = api
        .create(&PostParams::default(), &creg_json("desk", "PID-PGR01", "s-1", "claude_desktop"))
        .await
        .expect("valid registration accepted");
    assert_eq!(created.data["spec"]["agentSurface"], "claude_desktop");

    for surface in ["emacs", "Claude_Desktop", ""] {
        let err = api
            .create(&PostParams::default(), &creg_json("bad", "PID-PGR01", "s-2", surface))
            .await
            .expect_err("bad surface rejected");
        let (code, message) = api_error(err);
        assert_eq!(code, 422, "{message}");
        assert!(message.contains("spec.agentSurface"), "message names the field: {message}");
    }
    // Project ids are 1..128 characters.
    let long = "P".repeat(129);
    for project in ["", long.as_str()] {
        let (code, message) = api_error(
            api.create(&PostParams::default(), &creg_json("bad", project, "s-3", "codex"))
                .await
                .expect_err("bad project rejected"),
        );
        assert_eq!(code, 422, "{message}");
        assert!(message.contains("spec.projectId"), "{message}");
    }
    // Nothing but the valid one was stored.
    assert_eq!(api.list(&Default::default()).await.expect("list").items.len(), 1);
}

#[tokio::test]
async fn registration_spec_is_immutable() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "immut").await;
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    let ar = ApiResource::erase::<ControllerRegistration>(&());
    let dynamic: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
    dynamic.create(&PostParams::default(), &creg_json("code", "PID-A", "s-1", "claude_code")).await.expect("created");

    for (field, value) in [("projectId", "PID-B"), ("sessionId", "s-9"), ("agentSurface", "claude_desktop")] {
        let patch = json!({"spec": {field: value}});
        let err =
            api.patch("code", &PatchParams::default(), &Patch::Merge(&patch)).await.expect_err("spec change rejected");
        let (code, message) = api_error(err);
        assert_eq!(code, 422, "{message}");
        assert!(message.contains("spec is immutable"), "{message}");
    }
    let current = api.get("code").await.expect("get");
    assert_eq!(current.spec.project_id, "PID-A");
    // Labels and annotations stay editable.
    let patch = json!({"metadata": {"labels": {"team": "blue"}}});
    api.patch("code", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("metadata change allowed");
}

#[tokio::test]
async fn kubectl_get_prints_the_columns() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "cols").await;
    let ar = ApiResource::erase::<ControllerRegistration>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
    api.create(&PostParams::default(), &creg_json("desk-pgr01", "PID-PGR01", "7f6c", "claude_desktop"))
        .await
        .expect("created");
    api.create(&PostParams::default(), &creg_json("code-other", "PID-OTHER", "8a1d", "codex")).await.expect("created");
    let rs_ar = ApiResource::erase::<RunSession>(&());
    let rs: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &rs_ar);
    rs.create(&PostParams::default(), &rsess("srv-eu1-7-run", "srv-eu1-7", "run", KEY_A, 3)).await.expect("created");

    let out = cp.kubectl_ok(&["get", "creg", "-n", &ns]).await;
    let header: Vec<&str> = out.lines().next().unwrap_or_default().split_whitespace().collect();
    assert_eq!(header, ["NAME", "PROJECT", "SURFACE", "ROLE", "TERM", "HEARTBEAT", "STALE", "AGE"], "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("desk-pgr01") && l.contains("PID-PGR01") && l.contains("claude_desktop")),
        "{out}"
    );

    // spec.projectId is a selectable field.
    let out = cp
        .kubectl_ok(&[
            "get",
            "controllerregistrations",
            "-n",
            &ns,
            "--field-selector",
            "spec.projectId=PID-PGR01",
            "-o",
            "name",
        ])
        .await;
    assert_eq!(out.trim(), "controllerregistration.prism.ntecdev.ai/desk-pgr01");

    let out = cp.kubectl_ok(&["get", "rsess", "-n", &ns]).await;
    let header: Vec<&str> = out.lines().next().unwrap_or_default().split_whitespace().collect();
    assert_eq!(header, ["NAME", "SERVER", "COMPONENT", "PHASE", "VERSION", "HEARTBEAT", "AGE"], "{out}");

    // Both kinds are in the `prism` category.
    let out = cp.kubectl_ok(&["get", "prism", "-n", &ns, "-o", "name"]).await;
    let mut names: Vec<&str> = out.lines().collect();
    names.sort();
    assert_eq!(
        names,
        [
            "controllerregistration.prism.ntecdev.ai/code-other",
            "controllerregistration.prism.ntecdev.ai/desk-pgr01",
            "runsession.prism.ntecdev.ai/srv-eu1-7-run",
        ]
    );
}

#[tokio::test]
async fn kubectl_apply_of_a_bad_surface_fails_with_the_allowed_values() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "apply").await;
    let manifest = format!(
        "apiVersion: prism.ntecdev.ai/v1alpha1\nkind: ControllerRegistration\nmetadata: {{name: x, namespace: {ns}}}\nspec: {{projectId: P, sessionId: s, agentSurface: emacs}}\n"
    );
    let out = cp.kubectl(&["apply", "-f", "-"], Some(&manifest)).await;
    assert!(!out.ok);
    assert!(out.stderr.contains("Unsupported value: \"emacs\""), "{}", out.stderr);
    assert!(out.stderr.contains("\"claude_desktop\""), "lists the allowed values: {}", out.stderr);
}

#[tokio::test]
async fn run_session_schema_guards_identity_and_credential() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "rsess").await;
    let ar = ApiResource::erase::<RunSession>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
    api.create(&PostParams::default(), &rsess("run-a", "srv-eu1-7", "run", KEY_A, 3))
        .await
        .expect("valid RunSession accepted");

    // componentKind is a lowercase DNS label; the key is base64 of 32 bytes; generation >= 1.
    for (bad, field) in [
        (rsess("b1", "srv", "Run_Kind", KEY_A, 1), "spec.componentKind"),
        (rsess("b2", "srv", "run", "not-a-key", 1), "spec.credential.publicKey"),
        (rsess("b3", "srv", "run", KEY_A, 0), "spec.credential.generation"),
    ] {
        let (code, message) = api_error(api.create(&PostParams::default(), &bad).await.expect_err("rejected"));
        assert_eq!(code, 422, "{message}");
        assert!(message.contains(field), "names {field}: {message}");
    }

    let typed: Api<RunSession> = Api::namespaced(client.clone(), &ns);
    let patch = |v| Patch::Merge(v);
    // Identity is immutable.
    let v = json!({"spec": {"serverInstanceId": "srv-other"}});
    let (code, message) =
        api_error(typed.patch("run-a", &PatchParams::default(), &patch(&v)).await.expect_err("rejected"));
    assert_eq!(code, 422);
    assert!(message.contains("serverInstanceId is immutable"), "{message}");
    // A new key needs a higher generation; generations never go down.
    let v = json!({"spec": {"credential": {"publicKey": KEY_B, "generation": 3}}});
    let (_, message) =
        api_error(typed.patch("run-a", &PatchParams::default(), &patch(&v)).await.expect_err("rejected"));
    assert!(message.contains("a new publicKey needs a higher credential.generation"), "{message}");
    let v = json!({"spec": {"credential": {"publicKey": KEY_A, "generation": 2}}});
    let (_, message) =
        api_error(typed.patch("run-a", &PatchParams::default(), &patch(&v)).await.expect_err("rejected"));
    assert!(message.contains("may not decrease"), "{message}");
    // Rotation: new key, higher generation.
    let v = json!({"spec": {"credential": {"publicKey": KEY_B, "generation": 4}}});
    let rotated = typed.patch("run-a", &PatchParams::default(), &patch(&v)).await.expect("rotation accepted");
    assert_eq!(rotated.spec.credential.generation, 4);
    assert_eq!(rotated.meta().generation, Some(2));
}

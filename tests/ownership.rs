//! Session ownership over the HTTP API (SPEC §6): a session registered through the API
//! belongs to the Kubernetes identity that registered it; another identity's register,
//! heartbeat and release are refused with 403 `session_not_owned` and change nothing; a
//! registration created with kubectl has no owner. Authorization comes before any
//! existence check. (The MCP side is in tests/mcp.rs.)

use prism_testkit as support;

use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use prism_operator::crd::{AgentSurface, ControllerRegistration, ControllerRegistrationSpec, Role};
use serde_json::{Value, json};
use support::{Operator, TestDb, control_plane, eventually};

#[tokio::test]
async fn sessions_belong_to_the_identity_that_registered_them() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "owner").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let all = ["create", "delete", "get", "list"];
    let alice = support::agent_token(cp, &ns, "alice", &all).await;
    let bob = support::agent_token(cp, &ns, "bob", &all).await;
    let carol = support::agent_token(cp, &ns, "carol", &["get", "list"]).await;
    let http = support::http();
    let post = |token: &str, path: &str, body: Value| http.post(op.url(path)).bearer_auth(token).json(&body).send();
    let register = |token: &str, project: &str, session: &str| {
        post(
            token,
            "/api/v1/controller/register",
            json!({"namespace": ns, "project_id": project, "session_id": session, "agent_surface": "claude_code"}),
        )
    };
    let code = |r: reqwest::Response| async move {
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.expect("json")["error"]["code"].as_str().unwrap_or_default().to_string())
    };

    let r = register(&alice, "P", "s-alice").await.expect("register");
    assert_eq!(r.status(), 200);
    let id = r.json::<Value>().await.expect("json")["registration"]["id"].as_str().expect("id").to_string();
    let owner: Option<String> = sqlx::query_scalar("SELECT owner FROM controller_registrations WHERE id = $1::uuid")
        .bind(&id)
        .fetch_one(&db.pool)
        .await
        .expect("owner");
    assert_eq!(owner.as_deref(), Some(format!("system:serviceaccount:{ns}:alice").as_str()));
    // Alice's own calls work: registering again is idempotent, her heartbeat answers.
    assert_eq!(register(&alice, "P", "s-alice").await.expect("again").status(), 200);
    let hb = post(&alice, "/api/v1/controller/heartbeat", json!({"namespace": ns, "session_id": "s-alice"}));
    assert_eq!(hb.await.expect("heartbeat").status(), 200);

    tokio::time::sleep(Duration::from_millis(400)).await;
    let row = |db: &TestDb| {
        let q = sqlx::query_as::<_, (i64, Option<chrono::DateTime<chrono::Utc>>, chrono::DateTime<chrono::Utc>)>(
            "SELECT (SELECT count(*) FROM controller_registrations WHERE namespace = $1), released_at, last_heartbeat
             FROM controller_registrations WHERE id = $2::uuid",
        )
        .bind(ns.clone())
        .bind(id.clone());
        let pool = db.pool.clone();
        async move { q.fetch_one(&pool).await.expect("row") }
    };
    let before = row(&db).await;
    // Bob, with every right in the namespace, may not touch Alice's session.
    for (what, response) in [
        ("register same project", register(&bob, "P", "s-alice").await),
        ("register elsewhere (context switch)", register(&bob, "Q", "s-alice").await),
        (
            "heartbeat",
            post(&bob, "/api/v1/controller/heartbeat", json!({"namespace": ns, "session_id": "s-alice"})).await,
        ),
        ("release", post(&bob, &format!("/api/v1/controller/{id}/release?namespace={ns}"), json!({})).await),
        ("release without namespace", post(&bob, &format!("/api/v1/controller/{id}/release"), json!({})).await),
    ] {
        assert_eq!(code(response.expect(what)).await, (403, "session_not_owned".to_string()), "{what}");
    }
    // Reading the routing table is nobody's privilege; it does not refresh her session.
    let table =
        support::get_json(&op.url(&format!("/api/v1/controller/P/status?namespace={ns}&session_id=s-alice")), &bob)
            .await;
    assert_eq!(table["caller"]["session_id"], "s-alice");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(row(&db).await, before, "nothing changed");
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    assert_eq!(api.list(&Default::default()).await.expect("list").items.len(), 1, "no resource was created");

    // Authorization before existence: without rights, an unknown id and a known one get
    // the same 403, with or without the namespace.
    let unknown = uuid::Uuid::new_v4();
    for path in [
        format!("/api/v1/controller/{unknown}/release"),
        format!("/api/v1/controller/{id}/release"),
        format!("/api/v1/controller/{unknown}/release?namespace={ns}"),
        format!("/api/v1/controller/{id}/release?namespace={ns}"),
    ] {
        let r = post(&carol, &path, json!({})).await.expect("release");
        let (status, c) = code(r).await;
        assert_eq!((status, c.as_str()), (403, "forbidden"), "{path}");
    }
    // With rights: unknown in the namespace named is 404; without a namespace it stays 403.
    let r = post(&alice, &format!("/api/v1/controller/{unknown}/release?namespace={ns}"), json!({})).await;
    assert_eq!(code(r.expect("release")).await, (404, "not_found".to_string()));
    let r = post(&alice, &format!("/api/v1/controller/{unknown}/release"), json!({})).await;
    assert_eq!(code(r.expect("release")).await.0, 403);
    // An id of another namespace is not found in this one.
    let r = post(&alice, &format!("/api/v1/controller/{id}/release?namespace=default"), json!({})).await;
    assert_eq!(code(r.expect("release")).await.0, 403, "alice has no rights in default");
    // The owner wraps.
    let r = post(&alice, &format!("/api/v1/controller/{id}/release?namespace={ns}"), json!({})).await.expect("release");
    assert_eq!(r.status(), 200);

    // A registration created with kubectl: without the chart's admission policy it has
    // no known owner and any authorized caller acts on it; with it, it is its creator's
    // (here the admin's), and nobody else's.
    let spec = ControllerRegistrationSpec {
        project_id: "K".into(),
        session_id: "s-kubectl".into(),
        agent_surface: AgentSurface::Codex,
    };
    api.create(&PostParams::default(), &ControllerRegistration::new("by-kubectl", spec)).await.expect("create");
    let kid: String = eventually(10, "the kubectl registration is elected", || async {
        let obj = api.get_opt("by-kubectl").await.ok().flatten()?;
        (obj.status.as_ref()?.role == Role::Master).then(|| obj.metadata.uid.clone()).flatten()
    })
    .await;
    let hb = post(&bob, "/api/v1/controller/heartbeat", json!({"namespace": ns, "session_id": "s-kubectl"}));
    let release = post(&bob, &format!("/api/v1/controller/{kid}/release?namespace={ns}"), json!({}));
    if support::chart_mode() {
        assert_eq!(code(hb.await.expect("heartbeat")).await, (403, "session_not_owned".to_string()));
        assert_eq!(code(release.await.expect("release")).await, (403, "session_not_owned".to_string()));
    } else {
        assert_eq!(hb.await.expect("heartbeat").status(), 200);
        assert_eq!(release.await.expect("release").status(), 200);
    }
}

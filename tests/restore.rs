//! A restore never reissues a term (SPEC §15), as the issue tried it from outside:
//! `pg_dump` while a project is at term 1, two changes of master take it to term 3, the
//! operator is killed, the dump is restored (`pg_restore` into a new database), an
//! operator starts on it: it finds the database behind its mark, raises the project
//! above every term issued, says so in a warning and an Event, and the next master's
//! term is one no one held. No term is ever held by two sessions.

use prism_testkit as support;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use serde_json::{Value, json};
use support::{Operator, TestDb, control_plane};

async fn call(http: &reqwest::Client, op: &Operator, token: &str, path: &str, body: Option<Value>) -> Value {
    let mut request = http.post(op.url(path)).bearer_auth(token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let r = request.send().await.expect("request");
    let status = r.status();
    let text = r.text().await.expect("body");
    assert!(status.is_success(), "{path}: {status} {text}");
    serde_json::from_str(&text).expect("json")
}

fn run(cmd: &str, args: &[&str]) {
    let out = std::process::Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test]
async fn a_restored_database_never_reissues_a_term() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "restore").await;
    let db = TestDb::new().await;
    let mark_name = support::term_mark_of(&db.url);
    let mark = [("PRISM_TERM_MARK", mark_name.as_str())];
    let mut op = Operator::start(cp, &db.url, &ns, &mark).await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "get", "list", "delete"]).await;
    let http = reqwest::Client::new();
    // term -> the sessions that held it, from every answer.
    let mut held: BTreeMap<i64, std::collections::BTreeSet<String>> = BTreeMap::new();
    let mut note = |term: i64, session: &str| {
        held.entry(term).or_default().insert(session.to_string());
    };
    let register = |session: &'static str, surface: &'static str| json!({"namespace": ns, "project_id": "PID-RESTORE", "session_id": session, "agent_surface": surface});

    let a = call(&http, &op, &token, "/api/v1/controller/register", Some(register("s1", "codex"))).await;
    assert_eq!((a["is_master"].as_bool(), a["term"].as_i64()), (Some(true), Some(1)));
    note(1, "s1");
    let dump = std::env::temp_dir().join(format!("prism-restore-{}.dump", uuid::Uuid::new_v4().simple()));
    run("pg_dump", &["-Fc", "-f", dump.to_str().expect("utf-8"), &db.url]);

    // Two changes of master: a desktop preempts (term 2), then wraps and s1 is master again (term 3).
    let d = call(&http, &op, &token, "/api/v1/controller/register", Some(register("d1", "claude_desktop"))).await;
    assert_eq!((d["is_master"].as_bool(), d["term"].as_i64()), (Some(true), Some(2)));
    note(2, "d1");
    let id = d["registration"]["id"].as_str().expect("id").to_string();
    let r = call(&http, &op, &token, &format!("/api/v1/controller/{id}/release?namespace={ns}"), None).await;
    assert_eq!(r["term"].as_i64(), Some(3), "s1 promoted: {r}");
    note(3, "s1");
    // The mark has seen all three changes (it is written within a second of each).
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), support::OPERATOR_NAMESPACE);
    support::eventually(30, "the term mark at term 3", || {
        let configmaps = configmaps.clone();
        let name = mark_name.clone();
        async move {
            let cm = configmaps.get_opt(&name).await.expect("get")?;
            (cm.data?.get("highestTerm")?.as_str() == "3").then_some(())
        }
    })
    .await;
    op.kill().await;

    // The dump restored into a database of its own, and an operator on it.
    let restored = TestDb::empty().await;
    run("pg_restore", &["--no-owner", "-d", &restored.url, dump.to_str().expect("utf-8")]);
    let _ = std::fs::remove_file(&dump);
    let op = Operator::start(cp, &restored.url, &ns, &mark).await;
    let logs = op.logs();
    assert!(logs.contains("the database forgot terms it issued"), "a warning says so:\n{logs}");
    let events: Api<Event> = Api::namespaced(client.clone(), support::OPERATOR_NAMESPACE);
    let said = events.list(&Default::default()).await.expect("events").items.into_iter().any(|e| {
        e.reason.as_deref() == Some("Restored")
            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(mark_name.as_str())
    });
    assert!(said, "an Event on the term mark says the restore was found");

    // The restored master (s1, at term 1 in the dump) holds a term above everything issued.
    let mut status_url = op.url("/api/v1/controller/PID-RESTORE/status");
    status_url.push_str(&format!("?namespace={ns}"));
    let status: Value =
        http.get(&status_url).bearer_auth(&token).send().await.expect("status").json().await.expect("json");
    let raised = status["term"].as_i64().expect("term");
    assert!(raised > 3, "the restored master's term is above every term issued: {status}");
    assert_eq!(status["master"]["session_id"], "s1");
    note(raised, "s1");
    // A term change after it: the next term too is one nobody held.
    let d = call(&http, &op, &token, "/api/v1/controller/register", Some(register("d2", "claude_desktop"))).await;
    let next = d["term"].as_i64().expect("term");
    assert!(d["is_master"].as_bool() == Some(true) && next > raised, "{d}");
    note(next, "d2");
    for (term, sessions) in &held {
        assert_eq!(sessions.len(), 1, "term {term} held by {sessions:?}");
    }
    let (before, after): (i64, i64) = sqlx::query_as(
        "SELECT term_before, term_after FROM controller_term_restores WHERE namespace = $1 AND project_id = 'PID-RESTORE'",
    )
    .bind(&ns)
    .fetch_one(&restored.pool)
    .await
    .expect("the raise is recorded");
    assert_eq!((before, after), (1, raised));
}

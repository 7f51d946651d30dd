//! The election's invariants as the database enforces them (real Postgres): these hold
//! even if the operator's code is wrong or two replicas race.

use prism_testkit as support;

use sqlx::PgPool;
use support::TestDb;
use uuid::Uuid;

async fn project(pool: &PgPool, ns: &str, project: &str) {
    sqlx::query("INSERT INTO controller_projects (namespace, project_id) VALUES ($1, $2) ON CONFLICT DO NOTHING")
        .bind(ns)
        .bind(project)
        .execute(pool)
        .await
        .expect("project row");
}

async fn register(
    pool: &PgPool,
    ns: &str,
    project: &str,
    session: &str,
    surface: &str,
    master: bool,
) -> Result<Uuid, sqlx::Error> {
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO controller_registrations (id, namespace, name, project_id, session_id, agent_surface, is_master, master_term)
         VALUES ($1, $2, $3, $4, $5, $6, $7, CASE WHEN $7 THEN 1 END)",
    )
    .bind(id)
    .bind(ns)
    .bind(format!("reg-{session}"))
    .bind(project)
    .bind(session)
    .bind(surface)
    .bind(master)
    .execute(pool)
    .await?;
    Ok(id)
}

fn violated_constraint(e: sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => db.constraint().unwrap_or_default().to_string(),
        other => panic!("expected a database error, got {other}"),
    }
}

#[tokio::test]
async fn check_constraint_rejects_an_unknown_surface() {
    let db = TestDb::new().await;
    project(&db.pool, "ns", "P").await;
    for surface in ["claude_desktop", "claude_code", "codex", "cursor", "other"] {
        register(&db.pool, "ns", "P", &format!("s-{surface}"), surface, false).await.expect("known surface accepted");
    }
    let e = register(&db.pool, "ns", "P", "s-x", "emacs", false).await.expect_err("emacs rejected");
    assert_eq!(violated_constraint(e), "controller_registrations_agent_surface_check");
}

#[tokio::test]
async fn two_live_masters_on_one_project_are_impossible() {
    let db = TestDb::new().await;
    project(&db.pool, "ns", "P").await;
    project(&db.pool, "other-ns", "P").await;
    let first = register(&db.pool, "ns", "P", "s-1", "codex", true).await.expect("first master");
    let e = register(&db.pool, "ns", "P", "s-2", "claude_desktop", true).await.expect_err("second master rejected");
    assert_eq!(violated_constraint(e), "controller_registrations_one_master");

    // Promoting a peer while a master lives fails too.
    let peer = register(&db.pool, "ns", "P", "s-3", "cursor", false).await.expect("peer");
    let e = sqlx::query("UPDATE controller_registrations SET is_master = TRUE, master_term = 2 WHERE id = $1")
        .bind(peer)
        .execute(&db.pool)
        .await
        .expect_err("promotion beside a live master rejected");
    assert_eq!(violated_constraint(e), "controller_registrations_one_master");

    // The same project id in another namespace is another project.
    register(&db.pool, "other-ns", "P", "s-4", "codex", true).await.expect("master in another namespace");

    // Once the master is released, a successor can be master; a released row is never master.
    let e = sqlx::query(
        "UPDATE controller_registrations SET released_at = now(), release_reason = 'wrapped' WHERE id = $1",
    )
    .bind(first)
    .execute(&db.pool)
    .await
    .expect_err("a released row cannot stay master");
    assert_eq!(violated_constraint(e), "released_is_not_master");
    sqlx::query("UPDATE controller_registrations SET is_master = FALSE, released_at = now(), release_reason = 'wrapped' WHERE id = $1")
        .bind(first)
        .execute(&db.pool)
        .await
        .expect("release");
    sqlx::query("UPDATE controller_registrations SET is_master = TRUE, master_term = 2 WHERE id = $1")
        .bind(peer)
        .execute(&db.pool)
        .await
        .expect("promotion after release");
    let masters: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM controller_registrations WHERE namespace = 'ns' AND project_id = 'P' AND is_master AND released_at IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .expect("count");
    assert_eq!(masters, 1);
}

#[tokio::test]
async fn two_live_registrations_of_one_session_are_impossible() {
    let db = TestDb::new().await;
    project(&db.pool, "ns", "A").await;
    project(&db.pool, "ns", "B").await;
    let a = register(&db.pool, "ns", "A", "s-1", "claude_code", false).await.expect("live on A");
    let e = register(&db.pool, "ns", "B", "s-1", "claude_code", false)
        .await
        .expect_err("second live registration rejected");
    assert_eq!(violated_constraint(e), "controller_registrations_one_live_per_session");
    // After leaving A (context switch), the session may register on B.
    sqlx::query(
        "UPDATE controller_registrations SET released_at = now(), release_reason = 'context_switch' WHERE id = $1",
    )
    .bind(a)
    .execute(&db.pool)
    .await
    .expect("release A");
    register(&db.pool, "ns", "B", "s-1", "claude_code", false).await.expect("live on B after leaving A");
}

#[tokio::test]
async fn release_reasons_and_job_states_are_checked() {
    let db = TestDb::new().await;
    project(&db.pool, "ns", "P").await;
    let id = register(&db.pool, "ns", "P", "s-1", "other", false).await.expect("registered");
    let e =
        sqlx::query("UPDATE controller_registrations SET released_at = now(), release_reason = 'bored' WHERE id = $1")
            .bind(id)
            .execute(&db.pool)
            .await
            .expect_err("unknown reason rejected");
    assert_eq!(violated_constraint(e), "controller_registrations_release_reason_check");

    let e = sqlx::query(
        "INSERT INTO runtime_jobs (namespace, server_instance_id, component_kind, kind) VALUES ('ns', 'srv', 'run', 'reboot')",
    )
    .execute(&db.pool)
    .await
    .expect_err("unknown job kind rejected");
    assert_eq!(violated_constraint(e), "runtime_jobs_kind_check");
    let state: String = sqlx::query_scalar("INSERT INTO runtime_jobs (namespace, server_instance_id, component_kind, kind) VALUES ('ns', 'srv', 'run', 'config') RETURNING state")
        .fetch_one(&db.pool)
        .await
        .expect("job");
    assert_eq!(state, "queued");
}

#[tokio::test]
async fn election_history_is_append_only() {
    let db = TestDb::new().await;
    sqlx::query(
        "INSERT INTO controller_election_events (namespace, project_id, term, cause) VALUES ('ns', 'P', 1, 'elected')",
    )
    .execute(&db.pool)
    .await
    .expect("append");
    let e = sqlx::query("DELETE FROM controller_election_events").execute(&db.pool).await.expect_err("delete refused");
    assert!(e.to_string().contains("append-only"), "{e}");
}

#[tokio::test]
async fn migrating_twice_is_a_no_op() {
    let db = TestDb::new().await;
    let before: i64 =
        sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations").fetch_one(&db.pool).await.expect("count");
    prism_operator::db::migrate(&db.pool).await.expect("second run succeeds");
    let after: i64 =
        sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations").fetch_one(&db.pool).await.expect("count");
    assert_eq!(before, after);
    assert_eq!(after as usize, prism_operator::db::MIGRATOR.iter().count());
}

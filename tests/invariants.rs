//! The independent invariant checker (tests/faults/check_invariants.py: psql and SPEC §10,
//! no project code) against a history the real operator wrote through its HTTP API, and
//! against the same history with one forged row: it passes the first and names the
//! project, the rule and the row for the second. The fault harness of issue #12 runs it
//! after its faults.

use prism_testkit as support;

use support::{Operator, TestDb, control_plane};

/// Runs the checker; returns (exit success, stdout).
async fn check(db_url: &str, args: &[&str]) -> (bool, String) {
    support::faults::check_invariants(db_url, args).await
}

#[tokio::test]
async fn the_checker_passes_a_real_history_and_names_a_forged_row() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "invariants").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;
    let register = |project: &str, session: &str, surface: &str| {
        let (project, session, surface) = (project.to_string(), session.to_string(), surface.to_string());
        let (op, token, ns) = (&op, &token, &ns);
        async move { support::register(op, token, ns, &project, &session, &surface).await }
    };
    // Per project: a master, a peer, a desktop preempting, a second desktop (a peer), the
    // master desktop moving to another project (context switch: the second desktop is
    // promoted, and masters the other project): 4 changes of master per round.
    for p in 0..3 {
        let project = format!("PID-INV-{p}");
        register(&project, &format!("code-{p}"), "claude_code").await;
        register(&project, &format!("codex-{p}"), "codex").await;
        register(&project, &format!("desk-{p}"), "claude_desktop").await;
        register(&project, &format!("desk2-{p}"), "claude_desktop").await;
        register(&format!("PID-INV-ELSEWHERE-{p}"), &format!("desk-{p}"), "claude_desktop").await;
    }

    let (ok, out) = check(&db.url, &["--namespace-prefix", &ns]).await;
    assert!(ok, "a history the operator wrote holds the invariants:\n{out}");
    assert!(out.contains("projects 6, changes of master 12"), "{out}");

    // A row that re-elects the current master in the same term: the term did not rise.
    let (term, master): (i64, uuid::Uuid) = sqlx::query_as(
        "SELECT term, master_id FROM controller_projects WHERE namespace = $1 AND project_id = 'PID-INV-1'",
    )
    .bind(&ns)
    .fetch_one(&db.pool)
    .await
    .expect("project");
    sqlx::query(
        "INSERT INTO controller_election_events (namespace, project_id, term, master_id, previous_master_id, cause)
         VALUES ($1, 'PID-INV-1', $2, $3, $3, 'elected')",
    )
    .bind(&ns)
    .bind(term)
    .bind(master)
    .execute(&db.pool)
    .await
    .expect("forge a row");
    let (ok, out) = check(&db.url, &["--namespace-prefix", &ns]).await;
    assert!(!ok, "the forged row is found:\n{out}");
    let line = out.lines().find(|l| l.starts_with("VIOLATION")).unwrap_or_default();
    assert!(
        line.contains(&format!("{ns}/PID-INV-1: term {term} where {} was due", term + 1)),
        "the violation names the project, the rule and the row: {out}"
    );

    // Completions the load acknowledged: a job told "completed" twice is a violation.
    let file = std::env::temp_dir().join(format!("prism-completions-{}", uuid::Uuid::new_v4().simple()));
    std::fs::write(&file, "job-a\njob-b\njob-a\n").expect("write");
    let (ok, out) =
        check(&db.url, &["--namespace-prefix", "no-such-namespace-", "--completions", file.to_str().expect("utf-8")])
            .await;
    let _ = std::fs::remove_file(&file);
    assert!(!ok && out.contains("job job-a: acknowledged as completed 2 times"), "{out}");
}

/// SPEC §15: a restore's raise (controller_term_restores) is a jump the term rule allows,
/// and the history after it still passes; a term given to a second master does not.
#[tokio::test]
async fn the_checker_follows_a_restore_raise_and_names_a_term_held_twice() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "invariants-restore").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let token = support::agent_token(cp, &ns, "agent", &["create", "delete", "get", "list"]).await;
    support::register(&op, &token, &ns, "PID-R", "code-r", "claude_code").await;
    let before: i64 =
        sqlx::query_scalar("SELECT term FROM controller_projects WHERE namespace = $1 AND project_id = 'PID-R'")
            .bind(&ns)
            .fetch_one(&db.pool)
            .await
            .expect("term");
    // The restore guard's raise, as the operator makes it at start after a restore.
    let raised = prism_store::election::restore::RestoreGuard::new(db.pool.clone())
        .raise_after_restore(before + 1000)
        .await
        .expect("raise");
    assert!(raised.projects >= 1, "{raised:?}");
    // A desktop preempts after the raise: a term above the raised one.
    let answer = support::register(&op, &token, &ns, "PID-R", "desk-r", "claude_desktop").await;
    assert!(answer["term"].as_i64().is_some_and(|t| t > before + 1000), "{answer}");
    let (ok, out) = check(&db.url, &["--namespace-prefix", &ns]).await;
    assert!(ok, "a raise after a restore is allowed, and what follows it holds:\n{out}");

    // The term of the first master given to another: named as a term held by two.
    let first: uuid::Uuid = sqlx::query_scalar(
        "SELECT master_id FROM controller_election_events WHERE namespace = $1 AND project_id = 'PID-R' ORDER BY id LIMIT 1",
    )
    .bind(&ns)
    .fetch_one(&db.pool)
    .await
    .expect("first master");
    sqlx::query(
        "INSERT INTO controller_election_events (namespace, project_id, term, master_id, previous_master_id, cause)
         SELECT namespace, project_id, $2, gen_random_uuid(), master_id, 'elected' FROM controller_projects
         WHERE namespace = $1 AND project_id = 'PID-R'",
    )
    .bind(&ns)
    .bind(before)
    .execute(&db.pool)
    .await
    .expect("forge a row");
    let (ok, out) = check(&db.url, &["--namespace-prefix", &ns]).await;
    assert!(!ok && out.contains(&format!("term {before} was held by two masters")), "{first}: {out}");
}

/// The durable rows a Redis fault must leave alone: saved before, compared after; a row
/// that changed is named with both versions, an unchanged set passes.
#[tokio::test]
async fn the_checker_names_a_durable_row_that_changed() {
    let db = TestDb::new().await;
    let insert = "INSERT INTO run_identities (id, namespace, name, server_instance_id, component_kind, public_key, key_generation)
                  VALUES ($1, 'ns-durable', $2, $2, 'run', 'AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=', 1)";
    let ids = [uuid::Uuid::new_v4(), uuid::Uuid::new_v4()];
    for (i, id) in ids.iter().enumerate() {
        sqlx::query(insert).bind(id).bind(format!("srv-durable-{i}")).execute(&db.pool).await.expect("insert");
    }
    let file = std::env::temp_dir().join(format!("prism-durable-{}", uuid::Uuid::new_v4().simple()));
    let file = file.to_str().expect("utf-8").to_string();
    let (ok, out) = check(&db.url, &["--save-durable", &file]).await;
    assert!(ok && out.contains("saved 2 durable rows"), "{out}");
    let (ok, out) = check(&db.url, &["--durable-before", &file]).await;
    assert!(ok && out.contains("durable rows compared 2"), "unchanged rows pass:\n{out}");

    sqlx::query("UPDATE run_identities SET updated_at = now() + interval '1 second' WHERE id = $1")
        .bind(ids[1])
        .execute(&db.pool)
        .await
        .expect("touch a row");
    let (ok, out) = check(&db.url, &["--durable-before", &file]).await;
    let _ = std::fs::remove_file(&file);
    assert!(!ok, "a changed row is a violation:\n{out}");
    let line = out.lines().find(|l| l.starts_with("VIOLATION")).unwrap_or_default();
    assert!(line.contains(&format!("run_identities {} changed", ids[1])), "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with("VIOLATION")).count(), 1, "only that row: {out}");
}

/// SPEC §10's job invariants, from the rows: a history the database recorded passes; a
/// second finish, a claim past max_attempts and a fenced claim in another term are each
/// named.
#[tokio::test]
async fn the_checker_names_a_job_finished_twice_claimed_too_often_or_claimed_after_its_term() {
    let db = TestDb::new().await;
    let exec = |sql: &'static str| {
        let pool = db.pool.clone();
        async move { sqlx::query(sql).execute(&pool).await.expect(sql) }
    };
    exec("INSERT INTO controller_projects (namespace, project_id, term) VALUES ('ns-inv', 'P', 3)").await;
    let job = uuid::Uuid::new_v4();
    let fenced = uuid::Uuid::new_v4();
    for (id, fence) in [(job, None), (fenced, Some(3i64))] {
        sqlx::query(
            "INSERT INTO runtime_jobs (id, namespace, server_instance_id, component_kind, kind, max_attempts,
                 fence_namespace, fence_project_id, fence_term)
             VALUES ($1, 'ns-inv', 'srv', 'run', 'config', 2, $2, $3, $4)",
        )
        .bind(id)
        .bind(fence.map(|_| "ns-inv"))
        .bind(fence.map(|_| "P"))
        .bind(fence)
        .execute(&db.pool)
        .await
        .expect("job");
    }
    // The plain job: claimed, its attempt ends, claimed again, succeeded. Recorded by the
    // database's own trigger.
    let claim =
        "UPDATE runtime_jobs SET state = 'claimed', attempts = attempts + 1, visible_at = now() + interval '1 minute',
                     deadline_at = now() + interval '1 minute' WHERE id = $1";
    for step in [
        claim,
        "UPDATE runtime_jobs SET state = 'queued', visible_at = NULL, deadline_at = NULL WHERE id = $1",
        claim,
        "UPDATE runtime_jobs SET state = 'succeeded', completed_at = now() WHERE id = $1",
    ] {
        sqlx::query(step).bind(job).execute(&db.pool).await.expect(step);
    }
    // A job whose steps name their attempt, as the operator's step statement does: the
    // ack and the complete of its second attempt.
    let named = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO runtime_jobs (id, namespace, server_instance_id, component_kind, kind, max_attempts)
         VALUES ($1, 'ns-inv', 'srv', 'run', 'config', 3)",
    )
    .bind(named)
    .execute(&db.pool)
    .await
    .expect("job");
    let step = |attempt: i32, sql: &'static str| {
        let pool = db.pool.clone();
        async move {
            let mut tx = pool.begin().await.expect("begin");
            sqlx::query("SELECT set_config('prism.step_attempt', $1, true)")
                .bind(attempt.to_string())
                .execute(&mut *tx)
                .await
                .expect("name the attempt");
            sqlx::query(sql).bind(named).execute(&mut *tx).await.expect(sql);
            tx.commit().await.expect("commit");
        }
    };
    for sql in
        [claim, "UPDATE runtime_jobs SET state = 'queued', visible_at = NULL, deadline_at = NULL WHERE id = $1", claim]
    {
        sqlx::query(sql).bind(named).execute(&db.pool).await.expect(sql);
    }
    step(2, "UPDATE runtime_jobs SET state = 'running' WHERE id = $1").await;
    let (ok, out) = check(&db.url, &["--namespace-prefix", "ns-inv"]).await;
    assert!(ok, "{out}");
    assert!(out.contains("claims 4") && out.contains("steps naming their attempt 1"), "{out}");
    // A step of the first attempt finishing the second: what `stale_attempt` prevents.
    step(1, "UPDATE runtime_jobs SET state = 'succeeded', completed_at = now() WHERE id = $1").await;
    let (ok, out) = check(&db.url, &["--namespace-prefix", "ns-inv"]).await;
    assert!(!ok, "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("VIOLATION")
            && l.contains(&format!("job {named}"))
            && l.contains("a step of attempt 1 made it succeeded at attempt 2")),
        "{out}"
    );
    sqlx::query("DELETE FROM runtime_jobs WHERE id = $1").bind(named).execute(&db.pool).await.expect("forget it");
    // A finished job cannot be changed: the database refuses it.
    let revive = sqlx::query("UPDATE runtime_jobs SET state = 'queued', completed_at = NULL WHERE id = $1")
        .bind(job)
        .execute(&db.pool)
        .await;
    assert!(revive.is_err(), "a finished job stays finished");

    // Forged history: a second finish and a third claim of the plain job.
    for state in ["succeeded", "claimed"] {
        sqlx::query("INSERT INTO runtime_job_events (job_id, state, attempts) VALUES ($1, $2, 3)")
            .bind(job)
            .bind(state)
            .execute(&db.pool)
            .await
            .expect("forge");
    }
    // A fenced claim while its project had moved to term 4 (one change of master, 10 s
    // before the claim).
    exec(
        "INSERT INTO controller_election_events (namespace, project_id, term, master_id, cause, created_at)
          VALUES ('ns-inv', 'P', 4, gen_random_uuid(), 'elected', now() - interval '10 seconds')",
    )
    .await;
    sqlx::query("INSERT INTO runtime_job_events (job_id, state, attempts, project_term) VALUES ($1, 'claimed', 1, 4)")
        .bind(fenced)
        .execute(&db.pool)
        .await
        .expect("forge");
    let (ok, out) = check(&db.url, &["--namespace-prefix", "no-such-namespace-"]).await;
    assert!(!ok, "{out}");
    let violations: Vec<&str> = out.lines().filter(|l| l.starts_with("VIOLATION")).collect();
    let has = |needle: &str| violations.iter().any(|l| l.contains(&format!("job {job}")) && l.contains(needle));
    assert!(has("finished 2 times"), "{out}");
    assert!(has("claimed 3 times, max_attempts 2"), "{out}");
    assert!(has("changed after it finished"), "{out}");
    assert!(violations.iter().any(|l| l.contains(&format!("job {fenced}")) && l.contains("fenced to term 3")), "{out}");
}

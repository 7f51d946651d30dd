//! The election's invariants as the database enforces them (real Postgres): these hold
//! even if the operator's code is wrong or two replicas race. And what the schema's
//! functions cost: a claim's index reads do not grow with the backlog.

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
    let before = prism_store::migrations::applied(&db.pool).await.expect("ledgers");
    prism_operator::db::migrate(&db.pool).await.expect("second run succeeds");
    assert_eq!(prism_store::migrations::applied(&db.pool).await.expect("ledgers"), before);
    assert_eq!(before, prism_store::migrations::ALL.iter().count());
}

/// Index entries and sequentially read rows of `runtime_jobs`, as this backend's
/// statistics count them once flushed.
async fn reads_of_jobs(conn: &mut sqlx::PgConnection) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await.expect("flush statistics");
    sqlx::query_scalar(
        "SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes WHERE relname = 'runtime_jobs')::int8
              + (SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables WHERE relname = 'runtime_jobs')::int8",
    )
    .fetch_one(&mut *conn)
    .await
    .expect("read statistics")
}

/// One claim of one job of `target`, in a transaction of its own, as the store asks it.
async fn claim_one(conn: &mut sqlx::PgConnection, target: &str) -> bool {
    let got: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM runtime_jobs_claim('ns', $1, 'run', $2, 1, 60, ARRAY['config','file'], NULL)",
    )
    .bind(target)
    .bind(Uuid::nil())
    .fetch_optional(&mut *conn)
    .await
    .expect("claim");
    got.is_some()
}

/// SPEC §12, "Jobs are bounded": one tenant's backlog does not slow every tenant's claims.
/// The adversarial state is the one a bulk enqueue leaves: statistics that say "every job
/// is queued" (so an index over every state looks as good as the queued one) and the
/// oldest jobs already claimed. A claim then reads a few index entries at 1,000 queued as
/// at 100,000, and the selection inside the installed function is planned on the queued
/// jobs' ordered index, without a sort, whatever the statistics say.
#[tokio::test]
async fn a_claim_reads_the_same_few_index_entries_at_1000_and_100000_queued() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.expect("connection");
    let mut per_claim = Vec::new();
    for backlog in [1_000i64, 100_000] {
        let target = format!("t-{backlog}");
        sqlx::query(
            "INSERT INTO runtime_jobs (namespace, server_instance_id, component_kind, kind, created_at)
             SELECT 'ns', $1, 'run', 'config', now() - make_interval(secs => $2 - g) FROM generate_series(1, $2) g",
        )
        .bind(&target)
        .bind(backlog)
        .execute(&mut *conn)
        .await
        .expect("backlog");
        sqlx::query("ANALYZE runtime_jobs").execute(&mut *conn).await.expect("analyze");
        // The oldest jobs taken: in flight, in front of the queue in every index of all states.
        for _ in 0..300 {
            assert!(claim_one(&mut conn, &target).await, "a queued job to claim");
        }
        let before = reads_of_jobs(&mut conn).await;
        let claims = 200;
        for _ in 0..claims {
            assert!(claim_one(&mut conn, &target).await, "a queued job to claim");
        }
        let read = reads_of_jobs(&mut conn).await - before;
        per_claim.push(read as f64 / claims as f64);
    }
    println!(
        "index entries and rows read per claim: {:.1} at 1,000 queued, {:.1} at 100,000",
        per_claim[0], per_claim[1]
    );
    // Before the plan was pinned, each claim at 100,000 read past the 300 in flight and
    // more (the index of every state): 300 and up. Pinned, a claim reads 5 here on a
    // quiet machine and up to ~25 when concurrent snapshots (autovacuum, a busy CI) keep
    // the claimed entries from being marked dead, at 1,000 as at 100,000 (at 1,000 the
    // planner may also read the small table whole once autovacuum refreshed its
    // statistics: cheap there). The bound sits between the two, far from both.
    assert!(per_claim[1] <= 100.0, "a claim reads a few entries, not the jobs before the queue: {per_claim:?}");

    // The selection as installed, its parameters made literals, planned on the 100,000.
    let source: String = sqlx::query_scalar("SELECT prosrc FROM pg_proc WHERE proname = 'runtime_jobs_claim'")
        .fetch_one(&mut *conn)
        .await
        .expect("the claim function");
    let start = source.find("SELECT j.id").expect("the claim selects its jobs");
    let end = source[start..].find("FOR UPDATE").expect("the selection locks what it takes") + start;
    let selection = source[start..end]
        .replace("p_namespace", "'ns'")
        .replace("p_server", "'t-100000'")
        .replace("p_component", "'run'")
        .replace("p_kinds", "ARRAY['config','file']")
        .replace("take", "1");
    let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN (FORMAT JSON) {selection}")))
        .fetch_one(&mut *conn)
        .await
        .expect("explain the selection");
    let text = plan.to_string();
    assert!(text.contains("\"Index Name\":\"runtime_jobs_claim_order\""), "planned on the queued jobs' index: {text}");
    assert!(!text.contains("\"Node Type\":\"Sort\""), "in the index's order, no sort: {text}");
}

/// The per-namespace count of queued jobs the quota reads (SPEC §12) follows statements
/// that touch many jobs of many addresses at once — a bulk enqueue, the election's cancel
/// of stale fenced jobs, the reaper's batches, the retention's deletes — and updates
/// that change no state leave it alone.
#[tokio::test]
async fn the_queued_count_follows_statements_over_many_jobs() {
    let db = TestDb::new().await;
    let statements = [
        "INSERT INTO runtime_jobs (namespace, server_instance_id, component_kind, kind)
         SELECT CASE WHEN g % 3 = 0 THEN 'other' ELSE 'ns' END, 'srv-' || (g % 40), 'run', 'config'
         FROM generate_series(1, 5000) g",
        "UPDATE runtime_jobs SET state = 'cancelled', completed_at = now(), cancel_cause = 'expired'
         WHERE id IN (SELECT id FROM runtime_jobs WHERE state = 'queued' ORDER BY id LIMIT 1234)",
        "UPDATE runtime_jobs SET updated_at = now() WHERE namespace = 'ns'",
        "SELECT count(*) FROM runtime_jobs_claim('ns', 'srv-1', 'run', '00000000-0000-0000-0000-000000000000', 50, 60, NULL, NULL)",
        "UPDATE runtime_jobs SET state = 'queued', claimed_at = NULL WHERE id IN
             (SELECT id FROM runtime_jobs WHERE state = 'claimed' ORDER BY id LIMIT 20)",
        "DELETE FROM runtime_jobs WHERE id IN (SELECT id FROM runtime_jobs WHERE namespace = 'other' ORDER BY id LIMIT 700)",
    ];
    for sql in statements {
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&db.pool).await.expect(sql);
        let counted: Vec<(String, i64)> = sqlx::query_as(
            "SELECT namespace, sum(queued)::int8 FROM runtime_job_queue_counts GROUP BY 1 HAVING sum(queued) <> 0 ORDER BY 1",
        )
        .fetch_all(&db.pool)
        .await
        .expect("counts");
        let actual: Vec<(String, i64)> =
            sqlx::query_as("SELECT namespace, count(*) FROM runtime_jobs WHERE state = 'queued' GROUP BY 1 ORDER BY 1")
                .fetch_all(&db.pool)
                .await
                .expect("queued jobs");
        assert_eq!(counted, actual, "after: {sql}");
    }
}

/// The count of live registrations the namespace quota reads (SPEC §12) follows
/// registrations, releases (one or many in a statement) and deletes, and heartbeats
/// leave it alone.
#[tokio::test]
async fn the_live_registration_count_follows_registrations_and_releases() {
    let db = TestDb::new().await;
    for p in 0..30 {
        project(&db.pool, "ns", &format!("P{p}")).await;
        project(&db.pool, "other", &format!("P{p}")).await;
    }
    let statements = [
        "INSERT INTO controller_registrations (id, namespace, name, project_id, session_id, agent_surface)
         SELECT gen_random_uuid(), CASE WHEN g % 4 = 0 THEN 'other' ELSE 'ns' END, 'r' || g, 'P' || (g % 30), 's' || g, 'other'
         FROM generate_series(1, 400) g",
        "UPDATE controller_registrations SET last_heartbeat = now()",
        "UPDATE controller_registrations SET released_at = now(), release_reason = 'wrapped'
         WHERE id IN (SELECT id FROM controller_registrations ORDER BY id LIMIT 123)",
        "UPDATE controller_registrations SET released_at = now(), release_reason = 'stale_heartbeat_incident'
         WHERE released_at IS NULL AND project_id = 'P7'",
        "DELETE FROM controller_registrations WHERE id IN (SELECT id FROM controller_registrations ORDER BY name LIMIT 150)",
    ];
    for sql in statements {
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&db.pool).await.expect(sql);
        let counted: Vec<(String, i64)> = sqlx::query_as(
            "SELECT namespace, sum(live)::int8 FROM controller_registration_counts GROUP BY 1 HAVING sum(live) <> 0 ORDER BY 1",
        )
        .fetch_all(&db.pool)
        .await
        .expect("counts");
        let actual: Vec<(String, i64)> = sqlx::query_as(
            "SELECT namespace, count(*) FROM controller_registrations WHERE released_at IS NULL GROUP BY 1 ORDER BY 1",
        )
        .fetch_all(&db.pool)
        .await
        .expect("live registrations");
        assert_eq!(counted, actual, "after: {sql}");
    }
}

/// What the previous release checks at start: its own migrations (from its commit, read at
/// run time as its binary embeds them), strictly, in `_sqlx_migrations`.
/// On a connection of its own, closed after: a failed run returns without releasing
/// sqlx's advisory migration lock, which a pooled connection would keep holding.
async fn previous_release_starts_on(url: &str) -> Result<(), sqlx::migrate::MigrateError> {
    use sqlx::Connection;
    let (_, commit) = support::releases::previous_of(env!("CARGO_PKG_VERSION"));
    let dir = std::env::temp_dir().join(format!("prism-migrations-{}", Uuid::new_v4().simple()));
    let migrations = support::releases::checkout(&commit, "migrations", &dir);
    let previous = sqlx::migrate::Migrator::new(migrations.as_path()).await.expect("the previous release's migrations");
    let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
    let result = previous.run(&mut conn).await;
    let _ = conn.close().await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// SPEC §15: `helm rollback` starts the previous binary on this schema. Its start-up
/// migration check passes (with one ledger, it stopped: "migration 20261207000002 was
/// previously applied but is missing in the resolved migrations").
#[tokio::test]
async fn the_previous_release_starts_on_this_schema() {
    let db = TestDb::new().await;
    previous_release_starts_on(&db.url).await.expect("the previous release's start-up migration check");
    // And it applied nothing: this schema already had all of its.
    assert_eq!(
        prism_store::migrations::applied(&db.pool).await.expect("ledgers"),
        prism_store::migrations::ALL.iter().count()
    );
}

/// After a rollback of a later release, this one meets a migration it does not know in
/// its ledger, and starts.
#[tokio::test]
async fn a_later_release_migration_does_not_stop_this_one() {
    let db = TestDb::new().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (version, description, success, checksum, execution_time) VALUES (29991231000001, 'later', true, '\\x00', 1)",
        prism_store::migrations::LEDGER
    )))
    .execute(&db.pool)
    .await
    .expect("a later release's row");
    prism_operator::db::migrate(&db.pool).await.expect("this release starts");
}

/// A database a pre-release build migrated with one ledger: its later versions move to the
/// second (not applied again), and the previous release starts on it.
#[tokio::test]
async fn a_single_ledger_database_is_adopted() {
    let db = TestDb::new().await;
    let ledger = prism_store::migrations::LEDGER;
    let moved = sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO _sqlx_migrations SELECT * FROM {ledger}")))
        .execute(&db.pool)
        .await
        .expect("as a pre-release build left it")
        .rows_affected();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {ledger}"))).execute(&db.pool).await.expect("one ledger");
    assert!(moved > 0, "this release has migrations after the previous one's");
    assert!(previous_release_starts_on(&db.url).await.is_err(), "with one ledger the previous release stops");
    prism_operator::db::migrate(&db.pool).await.expect("adopted");
    previous_release_starts_on(&db.url).await.expect("the previous release starts after the adoption");
    assert_eq!(
        prism_store::migrations::applied(&db.pool).await.expect("ledgers"),
        prism_store::migrations::ALL.iter().count()
    );
}

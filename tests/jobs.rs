//! The job lifecycle a platform runs on (SPEC §5.1), end to end: real kube-apiserver,
//! Postgres and Redis, the operator process, Runs speaking the wire format (SPEC §8) and
//! a platform speaking the HTTP API with Kubernetes tokens. Each test plays what a user
//! would meet, races included.

use prism_testkit as support;

use std::time::Duration;

use prism_operator::run_client::{ClientError, RunClient};
use serde_json::{Value, json};
use support::{eventually, http};

type World = support::runs::RunWorld;

/// A platform with a token allowed to read, list and update the world's RunSessions.
struct Platform {
    base: String,
    ns: String,
    token: String,
}

impl Platform {
    async fn new(w: &World) -> Platform {
        let token = support::sa_token(w.cp, &w.ns, "platform", "runsessions", &["get", "list", "update"]).await;
        Platform { base: w.op.base.clone(), ns: w.ns.clone(), token }
    }

    fn with_token(&self, token: &str) -> Platform {
        Platform { base: self.base.clone(), ns: self.ns.clone(), token: token.to_string() }
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> (u16, Value) {
        let r = req.bearer_auth(&self.token).send().await.expect("request");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Enqueue for server `server` (component `run`), with `extra` fields merged in.
    async fn enqueue(&self, server: &str, kind: &str, extra: Value) -> (u16, Value) {
        let mut body = json!({"namespace": self.ns, "server_instance_id": server, "component_kind": "run",
                              "kind": kind, "payload": {"n": 1}});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        self.send(http().post(format!("{}/api/v1/runtime/jobs", self.base)).json(&body)).await
    }

    async fn queued(&self, server: &str, kind: &str, extra: Value) -> Value {
        let (status, job) = self.enqueue(server, kind, extra).await;
        assert_eq!(status, 201, "enqueue: {job}");
        job
    }

    async fn get(&self, id: &str) -> (u16, Value) {
        self.send(http().get(format!("{}/api/v1/runtime/jobs/{id}?namespace={}", self.base, self.ns))).await
    }

    async fn job(&self, id: &str) -> Value {
        let (status, job) = self.get(id).await;
        assert_eq!(status, 200, "get {id}: {job}");
        job
    }

    async fn list(&self, query: &str) -> (u16, Value) {
        self.send(http().get(format!("{}/api/v1/runtime/jobs?namespace={}{query}", self.base, self.ns))).await
    }

    async fn cancel(&self, id: &str, reason: Option<&str>) -> (u16, Value) {
        let mut req = http().post(format!("{}/api/v1/runtime/jobs/{id}/cancel?namespace={}", self.base, self.ns));
        if let Some(r) = reason {
            req = req.json(&json!({"reason": r}));
        }
        self.send(req).await
    }
}

fn id_of(job: &Value) -> String {
    job["id"].as_str().expect("job id").to_string()
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

async fn started_run(w: &World, name: &str, server: &str) -> RunClient {
    let mut run = w.run(name, server, None).await;
    run.hello().await.expect("hello");
    run
}

/// Cuts every LISTEN connection to the world's database (the operator's change signals),
/// as a Postgres restart or a proxy would.
async fn cut_listeners(w: &World) {
    let cut: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
          WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_one(&w.db.pool)
    .await
    .expect("terminate the listeners");
    assert!(cut >= 1, "the operator listens");
}

async fn complete(run: &RunClient, id: &str, body: Value) -> Result<Value, (u16, String)> {
    let id = uuid::Uuid::parse_str(id).expect("uuid");
    match run.step(&id, "complete", Some(body)).await {
        Ok(job) => Ok(serde_json::to_value(job).expect("job json")),
        Err(ClientError::Refused { status, code, .. }) => Err((status, code)),
        Err(e) => panic!("complete: {e}"),
    }
}

/// §5.1 read: one job and a filtered, keyset-paginated list, newest first, in the §8 shape;
/// authorized before any lookup (the same 403 for a missing job and another tenant's).
#[tokio::test]
async fn jobs_are_read_and_listed_in_pages_and_only_by_their_tenant() {
    let w = World::start("jobs-read", &[]).await;
    let p = Platform::new(&w).await;
    let _a = w.run("run-a", "srv-a", None).await;
    let _b = w.run("run-b", "srv-b", None).await;
    let mut ids = vec![];
    for i in 0..5 {
        let server = if i % 2 == 0 { "srv-a" } else { "srv-b" };
        ids.push(id_of(&p.queued(server, "config", json!({"payload": {"i": i}})).await));
    }
    let job = p.job(&ids[0]).await;
    for field in [
        "id",
        "namespace",
        "server_instance_id",
        "component_kind",
        "kind",
        "payload",
        "state",
        "attempts",
        "max_attempts",
        "timeout_seconds",
        "idempotency_key",
        "fence",
        "created_at",
        "claimed_at",
        "completed_at",
        "progress",
        "result",
        "last_error",
        "cancel_requested",
        "cancel_reason",
    ] {
        assert!(job.get(field).is_some(), "the job shape has {field}: {job}");
    }
    assert_eq!(
        (job["state"].as_str(), job["attempts"].as_i64(), job["max_attempts"].as_i64()),
        (Some("queued"), Some(0), Some(3))
    );
    assert_eq!(job["timeout_seconds"], 600);
    assert_eq!(job["cancel_requested"], false);

    // Newest first, two per page, every job once.
    let mut seen = vec![];
    let mut after = String::new();
    loop {
        let (status, page) = p.list(&format!("&limit=2{after}")).await;
        assert_eq!(status, 200, "{page}");
        let jobs = page["jobs"].as_array().expect("jobs");
        assert!(jobs.len() <= 2);
        seen.extend(jobs.iter().map(id_of));
        match page["next_cursor"].as_str() {
            Some(c) => after = format!("&after={c}"),
            None => break,
        }
    }
    let newest_first: Vec<String> = ids.iter().rev().cloned().collect();
    assert_eq!(seen, newest_first);
    let (_, a_only) = p.list("&server_instance_id=srv-a&state=queued").await;
    assert_eq!(a_only["jobs"].as_array().map(Vec::len), Some(3));
    let (_, none) = p.list("&state=succeeded").await;
    assert_eq!(none["jobs"].as_array().map(Vec::len), Some(0));
    assert_eq!(p.list("&state=bogus").await.0, 400, "an unknown state is refused");
    assert_eq!(p.list("&limit=501").await.0, 422);
    assert_eq!(code(&p.list("&after=not-a-cursor").await.1), "invalid_request");

    // A tenant of another namespace, with full rights there: 403 for this namespace's
    // jobs, the same for a job id that exists nowhere; nothing of the job in the answer.
    let other_ns = support::namespace(&w.client, "jobs-other").await;
    let outsider = support::sa_token(w.cp, &other_ns, "platform", "runsessions", &["get", "list", "update"]).await;
    let outsider = p.with_token(&outsider);
    let (s1, b1) = outsider.get(&ids[0]).await;
    let (s2, b2) = outsider.get(&uuid::Uuid::new_v4().to_string()).await;
    assert_eq!((s1, code(&b1)), (403, "forbidden"));
    assert_eq!((s2, code(&b2)), (403, "forbidden"));
    assert_eq!(outsider.list("").await.0, 403);
    let (s3, b3) = outsider.cancel(&ids[0], None).await;
    assert_eq!((s3, code(&b3)), (403, "forbidden"));
    assert!(!b1.to_string().contains("srv-a") && !b3.to_string().contains("srv-a"));
    assert_eq!(p.job(&ids[0]).await["state"], "queued", "a refused cancel changes nothing");
    // Asking for its own namespace, the outsider sees no job of this one.
    let own = Platform { base: p.base.clone(), ns: other_ns.clone(), token: outsider.token.clone() };
    assert_eq!(own.get(&ids[0]).await.0, 404);
    assert_eq!(own.list("").await.1["jobs"].as_array().map(Vec::len), Some(0));
    // Read-only: may read, may not cancel.
    let reader = p.with_token(&support::sa_token(w.cp, &w.ns, "reader", "runsessions", &["get", "list"]).await);
    assert_eq!(reader.get(&ids[0]).await.0, 200);
    assert_eq!(reader.cancel(&ids[0], None).await.0, 403);
}

/// §5.1 cancel: queued at once; in flight through the Run (heartbeat `cancel`, step
/// `cancel_requested`, claim `cancel`), which completes it `cancelled`; past the grace it
/// is cancelled anyway and the Run's later steps are 409 `job_finished`.
#[tokio::test]
async fn cancels_reach_the_run_and_the_grace_ends_them_anyway() {
    let w = World::start("jobs-cancel", &[("PRISM_JOB_CANCEL_GRACE_SECONDS", "3")]).await;
    let p = Platform::new(&w).await;
    let run = started_run(&w, "run-a", "srv-a").await;

    let queued = id_of(&p.queued("srv-a", "config", json!({})).await);
    let (status, job) = p.cancel(&queued, Some("not needed any more")).await;
    assert_eq!((status, job["state"].as_str()), (200, Some("cancelled")), "{job}");
    assert_eq!(job["cancel_reason"], "not needed any more");
    assert_eq!(code(&p.cancel(&queued, None).await.1), "job_finished");
    assert!(run.claim(10).await.expect("claim").is_empty(), "a cancelled job is never claimed");

    // In flight: asked, told, honoured.
    let honoured = id_of(&p.queued("srv-a", "config", json!({})).await);
    let claimed = run.claim(1).await.expect("claim");
    assert_eq!(claimed.len(), 1);
    run.step(&claimed[0].id, "ack", None).await.expect("ack");
    let (status, job) = p.cancel(&honoured, None).await;
    assert_eq!((status, job["state"].as_str(), job["cancel_requested"].as_bool()), (202, Some("running"), Some(true)));
    let beat = run.heartbeat().await.expect("heartbeat");
    assert_eq!(beat["cancel"], json!([honoured]), "the heartbeat answer names it");
    let progressed =
        run.step(&claimed[0].id, "progress", Some(json!({"progress": {"pct": 50}}))).await.expect("progress");
    assert!(progressed.cancel_requested, "every step answer says so");
    assert_eq!(run.claim_and_cancels(1).await.expect("claim").cancel.len(), 1, "and the claim answer");
    let done = complete(&run, &honoured, json!({"outcome": "cancelled"})).await.expect("complete as cancelled");
    assert_eq!((done["state"].as_str(), done["cancel_reason"].as_str()), (Some("cancelled"), Some("cancel_requested")));
    assert_eq!(run.heartbeat().await.expect("heartbeat")["cancel"], json!([]));

    // In flight and ignored: cancelled anyway after the grace; the Run's late steps 409.
    let ignored = id_of(&p.queued("srv-a", "config", json!({})).await);
    let claimed = run.claim(1).await.expect("claim");
    assert_eq!(claimed.len(), 1);
    assert_eq!(p.cancel(&ignored, None).await.0, 202);
    let job = eventually(10, "cancelled after the grace", || async {
        let job = p.job(&ignored).await;
        (job["state"] == "cancelled").then_some(job)
    })
    .await;
    assert!(job["completed_at"].is_string());
    let late = complete(&run, &ignored, json!({"outcome": "succeeded"})).await;
    assert_eq!(late, Err((409, "job_finished".to_string())));
    let (status, body) = p.cancel(&ignored, None).await;
    assert_eq!((status, code(&body)), (409, "job_finished"));

    // #43.5: /metrics (unauthenticated) counts cancellations by fixed cause only: the
    // canceller's text stays with the job.
    let metrics = support::metric_line(&w.op, "prism_runtime_job_cancellations{reason=\"grace\"} 1").await;
    assert!(metrics.lines().any(|l| l == "prism_runtime_job_cancellations{reason=\"requested\"} 2"), "{metrics}");
    assert!(!metrics.contains("not needed any more"), "a tenant's text on the metrics page");
    assert_eq!(p.job(&queued).await["cancel_reason"], "not needed any more", "kept with the job");
}

/// #43.6: jobs are bounded. A namespace holds at most PRISM_MAX_QUEUED_JOBS_PER_NAMESPACE
/// queued jobs (429 `quota_exceeded` beyond, which writes nothing; a claimed job makes
/// room), whatever its addresses; a job left queued past PRISM_JOB_QUEUED_TTL_HOURS is
/// cancelled with reason `expired`.
#[tokio::test]
async fn queued_jobs_are_bounded_per_namespace_and_expire() {
    let w = World::start("jobs-quota", &[("PRISM_MAX_QUEUED_JOBS_PER_NAMESPACE", "3")]).await;
    let p = Platform::new(&w).await;
    let run = started_run(&w, "run-a", "srv-a").await;
    let _other = started_run(&w, "run-b", "srv-b").await;
    let mut ids = Vec::new();
    for server in ["srv-a", "srv-b", "srv-a"] {
        ids.push(id_of(&p.queued(server, "config", json!({})).await));
    }
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM runtime_jobs").fetch_one(&w.db.pool).await.expect("count")
    };
    for server in ["srv-a", "srv-b"] {
        let (status, body) = p.enqueue(server, "config", json!({})).await;
        assert_eq!((status, code(&body)), (429, "quota_exceeded"), "{body}");
    }
    assert_eq!(count().await, 3, "a refused enqueue writes nothing");
    assert_eq!(run.claim(1).await.expect("claim").len(), 1);
    let (status, body) = p.enqueue("srv-b", "config", json!({})).await;
    assert_eq!(status, 201, "a claimed job made room: {body}");

    // Expiry: a job queued 73 hours ago (the default TTL is 72) is cancelled by the reaper.
    let old = &ids[1];
    sqlx::query("UPDATE runtime_jobs SET created_at = now() - interval '73 hours' WHERE id = $1::uuid")
        .bind(old)
        .execute(&w.db.pool)
        .await
        .expect("age it");
    let job = eventually(15, "the old job expired", || async {
        let job = p.job(old).await;
        (job["state"] == "cancelled").then_some(job)
    })
    .await;
    assert_eq!(job["cancel_reason"], "expired", "{job}");
    assert!(job["completed_at"].is_string());
    assert_eq!(p.job(&ids[2]).await["state"], "queued", "a young job stays queued");
    let (status, _) = p.enqueue("srv-a", "config", json!({})).await;
    assert_eq!(status, 201, "the expired job made room");
    let (status, _) = p.enqueue("srv-a", "config", json!({})).await;
    assert_eq!(status, 429, "and the quota holds again");
}

/// A cancel this replica did not take (another replica's API, the fence of a new master
/// term: here the same UPDATE, made in Postgres) still reaches the Run's heartbeat here,
/// also when the replica's connection that listens for them was cut just before.
#[tokio::test]
async fn a_cancel_taken_elsewhere_reaches_the_heartbeat_here_even_across_a_lost_listener() {
    let w = World::start("jobs-cancel-signal", &[]).await;
    let p = Platform::new(&w).await;
    let run = started_run(&w, "run-a", "srv-a").await;
    let request_cancel = |id: String| {
        let pool = w.db.pool.clone();
        async move {
            let id = uuid::Uuid::parse_str(&id).expect("uuid");
            let n = sqlx::query(
                "UPDATE runtime_jobs SET cancel_requested_at = now(), cancel_reason = 'elsewhere' WHERE id = $1",
            )
            .bind(id)
            .execute(&pool)
            .await
            .expect("request a cancel in Postgres")
            .rows_affected();
            assert_eq!(n, 1);
        }
    };
    let first = id_of(&p.queued("srv-a", "config", json!({})).await);
    let second = id_of(&p.queued("srv-a", "config", json!({})).await);
    assert_eq!(run.claim(2).await.expect("claim").len(), 2);
    assert_eq!(run.heartbeat().await.expect("heartbeat")["cancel"], json!([]), "nothing asked yet");

    request_cancel(first.clone()).await;
    eventually(5, "the heartbeat names the job cancelled elsewhere", || async {
        (run.heartbeat().await.expect("heartbeat")["cancel"] == json!([first])).then_some(())
    })
    .await;

    // Cut every LISTEN connection of the operator, then ask again at once.
    cut_listeners(&w).await;
    request_cancel(second.clone()).await;
    eventually(5, "the heartbeat names both, the listener cut notwithstanding", || async {
        let cancel = run.heartbeat().await.expect("heartbeat")["cancel"].clone();
        (cancel.as_array().map(Vec::len) == Some(2)).then_some(())
    })
    .await;
    let named = run.heartbeat().await.expect("heartbeat")["cancel"].clone();
    assert!(named == json!([first, second]) || named == json!([second, first]), "{named}");
    for id in [&first, &second] {
        complete(&run, id, json!({"outcome": "cancelled"})).await.expect("complete as cancelled");
    }
    assert_eq!(run.heartbeat().await.expect("heartbeat")["cancel"], json!([]));
}

/// A cancel and a complete of one running job at the same instant: exactly one wins and
/// the other is told (the job ends once, in the state the winner gave it).
#[tokio::test]
async fn cancel_and_complete_at_the_same_instant_end_the_job_once() {
    let w = World::start("jobs-race", &[("PRISM_JOB_CANCEL_GRACE_SECONDS", "1")]).await;
    let p = Platform::new(&w).await;
    let run = started_run(&w, "run-a", "srv-a").await;
    let mut outcomes = std::collections::BTreeMap::<String, u32>::new();
    for _ in 0..20 {
        let id = id_of(&p.queued("srv-a", "config", json!({})).await);
        assert_eq!(run.claim(1).await.expect("claim").len(), 1);
        // The queued case: a claim and a cancel racing for a queued job.
        let (cancel, done) = tokio::join!(
            p.cancel(&id, None),
            complete(&run, &id, json!({"outcome": "succeeded", "result": {"ok": 1}}))
        );
        let job = p.job(&id).await;
        match (&done, cancel.0) {
            // The Run finished first: the cancel is told the job is finished.
            (Ok(d), 409) => {
                assert_eq!((d["state"].as_str(), job["state"].as_str()), (Some("succeeded"), Some("succeeded")));
                assert_eq!(code(&cancel.1), "job_finished");
            }
            // The cancel was asked first: the Run's answer carries the request; the job
            // succeeded (the work was done), and the request had nothing left to stop.
            (Ok(d), 202) => {
                assert_eq!((d["state"].as_str(), job["state"].as_str()), (Some("succeeded"), Some("succeeded")))
            }
            other => panic!("unexpected race result {other:?} {cancel:?}"),
        }
        *outcomes.entry(format!("{}", cancel.0)).or_default() += 1;
        let events: Vec<(String,)> =
            sqlx::query_as("SELECT state FROM runtime_job_events WHERE job_id = $1::uuid AND state IN ('succeeded','failed','cancelled')")
                .bind(&id)
                .fetch_all(&w.db.pool)
                .await
                .expect("events");
        assert_eq!(events.len(), 1, "the job ended exactly once");
    }
    // Past the grace, the cancel wins and the Run is told: the same race from its side.
    let id = id_of(&p.queued("srv-a", "config", json!({})).await);
    assert_eq!(run.claim(1).await.expect("claim").len(), 1);
    assert_eq!(p.cancel(&id, None).await.0, 202);
    eventually(10, "cancelled", || async { (p.job(&id).await["state"] == "cancelled").then_some(()) }).await;
    assert_eq!(complete(&run, &id, json!({"outcome": "succeeded"})).await, Err((409, "job_finished".into())));
    println!("cancel answers in the race: {outcomes:?}");
}

/// §5.1 bounded attempts: a Run that dies mid-job (never completes) has its attempt end
/// by the visibility timeout; after `max_attempts` the job is `failed` for good with its
/// last error kept, and never claimed again. A retryable failure is retried after a
/// backoff; a deadline ends an attempt that keeps progressing.
#[tokio::test]
async fn attempts_are_bounded_and_end_by_timeout_deadline_or_failure() {
    let w = World::start("jobs-attempts", &[("PRISM_JOB_VISIBILITY_SECONDS", "1")]).await;
    let p = Platform::new(&w).await;
    let run = started_run(&w, "run-a", "srv-a").await;

    // Killed mid-job, twice.
    let id = id_of(&p.queued("srv-a", "config", json!({"max_attempts": 2})).await);
    let claim_it = || async {
        eventually(15, "claimed again after the backoff", || async {
            let jobs = run.claim(1).await.ok()?;
            (jobs.len() == 1).then(|| jobs[0].clone())
        })
        .await
    };
    let first = claim_it().await;
    assert_eq!(first.attempts, 1);
    let requeued = eventually(10, "the silent attempt ends", || async {
        let job = p.job(&id).await;
        (job["state"] == "queued").then_some(job)
    })
    .await;
    assert_eq!(requeued["last_error"], "visibility_timeout");
    let second = claim_it().await;
    assert_eq!(second.attempts, 2);
    let failed = eventually(10, "the last attempt ends", || async {
        let job = p.job(&id).await;
        (job["state"] == "failed").then_some(job)
    })
    .await;
    assert_eq!((failed["attempts"].as_i64(), failed["last_error"].as_str()), (Some(2), Some("visibility_timeout")));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(run.claim(10).await.expect("claim").is_empty(), "a failed job is never claimed again");
    let claims: i64 =
        sqlx::query_scalar("SELECT count(*) FROM runtime_job_events WHERE job_id = $1::uuid AND state = 'claimed'")
            .bind(&id)
            .fetch_one(&w.db.pool)
            .await
            .expect("count");
    assert_eq!(claims, 2, "claimed exactly max_attempts times");

    // A retryable failure: back to the queue after a backoff (2 s ± 20 %), the error kept.
    let id = id_of(&p.queued("srv-a", "config", json!({"max_attempts": 3})).await);
    let job = claim_it().await;
    let failed_at = std::time::Instant::now();
    let retry =
        complete(&run, &id, json!({"outcome": "failed", "retryable": true, "error": "disk full"})).await.expect("fail");
    assert_eq!((retry["state"].as_str(), retry["last_error"].as_str()), (Some("queued"), Some("disk full")));
    assert!(run.claim(1).await.expect("claim").is_empty(), "not before its backoff");
    let again = claim_it().await;
    assert!(failed_at.elapsed() >= Duration::from_millis(1500), "the backoff held {:?}", failed_at.elapsed());
    assert_eq!((again.id, again.attempts), (job.id, 2));
    // Not retryable: failed for good at once, attempts left or not.
    let done = complete(&run, &id, json!({"outcome": "failed", "error": "bad config"})).await.expect("fail");
    assert_eq!((done["state"].as_str(), done["last_error"].as_str()), (Some("failed"), Some("bad config")));

    // A deadline: the attempt keeps progressing (so the visibility timeout never runs
    // out) but passes its timeout_seconds.
    let id = id_of(&p.queued("srv-a", "config", json!({"timeout_seconds": 2, "max_attempts": 1})).await);
    let job = claim_it().await;
    let ended = eventually(10, "the deadline ends the attempt", || async {
        let _ = run.step(&job.id, "progress", Some(json!({"progress": {"alive": true}}))).await;
        let j = p.job(&id).await;
        (j["state"] == "failed").then_some(j)
    })
    .await;
    assert_eq!(ended["last_error"], "deadline_exceeded");
    assert_eq!(complete(&run, &id, json!({"outcome": "succeeded"})).await, Err((409, "job_finished".into())));

    // A complete that comes after the deadline does not count, reaped yet or not.
    let id = id_of(&p.queued("srv-a", "config", json!({"timeout_seconds": 1, "max_attempts": 1})).await);
    let _job = claim_it().await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let late = complete(&run, &id, json!({"outcome": "succeeded"})).await;
    assert!(
        matches!(&late, Err((409, c)) if c == "deadline_exceeded" || c == "job_finished"),
        "a complete past the deadline: {late:?}"
    );
    let ended = eventually(10, "failed by its deadline", || async {
        let j = p.job(&id).await;
        (j["state"] == "failed").then_some(j)
    })
    .await;
    assert_eq!(ended["last_error"], "deadline_exceeded");

    // Bad options change nothing.
    for bad in [
        json!({"max_attempts": 0}),
        json!({"max_attempts": 101}),
        json!({"timeout_seconds": 0}),
        json!({"timeout_seconds": 86401}),
        json!({"idempotency_key": "has space"}),
    ] {
        let (status, body) = p.enqueue("srv-a", "config", bad.clone()).await;
        assert_eq!((status, code(&body)), (422, "invalid_request"), "{bad}");
    }
}

/// §12 "a step names its attempt": a Run that outlived its visibility timeout can neither
/// finish nor requeue the attempt that came after it (409 `stale_attempt`, nothing
/// changes), while the current attempt's steps go through. A step that names no attempt
/// (a Run written before it was named) counts only while the job's current attempt is
/// its own session's claim.
#[tokio::test]
async fn a_step_of_an_ended_attempt_changes_nothing() {
    let w = World::start("jobs-stale-attempt", &[("PRISM_JOB_VISIBILITY_SECONDS", "1")]).await;
    let p = Platform::new(&w).await;
    let run = started_run(&w, "run-a", "srv-a").await;
    let id = id_of(&p.queued("srv-a", "config", json!({"max_attempts": 3})).await);
    let claim_it = || async {
        eventually(15, "claimed", || async {
            let jobs = run.claim(1).await.ok()?;
            (jobs.len() == 1).then(|| jobs[0].clone())
        })
        .await
    };
    let first = claim_it().await;
    assert_eq!((first.attempts, first.attempt), (1, Some(1)), "the claim answers the attempt");
    eventually(10, "the silent attempt ends", || async { (p.job(&id).await["state"] == "queued").then_some(()) }).await;
    let second = claim_it().await;
    assert_eq!(second.attempt, Some(2));

    // The first attempt's Run wakes up and reports: each step is refused, nothing changes.
    for (action, body) in [
        ("complete", json!({"outcome": "succeeded", "result": {"late": true}, "attempt": 1})),
        ("complete", json!({"outcome": "failed", "retryable": true, "error": "late", "attempt": 1})),
        ("progress", json!({"progress": {"late": true}, "attempt": 1})),
        ("ack", json!({"attempt": 1})),
    ] {
        let refused = run.step(&first.id, action, Some(body.clone())).await.expect_err("a stale step");
        assert_eq!(refused.code(), Some("stale_attempt"), "{action} {body}: {refused:?}");
    }
    let job = p.job(&id).await;
    assert_eq!(
        (job["state"].as_str(), job["attempts"].as_i64(), job["attempt"].as_i64(), &job["progress"], &job["result"]),
        (Some("claimed"), Some(2), Some(2), &Value::Null, &Value::Null),
        "the second attempt is untouched: {job}"
    );
    // The current attempt's steps go through (the bundled client names it by itself).
    let done = complete(&run, &id, json!({"outcome": "succeeded", "result": {"ok": 2}})).await.expect("complete");
    assert_eq!((done["state"].as_str(), done["result"]["ok"].as_i64()), (Some("succeeded"), Some(2)));
    // A late word of the first attempt on the finished job is stale too; of the last one,
    // finished.
    let late = run.step(&first.id, "complete", Some(json!({"outcome": "succeeded", "attempt": 1}))).await;
    assert_eq!(late.expect_err("stale").code(), Some("stale_attempt"));
    let again = run.step(&first.id, "complete", Some(json!({"outcome": "succeeded", "attempt": 2}))).await;
    assert_eq!(again.expect_err("finished").code(), Some("job_finished"));

    // Steps without `attempt`: counted while the claim is this session's, refused once a
    // newer session of the identity holds the Run.
    let mut old = started_run(&w, "run-b", "srv-b").await;
    old.name_attempts = false;
    let id = id_of(&p.queued("srv-b", "config", json!({})).await);
    let job = eventually(15, "claimed", || async {
        let jobs = old.claim(1).await.ok()?;
        (jobs.len() == 1).then(|| jobs[0].clone())
    })
    .await;
    old.step(&job.id, "ack", None).await.expect("an unnamed ack of this session's own claim");
    old.hello().await.expect("hello again: a new session");
    let refused = old.step(&job.id, "complete", Some(json!({"outcome": "succeeded"}))).await;
    assert_eq!(refused.expect_err("another session's claim").code(), Some("stale_attempt"));
    assert_eq!(p.job(&id).await["state"], "running");
    let done = old
        .step(&job.id, "complete", Some(json!({"outcome": "succeeded", "attempt": job.attempt})))
        .await
        .expect("the new session finishes the attempt it names");
    assert_eq!(serde_json::to_value(done).expect("json")["state"], "succeeded");
    // A malformed attempt is 422 and changes nothing.
    let id = id_of(&p.queued("srv-b", "config", json!({})).await);
    let job = eventually(15, "claimed", || async {
        let jobs = old.claim(1).await.ok()?;
        (jobs.len() == 1).then(|| jobs[0].clone())
    })
    .await;
    for bad in [json!({"attempt": 0}), json!({"attempt": "1"}), json!({"attempt": 101})] {
        let e = old.step(&job.id, "ack", Some(bad.clone())).await.expect_err("refused");
        assert_eq!(e.code(), Some("invalid_request"), "{bad}");
    }
    assert_eq!(p.job(&id).await["state"], "claimed");
}

/// §5.1 idempotent enqueue: 20 concurrent identical requests make one job (one 201, the
/// rest 200 with it); the key with another body is 409 `idempotency_conflict`.
#[tokio::test]
async fn an_idempotent_enqueue_from_20_callers_makes_one_job() {
    let w = World::start("jobs-idem", &[]).await;
    let p = Platform::new(&w).await;
    let _run = w.run("run-a", "srv-a", None).await;
    let body = json!({"idempotency_key": "deploy-42", "payload": {"version": "1.2.3", "steps": [1, 2]}});
    let answers = futures::future::join_all((0..20).map(|_| p.enqueue("srv-a", "lifecycle", body.clone()))).await;
    let created = answers.iter().filter(|(s, _)| *s == 201).count();
    let repeated = answers.iter().filter(|(s, _)| *s == 200).count();
    assert_eq!((created, repeated), (1, 19), "{answers:?}");
    let ids: std::collections::BTreeSet<String> = answers.iter().map(|(_, j)| id_of(j)).collect();
    assert_eq!(ids.len(), 1, "every answer is the same job");
    assert_eq!(answers[0].1["idempotency_key"], "deploy-42");
    let (_, page) = p.list("").await;
    assert_eq!(page["jobs"].as_array().map(Vec::len), Some(1));
    // The same request with its keys in another order is the same request.
    let reordered = json!({"payload": {"steps": [1, 2], "version": "1.2.3"}, "idempotency_key": "deploy-42"});
    assert_eq!(p.enqueue("srv-a", "lifecycle", reordered).await.0, 200);
    // Another body: 409, and nothing queued.
    let (status, err) =
        p.enqueue("srv-a", "lifecycle", json!({"idempotency_key": "deploy-42", "payload": {"version": "2"}})).await;
    assert_eq!((status, code(&err)), (409, "idempotency_conflict"));
    assert_eq!(p.list("").await.1["jobs"].as_array().map(Vec::len), Some(1));
    // The key answers in whatever state its job is.
    let id = ids.into_iter().next().expect("id");
    assert_eq!(p.cancel(&id, None).await.0, 200);
    let (status, job) = p.enqueue("srv-a", "lifecycle", body).await;
    assert_eq!((status, job["state"].as_str()), (200, Some("cancelled")));
}

/// §5.1 eligibility: a session gets only kinds it advertised and never more jobs in
/// flight than its `capacity.slots`, oldest first, even under concurrent claims.
#[tokio::test]
async fn claims_respect_kinds_and_slots_under_concurrent_claims() {
    let w = World::start("jobs-eligible", &[]).await;
    let p = Platform::new(&w).await;
    let mut run = w.run("run-a", "srv-a", None).await;
    run.capabilities = vec!["config".into(), "file".into()];
    run.capacity = [("slots".to_string(), 3)].into();
    run.hello().await.expect("hello");
    let log = id_of(&p.queued("srv-a", "log", json!({})).await);
    let mut oldest_first = vec![];
    for _ in 0..10 {
        oldest_first.push(id_of(&p.queued("srv-a", "config", json!({})).await));
    }
    let claims = futures::future::join_all((0..8).map(|_| run.claim(5))).await;
    let claimed: Vec<String> = claims.into_iter().flat_map(|c| c.expect("claim")).map(|j| j.id.to_string()).collect();
    assert_eq!(claimed.len(), 3, "at most 3 slots in flight: {claimed:?}");
    let mut sorted = claimed.clone();
    sorted.sort_by_key(|id| oldest_first.iter().position(|o| o == id));
    assert_eq!(sorted, oldest_first[..3].to_vec(), "the oldest three");
    // A slot frees when a job completes.
    complete(&run, &claimed[0], json!({"outcome": "succeeded"})).await.expect("complete");
    let next = run.claim(5).await.expect("claim");
    assert_eq!(next.iter().map(|j| j.id.to_string()).collect::<Vec<_>>(), vec![oldest_first[3].clone()]);
    // The log job stays queued for a Run that can do it.
    assert_eq!(p.job(&log).await["state"], "queued");
    // A heartbeat that advertises `log` and more slots makes it eligible.
    run.capabilities = vec!["log".into()];
    run.capacity = [("slots".to_string(), 10)].into();
    run.heartbeat().await.expect("heartbeat");
    let logs = run.claim(5).await.expect("claim");
    assert_eq!(logs.iter().map(|j| j.id.to_string()).collect::<Vec<_>>(), vec![log]);
}

/// §5.1 term-fenced jobs: queued work of a master is cancelled (`stale_term`) in the same
/// second its term moves on, work in flight gets a cancel request, an enqueue with the old
/// term is 409 `stale_term`, and a claim never hands out a stale-term job.
#[tokio::test]
async fn a_preempted_masters_fenced_work_never_reaches_a_machine() {
    let w = World::start("jobs-fence", &[]).await;
    let p = Platform::new(&w).await;
    support::grant(w.cp, &w.ns, "platform", "controllerregistrations", &["get"]).await;
    let agent = support::agent_token(w.cp, &w.ns, "agent", &["create", "get", "list", "delete", "update"]).await;
    let master = support::register(&w.op, &agent, &w.ns, "P", "codex-1", "codex").await;
    let term = master["term"].as_i64().expect("term");
    assert_eq!(master["is_master"], true);
    let fence = json!({"fence": {"namespace": w.ns, "project_id": "P", "term": term}});
    let run = started_run(&w, "run-a", "srv-a").await;
    let in_flight = id_of(&p.queued("srv-a", "config", fence.clone()).await);
    let claimed = run.claim(1).await.expect("claim");
    assert_eq!(claimed.iter().map(|j| j.id.to_string()).collect::<Vec<_>>(), vec![in_flight.clone()]);
    let queued: Vec<String> = {
        let mut ids = vec![];
        for _ in 0..3 {
            ids.push(id_of(&p.queued("srv-a", "config", fence.clone()).await));
        }
        ids
    };
    assert_eq!(p.job(&queued[0]).await["fence"]["term"], term);
    // Without `get` on registrations there, a fence is refused before it is read.
    let no_fence_right = p.with_token(&support::sa_token(w.cp, &w.ns, "dispatcher", "runsessions", &["update"]).await);
    assert_eq!(no_fence_right.enqueue("srv-a", "config", fence.clone()).await.0, 403);
    // A stale term is refused at once.
    let stale = json!({"fence": {"namespace": w.ns, "project_id": "P", "term": term + 7}});
    let (status, body) = p.enqueue("srv-a", "config", stale).await;
    assert_eq!((status, code(&body)), (409, "stale_term"));

    // A desktop session preempts the master: the term moves on.
    let desktop = support::register(&w.op, &agent, &w.ns, "P", "desktop-1", "claude_desktop").await;
    assert_eq!(desktop["is_master"], true);
    assert!(desktop["term"].as_i64() > Some(term));
    // In the same transaction: read right after the preempting register answered.
    for id in &queued {
        let job = p.job(id).await;
        assert_eq!(
            (job["state"].as_str(), job["cancel_reason"].as_str()),
            (Some("cancelled"), Some("stale_term")),
            "{job}"
        );
    }
    let flying = p.job(&in_flight).await;
    assert_eq!((flying["state"].as_str(), flying["cancel_requested"].as_bool()), (Some("claimed"), Some(true)));
    assert_eq!(run.heartbeat().await.expect("heartbeat")["cancel"], json!([in_flight]));
    assert!(run.claim(10).await.expect("claim").is_empty(), "no stale-term job is handed out");
    let (status, body) = p.enqueue("srv-a", "config", fence).await;
    assert_eq!((status, code(&body)), (409, "stale_term"), "the old master's new work is refused");
    // The database's own record: no fenced job was claimed in a term other than its own.
    let wrong: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM runtime_job_events e JOIN runtime_jobs j ON j.id = e.job_id
         WHERE e.state = 'claimed' AND j.fence_term IS NOT NULL AND e.project_term IS DISTINCT FROM j.fence_term",
    )
    .fetch_one(&w.db.pool)
    .await
    .expect("events");
    assert_eq!(wrong, 0);
}

/// #43.6: a change of master term does not wait on its project's whole fenced backlog.
/// With 3,000 fenced jobs queued, the preempting registration's transaction cancels 1,000
/// of them and leaves the rest to the reaper, which cancels them within seconds after the
/// commit; none is ever handed to a Run.
#[tokio::test]
async fn a_change_of_term_cancels_a_large_fenced_backlog_after_its_commit() {
    let w = World::start("jobs-fence-backlog", &[]).await;
    let agent = support::agent_token(w.cp, &w.ns, "agent", &["create", "get", "list", "delete", "update"]).await;
    let master = support::register(&w.op, &agent, &w.ns, "P", "codex-1", "codex").await;
    let term = master["term"].as_i64().expect("term");
    let run = started_run(&w, "run-a", "srv-a").await;
    sqlx::query(
        "INSERT INTO runtime_jobs (id, namespace, server_instance_id, component_kind, kind, payload,
                                   fence_namespace, fence_project_id, fence_term)
         SELECT gen_random_uuid(), $1, 'srv-a', 'run', 'config', '{}', $1, 'P', $2 FROM generate_series(1, 3000)",
    )
    .bind(&w.ns)
    .bind(term)
    .execute(&w.db.pool)
    .await
    .expect("a backlog of fenced jobs");
    let count = |state: &'static str| {
        let pool = w.db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM runtime_jobs WHERE state = $1 AND cancel_reason IS NOT DISTINCT FROM CASE WHEN $1 = 'cancelled' THEN 'stale_term' END")
                .bind(state)
                .fetch_one(&pool)
                .await
                .expect("count")
        }
    };
    let desktop = support::register(&w.op, &agent, &w.ns, "P", "desktop-1", "claude_desktop").await;
    assert!(desktop["term"].as_i64() > Some(term));
    assert!(count("cancelled").await >= 1000, "the first batch went with the change itself");
    assert!(run.claim(100).await.expect("claim").is_empty(), "no stale-term job is handed out meanwhile");
    eventually(20, "the rest cancelled after the commit", || async {
        (count("cancelled").await == 3000).then_some(())
    })
    .await;
    assert_eq!(count("queued").await, 0);
    let requests: i64 = sqlx::query_scalar("SELECT count(*) FROM runtime_job_fence_sweeps")
        .fetch_one(&w.db.pool)
        .await
        .expect("requests");
    assert_eq!(requests, 0, "the sweep request is forgotten once done");
    // The change's own transaction (one `now()` for all its rows) cancelled 1,000.
    let first_batch: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM runtime_jobs WHERE completed_at = (SELECT min(completed_at) FROM runtime_jobs)",
    )
    .fetch_one(&w.db.pool)
    .await
    .expect("first batch");
    assert_eq!(first_batch, 1000);
}

/// §9 `prism_enqueue` / `prism_job` through the official MCP SDK, in both protocol
/// generations: a master agent queues machine work fenced with its own term; once a
/// desktop session preempts it, its queued work is cancelled (`stale_term`) and its next
/// `prism_enqueue` is refused `not_master`; `prism_job` reads the job.
#[tokio::test]
async fn a_master_agent_queues_fenced_work_over_mcp_and_a_preempted_one_cannot() {
    let w = World::start("jobs-mcp", &[]).await;
    let agent = support::agent_token(w.cp, &w.ns, "agent", &["create", "get", "list", "delete"]).await;
    support::grant(w.cp, &w.ns, "agent", "runsessions", &["get", "update"]).await;
    let _run = w.run("run-a", "srv-a", None).await;
    let url = w.op.url("/mcp");
    for mode in ["legacy", "modern"] {
        let project = format!("P-{mode}");
        let (master, desktop) = (format!("codex-{mode}"), format!("desk-{mode}"));
        let ns = w.ns.as_str();
        let enqueue = json!(["prism_enqueue", {"server_instance_id": "srv-a", "component_kind": "run", "kind": "config",
            "payload": {"deploy": mode}, "session_id": master, "run_namespace": ns, "idempotency_key": format!("k-{mode}"),
            "namespace": ns}]);
        let plan = json!([["prism_start", {"project_id": project, "session_id": master, "namespace": ns}], enqueue]);
        let out = support::mcp_scenario(
            "calls",
            mode,
            &url,
            &agent,
            &[("calls", &plan.to_string()), ("client", "codex-mcp-client")],
        )
        .await;
        let start = &out["answers"][0]["structured"];
        let job = &out["answers"][1]["structured"];
        assert_eq!(out["answers"][1]["is_error"], false, "{mode}: {}", out["answers"][1]);
        assert_eq!(start["is_master"], true);
        assert_eq!(job["fence"], json!({"namespace": ns, "project_id": project, "term": start["term"]}), "{mode}");
        assert_eq!((job["state"].as_str(), job["role"].as_str()), (Some("queued"), Some("Master")));
        let id = job["id"].as_str().expect("job id").to_string();

        let preempt = json!([["prism_start", {"project_id": project, "session_id": desktop, "namespace": ns}]]);
        let out = support::mcp_scenario(
            "calls",
            mode,
            &url,
            &agent,
            &[("calls", &preempt.to_string()), ("client", "claude-ai")],
        )
        .await;
        assert_eq!(out["answers"][0]["structured"]["is_master"], true, "the desktop preempts");

        let plan =
            json!([enqueue, ["prism_job", {"job_id": id, "run_namespace": ns, "session_id": master, "namespace": ns}]]);
        let out = support::mcp_scenario(
            "calls",
            mode,
            &url,
            &agent,
            &[("calls", &plan.to_string()), ("client", "codex-mcp-client")],
        )
        .await;
        let refused = &out["answers"][0];
        assert_eq!(
            (refused["is_error"].as_bool(), refused["error"]["code"].as_str()),
            (Some(true), Some("not_master")),
            "{mode}: {refused}"
        );
        let read = &out["answers"][1]["structured"];
        assert_eq!(
            (read["state"].as_str(), read["cancel_reason"].as_str()),
            (Some("cancelled"), Some("stale_term")),
            "{mode}: {read}"
        );
        assert_eq!((read["role"].as_str(), read["you_were_preempted"].as_bool()), (Some("Peer"), Some(true)));
        assert!(out["answers"][1]["text"].as_str().unwrap_or_default().starts_with("You were preempted"));
    }
    // A caller who may not read the job's namespace's RunSessions is refused before the read.
    let outsider = support::agent_token(w.cp, &w.ns, "outsider", &["create", "get", "list"]).await;
    let plan = json!([["prism_job", {"job_id": uuid::Uuid::new_v4().to_string(), "run_namespace": w.ns}]]);
    let out = support::mcp_scenario(
        "calls",
        "modern",
        &url,
        &outsider,
        &[("calls", &plan.to_string()), ("client", "codex-mcp-client")],
    )
    .await;
    assert_eq!(out["answers"][0]["error"]["code"], "forbidden");
}

/// SPEC §11 long poll: a claim that finds nothing waits, holding no Postgres connection,
/// and is answered the moment work arrives — a job queued through another replica, a
/// cancel requested there for a job it holds, a retried job at the end of its backoff —
/// or empty when its wait ends. A cancel it already knew of does not end the wait.
#[tokio::test]
async fn long_poll_claims_are_answered_when_work_arrives_on_any_replica() {
    use std::time::Instant;
    let w = World::start("jobs-long-poll", &[]).await;
    let env = [("REDIS_URL", w.redis.url.as_str()), ("PRISM_REDIS_PREFIX", w.prefix.as_str())];
    let other = support::Operator::start(w.cp, &w.db.url, &w.ns, &env).await;
    let p = Platform::new(&w).await;
    let elsewhere = Platform { base: other.base.clone(), ns: w.ns.clone(), token: p.token.clone() };
    let run = std::sync::Arc::new(started_run(&w, "run-a", "srv-a").await);
    let waiting = |wait: u64| {
        let run = run.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            (run.claim_waiting(1, wait).await.expect("long-poll claim"), started.elapsed())
        })
    };
    let api_connections = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'active'
               AND query NOT LIKE '%pg_stat_activity%'",
        )
        .fetch_one(&w.db.pool)
        .await
        .expect("pg_stat_activity")
    };

    // Nothing queued: empty when the wait ends, not before.
    let (empty, took) = waiting(2).await.expect("task");
    assert!(empty.jobs.is_empty() && empty.cancel.is_empty());
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(4), "answered after {took:?}");

    // A job queued through the other replica reaches the claim waiting here at once.
    let claim = waiting(30);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!claim.is_finished(), "nothing to claim yet: it waits");
    assert_eq!(api_connections().await, 0, "a waiting claim holds no Postgres connection busy");
    let queued_at = Instant::now();
    let id = id_of(&elsewhere.queued("srv-a", "config", json!({})).await);
    let (claimed, _) = claim.await.expect("task");
    let dispatch = queued_at.elapsed();
    assert_eq!(claimed.jobs.iter().map(|j| j.id.to_string()).collect::<Vec<_>>(), vec![id.clone()]);
    assert!(dispatch < Duration::from_secs(2), "enqueue to claim took {dispatch:?}");
    run.step(&claimed.jobs[0].id, "ack", None).await.expect("ack");

    // A cancel requested through the other replica ends a wait here.
    let claim = waiting(30);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(elsewhere.cancel(&id, None).await.0, 202);
    let (told, took) = claim.await.expect("task");
    assert_eq!(told.cancel.iter().map(|j| j.to_string()).collect::<Vec<_>>(), vec![id.clone()]);
    assert!(took < Duration::from_secs(3), "told after {took:?}");
    // Known now: the next wait is not cut short by it, and still lists it at the end.
    let (again, took) = waiting(2).await.expect("task");
    assert!(
        took >= Duration::from_secs(2),
        "a known cancel answered at once ({took:?}): a Run finishing it would spin"
    );
    assert_eq!(again.cancel.len(), 1);
    complete(&run, &id, json!({"outcome": "cancelled"})).await.expect("complete as cancelled");

    // A retryable failure comes back after its backoff (2 s ± 20 %): the waiting claim
    // is woken then, with no new signal.
    let retried = id_of(&p.queued("srv-a", "config", json!({})).await);
    assert_eq!(run.claim(1).await.expect("claim").len(), 1);
    complete(&run, &retried, json!({"outcome": "failed", "retryable": true, "error": "busy"})).await.expect("fail");
    let (back, took) = waiting(30).await.expect("task");
    assert_eq!(back.jobs.iter().map(|j| j.id.to_string()).collect::<Vec<_>>(), vec![retried]);
    assert!(took >= Duration::from_millis(1200) && took < Duration::from_secs(5), "woken after {took:?}");

    // Bad waits are refused and claim nothing.
    let _ = p.queued("srv-a", "config", json!({})).await;
    for body in [json!({"wait_seconds": 61}), json!({"wait_seconds": -1}), json!({"wait_seconds": "5"})] {
        let r = http()
            .post(format!("{}/api/v1/runtime/jobs/claim", w.op.base))
            .bearer_auth(run.session_token().expect("token"))
            .json(&body)
            .send()
            .await
            .expect("claim");
        assert_eq!(r.status().as_u16(), 422, "{body}");
    }
    assert_eq!(run.claim(1).await.expect("the job is still there").len(), 1);
}

/// A waiting claim misses nothing when the replica's listener loses its connection
/// (it looks again once reconnected), and ends with a clean empty answer when the replica
/// stops (SIGTERM), so its Run asks another.
#[tokio::test]
async fn a_waiting_claim_survives_a_lost_listener_and_ends_when_its_replica_stops() {
    use std::time::Instant;
    let mut w = World::start("jobs-long-poll-faults", &[]).await;
    let p = Platform::new(&w).await;
    let run = std::sync::Arc::new(started_run(&w, "run-a", "srv-a").await);
    let waiting = |wait: u64| {
        let run = run.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            (run.claim_waiting(1, wait).await, started.elapsed())
        })
    };

    let claim = waiting(30);
    tokio::time::sleep(Duration::from_millis(500)).await;
    cut_listeners(&w).await;
    // Queued while no listener hears it.
    let id = id_of(&p.queued("srv-a", "config", json!({})).await);
    let (claimed, took) = claim.await.expect("task");
    let claimed = claimed.expect("claim");
    assert_eq!(claimed.jobs.iter().map(|j| j.id.to_string()).collect::<Vec<_>>(), vec![id]);
    assert!(took < Duration::from_secs(10), "found after the reconnect, {took:?} into its wait");

    let claim = waiting(30);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stopped_at = Instant::now();
    let killed = std::process::Command::new("kill").args(["-TERM", &w.op.pid().to_string()]).status().expect("kill");
    assert!(killed.success());
    let (answer, _) = claim.await.expect("task");
    let answer = answer.expect("a clean answer, not a cut connection");
    assert!(answer.jobs.is_empty());
    assert!(stopped_at.elapsed() < Duration::from_secs(3), "the wait ended {:?} after SIGTERM", stopped_at.elapsed());
    let deadline = Instant::now() + Duration::from_secs(10);
    while w.op.exited().is_none() {
        assert!(Instant::now() < deadline, "still running 10 s after SIGTERM:\n{}", w.op.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// SPEC §10/§11: `kill -9` of the replica that Runs long-poll on and an agent watches:
/// each client resumes on the other replica (the Runs' session tokens and the watch's
/// `Last-Event-ID` are good there), every job queued before, during and after the kill
/// is done exactly once, and none reaches a Run twice — a job whose claim the dead
/// replica committed but never answered comes back after its deadline.
#[tokio::test]
async fn a_replica_killed_while_claims_and_a_watch_wait_on_it_loses_nothing() {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let mut w = World::start("jobs-kill-waiting", &[]).await;
    let env = [("REDIS_URL", w.redis.url.as_str()), ("PRISM_REDIS_PREFIX", w.prefix.as_str())];
    let other = support::Operator::start(w.cp, &w.db.url, &w.ns, &env).await;
    let p = Platform::new(&w).await;
    let survivor = Platform { base: other.base.clone(), ns: w.ns.clone(), token: p.token.clone() };
    let received = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut runs = Vec::new();
    for i in 0..4 {
        let mut run = started_run(&w, &format!("run-{i}"), &format!("srv-{i}")).await;
        let (received, stop, fallback) = (received.clone(), stop.clone(), other.base.clone());
        runs.push(tokio::spawn(async move {
            let mut moved = false;
            while !stop.load(Ordering::SeqCst) {
                match run.claim_waiting(1, 3).await {
                    Ok(claimed) => {
                        for job in claimed.jobs {
                            received.lock().expect("lock").push(job.id.to_string());
                            let done = json!({"outcome": "succeeded"});
                            if run.step(&job.id, "complete", Some(done.clone())).await.is_err() {
                                run.set_base(&fallback);
                                moved = true;
                                match run.step(&job.id, "complete", Some(done)).await {
                                    Ok(_) => {}
                                    // The dead replica committed the first try and was
                                    // killed before it answered: done already.
                                    Err(ClientError::Refused { code, .. }) if code == "job_finished" => {}
                                    Err(e) => panic!("complete on the survivor: {e}"),
                                }
                            }
                        }
                    }
                    // The replica is gone: the same session, on the other one.
                    Err(_) if !moved => {
                        run.set_base(&fallback);
                        moved = true;
                    }
                    Err(e) => panic!("a claim on the survivor failed: {e}"),
                }
                let _ = run.heartbeat().await;
            }
            moved
        }));
    }
    // An agent watches a project on the replica about to die.
    let agent = support::agent_token(w.cp, &w.ns, "agent", &["create", "delete", "get", "list"]).await;
    support::register(&w.op, &agent, &w.ns, "p-kill", "s-1", "claude_code").await;
    let watch_url = |base: &str| format!("{base}/api/v1/controller/p-kill/watch?namespace={}", w.ns);
    let mut stream = http().get(watch_url(&w.op.base)).bearer_auth(&agent).send().await.expect("watch");
    let (first_id, _) = next_routing(&mut stream).await.expect("the snapshot");
    tokio::time::sleep(Duration::from_millis(800)).await;

    let timeout = json!({"timeout_seconds": 4});
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(id_of(&survivor.queued(&format!("srv-{i}"), "config", timeout.clone()).await));
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    for i in 0..4 {
        ids.push(id_of(&survivor.queued(&format!("srv-{i}"), "config", timeout.clone()).await));
    }
    w.op.kill().await;
    for i in 0..4 {
        ids.push(id_of(&survivor.queued(&format!("srv-{i}"), "config", timeout.clone()).await));
    }

    // The watch: its stream is cut; resumed on the survivor with its last id, it is told
    // of the next change (a second session joining) and of nothing it had seen.
    assert!(next_routing(&mut stream).await.is_none(), "the dead replica's stream ends");
    let resumed = http()
        .get(watch_url(&other.base))
        .bearer_auth(&agent)
        .header("Last-Event-ID", &first_id)
        .send()
        .await
        .expect("watch again");
    let mut resumed = resumed;
    support::register(&other, &agent, &w.ns, "p-kill", "s-2", "codex").await;
    let (next_id, table) = next_routing(&mut resumed).await.expect("the change, on the survivor");
    assert_ne!(next_id, first_id, "resumed after the event it had: no snapshot again");
    assert_eq!(table["peers"].as_array().map(Vec::len), Some(1), "{table:#}");

    let all: HashSet<String> = ids.iter().cloned().collect();
    eventually(60, "every job done", || async {
        let done = received.lock().expect("lock").iter().cloned().collect::<HashSet<_>>();
        (done == all).then_some(())
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for run in runs {
        assert!(run.await.expect("run task"), "every Run moved to the survivor");
    }
    let got = received.lock().expect("lock").clone();
    assert_eq!(got.len(), all.len(), "no job reached a Run twice: {got:?}");
    let mut again = 0;
    for id in &ids {
        let job = survivor.job(id).await;
        assert_eq!(job["state"], "succeeded", "{job:#}");
        assert!(job["attempts"].as_i64().is_some_and(|a| (1..=2).contains(&a)), "{job:#}");
        again += usize::from(job["attempts"] == 2);
    }
    println!("{} jobs done once each; {again} after a claim the killed replica never answered", ids.len());
}

/// The next `routing` event of a watch: its id and the table.
async fn next_routing(stream: &mut reqwest::Response) -> Option<(String, Value)> {
    let (id, table) = support::next_sse(stream, "routing").await?;
    Some((id?, table))
}

/// #43.1: a Run session's long-poll claims are held streams too: at most
/// PRISM_MAX_STREAMS_PER_IDENTITY wait at once (429 `too_many_streams` beyond), while a
/// claim that does not wait is answered as always.
#[tokio::test]
async fn a_run_session_holds_a_bounded_number_of_waiting_claims() {
    let w = World::start("jobs-held-claims", &[("PRISM_MAX_STREAMS_PER_IDENTITY", "2")]).await;
    let p = Platform::new(&w).await;
    let run = std::sync::Arc::new(started_run(&w, "run-a", "srv-a").await);
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let run = run.clone();
            tokio::spawn(async move { run.claim_waiting(1, 30).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let refused = match tokio::time::timeout(Duration::from_secs(5), run.claim_waiting(1, 30)).await {
        Ok(Err(ClientError::Refused { status: 429, code, retry_after, .. })) => (code, retry_after),
        other => panic!("a third waiting claim: {other:?}"),
    };
    assert_eq!(refused.0, "too_many_streams");
    assert!(refused.1.is_some(), "with Retry-After");
    assert!(run.claim(1).await.expect("a claim that does not wait").is_empty());
    // Work arrives: the two waiting claims share it and end, giving their places back.
    for _ in 0..2 {
        p.queued("srv-a", "config", json!({})).await;
    }
    let mut got = 0;
    for claim in waiting {
        got += claim.await.expect("task").expect("claim").jobs.len();
    }
    assert!(got >= 1, "the waiting claims were answered with the work");
    let again = tokio::time::timeout(Duration::from_secs(10), run.claim_waiting(1, 1)).await;
    assert!(again.expect("answered").is_ok(), "a place is free again");
}

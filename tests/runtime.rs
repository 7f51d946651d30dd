//! The runtime session registry end to end: real kube-apiserver, Postgres and Redis (a
//! private redis-server per test, so it can be stopped and flushed), the operator
//! process, and a Run speaking the wire format of SPEC §8.

use prism_testkit as support;

use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;

use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use prism_operator::crd::{RunCredential, RunPhase, RunSession, RunSessionSpec, UnavailableReason};
use prism_operator::run_client::{self, RunClient};
use prism_operator::run_registry::jobs::JobState;
use serde_json::{Value, json};
use support::{Operator, TestDb, eventually, phase};

type World = support::runs::RunWorld;

async fn world(hint: &str, env: &[(&str, &str)]) -> World {
    World::start(hint, env).await
}

/// A platform that enqueues jobs for the world's Runs.
trait Dispatcher {
    async fn enqueue_token(&self) -> String;
    async fn enqueue(&self, token: &str, server: &str, kind: &str) -> reqwest::Response;
}

impl Dispatcher for World {
    async fn enqueue_token(&self) -> String {
        support::sa_token(self.cp, &self.ns, "dispatcher", "runsessions", &["get", "update"]).await
    }

    async fn enqueue(&self, token: &str, server: &str, kind: &str) -> reqwest::Response {
        support::http()
            .post(self.op.url("/api/v1/runtime/jobs"))
            .bearer_auth(token)
            .json(&json!({"server_instance_id": server, "component_kind": "run", "kind": kind, "payload": {"n": 1}}))
            .send()
            .await
            .expect("enqueue")
    }
}

fn code(e: &run_client::ClientError) -> &str {
    e.code().unwrap_or("not a refusal")
}

#[tokio::test]
async fn hello_heartbeat_supersede_and_online_status() {
    let w = world("hello", &[]).await;
    let mut run = w.run("srv-1-run", "srv-1", None).await;
    phase(&w.api, "srv-1-run", RunPhase::Pending, 10).await;

    let granted = run.hello().await.expect("valid hello");
    assert_eq!(granted.lease_ttl_seconds, 30);
    assert_eq!(granted.heartbeat_interval_seconds, 8, "a third of the lease, below the idle cut");
    let online = phase(&w.api, "srv-1-run", RunPhase::Online, 5).await;
    let st = online.status.expect("status");
    assert!(st.online);
    assert_eq!(st.version.as_deref(), Some(env!("CARGO_PKG_VERSION")));
    assert_eq!(st.capabilities, ["lifecycle", "config", "file", "log", "protected_request"]);
    assert_eq!(st.capacity.get("slots"), Some(&4));
    let out = w.cp.kubectl_ok(&["get", "rsess", "-n", &w.ns, "--no-headers"]).await;
    assert!(out.contains("srv-1") && out.contains("Online"), "{out}");

    // The pass this is (scripts/test runs the suite on a standalone Redis and on a cluster).
    let mode = if support::redis_cluster_mode() { "\"redis\":\"cluster redis://" } else { "\"redis\":\"redis://" };
    assert!(w.op.logs().contains(mode), "{mode} in the operator's log:\n{}", w.op.logs());
    support::metric_line(&w.op, "prism_runtime_runs_online 1").await;
    support::metric_line(&w.op, "prism_dependency_up{dependency=\"redis\"} 1").await;

    // Heartbeat renews the lease and stores the snapshot; the same snapshot again keeps
    // it (the script writes only what changed), and the last heartbeat is the renewal's.
    run.capacity.insert("slots".into(), 2);
    let beat = run.heartbeat().await.expect("heartbeat");
    assert!(beat["lease_ttl_seconds"].as_u64().is_some_and(|s| s > 25), "{beat}");
    let token = w.enqueue_token().await;
    let url = w.op.url("/api/v1/runtime/servers/srv-1/status");
    let view = support::get_json(&url, &token).await;
    assert_eq!(view["components"][0]["capacity"]["slots"], 2, "{view}");
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    run.heartbeat().await.expect("the same snapshot again");
    let view = support::get_json(&url, &token).await;
    let c = &view["components"][0];
    assert_eq!((&c["capacity"]["slots"], &c["capabilities"][0]), (&json!(2), &json!("lifecycle")), "{view}");
    let beat_at: chrono::DateTime<chrono::Utc> =
        c["last_heartbeat"].as_str().and_then(|t| t.parse().ok()).expect("time");
    let ago = (chrono::Utc::now() - beat_at).num_milliseconds();
    assert!((-1000..2000).contains(&ago), "the last heartbeat was {ago} ms ago, not the renewal's: {view}");

    // A second hello rotates the token: the first stops authorizing at once.
    let first = run.token.clone().expect("token");
    run.hello().await.expect("second hello");
    let mut old = RunClient::new(&w.op.base, "srv-1", "run", 1, SigningKey::from_bytes(&[1; 32]));
    old.token = Some(first);
    assert_eq!(code(&old.heartbeat().await.expect_err("superseded")), "session_superseded");
    assert_eq!(code(&old.claim(1).await.expect_err("superseded")), "session_superseded");
    run.heartbeat().await.expect("the new token works");
    assert_eq!(
        code(
            &RunClient::new(&w.op.base, "srv-1", "run", 1, SigningKey::from_bytes(&[1; 32]))
                .heartbeat()
                .await
                .expect_err("no token")
        ),
        "not a refusal"
    );
}

#[tokio::test]
async fn every_failure_of_proof_is_401_with_its_code_and_changes_nothing() {
    let w = world("proof", &[]).await;
    let run = w.run("srv-2-run", "srv-2", None).await;
    let now = chrono::Utc::now().timestamp();
    let post = |body: Value| {
        let run = &run;
        async move { run.post_hello(&body).await.expect_err("refused") }
    };
    // Unknown identity.
    let stranger = RunClient::new(&w.op.base, "srv-unknown", "run", 1, SigningKey::from_bytes(&[2; 32]));
    assert_eq!(
        code(&stranger.post_hello(&stranger.hello_body(now, "nonce-unknown-0001")).await.expect_err("unknown")),
        "unknown_identity"
    );
    // Stale generation (signed correctly, but for generation 2 while 1 is current).
    let mut body = run.hello_body(now, "nonce-stale-000001");
    body["key_generation"] = json!(2);
    assert_eq!(code(&post(body).await), "stale_generation");
    // Bad signature: another key, or a changed field.
    let impostor = RunClient::new(&w.op.base, "srv-2", "run", 1, SigningKey::from_bytes(&[3; 32]));
    assert_eq!(code(&post(impostor.hello_body(now, "nonce-impostor-001")).await), "bad_signature");
    let mut body = run.hello_body(now, "nonce-tampered-001");
    body["timestamp"] = json!(now + 1);
    assert_eq!(code(&post(body).await), "bad_signature");
    // Clock skew beyond ±300 s.
    assert_eq!(code(&post(run.hello_body(now - 301, "nonce-skew-0000001")).await), "clock_skew");
    // Replayed nonce: the same signed hello twice.
    let body = run.hello_body(now, "nonce-replay-00001");
    run.post_hello(&body).await.expect("first use");
    let e = post(body).await;
    assert_eq!(code(&e), "replayed_nonce");
    let run_client::ClientError::Refused { status, message, .. } = &e else {
        panic!("a replayed nonce is refused by the operator, got {e:?}");
    };
    assert_eq!(*status, 401);
    assert_eq!(message, "hello refused", "says nothing more");
    // Malformed input is a 4xx with a code, not a proof failure.
    let mut body = run.hello_body(now, "short");
    assert_eq!(code(&post(body.clone()).await), "invalid_request");
    body["nonce"] = json!("nonce-shape-000001");
    body["capacity"] = json!({"slots": -1});
    assert_eq!(code(&post(body).await), "invalid_request");
}

#[tokio::test]
async fn a_silent_run_goes_offline_within_the_lease_and_hello_again_works() {
    let w = world("offline", &[]).await;
    let mut run = w.run("srv-3-run", "srv-3", Some(5)).await;
    let granted = run.hello().await.expect("hello");
    assert_eq!(granted.lease_ttl_seconds, 5);
    phase(&w.api, "srv-3-run", RunPhase::Online, 5).await;
    let last = Instant::now();
    let off = phase(&w.api, "srv-3-run", RunPhase::Offline, 15).await;
    let took = last.elapsed();
    assert!(took <= Duration::from_secs(8), "offline after {took:?}; lease 5 s + 2 s allowed (+1 s test polling)");
    let st = off.status.expect("status");
    assert_eq!(st.unavailable_reason, Some(UnavailableReason::LeaseExpired));
    assert!(!st.online);
    assert_eq!(code(&run.heartbeat().await.expect_err("expired")), "session_expired");
    run.hello().await.expect("hello again");
    phase(&w.api, "srv-3-run", RunPhase::Online, 5).await;
}

/// `prism_runtime_runs_online` of the operator's /metrics, if it answers.
async fn runs_online(w: &World) -> Option<i64> {
    let text = support::http().get(w.op.url("/metrics")).send().await.ok()?.text().await.ok()?;
    text.lines().find_map(|l| l.strip_prefix("prism_runtime_runs_online ")?.parse().ok())
}

/// A scrape counts live sessions in one pipeline per Redis master: Runs whose keys lie
/// on every master of a cluster are each counted once, and a lease that expired is not.
#[tokio::test]
async fn runs_online_counts_each_live_session_once_on_every_master() {
    let w = world("online", &[]).await;
    let mut runs = Vec::new();
    for i in 0..12 {
        // Two leases of 5 s (the shortest allowed), to watch them end.
        let lease = (i < 2).then_some(5);
        runs.push(w.run(&format!("many-{i}-run"), &format!("many-{i}"), lease).await);
    }
    // The gauge is a snapshot (refreshed every 10 s): wait for each count.
    let count = |n: i64| {
        let w = &w;
        async move {
            eventually(support::METRICS_LAG_SECS, &format!("{n} runs online"), || async {
                runs_online(w).await.filter(|m| *m == n)
            })
            .await
        }
    };
    count(0).await;
    // The slots of many-0 .. many-7 (13447 7894 12292 6741 15745 6096 14594 4947) lie on
    // all three masters of the private cluster (PRISM_TEST_REDIS=cluster), the two that
    // expire on two of them.
    for run in runs.iter_mut().take(8) {
        run.hello().await.expect("hello");
    }
    // Counted while the two short leases still hold (5 s, the gauge every 10 s: it may
    // skip the 8 and show the 6 at once).
    let seen = eventually(support::METRICS_LAG_SECS, "8 or 6 runs online", || async {
        runs_online(&w).await.filter(|n| *n == 8 || *n == 6)
    })
    .await;
    assert!(seen == 8 || seen == 6);
    count(6).await;
}

#[tokio::test]
async fn jobs_go_to_their_own_target_and_cross_target_steps_are_refused() {
    let w = world("jobs", &[("PRISM_JOB_VISIBILITY_SECONDS", "2")]).await;
    let mut a = w.run("srv-a-run", "srv-a", None).await;
    let mut b = w.run("srv-b-run", "srv-b", None).await;
    a.hello().await.expect("hello a");
    b.hello().await.expect("hello b");

    // Enqueue needs a Kubernetes identity allowed to update that RunSession.
    let reader = support::sa_token(w.cp, &w.ns, "reader", "runsessions", &["get"]).await;
    assert_eq!(w.enqueue(&reader, "srv-a", "config").await.status(), 403);
    let token = w.enqueue_token().await;
    let r = w.enqueue(&token, "srv-a", "reboot").await;
    assert_eq!(r.status(), 422, "unknown job kind");
    // An address nobody holds: without a namespace the same 403 as a refusal (nothing
    // is told of addresses); with the caller's namespace, where it has rights, a 404.
    let r = w.enqueue(&token, "srv-nobody", "config").await;
    assert_eq!(r.status(), 403);
    let r = support::http()
        .post(w.op.url("/api/v1/runtime/jobs"))
        .bearer_auth(&token)
        .json(
            &json!({"namespace": w.ns, "server_instance_id": "srv-nobody", "component_kind": "run", "kind": "config"}),
        )
        .send()
        .await
        .expect("enqueue");
    assert_eq!(r.status(), 404);
    let mut ids = vec![];
    for kind in ["config", "lifecycle", "log"] {
        let r = w.enqueue(&token, "srv-a", kind).await;
        assert_eq!(r.status(), 201);
        let job: Value = r.json().await.expect("job");
        assert_eq!(job["state"], "queued");
        ids.push(job["id"].as_str().expect("id").to_string());
    }

    // The other target's Run gets nothing; the right Run gets the oldest first.
    assert!(b.claim(10).await.expect("claim b").is_empty());
    let got = a.claim(2).await.expect("claim a");
    assert_eq!(got.iter().map(|j| j.id.to_string()).collect::<Vec<_>>(), ids[..2]);
    assert!(got.iter().all(|j| j.state == JobState::Claimed && j.attempts == 1));
    let job = got[0].id;

    // Cross-target steps: 403 cross_target, job unchanged.
    for (action, body) in [
        ("ack", None),
        ("progress", Some(json!({"progress": {"pct": 50}}))),
        ("complete", Some(json!({"outcome": "succeeded", "result": {}}))),
    ] {
        let e = b.step(&job, action, body).await.expect_err("cross target");
        assert_eq!(code(&e), "cross_target", "{action}");
    }
    let state: (String, Option<Value>) = sqlx::query_as("SELECT state, progress FROM runtime_jobs WHERE id = $1")
        .bind(job)
        .fetch_one(&w.db.pool)
        .await
        .expect("job row");
    assert_eq!(state, ("claimed".to_string(), None));

    // The right Run acks, reports progress, completes.
    assert_eq!(a.step(&job, "ack", None).await.expect("ack").state, JobState::Running);
    let p = a.step(&job, "progress", Some(json!({"progress": {"pct": 50}}))).await.expect("progress");
    assert_eq!(p.progress, Some(json!({"pct": 50})));
    // A Run that says hello again (new session) may finish what it claimed before.
    a.hello().await.expect("hello again");
    let done = a
        .step(&job, "complete", Some(json!({"outcome": "succeeded", "result": {"ok": true}})))
        .await
        .expect("complete");
    assert_eq!((done.state.as_str(), done.result), ("succeeded", Some(json!({"ok": true}))));
    assert_eq!(
        code(&a.step(&job, "complete", Some(json!({"outcome": "failed"}))).await.expect_err("twice")),
        "job_finished"
    );

    // The second claimed job is never progressed: its visibility timeout puts it back.
    let silent = got[1].id;
    eventually(10, "silent job requeued", || async {
        let s: String = sqlx::query_scalar("SELECT state FROM runtime_jobs WHERE id = $1")
            .bind(silent)
            .fetch_one(&w.db.pool)
            .await
            .ok()?;
        (s == "queued").then_some(())
    })
    .await;
    // Eligible again after its backoff (2 s ± 20 % after a first attempt, SPEC §5.1).
    let again = eventually(10, "claimed again after the backoff", || async {
        let again = a.claim(5).await.ok()?;
        again.iter().any(|j| j.id == silent).then_some(again)
    })
    .await;
    assert_eq!(again.iter().find(|j| j.id == silent).map(|j| j.attempts), Some(2));
}

#[tokio::test]
async fn redis_down_flushed_and_operator_restarted() {
    let mut w = world("redis", &[]).await;
    let mut run = w.run("srv-r-run", "srv-r", None).await;
    run.hello().await.expect("hello");
    phase(&w.api, "srv-r-run", RunPhase::Online, 5).await;
    let token = w.enqueue_token().await;
    assert_eq!(w.enqueue(&token, "srv-r", "config").await.status(), 201);

    // Operator restarted while the session is live: the token keeps working, nothing is
    // cleaned at start; a second operator on the same Redis/Postgres sees the session.
    let env = [("REDIS_URL", w.redis.url.clone()), ("PRISM_REDIS_PREFIX", w.prefix.clone())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    drop(std::mem::replace(&mut w.op, Operator::start(w.cp, &w.db.url, &w.ns, &env).await));
    let mut same = RunClient::new(&w.op.base, "srv-r", "run", 1, SigningKey::from_bytes(&[0; 32]));
    same.token = run.token.clone();
    same.heartbeat().await.expect("token survives an operator restart");
    let other_ns = support::namespace(&w.client, "second").await;
    let second = Operator::start(w.cp, &w.db.url, &other_ns, &env).await;
    let mut via_second = RunClient::new(&second.base, "srv-r", "run", 1, SigningKey::from_bytes(&[0; 32]));
    via_second.token = run.token.clone();
    via_second.heartbeat().await.expect("a second operator sees the same session");
    drop(second);
    run.set_base(&w.op.base);

    // Redis stopped: readiness says so, Runs get 503 runtime_registry_unavailable, no job
    // is assigned; the RunSession shows Unavailable.
    let identity_row = || async {
        let row: String =
            // Less the hello high-water mark, which every hello (not a reconcile) moves.
            sqlx::query_scalar("SELECT (to_jsonb(i) - 'hello_mark' - 'hello_nonces')::text FROM run_identities i WHERE server_instance_id = 'srv-r'")
                .fetch_one(&w.db.pool)
                .await
                .expect("identity row");
        row
    };
    let identity_before = identity_row().await;
    w.redis.down().await;
    let http = support::http();
    // Readiness is probed every 2 s: within a few seconds it says so.
    eventually(5, "/readyz reports the registry unavailable", || async {
        let ready: Value = http.get(w.op.url("/readyz")).send().await.ok()?.json().await.ok()?;
        (ready["checks"]["runtime_registry"]["status"] == "unavailable").then_some(())
    })
    .await;
    for e in [
        run.heartbeat().await.expect_err("503"),
        run.claim(1).await.map(|_| ()).expect_err("503"),
        run.hello().await.map(|_| ()).expect_err("503"),
    ] {
        assert_eq!(code(&e), "runtime_registry_unavailable", "{e:?}");
    }
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM runtime_jobs WHERE state = 'queued'")
        .fetch_one(&w.db.pool)
        .await
        .expect("count");
    assert_eq!(queued, 1, "no job assigned while Redis is down");
    let un = phase(&w.api, "srv-r-run", RunPhase::Unavailable, 15).await;
    assert_eq!(un.status.and_then(|s| s.unavailable_reason), Some(UnavailableReason::RedisUnavailable));

    // Redis back, but empty (it lost its data): Runs are offline until they say hello;
    // the RunSession and the job are unchanged.
    w.redis.up().await;
    w.redis.flushall().await;
    assert_eq!(code(&run.heartbeat().await.expect_err("session gone")), "session_expired");
    phase(&w.api, "srv-r-run", RunPhase::Offline, 15).await;
    assert!(w.api.get_opt("srv-r-run").await.expect("get").is_some());
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM runtime_jobs WHERE state = 'queued'")
        .fetch_one(&w.db.pool)
        .await
        .expect("count");
    assert_eq!(queued, 1);
    run.hello().await.expect("hello again");
    let back = phase(&w.api, "srv-r-run", RunPhase::Online, 5).await;
    // The status write removes what no longer holds (a merge patch names it null).
    assert_eq!(back.status.and_then(|s| s.unavailable_reason), None, "the outage's reason is gone");
    assert_eq!(run.claim(5).await.expect("claim").len(), 1);
    // Redis going and coming back reconciled the RunSession twice; its durable identity
    // row was not rewritten (not even its updated_at).
    assert_eq!(identity_row().await, identity_before);
}

#[tokio::test]
async fn a_runsession_recreated_over_a_surviving_database_takes_its_identity_back() {
    let w = world("reinc", &[]).await;
    // An earlier incarnation of this namespace's srv-o-run: its row live, its object gone
    // without its finalizer running (a control plane rebuilt or restored over this
    // database gives objects new uids), its key generation ahead of the new one's.
    let old = uuid::Uuid::new_v4();
    let (_, old_public) = run_client::new_key().expect("key");
    sqlx::query(
        "INSERT INTO run_identities (id, namespace, name, server_instance_id, component_kind, public_key, key_generation)
         VALUES ($1, $2, 'srv-o-run', 'srv-o', 'run', $3, 11)",
    )
    .bind(old)
    .bind(&w.ns)
    .bind(&old_public)
    .execute(&w.db.pool)
    .await
    .expect("the earlier incarnation's row");

    // The resource made again, with a new key at generation 1: its Run gets in.
    let mut run = w.run("srv-o-run", "srv-o", None).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match run.hello().await {
            Ok(_) => break,
            Err(e) => assert!(Instant::now() < deadline, "the re-created RunSession's Run got no session: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    phase(&w.api, "srv-o-run", RunPhase::Online, 5).await;
    let revoked: bool = sqlx::query_scalar("SELECT revoked_at IS NOT NULL FROM run_identities WHERE id = $1")
        .bind(old)
        .fetch_one(&w.db.pool)
        .await
        .expect("old row");
    assert!(revoked, "the earlier incarnation's identity still authenticates");
    assert!(w.op.logs().contains("taken over from an earlier resource of the same name"), "no log line says why");
}

#[tokio::test]
async fn identity_lifecycle_duplicates_rotation_deletion_and_safe_status() {
    let w = world("ident", &[("RUST_LOG", "debug")]).await;
    let mut run = w.run("srv-i-run", "srv-i", None).await;
    run.hello().await.expect("hello");
    phase(&w.api, "srv-i-run", RunPhase::Online, 5).await;

    // A second resource claiming the same identity is not used.
    let (dup_key, other_key) = run_client::new_key().expect("key");
    let dup = RunSession::new(
        "srv-i-dup",
        RunSessionSpec {
            server_instance_id: "srv-i".into(),
            component_kind: "run".into(),
            credential: RunCredential { public_key: other_key, generation: 1 },
            lease_seconds: None,
            paused: false,
        },
    );
    w.api.create(&PostParams::default(), &dup).await.expect("create duplicate");
    let d = eventually(10, "DuplicateIdentity", || async {
        let r = w.api.get_opt("srv-i-dup").await.ok().flatten()?;
        r.status
            .as_ref()?
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "False" && c.reason == "DuplicateIdentity")
            .then_some(r)
    })
    .await;
    assert_eq!(d.status.map(|s| s.phase), Some(RunPhase::Pending));

    // The owner sees a safe projection over HTTP; nobody else does.
    let token = w.enqueue_token().await;
    let http = support::http();
    let r =
        http.get(w.op.url("/api/v1/runtime/servers/srv-i/status")).bearer_auth(&token).send().await.expect("status");
    assert_eq!(r.status(), 200);
    let body = r.text().await.expect("text");
    let status: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(status["components"][0]["phase"], "Online");
    assert_eq!(status["components"][0]["capacity"]["slots"], 4);
    let nobody = support::sa_token(w.cp, &w.ns, "nobody", "configmaps", &["get"]).await;
    let r =
        http.get(w.op.url("/api/v1/runtime/servers/srv-i/status")).bearer_auth(&nobody).send().await.expect("status");
    assert_eq!(r.status(), 403);

    // Secrets never reach a response, the status, an Event or a log line.
    let session_token = run.token.clone().expect("token");
    let token_hash = prism_operator::run_registry::service::token_hash(&session_token);
    let obj = serde_json::to_string(&w.api.get("srv-i-run").await.expect("get")).expect("json");
    let events = w.cp.kubectl_ok(&["get", "events", "-n", &w.ns, "-o", "json"]).await;
    let secret_part = session_token.rsplit('.').next().expect("secret part").to_string();
    for (what, text) in [("response", &body), ("resource", &obj), ("events", &events), ("logs", &w.op.logs())] {
        for secret in [secret_part.as_str(), token_hash.as_str(), w.prefix.as_str(), "run:{srv-i/run}"] {
            assert!(!text.contains(secret), "{what} contains {secret}");
        }
    }
    assert!(w.op.logs().contains("HTTP API serving"), "the log was captured");

    // Raising the generation revokes the session at once; the old key is stale.
    let (new_key, new_public) = run_client::new_key().expect("key");
    let patch = json!({"spec": {"credential": {"publicKey": new_public, "generation": 2}}});
    w.api.patch("srv-i-run", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("rotate");
    let off = phase(&w.api, "srv-i-run", RunPhase::Offline, 10).await;
    assert_eq!(off.status.and_then(|s| s.unavailable_reason), Some(UnavailableReason::CredentialRotated));
    assert_eq!(code(&run.heartbeat().await.expect_err("revoked")), "session_expired");
    assert_eq!(code(&run.hello().await.expect_err("old key")), "stale_generation");
    // The owner's view of an offline component keeps the last known facts and the reason.
    let view = support::get_json(&w.op.url("/api/v1/runtime/servers/srv-i/status"), &token).await;
    let c = &view["components"][0];
    assert_eq!((c["phase"].as_str(), c["online"].as_bool()), (Some("Offline"), Some(false)), "{view}");
    assert_eq!(c["unavailable_reason"], "credential_rotated", "{view}");
    assert_eq!(c["version"], env!("CARGO_PKG_VERSION"), "{view}");
    assert!(c["last_heartbeat"].is_string(), "{view}");
    let mut rotated = RunClient::new(&w.op.base, "srv-i", "run", 2, new_key);
    rotated.hello().await.expect("new key works");
    phase(&w.api, "srv-i-run", RunPhase::Online, 5).await;

    // Deleting the resource revokes the identity and cancels the jobs it left (nobody of
    // its namespace is left to run them; SPEC §5); the duplicate then takes the identity
    // over, without those jobs.
    assert_eq!(w.enqueue(&token, "srv-i", "file").await.status(), 201);
    w.api.delete("srv-i-run", &DeleteParams::default()).await.expect("delete");
    eventually(10, "resource gone", || async { w.api.get_opt("srv-i-run").await.ok()?.is_none().then_some(()) }).await;
    assert_eq!(code(&rotated.heartbeat().await.expect_err("revoked")), "session_expired");
    let jobs: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT state, cancel_reason FROM runtime_jobs WHERE server_instance_id = 'srv-i'")
            .fetch_all(&w.db.pool)
            .await
            .expect("jobs");
    assert_eq!(jobs, [("cancelled".to_string(), Some("identity_deleted".to_string()))]);
    let taken = eventually(40, "duplicate takes over", || async {
        let r = w.api.get_opt("srv-i-dup").await.ok().flatten()?;
        r.status.as_ref()?.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True").then_some(r)
    })
    .await;
    // It owns the identity now, but no Run has said hello with its key yet.
    let st = taken.status.expect("status");
    assert_eq!((st.phase, st.online, st.unavailable_reason), (RunPhase::Pending, false, None), "{st:?}");
    assert_eq!(st.observed_generation, taken.metadata.generation);
    let online = st.conditions.iter().find(|c| c.type_ == "Online").expect("Online condition");
    assert_eq!((online.status.as_str(), online.reason.as_str()), ("False", "NeverConnected"), "{online:?}");
    // Its key is the identity's key now: its Run says hello; the cancelled job is not
    // handed out, a new one is.
    let mut dup_run = RunClient::new(&w.op.base, "srv-i", "run", 1, dup_key);
    dup_run.hello().await.expect("the duplicate's key is accepted");
    phase(&w.api, "srv-i-dup", RunPhase::Online, 5).await;
    assert!(dup_run.claim(5).await.expect("claim").is_empty(), "the deleted identity's jobs stay cancelled");
    assert_eq!(w.enqueue(&token, "srv-i", "log").await.status(), 201);
    let jobs = dup_run.claim(5).await.expect("claim");
    assert_eq!(jobs.iter().map(|j| j.kind.as_str()).collect::<Vec<_>>(), ["log"]);
}

/// Every live Run's reconcile mirrors its identity, once a lease: an unchanged one must
/// not even lock its row (a lock is a WAL record and a commit flush: the scale bench
/// counted ~400 a second at 10,000 Runs). A changed one is written, and a rotation told.
#[tokio::test]
async fn mirroring_an_unchanged_identity_locks_nothing() {
    use prism_operator::run_registry::identity::{IdentitySpec, IdentityStore, Mirror};
    let db = TestDb::new().await;
    let store = IdentityStore::new(db.pool.clone());
    let mut identity = IdentitySpec {
        id: uuid::Uuid::new_v4(),
        namespace: "ns".into(),
        name: "r".into(),
        server_instance_id: "srv".into(),
        component_kind: "run".into(),
        public_key: "A".repeat(43) + "=",
        key_generation: 1,
        lease_seconds: None,
        paused: false,
    };
    let xmax = || async {
        let x: String = sqlx::query_scalar("SELECT xmax::text FROM run_identities WHERE id = $1")
            .bind(identity.id)
            .fetch_one(&db.pool)
            .await
            .expect("row");
        x
    };
    let Mirror::Owned { rotated: false, epoch: first } = store.mirror(&identity).await.expect("insert") else {
        panic!("a new identity is owned, not rotated");
    };
    assert_eq!(xmax().await, "0");
    for _ in 0..3 {
        assert_eq!(store.mirror(&identity).await.expect("mirror"), Mirror::Owned { rotated: false, epoch: first });
    }
    assert_eq!(xmax().await, "0", "an unchanged identity was locked (or written)");
    identity.key_generation = 2;
    let Mirror::Owned { rotated: true, epoch: second } = store.mirror(&identity).await.expect("rotate") else {
        panic!("a new generation is a rotation");
    };
    assert!(second > first, "a rotation is a new epoch: {first} -> {second}");
    let generation: i64 = sqlx::query_scalar("SELECT key_generation FROM run_identities WHERE id = $1")
        .bind(identity.id)
        .fetch_one(&db.pool)
        .await
        .expect("row");
    assert_eq!(generation, 2);
    // spec.paused is mirrored (SPEC §5.1) and is no rotation: the same epoch, and what a
    // session of that epoch acts as says it.
    identity.paused = true;
    assert_eq!(store.mirror(&identity).await.expect("pause"), Mirror::Owned { rotated: false, epoch: second });
    let acting = store.current(&identity.address(), second).await.expect("current").expect("live");
    assert_eq!((acting.namespace.as_str(), acting.paused), ("ns", true));
    identity.paused = false;
    assert_eq!(store.mirror(&identity).await.expect("unpause"), Mirror::Owned { rotated: false, epoch: second });
    assert_eq!(store.current(&identity.address(), second).await.expect("current").map(|a| a.paused), Some(false));
}

/// How often an Event of `reason` was recorded on the named object (a repeat is a series).
async fn event_count(w: &World, name: &str, reason: &str) -> i32 {
    support::events_about(&w.client, &w.ns, name)
        .await
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .map(|e| e.series.map_or(1, |s| s.count))
        .sum()
}

/// Waits until an Event of `reason` was recorded on the named object; returns how often.
async fn event_seen(w: &World, name: &str, reason: &str) -> i32 {
    eventually(10, &format!("an Event {reason} on {name}"), || async {
        Some(event_count(w, name, reason).await).filter(|n| *n > 0)
    })
    .await
}

/// The `Draining` condition of a RunSession: (status, reason, message).
fn draining_condition(r: &RunSession) -> Option<(String, String, String)> {
    let c = r.status.as_ref()?.conditions.iter().find(|c| c.type_ == "Draining")?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Jobs of a server in `state`, from Postgres.
async fn jobs_in(w: &World, server: &str, state: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM runtime_jobs WHERE server_instance_id = $1 AND state = $2")
        .bind(server)
        .bind(state)
        .fetch_one(&w.db.pool)
        .await
        .expect("count jobs")
}

/// A job claimed, acked, progressed and completed: what a drained Run still may do.
async fn finish(run: &RunClient, job: &uuid::Uuid) {
    assert_eq!(run.step(job, "ack", None).await.expect("ack").state, JobState::Running);
    run.step(job, "progress", Some(json!({"progress": {"pct": 50}}))).await.expect("progress");
    let done = run.step(job, "complete", Some(json!({"outcome": "succeeded"}))).await.expect("complete");
    assert_eq!(done.state.as_str(), "succeeded");
}

/// SPEC §5.1, Drain, by the platform: `kubectl patch rsess … -p '{"spec":{"paused":true}}'`
/// cordons the Run within seconds: its claims hand out no new job although one is queued,
/// the job it holds finishes normally, status says `Draining` and who drained it, and an
/// Event says when it started; unpaused, it claims again and an Event says so.
#[tokio::test]
async fn a_paused_runsession_hands_out_no_new_job_and_resumes_when_unpaused() {
    let w = world("paused", &[]).await;
    let mut run = w.run("srv-p-run", "srv-p", None).await;
    run.hello().await.expect("hello");
    phase(&w.api, "srv-p-run", RunPhase::Online, 5).await;
    let token = w.enqueue_token().await;
    assert_eq!(w.enqueue(&token, "srv-p", "config").await.status(), 201);
    assert_eq!(w.enqueue(&token, "srv-p", "lifecycle").await.status(), 201);
    let held = run.claim(2).await.expect("claim before the cordon");
    assert_eq!(held.len(), 2);

    let pause = |paused: bool| {
        let api = w.api.clone();
        async move {
            let patch = json!({"spec": {"paused": paused}});
            api.patch("srv-p-run", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch spec.paused")
        }
    };
    let patched = pause(true).await;
    let started = Instant::now();
    let drained = phase(&w.api, "srv-p-run", RunPhase::Draining, 5).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(drained.status.as_ref().and_then(|s| s.observed_generation), patched.metadata.generation);
    let (status, reason, message) = draining_condition(&drained).expect("a Draining condition");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "Paused"));
    assert!(message.contains("cordoned"), "{message}");
    assert!(drained.status.as_ref().is_some_and(|s| s.online), "a drained Run is still online");
    let out = w.cp.kubectl_ok(&["get", "rsess", "srv-p-run", "-n", &w.ns, "--no-headers"]).await;
    assert!(out.contains("Draining"), "the PHASE column: {out}");
    let view = support::get_json(&w.op.url("/api/v1/runtime/servers/srv-p/status"), &token).await;
    assert_eq!(view["components"][0]["phase"], "Draining", "{view}");

    // No new job, although one is queued; the one it holds still takes every step.
    assert_eq!(w.enqueue(&token, "srv-p", "log").await.status(), 201);
    assert!(run.claim(5).await.expect("claim while paused").is_empty());
    assert_eq!(jobs_in(&w, "srv-p", "queued").await, 1);
    finish(&run, &held[0].id).await;
    // A cancel of a job it holds still reaches it, in the claim's answer, and it ends it.
    let url = w.op.url(&format!("/api/v1/runtime/jobs/{}/cancel?namespace={}", held[1].id, w.ns));
    let r = support::http().post(url).bearer_auth(&token).send().await.expect("cancel");
    assert_eq!(r.status(), 202, "a cancel requested of a job in flight");
    let answer = run.claim_and_cancels(5).await.expect("claim while paused");
    assert_eq!((answer.jobs.len(), answer.cancel), (0, vec![held[1].id]));
    let done = run.step(&held[1].id, "complete", Some(json!({"outcome": "cancelled"}))).await.expect("cancelled");
    assert_eq!(done.state.as_str(), "cancelled");
    run.heartbeat().await.expect("a paused Run heartbeats");
    assert_eq!(event_seen(&w, "srv-p-run", "Draining").await, 1);
    // A hello while paused (a reconcile) is no new drain: the Run stays cordoned.
    run.hello().await.expect("hello while paused");
    assert!(run.claim(5).await.expect("claim after a new hello").is_empty());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let still = phase(&w.api, "srv-p-run", RunPhase::Draining, 5).await;
    assert_eq!(draining_condition(&still).map(|c| c.1), Some("Paused".into()));
    assert_eq!(event_count(&w, "srv-p-run", "Draining").await, 1, "one Event per transition, not per reconcile");

    // Unpaused: claims hand out jobs again.
    pause(false).await;
    let resumed = phase(&w.api, "srv-p-run", RunPhase::Online, 5).await;
    let (status, reason, _) = draining_condition(&resumed).expect("the Draining condition");
    assert_eq!((status.as_str(), reason.as_str()), ("False", "NotDraining"));
    let got = run.claim(5).await.expect("claim after unpausing");
    assert_eq!(got.iter().map(|j| j.kind.as_str()).collect::<Vec<_>>(), ["log"]);
    assert_eq!(event_seen(&w, "srv-p-run", "Resumed").await, 1);
    let view = support::get_json(&w.op.url("/api/v1/runtime/servers/srv-p/status"), &token).await;
    assert_eq!(view["components"][0]["phase"], "Online", "{view}");
}

/// SPEC §5.1, Drain, by the Run: `"draining": true` in its heartbeat is its graceful
/// stop. Sticky until a heartbeat says `false`; a new hello starts not draining.
#[tokio::test]
async fn a_run_that_says_it_is_draining_gets_no_new_job_until_it_says_otherwise() {
    let w = world("draining", &[]).await;
    let mut run = w.run("srv-d-run", "srv-d", None).await;
    run.hello().await.expect("hello");
    phase(&w.api, "srv-d-run", RunPhase::Online, 5).await;
    let token = w.enqueue_token().await;
    assert_eq!(w.enqueue(&token, "srv-d", "config").await.status(), 201);
    let held = run.claim(1).await.expect("claim before draining");
    assert_eq!(held.len(), 1);

    run.draining = Some(true);
    run.heartbeat().await.expect("heartbeat: draining");
    let drained = phase(&w.api, "srv-d-run", RunPhase::Draining, 5).await;
    let (status, reason, _) = draining_condition(&drained).expect("a Draining condition");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "RunDraining"));
    assert_eq!(w.enqueue(&token, "srv-d", "log").await.status(), 201);
    assert!(run.claim(5).await.expect("claim while draining").is_empty());
    assert_eq!(jobs_in(&w, "srv-d", "queued").await, 1);
    finish(&run, &held[0].id).await;
    assert_eq!(event_seen(&w, "srv-d-run", "Draining").await, 1);
    let view = support::get_json(&w.op.url("/api/v1/runtime/servers/srv-d/status"), &token).await;
    assert_eq!(view["components"][0]["phase"], "Draining", "{view}");

    // A heartbeat that does not say keeps it draining (and changes no status).
    run.draining = None;
    run.heartbeat().await.expect("heartbeat without draining");
    let empty = support::http()
        .post(w.op.url("/api/v1/runtime/heartbeat"))
        .bearer_auth(run.token.as_deref().expect("token"))
        .send()
        .await
        .expect("heartbeat with no body");
    assert_eq!(empty.status(), 200);
    assert!(run.claim(5).await.expect("claim, still draining").is_empty());
    assert_eq!(
        phase(&w.api, "srv-d-run", RunPhase::Draining, 5).await.status.map(|s| s.phase),
        Some(RunPhase::Draining)
    );

    // `false` resumes it.
    run.draining = Some(false);
    run.heartbeat().await.expect("heartbeat: not draining");
    let resumed = phase(&w.api, "srv-d-run", RunPhase::Online, 5).await;
    assert_eq!(draining_condition(&resumed).map(|c| c.0), Some("False".into()));
    let got = run.claim(5).await.expect("claim after resuming");
    assert_eq!(got.iter().map(|j| j.kind.as_str()).collect::<Vec<_>>(), ["log"]);
    assert_eq!(event_seen(&w, "srv-d-run", "Resumed").await, 1);
    assert_eq!(event_count(&w, "srv-d-run", "Draining").await, 1);

    // Draining again, then a new hello: the new session is not draining.
    run.draining = Some(true);
    run.heartbeat().await.expect("heartbeat: draining again");
    phase(&w.api, "srv-d-run", RunPhase::Draining, 5).await;
    assert_eq!(w.enqueue(&token, "srv-d", "file").await.status(), 201);
    assert!(run.claim(5).await.expect("claim while draining again").is_empty());
    run.draining = None;
    run.hello().await.expect("a new hello");
    phase(&w.api, "srv-d-run", RunPhase::Online, 5).await;
    let got = run.claim(5).await.expect("claim in the new session");
    assert_eq!(got.iter().map(|j| j.kind.as_str()).collect::<Vec<_>>(), ["file"]);
}

/// A `draining` that is no boolean is a 4xx with a code and changes nothing: not the
/// drain, not the lease's snapshot.
#[tokio::test]
async fn a_draining_that_is_not_a_boolean_is_refused_and_changes_nothing() {
    let w = world("drainbad", &[]).await;
    let mut run = w.run("srv-x-run", "srv-x", None).await;
    run.hello().await.expect("hello");
    phase(&w.api, "srv-x-run", RunPhase::Online, 5).await;
    let token = w.enqueue_token().await;
    let beat = |body: Value| {
        let token = run.token.clone().expect("token");
        let url = w.op.url("/api/v1/runtime/heartbeat");
        async move { support::http().post(url).bearer_auth(token).json(&body).send().await.expect("heartbeat") }
    };
    for body in [
        json!({"draining": "yes"}),
        json!({"draining": 1}),
        json!({"draining": "true"}),
        json!({"draining": [true]}),
        json!({"capacity": {"slots": 1}, "draining": "yes"}),
    ] {
        let r = beat(body.clone()).await;
        assert_eq!(r.status(), 422, "{body}");
        let answer: Value = r.json().await.expect("error body");
        assert_eq!(answer["error"]["code"], "invalid_request", "{body}: {answer}");
    }
    // Not draining: the queued job is handed out; the snapshot is the hello's.
    assert_eq!(w.enqueue(&token, "srv-x", "config").await.status(), 201);
    assert_eq!(run.claim(5).await.expect("claim").len(), 1);
    let view = support::get_json(&w.op.url("/api/v1/runtime/servers/srv-x/status"), &token).await;
    assert_eq!(
        (view["components"][0]["phase"].as_str(), &view["components"][0]["capacity"]["slots"]),
        (Some("Online"), &json!(4)),
        "{view}"
    );

    // Draining: a bad value leaves it draining.
    run.draining = Some(true);
    run.heartbeat().await.expect("heartbeat: draining");
    phase(&w.api, "srv-x-run", RunPhase::Draining, 5).await;
    let r = beat(json!({"draining": "no"})).await;
    assert_eq!(r.status(), 422);
    assert_eq!(w.enqueue(&token, "srv-x", "log").await.status(), 201);
    assert!(run.claim(5).await.expect("claim while draining").is_empty());
    let still = phase(&w.api, "srv-x-run", RunPhase::Draining, 5).await;
    assert_eq!(draining_condition(&still).map(|c| c.1), Some("RunDraining".into()));
}

/// Every key of `address` ("srv/run") on any master of the world's Redis, as DUMP gives
/// it, with its time to live.
async fn redis_keys_of(w: &World, address: &str) -> Vec<(u16, String, Vec<u8>, i64)> {
    let mut saved = Vec::new();
    for port in w.redis.masters().await {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("redis url");
        let mut conn = client.get_multiplexed_async_connection().await.expect("connect to a master");
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(format!("*{address}*")).query_async(&mut conn).await.expect("keys");
        for key in keys {
            let data: Vec<u8> = redis::cmd("DUMP").arg(&key).query_async(&mut conn).await.expect("dump");
            let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await.expect("pttl");
            saved.push((port, key, data, ttl.max(0)));
        }
    }
    saved
}

/// SPEC §12, revocations are level-triggered: a session of a rotated key is refused at
/// its heartbeat even where Redis never heard of the rotation — the fence write failed,
/// or a failover or restore lost it — not only once the next reconcile's fence gets
/// through. (Before, such a session heartbeated on, and its RunSession showed Online.)
#[tokio::test]
async fn a_rotated_keys_session_is_refused_even_where_redis_lost_the_fence() {
    let w = world("fence", &[]).await;
    let mut run = w.run("srv-f-run", "srv-f", None).await;
    run.hello().await.expect("hello");
    run.heartbeat().await.expect("heartbeat");
    // What Redis holds of the address in the old key's epoch, to put back later.
    let before = redis_keys_of(&w, "srv-f/run").await;
    assert!(!before.is_empty(), "the session is in Redis");

    let (_, new_public) = run_client::new_key().expect("key");
    let patch = json!({"spec": {"credential": {"publicKey": new_public, "generation": 2}}});
    w.api.patch("srv-f-run", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("rotate");
    eventually(10, "the fence ended the old key's session", || async { run.heartbeat().await.err() }).await;

    // Redis forgets the fence: the old session and epoch are back, as after a failover to
    // a replica the fence never reached.
    for (port, key, data, ttl) in &before {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("redis url");
        let mut conn = client.get_multiplexed_async_connection().await.expect("connect to a master");
        let _: () = redis::cmd("RESTORE")
            .arg(key)
            .arg(*ttl)
            .arg(data.as_slice())
            .arg("REPLACE")
            .query_async(&mut conn)
            .await
            .expect("restore");
    }
    let refused = run.heartbeat().await.expect_err("a session of the rotated key");
    assert_eq!(code(&refused), "session_expired");
    assert_eq!(code(&run.heartbeat().await.expect_err("still")), "session_expired");
}

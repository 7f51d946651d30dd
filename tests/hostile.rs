//! The hostile tenant (SPEC §12, §4 rule 8, §6): every promise the operator makes, tried
//! by callers that do not cooperate — identities with only `create`, only `get`/`list`,
//! no rights at all, another tenant's rights — against the real services. Each test
//! plays one broken promise of issue #19 and asserts what a user would notice.
//!
//! Run also with the chart's RBAC and admission policy (PRISM_TEST_OPERATOR_RBAC=chart,
//! scripts/test does): then kubectl registrations carry the owner the policy stamps.

use prism_testkit as support;

use std::time::Duration;

use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use prism_operator::crd::{ControllerRegistration, RunPhase, RunSession};
use prism_operator::run_client::{self, RunClient};
use serde_json::{Value, json};
use support::{Operator, PrivateRedis, TestDb, control_plane, eventually};

const ALL: [&str; 4] = ["create", "delete", "get", "list"];

fn http() -> reqwest::Client {
    support::http()
}

async fn post(op: &Operator, token: &str, path: &str, body: Value) -> (u16, Value) {
    let r = http().post(op.url(path)).bearer_auth(token).json(&body).send().await.expect("POST");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn get(op: &Operator, token: &str, path: &str) -> (u16, Value) {
    let r = http().get(op.url(path)).bearer_auth(token).send().await.expect("GET");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn code(answer: &Value) -> &str {
    answer["error"]["code"].as_str().unwrap_or_default()
}

async fn register(op: &Operator, token: &str, ns: &str, project: &str, session: &str, surface: &str) -> (u16, Value) {
    let body = json!({"namespace": ns, "project_id": project, "session_id": session, "agent_surface": surface});
    post(op, token, "/api/v1/controller/register", body).await
}

/// Rows and resources of a namespace's registrations, for "nothing changed".
async fn registrations(db: &TestDb, api: &Api<ControllerRegistration>, ns: &str) -> (Vec<Value>, usize) {
    let rows: Vec<(Value,)> =
        sqlx::query_as("SELECT to_jsonb(r) FROM controller_registrations r WHERE namespace = $1 ORDER BY id")
            .bind(ns)
            .fetch_all(&db.pool)
            .await
            .expect("rows");
    let resources = api.list(&Default::default()).await.expect("list").items.len();
    (rows.into_iter().map(|(v,)| v).collect(), resources)
}

fn ready_reason(obj: &ControllerRegistration) -> Option<(String, String)> {
    let c = obj.status.as_ref()?.conditions.iter().find(|c| c.type_ == "Ready")?;
    Some((c.status.clone(), c.reason.clone()))
}

fn creg_yaml(name: &str, ns: &str, project: &str, session: &str) -> String {
    format!(
        "apiVersion: prism.ntecdev.ai/v1alpha1\nkind: ControllerRegistration\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {{projectId: {project}, sessionId: {session}, agentSurface: codex}}\n"
    )
}

/// #19.1: a registration created with kubectl by an identity with only `create` never
/// moves, joins or releases another identity's live session; it stays unused with
/// `SessionNotOwned`, and the owner's session, role, term and nudges are untouched.
#[tokio::test]
async fn a_kubectl_registration_never_moves_another_identitys_session() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-own").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    let alice = support::agent_token(cp, &ns, "alice", &ALL).await;
    support::sa_token(cp, &ns, "creator", "controllerregistrations", &["create", "get"]).await;
    let creator = support::api_server_token(cp, &ns, "creator").await;

    let (status, _) = register(&op, &alice, &ns, "P", "s-alice", "codex").await;
    assert_eq!(status, 200);
    let before: (String, bool, Option<i64>) = sqlx::query_as(
        "SELECT project_id, is_master, master_term FROM controller_registrations WHERE session_id = 's-alice' AND released_at IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .expect("alice's row");
    assert_eq!(before, ("P".to_string(), true, Some(1)));

    // Elsewhere (a context switch of her session) and on her own project (a duplicate).
    for (name, project) in [("steal-elsewhere", "Q"), ("steal-same", "P")] {
        let out =
            cp.kubectl_as(&creator, &["create", "-f", "-"], Some(&creg_yaml(name, &ns, project, "s-alice"))).await;
        assert!(out.ok, "the create itself is allowed by RBAC: {}", out.stderr);
        let obj = support::wait_for(&api, name, 15, "SessionNotOwned", |o| {
            ready_reason(o).is_some_and(|(s, r)| s == "False" && r == "SessionNotOwned")
        })
        .await;
        let message = &obj.status.as_ref().expect("status").conditions[0].message;
        assert!(!message.contains("serviceaccount") && !message.contains("creator"), "names no identity: {message}");
    }
    let after: (String, bool, Option<i64>) = sqlx::query_as(
        "SELECT project_id, is_master, master_term FROM controller_registrations WHERE session_id = 's-alice' AND released_at IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .expect("alice's row");
    assert_eq!(after, before, "her session stays where it was, master in term 1");
    let nudges: i64 = sqlx::query_scalar("SELECT count(*) FROM nudges").fetch_one(&db.pool).await.expect("nudges");
    assert_eq!(nudges, 0, "no wrap_session nudge was sent to her");
    let events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM controller_election_events").fetch_one(&db.pool).await.expect("h");
    assert_eq!(events, 1, "one change of master: her election");
    let (status, hb) =
        post(&op, &alice, "/api/v1/controller/heartbeat", json!({"namespace": ns, "session_id": "s-alice"})).await;
    assert_eq!((status, hb["role"].as_str()), (200, Some("Master")));

    // Her own kubectl registration: with the chart's policy it is hers (the owner it
    // stamps is her username) and switches her session; without it no owner is known,
    // and an unowned registration never displaces an owned session.
    let alice_k = support::api_server_token(cp, &ns, "alice").await;
    let out =
        cp.kubectl_as(&alice_k, &["create", "-f", "-"], Some(&creg_yaml("mine-elsewhere", &ns, "R", "s-alice"))).await;
    assert!(out.ok, "{}", out.stderr);
    if support::chart_mode() {
        support::role(&api, "mine-elsewhere", prism_operator::crd::Role::Master, 15).await;
    } else {
        support::wait_for(&api, "mine-elsewhere", 15, "SessionNotOwned", |o| {
            ready_reason(o).is_some_and(|(_, r)| r == "SessionNotOwned")
        })
        .await;
    }
}

/// #19.1: a refused register leaves no resource and no row; concurrent identical
/// registers leave exactly one; the per-identity quota refuses with 429 and makes
/// nothing; a resource the API made and never registered is not registered later (it
/// would bring a refused or wrapped session back to life), and goes away.
#[tokio::test]
async fn refused_and_concurrent_registers_leave_nothing_behind() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-reg").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[("PRISM_MAX_SESSIONS_PER_IDENTITY", "3")]).await;
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    let alice = support::agent_token(cp, &ns, "alice", &ALL).await;
    let bob = support::agent_token(cp, &ns, "bob", &ALL).await;
    assert_eq!(register(&op, &alice, &ns, "P", "s-alice", "codex").await.0, 200);

    // Bob's register of her session, here and elsewhere: 403, and nothing at all made.
    let before = registrations(&db, &api, &ns).await;
    for project in ["P", "Q"] {
        let (status, answer) = register(&op, &bob, &ns, project, "s-alice", "codex").await;
        assert_eq!((status, code(&answer)), (403, "session_not_owned"), "{project}");
    }
    assert_eq!(registrations(&db, &api, &ns).await, before, "a refused register leaves no resource and no row");

    // Twelve identical registers at once: one resource, one row, one answer.
    let calls = (0..12).map(|_| register(&op, &alice, &ns, "P", "s-twelve", "cursor"));
    let answers = futures::future::join_all(calls).await;
    let ids: std::collections::BTreeSet<String> = answers
        .iter()
        .map(|(status, a)| {
            assert_eq!(*status, 200, "{a}");
            a["registration"]["id"].as_str().expect("id").to_string()
        })
        .collect();
    assert_eq!(ids.len(), 1, "every call answers with the one registration: {ids:?}");
    eventually(15, "the other resources gone", || async {
        let list = api.list(&Default::default()).await.ok()?;
        let of_session = list.items.iter().filter(|r| r.spec.session_id == "s-twelve").count();
        (of_session == 1).then_some(())
    })
    .await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM controller_registrations WHERE session_id = 's-twelve'")
        .fetch_one(&db.pool)
        .await
        .expect("rows");
    assert_eq!(rows, 1);

    // The quota (3 here): the third session passes, the fourth is 429 and makes nothing;
    // a context switch at the quota adds no session and passes.
    assert_eq!(register(&op, &alice, &ns, "P", "s-third", "codex").await.0, 200);
    let before = registrations(&db, &api, &ns).await;
    let (status, answer) = register(&op, &alice, &ns, "P", "s-fourth", "codex").await;
    assert_eq!((status, code(&answer)), (429, "quota_exceeded"), "{answer}");
    assert_eq!(registrations(&db, &api, &ns).await.1, before.1, "no resource for a refused register");
    assert_eq!(register(&op, &alice, &ns, "Q", "s-third", "codex").await.0, 200, "a switch at the quota");
    // Another identity has a quota of its own.
    assert_eq!(register(&op, &bob, &ns, "P", "s-bob", "codex").await.0, 200);

    // A resource marked as the API's, with no row (a call that died between its steps):
    // never registered by the reconciler. The chart's policy refuses the mark to anybody
    // but the operator.
    let mut orphan = support::creg("orphan", "P", "s-orphan", prism_operator::crd::AgentSurface::Codex);
    orphan.metadata.annotations = Some([("prism.ntecdev.ai/registered-by".to_string(), "api".to_string())].into());
    let created = api.create(&PostParams::default(), &orphan).await;
    if support::chart_mode() {
        let e = created.expect_err("the policy refuses the operator's mark to others");
        assert!(e.to_string().contains("registered-by"), "{e}");
        return;
    }
    created.expect("create");
    tokio::time::sleep(Duration::from_secs(6)).await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM controller_registrations WHERE session_id = 's-orphan'")
        .fetch_one(&db.pool)
        .await
        .expect("rows");
    assert_eq!(rows, 0, "the reconciler does not write the API's rows");
    eventually(90, "the orphan deleted after its grace", || async {
        api.get_opt("orphan").await.ok()?.is_none().then_some(())
    })
    .await;
}

type Runs = support::runs::RunWorld;

async fn runs(hint: &str, env: &[(&str, &str)]) -> Runs {
    Runs::start(hint, env).await
}

fn refusal(e: &run_client::ClientError) -> &str {
    e.code().unwrap_or("not a refusal")
}

/// #19.2: revocation is level-triggered. Hellos racing a key rotation, and a rotation and
/// a deletion whose Redis writes fail at that moment: within 5 s of the change no
/// session of the old key heartbeats, claims or steps.
#[tokio::test]
async fn no_old_key_authorizes_anything_within_5_s_of_a_rotation_or_deletion() {
    let unlimited = [
        ("PRISM_HELLO_RATE", "1000"),
        ("PRISM_HELLO_BURST", "1000"),
        ("PRISM_UNAUTHENTICATED_RATE", "1000"),
        ("PRISM_UNAUTHENTICATED_BURST", "1000"),
    ];
    let w = runs("h-revoke", &unlimited).await;
    let (mut first, key) = w.run_with_key("r", "srv-r", None).await;
    first.hello().await.expect("hello");

    // Twelve Runs with the generation-1 key say hello again and again while the
    // generation is raised.
    let key = std::sync::Arc::new(key);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let shared = http();
    let granted = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let hellos: Vec<_> = (0..12)
        .map(|_| {
            let (key, stop, base, shared, granted) =
                (key.clone(), stop.clone(), w.op.base.clone(), shared.clone(), granted.clone());
            tokio::spawn(async move {
                let (mut tokens, mut refusals) = (vec![], std::collections::BTreeMap::<String, u32>::new());
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut run = RunClient::new(&base, "srv-r", "run", 1, (*key).clone()).with_http(shared.clone());
                    match run.hello().await {
                        Ok(_) => {
                            granted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            tokens.push(run.token.clone().expect("token"))
                        }
                        Err(e) => *refusals.entry(refusal(&e).to_string()).or_default() += 1,
                    }
                }
                (tokens, refusals)
            })
        })
        .collect();
    // The race is on once some of them hold old-key sessions (on a busy machine the first
    // hellos take a while).
    eventually(20, "old-key hellos granted", || async {
        (granted.load(std::sync::atomic::Ordering::Relaxed) >= 3).then_some(())
    })
    .await;
    let (key2, public2) = run_client::new_key().expect("key");
    let rotate = json!({"spec": {"credential": {"publicKey": public2, "generation": 2}}});
    w.api.patch("r", &PatchParams::default(), &Patch::Merge(&rotate)).await.expect("rotate");
    let rotated_at = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut old_tokens = vec![first.token.clone().expect("token")];
    let mut refusals = std::collections::BTreeMap::<String, u32>::new();
    for h in hellos {
        let (tokens, refused) = h.await.expect("hello task");
        old_tokens.extend(tokens);
        for (code, n) in refused {
            *refusals.entry(code).or_default() += n;
        }
    }
    // Concurrent hellos of one identity in different seconds: the earlier timestamp loses
    // to the high-water mark (replayed_nonce); those after the rotation are stale.
    let attempts = old_tokens.len() + refusals.values().sum::<u32>() as usize;
    assert!(
        attempts > 24 && old_tokens.len() > 1 && refusals.contains_key("stale_generation"),
        "the race ran across the rotation: {} old-key tokens, refusals {refusals:?}",
        old_tokens.len()
    );
    tokio::time::sleep(Duration::from_secs(5).saturating_sub(rotated_at.elapsed())).await;
    let mut alive = 0;
    for token in &old_tokens {
        let mut run = RunClient::new(&w.op.base, "srv-r", "run", 1, (*key).clone());
        run.token = Some(token.clone());
        if run.heartbeat().await.is_ok() || run.claim(1).await.is_ok() {
            alive += 1;
        }
    }
    assert_eq!(alive, 0, "{alive} of {} old-key sessions still authorize something", old_tokens.len());

    // A rotation whose Redis write fails (writes paused past the operator's timeout):
    // claims are refused at once (Postgres knows the epoch), heartbeats within 5 s.
    let mut second = RunClient::new(&w.op.base, "srv-r", "run", 2, key2);
    second.hello().await.expect("hello with the new key");
    assert!(second.heartbeat().await.is_ok());
    let (_key3, public3) = run_client::new_key().expect("key");
    w.pause_writes(3000).await;
    let rotate = json!({"spec": {"credential": {"publicKey": public3, "generation": 3}}});
    w.api.patch("r", &PatchParams::default(), &Patch::Merge(&rotate)).await.expect("rotate");
    let rotated_at = std::time::Instant::now();
    eventually(3, "the generation-3 key in Postgres", || async {
        let g: i64 = sqlx::query_scalar(
            "SELECT key_generation FROM run_identities WHERE server_instance_id = 'srv-r' AND revoked_at IS NULL",
        )
        .fetch_one(&w.db.pool)
        .await
        .ok()?;
        (g == 3).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(3200).saturating_sub(rotated_at.elapsed())).await;
    let claimed = second.claim(1).await.expect_err("claims of the old key are refused");
    assert!(matches!(refusal(&claimed), "session_superseded" | "session_expired"), "{claimed:?}");
    tokio::time::sleep(Duration::from_secs(5).saturating_sub(rotated_at.elapsed())).await;
    let beat = second.heartbeat().await.expect_err("the old key's heartbeat is refused within 5 s");
    assert!(matches!(refusal(&beat), "session_superseded" | "session_expired"), "{beat:?}");

    // A deletion whose Redis write fails: the finalizer keeps at it.
    let w2 = runs("h-revoke-del", &[]).await;
    let mut run = w2.run("d", "srv-d", None).await;
    run.hello().await.expect("hello");
    w2.pause_writes(3000).await;
    w2.api.delete("d", &DeleteParams::default()).await.expect("delete");
    let deleted_at = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(5).saturating_sub(deleted_at.elapsed())).await;
    assert!(run.heartbeat().await.is_err(), "the deleted identity's session is over");
    assert!(run.claim(1).await.is_err());
    eventually(20, "the resource gone once the fence is written", || async {
        w2.api.get_opt("d").await.ok()?.is_none().then_some(())
    })
    .await;
}

/// #19.7: a hello cannot be replayed after Redis lost its data: the identity's
/// high-water mark is durable.
#[tokio::test]
async fn a_hello_cannot_be_replayed_after_redis_forgets_its_nonces() {
    let w = runs("h-replay", &[]).await;
    let run = w.run("r", "srv-replay", None).await;
    let now = chrono::Utc::now().timestamp();
    let earlier = run.hello_body(now - 60, "earlier-nonce-000001");
    let signed = run.hello_body(now, "captured-nonce-00001");
    run.post_hello(&signed).await.expect("the real Run's hello");
    w.redis.flushall().await;
    let replayed = run.post_hello(&signed).await.expect_err("a replay after FLUSHALL");
    assert_eq!(refusal(&replayed), "replayed_nonce");
    let older = run.post_hello(&earlier).await.expect_err("an older signed hello");
    assert_eq!(refusal(&older), "replayed_nonce");
    // A new hello of the Run itself, the same second or later, is accepted.
    run.post_hello(&run.hello_body(now, "fresh-nonce-00000001")).await.expect("a new nonce of that second");
    run.post_hello(&run.hello_body(now + 1, "fresh-nonce-00000002")).await.expect("a later hello");
}

/// #19.3 and #19.8: jobs and identities stay in their tenant. A RunSession of another
/// namespace claiming the same address is told nothing of the owner; deleting the owner
/// cancels its jobs (`identity_deleted`), and the other tenant taking the address over
/// sees none of them; enqueue and server status authorize before they look, with one
/// 403 for "none", "not yours" and "another tenant's", naming nobody.
#[tokio::test]
async fn jobs_and_identities_stay_in_their_tenant() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let a = support::namespace(&client, "h-ta").await;
    let b = support::namespace(&client, "h-tb").await;
    let db = TestDb::new().await;
    let redis = PrivateRedis::start().await;
    let prefix = support::redis_prefix();
    let env = [("REDIS_URL", redis.url.as_str()), ("PRISM_REDIS_PREFIX", prefix.as_str())];
    // One operator per tenant namespace over the same database and Redis (two replicas,
    // each reconciling one namespace): the identities of both meet in one table.
    let op = Operator::start(cp, &db.url, &a, &env).await;
    let _op_b = Operator::start(cp, &db.url, &b, &env).await;
    let api_a: Api<RunSession> = Api::namespaced(client.clone(), &a);
    let api_b: Api<RunSession> = Api::namespaced(client.clone(), &b);
    let disp_a = support::sa_token(cp, &a, "dispatcher", "runsessions", &["get", "list", "update"]).await;
    let disp_b = support::sa_token(cp, &b, "dispatcher", "runsessions", &["get", "list", "update"]).await;
    let nobody = support::sa_token(cp, &a, "nobody", "configmaps", &["get"]).await;

    let key_a = support::create_run_session(&api_a, "owner-run", "srv-x", None).await;
    support::phase(&api_a, "owner-run", RunPhase::Pending, 10).await;
    eventually(10, "A's identity", || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM run_identities WHERE namespace = $1 AND revoked_at IS NULL")
                .bind(&a)
                .fetch_one(&db.pool)
                .await
                .ok()?;
        (n == 1).then_some(())
    })
    .await;
    let key_b = support::create_run_session(&api_b, "intruder-run", "srv-x", None).await;
    let dup = support::wait_for(&api_b, "intruder-run", 15, "DuplicateIdentity", |r| {
        r.status.as_ref().is_some_and(|s| s.conditions.iter().any(|c| c.reason == "DuplicateIdentity"))
    })
    .await;
    let text = serde_json::to_string(&dup.status).expect("json");
    assert!(!text.contains(&a) && !text.contains("owner-run"), "B's status names A's objects: {text}");

    // A's platform enqueues (namespace from the address's RunSession): the job is A's.
    let enqueue = |token: String, ns: Option<&str>, kind: &str| {
        let mut body = json!({"server_instance_id": "srv-x", "component_kind": "run", "kind": kind});
        if let Some(ns) = ns {
            body["namespace"] = json!(ns);
        }
        let op = &op;
        async move { post(op, &token, "/api/v1/runtime/jobs", body).await }
    };
    let (status, job) = enqueue(disp_a.clone(), None, "config").await;
    assert_eq!((status, job["namespace"].as_str()), (201, Some(a.as_str())), "{job}");
    // B's platform: without a namespace the address is A's: 403, naming nothing of A.
    let (status, refused) = enqueue(disp_b.clone(), None, "config").await;
    assert_eq!((status, code(&refused)), (403, "forbidden"));
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(!message.contains(&a) && !message.contains("owner-run"), "{message}");
    // With its own namespace: B has no RunSession of the address (a 404 for it, whose
    // rights are there); nobody gets the same 403 for an address that exists and one that
    // does not.
    assert_eq!(enqueue(disp_b.clone(), Some(&b), "config").await.0, 404);
    let existing = post(
        &op,
        &nobody,
        "/api/v1/runtime/jobs",
        json!({"server_instance_id": "srv-x", "component_kind": "run", "kind": "log"}),
    )
    .await;
    let missing = post(
        &op,
        &nobody,
        "/api/v1/runtime/jobs",
        json!({"server_instance_id": "srv-none", "component_kind": "run", "kind": "log"}),
    )
    .await;
    assert_eq!((existing.0, code(&existing.1)), (403, "forbidden"));
    assert_eq!((missing.0, code(&missing.1)), (403, "forbidden"));
    let strip = |m: &Value| m["error"]["message"].as_str().unwrap_or_default().replace("srv-none", "srv-x");
    assert_eq!(strip(&existing.1), strip(&missing.1), "one message for both");
    // Server status: the same, and B sees nothing of A's component.
    let s_nobody = get(&op, &nobody, "/api/v1/runtime/servers/srv-x/status").await;
    let s_missing = get(&op, &nobody, "/api/v1/runtime/servers/srv-none/status").await;
    assert_eq!((s_nobody.0, s_missing.0), (403, 403));
    assert_eq!(
        get(&op, &disp_b, "/api/v1/runtime/servers/srv-x/status").await.0,
        403,
        "A's component is not B's to see"
    );
    let (status, view) = get(&op, &disp_a, "/api/v1/runtime/servers/srv-x/status").await;
    assert_eq!((status, view["components"].as_array().map(Vec::len)), (200, Some(1)));

    // A deletes its RunSession: its job is cancelled; B takes the address over and sees
    // none of A's work, only its own.
    api_a.delete("owner-run", &DeleteParams::default()).await.expect("delete");
    let cancelled: (String, Option<String>) = eventually(15, "A's job cancelled", || async {
        let row: (String, Option<String>) =
            sqlx::query_as("SELECT state, cancel_reason FROM runtime_jobs WHERE namespace = $1")
                .bind(&a)
                .fetch_one(&db.pool)
                .await
                .ok()?;
        (row.0 == "cancelled").then_some(row)
    })
    .await;
    assert_eq!(cancelled.1.as_deref(), Some("identity_deleted"));
    support::wait_for(&api_b, "intruder-run", 40, "B takes the address over", |r| {
        r.status.as_ref().is_some_and(|s| s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    })
    .await;
    let mut run_b = RunClient::new(&op.base, "srv-x", "run", 1, key_b);
    run_b.hello().await.expect("B's Run");
    // Even a job of A's still queued for the address (as one left from before would be)
    // is not B's to claim.
    sqlx::query("INSERT INTO runtime_jobs (namespace, server_instance_id, component_kind, kind) VALUES ($1, 'srv-x', 'run', 'file')")
        .bind(&a)
        .execute(&db.pool)
        .await
        .expect("A's queued job");
    assert!(run_b.claim(10).await.expect("claim").is_empty(), "no job of A's reaches B");
    let (status, _) = enqueue(disp_a.clone(), None, "config").await;
    assert_eq!(status, 403, "the address is B's now: A's platform may not enqueue for it");
    assert_eq!(enqueue(disp_b.clone(), Some(&b), "log").await.0, 201);
    let jobs = run_b.claim(10).await.expect("claim");
    assert_eq!(jobs.iter().map(|j| (j.namespace.as_str(), j.kind.as_str())).collect::<Vec<_>>(), [(b.as_str(), "log")]);
    // A's old key is worth nothing.
    let mut old = RunClient::new(&op.base, "srv-x", "run", 1, key_a);
    assert_eq!(refusal(&old.hello().await.expect_err("A's key")), "bad_signature");
}

/// #19.4: reading is not heartbeating. A read-only dashboard polling the routing table
/// with a session's id (HTTP `status?session_id=`, MCP `prism_status` and `prism_fence`)
/// refreshes nothing; the owner's call does.
#[tokio::test]
async fn a_read_only_identity_keeps_no_session_alive() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-read").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    let reader = support::agent_token(cp, &ns, "dashboard", &["get", "list"]).await;
    let agent = support::agent_token(cp, &ns, "agent", &ALL).await;
    // The agent's own kubectl registration (with the chart's policy it is the agent's).
    let agent_k = support::api_server_token(cp, &ns, "agent").await;
    let out = cp.kubectl_as(&agent_k, &["create", "-f", "-"], Some(&creg_yaml("by-kubectl", &ns, "P", "s-k"))).await;
    assert!(out.ok, "{}", out.stderr);
    support::role(&api, "by-kubectl", prism_operator::crd::Role::Master, 15).await;
    let heartbeat_of = || async {
        let t: chrono::DateTime<chrono::Utc> =
            sqlx::query_scalar("SELECT last_heartbeat FROM controller_registrations WHERE session_id = 's-k'")
                .fetch_one(&db.pool)
                .await
                .expect("row");
        t
    };
    let before = heartbeat_of().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..5 {
        let (status, table) =
            get(&op, &reader, &format!("/api/v1/controller/P/status?namespace={ns}&session_id=s-k")).await;
        assert_eq!((status, table["caller"]["session_id"].as_str()), (200, Some("s-k")));
    }
    let plan = json!([
        ["prism_status", {"project_id": "P", "session_id": "s-k", "namespace": ns}],
        ["prism_fence", {"project_id": "P", "term": 1, "session_id": "s-k", "namespace": ns}],
    ])
    .to_string();
    let url = op.url("/mcp");
    for mode in ["legacy", "modern"] {
        let out = support::mcp_scenario("calls", mode, &url, &reader, &[("calls", &plan)]).await;
        for answer in out["answers"].as_array().expect("answers") {
            assert_eq!(answer["is_error"], false, "{answer}");
            assert_eq!(answer["structured"]["role"], "Master", "D6 still says its role: {answer}");
        }
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(heartbeat_of().await, before, "the reader refreshed the session");
    // The same call by an identity that may heartbeat it does refresh it (the check can fail).
    let (status, _) = get(&op, &agent, &format!("/api/v1/controller/P/status?namespace={ns}&session_id=s-k")).await;
    assert_eq!(status, 200);
    let owner: Option<String> =
        sqlx::query_scalar("SELECT owner FROM controller_registrations WHERE session_id = 's-k'")
            .fetch_one(&db.pool)
            .await
            .expect("owner");
    eventually(5, &format!("the agent's call refreshed it (owner {owner:?})"), || async {
        (heartbeat_of().await > before).then_some(())
    })
    .await;
}

/// #19.5 and #19.6: a token must be made for the operator's audience (one for the API
/// server is refused), and two tokens of one user with other groups are two identities
/// to the authorization cache.
#[tokio::test]
async fn tokens_are_audience_bound_and_decisions_are_cached_by_the_whole_identity() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-aud").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let bound = support::agent_token(cp, &ns, "agent", &ALL).await;
    let cluster_wide = support::api_server_token(cp, &ns, "agent").await;
    let (status, answer) = register(&op, &cluster_wide, &ns, "P", "s-1", "codex").await;
    assert_eq!((status, code(&answer)), (401, "invalid_token"), "a token for the API server is no agent token");
    assert_eq!(register(&op, &bound, &ns, "P", "s-1", "codex").await.0, 200);

    // A person (a static token: valid for the API server's audience, accepted only with
    // the explicit opt-in) with two tokens: group prism-people may register here, group
    // prism-outsiders may not.
    let dir = cp.kubeconfig.parent().expect("control plane dir");
    let people = std::fs::read_to_string(dir.join("person-token")).expect("person-token");
    assert_eq!(
        get(&op, &people, &format!("/api/v1/controller/P/status?namespace={ns}")).await.0,
        401,
        "no opt-in, no person"
    );
    drop(op);
    let audiences = format!("{},{}", support::AGENT_AUDIENCE, support::API_SERVER_AUDIENCE);
    let op2 = Operator::start(cp, &db.url, &ns, &[("PRISM_TOKEN_AUDIENCES", audiences.as_str())]).await;
    let binding = json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "people", "namespace": ns},
         "rules": [{"apiGroups": ["prism.ntecdev.ai"], "resources": ["controllerregistrations"], "verbs": ALL}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "people", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "people"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "prism-people"}]}
    ]});
    let out = cp.kubectl(&["apply", "-f", "-"], Some(&binding.to_string())).await;
    assert!(out.ok, "{}", out.stderr);
    let outsider = std::fs::read_to_string(dir.join("person-token-other")).expect("person-token-other");
    eventually(10, "the binding in effect", || async {
        (register(&op2, &people, &ns, "P", "s-person", "claude_code").await.0 == 200).then_some(())
    })
    .await;
    // Same username, same uid, other groups, a moment later: asked anew, and refused.
    let (status, answer) = register(&op2, &outsider, &ns, "P", "s-outsider", "claude_code").await;
    assert_eq!((status, code(&answer)), (403, "forbidden"), "{answer}");
}

/// #19.9 (rate limits): a flood of random tokens from one address is refused with 429
/// and `Retry-After` once its budget is spent, while an agent whose token is known is
/// served throughout; hellos for one Run identity are limited too.
#[tokio::test]
async fn a_flood_of_random_tokens_or_hellos_is_rate_limited() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-rate").await;
    let db = TestDb::new().await;
    let op =
        Operator::start(cp, &db.url, &ns, &[("PRISM_UNAUTHENTICATED_RATE", "2"), ("PRISM_UNAUTHENTICATED_BURST", "5")])
            .await;
    let agent = support::agent_token(cp, &ns, "agent", &ALL).await;
    let status_path = format!("/api/v1/controller/P/status?namespace={ns}");
    assert_eq!(get(&op, &agent, &status_path).await.0, 200, "the agent's token is known now");
    let mut limited = 0;
    let flood_started = std::time::Instant::now();
    for n in 0..40 {
        let r = http()
            .get(op.url(&status_path))
            .bearer_auth(format!("random-{n}-{}", uuid::Uuid::new_v4()))
            .send()
            .await
            .expect("GET");
        match r.status().as_u16() {
            429 => {
                limited += 1;
                let retry: u64 = r.headers()["retry-after"].to_str().expect("text").parse().expect("seconds");
                assert!(retry >= 1, "Retry-After {retry}");
                let body: Value = r.json().await.expect("json");
                assert_eq!(code(&body), "rate_limited");
            }
            401 => {}
            other => panic!("a random token answered {other}"),
        }
        assert_eq!(get(&op, &agent, &status_path).await.0, 200, "the known agent is served during the flood");
    }
    // At most the burst, plus what the bucket refilled meanwhile, got a TokenReview.
    let allowed = 40 - limited;
    let refilled = (2.0 * flood_started.elapsed().as_secs_f64()).ceil() as usize;
    assert!(
        allowed <= 5 + refilled + 1,
        "{allowed} of 40 random tokens were reviewed (burst 5, 2/s, {refilled} refilled)"
    );

    // Hellos of one identity: 1/s with a burst of 10 (the defaults).
    let w = runs("h-rate-hello", &[]).await;
    let mut run = w.run("r", "srv-rate", None).await;
    let mut refused = 0;
    for _ in 0..20 {
        match run.hello().await {
            Ok(_) => {}
            Err(e) if refusal(&e) == "rate_limited" => refused += 1,
            Err(e) => panic!("hello: {e:?}"),
        }
    }
    assert!((8..=11).contains(&refused), "{refused} of 20 hellos refused (burst 10, 1/s)");
}

/// #19.10: an answer is never older than a change committed before the request. A
/// master preempted a moment ago is told so on its very next call; a peer promoted by a
/// wrap is told it is master.
#[tokio::test]
async fn an_answer_is_never_older_than_the_change_before_it() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-fresh").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let agent = support::agent_token(cp, &ns, "agent", &ALL).await;
    let desk = support::agent_token(cp, &ns, "desk", &ALL).await;
    let beat = |session: &str| {
        post(&op, &agent, "/api/v1/controller/heartbeat", json!({"namespace": ns, "session_id": session}))
    };
    for round in 0..3 {
        let project = format!("P{round}");
        let (old, peer) = (format!("s-old-{round}"), format!("s-peer-{round}"));
        assert_eq!(register(&op, &agent, &ns, &project, &old, "codex").await.0, 200);
        assert_eq!(register(&op, &agent, &ns, &project, &peer, "cursor").await.0, 200);
        let (_, hb) = beat(&old).await;
        assert_eq!(hb["role"], "Master");
        let (status, d) = register(&op, &desk, &ns, &project, &format!("s-desk-{round}"), "claude_desktop").await;
        assert_eq!((status, d["is_master"].as_bool()), (200, Some(true)));
        let (_, hb) = beat(&old).await;
        assert_eq!(
            (hb["role"].as_str(), hb["you_were_preempted"].as_bool(), hb["term"].as_i64()),
            (Some("Peer"), Some(true), Some(2)),
            "round {round}: {hb}"
        );
        // The desktop wraps: the earliest peer (the preempted one) is master at once.
        let desk_id = d["registration"]["id"].as_str().expect("id");
        assert_eq!(
            post(&op, &desk, &format!("/api/v1/controller/{desk_id}/release?namespace={ns}"), json!({})).await.0,
            200
        );
        let (_, hb) = beat(&old).await;
        assert_eq!((hb["role"].as_str(), hb["term"].as_i64()), (Some("Master"), Some(3)), "round {round}: {hb}");
    }
}

/// #19.10 with roles held in memory (issue 23): heartbeats of an unchanged session are
/// answered without Postgres, and a change committed by another replica reaches them
/// through its notification, before the heartbeat that follows the change's answer.
/// Every replica serves the API; only the Lease holder reconciles.
#[tokio::test]
async fn held_roles_answer_without_postgres_and_follow_another_replicas_change() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-held").await;
    let db = TestDb::new().await;
    let replica = |pod: &'static str| {
        let (db_url, ns) = (db.url.clone(), ns.clone());
        async move { Operator::replica(cp, &db_url, &ns, pod).await }
    };
    let (a, b) = (replica("held-a").await, replica("held-b").await);
    let agent = support::agent_token(cp, &ns, "agent", &ALL).await;
    let desk = support::agent_token(cp, &ns, "desk", &ALL).await;
    let beat = |session: &str| {
        post(&a, &agent, "/api/v1/controller/heartbeat", json!({"namespace": ns, "session_id": session}))
    };
    let role_reads = || async { support::metric_value(&a, "prism_controller_role_reads_total", "").await as u64 };
    for round in 0..3 {
        let project = format!("P{round}");
        let old = format!("s-old-{round}");
        assert_eq!(register(&a, &agent, &ns, &project, &old, "codex").await.0, 200);
        let first = role_reads().await;
        assert_eq!(beat(&old).await.1["role"], "Master");
        assert!(role_reads().await > first, "round {round}: the first heartbeat reads the role");
        // 200 heartbeats of the unchanged session: its role is read from Postgres once
        // (the operator counts those reads), not once per heartbeat.
        let before = role_reads().await;
        for _ in 0..200 {
            let (status, hb) = beat(&old).await;
            assert_eq!((status, hb["role"].as_str()), (200, Some("Master")), "{hb}");
        }
        let read = role_reads().await - before;
        assert!(read <= 1, "round {round}: 200 heartbeats of an unchanged session read its role {read} times");
        // A desktop preempts through the other replica; its answer comes after the commit.
        let (status, d) = register(&b, &desk, &ns, &project, &format!("s-desk-{round}"), "claude_desktop").await;
        assert_eq!((status, d["is_master"].as_bool()), (200, Some(true)));
        let (told, calls) = (std::time::Instant::now(), std::sync::atomic::AtomicU32::new(0));
        let hb = eventually(1, "the preempted master told so by the other replica", || async {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (_, hb) = beat(&old).await;
            (hb["role"] == "Peer").then_some(hb)
        })
        .await;
        println!(
            "round {round}: replica A told of replica B's preemption at its call {} after B's answer, {:?}",
            calls.into_inner(),
            told.elapsed()
        );
        assert_eq!((hb["you_were_preempted"].as_bool(), hb["term"].as_i64()), (Some(true), Some(2)), "{hb}");
        // A wrap through the other replica promotes the old master back.
        let desk_id = d["registration"]["id"].as_str().expect("id");
        let path = format!("/api/v1/controller/{desk_id}/release?namespace={ns}");
        assert_eq!(post(&b, &desk, &path, json!({})).await.0, 200);
        eventually(1, "the promoted peer told so by the other replica", || async {
            let (_, hb) = beat(&old).await;
            (hb["role"] == "Master" && hb["term"] == 3).then_some(())
        })
        .await;
    }
    // Deleted with kubectl: the leader's cleanup releases it (whichever replica leads),
    // and A's held role goes with it; once told not_registered, always told so.
    let (status, gone) = register(&a, &agent, &ns, "P-gone", "s-gone", "codex").await;
    assert_eq!(status, 200, "{gone}");
    assert_eq!(beat("s-gone").await.1["role"], "Master");
    let name = gone["registration"]["name"].as_str().expect("name");
    let regs: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    regs.delete(name, &DeleteParams::default()).await.expect("delete");
    eventually(10, "the deleted registration's session told not_registered", || async {
        let (status, hb) = beat("s-gone").await;
        (status == 404 && code(&hb) == "not_registered").then_some(())
    })
    .await;
    for _ in 0..20 {
        let (status, hb) = beat("s-gone").await;
        assert_eq!((status, code(&hb)), (404, "not_registered"), "{hb}");
    }
}

/// #19.11: identifiers are printable. A newline or another control character in a
/// project or session id is refused by the API (422), by the CRD schema and over MCP,
/// and nothing is written.
#[tokio::test]
async fn identifiers_with_control_characters_are_refused_everywhere() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-print").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    let agent = support::agent_token(cp, &ns, "agent", &ALL).await;
    for (project, session) in
        [("P\nX", "s-1"), ("P", "s\r2"), ("P\u{7f}", "s-3"), ("P", "s\u{85}4"), ("P\u{1b}[31m", "s-5")]
    {
        let (status, answer) = register(&op, &agent, &ns, project, session, "codex").await;
        assert_eq!((status, code(&answer)), (422, "invalid_request"), "{project:?} {session:?}");
    }
    assert_eq!(get(&op, &agent, &format!("/api/v1/controller/P%0AX/status?namespace={ns}")).await.0, 422);
    let e = api
        .create(&PostParams::default(), &support::creg("nl", "P\nX", "s-nl", prism_operator::crd::AgentSurface::Codex))
        .await
        .expect_err("the CRD schema refuses it");
    assert!(e.to_string().contains("spec.projectId"), "{e}");
    let plan = json!([["prism_start", {"project_id": "P\nX", "namespace": ns}]]).to_string();
    for mode in ["legacy", "modern"] {
        let out = support::mcp_scenario("calls", mode, &op.url("/mcp"), &agent, &[("calls", &plan)]).await;
        let answer = &out["answers"][0];
        assert_eq!(answer["is_error"], true, "{answer}");
        assert_eq!(answer["error"]["code"], "invalid_request", "{answer}");
    }
    assert_eq!(registrations(&db, &api, &ns).await, (vec![], 0), "nothing written");
}

/// #19.12: releasing an id whose resource is gone never deletes a later resource that
/// took its name.
#[tokio::test]
async fn releasing_an_old_id_never_deletes_a_new_resource_of_its_name() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-name").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[]).await;
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    let agent = support::agent_token(cp, &ns, "agent", &ALL).await;
    let first = api
        .create(&PostParams::default(), &support::creg("reused", "P", "s-a", prism_operator::crd::AgentSurface::Codex))
        .await
        .expect("create");
    support::role(&api, "reused", prism_operator::crd::Role::Master, 15).await;
    let old_id = first.metadata.uid.clone().expect("uid");
    let release = format!("/api/v1/controller/{old_id}/release?namespace={ns}");
    let kubectl_owned = support::chart_mode();
    // With the chart's policy the admin's registration is the admin's; the agent may not
    // wrap it. The admin deletes it then (the wrap by kubectl).
    if kubectl_owned {
        api.delete("reused", &DeleteParams::default()).await.expect("delete");
    } else {
        assert_eq!(post(&op, &agent, &release, json!({})).await.0, 200);
    }
    eventually(15, "first resource gone", || async { api.get_opt("reused").await.ok()?.is_none().then_some(()) }).await;
    let second = api
        .create(&PostParams::default(), &support::creg("reused", "P", "s-b", prism_operator::crd::AgentSurface::Codex))
        .await
        .expect("create again");
    support::role(&api, "reused", prism_operator::crd::Role::Master, 15).await;
    let (status, _) = post(&op, &agent, &release, json!({})).await;
    assert!(status == 200 || status == 403, "releasing the old id: {status}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let now = api.get_opt("reused").await.expect("get").expect("the new resource is still there");
    assert_eq!(now.metadata.uid, second.metadata.uid);
    assert!(now.metadata.deletion_timestamp.is_none(), "and not being deleted");
}

/// #19.9 (retention): nothing grows without bound. A released registration's resource is
/// deleted once it is past PRISM_RELEASED_RETENTION_HOURS; released rows whose resource
/// is gone, election history and nudges past PRISM_HISTORY_RETENTION_DAYS are pruned;
/// live ones stay.
#[tokio::test]
async fn released_resources_and_old_history_are_deleted() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-keep").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[("PRISM_RETENTION_INTERVAL_SECONDS", "1")]).await;
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    let agent = support::agent_token(cp, &ns, "agent", &ALL).await;
    // A session that switches project leaves a Released resource behind.
    let (_, first) = register(&op, &agent, &ns, "P", "s-move", "codex").await;
    let old_name = first["registration"]["name"].as_str().expect("name").to_string();
    assert_eq!(register(&op, &agent, &ns, "Q", "s-move", "codex").await.0, 200);
    support::role(&api, &old_name, prism_operator::crd::Role::Released, 15).await;
    assert_eq!(register(&op, &agent, &ns, "P", "s-stays", "cursor").await.0, 200);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(api.get_opt(&old_name).await.expect("get").is_some(), "not before its time");

    sqlx::query("UPDATE controller_registrations SET released_at = now() - interval '25 hours' WHERE name = $1")
        .bind(&old_name)
        .execute(&db.pool)
        .await
        .expect("age it");
    eventually(15, "the released resource deleted", || async {
        api.get_opt(&old_name).await.ok()?.is_none().then_some(())
    })
    .await;

    // Past the history retention: the released row, an old history row and an old nudge go.
    sqlx::query("UPDATE controller_registrations SET released_at = now() - interval '31 days' WHERE name = $1")
        .bind(&old_name)
        .execute(&db.pool)
        .await
        .expect("age it more");
    sqlx::query(
        "INSERT INTO controller_election_events (namespace, project_id, term, cause, created_at)
         VALUES ($1, 'P', 0, 'elected', now() - interval '40 days')",
    )
    .bind(&ns)
    .execute(&db.pool)
    .await
    .expect("old history");
    sqlx::query("UPDATE nudges SET created_at = now() - interval '40 days'")
        .execute(&db.pool)
        .await
        .expect("old nudge");
    let count = |sql: &'static str| {
        let pool = db.pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.expect("count") }
    };
    eventually(15, "old rows pruned", || async {
        let released = count("SELECT count(*) FROM controller_registrations WHERE released_at IS NOT NULL").await;
        let old_history =
            count("SELECT count(*) FROM controller_election_events WHERE created_at < now() - interval '30 days'")
                .await;
        let nudges = count("SELECT count(*) FROM nudges").await;
        (released == 0 && old_history == 0 && nudges == 0).then_some(())
    })
    .await;
    let live = count("SELECT count(*) FROM controller_registrations WHERE released_at IS NULL").await;
    assert_eq!(live, 2, "live registrations stay");
    let recent = count("SELECT count(*) FROM controller_election_events").await;
    assert!(recent >= 2, "recent history stays ({recent})");
}

/// #19.9 (unauthenticated routes, separate pools): /metrics and /readyz answer from
/// snapshots without touching a backend per request, and a saturated API pool (every
/// connection held by a blocked call) does not fail /readyz.
#[tokio::test]
async fn health_routes_are_snapshots_and_survive_a_saturated_api_pool() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-health").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[("PRISM_API_DB_CONNECTIONS", "1")]).await;
    let agent = support::agent_token(cp, &ns, "agent", &ALL).await;
    eventually(10, "ready", || async {
        (http().get(op.url("/readyz")).send().await.ok()?.status() == 200).then_some(())
    })
    .await;
    // Scrapes and probes do not reach Postgres: its statement counter does not move.
    let statements = || async {
        let n: i64 = sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
            .fetch_one(&db.pool)
            .await
            .expect("stats");
        n
    };
    // The same time with and without 500 health requests: the requests add nothing. A
    // request that reached Postgres would add at least one transaction each (500); the
    // background (probes every 2 s, gauges every 10 s, the reconciler, statistics that
    // backends flush up to a second late) adds a few either way.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let busy_started = std::time::Instant::now();
    let before = statements().await;
    for _ in 0..250 {
        assert_eq!(http().get(op.url("/metrics")).send().await.expect("metrics").status(), 200);
        assert_eq!(http().get(op.url("/readyz")).send().await.expect("readyz").status(), 200);
    }
    let busy_took = busy_started.elapsed().max(Duration::from_secs(3));
    tokio::time::sleep(busy_took.saturating_sub(busy_started.elapsed())).await;
    let busy = statements().await - before;
    let before = statements().await;
    tokio::time::sleep(busy_took).await;
    let idle = statements().await - before;
    // Backends report their counts up to 10 s late, so the windows differ by tens of
    // transactions; a route that reached Postgres would add 500 or more.
    assert!(busy < idle + 250, "{busy} transactions with 500 health requests, {idle} without");

    // Saturate the API pool: hold the project's election lock, so the one API connection
    // waits inside a register.
    let mut holder = db.pool.acquire().await.expect("connection");
    sqlx::query("BEGIN").execute(&mut *holder).await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1 || '/' || 'P', 0))")
        .bind(&ns)
        .execute(&mut *holder)
        .await
        .expect("lock");
    let blocked = tokio::spawn({
        let (url, agent, ns) = (op.url("/api/v1/controller/register"), agent.clone(), ns.clone());
        async move {
            http()
                .post(url)
                .bearer_auth(agent)
                .json(&json!({"namespace": ns, "project_id": "P", "session_id": "s-blocked", "agent_surface": "codex"}))
                .send()
                .await
        }
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    let ready = http().get(op.url("/readyz")).send().await.expect("readyz");
    assert_eq!(ready.status(), 200, "a busy API pool is no reason to leave the Service");
    sqlx::query("ROLLBACK").execute(&mut *holder).await.expect("rollback");
    let _ = blocked.await;
}

/// #43.2: a refusal costs the refused. Hellos signed by the wrong key in a Run's name are
/// charged to their source address, never to the Run: its own hello right after forty of
/// them is granted. Valid hellos still spend the Run's budget, and a Run told to wait
/// (429 with `Retry-After`) gets its session by waiting, as demo-run does.
#[tokio::test]
async fn forged_hellos_in_a_runs_name_do_not_lock_it_out() {
    // The forger and the Run share 127.0.0.1 here; in the field they are two addresses,
    // so the per-address budget is opened wide and only the per-identity one is at play.
    let w = runs("h-forged-hello", &[("PRISM_UNAUTHENTICATED_RATE", "1000"), ("PRISM_UNAUTHENTICATED_BURST", "1000")])
        .await;
    let mut run = w.run("r", "srv-forged", None).await;
    let (forger_key, _) = run_client::new_key().expect("key");
    let mut forger = RunClient::new(&w.op.base, "srv-forged", "run", 1, forger_key);
    for n in 0..40 {
        let e = forger.hello().await.expect_err("a forged hello is refused");
        assert_eq!(refusal(&e), "bad_signature", "forged hello {n}: {e:?}");
    }
    run.hello().await.expect("the Run's own hello after 40 forged ones is granted");

    // Its own hellos do spend its budget (1/s, burst 10): past it, 429 with Retry-After,
    // and waiting that long is enough.
    let mut told_to_wait = None;
    for _ in 0..20 {
        match run.hello().await {
            Ok(_) => {}
            Err(run_client::ClientError::Refused { code, retry_after, .. }) if code == "rate_limited" => {
                told_to_wait = retry_after;
                break;
            }
            Err(e) => panic!("hello: {e:?}"),
        }
    }
    let wait = told_to_wait.expect("a 429 with Retry-After within 20 hellos");
    assert!(wait >= Duration::from_secs(1) && wait <= Duration::from_secs(10), "Retry-After {wait:?}");
    run.hello_patiently(Duration::from_secs(30)).await.expect("granted after waiting");
}

/// #43.8: with the chart's admission policy, `kubectl delete` of a registration owned by
/// another identity is refused (deleting it would wrap their session), while its owner,
/// and an identity allowed `delete` on `controllerregistrations/owned`, may. Without the
/// policy no owner is known to the API server and RBAC alone decides.
#[tokio::test]
async fn only_the_owner_or_the_override_deletes_an_owned_registration() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-delete").await;
    let db = TestDb::new().await;
    let _op = Operator::start(cp, &db.url, &ns, &[]).await;
    let api: Api<ControllerRegistration> = Api::namespaced(client.clone(), &ns);
    for sa in ["alice", "mallory", "platform"] {
        support::sa_token(cp, &ns, sa, "controllerregistrations", &ALL).await;
    }
    support::grant(cp, &ns, "platform", "controllerregistrations/owned", &["delete"]).await;
    let alice = support::api_server_token(cp, &ns, "alice").await;
    let mallory = support::api_server_token(cp, &ns, "mallory").await;
    let platform = support::api_server_token(cp, &ns, "platform").await;

    for name in ["alices", "alices-too"] {
        let out = cp.kubectl_as(&alice, &["create", "-f", "-"], Some(&creg_yaml(name, &ns, "P", name))).await;
        assert!(out.ok, "{}", out.stderr);
    }
    support::role(&api, "alices", prism_operator::crd::Role::Master, 15).await;
    let delete = |token: &str, name: &str| {
        let (token, name, ns) = (token.to_string(), name.to_string(), ns.clone());
        async move { cp.kubectl_as(&token, &["delete", "creg", &name, "-n", &ns, "--wait=false"], None).await }
    };
    let refused = delete(&mallory, "alices").await;
    if !support::chart_mode() {
        assert!(refused.ok, "without the policy RBAC decides: {}", refused.stderr);
        return;
    }
    assert!(!refused.ok, "another identity's delete is refused");
    assert!(refused.stderr.contains("owned by another identity"), "{}", refused.stderr);
    // (The object is "alices"; the owner, system:serviceaccount:<ns>:alice, is not told.)
    assert!(!refused.stderr.contains(":alice"), "the refusal names no identity: {}", refused.stderr);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still = api.get("alices").await.expect("still there");
    assert!(still.metadata.deletion_timestamp.is_none(), "not being deleted");
    support::role(&api, "alices", prism_operator::crd::Role::Master, 5).await;

    // The owner may, and so may the platform's override.
    let own = delete(&alice, "alices").await;
    assert!(own.ok, "the owner deletes her own: {}", own.stderr);
    let over = delete(&platform, "alices-too").await;
    assert!(over.ok, "delete on controllerregistrations/owned overrides: {}", over.stderr);
    for name in ["alices", "alices-too"] {
        eventually(30, "deleted (wrapped by the finalizer)", || async {
            api.get_opt(name).await.ok()?.is_none().then_some(())
        })
        .await;
    }
}

/// #43.4: authenticated calls have a per-identity budget. An identity flooding the API is
/// refused with 429 `rate_limited` and `Retry-After` once its budget is spent, while
/// another identity's calls are served throughout.
#[tokio::test]
async fn a_flooding_identity_is_throttled_and_its_neighbour_is_not() {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, "h-identity-rate").await;
    let db = TestDb::new().await;
    let op = Operator::start(cp, &db.url, &ns, &[("PRISM_RATE_PER_IDENTITY", "5"), ("PRISM_BURST_PER_IDENTITY", "20")])
        .await;
    let flooder = support::agent_token(cp, &ns, "flooder", &ALL).await;
    let neighbour = support::agent_token(cp, &ns, "neighbour", &ALL).await;
    let path = format!("/api/v1/controller/P/status?namespace={ns}");
    let started = std::time::Instant::now();
    let mut limited = 0;
    for _ in 0..60 {
        let r = http().get(op.url(&path)).bearer_auth(&flooder).send().await.expect("GET");
        match r.status().as_u16() {
            200 => {}
            429 => {
                limited += 1;
                assert!(r.headers().get("retry-after").is_some(), "429 with Retry-After");
                let body: Value = r.json().await.expect("json");
                assert_eq!(code(&body), "rate_limited");
            }
            other => panic!("the flooder got {other}"),
        }
    }
    let served = 60 - limited;
    let refilled = (5.0 * started.elapsed().as_secs_f64()).ceil() as usize;
    assert!(limited > 0, "60 calls at once spend a burst of 20");
    assert!(served <= 20 + refilled + 1, "{served} of 60 served (burst 20, 5/s, {refilled} refilled)");
    for _ in 0..10 {
        assert_eq!(get(&op, &neighbour, &path).await.0, 200, "the neighbour is served during the flood");
    }
}

/// #43.9: the Run session routes are no way around the per-address limit. A flood of
/// made-up session tokens from one address is refused with 429 once the address's budget
/// is spent, before each costs a look-up, while a Run whose token checked out keeps
/// heartbeating and claiming from that same address.
#[tokio::test]
async fn a_flood_of_made_up_session_tokens_is_rate_limited_and_a_real_run_is_not() {
    let w = runs("h-session-flood", &[("PRISM_UNAUTHENTICATED_RATE", "2"), ("PRISM_UNAUTHENTICATED_BURST", "5")]).await;
    let mut run = w.run("r", "srv-flood", None).await;
    run.hello().await.expect("hello");
    run.heartbeat().await.expect("its first heartbeat: its token is known from now on");
    let mut limited = 0;
    for n in 0..40 {
        let r = http()
            .post(w.op.url("/api/v1/runtime/heartbeat"))
            .bearer_auth(format!("prs1.{n}.{}", uuid::Uuid::new_v4().simple()))
            .send()
            .await
            .expect("POST");
        match r.status().as_u16() {
            401 => {}
            429 => {
                limited += 1;
                assert!(r.headers().get("retry-after").is_some());
            }
            other => panic!("a made-up session token answered {other}"),
        }
        run.heartbeat().await.expect("the real Run is served during the flood");
    }
    assert!(limited >= 20, "{limited} of 40 made-up tokens refused 429 (burst 5, 2/s)");
    assert!(run.claim(1).await.is_ok(), "and claims");
}

/// #43.9: a Run that flips `draining` on every heartbeat, as fast as it can, costs the API
/// server a bounded number of status writes (one refresh per address every 2 s, the last
/// state last), not one per flip; its status still ends where the Run left it.
#[tokio::test]
async fn flipping_draining_costs_a_bounded_number_of_status_writes() {
    let w = runs("h-drain-flips", &[]).await;
    let mut run = w.run("flipper", "srv-flipper", None).await;
    run.hello().await.expect("hello");
    support::phase(&w.api, "flipper", RunPhase::Online, 15).await;
    let api = w.api.clone();
    let watching = tokio::spawn(async move {
        let mut versions = std::collections::BTreeSet::new();
        let until = std::time::Instant::now() + Duration::from_secs(8);
        while std::time::Instant::now() < until {
            if let Ok(obj) = api.get("flipper").await {
                versions.extend(obj.metadata.resource_version);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        versions.len()
    });
    let started = std::time::Instant::now();
    let mut flips = 0;
    while started.elapsed() < Duration::from_secs(4) {
        run.draining = Some(flips % 2 == 0);
        run.heartbeat().await.expect("heartbeat");
        flips += 1;
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    run.draining = Some(true);
    run.heartbeat().await.expect("heartbeat");
    let versions = watching.await.expect("watcher");
    assert!(flips >= 50, "{flips} flips");
    // 4 s of flips: a refresh at once and one each 2 s after, with the watch's first
    // sight and the last refresh: a handful, where one per flip would be dozens.
    assert!(versions <= 7, "{versions} versions of the RunSession for {flips} drain flips");
    support::phase(&w.api, "flipper", RunPhase::Draining, 15).await;
}

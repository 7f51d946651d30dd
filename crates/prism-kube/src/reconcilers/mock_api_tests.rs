//! The reconcile glue against a mocked API server (`tower_test::mock`, as kube-rs's
//! controller-rs tests its reconciler): each test scripts the requests it expects, checks
//! their method, path, content type and body, and answers them, conflicts and 404s
//! included. Why a mock: these are the cases a real API server produces only by timing
//! (a stale cache copy, a resource gone between cleanup and finalizer removal), and "no
//! request at all" is only observable this way; and it runs in milliseconds without
//! Postgres, Redis or a kube-apiserver, so the glue is tested apart from the election
//! and the registry. The same steps against a real API server, with the operator
//! running, are covered by the real-apiserver suites tests/election.rs and
//! tests/runtime.rs.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::{Request, Response};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::Event as Finalizer;
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use tower_test::mock::{Handle, SendResponse};

use super::registration::{add_finalizer_with_label, ensure_label};
use super::status::{Written, write_status};
use super::{ControllerError, EventPublisher, FIELD_MANAGER, finalized};
use crate::crd::{
    AgentSurface, ControllerRegistration, ControllerRegistrationSpec, ControllerRegistrationStatus, PROJECT_LABEL,
    REGISTRATION_FINALIZER, Role, RunCredential, RunPhase, RunSession, RunSessionSpec, RunSessionStatus,
};
use crate::time::to_k8s;

type ApiServer = Handle<Request<Body>, Response<Body>>;

const REGISTRATION: &str = "/apis/prism.ntecdev.ai/v1alpha1/namespaces/ns/controllerregistrations/r";
const RUNSESSION: &str = "/apis/prism.ntecdev.ai/v1alpha1/namespaces/ns/runsessions/rs";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/ns/events";
/// PRISM_STATUS_HEARTBEAT_SECONDS in these tests (the default).
const HEARTBEAT_EVERY: u64 = 120;

/// One request the glue sent, ready to be answered.
struct Sent {
    method: String,
    path: String,
    query: String,
    content_type: String,
    body: Value,
    reply: SendResponse<Response<Body>>,
}

impl Sent {
    fn answer(self, code: u16, body: &Value) {
        let bytes = serde_json::to_vec(body).expect("json");
        self.reply.send_response(Response::builder().status(code).body(Body::from(bytes)).expect("response"));
    }

    /// Answers with an API error (a `Status` object), as the API server does.
    fn fail(self, code: u16, reason: &str) {
        let status = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": reason, "reason": reason, "code": code,
        });
        self.answer(code, &status);
    }

    fn is(&self, method: &str, path: &str) -> bool {
        self.method == method && self.path == path
    }
}

async fn next(server: &mut ApiServer) -> Sent {
    let (req, reply) = server.next_request().await.expect("one more request");
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or_default().to_string();
    let content_type =
        req.headers().get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let bytes = req.into_body().collect_bytes().await.expect("request body");
    let body = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).expect("JSON body") };
    Sent { method, path, query, content_type, body, reply }
}

/// Runs `glue` with a client whose API server is `script`. The script sees the requests
/// in order; once the glue is done (and with it every clone of the client), any request
/// the script did not consume fails the test.
async fn against<T, S, G>(script: impl FnOnce(ApiServer) -> S, glue: impl FnOnce(Client) -> G) -> T
where
    S: Future<Output = ApiServer> + Send + 'static,
    G: Future<Output = T>,
{
    let (service, server) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let scripted = tokio::spawn({
        let script = script(server);
        async move {
            let mut server = script.await;
            if let Some((req, _)) = server.next_request().await {
                panic!("unexpected request: {} {}", req.method(), req.uri());
            }
        }
    });
    let out = tokio::time::timeout(Duration::from_secs(5), glue(Client::new(service, "default"))).await;
    tokio::time::timeout(Duration::from_secs(5), scripted).await.expect("script finished").expect("script passed");
    out.expect("glue finished")
}

pub(super) fn registration(resource_version: &str) -> ControllerRegistration {
    let mut obj = ControllerRegistration::new(
        "r",
        ControllerRegistrationSpec {
            project_id: "PID-1".into(),
            session_id: "s".into(),
            agent_surface: AgentSurface::Codex,
        },
    );
    obj.metadata.namespace = Some("ns".into());
    obj.metadata.uid = Some("0b8f9e3c-5d7a-4c1e-9a51-3f0e2d6b7a10".into());
    obj.metadata.resource_version = Some(resource_version.into());
    obj
}

fn labelled(mut obj: ControllerRegistration) -> ControllerRegistration {
    obj.metadata.labels = Some([(PROJECT_LABEL.to_string(), obj.spec.project_id.clone())].into());
    obj
}

fn with_finalizers(mut obj: ControllerRegistration, finalizers: &[&str]) -> ControllerRegistration {
    obj.metadata.finalizers = Some(finalizers.iter().map(|f| f.to_string()).collect());
    obj
}

fn deleting(mut obj: ControllerRegistration) -> ControllerRegistration {
    obj.metadata.deletion_timestamp = Some(to_k8s(chrono::Utc::now()));
    obj
}

fn to_json<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).expect("json")
}

// ---- the project label ------------------------------------------------------------

#[tokio::test]
async fn label_conflict_is_retried_after_a_fresh_read() {
    let obj = registration("1");
    let out = against(
        |mut server| async move {
            let sent = next(&mut server).await;
            assert!(sent.is("PATCH", REGISTRATION), "{} {}", sent.method, sent.path);
            assert_eq!(sent.content_type, "application/merge-patch+json");
            assert_eq!(
                sent.body,
                json!({"metadata": {"labels": {PROJECT_LABEL: "PID-1"}, "resourceVersion": "1"}}),
                "the label alone, guarded by the copy that lacked it"
            );
            sent.fail(409, "Conflict");
            let sent = next(&mut server).await;
            assert!(sent.is("GET", REGISTRATION), "a fresh read: {} {}", sent.method, sent.path);
            sent.answer(200, &to_json(&registration("2")));
            let sent = next(&mut server).await;
            assert!(sent.is("PATCH", REGISTRATION));
            assert_eq!(sent.body["metadata"]["resourceVersion"], "2", "guarded by the fresh copy");
            sent.answer(200, &to_json(&labelled(registration("3"))));
            server
        },
        |client| async move { ensure_label(&Api::namespaced(client, "ns"), &obj).await },
    )
    .await;
    let updated = out.expect("the updated resource");
    assert_eq!(updated.resource_version().as_deref(), Some("3"));
    assert_eq!(updated.labels().get(PROJECT_LABEL).map(String::as_str), Some("PID-1"));
}

#[tokio::test]
async fn label_conflict_with_the_label_already_there_writes_nothing_more() {
    let obj = registration("1");
    let out = against(
        |mut server| async move {
            next(&mut server).await.fail(409, "Conflict");
            let sent = next(&mut server).await;
            assert!(sent.is("GET", REGISTRATION));
            sent.answer(200, &to_json(&labelled(registration("2"))));
            server
        },
        |client| async move { ensure_label(&Api::namespaced(client, "ns"), &obj).await },
    )
    .await;
    assert_eq!(out.and_then(|o| o.resource_version()).as_deref(), Some("2"), "the fresh copy is used");
}

#[tokio::test]
async fn a_label_failure_is_no_reconcile_failure() {
    let obj = registration("1");
    let out = against(
        |mut server| async move {
            next(&mut server).await.fail(403, "Forbidden");
            server
        },
        |client| async move { ensure_label(&Api::namespaced(client, "ns"), &obj).await },
    )
    .await;
    assert!(out.is_none(), "logged, and the election goes on with the copy it had");
}

#[tokio::test]
async fn with_finalizer_and_label_from_admission_apply_writes_nothing() {
    let obj = Arc::new(with_finalizers(labelled(registration("1")), &[REGISTRATION_FINALIZER]));
    let applied = Arc::new(AtomicBool::new(false));
    let result = against(
        |server| async move { server },
        |client| {
            let applied = applied.clone();
            async move {
                let api = Api::namespaced(client, "ns");
                let api = &api;
                finalized(api, REGISTRATION_FINALIZER, obj, |event| async move {
                    let Finalizer::Apply(obj) = event else { panic!("not deleting") };
                    assert!(ensure_label(api, &obj).await.is_none());
                    applied.store(true, Ordering::SeqCst);
                    Ok(Action::requeue(Duration::from_secs(120)))
                })
                .await
            }
        },
    )
    .await;
    assert_eq!(result.expect("reconciled"), Action::requeue(Duration::from_secs(120)));
    assert!(applied.load(Ordering::SeqCst));
}

// ---- the finalizer ----------------------------------------------------------------

#[tokio::test]
async fn finalizer_and_label_missing_are_written_in_one_patch_and_apply_runs_at_once() {
    let obj = Arc::new(with_finalizers(registration("3"), &["other.io/keep"]));
    let applied = Arc::new(AtomicBool::new(false));
    let result = against(
        |mut server| async move {
            let patch = next(&mut server).await;
            assert!(patch.is("PATCH", REGISTRATION));
            assert_eq!(patch.content_type, "application/merge-patch+json");
            assert_eq!(patch.body["metadata"]["finalizers"], json!(["other.io/keep", REGISTRATION_FINALIZER]));
            assert_eq!(patch.body["metadata"]["labels"][PROJECT_LABEL], "PID-1");
            assert_eq!(patch.body["metadata"]["resourceVersion"], "3");
            let done = labelled(with_finalizers(registration("4"), &["other.io/keep", REGISTRATION_FINALIZER]));
            patch.answer(200, &to_json(&done));
            server
        },
        |client| {
            let applied = applied.clone();
            async move {
                let api = Api::namespaced(client, "ns");
                let api = &api;
                let prepared = add_finalizer_with_label(api, obj).await;
                finalized(api, REGISTRATION_FINALIZER, prepared, |event| async move {
                    let Finalizer::Apply(obj) = event else { panic!("not deleting") };
                    assert!(ensure_label(api, &obj).await.is_none(), "the label is there: no second write");
                    applied.store(true, Ordering::SeqCst);
                    Ok(Action::requeue(Duration::from_secs(120)))
                })
                .await
            }
        },
    )
    .await;
    assert_eq!(result.expect("reconciled"), Action::requeue(Duration::from_secs(120)));
    assert!(applied.load(Ordering::SeqCst), "apply ran in the same reconcile");
}

#[tokio::test]
async fn a_failed_combined_patch_leaves_the_finalizer_to_finalizer() {
    let obj = Arc::new(registration("3"));
    let back = against(
        |mut server| async move {
            let patch = next(&mut server).await;
            assert!(patch.is("PATCH", REGISTRATION));
            patch.fail(409, "Conflict");
            server
        },
        |client| async move {
            let api: Api<ControllerRegistration> = Api::namespaced(client, "ns");
            add_finalizer_with_label(&api, obj.clone()).await
        },
    )
    .await;
    assert_eq!(back.resource_version().as_deref(), Some("3"), "unchanged: finalizer() adds it the usual way");
    let with_label = labelled(registration("5"));
    assert!(super::registration::finalizer_and_label_patch(&with_label).is_none(), "label there: finalizer() alone");
    assert!(super::registration::finalizer_and_label_patch(&deleting(registration("6"))).is_none());
}

#[tokio::test]
async fn the_finalizer_is_added_when_missing_and_apply_waits_for_it() {
    for (present, expected) in [
        (
            vec![],
            json!([
                {"op": "test", "path": "/metadata/finalizers", "value": null},
                {"op": "add", "path": "/metadata/finalizers", "value": [REGISTRATION_FINALIZER]},
            ]),
        ),
        (
            vec!["other.io/keep"],
            json!([
                {"op": "test", "path": "/metadata/finalizers", "value": ["other.io/keep"]},
                {"op": "add", "path": "/metadata/finalizers/-", "value": REGISTRATION_FINALIZER},
            ]),
        ),
    ] {
        let mut obj = registration("1");
        if !present.is_empty() {
            obj = with_finalizers(obj, &present);
        }
        let answer = to_json(&with_finalizers(registration("2"), &[REGISTRATION_FINALIZER]));
        let result = against(
            |mut server| async move {
                let sent = next(&mut server).await;
                assert!(sent.is("PATCH", REGISTRATION));
                assert_eq!(sent.content_type, "application/json-patch+json");
                assert_eq!(sent.body, expected, "guarded by a test of the list it saw");
                sent.answer(200, &answer);
                server
            },
            |client| async move {
                let api = Api::namespaced(client, "ns");
                // No apply before the finalizer is on the resource.
                finalized(&api, REGISTRATION_FINALIZER, Arc::new(obj), |_| async {
                    Err(ControllerError::MissingField("finalizer"))
                })
                .await
            },
        )
        .await;
        assert_eq!(result.expect("finalizer added"), Action::await_change(), "its watch event is the next reconcile");
    }
}

#[tokio::test]
async fn the_finalizer_is_removed_after_a_successful_cleanup() {
    let obj = Arc::new(deleting(with_finalizers(registration("1"), &["other.io/keep", REGISTRATION_FINALIZER])));
    let cleaned = Arc::new(AtomicBool::new(false));
    let result = against(
        {
            let cleaned = cleaned.clone();
            move |mut server| async move {
                let sent = next(&mut server).await;
                assert!(cleaned.load(Ordering::SeqCst), "removed only after the cleanup");
                assert!(sent.is("PATCH", REGISTRATION));
                assert_eq!(sent.content_type, "application/json-patch+json");
                assert_eq!(
                    sent.body,
                    json!([
                        {"op": "test", "path": "/metadata/finalizers/1", "value": REGISTRATION_FINALIZER},
                        {"op": "remove", "path": "/metadata/finalizers/1"},
                    ]),
                    "ours only, never someone else's"
                );
                sent.answer(200, &to_json(&deleting(with_finalizers(registration("2"), &["other.io/keep"]))));
                server
            }
        },
        |client| {
            let cleaned = cleaned.clone();
            async move {
                let api = Api::namespaced(client, "ns");
                finalized(&api, REGISTRATION_FINALIZER, obj, |event| async move {
                    let Finalizer::Cleanup(_) = event else { panic!("the resource is being deleted") };
                    cleaned.store(true, Ordering::SeqCst);
                    Ok(Action::await_change())
                })
                .await
            }
        },
    )
    .await;
    assert_eq!(result.expect("cleaned up"), Action::await_change());
}

#[tokio::test]
async fn a_resource_already_gone_when_its_finalizer_is_removed_is_done() {
    let obj = Arc::new(deleting(with_finalizers(registration("1"), &[REGISTRATION_FINALIZER])));
    let result = against(
        |mut server| async move {
            let sent = next(&mut server).await;
            assert!(sent.is("PATCH", REGISTRATION));
            sent.fail(404, "NotFound");
            server
        },
        |client| async move {
            let api = Api::namespaced(client, "ns");
            finalized(&api, REGISTRATION_FINALIZER, obj, |_| async { Ok(Action::await_change()) }).await
        },
    )
    .await;
    assert_eq!(result.expect("404 is success"), Action::await_change());
}

#[tokio::test]
async fn a_failed_cleanup_keeps_the_finalizer() {
    let obj = Arc::new(deleting(with_finalizers(registration("1"), &[REGISTRATION_FINALIZER])));
    let result = against(
        |server| async move { server },
        |client| async move {
            let api = Api::namespaced(client, "ns");
            finalized(&api, REGISTRATION_FINALIZER, obj, |_| async {
                Err(ControllerError::MissingField("metadata.uid"))
            })
            .await
        },
    )
    .await;
    assert!(matches!(result, Err(ControllerError::Finalizer(_))), "{result:?}");
}

// ---- the status writer ------------------------------------------------------------

fn master_status(heartbeat_secs: i64) -> ControllerRegistrationStatus {
    let at = |s: i64| chrono::DateTime::from_timestamp(1_700_000_000 + s, 0).map(to_k8s);
    ControllerRegistrationStatus {
        role: Role::Master,
        is_master: true,
        term: Some(3),
        registered_at: at(0),
        last_heartbeat: at(heartbeat_secs),
        observed_generation: Some(1),
        ..Default::default()
    }
}

#[tokio::test]
async fn no_status_write_and_no_event_when_nothing_worth_it_changed() {
    let obj = registration("1");
    let written = Written::new(Duration::from_secs(HEARTBEAT_EVERY));
    let (before, after) = (master_status(0), master_status(100));
    against(
        |server| async move { server },
        |client| async {
            let api = Api::namespaced(client.clone(), "ns");
            let events = EventPublisher::new(client, None);
            write_status(&api, &events, &written, &obj, &before, &before).await.expect("same status");
            write_status(&api, &events, &written, &obj, &before, &after)
                .await
                .expect("100 s of heartbeat, under the 120 s status heartbeat");
        },
    )
    .await;
    assert_eq!(written.previous(obj.uid().as_deref(), None), None, "nothing written, nothing remembered");
}

#[tokio::test]
async fn a_new_role_is_written_remembered_and_announced_once() {
    let obj = registration("1");
    let written = Written::new(Duration::from_secs(HEARTBEAT_EVERY));
    let (before, after) = (ControllerRegistrationStatus::default(), master_status(0));
    let expected = json!({"status": to_json(&after)});
    let mut answered = registration("2");
    answered.status = Some(after.clone());
    let answered = to_json(&answered);
    against(
        |mut server| async move {
            let sent = next_status_patch(&mut server, REGISTRATION).await;
            assert_eq!(sent.body, expected);
            sent.answer(200, &answered);
            let sent = next(&mut server).await;
            assert!(sent.is("POST", EVENTS), "{} {}", sent.method, sent.path);
            assert_eq!(
                (&sent.body["type"], &sent.body["reason"], &sent.body["action"], &sent.body["note"]),
                (&json!("Normal"), &json!("BecameMaster"), &json!("Elect"), &json!("became master in term 3"))
            );
            assert_eq!(sent.body["regarding"]["name"], "r");
            assert_eq!(sent.body["reportingInstance"], FIELD_MANAGER, "no pod name: the controller's");
            let body = sent.body.clone();
            sent.answer(201, &body);
            server
        },
        |client| async {
            let api = Api::namespaced(client.clone(), "ns");
            write_status(&api, &EventPublisher::new(client, None), &written, &obj, &before, &after)
                .await
                .expect("written");
        },
    )
    .await;
    assert_eq!(written.previous(obj.uid().as_deref(), None), Some(after), "the lagging cache is not trusted");
}

#[tokio::test]
async fn a_failed_status_write_is_neither_remembered_nor_announced() {
    let obj = registration("1");
    let written = Written::new(Duration::from_secs(HEARTBEAT_EVERY));
    let result = against(
        |mut server| async move {
            next_status_patch(&mut server, REGISTRATION).await.fail(500, "InternalError");
            server
        },
        |client| async {
            let api = Api::namespaced(client.clone(), "ns");
            write_status(
                &api,
                &EventPublisher::new(client, None),
                &written,
                &obj,
                &Default::default(),
                &master_status(0),
            )
            .await
        },
    )
    .await;
    assert!(result.is_err());
    assert_eq!(written.previous(obj.uid().as_deref(), None), None);
}

/// The next request, checked to be a merge patch of `path`'s status as this operator.
async fn next_status_patch(server: &mut ApiServer, path: &str) -> Sent {
    let sent = next(server).await;
    assert!(sent.is("PATCH", &format!("{path}/status")), "{} {}", sent.method, sent.path);
    assert_eq!(sent.content_type, "application/merge-patch+json");
    assert!(sent.query.contains(&format!("fieldManager={FIELD_MANAGER}")), "{}", sent.query);
    sent
}

fn runsession() -> RunSession {
    let mut obj = RunSession::new(
        "rs",
        RunSessionSpec {
            server_instance_id: "srv-1".into(),
            component_kind: "run".into(),
            credential: RunCredential { public_key: "a2V5".into(), generation: 1 },
            lease_seconds: None,
            paused: false,
        },
    );
    obj.metadata.namespace = Some("ns".into());
    obj.metadata.uid = Some("6a4d2f8e-1b3c-4e5f-8a9b-0c1d2e3f4a5b".into());
    obj.metadata.resource_version = Some("1".into());
    obj
}

fn online(heartbeat_secs: i64) -> RunSessionStatus {
    let at = |s: i64| chrono::DateTime::from_timestamp(1_700_000_000 + s, 0).map(to_k8s);
    RunSessionStatus {
        phase: RunPhase::Online,
        online: true,
        last_heartbeat: at(heartbeat_secs),
        session_started_at: at(0),
        version: Some("1.4.2".into()),
        observed_generation: Some(1),
        ..Default::default()
    }
}

#[tokio::test]
async fn runsession_status_uses_the_same_writer_and_its_own_events() {
    let obj = runsession();
    let written = Written::new(Duration::from_secs(HEARTBEAT_EVERY));
    let pending = RunSessionStatus::default();
    let (first, later, much_later) = (online(0), online(100), online(120));
    let expected = json!({"status": to_json(&first)});
    let (answer, beat) = (to_json(&runsession()), to_json(&much_later));
    against(
        |mut server| async move {
            let sent = next_status_patch(&mut server, RUNSESSION).await;
            assert_eq!(sent.body, expected);
            sent.answer(200, &answer);
            let sent = next(&mut server).await;
            assert!(sent.is("POST", EVENTS));
            assert_eq!(
                (&sent.body["type"], &sent.body["reason"], &sent.body["action"], &sent.body["note"]),
                (&json!("Normal"), &json!("Online"), &json!("Observe"), &json!("session started, version 1.4.2"))
            );
            let body = sent.body.clone();
            sent.answer(201, &body);
            // 120 s of heartbeat is a write, and no Event.
            let sent = next_status_patch(&mut server, RUNSESSION).await;
            assert_eq!(sent.body["status"], beat);
            sent.answer(200, &answer);
            server
        },
        |client| async {
            let api = Api::namespaced(client.clone(), "ns");
            let events = EventPublisher::new(client, None);
            write_status(&api, &events, &written, &obj, &pending, &first).await.expect("online");
            write_status(&api, &events, &written, &obj, &first, &later).await.expect("100 s: no write");
            write_status(&api, &events, &written, &obj, &first, &much_later).await.expect("120 s: a write");
        },
    )
    .await;
    let remembered: Option<Time> = written.previous(obj.uid().as_deref(), None).and_then(|s| s.last_heartbeat);
    assert_eq!(remembered, online(120).last_heartbeat);
}

/// Every Event is one create with all its fields, a repeat included: nothing of an Event
/// is kept to turn the next one into a patch (kube's Recorder kept each for 6 minutes
/// and would PATCH a `series` here), and a failed create changes nothing for the next.
#[tokio::test]
async fn events_are_created_whole_each_time_and_nothing_is_kept() {
    let obj = registration("1");
    let started = Timestamp::now();
    let expected = json!({
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"namespace": "ns"},
        "action": "Elect",
        "reason": "Preempted",
        "note": "preempted by desktop registration d",
        "type": "Warning",
        "reportingController": FIELD_MANAGER,
        "reportingInstance": "pod-1",
        "regarding": {
            "apiVersion": "prism.ntecdev.ai/v1alpha1",
            "kind": "ControllerRegistration",
            "namespace": "ns",
            "name": "r",
            "uid": "0b8f9e3c-5d7a-4c1e-9a51-3f0e2d6b7a10",
        },
    });
    against(
        |mut server| async move {
            let mut names = Vec::new();
            for n in 0..3 {
                let sent = next(&mut server).await;
                assert!(sent.is("POST", EVENTS), "Event {n}: {} {}", sent.method, sent.path);
                assert_eq!(sent.content_type, "application/json");
                let mut body = sent.body.clone();
                let meta = body["metadata"].as_object_mut().expect("metadata");
                let name = meta.remove("name").and_then(|v| v.as_str().map(String::from)).expect("a name");
                let (object, nanos) = name.split_once('.').expect("<object>.<hex nanos>");
                assert_eq!(object, "r");
                let nanos = i128::from_str_radix(nanos, 16).expect("hex");
                let at = body.as_object_mut().and_then(|b| b.remove("eventTime")).expect("eventTime");
                let at: Timestamp = at.as_str().expect("a time").parse().expect("RFC 3339");
                assert!(at >= started.checked_sub(SignedDuration::from_secs(1)).expect("time"), "{at} is now");
                assert!(at <= Timestamp::now(), "{at} is now");
                assert!(
                    (nanos / 1000 - i128::from(at.as_microsecond())).abs() <= 1,
                    "the name's instant is eventTime's"
                );
                assert_eq!(body, expected, "Event {n}: these fields and no others (no series)");
                names.push(name);
                if n == 1 {
                    sent.fail(500, "InternalError");
                } else {
                    let answer = sent.body.clone();
                    sent.answer(201, &answer);
                }
            }
            let mut unique = names.clone();
            unique.sort();
            unique.dedup();
            assert_eq!(unique.len(), 3, "a name per Event: {names:?}");
            server
        },
        |client| async {
            let events = EventPublisher::new(client, Some("pod-1".into()));
            for _ in 0..3 {
                let event = (EventType::Warning, "Preempted", "preempted by desktop registration d".to_string());
                // A failure is only logged: publish has nothing to return.
                let () = events.publish(&obj, event, "Elect").await;
            }
        },
    )
    .await;
}

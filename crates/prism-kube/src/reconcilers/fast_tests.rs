//! Every rule of SPEC §4/§5 that a reconcile applies, through the whole reconcile
//! (`reconcile()`: span, finalizer, apply or cleanup, status writer, Events, metrics)
//! against the fakes of `crate::fakes`: the store traits in memory (the election with
//! prism-core's own rules) and an API server that answers and records. No Postgres, no
//! Redis, no kube-apiserver: `cargo test -p prism-kube` runs them in well under a second.
//! The same behaviour with the real stores and a real API server is what tests/election.rs
//! and tests/runtime.rs prove; these pin down the reconcile's own decisions, each alone.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use chrono::Utc;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use serde_json::Value;
use uuid::Uuid;

use super::registration::{ORPHAN_GRACE, next_slot, project_slot};
use super::{Context, reconcile, retain, run_reaper, run_registry_watch};
use crate::crd::{
    AgentSurface, ControllerRegistration, ControllerRegistrationSpec, OWNER_ANNOTATION, PROJECT_LABEL,
    REGISTERED_BY_ANNOTATION, REGISTERED_BY_API, REGISTRATION_FINALIZER, RunCredential, RunSession, RunSessionSpec,
};
use crate::fakes::{ApiServer, FakeElection, FakeRuns, HEARTBEAT_EVERY, api_server, context};
use crate::time::to_k8s;
use prism_core::election::{Registration, ReleaseReason};
use prism_core::run::{REVOKED_EPOCH_TTL, RunAddress};
use prism_core::store::{Refusal, Runs};

type Ctx = Arc<Context<FakeElection, FakeRuns>>;

const NS: &str = "ns";

fn path_of(plural: &str, name: &str) -> String {
    format!("/apis/prism.ntecdev.ai/v1alpha1/namespaces/{NS}/{plural}/{name}")
}

fn registration_path(name: &str) -> String {
    path_of("controllerregistrations", name)
}

/// A registration as the chart's admission policy leaves it (finalizer and label on), so
/// the reconcile goes straight to the election.
fn registration(name: &str, session: &str, surface: AgentSurface) -> ControllerRegistration {
    let mut obj = ControllerRegistration::new(
        name,
        ControllerRegistrationSpec { project_id: "PID-1".into(), session_id: session.into(), agent_surface: surface },
    );
    obj.metadata.namespace = Some(NS.into());
    obj.metadata.uid = Some(Uuid::new_v4().to_string());
    obj.metadata.generation = Some(1);
    obj.metadata.resource_version = Some("1".into());
    obj.metadata.creation_timestamp = Some(to_k8s(Utc::now()));
    obj.metadata.finalizers = Some(vec![REGISTRATION_FINALIZER.into()]);
    obj.metadata.labels = Some([(PROJECT_LABEL.to_string(), "PID-1".to_string())].into());
    obj
}

fn uid_of<K: kube::Resource>(obj: &K) -> Uuid {
    obj.meta().uid.as_deref().and_then(|u| Uuid::parse_str(u).ok()).unwrap_or_default()
}

/// The API server holds the object, and the reconcile runs on it; the status it wrote is
/// folded back into the object (as the watch would bring it), for the next reconcile.
async fn reconciled<K>(
    server: &ApiServer,
    ctx: &Ctx,
    plural: &str,
    obj: &mut K,
) -> Result<Action, super::ControllerError>
where
    K: super::Reconciled + kube::core::object::HasStatus,
    K::Status: serde::de::DeserializeOwned,
{
    let path = path_of(plural, &kube::ResourceExt::name_any(obj));
    server.hold(&path, serde_json::to_value(&*obj).unwrap_or(Value::Null));
    let result = reconcile(Arc::new(obj.clone()), ctx.clone()).await;
    if let Some(status) = server.last_status(&path) {
        *obj.status_mut() = serde_json::from_value(status).ok();
    }
    result
}

fn condition<'a>(status: &'a Value, type_: &str) -> (&'a str, &'a str) {
    let found = status["conditions"].as_array().and_then(|cs| cs.iter().find(|c| c["type"] == type_));
    match found {
        Some(c) => (c["status"].as_str().unwrap_or_default(), c["reason"].as_str().unwrap_or_default()),
        None => ("", ""),
    }
}

// ---- ControllerRegistration (SPEC §4) ---------------------------------------------

#[tokio::test]
async fn the_first_registration_of_a_project_is_its_master_and_comes_back_in_its_slot() {
    let (client, server) = api_server();
    let (ctx, metrics) = context(client, false);
    let mut r1 = registration("r1", "s1", AgentSurface::Codex);
    let before = Utc::now();
    let action = reconciled(&server, &ctx, "controllerregistrations", &mut r1).await.expect("reconciled");
    let after = Utc::now();

    let status = server.last_status(&registration_path("r1")).expect("a status was written");
    assert_eq!(status["role"], "Master");
    assert_eq!(status["isMaster"], true);
    assert_eq!(status["term"], 1);
    assert_eq!(status["master"]["name"], "r1");
    assert_eq!(condition(&status, "Ready"), ("True", "Registered"));
    assert_eq!(condition(&status, "Master"), ("True", "Elected"));
    assert_eq!(condition(&status, "Stale"), ("False", "HeartbeatFresh"));
    assert_eq!(server.event_reasons(), ["BecameMaster"]);
    // A live registration comes back in its project's slot of the status heartbeat.
    let slot = project_slot(&r1.namespace().unwrap_or_default(), &r1.spec.project_id);
    // Slots are whole milliseconds: the reconcile's clock falls in one of the
    // milliseconds from `before`'s to `after`'s, which may be one more than their
    // difference rounded down (0.7998 → 0.8001 is 0 ms apart but two slots).
    let slots: Vec<Action> = (0..=(after - before).num_milliseconds() + 1)
        .map(|ms| Action::requeue(next_slot(HEARTBEAT_EVERY, slot, before + chrono::Duration::milliseconds(ms))))
        .collect();
    assert!(slots.contains(&action), "{action:?} is not the registration's project's slot");
    assert_eq!(*metrics.reconciles.lock().expect("metrics"), [("controllerregistration".to_string(), false)]);
}

#[tokio::test]
async fn a_desktop_session_preempts_the_master_and_both_statuses_say_who() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut codex = registration("codex", "s1", AgentSurface::Codex);
    let mut desktop = registration("desk", "s2", AgentSurface::ClaudeDesktop);
    reconciled(&server, &ctx, "controllerregistrations", &mut codex).await.expect("codex");
    reconciled(&server, &ctx, "controllerregistrations", &mut desktop).await.expect("desktop");
    // The election's trigger brings the demoted one back: its row, its project and its
    // preemptor (that project's master) come from one read.
    let reads = (ctx.election.called("project"), ctx.election.called("get"));
    reconciled(&server, &ctx, "controllerregistrations", &mut codex).await.expect("codex again");
    assert_eq!((ctx.election.called("project"), ctx.election.called("get")), (reads.0 + 1, reads.1));

    let desk = server.last_status(&registration_path("desk")).expect("desktop status");
    assert_eq!((desk["role"].as_str(), desk["term"].as_i64()), (Some("Master"), Some(2)), "a new term");
    let old = server.last_status(&registration_path("codex")).expect("codex status");
    assert_eq!(old["role"], "Peer");
    assert_eq!(old["preempted"], true);
    assert_eq!(old["preemptedBy"]["name"], "desk");
    assert_eq!(old["preemptedBy"]["agentSurface"], "claude_desktop");
    assert_eq!(old["master"]["name"], "desk");
    assert_eq!(condition(&old, "Master"), ("False", "Preempted"));
    assert_eq!(server.event_reasons(), ["BecameMaster", "BecameMaster", "Preempted"]);
}

#[tokio::test]
async fn a_peer_joins_without_an_event_and_names_its_master() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut first = registration("first", "s1", AgentSurface::Codex);
    let mut second = registration("second", "s2", AgentSurface::Cursor);
    reconciled(&server, &ctx, "controllerregistrations", &mut first).await.expect("first");
    reconciled(&server, &ctx, "controllerregistrations", &mut second).await.expect("second");
    let peer = server.last_status(&registration_path("second")).expect("status");
    assert_eq!((peer["role"].as_str(), peer["master"]["name"].as_str()), (Some("Peer"), Some("first")));
    assert_eq!(condition(&peer, "Master"), ("False", "Peer"));
    assert_eq!(server.event_reasons(), ["BecameMaster"], "joining as a peer changes nobody's role");
}

#[tokio::test]
async fn an_unchanged_status_is_not_written_again() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut r1 = registration("r1", "s1", AgentSurface::Codex);
    reconciled(&server, &ctx, "controllerregistrations", &mut r1).await.expect("first");
    let writes = server.writes().len();
    reconciled(&server, &ctx, "controllerregistrations", &mut r1).await.expect("again");
    assert_eq!(server.writes().len(), writes, "no status write, no Event: {:?}", server.writes());
    assert_eq!(ctx.election.called("register"), 1, "the row is known: read, not registered again");
    // A live registration's periodic reconcile reads Postgres once: its project, with
    // its row in it.
    let reads = (ctx.election.called("project"), ctx.election.called("get"));
    reconciled(&server, &ctx, "controllerregistrations", &mut r1).await.expect("once more");
    assert_eq!((ctx.election.called("project"), ctx.election.called("get")), (reads.0 + 1, reads.1));
}

#[tokio::test]
async fn a_second_resource_for_a_live_session_is_not_used() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut first = registration("first", "same-session", AgentSurface::Codex);
    let mut copy = registration("copy", "same-session", AgentSurface::Codex);
    reconciled(&server, &ctx, "controllerregistrations", &mut first).await.expect("first");
    let action = reconciled(&server, &ctx, "controllerregistrations", &mut copy).await.expect("copy");
    let status = server.last_status(&registration_path("copy")).expect("status");
    assert_eq!(status["role"], "Pending");
    assert_eq!(condition(&status, "Ready"), ("False", "DuplicateSession"));
    assert!(status.get("master").is_none(), "not in the election: no master shown");
    assert_eq!(server.event_reasons(), ["BecameMaster", "DuplicateSession"]);
    assert_eq!(action, Action::requeue(Duration::from_secs(60)));
    assert_eq!(ctx.election.row(uid_of(&first)).map(|r| r.is_master), Some(true), "the first one is untouched");
}

#[tokio::test]
async fn refusals_are_answers_shown_in_status_not_failed_reconciles() {
    for (refusal, reason) in [
        (Refusal::NotOwned("s1".into()), "SessionNotOwned"),
        (Refusal::QuotaExceeded(prism_core::election::Quota::Owner(100)), "QuotaExceeded"),
    ] {
        let (client, server) = api_server();
        let (ctx, metrics) = context(client, false);
        *ctx.election.refuse.lock().expect("lock") = Some(refusal);
        let mut r1 = registration("r1", "s1", AgentSurface::Codex);
        let action = reconciled(&server, &ctx, "controllerregistrations", &mut r1).await.expect("not an error");
        let status = server.last_status(&registration_path("r1")).expect("status");
        assert_eq!((status["role"].as_str(), condition(&status, "Ready")), (Some("Pending"), ("False", reason)));
        assert_eq!(server.event_reasons(), [reason]);
        assert_eq!(action, Action::requeue(Duration::from_secs(60)));
        assert_eq!(*metrics.reconciles.lock().expect("metrics"), [("controllerregistration".to_string(), false)]);
    }
}

#[tokio::test]
async fn a_kubectl_owner_annotation_counts_only_where_the_admission_policy_is_trusted() {
    for (trusted, expected) in [(false, None), (true, Some("alice".to_string()))] {
        let (client, server) = api_server();
        let (ctx, _) = context(client, trusted);
        let mut r1 = registration("r1", "s1", AgentSurface::Codex);
        r1.metadata.annotations = Some([(OWNER_ANNOTATION.to_string(), "alice".to_string())].into());
        reconciled(&server, &ctx, "controllerregistrations", &mut r1).await.expect("reconciled");
        let new = ctx.election.last_new.lock().expect("lock").clone().expect("registered");
        assert_eq!(new.owner, expected, "trusted: {trusted}");
        assert!(!new.through_api, "kubectl's registration is the reconciler's to write");
    }
}

#[tokio::test]
async fn a_registration_the_api_made_waits_for_its_row_and_is_deleted_when_it_never_comes() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut fresh = registration("fresh", "s1", AgentSurface::Codex);
    fresh.metadata.annotations = Some([(REGISTERED_BY_ANNOTATION.to_string(), REGISTERED_BY_API.to_string())].into());
    let action = reconciled(&server, &ctx, "controllerregistrations", &mut fresh).await.expect("fresh");
    assert_eq!(action, Action::requeue(Duration::from_secs(5)), "the API's own call writes the row");
    assert!(server.writes().is_empty(), "no status while waiting: {:?}", server.writes());
    assert_eq!(ctx.election.called("register"), 0, "one writer per registration: the API");

    let mut orphan = fresh.clone();
    orphan.metadata.name = Some("orphan".into());
    orphan.metadata.creation_timestamp = Some(to_k8s(Utc::now() - ORPHAN_GRACE - chrono::Duration::seconds(1)));
    let action = reconciled(&server, &ctx, "controllerregistrations", &mut orphan).await.expect("orphan");
    assert_eq!(action, Action::await_change());
    let deletes: Vec<_> = server.writes().into_iter().filter(|s| s.method == "DELETE").collect();
    assert_eq!(deletes.len(), 1);
    assert_eq!(deletes[0].path, registration_path("orphan"));
    assert_eq!(deletes[0].body["preconditions"]["uid"], uid_of(&orphan).to_string(), "only that resource");
    assert_eq!(ctx.election.called("register"), 0, "a leftover never comes back to life as a registration");
}

#[tokio::test]
async fn deleting_the_master_releases_it_promotes_the_successor_and_lets_it_go() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut master = registration("master", "s1", AgentSurface::Codex);
    let mut peer = registration("peer", "s2", AgentSurface::Codex);
    reconciled(&server, &ctx, "controllerregistrations", &mut master).await.expect("master");
    reconciled(&server, &ctx, "controllerregistrations", &mut peer).await.expect("peer");

    master.metadata.deletion_timestamp = Some(to_k8s(Utc::now()));
    let action = reconciled(&server, &ctx, "controllerregistrations", &mut master).await.expect("cleanup");
    assert_eq!(action, Action::await_change());
    let row = ctx.election.row(uid_of(&master)).expect("row kept until retention");
    assert_eq!(row.release_reason, Some(ReleaseReason::Wrapped));
    assert_eq!(ctx.election.gone(), [uid_of(&master)], "its row may be pruned now");
    let finalizer_removed = server
        .writes()
        .into_iter()
        .any(|s| s.method == "PATCH" && s.path == registration_path("master") && s.body.to_string().contains("remove"));
    assert!(finalizer_removed, "the finalizer goes after the release: {:?}", server.writes());

    reconciled(&server, &ctx, "controllerregistrations", &mut peer).await.expect("successor");
    let promoted = server.last_status(&registration_path("peer")).expect("status");
    assert_eq!((promoted["role"].as_str(), promoted["term"].as_i64()), (Some("Master"), Some(2)));
    assert_eq!(server.event_reasons(), ["BecameMaster", "Released", "Promoted"]);
}

#[tokio::test]
async fn a_failed_release_keeps_the_finalizer_and_fails_the_reconcile() {
    let (client, server) = api_server();
    let (ctx, metrics) = context(client, false);
    let mut r1 = registration("r1", "s1", AgentSurface::Codex);
    reconciled(&server, &ctx, "controllerregistrations", &mut r1).await.expect("registered");
    let writes = server.writes().len();
    ctx.election.down.store(true, Ordering::SeqCst);
    r1.metadata.deletion_timestamp = Some(to_k8s(Utc::now()));
    let error = reconciled(&server, &ctx, "controllerregistrations", &mut r1).await.expect_err("Postgres is down");
    assert!(error.to_string().contains("unavailable"), "the store's error says what failed: {error}");
    assert_eq!(server.writes().len(), writes, "nothing written, the finalizer stays: {:?}", server.writes());
    assert_eq!(metrics.reconciles.lock().expect("metrics").last(), Some(&("controllerregistration".to_string(), true)));
    assert_eq!(ctx.election.row(uid_of(&r1)).map(|r| r.is_live()), Some(true));
}

#[tokio::test]
async fn a_stale_heartbeat_shows_stale_and_a_released_registration_is_left_alone() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut r1 = registration("r1", "s1", AgentSurface::Codex);
    reconciled(&server, &ctx, "controllerregistrations", &mut r1).await.expect("registered");
    let mut row: Registration = ctx.election.row(uid_of(&r1)).expect("row");
    row.last_heartbeat = Utc::now() - chrono::Duration::minutes(6);
    ctx.election.put(row.clone());
    reconciled(&server, &ctx, "controllerregistrations", &mut r1).await.expect("stale");
    let status = server.last_status(&registration_path("r1")).expect("status");
    assert_eq!(condition(&status, "Stale"), ("True", "HeartbeatStale"));
    assert_eq!(status["role"], "Master", "stale is shown; the sweep, not the reconcile, releases");

    row.released_at = Some(Utc::now());
    row.release_reason = Some(ReleaseReason::StaleHeartbeatIncident);
    row.is_master = false;
    ctx.election.put(row);
    let action = reconciled(&server, &ctx, "controllerregistrations", &mut r1).await.expect("released");
    let status = server.last_status(&registration_path("r1")).expect("status");
    assert_eq!(status["role"], "Released");
    assert_eq!(status["releaseReason"], "stale_heartbeat_incident");
    assert_eq!(condition(&status, "Ready"), ("False", "StaleHeartbeatIncident"));
    assert_eq!(action, Action::await_change(), "a released registration is not requeued");
    assert_eq!(server.event_reasons(), ["BecameMaster", "Released"]);
}

#[tokio::test]
async fn retention_deletes_only_the_released_resource_it_names_and_marks_it_gone() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut old = registration("old", "s1", AgentSurface::Codex);
    let mut gone_already = registration("gone", "s2", AgentSurface::Codex);
    let mut live = registration("live", "s3", AgentSurface::Codex);
    for obj in [&mut old, &mut gone_already, &mut live] {
        reconciled(&server, &ctx, "controllerregistrations", obj).await.expect("registered");
    }
    for obj in [&old, &gone_already] {
        let mut row = ctx.election.row(uid_of(obj)).expect("row");
        row.released_at = Some(Utc::now() - chrono::Duration::hours(25));
        row.release_reason = Some(ReleaseReason::Wrapped);
        ctx.election.put(row);
    }
    // The API server no longer holds this one: its delete is a 404, and it is done.
    server.forget(&registration_path("gone"));
    retain(&ctx, Some(NS)).await.expect("retention");
    let deletes: Vec<_> = server.writes().into_iter().filter(|s| s.method == "DELETE").collect();
    let paths: Vec<&str> = deletes.iter().map(|d| d.path.as_str()).collect();
    assert!(paths.contains(&registration_path("old").as_str()), "{paths:?}");
    assert!(!paths.contains(&registration_path("live").as_str()), "a live registration is never deleted");
    let old_delete = deletes.iter().find(|d| d.path == registration_path("old")).expect("old deleted");
    assert_eq!(old_delete.body["preconditions"]["uid"], uid_of(&old).to_string(), "never a later resource");
    let mut gone = ctx.election.gone();
    gone.sort();
    let mut expected = vec![uid_of(&old), uid_of(&gone_already)];
    expected.sort();
    assert_eq!(gone, expected);
}

// ---- RunSession (SPEC §5, §12) -------------------------------------------------------

fn runsession_path(name: &str) -> String {
    path_of("runsessions", name)
}

fn runsession(name: &str, server_instance: &str) -> RunSession {
    let mut obj = RunSession::new(
        name,
        RunSessionSpec {
            server_instance_id: server_instance.into(),
            component_kind: "run".into(),
            credential: RunCredential { public_key: "a2V5LTE=".into(), generation: 1 },
            lease_seconds: None,
            paused: false,
        },
    );
    obj.metadata.namespace = Some(NS.into());
    obj.metadata.uid = Some(Uuid::new_v4().to_string());
    obj.metadata.generation = Some(1);
    obj.metadata.resource_version = Some("1".into());
    obj.metadata.finalizers = Some(vec![super::run_session::FINALIZER.into()]);
    obj
}

fn address(server_instance: &str) -> RunAddress {
    RunAddress { server_instance_id: server_instance.into(), component_kind: "run".into() }
}

#[tokio::test]
async fn a_run_is_pending_until_its_hello_then_online_and_checked_again_when_its_lease_ends() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut rs = runsession("rs", "srv-1");
    let action = reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("pending");
    let status = server.last_status(&runsession_path("rs")).expect("status");
    assert_eq!((status["phase"].as_str(), status["online"].as_bool()), (Some("Pending"), Some(false)));
    assert_eq!(condition(&status, "Online"), ("False", "NeverConnected"));
    assert_eq!(condition(&status, "Ready"), ("True", "Identity"));
    assert_eq!(action, Action::requeue(Duration::from_secs(30)), "the default lease");

    ctx.registry.hello(&address("srv-1"), Duration::from_secs(12), false).expect("the identity is mirrored");
    let action = reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("online");
    let status = server.last_status(&runsession_path("rs")).expect("status");
    assert_eq!((status["phase"].as_str(), status["online"].as_bool()), (Some("Online"), Some(true)));
    assert_eq!(status["version"], "1.4.2");
    assert_eq!(status["capacity"]["slots"], 2);
    assert_eq!(condition(&status, "Online"), ("True", "LeaseHeld"));
    assert_eq!(condition(&status, "Draining"), ("False", "NotDraining"));
    assert_eq!(action, Action::requeue(Duration::from_millis(12_250)), "right after the lease would end");
    assert_eq!(server.event_reasons(), ["Online"]);
    let text = serde_json::to_string(&status).unwrap_or_default();
    assert!(!text.contains("a2V5LTE="), "status never carries the credential: {text}");
}

#[tokio::test]
async fn a_rotated_key_ends_the_older_keys_session_at_the_next_reconcile() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut rs = runsession("rs", "srv-1");
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("mirrored");
    ctx.registry.hello(&address("srv-1"), Duration::from_secs(30), false).expect("hello");
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("online");

    rs.spec.credential = RunCredential { public_key: "a2V5LTI=".into(), generation: 2 };
    rs.metadata.generation = Some(2);
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("rotated");
    assert_eq!(ctx.registry.session(&address("srv-1")), None, "the older key's session is ended");
    let status = server.last_status(&runsession_path("rs")).expect("status");
    assert_eq!(
        (status["phase"].as_str(), status["unavailableReason"].as_str()),
        (Some("Offline"), Some("credential_rotated"))
    );
    assert_eq!(status["observedGeneration"], 2);
    assert_eq!(server.event_reasons(), ["Online", "Offline"]);
}

#[tokio::test]
async fn while_redis_is_down_a_run_shows_unavailable_and_an_owed_fence_is_retried_within_a_second() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut rs = runsession("rs", "srv-1");
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("mirrored");
    ctx.registry.redis_down.store(true, Ordering::SeqCst);
    let action = reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("shown, not failed");
    let status = server.last_status(&runsession_path("rs")).expect("status");
    assert_eq!(status["phase"], "Unavailable");
    assert_eq!(condition(&status, "Online"), ("False", "RegistryUnavailable"));
    assert_eq!(action, Action::requeue(Duration::from_secs(5)));

    // A key rotated while Redis is down: the old key's session must end within seconds of
    // Redis coming back, so the fence is tried every second.
    rs.spec.credential = RunCredential { public_key: "a2V5LTI=".into(), generation: 2 };
    let action = reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("rotated");
    assert_eq!(action, Action::requeue(Duration::from_secs(1)));
    let action = reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("still owed");
    assert_eq!(action, Action::requeue(Duration::from_secs(1)), "owed until a fence is written");
    ctx.registry.redis_down.store(false, Ordering::SeqCst);
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("fenced");
    let fenced = ctx.registry.fence_of(&address("srv-1")).expect("a fence was written");
    ctx.registry.redis_down.store(true, Ordering::SeqCst);
    let action = reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("down again");
    assert_eq!(action, Action::requeue(Duration::from_secs(5)), "nothing owed once the fence is written");
    assert!(fenced >= 2, "the fence is the rotated identity's epoch: {fenced}");
}

#[tokio::test]
async fn a_second_resource_for_an_address_is_not_used_and_another_tenants_is_not_named() {
    for (owner_namespace, named) in [(NS, true), ("other-tenant", false)] {
        let (client, server) = api_server();
        let (ctx, _) = context(client, false);
        let mut owner = runsession("owner-rs", "srv-1");
        owner.metadata.namespace = Some(owner_namespace.into());
        ctx.registry.mirror(&super::run_session::identity_of(&owner).expect("identity")).await.expect("owner");
        let mut copy = runsession("copy", "srv-1");
        let action = reconciled(&server, &ctx, "runsessions", &mut copy).await.expect("duplicate");
        let status = server.last_status(&runsession_path("copy")).expect("status");
        assert_eq!(status["phase"], "Pending");
        let ready = status["conditions"].as_array().and_then(|cs| cs.first()).cloned().unwrap_or_default();
        assert_eq!(ready["reason"], "DuplicateIdentity");
        let message = ready["message"].as_str().unwrap_or_default();
        assert_eq!(message.contains("owner-rs"), named, "{owner_namespace}: {message}");
        assert_eq!(ctx.registry.called("fence"), 0, "a duplicate fences nothing of the owner's");
        assert_eq!(action, Action::requeue(Duration::from_secs(30)));
        assert_eq!(server.event_reasons(), ["DuplicateIdentity"]);
    }
}

#[tokio::test]
async fn a_paused_run_and_a_draining_run_show_who_drained_them() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut rs = runsession("rs", "srv-1");
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("mirrored");
    ctx.registry.hello(&address("srv-1"), Duration::from_secs(30), true).expect("hello, draining");
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("draining");
    let status = server.last_status(&runsession_path("rs")).expect("status");
    assert_eq!(status["phase"], "Draining");
    assert_eq!(condition(&status, "Draining"), ("True", "RunDraining"));

    ctx.registry.hello(&address("srv-1"), Duration::from_secs(30), false).expect("hello, not draining");
    rs.spec.paused = true;
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("paused");
    let status = server.last_status(&runsession_path("rs")).expect("status");
    assert_eq!(condition(&status, "Draining"), ("True", "Paused"), "the cordon wins over the Run's word");
    assert_eq!(server.event_reasons(), ["Online", "Draining"], "one drain, however it is caused");
}

/// An unchanged identity is not read from Postgres at every lease: the memo answers,
/// and a change of the spec (or a rotation) mirrors again. The fence, the level-triggered
/// revocation, still runs every time.
#[tokio::test]
async fn an_unchanged_identity_is_mirrored_once_and_a_changed_one_again() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut rs = runsession("rs", "srv-1");
    for _ in 0..3 {
        reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("reconciled");
    }
    assert_eq!(ctx.registry.called("mirror"), 1, "the unchanged identity is read once");
    assert_eq!(ctx.registry.called("fence"), 3, "the fence runs every reconcile");
    rs.spec.paused = true;
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("paused");
    assert_eq!(ctx.registry.called("mirror"), 2, "a changed spec is mirrored");
    rs.spec.credential = RunCredential { public_key: "a2V5LTI=".into(), generation: 2 };
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("rotated");
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("again");
    assert_eq!(ctx.registry.called("mirror"), 3, "a rotation is mirrored once");
    assert!(ctx.registry.fence_of(&address("srv-1")).is_some_and(|e| e >= 2), "fenced to the rotated epoch");
}

#[tokio::test]
async fn deleting_a_runsession_revokes_its_identity_and_ends_its_session() {
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut rs = runsession("rs", "srv-1");
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("mirrored");
    ctx.registry.hello(&address("srv-1"), Duration::from_secs(30), false).expect("hello");
    ctx.registry.unfinished_jobs.store(3, Ordering::SeqCst);
    rs.metadata.deletion_timestamp = Some(to_k8s(Utc::now()));
    let action = reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("cleanup");
    assert_eq!(action, Action::await_change());
    assert_eq!(ctx.registry.session(&address("srv-1")), None, "its session ended");
    assert_eq!(ctx.registry.called("revoke"), 1);
    let identity = super::run_session::identity_of(&rs).expect("identity");
    assert_eq!(ctx.registry.revoke(&identity, REVOKED_EPOCH_TTL).await.expect("again"), None, "revoked once");
    let finalizer_removed = server.writes().into_iter().any(|s| s.method == "PATCH" && s.path == runsession_path("rs"));
    assert!(finalizer_removed, "the finalizer goes after the revocation: {:?}", server.writes());
}

#[tokio::test]
async fn a_revocation_that_fails_at_redis_keeps_the_finalizer_for_the_next_try() {
    let (client, server) = api_server();
    let (ctx, metrics) = context(client, false);
    let mut rs = runsession("rs", "srv-1");
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("mirrored");
    let writes = server.writes().len();
    ctx.registry.redis_down.store(true, Ordering::SeqCst);
    rs.metadata.deletion_timestamp = Some(to_k8s(Utc::now()));
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect_err("Redis is down");
    assert_eq!(server.writes().len(), writes, "the finalizer stays: {:?}", server.writes());
    assert_eq!(metrics.reconciles.lock().expect("metrics").last(), Some(&("runsession".to_string(), true)));
}

// ---- the loops beside the reconcilers ------------------------------------------------

#[tokio::test]
async fn the_registry_watch_asks_for_every_runsession_when_redis_goes_and_when_it_comes_back() {
    let (client, _server) = api_server();
    let (ctx, _) = context(client, false);
    let (changed, mut changes) = tokio::sync::mpsc::unbounded_channel();
    let watch = tokio::spawn(run_registry_watch(ctx.clone(), Duration::from_millis(5), changed));
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(changes.try_recv().is_err(), "nothing while Redis answers");
    ctx.registry.redis_down.store(true, Ordering::SeqCst);
    let went = tokio::time::timeout(Duration::from_secs(2), changes.recv()).await;
    assert_eq!(went.ok().flatten(), Some(()), "Redis went away");
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(changes.try_recv().is_err(), "once per change, not per look");
    ctx.registry.redis_down.store(false, Ordering::SeqCst);
    let came = tokio::time::timeout(Duration::from_secs(2), changes.recv()).await;
    assert_eq!(came.ok().flatten(), Some(()), "Redis came back");
    watch.abort();
}

#[tokio::test]
async fn the_reaper_counts_what_it_ended_by_outcome() {
    let (client, _server) = api_server();
    let (ctx, metrics) = context(client, false);
    *ctx.registry.reaped.lock().expect("lock") =
        prism_core::run::Reaped { requeued: 2, failed: 1, cancelled: 0, expired: 0, stale_term: 0 };
    let reaper = tokio::spawn(run_reaper(ctx.clone(), Duration::from_millis(5)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    reaper.abort();
    let attempts = metrics.attempts.lock().expect("metrics").clone();
    assert_eq!(attempts, [("requeued".to_string(), 2), ("failed".to_string(), 1)]);
    assert!(ctx.registry.called("reap") > 1, "the reaper keeps going");
}

// ---- The watch cache's packed form ------------------------------------------------

/// Objects as the reconcilers leave them (status written, a label and an annotation) are
/// cached in at most a quarter of their JSON (1,308 and 1,087 bytes packed to 202 and 126
/// when this was written), and unpack whole.
#[tokio::test]
async fn reconciled_objects_pack_small_and_unpack_whole() {
    use super::packed::Packed;
    let (client, server) = api_server();
    let (ctx, _) = context(client, false);
    let mut reg = registration("r1", "7d0f6a52-3a51-4f0e-9d1e-2f7ad3c0b8e4", AgentSurface::ClaudeCode);
    reg.metadata.annotations =
        Some([(OWNER_ANNOTATION.to_string(), "system:serviceaccount:team-a:agent".to_string())].into());
    reconciled(&server, &ctx, "controllerregistrations", &mut reg).await.expect("master");
    let mut rs = runsession("rs", "srv-1");
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("mirrored");
    ctx.registry.hello(&address("srv-1"), Duration::from_secs(30), false).expect("hello");
    reconciled(&server, &ctx, "runsessions", &mut rs).await.expect("online");

    let json = serde_json::to_vec(&reg).unwrap_or_default();
    let packed = Packed::pack(reg.clone()).expect("pack");
    assert_eq!(serde_json::to_vec(&packed.unpack().expect("unpack")).unwrap_or_default(), json);
    assert!(packed.packed_len() * 4 <= json.len(), "{} of {}", packed.packed_len(), json.len());

    let json = serde_json::to_vec(&rs).unwrap_or_default();
    let packed = Packed::pack(rs.clone()).expect("pack");
    assert_eq!(serde_json::to_vec(&packed.unpack().expect("unpack")).unwrap_or_default(), json);
    assert!(packed.packed_len() * 4 <= json.len(), "{} of {}", packed.packed_len(), json.len());
}

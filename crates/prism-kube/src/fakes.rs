//! Fakes for the fast reconcile tests (tests only; a mock, and said so): the store traits
//! over maps in memory, and an API server that answers as kube-apiserver does for the few
//! requests a reconcile makes (merge and JSON patches, deletes, Events) and
//! records every one. The election fake applies prism-core's own rules (`decide`), so a
//! test that registers a desktop session after a codex one sees the preemption the real
//! store would write; what the fakes leave out (locks, retries, the context switch of
//! rule 7, quotas counted) is the real-service suites' (tests/election.rs, tests/runtime.rs).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};
use http::{Request, Response};
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::reconcilers::{Context, ReconcileMetrics, Retention, Written};
use prism_core::election::{
    Candidate, Event, NewRegistration, ProjectState, ProjectView, Pruned, RegisterOutcome, Registration, ReleaseReason,
    Transition, decide,
};
use prism_core::run::{Fenced, IdentitySpec, Mirror, Reaped, RunAddress, Session};
use prism_core::store::{ElectionFailure, Elections, Failure, Refusal, Runs};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fake store's failure: the service is down, or the election refused.
#[derive(Debug, thiserror::Error)]
pub enum FakeError {
    #[error("fake store: unavailable")]
    Down,
    #[error("fake store: refused: {0:?}")]
    Refused(Refusal),
}

impl Failure for FakeError {
    fn unavailable(&self) -> bool {
        matches!(self, FakeError::Down)
    }
}

impl ElectionFailure for FakeError {
    fn refusal(&self) -> Option<Refusal> {
        match self {
            FakeError::Refused(r) => Some(r.clone()),
            FakeError::Down => None,
        }
    }
}

#[derive(Default)]
struct Projects {
    rows: BTreeMap<Uuid, Registration>,
    terms: BTreeMap<(String, String), i64>,
    gone: Vec<Uuid>,
}

/// The election in memory, with the pure rules of prism-core.
#[derive(Default)]
pub struct FakeElection {
    state: Mutex<Projects>,
    /// Every call, by method name, in order.
    pub calls: Mutex<Vec<&'static str>>,
    /// Postgres is down: every call fails as unavailable.
    pub down: AtomicBool,
    /// The next `register` is refused with this.
    pub refuse: Mutex<Option<Refusal>>,
    /// What the last `register` was asked to enter.
    pub last_new: Mutex<Option<NewRegistration>>,
}

impl FakeElection {
    fn enter(&self, call: &'static str) -> Result<MutexGuard<'_, Projects>, FakeError> {
        lock(&self.calls).push(call);
        if self.down.load(Ordering::SeqCst) { Err(FakeError::Down) } else { Ok(lock(&self.state)) }
    }

    /// A row as a test wants it (a released one, one with an old heartbeat).
    pub fn put(&self, row: Registration) {
        lock(&self.state).rows.insert(row.id, row);
    }

    pub fn row(&self, id: Uuid) -> Option<Registration> {
        lock(&self.state).rows.get(&id).cloned()
    }

    pub fn gone(&self) -> Vec<Uuid> {
        lock(&self.state).gone.clone()
    }

    pub fn called(&self, call: &str) -> usize {
        lock(&self.calls).iter().filter(|c| **c == call).count()
    }
}

impl Projects {
    fn live(&self, namespace: &str, project: &str) -> Vec<&Registration> {
        self.rows.values().filter(|r| r.is_live() && r.namespace == namespace && r.project_id == project).collect()
    }

    fn state(&self, namespace: &str, project: &str) -> ProjectState {
        let live = self
            .live(namespace, project)
            .into_iter()
            .map(|r| Candidate {
                id: r.id,
                surface: r.agent_surface,
                registered_at: r.registered_at,
                is_master: r.is_master,
            })
            .collect();
        ProjectState { term: self.terms.get(&(namespace.into(), project.into())).copied().unwrap_or(0), live }
    }

    /// Runs one event of the rules on the project and writes what they decided.
    fn elect(&mut self, namespace: &str, project: &str, before: ProjectState, event: &Event, now: DateTime<Utc>) {
        let decision = decide(&before, event);
        for (id, transition) in &decision.transitions {
            let Some(row) = self.rows.get_mut(id) else { continue };
            match transition {
                Transition::JoinedAsMaster | Transition::Promoted => {
                    row.is_master = true;
                    row.master_term = Some(decision.next.term);
                }
                Transition::JoinedAsPeer => row.is_master = false,
                Transition::Preempted { by } => {
                    row.is_master = false;
                    row.preempted = true;
                    row.preempted_by = Some(*by);
                }
                Transition::Released { reason, .. } => {
                    row.is_master = false;
                    row.released_at = Some(now);
                    row.release_reason = Some(*reason);
                }
            }
        }
        self.terms.insert((namespace.into(), project.into()), decision.next.term);
    }
}

impl Elections for FakeElection {
    type Error = FakeError;

    async fn get(&self, id: Uuid) -> Result<Option<Registration>, FakeError> {
        Ok(self.enter("get")?.rows.get(&id).cloned())
    }

    async fn register(&self, new: &NewRegistration) -> Result<RegisterOutcome, FakeError> {
        let mut s = self.enter("register")?;
        *lock(&self.last_new) = Some(new.clone());
        if let Some(refusal) = lock(&self.refuse).take() {
            return Err(FakeError::Refused(refusal));
        }
        if let Some(row) = s.rows.get(&new.id) {
            return Ok(RegisterOutcome::Registered(row.clone()));
        }
        let same_session = s.live(&new.namespace, &new.project_id).into_iter().find(|r| r.session_id == new.session_id);
        if let Some(existing) = same_session {
            return Ok(RegisterOutcome::DuplicateSession { existing: existing.clone() });
        }
        let now = Utc::now();
        // The project as it was: the rules see the newcomer arrive.
        let before = s.state(&new.namespace, &new.project_id);
        let row = Registration {
            id: new.id,
            namespace: new.namespace.clone(),
            name: new.name.clone(),
            project_id: new.project_id.clone(),
            session_id: new.session_id.clone(),
            agent_surface: new.surface,
            is_master: false,
            master_term: None,
            registered_at: now,
            last_heartbeat: now,
            released_at: None,
            release_reason: None,
            preempted: false,
            preempted_by: None,
        };
        s.rows.insert(new.id, row);
        let candidate = Candidate { id: new.id, surface: new.surface, registered_at: now, is_master: false };
        s.elect(&new.namespace, &new.project_id, before, &Event::Register(candidate), now);
        let row = s.rows.get(&new.id).cloned().ok_or(FakeError::Down)?;
        Ok(RegisterOutcome::Registered(row))
    }

    async fn project(&self, namespace: &str, project_id: &str) -> Result<ProjectView, FakeError> {
        let s = self.enter("project")?;
        let mut live: Vec<Registration> = s.live(namespace, project_id).into_iter().cloned().collect();
        live.sort_by_key(|r| (!r.is_master, r.registered_at));
        Ok(ProjectView {
            term: s.terms.get(&(namespace.into(), project_id.into())).copied().unwrap_or(0),
            changes: 0,
            master: live.iter().find(|r| r.is_master).cloned(),
            live,
        })
    }

    async fn release(&self, id: Uuid, reason: ReleaseReason) -> Result<bool, FakeError> {
        let mut s = self.enter("release")?;
        let Some(row) = s.rows.get(&id).filter(|r| r.is_live()).cloned() else { return Ok(false) };
        let before = s.state(&row.namespace, &row.project_id);
        s.elect(&row.namespace, &row.project_id, before, &Event::Release { ids: vec![id], reason }, Utc::now());
        Ok(true)
    }

    async fn resource_gone(&self, id: Uuid) -> Result<(), FakeError> {
        self.enter("resource_gone")?.gone.push(id);
        Ok(())
    }

    async fn sweep(&self, _stale_minutes: u32) -> Result<usize, FakeError> {
        self.enter("sweep").map(|_| 0)
    }

    async fn released_resources(
        &self,
        hours: u32,
        namespace: Option<&str>,
        limit: i64,
    ) -> Result<Vec<(Uuid, String, String)>, FakeError> {
        let s = self.enter("released_resources")?;
        let before = Utc::now() - chrono::Duration::hours(i64::from(hours));
        Ok(s.rows
            .values()
            .filter(|r| r.released_at.is_some_and(|at| at < before) && !s.gone.contains(&r.id))
            .filter(|r| namespace.is_none_or(|ns| ns == r.namespace))
            .take(usize::try_from(limit).unwrap_or(0))
            .map(|r| (r.id, r.namespace.clone(), r.name.clone()))
            .collect())
    }

    async fn prune(&self, _days: u32) -> Result<Pruned, FakeError> {
        self.enter("prune").map(|_| Pruned::default())
    }
}

#[derive(Default)]
struct Identities {
    /// id → (spec, epoch, revoked)
    rows: BTreeMap<Uuid, (IdentitySpec, i64, bool)>,
    sessions: BTreeMap<RunAddress, Session>,
    /// address → the epoch a fence wrote last
    fences: BTreeMap<RunAddress, i64>,
    next_epoch: i64,
}

/// The registry of Runs in memory: identities with epochs (Postgres's part), sessions
/// and fences (Redis's part), and a reaper that reports what a test set.
#[derive(Default)]
pub struct FakeRuns {
    state: Mutex<Identities>,
    pub calls: Mutex<Vec<&'static str>>,
    /// Redis is down: fence and ping fail as unavailable (mirror and revoke's Postgres
    /// step do not).
    pub redis_down: AtomicBool,
    /// What the next reap reports.
    pub reaped: Mutex<Reaped>,
    /// Jobs a revoke cancels.
    pub unfinished_jobs: AtomicU64,
}

impl FakeRuns {
    fn enter(&self, call: &'static str) -> MutexGuard<'_, Identities> {
        lock(&self.calls).push(call);
        lock(&self.state)
    }

    /// A Run's hello, as the API would have opened it: a live session of the address's
    /// current epoch (None: no identity owns the address).
    pub fn hello(&self, address: &RunAddress, lease_left: Duration, draining: bool) -> Option<Session> {
        let mut s = lock(&self.state);
        let epoch = s.rows.values().find(|(spec, _, revoked)| !revoked && spec.address() == *address)?.1;
        let now = Utc::now();
        let session = Session {
            session_id: Uuid::new_v4(),
            generation: 1,
            epoch,
            started_at: now,
            last_heartbeat: now,
            version: Some("1.4.2".into()),
            target: None,
            capabilities: vec!["lifecycle".into()],
            capacity: [("slots".to_string(), 2)].into(),
            draining,
            lease_left,
        };
        s.sessions.insert(address.clone(), session.clone());
        Some(session)
    }

    pub fn session(&self, address: &RunAddress) -> Option<Session> {
        lock(&self.state).sessions.get(address).cloned()
    }

    pub fn fence_of(&self, address: &RunAddress) -> Option<i64> {
        lock(&self.state).fences.get(address).copied()
    }

    pub fn called(&self, call: &str) -> usize {
        lock(&self.calls).iter().filter(|c| **c == call).count()
    }
}

impl Runs for FakeRuns {
    type Error = FakeError;

    async fn mirror(&self, identity: &IdentitySpec) -> Result<Mirror, FakeError> {
        let mut s = self.enter("mirror");
        let address = identity.address();
        if let Some((owner, _, _)) =
            s.rows.values().find(|(spec, _, revoked)| !revoked && spec.id != identity.id && spec.address() == address)
        {
            return Ok(Mirror::Duplicate { owner_namespace: owner.namespace.clone(), owner_name: owner.name.clone() });
        }
        s.next_epoch += 1;
        let fresh = s.next_epoch;
        match s.rows.get_mut(&identity.id) {
            Some((_, _, true)) => Ok(Mirror::Revoked),
            Some((spec, epoch, false)) => {
                let rotated = spec.public_key != identity.public_key || spec.key_generation != identity.key_generation;
                if rotated {
                    *epoch = fresh;
                }
                *spec = identity.clone();
                Ok(Mirror::Owned { rotated, epoch: *epoch })
            }
            None => {
                s.rows.insert(identity.id, (identity.clone(), fresh, false));
                Ok(Mirror::Owned { rotated: false, epoch: fresh })
            }
        }
    }

    fn lease_seconds(&self, lease_seconds: Option<i32>) -> u32 {
        lease_seconds.map(|s| s.max(1) as u32).unwrap_or(30)
    }

    async fn fence(&self, address: &RunAddress, epoch: i64) -> Result<Fenced, FakeError> {
        let mut s = self.enter("fence");
        if self.redis_down.load(Ordering::SeqCst) {
            return Err(FakeError::Down);
        }
        s.fences.insert(address.clone(), epoch);
        Ok(match s.sessions.get(address).cloned() {
            Some(session) if session.epoch < epoch => {
                s.sessions.remove(address);
                Fenced::Revoked
            }
            Some(session) => Fenced::Live(session),
            None => Fenced::Absent,
        })
    }

    async fn revoke(&self, identity: &IdentitySpec, _revoked_ttl: Duration) -> Result<Option<u64>, FakeError> {
        let mut s = self.enter("revoke");
        s.next_epoch += 1;
        let fresh = s.next_epoch;
        let Some((_, epoch, revoked)) = s.rows.get_mut(&identity.id).filter(|(_, _, revoked)| !revoked) else {
            return Ok(None);
        };
        *revoked = true;
        *epoch = fresh;
        if self.redis_down.load(Ordering::SeqCst) {
            return Err(FakeError::Down);
        }
        s.fences.insert(identity.address(), fresh);
        s.sessions.remove(&identity.address());
        Ok(Some(self.unfinished_jobs.load(Ordering::SeqCst)))
    }

    async fn prune(&self, _days: u32) -> Result<(u64, u64), FakeError> {
        let _held = self.enter("prune");
        Ok((0, 0))
    }

    async fn reap(&self) -> Result<Reaped, FakeError> {
        let _held = self.enter("reap");
        Ok(std::mem::take(&mut *lock(&self.reaped)))
    }

    async fn ping(&self) -> Result<(), FakeError> {
        let _held = self.enter("ping");
        if self.redis_down.load(Ordering::SeqCst) { Err(FakeError::Down) } else { Ok(()) }
    }
}

/// The reconcile metrics, counted.
#[derive(Default)]
pub struct CountedMetrics {
    pub reconciles: Mutex<Vec<(String, bool)>>,
    pub attempts: Mutex<Vec<(String, u64)>>,
}

impl ReconcileMetrics for CountedMetrics {
    fn reconciled(&self, controller: &str, _took: Duration, failed: bool) {
        lock(&self.reconciles).push((controller.to_string(), failed));
    }

    fn attempts_ended(&self, outcome: &str, n: u64) {
        if n > 0 {
            lock(&self.attempts).push((outcome.to_string(), n));
        }
    }
}

/// One request the API server got.
#[derive(Clone, Debug)]
pub struct Sent {
    pub method: String,
    pub path: String,
    pub body: Value,
}

/// The API server's side of a test: what it was sent, and the objects it holds (by
/// path), which its answers are made of.
#[derive(Clone, Default)]
pub struct ApiServer {
    pub sent: Arc<Mutex<Vec<Sent>>>,
    objects: Arc<Mutex<BTreeMap<String, Value>>>,
}

impl ApiServer {
    /// Holds `obj` at `path` (what GETs and patches of that path answer with).
    pub fn hold(&self, path: &str, obj: Value) {
        lock(&self.objects).insert(path.to_string(), obj);
    }

    /// The object at `path` is gone (deleted by someone else).
    pub fn forget(&self, path: &str) {
        lock(&self.objects).remove(path);
    }

    pub fn sent(&self) -> Vec<Sent> {
        lock(&self.sent).clone()
    }

    /// The status written last to the object at `path` (the merge patch's `status`).
    pub fn last_status(&self, path: &str) -> Option<Value> {
        let status = format!("{path}/status");
        self.sent()
            .into_iter()
            .rev()
            .find(|s| s.method == "PATCH" && s.path == status)
            .map(|s| s.body["status"].clone())
    }

    /// The reasons of the Events recorded, in order.
    pub fn event_reasons(&self) -> Vec<String> {
        self.sent()
            .into_iter()
            .filter(|s| s.method == "POST" && s.path.ends_with("/events"))
            .map(|s| s.body["reason"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    pub fn writes(&self) -> Vec<Sent> {
        self.sent().into_iter().filter(|s| s.method != "GET").collect()
    }

    fn answer(&self, method: &str, path: &str, body: &Value) -> (u16, Value) {
        let object_path = path.strip_suffix("/status").unwrap_or(path);
        let mut objects = lock(&self.objects);
        match method {
            "POST" if path.ends_with("/events") => (201, body.clone()),
            "GET" => match objects.get(path) {
                Some(obj) => (200, obj.clone()),
                None => not_found(),
            },
            "PATCH" => match objects.get_mut(object_path) {
                // A JSON patch is only ever kube's `finalizer()` here, adding or removing
                // the one finalizer: its result is all this fake keeps of it.
                Some(obj) if body.is_array() => {
                    let removes = body.as_array().is_some_and(|ops| ops.iter().any(|op| op["op"] == "remove"));
                    if removes && let Some(meta) = obj["metadata"].as_object_mut() {
                        meta.remove("finalizers");
                    }
                    (200, obj.clone())
                }
                Some(obj) => {
                    merge(obj, body);
                    (200, obj.clone())
                }
                None => not_found(),
            },
            "DELETE" => match objects.remove(path) {
                Some(obj) => (200, obj),
                None => not_found(),
            },
            _ => (405, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 405})),
        }
    }
}

fn not_found() -> (u16, Value) {
    (
        404,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "NotFound", "code": 404}),
    )
}

/// A JSON merge patch (RFC 7386), as the API server applies one.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// A client whose requests the returned `ApiServer` answers and records.
pub fn api_server() -> (Client, ApiServer) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let server = ApiServer::default();
    let answering = server.clone();
    tokio::spawn(async move {
        while let Some((req, reply)) = handle.next_request().await {
            let method = req.method().to_string();
            let path = req.uri().path().to_string();
            let bytes = req.into_body().collect_bytes().await.unwrap_or_default();
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let (code, answer) = answering.answer(&method, &path, &body);
            lock(&answering.sent).push(Sent { method, path, body });
            let bytes = serde_json::to_vec(&answer).unwrap_or_default();
            let response = Response::builder().status(code).body(Body::from(bytes));
            if let Ok(response) = response {
                reply.send_response(response);
            }
        }
    });
    (Client::new(service, "default"), server)
}

/// PRISM_STATUS_HEARTBEAT_SECONDS in these tests (the default).
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(120);

/// A leader's context over the fakes and the fake API server.
pub fn context(
    client: Client,
    trust_owner_annotation: bool,
) -> (Arc<Context<FakeElection, FakeRuns>>, Arc<CountedMetrics>) {
    let metrics = Arc::new(CountedMetrics::default());
    let ctx = Context {
        events: crate::reconcilers::EventPublisher::new(client.clone(), None),
        client,
        election: FakeElection::default(),
        registry: FakeRuns::default(),
        stale_after: chrono::Duration::minutes(5),
        status_heartbeat: HEARTBEAT_EVERY,
        metrics: metrics.clone(),
        reconcile_concurrency: 1,
        written_registrations: Written::new(HEARTBEAT_EVERY),
        written_runsessions: Written::new(HEARTBEAT_EVERY),
        failures: Default::default(),
        trust_owner_annotation,
        fences_owed: moka::sync::Cache::new(100),
        mirrored: crate::reconcilers::run_session::MirrorMemo::new(
            100,
            crate::reconcilers::run_session::MIRROR_MEMO_TTL,
        ),
        retention: Retention { released_hours: 24, history_days: 30, every: Duration::from_secs(3600) },
    };
    (Arc::new(ctx), metrics)
}

//! What Runs do over HTTP, as a service: hello (prove possession, get a session lease),
//! heartbeat, claim jobs and report on them; plus the safe status projection.

use std::collections::BTreeMap;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use utoipa::ToSchema;
use utoipa::openapi::schema::{ArrayBuilder, KnownFormat, ObjectBuilder, Schema, SchemaFormat, SchemaType, Type};
use uuid::Uuid;

use super::RegistryError;
use super::identity::{Acting, HelloMark, Identity, IdentitySpec, IdentityStore, Mirror};
use super::jobs::{
    Attempt, Cancel, Cursor, Eligibility, Enqueued, Job, JobCensus, JobFilter, JobStore, NewJob, Reaped, Step,
    StepRefused,
};
use super::proof;
use super::sessions::{
    Fenced, HelloOutcome, Lease, NewSession, Renewal, RunAddress, Session, SessionStore, TokenCheck,
};
use crate::signals::Signals;
use prism_core::run::RunTarget;

// Hello signatures, checked on a thread of their own.
mod prover;

pub const TOKEN_PREFIX: &str = "prs1";
const NO_CAPACITY: &BTreeMap<String, i64> = &BTreeMap::new();

/// What `name_ok` accepts (with lengths 1-63): capability and capacity names.
pub const NAME_PATTERN: &str = "^[a-z][a-z0-9_]*$";
/// At most this many capabilities, and capacity entries.
const MAX_SNAPSHOT_ENTRIES: usize = 32;

/// The hello request (SPEC §8).
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    #[schema(min_length = 1, max_length = 253, pattern = "^[A-Za-z0-9._-]+$", example = "srv-eu1-7")]
    pub server_instance_id: String,
    #[schema(min_length = 1, max_length = 63, pattern = "^[a-z0-9-]+$", example = "run")]
    pub component_kind: String,
    /// The RunSession's current key generation.
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "crate::json_int::i64")]
    pub key_generation: i64,
    /// Unix seconds; within 300 s of the operator's clock.
    #[serde(deserialize_with = "crate::json_int::i64")]
    pub timestamp: i64,
    #[schema(min_length = 16, max_length = 128, pattern = "^[A-Za-z0-9_-]{16,128}$", example = "Zk3q9-2LwX0aPq7T")]
    pub nonce: String,
    /// Standard base64 of the 64-byte Ed25519 signature of the six-line hello message.
    pub signature: String,
    #[serde(default)]
    #[schema(max_length = 64, pattern = "^[A-Za-z0-9.+_-]{0,64}$", example = "1.4.2")]
    pub version: Option<String>,
    #[serde(default)]
    pub target: Option<RunTarget>,
    #[serde(default)]
    #[schema(schema_with = capabilities_schema)]
    pub capabilities: Option<Vec<String>>,
    #[serde(default, deserialize_with = "crate::json_int::opt_map_i64")]
    #[schema(schema_with = capacity_schema)]
    pub capacity: Option<BTreeMap<String, i64>>,
}

/// The schema `check_snapshot` enforces on capabilities (null: not given).
pub fn capabilities_schema() -> Schema {
    ArrayBuilder::new()
        .schema_type(SchemaType::Array(vec![Type::Array, Type::Null]))
        .items(name_schema())
        .max_items(Some(MAX_SNAPSHOT_ENTRIES))
        .description(Some("Capability names, e.g. `lifecycle`"))
        .into()
}

/// The schema `check_snapshot` enforces on capacity (null: not given).
pub fn capacity_schema() -> Schema {
    let amount = ObjectBuilder::new()
        .schema_type(Type::Integer)
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
        .minimum(Some(0))
        .maximum(Some(i64::MAX));
    ObjectBuilder::new()
        .schema_type(SchemaType::Array(vec![Type::Object, Type::Null]))
        .property_names(Some(name_schema()))
        .additional_properties(Some(amount))
        .max_properties(Some(MAX_SNAPSHOT_ENTRIES))
        .description(Some("Name -> non-negative amount, e.g. `slots: 4`"))
        .into()
}

fn name_schema() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::String).min_length(Some(1)).max_length(Some(63)).pattern(Some(NAME_PATTERN))
}

#[derive(Clone, Debug, Serialize, PartialEq, ToSchema)]
pub struct Granted {
    pub session_token: String,
    pub lease_ttl_seconds: u32,
    pub heartbeat_interval_seconds: u32,
}

/// Every failure of proof; the caller learns the code and nothing more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProofRefused {
    UnknownIdentity,
    StaleGeneration,
    BadSignature,
    ClockSkew,
    ReplayedNonce,
}

impl ProofRefused {
    pub fn code(self) -> &'static str {
        match self {
            ProofRefused::UnknownIdentity => "unknown_identity",
            ProofRefused::StaleGeneration => "stale_generation",
            ProofRefused::BadSignature => "bad_signature",
            ProofRefused::ClockSkew => "clock_skew",
            ProofRefused::ReplayedNonce => "replayed_nonce",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionRefused {
    /// Not a token this operator issued.
    InvalidToken,
    Superseded,
    Expired,
}

impl SessionRefused {
    pub fn code(self) -> &'static str {
        match self {
            SessionRefused::InvalidToken => "invalid_token",
            SessionRefused::Superseded => "session_superseded",
            SessionRefused::Expired => "session_expired",
        }
    }
}

/// Input shape errors: a 4xx before any proof is checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid(pub String);

pub fn name_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_lowercase()
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_')
}

/// Validates a capability/capacity snapshot: bounded, known-shape names, non-negative amounts.
pub fn check_snapshot(
    capabilities: Option<&Vec<String>>,
    capacity: Option<&BTreeMap<String, i64>>,
) -> Result<(), Invalid> {
    if let Some(caps) = capabilities {
        if caps.len() > MAX_SNAPSHOT_ENTRIES {
            return Err(Invalid("capabilities: at most 32 entries".into()));
        }
        if let Some(bad) = caps.iter().find(|c| !name_ok(c)) {
            return Err(Invalid(format!("capabilities: {bad:?} is not a name of [a-z0-9_] (max 63)")));
        }
    }
    if let Some(cap) = capacity {
        if cap.len() > MAX_SNAPSHOT_ENTRIES {
            return Err(Invalid("capacity: at most 32 entries".into()));
        }
        if let Some((k, _)) = cap.iter().find(|(k, _)| !name_ok(k)) {
            return Err(Invalid(format!("capacity: {k:?} is not a name of [a-z0-9_] (max 63)")));
        }
        if let Some((k, v)) = cap.iter().find(|(_, v)| **v < 0) {
            return Err(Invalid(format!("capacity: {k} must be a non-negative integer, got {v}")));
        }
    }
    Ok(())
}

// The shapes an identity may have: the domain's limits.
pub use prism_core::limits::{component_kind_ok, server_instance_id_ok};

/// A (server, component) address in the shape every identity has; no other can name one.
pub fn check_address(server_instance_id: &str, component_kind: &str) -> Result<(), Invalid> {
    if !server_instance_id_ok(server_instance_id) {
        return Err(Invalid(prism_core::limits::server_instance_id_rule()));
    }
    if !component_kind_ok(component_kind) {
        return Err(Invalid(prism_core::limits::component_kind_rule()));
    }
    Ok(())
}

/// JSON that Postgres `jsonb` can store: no NUL character in any string or key (the
/// insert would fail, a 500, where the caller's input is at fault).
pub fn check_jsonb(field: &str, v: &Value) -> Result<(), Invalid> {
    fn has_nul(v: &Value) -> bool {
        match v {
            Value::String(s) => s.contains('\0'),
            Value::Array(items) => items.iter().any(has_nul),
            Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
            Value::Null | Value::Bool(_) | Value::Number(_) => false,
        }
    }
    if has_nul(v) { Err(Invalid(format!("{field}: JSON without NUL characters (\\u0000)"))) } else { Ok(()) }
}

pub fn version_ok(v: &str) -> bool {
    v.len() <= 64 && v.bytes().all(|c| c.is_ascii_alphanumeric() || b".+_-".contains(&c))
}

/// A target's `os` or `arch`.
pub fn target_part_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= 32 && s.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

pub fn check_hello(h: &Hello) -> Result<(), Invalid> {
    check_address(&h.server_instance_id, &h.component_kind)?;
    if h.key_generation < 1 {
        return Err(Invalid("key_generation: an integer >= 1".into()));
    }
    if !proof::nonce_ok(&h.nonce) {
        return Err(Invalid("nonce: 16-128 characters of [A-Za-z0-9_-]".into()));
    }
    if let Some(v) = &h.version
        && !version_ok(v)
    {
        return Err(Invalid("version: at most 64 characters of [A-Za-z0-9.+_-]".into()));
    }
    if let Some(t) = &h.target
        && (!target_part_ok(&t.os) || !target_part_ok(&t.arch))
    {
        return Err(Invalid("target: os and arch are 1-32 characters of [A-Za-z0-9_]".into()));
    }
    check_snapshot(h.capabilities.as_ref(), h.capacity.as_ref())
}

/// The proof of a checked hello against its identity's key generation and public key, at
/// `now` (Unix seconds). Pure, so every input can be tried on it.
pub fn check_proof(h: &Hello, key_generation: i64, public_key: &str, now: i64) -> Result<(), ProofRefused> {
    if h.key_generation != key_generation {
        return Err(ProofRefused::StaleGeneration);
    }
    if !proof::within_clock_window(h.timestamp, now) {
        return Err(ProofRefused::ClockSkew);
    }
    let message =
        proof::hello_message(&h.server_instance_id, &h.component_kind, h.key_generation, h.timestamp, &h.nonce);
    proof::verify(public_key, &message, &h.signature).map_err(|_| ProofRefused::BadSignature)
}

/// The heartbeat interval a Run is told for a lease of `lease` seconds: a third of it, so
/// two beats may fail before it runs out; but not within 2 s above the API's idle cut of
/// a kept-alive connection (10 s, its header read timeout): a beat sent as the server
/// closes the connection fails, and one of a Run beating every 10 s would meet that
/// about once in 25 (tests/transport.rs). 8 s then (the default lease of 30 s).
pub fn heartbeat_interval(lease: u32) -> u32 {
    match lease / 3 {
        0 => 1,
        10..=11 => 8,
        third => third,
    }
}

/// A session token: a routing part naming the identity (not secret) and 256 random bits.
fn mint_token(a: &RunAddress) -> Result<String, RegistryError> {
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).map_err(|e| RegistryError::Entropy(e.to_string()))?;
    let route = URL_SAFE_NO_PAD.encode(format!("{}\n{}", a.server_instance_id, a.component_kind));
    Ok(format!("{TOKEN_PREFIX}.{route}.{}", URL_SAFE_NO_PAD.encode(secret)))
}

/// The address a token is for, if it is shaped like one of ours.
pub fn token_address(token: &str) -> Option<RunAddress> {
    let mut parts = token.split('.');
    let (Some(TOKEN_PREFIX), Some(route), Some(secret), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    if secret.len() != 43 {
        return None;
    }
    let route = String::from_utf8(URL_SAFE_NO_PAD.decode(route).ok()?).ok()?;
    let (server, component) = route.split_once('\n')?;
    // The route is the caller's text until checked: a forged one (say `}x`) would name
    // keys of two cluster slots and turn a 401 into a CROSSSLOT error (a 503).
    if !server_instance_id_ok(server) || !component_kind_ok(component) {
        return None;
    }
    Some(RunAddress { server_instance_id: server.to_string(), component_kind: component.to_string() })
}

/// Only this hash is stored.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// What Runs do, as one service over the three stores: hello, heartbeat, claim, steps;
/// and what the platform, the reconcilers and the metrics ask of them. The stores are
/// its own: every caller goes through a method here.
#[derive(Clone)]
pub struct RunRegistry {
    sessions: SessionStore,
    identities: IdentityStore,
    jobs: JobStore,
    /// What this process hears of jobs changing on any replica: pending cancels, the
    /// wakes of waiting claims (one listener per process).
    signals: Signals,
    default_lease_seconds: u32,
    /// Where hello signatures are checked (`prover`): off the runtime's workers.
    prover: Option<prover::Prover>,
}

/// The platform's side and the operator's upkeep: what is asked of one store, passed on.
/// A call passed on to one store is traced by that store's span; a span here is only for
/// what does more than one store call.
impl RunRegistry {
    pub fn new(
        sessions: SessionStore,
        identities: IdentityStore,
        jobs: JobStore,
        signals: Signals,
        default_lease_seconds: u32,
    ) -> Self {
        let prover = prover::Prover::start();
        RunRegistry { sessions, identities, jobs, signals, default_lease_seconds, prover }
    }

    /// The live identity of an address (in `namespace`, when given).
    pub async fn identity(&self, namespace: Option<&str>, a: &RunAddress) -> Result<Option<Identity>, RegistryError> {
        match namespace {
            Some(ns) => self.identities.live_in(ns, a).await,
            None => self.identities.live(a).await,
        }
    }

    /// The status of the identity's RunSession is refreshed now (`IdentityStore::announce_status`).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn announce_status(&self, identity: &IdentitySpec) -> Result<(), RegistryError> {
        self.identities.announce_status(identity).await
    }

    /// Every live identity of a server (in `namespace`, when given).
    pub async fn identities_of_server(
        &self,
        server_instance_id: &str,
        namespace: Option<&str>,
    ) -> Result<Vec<Identity>, RegistryError> {
        self.identities.of_server(server_instance_id, namespace).await
    }

    /// The session an address holds now, if any.
    pub async fn session_of(&self, a: &RunAddress) -> Result<Option<Session>, RegistryError> {
        self.sessions.session(a).await
    }

    pub async fn enqueue(&self, namespace: &str, a: &RunAddress, new: &NewJob) -> Result<Enqueued, RegistryError> {
        self.jobs.enqueue(namespace, a, new).await
    }

    pub async fn job(&self, namespace: &str, id: Uuid) -> Result<Option<Job>, RegistryError> {
        self.jobs.get(namespace, id).await
    }

    /// A page of `namespace`'s jobs, newest first (`JobStore::list`).
    pub async fn jobs(
        &self,
        namespace: &str,
        filter: &JobFilter,
        limit: i64,
        after: Option<Cursor>,
    ) -> Result<(Vec<Job>, Option<Cursor>), RegistryError> {
        self.jobs.list(namespace, filter, limit, after).await
    }

    /// A RunSession's identity, mirrored into Postgres (its reconcile).
    pub async fn mirror(&self, i: &IdentitySpec) -> Result<Mirror, RegistryError> {
        self.identities.mirror(i).await
    }

    /// Ends the address's sessions of an epoch older than `epoch` (`SessionStore::fence`).
    pub async fn fence(
        &self,
        a: &RunAddress,
        epoch: i64,
        expires: Option<std::time::Duration>,
    ) -> Result<Fenced, RegistryError> {
        self.sessions.fence(a, epoch, expires).await
    }

    /// A deleted RunSession: its identity revoked (a new epoch), the jobs of its namespace
    /// it left unfinished cancelled, and Redis fenced to the revoked epoch, which ends its
    /// session (`revoked_ttl`: how long the fence outlives it). None when the resource
    /// never held the identity; else how many jobs were cancelled.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn revoke(
        &self,
        identity: &IdentitySpec,
        revoked_ttl: std::time::Duration,
    ) -> Result<Option<u64>, RegistryError> {
        let Some(epoch) = self.identities.revoke(identity.id).await? else { return Ok(None) };
        let address = identity.address();
        let cancelled = self.jobs.cancel_for_identity(&identity.namespace, &address, identity.id).await?;
        self.sessions.fence(&address, epoch, Some(revoked_ttl)).await?;
        Ok(Some(cancelled))
    }

    /// Retention: finished jobs' keys and revoked identities past `days`; how many of each.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn prune(&self, days: u32) -> Result<(u64, u64), RegistryError> {
        Ok((self.jobs.prune_finished(days).await?, self.identities.prune_revoked(days).await?))
    }

    /// The job reaper's pass (`JobStore::reap`).
    pub async fn reap(&self) -> Result<Reaped, RegistryError> {
        self.jobs.reap().await
    }

    /// Whether Redis answers.
    pub async fn ping(&self) -> Result<(), RegistryError> {
        self.sessions.ping().await
    }

    /// The jobs by state (metrics).
    pub async fn census(&self) -> Result<JobCensus, RegistryError> {
        self.jobs.census().await
    }

    /// How many live identities hold a session now (metrics).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn online(&self) -> Result<usize, RegistryError> {
        let addresses = self.identities.all_addresses().await?;
        self.sessions.count_live(&addresses).await
    }
}

impl RunRegistry {
    pub fn lease_seconds(&self, lease_seconds: Option<i32>) -> u32 {
        lease_seconds.map(|s| s.max(1) as u32).unwrap_or(self.default_lease_seconds)
    }

    /// Checks a hello's proof (its fields, the identity, generation, clock and
    /// signature) without writing anything: what a caller must pass before anything is
    /// charged to the identity it names (SPEC §12, "a refusal costs the refused"). The
    /// outer error is infrastructure (503); the inner one the refusal to report.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn prove<'h>(
        &self,
        h: &'h Hello,
        now: DateTime<Utc>,
    ) -> Result<Result<Proven<'h>, HelloError>, RegistryError> {
        if let Err(e) = check_hello(h) {
            return Ok(Err(HelloError::Invalid(e)));
        }
        let address =
            RunAddress { server_instance_id: h.server_instance_id.clone(), component_kind: h.component_kind.clone() };
        let Some(identity) = self.identities.live(&address).await? else {
            return Ok(Err(HelloError::Refused(ProofRefused::UnknownIdentity)));
        };
        let (generation, key) = (identity.spec.key_generation, &identity.spec.public_key);
        if let Err(refused) = prover::Prover::check(self.prover.as_ref(), h, generation, key, now.timestamp()).await {
            return Ok(Err(HelloError::Refused(refused)));
        }
        Ok(Ok(Proven { hello: h, address, identity, now }))
    }

    /// Opens (or rotates) the session of a proven hello: the durable replay guard, then
    /// the lease. The outer error is infrastructure (503); the inner one the refusal.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn open(&self, proven: Proven<'_>) -> Result<Result<(Identity, Granted), HelloError>, RegistryError> {
        let Proven { hello: h, address, identity, now } = proven;
        // The durable replay guard, and the last word on the generation: a key rotated
        // since the identity was read refuses the hello here, in one statement.
        let epoch = match self.identities.mark_hello(identity.spec.id, h.key_generation, h.timestamp, &h.nonce).await? {
            HelloMark::Taken { epoch } => epoch,
            HelloMark::Revoked => return Ok(Err(HelloError::Refused(ProofRefused::UnknownIdentity))),
            HelloMark::Rotated => return Ok(Err(HelloError::Refused(ProofRefused::StaleGeneration))),
            HelloMark::Replayed => return Ok(Err(HelloError::Refused(ProofRefused::ReplayedNonce))),
        };
        let lease = self.lease_seconds(identity.spec.lease_seconds);
        let token = mint_token(&address)?;
        let hash = token_hash(&token);
        let session = NewSession {
            token_hash: &hash,
            session_id: Uuid::new_v4(),
            generation: identity.spec.key_generation,
            epoch,
            now,
            lease: std::time::Duration::from_secs(u64::from(lease)),
            version: h.version.as_deref(),
            target: h.target.as_ref(),
            capabilities: h.capabilities.as_deref().unwrap_or_default(),
            capacity: h.capacity.as_ref().unwrap_or(NO_CAPACITY),
        };
        // Nonces are remembered past both ends of the clock window.
        let nonce_ttl = std::time::Duration::from_secs((2 * proof::CLOCK_WINDOW_SECS + 60) as u64);
        match self.sessions.hello(&address, &h.nonce, &session, nonce_ttl).await? {
            HelloOutcome::ReplayedNonce => return Ok(Err(HelloError::Refused(ProofRefused::ReplayedNonce))),
            // Rotated or replaced after the mark was taken: a newer epoch is in Redis.
            HelloOutcome::Stale => return Ok(Err(HelloError::Refused(ProofRefused::StaleGeneration))),
            HelloOutcome::Started | HelloOutcome::Rotated => {}
        }
        let granted = Granted {
            session_token: token,
            lease_ttl_seconds: lease,
            heartbeat_interval_seconds: heartbeat_interval(lease),
        };
        Ok(Ok((identity, granted)))
    }

    /// Checks a session token: its address and whole session while it is valid.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn session(&self, token: &str) -> Result<Result<(RunAddress, Session), SessionRefused>, RegistryError> {
        let Some(address) = token_address(token) else {
            return Ok(Err(SessionRefused::InvalidToken));
        };
        Ok(match self.sessions.check(&address, &token_hash(token)).await? {
            TokenCheck::Valid(session) => Ok((address, session)),
            TokenCheck::Superseded => Err(SessionRefused::Superseded),
            TokenCheck::Expired => Err(SessionRefused::Expired),
        })
    }

    /// A heartbeat: checks the token (and that its epoch is not known to be an older
    /// one: `Signals::stale_epoch`), keeps the snapshot and renews the lease; says
    /// whether it changed the session's `draining` (the heartbeat then has the
    /// RunSession's status refreshed).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn renew(
        &self,
        token: &str,
        renewal: Renewal<'_>,
    ) -> Result<Result<Renewed, SessionRefused>, RegistryError> {
        let Some(address) = token_address(token) else {
            return Ok(Err(SessionRefused::InvalidToken));
        };
        Ok(match self.sessions.renew(&address, &token_hash(token), renewal).await? {
            // A session of a key since rotated or revoked, which Redis was not told of
            // (its fence failed, or a failover lost it): what the fence would have made
            // of it. The lease was renewed; the next reconcile's fence ends it.
            TokenCheck::Valid(lease) if self.signals.stale_epoch(&address, lease.epoch) => Err(SessionRefused::Expired),
            TokenCheck::Valid(lease) => Ok(Renewed { address, lease }),
            TokenCheck::Superseded => Err(SessionRefused::Superseded),
            TokenCheck::Expired => Err(SessionRefused::Expired),
        })
    }

    /// The namespace a session still acts in: its identity's, while the session's epoch
    /// is the identity's current one (checked in Postgres on every claim and step, so a
    /// rotation or deletion stops them even while Redis could not be told).
    async fn acting_namespace(&self, address: &RunAddress, session: &Session) -> Result<Option<String>, RegistryError> {
        Ok(self.acting(address, session).await?.map(|acting| acting.namespace))
    }

    /// What a session still acts as (`acting_namespace`), with its identity's `paused`.
    async fn acting(&self, address: &RunAddress, session: &Session) -> Result<Option<Acting>, RegistryError> {
        self.identities.current(address, session.epoch).await
    }

    /// Claims up to `max` of the oldest eligible queued jobs of the session's own
    /// address (the kinds and slots it advertised), of its identity's namespace only;
    /// with the ids of the jobs it holds whose cancel was requested. A drained Run (its
    /// RunSession paused, or the session said it is draining; SPEC §5.1) gets no job, but
    /// still its cancels: its jobs in flight finish normally.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn claim(
        &self,
        address: &RunAddress,
        session: &Session,
        max: i64,
    ) -> Result<Result<Claim, SessionRefused>, RegistryError> {
        let Some(Acting { namespace, paused }) = self.acting(address, session).await? else {
            return Ok(Err(SessionRefused::Superseded));
        };
        let jobs = if drained(paused, session) {
            Vec::new()
        } else {
            let eligible = Eligibility::of(&session.capabilities, &session.capacity);
            self.jobs.claim(&namespace, address, session.session_id, max, &eligible).await?
        };
        let cancel = if self.signals.may_have_cancel(address) {
            self.jobs.cancel_requested(&namespace, address).await?
        } else {
            Vec::new()
        };
        Ok(Ok(Claim { jobs, cancel }))
    }

    /// `claim`, and when that finds no job, waits (SPEC §11 long poll) until something
    /// may be claimable for the address — a job queued there on any replica, a slot
    /// freed — or a cancel is requested for a job it holds, and looks again; until
    /// `until` or `stop` (the replica is shutting down: the Run asks again elsewhere).
    /// The answer then is the last look's (no job; the cancels still pending).
    /// Waiting holds no Postgres connection. Each look after a wake reads the session
    /// again: a heartbeat may have changed its kinds, slots or draining, and a newer
    /// hello ends it.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn claim_waiting(
        &self,
        token: &str,
        address: &RunAddress,
        mut session: Session,
        max: i64,
        until: tokio::time::Instant,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<Result<Claim, SessionRefused>, RegistryError> {
        let waiter = self.signals.run_waiter(address);
        let mut stop = std::pin::pin!(stop);
        // The cancels pending at the first look: the Run has heard of them (heartbeat,
        // earlier claims); only a new one ends the wait, or a Run still finishing one
        // would have every long poll answered at once.
        let mut pending: Option<Vec<Uuid>> = None;
        loop {
            // Armed before the look, so a wake while Postgres answers is not lost.
            let armed = waiter.armed();
            let claim = match self.claim(address, &session, max).await? {
                Ok(claim) => claim,
                Err(refused) => return Ok(Err(refused)),
            };
            let new_cancel = pending.as_ref().is_some_and(|p| claim.cancel.iter().any(|id| !p.contains(id)));
            if !claim.jobs.is_empty() || new_cancel || tokio::time::Instant::now() >= until {
                return Ok(Ok(claim));
            }
            pending.get_or_insert_with(|| claim.cancel.clone());
            tokio::select! {
                _ = armed.woken() => {}
                _ = tokio::time::sleep_until(until) => return Ok(Ok(claim)),
                _ = &mut stop => return Ok(Ok(claim)),
            }
            session = match self.session(token).await? {
                Ok((_, session)) => session,
                Err(refused) => return Ok(Err(refused)),
            };
        }
    }

    /// The jobs the session's Run holds whose cancel was requested (its heartbeat
    /// answer). A session that no longer acts for its identity holds none. Postgres is
    /// read only when a cancel may be pending for the address (`Signals`).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn cancel_requested(&self, address: &RunAddress, lease: &Lease) -> Result<Vec<Uuid>, RegistryError> {
        if !self.signals.may_have_cancel(address) {
            return Ok(vec![]);
        }
        match self.identities.current(address, lease.epoch).await? {
            Some(acting) => self.jobs.cancel_requested(&acting.namespace, address).await,
            None => Ok(vec![]),
        }
    }

    /// Cancels a job of `namespace` (`JobStore::cancel`); a request for a job in flight
    /// is noted here at once, so its Run's next heartbeat on this replica hears of it.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn cancel(
        &self,
        namespace: &str,
        id: Uuid,
        reason: Option<&str>,
    ) -> Result<Option<Cancel>, RegistryError> {
        let done = self.jobs.cancel(namespace, id, reason).await?;
        if let Some(Cancel::Requested(job)) = &done {
            self.signals.note_cancel(&RunAddress {
                server_instance_id: job.server_instance_id.clone(),
                component_kind: job.component_kind.clone(),
            });
        }
        Ok(done)
    }

    #[tracing::instrument(level = "debug", skip_all, fields(store = "registry"))]
    pub async fn step(
        &self,
        address: &RunAddress,
        session: &Session,
        id: Uuid,
        step: &Step,
        attempt: Option<i32>,
        body: Option<&Value>,
    ) -> Result<Result<Job, StepError>, RegistryError> {
        let Some(namespace) = self.acting_namespace(address, session).await? else {
            return Ok(Err(StepError::Session(SessionRefused::Superseded)));
        };
        let attempt = attempt.map_or(Attempt::OfSession(session.session_id), Attempt::Named);
        Ok(self.jobs.step(&namespace, address, id, step, attempt, body).await?.map_err(StepError::Job))
    }
}

/// A claim's answer: the jobs now the session's, and the ids of those it holds that it
/// must stop (SPEC §11).
#[derive(Clone, Debug, PartialEq)]
pub struct Claim {
    pub jobs: Vec<Job>,
    pub cancel: Vec<Uuid>,
}

/// A renewed session: its address and lease.
#[derive(Clone, Debug, PartialEq)]
pub struct Renewed {
    pub address: RunAddress,
    pub lease: Lease,
}

/// Whether a session's claims hand out no new job (SPEC §5.1, Drain): its identity is
/// paused (the platform's cordon), or the Run said it is draining (its graceful stop).
pub fn drained(paused: bool, session: &Session) -> bool {
    paused || session.draining
}

/// Why a job step was refused: the session, or the job.
#[derive(Debug, PartialEq)]
pub enum StepError {
    Session(SessionRefused),
    Job(StepRefused),
}

#[derive(Clone, Debug, PartialEq)]
pub enum HelloError {
    Invalid(Invalid),
    Refused(ProofRefused),
}

/// A hello whose proof checked out (`RunRegistry::prove`): its identity is proven, so
/// what it costs may be charged to that identity before `open` writes anything.
pub struct Proven<'h> {
    hello: &'h Hello,
    address: RunAddress,
    identity: Identity,
    now: DateTime<Utc>,
}

impl Proven<'_> {
    /// The proven identity's address.
    pub fn address(&self) -> &RunAddress {
        &self.address
    }
}

/// The registry of Runs as the reconcilers drive it (prism-core's store trait).
impl prism_core::store::Runs for RunRegistry {
    type Error = RegistryError;

    async fn mirror(&self, identity: &IdentitySpec) -> Result<Mirror, RegistryError> {
        RunRegistry::mirror(self, identity).await
    }

    fn lease_seconds(&self, lease_seconds: Option<i32>) -> u32 {
        RunRegistry::lease_seconds(self, lease_seconds)
    }

    async fn fence(&self, address: &RunAddress, epoch: i64) -> Result<Fenced, RegistryError> {
        RunRegistry::fence(self, address, epoch, None).await
    }

    async fn revoke(
        &self,
        identity: &IdentitySpec,
        revoked_ttl: std::time::Duration,
    ) -> Result<Option<u64>, RegistryError> {
        RunRegistry::revoke(self, identity, revoked_ttl).await
    }

    async fn prune(&self, days: u32) -> Result<(u64, u64), RegistryError> {
        RunRegistry::prune(self, days).await
    }

    async fn reap(&self) -> Result<Reaped, RegistryError> {
        RunRegistry::reap(self).await
    }

    async fn ping(&self) -> Result<(), RegistryError> {
        RunRegistry::ping(self).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_route_to_their_identity_and_carry_256_random_bits() {
        let t = RunAddress { server_instance_id: "srv-eu1.7".into(), component_kind: "run".into() };
        let a = mint_token(&t).expect("token");
        let b = mint_token(&t).expect("token");
        assert_ne!(a, b);
        assert_eq!(token_address(&a), Some(t));
        assert_eq!(token_hash(&a).len(), 64);
        assert_eq!(token_address("prs1.bad"), None);
        assert_eq!(token_address("Bearer something"), None);
        let forged = format!("{}x", a);
        assert_eq!(token_address(&forged), None);
        // A route that is not an identity's shape names no keys at all.
        for route in ["}x\nrun", "srv\n{run}", "\nrun", "srv\nRun"] {
            let forged = format!("{TOKEN_PREFIX}.{}.{}", URL_SAFE_NO_PAD.encode(route), "a".repeat(43));
            assert_eq!(token_address(&forged), None, "{route:?}");
        }
    }

    #[test]
    fn heartbeats_are_a_third_of_the_lease_but_never_at_the_idle_cut() {
        let intervals: Vec<u32> = [1, 5, 27, 30, 33, 35, 36, 60, 3600].into_iter().map(heartbeat_interval).collect();
        assert_eq!(intervals, [1, 1, 9, 8, 8, 8, 12, 20, 1200]);
    }

    #[test]
    fn snapshots_are_bounded_and_non_negative() {
        let caps = vec!["lifecycle".to_string(), "protected_request".to_string()];
        let cap: BTreeMap<String, i64> = [("slots".to_string(), 4)].into();
        assert_eq!(check_snapshot(Some(&caps), Some(&cap)), Ok(()));
        assert!(check_snapshot(Some(&vec!["Has Space".to_string()]), None).is_err());
        assert!(check_snapshot(Some(&vec!["x".to_string(); 33]), None).is_err());
        let negative: BTreeMap<String, i64> = [("slots".to_string(), -1)].into();
        assert!(check_snapshot(None, Some(&negative)).is_err());
    }
}

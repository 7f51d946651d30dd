//! The runtime session registry's Redis side. Redis is required: there is no in-memory
//! fallback, and an unreachable Redis is reported as such, never papered over.
//!
//! Keys of one Run identity share the hash tag `{server/component}` (identities are
//! `[A-Za-z0-9._-]`, so no brace can move the tag), and every change that touches more
//! than one key is a single Lua script on one slot, so the scripts run unchanged on a
//! Redis Cluster (`PRISM_REDIS_MODE=cluster`). Nothing here lists keys (no SCAN/KEYS):
//! every key is named from an identity Postgres knows.
//! * `{prefix}:run:{srv/comp}:session` — hash, the live session; its TTL *is* the lease.
//!   Its fields are strings; `target`, `capabilities` and `capacity` hold JSON, written
//!   and read only here, so everything outside this module sees typed `Session`s.
//!   `draining` is `1` once a heartbeat said the Run is draining, until one says it is
//!   not (absent or `0`: not draining; a hello writes a new hash, not draining).
//! * `{prefix}:run:{srv/comp}:retired` — set of superseded token hashes (TTL: a lease).
//! * `{prefix}:run:{srv/comp}:nonce:{nonce}` — replay guard for hello nonces (the durable
//!   one is the identity's high-water mark in Postgres; this one only spares it a write).
//! * `{prefix}:run:{srv/comp}:identity` — the address's current identity epoch (see
//!   `identity`): a session hash carries the epoch it was opened in, and every script that
//!   lets a session act compares the two, so a rotated or deleted identity's session
//!   authorizes nothing once any reconcile (or a newer hello) has written the new epoch,
//!   whichever Redis write failed before.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, Script, Value};
use uuid::Uuid;

use super::{RedisStep, RegistryError};
use crate::db::redact_url;
use prism_core::run::RunTarget;

/// Where the runtime registry's Redis is, as REDIS_URL and PRISM_REDIS_MODE say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RedisEndpoint {
    /// One Redis server (or a proxy in front of several).
    Standalone(String),
    /// Seed nodes of a Redis Cluster: the client learns the rest of the topology from them.
    Cluster(Vec<String>),
}

impl RedisEndpoint {
    /// For logs and errors: every URL without its password.
    pub fn redacted(&self) -> String {
        match self {
            RedisEndpoint::Standalone(url) => redact_url(url),
            RedisEndpoint::Cluster(nodes) => {
                let nodes: Vec<String> = nodes.iter().map(|n| redact_url(n)).collect();
                format!("cluster {}", nodes.join(","))
            }
        }
    }
}

// A Run's address and session are the domain's.
pub use prism_core::run::{Fenced, REVOKED_EPOCH_TTL, RunAddress, Session};

/// What a token is worth right now: `T` is what a valid one gives (the whole `Session`
/// to a check, the renewed `Lease` to a heartbeat).
#[derive(Clone, Debug, PartialEq)]
pub enum TokenCheck<T> {
    Valid(T),
    /// A newer hello replaced this token, or the identity's key was rotated or the
    /// identity deleted since (its session is ended by the check itself).
    Superseded,
    /// No live session for this address (lease expired, or Redis lost it).
    Expired,
}

/// What a heartbeat's renewal leaves: all its reply and its cancels need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The identity epoch the session was opened in (0: a session of a build before epochs).
    pub epoch: i64,
    /// The lease, renewed in full.
    pub lease_left: Duration,
    /// This renewal changed the session's `draining`.
    pub drain_changed: bool,
}

/// A fresh session to write at hello.
pub struct NewSession<'a> {
    pub token_hash: &'a str,
    pub session_id: Uuid,
    pub generation: i64,
    /// The identity epoch the hello's mark was taken in.
    pub epoch: i64,
    pub now: DateTime<Utc>,
    pub lease: Duration,
    pub version: Option<&'a str>,
    pub target: Option<&'a RunTarget>,
    pub capabilities: &'a [String],
    pub capacity: &'a BTreeMap<String, i64>,
}

/// A heartbeat's renewal: the snapshot it carries (absent parts are kept).
#[derive(Clone, Copy, Debug, Default)]
pub struct Renewal<'a> {
    pub capabilities: Option<&'a [String]>,
    pub capacity: Option<&'a BTreeMap<String, i64>>,
    /// Whether the Run is draining (absent: as it was).
    pub draining: Option<bool>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HelloOutcome {
    /// The address had no live session.
    Started,
    /// A live session was replaced: its token stops authorizing at once.
    Rotated,
    ReplayedNonce,
    /// The address's current epoch is newer than the hello's: the identity was rotated or
    /// replaced after the hello read it.
    Stale,
}

// KEYS: session, retired, nonce, identity. ARGV: token_hash, session_id, generation,
// now_ms, lease_ms, nonce_ttl_s, version, target, capabilities, capacity, epoch.
const HELLO: &str = r#"
local epoch = tonumber(ARGV[11])
local current = tonumber(redis.call('GET', KEYS[4]) or '0')
if current > epoch then
  return 'stale'
end
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[6]) then
  return 'replayed'
end
if current < epoch then
  redis.call('SET', KEYS[4], ARGV[11])
end
local old = redis.call('HGET', KEYS[1], 'token_hash')
if old then
  redis.call('SADD', KEYS[2], old)
  redis.call('PEXPIRE', KEYS[2], math.max(tonumber(ARGV[5]), 60000) * 2)
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'token_hash', ARGV[1], 'session_id', ARGV[2], 'generation', ARGV[3],
  'started_at_ms', ARGV[4], 'last_heartbeat_ms', ARGV[4], 'lease_ms', ARGV[5], 'version', ARGV[7],
  'target', ARGV[8], 'capabilities', ARGV[9], 'capacity', ARGV[10], 'epoch', ARGV[11], 'draining', '0')
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if old then return 'rotated' end
return 'started'
"#;

// KEYS: session, retired, identity. ARGV: token_hash. Returns the session fields plus
// its TTL, or a status word. A session of another epoch than the address's current one
// is ended here ('revoked'). Claims and steps: they read the whole session.
const CHECK: &str = r#"
local cur = redis.call('HGET', KEYS[1], 'token_hash')
if cur ~= ARGV[1] then
  if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return 'superseded' end
  return 'expired'
end
if redis.call('HGET', KEYS[1], 'epoch') ~= redis.call('GET', KEYS[3]) then
  redis.call('DEL', KEYS[1])
  return 'revoked'
end
local fields = redis.call('HGETALL', KEYS[1])
table.insert(fields, 'ttl_ms')
table.insert(fields, tostring(redis.call('PTTL', KEYS[1])))
return fields
"#;

// KEYS: session, retired. ARGV: token_hash, capabilities or "", capacity or "", draining
// ("1"/"0", or "": as it was). The heartbeat: check the token, store what the snapshot
// changed, renew the lease, and return only what the reply needs: {epoch, lease_ms,
// drain_changed (1/0)}, or a status word. Three commands in the steady case (EVALSHA,
// HMGET, PEXPIRE): one read of the hash, a write only when the Run's snapshot changed, and
// no `last_heartbeat_ms` write: the lease is renewed to `lease_ms`, so the last heartbeat
// is when the TTL was last full (`SessionFields`).
//
// Unlike CHECK it does not compare the session's epoch with the identity key's: the two
// cannot differ while the session exists. Only HELLO and FENCE write the identity key, and
// each does so in the same script that ends every session of another epoch (HELLO
// replaces the session, FENCE deletes it), on the same slot, replicated as one unit. The
// comparison cost a GET on every heartbeat (issue 23: commands per heartbeat <= 4); claims
// and steps (CHECK) keep it, as a second look where a job is at stake.
const RENEW: &str = r#"
local s = redis.call('HMGET', KEYS[1], 'token_hash', 'epoch', 'lease_ms', 'draining', 'capabilities', 'capacity')
if s[1] ~= ARGV[1] then
  if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return 'superseded' end
  return 'expired'
end
local set = {}
if ARGV[2] ~= '' and ARGV[2] ~= s[5] then
  table.insert(set, 'capabilities'); table.insert(set, ARGV[2])
end
if ARGV[3] ~= '' and ARGV[3] ~= s[6] then
  table.insert(set, 'capacity'); table.insert(set, ARGV[3])
end
local drain_changed = 0
if ARGV[4] ~= '' and (s[4] or '0') ~= ARGV[4] then
  table.insert(set, 'draining'); table.insert(set, ARGV[4])
  drain_changed = 1
end
if #set > 0 then redis.call('HSET', KEYS[1], unpack(set)) end
redis.call('PEXPIRE', KEYS[1], s[3])
return {s[2] or '', s[3], drain_changed}
"#;

// KEYS: session. Returns the session fields plus its TTL, or nothing.
const READ: &str = r#"
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return fields end
table.insert(fields, 'ttl_ms')
table.insert(fields, tostring(redis.call('PTTL', KEYS[1])))
return fields
"#;

// KEYS: session, identity. ARGV: epoch (the identity's current one, from Postgres),
// ttl_s of the identity key (0: none; a revoked identity's key expires). Raises the
// address's epoch to ARGV[1] (never lowers it), ends a session of any other epoch, and
// returns what is left: the session fields plus its TTL, nothing, or 'revoked'.
const FENCE: &str = r#"
local epoch = tonumber(ARGV[1])
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
if current < epoch then
  if ARGV[2] == '0' then
    redis.call('SET', KEYS[2], ARGV[1])
  else
    redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
  end
  current = epoch
end
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return fields end
if tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') ~= current then
  redis.call('DEL', KEYS[1])
  return 'revoked'
end
table.insert(fields, 'ttl_ms')
table.insert(fields, tostring(redis.call('PTTL', KEYS[1])))
return fields
"#;

/// How long one request to a Redis node may take, and how long to wait for a connection.
/// Short: a Run waiting on a dead Redis should get a 503 quickly, not hang.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
/// A cluster request as a whole, retries and MOVED/ASK redirections included: long enough
/// to follow a slot map that changed under it, still a quick 503 while a slot has no
/// master (its lease outlives that; SPEC §10).
const CLUSTER_REQUEST_TIMEOUT: Duration = Duration::from_secs(4);
/// The readiness probe's budget: /readyz must answer within the kubelet's default probe
/// timeout (1 s) even while Redis hangs, reporting the registry unavailable rather than
/// getting the whole replica marked unready.
const PING_BUDGET: Duration = Duration::from_millis(800);
const CLUSTER_SLOTS: u32 = 16384;

/// CRC16/XMODEM, the checksum Redis Cluster maps keys to slots with (the crate the
/// redis client itself uses for routing).
fn crc16(data: &[u8]) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(data)
}

/// A hash tag whose slot lies in `start..=end` (a few tries for a master's range; at most
/// about 16384 x 20 for a single slot).
fn tag_in_slots(start: u16, end: u16) -> Option<String> {
    (0..200_000u32).map(|n| n.to_string()).find(|t| (start..=end).contains(&(crc16(t.as_bytes()) % 16384)))
}

/// A range of slots and the master serving it, from `CLUSTER SLOTS`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SlotRange {
    start: u16,
    end: u16,
    /// "host:port" of the master (a master may serve several ranges); None when the
    /// answer did not say it in a shape we read, and then the range is a group of its own
    /// rather than merged with other unreadable ones (which may be other masters).
    master: Option<String>,
}

/// What keys are grouped by for one round trip: their master, or their range alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Group<'a> {
    Master(&'a str),
    Range(u16),
}

/// The slot ranges of a `CLUSTER SLOTS` answer.
fn slot_ranges(answer: &[Value]) -> Vec<SlotRange> {
    let number = |v: &Value| match v {
        Value::Int(n) => u16::try_from(*n).ok(),
        _ => None,
    };
    let master = |v: &Value| match v {
        Value::Array(node) => match (node.first(), node.get(1)) {
            (Some(Value::BulkString(host)), Some(Value::Int(port))) => {
                Some(format!("{}:{port}", String::from_utf8_lossy(host)))
            }
            _ => None,
        },
        _ => None,
    };
    answer
        .iter()
        .filter_map(|entry| match entry {
            Value::Array(items) if items.len() >= 3 => {
                Some(SlotRange { start: number(&items[0])?, end: number(&items[1])?, master: master(&items[2]) })
            }
            _ => None,
        })
        .collect()
}

/// The slot of a Run's keys: its hash tag is `server/component` (see `SessionStore::key`).
fn address_slot(a: &RunAddress) -> u16 {
    crc16(format!("{}/{}", a.server_instance_id, a.component_kind).as_bytes()) % CLUSTER_SLOTS as u16
}

/// Keys grouped by the master serving their slot, each group with one of its slots to
/// route it by. Err: a slot no range covers.
fn by_master(ranges: &[SlotRange], keys: Vec<(u16, String)>) -> Result<Vec<(u16, Vec<String>)>, u16> {
    let mut groups: BTreeMap<Group, (u16, Vec<String>)> = BTreeMap::new();
    for (slot, key) in keys {
        let range = ranges.iter().find(|r| (r.start..=r.end).contains(&slot)).ok_or(slot)?;
        let group = range.master.as_deref().map_or(Group::Range(range.start), Group::Master);
        groups.entry(group).or_insert_with(|| (slot, Vec::new())).1.push(key);
    }
    Ok(groups.into_values().collect())
}

/// Runs counted by one pipeline at most (per master): what a count of the runs-online
/// gauge holds at once (the keys, the packed commands, the answers: ~180 bytes a Run, 1.8
/// MiB at 10,000 in one pipeline, seen at the operator's heap peak) and how long one
/// pipeline keeps Redis busy stay bounded as the Runs grow.
const COUNT_BATCH: usize = 1_000;

/// EXISTS of each key, in one pipeline.
fn exists_pipeline(keys: &[String]) -> Pipeline {
    let mut pipe = redis::pipe();
    for key in keys {
        pipe.exists(key);
    }
    pipe
}

/// How many EXISTS of a pipeline answered 1.
fn existing(answers: Vec<Value>) -> Result<usize, RegistryError> {
    let mut n = 0;
    for answer in answers {
        match answer {
            Value::Int(found) => n += usize::from(found > 0),
            Value::ServerError(e) => return Err(redis::RedisError::from(e)).step("runs online: count live sessions"),
            other => {
                let e =
                    redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "EXISTS", format!("{other:?}")));
                return Err(e).step("runs online: count live sessions");
            }
        }
    }
    Ok(n)
}

/// The one connection to Redis, whichever kind. Both kinds connect lazily and reconnect
/// by themselves; the cluster one also follows MOVED/ASK and refreshes its slot map when
/// a master fails over. Both speak `ConnectionLike`, so every script and command of the
/// store is written once.
#[derive(Clone)]
enum Connection {
    Standalone(ConnectionManager),
    Cluster(ClusterHandle),
}

/// The cluster connection, and the client to make a new one with.
///
/// redis 1.8's async cluster client can stay broken after every node was away at once (a
/// restart of the whole cluster): its recovery refreshes the slot map over an empty
/// connection map, fails with `ClusterConnectionNotFound` and tries again at once,
/// forever, instead of dialling the seed nodes again: a busy loop, an error log line per
/// try, and every request refused (found by the fault harness, tests/soak.rs: a Redis
/// restart after failovers left one replica's registry down for good while the others
/// recovered). So a request that gets "no connections" replaces the connection with a
/// fresh one from the seed nodes; the stuck one ends when its last clone is dropped.
/// It can also stay stuck with every request timing out after such a restart (seen in
/// CI: tests/redis_cluster.rs, no hello for 20 s against a cluster that answered PING):
/// `STUCK_AFTER` transport failures in a row (timeouts, drops, refusals; no success in
/// between) replace it the same way. A failover's few seconds of timeouts may cost one
/// replacement too, which dials the seed nodes and finds the new master.
#[derive(Clone)]
struct ClusterHandle(Arc<ClusterParts>);

struct ClusterParts {
    client: ClusterClient,
    config: ClusterConfig,
    /// The connection in use, and its generation (so that a burst of failures on one
    /// stuck connection replaces it once).
    current: Mutex<(u64, ClusterConnection)>,
    /// Transport failures in a row on the current generation.
    failing: std::sync::atomic::AtomicU32,
}

/// Transport failures in a row after which a cluster connection is dialled afresh.
const STUCK_AFTER: u32 = 5;

impl ClusterHandle {
    fn new(client: ClusterClient, config: ClusterConfig) -> Self {
        let conn = client.get_pending_async_connection_with_config(config.clone());
        Self(Arc::new(ClusterParts {
            client,
            config,
            current: Mutex::new((0, conn)),
            failing: std::sync::atomic::AtomicU32::new(0),
        }))
    }

    fn connection(&self) -> (u64, ClusterConnection) {
        self.0.current.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// After `error` on generation `generation`: a connection that has no node left, or
    /// whose requests failed at the transport `STUCK_AFTER` times in a row, is replaced
    /// (once) by one dialled from the seed nodes.
    fn after_error(&self, generation: u64, error: &RedisError) {
        use std::sync::atomic::Ordering;
        let mut current = self.0.current.lock().unwrap_or_else(PoisonError::into_inner);
        // A request of a connection already replaced says nothing of the new one.
        if current.0 != generation {
            return;
        }
        let transport =
            error.is_timeout() || error.is_connection_dropped() || error.is_connection_refusal() || error.is_io_error();
        let why = if error.kind() == ErrorKind::ClusterConnectionNotFound {
            "has no node left"
        } else if transport {
            if self.0.failing.fetch_add(1, Ordering::Relaxed) + 1 < STUCK_AFTER {
                return;
            }
            "failed at the transport several times in a row"
        } else {
            return;
        };
        tracing::warn!(generation, "Redis Cluster connection {why}; dialling the seed nodes again");
        *current = (generation + 1, self.0.client.get_pending_async_connection_with_config(self.0.config.clone()));
        self.0.failing.store(0, Ordering::Relaxed);
    }

    /// A request went through: the run of transport failures is over.
    fn after_success(&self) {
        self.0.failing.store(0, std::sync::atomic::Ordering::Relaxed);
    }

    fn settle<T>(&self, generation: u64, answer: &Result<T, RedisError>) {
        match answer {
            Ok(_) => self.after_success(),
            Err(e) => self.after_error(generation, e),
        }
    }
}

impl ClusterHandle {
    /// A pipeline sent to the node serving `slot`, whatever slots its keys are on (the
    /// caller grouped them by master), replacing a stuck connection as every request does.
    async fn pipeline_to_slot(&self, pipeline: Pipeline, count: usize, slot: u16) -> Result<Vec<Value>, RedisError> {
        let (generation, mut conn) = self.connection();
        let route = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
        let answer = conn.route_pipeline(pipeline, 0, count, route).await;
        self.settle(generation, &answer);
        answer
    }
}

impl ConnectionLike for ClusterHandle {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let (generation, mut conn) = self.connection();
        Box::pin(async move {
            let answer = conn.req_packed_command(cmd).await;
            self.settle(generation, &answer);
            answer
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let (generation, mut conn) = self.connection();
        Box::pin(async move {
            let answer = conn.req_packed_commands(pipeline, offset, count).await;
            self.settle(generation, &answer);
            answer
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

impl Connection {
    fn open(endpoint: &RedisEndpoint) -> Result<Self, RegistryError> {
        match endpoint {
            RedisEndpoint::Standalone(url) => {
                let client = redis::Client::open(url.as_str()).step("parse REDIS_URL")?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(RESPONSE_TIMEOUT))
                    .set_response_timeout(Some(RESPONSE_TIMEOUT))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(500));
                let conn = ConnectionManager::new_lazy_with_config(client, config).step("set up the connection")?;
                Ok(Connection::Standalone(conn))
            }
            RedisEndpoint::Cluster(nodes) => {
                let client = ClusterClient::builder(nodes.iter().map(String::as_str))
                    .connection_timeout(RESPONSE_TIMEOUT)
                    .response_timeout(RESPONSE_TIMEOUT)
                    .overall_response_timeout(Some(CLUSTER_REQUEST_TIMEOUT))
                    // Retries cover redirections and a reconnect to a promoted replica; the
                    // default (16, up to minutes apart) would outlast any request.
                    .retries(4)
                    .min_retry_wait(100)
                    .max_retry_wait(1000)
                    .build()
                    .step("parse the REDIS_URL seed nodes")?;
                let config = ClusterConfig::new()
                    .set_connection_timeout(RESPONSE_TIMEOUT)
                    .set_response_timeout(RESPONSE_TIMEOUT);
                // Pending: the seed nodes are dialled in the background, so the operator
                // starts (and reports the registry unavailable) while the cluster is down.
                Ok(Connection::Cluster(ClusterHandle::new(client, config)))
            }
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Standalone(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Standalone(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Standalone(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

/// The Redis side of the registry: a lazily connected, self-reconnecting connection,
/// the key prefix every key of this operator lives under, and the scripts.
#[derive(Clone)]
pub struct SessionStore {
    conn: Connection,
    prefix: String,
    hello: Script,
    check: Script,
    renew: Script,
    read: Script,
    fence: Script,
}

/// The fields of a session hash, as Redis returns them (`HGETALL` plus `ttl_ms`).
struct SessionFields {
    address: RunAddress,
    fields: HashMap<String, String>,
}

impl SessionFields {
    fn new(address: &RunAddress, list: Vec<String>) -> Self {
        let mut fields = HashMap::new();
        let mut it = list.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            fields.insert(k, v);
        }
        // The token hash never leaves this module.
        fields.remove("token_hash");
        Self { address: address.clone(), fields }
    }

    fn corrupt(&self, field: &'static str) -> RegistryError {
        let value = self.fields.get(field).cloned().unwrap_or_default();
        RegistryError::CorruptSession { address: self.address.clone(), field, value }
    }

    fn text(&self, field: &'static str) -> &str {
        self.fields.get(field).map(String::as_str).unwrap_or_default()
    }

    fn number(&self, field: &'static str) -> Result<i64, RegistryError> {
        self.text(field).parse().map_err(|_| self.corrupt(field))
    }

    fn millis(&self, field: &'static str) -> Result<DateTime<Utc>, RegistryError> {
        DateTime::from_timestamp_millis(self.number(field)?).ok_or_else(|| self.corrupt(field))
    }

    /// A JSON document, or its default when the Run did not send one (empty field).
    fn json<T: serde::de::DeserializeOwned + Default>(&self, field: &'static str) -> Result<T, RegistryError> {
        match self.text(field) {
            "" => Ok(T::default()),
            text => serde_json::from_str(text).map_err(|_| self.corrupt(field)),
        }
    }

    /// When the lease was last renewed: every renewal sets the TTL to `lease_ms`, so it
    /// is `lease_ms - ttl_ms` ago (no heartbeat writes its time: one command less per
    /// beat). Read against this replica's clock, as the TTL is.
    fn last_heartbeat(&self) -> Result<DateTime<Utc>, RegistryError> {
        let since = (self.number("lease_ms")? - self.number("ttl_ms")?).max(0);
        Ok(Utc::now() - chrono::Duration::milliseconds(since))
    }

    fn session(&self) -> Result<Session, RegistryError> {
        Ok(Session {
            session_id: Uuid::parse_str(self.text("session_id")).map_err(|_| self.corrupt("session_id"))?,
            generation: self.number("generation")?,
            epoch: match self.text("epoch") {
                "" => 0,
                _ => self.number("epoch")?,
            },
            started_at: self.millis("started_at_ms")?,
            last_heartbeat: self.last_heartbeat()?,
            version: Some(self.text("version")).filter(|v| !v.is_empty()).map(str::to_string),
            target: self.json("target")?,
            capabilities: self.json("capabilities")?,
            capacity: self.json("capacity")?,
            draining: match self.text("draining") {
                // Absent: a session written before drain existed.
                "" | "0" => false,
                "1" => true,
                _ => return Err(self.corrupt("draining")),
            },
            lease_left: Duration::from_millis(self.number("ttl_ms")?.max(0) as u64),
        })
    }
}

/// Why a check or renewal refused a token: the word its script returned.
fn refused<T>(a: &RunAddress, out: &Value, script: &'static str) -> Result<TokenCheck<T>, RegistryError> {
    let word: String = redis::from_redis_value_ref(out).map_err(RedisError::from).step("read the token check")?;
    match word.as_str() {
        "superseded" | "revoked" => Ok(TokenCheck::Superseded),
        "expired" => Ok(TokenCheck::Expired),
        other => Err(RegistryError::CorruptSession { address: a.clone(), field: script, value: other.into() }),
    }
}

/// A JSON document for a session field (these types always serialize).
fn to_json<T: serde::Serialize + ?Sized>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

impl SessionStore {
    /// Does not connect: the operator starts (and reports "unavailable") while Redis is down.
    pub fn new(endpoint: &RedisEndpoint, prefix: &str) -> Result<Self, RegistryError> {
        Ok(Self {
            conn: Connection::open(endpoint)?,
            prefix: prefix.to_string(),
            hello: Script::new(HELLO),
            check: Script::new(CHECK),
            renew: Script::new(RENEW),
            read: Script::new(READ),
            fence: Script::new(FENCE),
        })
    }

    /// The session hash, retired set and identity-epoch key of an address: the keys the
    /// token scripts take (and the benchmark's baseline).
    pub fn session_keys(&self, a: &RunAddress) -> (String, String, String) {
        (self.key(a, "session"), self.key(a, "retired"), self.key(a, "identity"))
    }

    /// CHECK's invocation: the address's session keys and the token's hash, its first
    /// argument.
    fn token_script<'s>(&self, script: &'s Script, a: &RunAddress, token_hash: &str) -> redis::ScriptInvocation<'s> {
        let (session, retired, identity) = self.session_keys(a);
        let mut call = script.key(session);
        call.key(retired).key(identity).arg(token_hash);
        call
    }

    fn key(&self, a: &RunAddress, suffix: &str) -> String {
        format!("{}:run:{{{}/{}}}:{suffix}", self.prefix, a.server_instance_id, a.component_kind)
    }

    /// Round trip to Redis, for readiness and the redis-up metric, within `PING_BUDGET`.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "sessions"))]
    pub async fn ping(&self) -> Result<(), RegistryError> {
        let probe = async {
            match &self.conn {
                Connection::Standalone(conn) => {
                    let _: String = redis::cmd("PING").query_async(&mut conn.clone()).await.step("ping")?;
                    Ok(())
                }
                Connection::Cluster(conn) => self.every_slot_answers(conn).await,
            }
        };
        tokio::time::timeout(PING_BUDGET, probe).await.unwrap_or_else(|_| {
            Err(RegistryError::Unavailable(format!("no answer within {} ms", PING_BUDGET.as_millis())))
        })
    }

    /// A cluster is ready when every slot has a master that answers for it. PING is not
    /// enough: the client sends it to the masters it holds connections to and drops a
    /// dead master's, so a killed master would read as healthy until its replica takes
    /// over (found by tests/redis_cluster.rs's kill -9). So: the slot map, then a keyed
    /// read (EXISTS, writes nothing) into each master's range, routed as the scripts are.
    async fn every_slot_answers(&self, conn: &ClusterHandle) -> Result<(), RegistryError> {
        let answer: Vec<Value> =
            redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut conn.clone()).await.step("read the slot map")?;
        let ranges = slot_ranges(&answer);
        let covered: u32 = ranges.iter().map(|r| u32::from(r.end.saturating_sub(r.start)) + 1).sum();
        if covered < CLUSTER_SLOTS {
            return Err(RegistryError::Unavailable(format!(
                "{} of {CLUSTER_SLOTS} cluster slots have no master",
                CLUSTER_SLOTS - covered
            )));
        }
        let probes = ranges.iter().filter_map(|r| {
            let key = format!("{}:probe:{{{}}}", self.prefix, tag_in_slots(r.start, r.end)?);
            let mut conn = conn.clone();
            Some(async move {
                let _: bool = redis::cmd("EXISTS").arg(key).query_async(&mut conn).await.step("reach every master")?;
                Ok::<_, RegistryError>(())
            })
        });
        futures::future::try_join_all(probes).await?;
        Ok(())
    }

    /// Writes a new session lease, retiring any live one, if the nonce is fresh. One
    /// script: nonce guard, rotation and lease are a single atomic step.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "sessions"))]
    pub async fn hello(
        &self,
        a: &RunAddress,
        nonce: &str,
        s: &NewSession<'_>,
        nonce_ttl: Duration,
    ) -> Result<HelloOutcome, RegistryError> {
        let mut conn = self.conn.clone();
        let out: String = self
            .hello
            .key(self.key(a, "session"))
            .key(self.key(a, "retired"))
            .key(self.key(a, &format!("nonce:{nonce}")))
            .key(self.key(a, "identity"))
            .arg(s.token_hash)
            .arg(s.session_id.to_string())
            .arg(s.generation)
            .arg(s.now.timestamp_millis())
            .arg(s.lease.as_millis() as u64)
            .arg(nonce_ttl.as_secs())
            .arg(s.version.unwrap_or_default())
            .arg(s.target.map(to_json).unwrap_or_default())
            .arg(to_json(&s.capabilities))
            .arg(to_json(s.capacity))
            .arg(s.epoch)
            .invoke_async(&mut conn)
            .await
            .step("hello: write the session lease")?;
        match out.as_str() {
            "replayed" => Ok(HelloOutcome::ReplayedNonce),
            "stale" => Ok(HelloOutcome::Stale),
            "rotated" => Ok(HelloOutcome::Rotated),
            "started" => Ok(HelloOutcome::Started),
            other => Err(RegistryError::CorruptSession { address: a.clone(), field: "hello", value: other.into() }),
        }
    }

    /// Checks a token: the whole session while it is valid.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "sessions"))]
    pub async fn check(&self, a: &RunAddress, token_hash: &str) -> Result<TokenCheck<Session>, RegistryError> {
        let mut conn = self.conn.clone();
        let out: Value = self
            .token_script(&self.check, a, token_hash)
            .invoke_async(&mut conn)
            .await
            .step("check the session token")?;
        // A list is the session's fields; a single word is why the token is not valid.
        if let Value::Array(_) = out {
            let list: Vec<String> =
                redis::from_redis_value_ref(&out).map_err(RedisError::from).step("read the session")?;
            return Ok(TokenCheck::Valid(SessionFields::new(a, list).session()?));
        }
        refused(a, &out, "check")
    }

    /// A heartbeat: checks the token, stores the snapshot's changes and renews the lease,
    /// in one script of three commands (see RENEW).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "sessions"))]
    pub async fn renew(
        &self,
        a: &RunAddress,
        token_hash: &str,
        r: Renewal<'_>,
    ) -> Result<TokenCheck<Lease>, RegistryError> {
        let mut conn = self.conn.clone();
        let mut call = self.renew.key(self.key(a, "session"));
        call.key(self.key(a, "retired")).arg(token_hash);
        let out: Value = call
            .arg(r.capabilities.map(to_json).unwrap_or_default())
            .arg(r.capacity.map(to_json).unwrap_or_default())
            .arg(r.draining.map(|d| if d { "1" } else { "0" }).unwrap_or_default())
            .invoke_async(&mut conn)
            .await
            .step("renew the session lease")?;
        if let Value::Array(_) = out {
            let (epoch, lease_ms, drain_changed): (String, i64, i64) =
                redis::from_redis_value_ref(&out).map_err(RedisError::from).step("read the renewed lease")?;
            let corrupt =
                |field: &'static str, value: String| RegistryError::CorruptSession { address: a.clone(), field, value };
            let epoch = match epoch.as_str() {
                "" => 0,
                text => text.parse().map_err(|_| corrupt("epoch", epoch.clone()))?,
            };
            let lease_left =
                Duration::from_millis(u64::try_from(lease_ms).map_err(|_| corrupt("lease_ms", lease_ms.to_string()))?);
            return Ok(TokenCheck::Valid(Lease { epoch, lease_left, drain_changed: drain_changed == 1 }));
        }
        refused(a, &out, "renew")
    }

    /// The live session of an address with what is left of its lease, if any.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "sessions"))]
    pub async fn session(&self, a: &RunAddress) -> Result<Option<Session>, RegistryError> {
        let mut conn = self.conn.clone();
        let list: Vec<String> =
            self.read.key(self.key(a, "session")).invoke_async(&mut conn).await.step("read the session")?;
        if list.is_empty() {
            return Ok(None);
        }
        SessionFields::new(a, list).session().map(Some)
    }

    /// How many of these addresses have a live session (the runs-online gauge): EXISTS of
    /// each session key, one pipeline per Redis master for each `COUNT_BATCH` Runs, so a
    /// scrape waits for a round trip per master per batch however many Runs there are.
    /// (It was one read per identity, one after another: about a second at 10,000.) A
    /// lease counter kept by the scripts cannot do this: a lease ends by expiring, with no
    /// script running, and a cluster script cannot touch a key outside its Run's slot. A
    /// cached gauge would only make the same cost rarer, and the number stale.
    #[tracing::instrument(level = "debug", skip_all, fields(store = "sessions"))]
    pub async fn count_live(&self, addresses: &[RunAddress]) -> Result<usize, RegistryError> {
        let mut live = 0;
        match &self.conn {
            Connection::Standalone(conn) => {
                for batch in addresses.chunks(COUNT_BATCH) {
                    let keys: Vec<String> = batch.iter().map(|a| self.key(a, "session")).collect();
                    let answers = conn
                        .clone()
                        .req_packed_commands(&exists_pipeline(&keys), 0, keys.len())
                        .await
                        .step("runs online: count live sessions")?;
                    live += existing(answers)?;
                }
            }
            Connection::Cluster(conn) => {
                // A pipeline goes to one node: group the keys by the master of their slot,
                // by the slot map read once per count. Should it change in between, a
                // moved key's answer is an error and this scrape reports nothing new (the
                // next one will).
                if addresses.is_empty() {
                    return Ok(0);
                }
                let answer: Vec<Value> = redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async(&mut conn.clone())
                    .await
                    .step("runs online: read the slot map")?;
                let ranges = slot_ranges(&answer);
                for batch in addresses.chunks(COUNT_BATCH) {
                    let keys = batch.iter().map(|a| (address_slot(a), self.key(a, "session"))).collect();
                    let groups = by_master(&ranges, keys)
                        .map_err(|slot| RegistryError::Unavailable(format!("cluster slot {slot} has no master")))?;
                    let counts = groups.into_iter().map(|(slot, keys)| async move {
                        let answers = conn
                            .pipeline_to_slot(exists_pipeline(&keys), keys.len(), slot)
                            .await
                            .step("runs online: count live sessions on a master")?;
                        existing(answers)
                    });
                    live += futures::future::try_join_all(counts).await?.into_iter().sum::<usize>();
                }
            }
        }
        Ok(live)
    }

    /// Makes `epoch` the address's current epoch (never lowering it) and ends a session
    /// of any other one; returns the live session left, if any. Every reconcile of a
    /// RunSession runs it (level-triggered revocation: a write that failed is made by the
    /// next reconcile), as does the finalizer of a deleted one (with `expires`: the
    /// revoked identity's epoch need not stay forever).
    #[tracing::instrument(level = "debug", skip_all, fields(store = "sessions"))]
    pub async fn fence(&self, a: &RunAddress, epoch: i64, expires: Option<Duration>) -> Result<Fenced, RegistryError> {
        let mut conn = self.conn.clone();
        let out: redis::Value = self
            .fence
            .key(self.key(a, "session"))
            .key(self.key(a, "identity"))
            .arg(epoch)
            .arg(expires.map(|d| d.as_secs().max(1)).unwrap_or(0))
            .invoke_async(&mut conn)
            .await
            .step("fence the session to the identity's epoch")?;
        if let redis::Value::Array(_) = out {
            let list: Vec<String> =
                redis::from_redis_value_ref(&out).map_err(redis::RedisError::from).step("read the session")?;
            if list.is_empty() {
                return Ok(Fenced::Absent);
            }
            return Ok(Fenced::Live(SessionFields::new(a, list).session()?));
        }
        let word: String = redis::from_redis_value_ref(&out).map_err(redis::RedisError::from).step("read the fence")?;
        match word.as_str() {
            "revoked" => Ok(Fenced::Revoked),
            other => Err(RegistryError::CorruptSession { address: a.clone(), field: "fence", value: other.into() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection with no node left is replaced once per generation; other errors, and
    /// late failures of a connection already replaced, leave the current one alone. (No
    /// server: the seed node is never dialled, the handle only swaps.)
    #[tokio::test]
    async fn a_cluster_connection_with_no_node_left_is_replaced_once() {
        let client = ClusterClient::new(vec!["redis://127.0.0.1:1"]).expect("client");
        let handle = ClusterHandle::new(client, ClusterConfig::new());
        let no_node = RedisError::from((ErrorKind::ClusterConnectionNotFound, "No connections found"));
        let io = RedisError::from(std::io::Error::other("reset"));
        assert_eq!(handle.connection().0, 0);
        handle.after_error(0, &io);
        assert_eq!(handle.connection().0, 0, "an I/O error is the client's own to recover from");
        handle.after_error(0, &no_node);
        assert_eq!(handle.connection().0, 1, "no node left: a new connection from the seed nodes");
        handle.after_error(0, &no_node);
        assert_eq!(handle.connection().0, 1, "the old connection's late failures do not replace the new one");
        handle.clone().after_error(1, &no_node);
        assert_eq!(handle.connection().0, 2, "clones share the connection");
    }

    /// A connection whose requests keep failing at the transport (every request timing
    /// out after a whole-cluster restart, seen in CI) is replaced after `STUCK_AFTER` in
    /// a row; a success in between, or Redis refusing a command, is no such run.
    #[tokio::test]
    async fn a_cluster_connection_that_keeps_failing_at_the_transport_is_dialled_again() {
        let client = ClusterClient::new(vec!["redis://127.0.0.1:1"]).expect("client");
        let handle = ClusterHandle::new(client, ClusterConfig::new());
        let timeout = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(timeout.is_timeout());
        for _ in 1..STUCK_AFTER {
            handle.after_error(0, &timeout);
        }
        assert_eq!(handle.connection().0, 0, "a few timeouts are a slow moment, not a stuck connection");
        handle.after_success();
        for _ in 1..STUCK_AFTER {
            handle.after_error(0, &timeout);
        }
        assert_eq!(handle.connection().0, 0, "a success in between starts the count again");
        handle.after_error(0, &timeout);
        assert_eq!(handle.connection().0, 1, "STUCK_AFTER in a row: dialled again");
        for _ in 0..2 * STUCK_AFTER {
            handle.after_error(0, &timeout);
        }
        assert_eq!(handle.connection().0, 1, "late failures of the replaced connection count for nothing");
        let refused = RedisError::from((ErrorKind::UnexpectedReturnType, "not a hash"));
        for _ in 0..2 * STUCK_AFTER {
            handle.after_error(1, &refused);
        }
        assert_eq!(handle.connection().0, 1, "an answer of the wrong type is no transport failure");
    }

    fn fields(pairs: &[(&str, &str)]) -> SessionFields {
        let address = RunAddress { server_instance_id: "srv".into(), component_kind: "run".into() };
        SessionFields::new(&address, pairs.iter().flat_map(|(k, v)| [k.to_string(), v.to_string()]).collect())
    }

    const GOOD: [(&str, &str); 10] = [
        ("token_hash", "secret"),
        ("session_id", "6f1c1b9e-0c59-4d2b-9d36-5c1f8f0b8a11"),
        ("generation", "3"),
        ("started_at_ms", "1700000000000"),
        ("lease_ms", "30000"),
        ("version", "1.4.2"),
        ("target", r#"{"os":"linux","arch":"amd64"}"#),
        ("capabilities", r#"["lifecycle","config"]"#),
        ("capacity", r#"{"slots":4}"#),
        ("ttl_ms", "20000"),
    ];

    /// Redis Cluster's rule: the text between the first `{` and the next `}`, if not empty.
    fn hash_tag(key: &str) -> Option<&str> {
        let open = key.find('{')?;
        let close = key[open + 1..].find('}')? + open + 1;
        Some(&key[open + 1..close]).filter(|t| !t.is_empty())
    }

    #[test]
    fn every_key_of_one_identity_is_on_the_slot_of_its_address() {
        let endpoint = RedisEndpoint::Standalone("redis://127.0.0.1:1".into());
        let store = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(async { SessionStore::new(&endpoint, "prism-a.b_c").expect("store") });
        let a = RunAddress { server_instance_id: "srv-eu1.7".into(), component_kind: "run".into() };
        let (session, retired, identity) = store.session_keys(&a);
        let nonce = store.key(&a, "nonce:AbC_-{x}0123456789");
        for key in [&session, &retired, &identity, &nonce] {
            assert_eq!(hash_tag(key), Some("srv-eu1.7/run"), "{key}");
        }
        assert_eq!(session, "prism-a.b_c:run:{srv-eu1.7/run}:session");
    }

    #[test]
    fn slots_are_computed_as_redis_computes_them() {
        // Answers of CLUSTER KEYSLOT on Redis 7.
        for (key, slot) in [("123456789", 12739), ("foo", 12182), ("somekey", 11058), ("hello", 866)] {
            assert_eq!(crc16(key.as_bytes()) % 16384, slot, "{key}");
        }
        for (start, end) in [(0, 5460), (5461, 10922), (10923, 16383), (777, 777), (16383, 16383)] {
            let tag = tag_in_slots(start, end).expect("a tag");
            assert!((start..=end).contains(&(crc16(tag.as_bytes()) % 16384)), "{tag} for {start}-{end}");
        }
        let answer = vec![
            Value::Array(vec![Value::Int(0), Value::Int(5460), Value::Array(vec![])]),
            Value::Array(vec![Value::Int(5461), Value::Int(16383), Value::Array(vec![]), Value::Array(vec![])]),
            Value::Nil,
        ];
        let bounds: Vec<(u16, u16)> = slot_ranges(&answer).iter().map(|r| (r.start, r.end)).collect();
        assert_eq!(bounds, [(0, 5460), (5461, 16383)]);
    }

    #[test]
    fn keys_are_grouped_by_the_master_of_their_slot() {
        let node = |host: &str, port: i64| Value::Array(vec![Value::BulkString(host.into()), Value::Int(port)]);
        let answer = vec![
            Value::Array(vec![Value::Int(0), Value::Int(5460), node("10.0.0.1", 7001), node("10.0.0.4", 7004)]),
            Value::Array(vec![Value::Int(5461), Value::Int(10922), node("10.0.0.2", 7002)]),
            Value::Array(vec![Value::Int(10923), Value::Int(16383), node("10.0.0.1", 7001)]),
        ];
        let ranges = slot_ranges(&answer);
        assert_eq!(ranges[0].master.as_deref(), Some("10.0.0.1:7001"));
        let keys = vec![(12, "a".to_string()), (6000, "b".into()), (16000, "c".into()), (5460, "d".into())];
        let groups = by_master(&ranges, keys).expect("every slot covered");
        // Two masters: the first serves two ranges, so one pipeline carries a, c and d.
        assert_eq!(groups, [(12, vec!["a".to_string(), "c".into(), "d".into()]), (6000, vec!["b".to_string()])]);
        assert_eq!(by_master(&ranges[..2], vec![(16000, "c".into())]), Err(16000));

        // Ranges whose master is in no shape we read are not merged into one group (they
        // may be different masters): each is a round trip of its own.
        let unreadable = vec![
            Value::Array(vec![Value::Int(0), Value::Int(8000), Value::Array(vec![])]),
            Value::Array(vec![Value::Int(8001), Value::Int(16383), Value::Nil]),
        ];
        let ranges = slot_ranges(&unreadable);
        assert_eq!(ranges[0].master, None);
        let groups = by_master(&ranges, vec![(1, "a".into()), (9000, "b".into()), (2, "c".into())]).expect("covered");
        assert_eq!(groups, [(1, vec!["a".to_string(), "c".into()]), (9000, vec!["b".to_string()])]);

        // A Run's slot is its hash tag's, as Redis computes it for its keys.
        let a = RunAddress { server_instance_id: "srv-eu1.7".into(), component_kind: "run".into() };
        assert_eq!(address_slot(&a), crc16(b"srv-eu1.7/run") % 16384);
    }

    #[test]
    fn exists_answers_count_and_errors_name_the_step() {
        assert_eq!(existing(vec![Value::Int(1), Value::Int(0), Value::Int(1)]).expect("count"), 2);
        let err = existing(vec![Value::Int(1), Value::Nil]).expect_err("not a number");
        assert!(err.to_string().contains("runs online: count live sessions"), "{err}");
    }

    #[test]
    fn a_stored_session_reads_as_typed_fields() {
        let s = fields(&GOOD).session().expect("session");
        assert_eq!(s.generation, 3);
        assert_eq!(s.target, Some(RunTarget { os: "linux".into(), arch: "amd64".into() }));
        assert_eq!(s.capabilities, vec!["lifecycle".to_string(), "config".to_string()]);
        assert_eq!(s.capacity.get("slots"), Some(&4));
        assert_eq!(s.lease_left, Duration::from_secs(20));
        assert_eq!(s.version.as_deref(), Some("1.4.2"));
        // 20 s left of a 30 s lease: renewed 10 s ago (no heartbeat writes its time).
        let ago = (Utc::now() - s.last_heartbeat).num_milliseconds();
        assert!((10_000..11_000).contains(&ago), "last heartbeat {ago} ms ago");
    }

    #[test]
    fn absent_parts_are_empty_and_bad_parts_are_errors_naming_the_field() {
        let mut minimal: Vec<(&str, &str)> = GOOD.to_vec();
        minimal.retain(|(k, _)| !matches!(*k, "target" | "capabilities" | "capacity" | "version"));
        let s = fields(&minimal).session().expect("session");
        assert_eq!((s.target, s.capabilities.len(), s.capacity.len(), s.version), (None, 0, 0, None));

        let mut bad = GOOD.to_vec();
        bad[6] = ("target", "not json");
        let err = fields(&bad).session().expect_err("corrupt");
        assert!(err.to_string().contains("srv/run has target = \"not json\""), "{err}");
        let mut bad = GOOD.to_vec();
        bad[2] = ("generation", "x");
        assert!(matches!(fields(&bad).session(), Err(RegistryError::CorruptSession { field: "generation", .. })));
    }

    #[test]
    fn draining_reads_as_written_and_absent_is_not_draining() {
        assert!(!fields(&GOOD).session().expect("a session of a build before drain").draining);
        for (text, draining) in [("0", false), ("1", true)] {
            let mut drained = GOOD.to_vec();
            drained.push(("draining", text));
            assert_eq!(fields(&drained).session().expect("session").draining, draining, "{text}");
        }
        let mut bad = GOOD.to_vec();
        bad.push(("draining", "yes"));
        assert!(matches!(fields(&bad).session(), Err(RegistryError::CorruptSession { field: "draining", .. })));
    }
}

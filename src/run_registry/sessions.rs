//! The runtime session registry's Redis side. Redis is required: there is no in-memory
//! fallback, and an unreachable Redis is reported as such, never papered over.
//!
//! Keys of one Run identity share the hash tag `{server/component}`, and every change
//! that touches more than one key is a single Lua script, so the scripts run unchanged on
//! Redis Cluster:
//! * `{prefix}:run:{srv/comp}:session` — hash, the live session; its TTL *is* the lease.
//! * `{prefix}:run:{srv/comp}:retired` — set of superseded token hashes (TTL: a lease).
//! * `{prefix}:run:{srv/comp}:nonce:{nonce}` — replay guard for hello nonces.

use std::collections::HashMap;
use std::time::Duration;

use redis::Script;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::RuntimeError;

/// A Run identity: what Redis keys and jobs are addressed by.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target {
    pub server_instance_id: String,
    pub component_kind: String,
}

/// The stored session (never its token; the token hash stays inside Redis scripts).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Session {
    pub session_id: String,
    pub generation: i64,
    pub started_at_ms: i64,
    pub last_heartbeat_ms: i64,
    pub version: String,
    /// JSON documents as the Run sent them (validated before they got here).
    pub target: String,
    pub capabilities: String,
    pub capacity: String,
    /// Milliseconds left on the lease.
    pub ttl_ms: i64,
}

/// What a token is worth right now.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenCheck {
    Valid(Session),
    /// A newer hello replaced this token.
    Superseded,
    /// No live session for this identity (lease expired, or Redis lost it).
    Expired,
}

/// A fresh session to write at hello.
pub struct NewSession<'a> {
    pub token_hash: &'a str,
    pub session_id: &'a str,
    pub generation: i64,
    pub now_ms: i64,
    pub lease_ms: i64,
    pub version: &'a str,
    pub target: &'a str,
    pub capabilities: &'a str,
    pub capacity: &'a str,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HelloOutcome {
    /// The identity had no live session.
    Started,
    /// A live session was replaced: its token stops authorizing at once.
    Rotated,
    ReplayedNonce,
}

// KEYS: session, retired, nonce. ARGV: token_hash, session_id, generation, now_ms,
// lease_ms, nonce_ttl_s, version, target, capabilities, capacity.
const HELLO: &str = r#"
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[6]) then
  return 'replayed'
end
local old = redis.call('HGET', KEYS[1], 'token_hash')
if old then
  redis.call('SADD', KEYS[2], old)
  redis.call('PEXPIRE', KEYS[2], math.max(tonumber(ARGV[5]), 60000) * 2)
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'token_hash', ARGV[1], 'session_id', ARGV[2], 'generation', ARGV[3],
  'started_at_ms', ARGV[4], 'last_heartbeat_ms', ARGV[4], 'lease_ms', ARGV[5], 'version', ARGV[7],
  'target', ARGV[8], 'capabilities', ARGV[9], 'capacity', ARGV[10])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if old then return 'rotated' end
return 'started'
"#;

// KEYS: session, retired. ARGV: token_hash, renew ("1"/"0"), now_ms, capabilities or "",
// capacity or "". Returns the session fields, or a status word.
/// Public for the benchmark, which runs this same script straight against Redis.
pub const CHECK: &str = r#"
local cur = redis.call('HGET', KEYS[1], 'token_hash')
if cur ~= ARGV[1] then
  if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return 'superseded' end
  return 'expired'
end
if ARGV[2] == '1' then
  redis.call('HSET', KEYS[1], 'last_heartbeat_ms', ARGV[3])
  if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'capabilities', ARGV[4]) end
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'capacity', ARGV[5]) end
  redis.call('PEXPIRE', KEYS[1], redis.call('HGET', KEYS[1], 'lease_ms'))
end
local fields = redis.call('HGETALL', KEYS[1])
table.insert(fields, 'ttl_ms')
table.insert(fields, tostring(redis.call('PTTL', KEYS[1])))
return fields
"#;

// KEYS: session. Returns the session fields plus its TTL, or nothing.
const READ: &str = r#"
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return fields end
table.insert(fields, 'ttl_ms')
table.insert(fields, tostring(redis.call('PTTL', KEYS[1])))
return fields
"#;

/// A lazily connected, self-reconnecting Redis connection plus the key prefix every key
/// of this operator lives under.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    prefix: String,
    hello: Script,
    check: Script,
    read: Script,
}

fn session_of(mut fields: HashMap<String, String>) -> Session {
    let mut take = |k: &str| fields.remove(k).unwrap_or_default();
    let num = |s: String| s.parse::<i64>().unwrap_or_default();
    Session {
        session_id: take("session_id"),
        generation: num(take("generation")),
        started_at_ms: num(take("started_at_ms")),
        last_heartbeat_ms: num(take("last_heartbeat_ms")),
        version: take("version"),
        target: take("target"),
        capabilities: take("capabilities"),
        capacity: take("capacity"),
        ttl_ms: num(take("ttl_ms")),
    }
}

fn pairs(list: Vec<String>) -> HashMap<String, String> {
    let mut map = HashMap::new();
    let mut it = list.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        map.insert(k, v);
    }
    // The token hash never leaves this module.
    map.remove("token_hash");
    map
}

impl RedisStore {
    /// Does not connect: the operator starts (and reports "unavailable") while Redis is down.
    pub fn new(url: &str, prefix: &str) -> Result<Self, RuntimeError> {
        let client = redis::Client::open(url)?;
        // Short timeouts: a Run waiting on a dead Redis should get a 503 quickly, not hang.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, config)?;
        Ok(Self {
            conn,
            prefix: prefix.to_string(),
            hello: Script::new(HELLO),
            check: Script::new(CHECK),
            read: Script::new(READ),
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The session hash and retired set of an identity (for the benchmark's baseline).
    pub fn session_keys(&self, t: &Target) -> (String, String) {
        (self.key(t, "session"), self.key(t, "retired"))
    }

    fn key(&self, t: &Target, suffix: &str) -> String {
        format!("{}:run:{{{}/{}}}:{suffix}", self.prefix, t.server_instance_id, t.component_kind)
    }

    /// Round trip to Redis, for readiness.
    pub async fn ping(&self) -> Result<(), RuntimeError> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        Ok(())
    }

    /// Writes a new session lease, retiring any live one, if the nonce is fresh. One
    /// script: nonce guard, rotation and lease are a single atomic step.
    pub async fn hello(
        &self,
        t: &Target,
        nonce: &str,
        s: &NewSession<'_>,
        nonce_ttl_secs: u64,
    ) -> Result<HelloOutcome, RuntimeError> {
        let mut conn = self.conn.clone();
        let out: String = self
            .hello
            .key(self.key(t, "session"))
            .key(self.key(t, "retired"))
            .key(self.key(t, &format!("nonce:{nonce}")))
            .arg(s.token_hash)
            .arg(s.session_id)
            .arg(s.generation)
            .arg(s.now_ms)
            .arg(s.lease_ms)
            .arg(nonce_ttl_secs)
            .arg(s.version)
            .arg(s.target)
            .arg(s.capabilities)
            .arg(s.capacity)
            .invoke_async(&mut conn)
            .await?;
        Ok(match out.as_str() {
            "replayed" => HelloOutcome::ReplayedNonce,
            "rotated" => HelloOutcome::Rotated,
            _ => HelloOutcome::Started,
        })
    }

    /// Checks a token; with `renew`, also extends the lease and stores the snapshot.
    pub async fn check(
        &self,
        t: &Target,
        token_hash: &str,
        renew: Option<(i64, Option<&str>, Option<&str>)>,
    ) -> Result<TokenCheck, RuntimeError> {
        let mut conn = self.conn.clone();
        let (flag, now, caps, cap) = match renew {
            Some((now, caps, cap)) => ("1", now, caps.unwrap_or(""), cap.unwrap_or("")),
            None => ("0", 0, "", ""),
        };
        let out: redis::Value = self
            .check
            .key(self.key(t, "session"))
            .key(self.key(t, "retired"))
            .arg(token_hash)
            .arg(flag)
            .arg(now)
            .arg(caps)
            .arg(cap)
            .invoke_async(&mut conn)
            .await?;
        // A list is the session's fields; a single word is why the token is not valid.
        if let Ok(list) = redis::from_redis_value_ref::<Vec<String>>(&out)
            && list.len() > 1
        {
            return Ok(TokenCheck::Valid(session_of(pairs(list))));
        }
        Ok(match redis::from_redis_value_ref::<String>(&out).unwrap_or_default().as_str() {
            "superseded" => TokenCheck::Superseded,
            _ => TokenCheck::Expired,
        })
    }

    /// The live session of an identity with its remaining lease, if any.
    pub async fn session(&self, t: &Target) -> Result<Option<Session>, RuntimeError> {
        let mut conn = self.conn.clone();
        let list: Vec<String> = self.read.key(self.key(t, "session")).invoke_async(&mut conn).await?;
        Ok((!list.is_empty()).then(|| session_of(pairs(list))))
    }

    /// Ends an identity's live session at once (credential rotated, resource deleted).
    pub async fn revoke(&self, t: &Target) -> Result<bool, RuntimeError> {
        let mut conn = self.conn.clone();
        let removed: i64 = redis::cmd("DEL").arg(self.key(t, "session")).query_async(&mut conn).await?;
        Ok(removed > 0)
    }
}

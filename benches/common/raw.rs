//! The Run heartbeat's baseline: the operator's heartbeat script as it was on 2026-12-02
//! (commit 152bb13, `sessions::CHECK` with a renewal), frozen here and sent bare to Redis
//! with the keys and token hash the operator would pass for each Run. Frozen: a baseline
//! that ran the operator's current script would move with every change made to it, and
//! the ratio would show nothing. Used by the runtime and the scale bench.

use prism_operator::run_client::RunClient;
use prism_operator::run_registry::service::token_hash;
use prism_operator::run_registry::{RunAddress, SessionStore};

const FROZEN_CHECK: &str = r#"
local cur = redis.call('HGET', KEYS[1], 'token_hash')
if cur ~= ARGV[1] then
  if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return 'superseded' end
  return 'expired'
end
if redis.call('HGET', KEYS[1], 'epoch') ~= redis.call('GET', KEYS[3]) then
  redis.call('DEL', KEYS[1])
  return 'revoked'
end
local drain_changed = false
if ARGV[2] == '1' then
  redis.call('HSET', KEYS[1], 'last_heartbeat_ms', ARGV[3])
  if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'capabilities', ARGV[4]) end
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'capacity', ARGV[5]) end
  local draining = ARGV[6] or ''
  if draining ~= '' and (redis.call('HGET', KEYS[1], 'draining') or '0') ~= draining then
    redis.call('HSET', KEYS[1], 'draining', draining)
    drain_changed = true
  end
  redis.call('PEXPIRE', KEYS[1], redis.call('HGET', KEYS[1], 'lease_ms'))
end
local fields = redis.call('HGETALL', KEYS[1])
table.insert(fields, 'ttl_ms')
table.insert(fields, tostring(redis.call('PTTL', KEYS[1])))
if drain_changed then
  table.insert(fields, 'drain_changed')
  table.insert(fields, '1')
end
return fields
"#;

/// The frozen heartbeat script, for `raw_heartbeat`.
pub fn frozen_heartbeat_script() -> redis::Script {
    redis::Script::new(FROZEN_CHECK)
}

/// Each Run's session and record keys (as `store` names them) and its token's hash.
pub fn heartbeat_keys(store: &SessionStore, runs: &[RunClient]) -> Vec<(String, String, String, String)> {
    runs.iter()
        .map(|run| {
            let at = RunAddress { server_instance_id: run.server_instance_id.clone(), component_kind: "run".into() };
            let (session, record, identity) = store.session_keys(&at);
            (session, record, identity, token_hash(run.token.as_deref().unwrap_or_default()))
        })
        .collect()
}

/// One bare renew of `keys`' session, as the heartbeat's baseline: true when Redis ran it.
pub async fn raw_heartbeat(
    conn: &mut redis::aio::MultiplexedConnection,
    script: &redis::Script,
    keys: &(String, String, String, String),
) -> bool {
    let (session, record, identity, hash) = keys;
    let now = chrono::Utc::now().timestamp_millis();
    let res: redis::RedisResult<redis::Value> = script
        .key(session)
        .key(record)
        .key(identity)
        .arg(hash)
        .arg("1")
        .arg(now)
        .arg("")
        .arg("")
        .invoke_async(conn)
        .await;
    res.is_ok()
}

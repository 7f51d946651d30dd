//! The Run heartbeat's baseline: the operator's own Lua script (`sessions::CHECK`) sent
//! bare to Redis, with the keys and token hash the operator would pass for each Run.
//! Used by the runtime and the scale bench.

use prism_operator::run_client::RunClient;
use prism_operator::run_registry::service::token_hash;
use prism_operator::run_registry::{RunAddress, SessionStore};

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

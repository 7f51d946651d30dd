//! The runtime session registry's Redis side. Redis is required: there is no in-memory
//! fallback, and an unreachable Redis is reported as such, never papered over.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("runtime registry unavailable: {0}")]
    Unavailable(#[from] redis::RedisError),
}

/// A lazily connected, self-reconnecting Redis connection plus the key prefix every key
/// of this operator lives under.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    prefix: String,
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
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Round trip to Redis, for readiness.
    pub async fn ping(&self) -> Result<(), RuntimeError> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        Ok(())
    }
}

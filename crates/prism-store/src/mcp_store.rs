//! What MCP sessions keep in Postgres, for any replica: the key that signs their ids
//! (`mcp_session_key`) and the resources each session follows (`mcp_subscriptions`,
//! keyed by a digest of its signed `Mcp-Session-Id`). The API decides who may follow
//! what and how much (`api::mcp::subscriptions`); this store only reads and writes, and
//! NOTIFYs the session's stream, wherever it runs, when what it follows changes.

use std::time::Duration;

use sqlx::PgPool;

use crate::db::{QueryError, Step};
use crate::signals::{MCP_SUBSCRIPTIONS, ProjectKey};
use prism_core::election::ChangeId;

/// The MCP sessions' tables.
#[derive(Clone)]
pub struct McpStore {
    pool: PgPool,
}

/// A session, as its rows name it: the digest of its id and of its owner.
#[derive(Clone, Copy, Debug)]
pub struct SessionRows<'a> {
    pub session: &'a str,
    pub owner: &'a str,
}

/// How much one session, and one owner over all its sessions, may follow.
#[derive(Clone, Copy, Debug)]
pub struct FollowQuota {
    pub per_session: i64,
    pub per_owner: i64,
}

/// A followed resource.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct Followed {
    pub uri: String,
    pub namespace: String,
    pub project_id: String,
    seen_term: Option<i64>,
    seen_seq: Option<i64>,
}

impl Followed {
    /// Where the project stood when the session was last told of it.
    pub fn seen(&self) -> Option<ChangeId> {
        Some(ChangeId { term: self.seen_term?, seq: self.seen_seq? })
    }
}

impl McpStore {
    pub fn new(pool: PgPool) -> Self {
        McpStore { pool }
    }

    /// The session-signing key every replica of this database shares: `fresh` if this
    /// is the first replica to ask, else the one the first wrote.
    pub async fn shared_session_key(&self, fresh: &[u8]) -> Result<Vec<u8>, QueryError> {
        sqlx::query("INSERT INTO mcp_session_key (key) VALUES ($1) ON CONFLICT (id) DO NOTHING")
            .bind(fresh)
            .execute(&self.pool)
            .await
            .step("mcp: store a new session key")?;
        sqlx::query_scalar("SELECT key FROM mcp_session_key WHERE id")
            .fetch_one(&self.pool)
            .await
            .step("mcp: read the shared session key")
    }

    /// Follows `uri` (the resource of `project`) for the session, from `seen`; false
    /// when the session or its owner holds all the quota allows. Following again renews,
    /// and keeps where the session was last told of it.
    pub async fn subscribe(
        &self,
        rows: SessionRows<'_>,
        uri: &str,
        project: &ProjectKey,
        seen: Option<ChangeId>,
        quota: FollowQuota,
    ) -> Result<bool, QueryError> {
        let added: Option<i32> = sqlx::query_scalar(
            "INSERT INTO mcp_subscriptions (session_digest, owner_digest, uri, namespace, project_id,
                                            seen_term, seen_seq)
             SELECT $1, $2, $3, $4, $5, $8, $9
              WHERE EXISTS (SELECT 1 FROM mcp_subscriptions WHERE session_digest = $1 AND uri = $3)
                 OR ((SELECT count(*) FROM mcp_subscriptions WHERE session_digest = $1) < $6
                     AND (SELECT count(*) FROM mcp_subscriptions WHERE owner_digest = $2) < $7)
             ON CONFLICT (session_digest, uri) DO UPDATE SET renewed_at = now()
             RETURNING 1",
        )
        .bind(rows.session)
        .bind(rows.owner)
        .bind(uri)
        .bind(&project.namespace)
        .bind(&project.project_id)
        .bind(quota.per_session)
        .bind(quota.per_owner)
        .bind(seen.map(|id| id.term))
        .bind(seen.map(|id| id.seq))
        .fetch_optional(&self.pool)
        .await
        .step("mcp: subscribe")?;
        if added.is_some() {
            self.signal(rows.session).await?;
        }
        Ok(added.is_some())
    }

    pub async fn unsubscribe(&self, session: &str, uri: &str) -> Result<(), QueryError> {
        sqlx::query("DELETE FROM mcp_subscriptions WHERE session_digest = $1 AND uri = $2")
            .bind(session)
            .bind(uri)
            .execute(&self.pool)
            .await
            .step("mcp: unsubscribe")?;
        self.signal(session).await
    }

    /// The session ended: it follows nothing.
    pub async fn forget(&self, session: &str) -> Result<(), QueryError> {
        sqlx::query("DELETE FROM mcp_subscriptions WHERE session_digest = $1")
            .bind(session)
            .execute(&self.pool)
            .await
            .step("mcp: forget a session's subscriptions")?;
        self.signal(session).await
    }

    /// What the session follows, renewing it when `renew`.
    pub async fn followed(&self, session: &str, renew: bool) -> Result<Vec<Followed>, QueryError> {
        let sql = if renew {
            "UPDATE mcp_subscriptions SET renewed_at = now() WHERE session_digest = $1
             RETURNING uri, namespace, project_id, seen_term, seen_seq"
        } else {
            "SELECT uri, namespace, project_id, seen_term, seen_seq FROM mcp_subscriptions WHERE session_digest = $1"
        };
        sqlx::query_as(sql).bind(session).fetch_all(&self.pool).await.step("mcp: read a session's subscriptions")
    }

    /// The session was told of `project` as it stands at `id`.
    pub async fn told(&self, session: &str, project: &ProjectKey, id: ChangeId) -> Result<(), QueryError> {
        sqlx::query(
            "UPDATE mcp_subscriptions SET seen_term = $4, seen_seq = $5
              WHERE session_digest = $1 AND namespace = $2 AND project_id = $3",
        )
        .bind(session)
        .bind(&project.namespace)
        .bind(&project.project_id)
        .bind(id.term)
        .bind(id.seq)
        .execute(&self.pool)
        .await
        .step("mcp: note what a session was told")?;
        Ok(())
    }

    /// Drops the session's subscriptions in `namespace`.
    pub async fn drop_namespace(&self, session: &str, namespace: &str) -> Result<(), QueryError> {
        sqlx::query("DELETE FROM mcp_subscriptions WHERE session_digest = $1 AND namespace = $2")
            .bind(session)
            .bind(namespace)
            .execute(&self.pool)
            .await
            .step("mcp: drop a revoked namespace's subscriptions")?;
        Ok(())
    }

    /// Deletes rows nobody renewed for `retention`; how many.
    pub async fn prune(&self, retention: Duration) -> Result<u64, QueryError> {
        let done = sqlx::query("DELETE FROM mcp_subscriptions WHERE renewed_at < now() - make_interval(secs => $1)")
            .bind(retention.as_secs_f64())
            .execute(&self.pool)
            .await
            .step("mcp: prune old subscriptions")?;
        Ok(done.rows_affected())
    }

    /// Wakes the session's stream on every replica: what it follows changed.
    async fn signal(&self, session: &str) -> Result<(), QueryError> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(MCP_SUBSCRIPTIONS)
            .bind(session)
            .execute(&self.pool)
            .await
            .step("mcp: signal a session's subscriptions")?;
        Ok(())
    }
}

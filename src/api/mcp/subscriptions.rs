//! `resources/subscribe` of the session-based MCP revisions (SPEC §11), for any replica.
//!
//! A session's subscriptions live in Postgres (`mcp_subscriptions`, keyed by a digest of
//! its signed `Mcp-Session-Id`), not in the memory of the replica that took them: the
//! session's GET stream (`GET /mcp` with the id) may reach another replica, and a
//! replica may stop. The stream reads what its session follows, sends
//! `notifications/resources/updated` for each change of a followed project (heard from
//! any replica through `signals`), and reads the set again when a subscribe or
//! unsubscribe anywhere NOTIFYs the session. `DELETE /mcp` (the end of a session)
//! forgets them.
//!
//! Bounded: `MAX_FOLLOWED` subscriptions per session, `MAX_PER_OWNER` per identity (a
//! caller minting sessions gains nothing), rows not renewed for `RETENTION` (a subscribe
//! or an open stream renews them) are deleted. Each subscribe is authorized as status;
//! an open stream checks its caller again every `RECHECK_EVERY` and drops the
//! subscriptions of namespaces it may no longer read (revocation is level-triggered).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::SessionFacts;
use super::resources::{Changes, Follower, MAX_FOLLOWED, ProjectUri, any_woken};
use crate::agent_sessions::ChangeId;
use crate::api::agents::RESOURCE;
use crate::api::auth::Caller;
use crate::api::watch::{KEEPALIVE, RECHECK_EVERY, stopped};
use crate::api::{ApiError, AppState};
use crate::db::{QueryError, Step};
use crate::signals::{MCP_SUBSCRIPTIONS, ProjectKey};

/// Subscriptions one identity may hold over all its sessions.
pub const MAX_PER_OWNER: i64 = 256;
/// Rows not renewed for this long are deleted.
pub const RETENTION: Duration = Duration::from_secs(24 * 3600);
/// An open stream renews its session's rows this often.
const RENEW_EVERY: Duration = Duration::from_secs(600);

/// The subscriptions of MCP sessions (table `mcp_subscriptions`).
#[derive(Clone)]
pub struct Subscriptions {
    pool: PgPool,
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
    /// Where the project stood when the session was last told of it (see `Baseline`).
    pub fn seen(&self) -> Option<ChangeId> {
        Some(ChangeId { term: self.seen_term?, seq: self.seen_seq? })
    }
}

impl Subscriptions {
    pub fn new(pool: PgPool) -> Self {
        Subscriptions { pool }
    }

    /// Follows `uri` for the session from where the project stands (`seen`, if it could
    /// be read); false when the session or its owner holds all it may. Subscribing
    /// again renews, and keeps where the session was last told of it.
    pub async fn subscribe(
        &self,
        session: &SessionFacts,
        uri: &str,
        project: &ProjectUri,
        seen: Option<ChangeId>,
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
        .bind(&session.id_digest)
        .bind(session.owner_digest())
        .bind(uri)
        .bind(&project.0.namespace)
        .bind(&project.0.project_id)
        .bind(MAX_FOLLOWED as i64)
        .bind(MAX_PER_OWNER)
        .bind(seen.map(|id| id.term))
        .bind(seen.map(|id| id.seq))
        .fetch_optional(&self.pool)
        .await
        .step("mcp: subscribe")?;
        if added.is_some() {
            self.signal(&session.id_digest).await?;
        }
        Ok(added.is_some())
    }

    pub async fn unsubscribe(&self, session: &SessionFacts, uri: &str) -> Result<(), QueryError> {
        sqlx::query("DELETE FROM mcp_subscriptions WHERE session_digest = $1 AND uri = $2")
            .bind(&session.id_digest)
            .bind(uri)
            .execute(&self.pool)
            .await
            .step("mcp: unsubscribe")?;
        self.signal(&session.id_digest).await
    }

    /// The session ended (`DELETE /mcp`): it follows nothing.
    pub async fn forget(&self, session: &SessionFacts) -> Result<(), QueryError> {
        sqlx::query("DELETE FROM mcp_subscriptions WHERE session_digest = $1")
            .bind(&session.id_digest)
            .execute(&self.pool)
            .await
            .step("mcp: forget a session's subscriptions")?;
        self.signal(&session.id_digest).await
    }

    /// What the session follows, renewing it when `renew`.
    pub async fn followed(&self, session: &SessionFacts, renew: bool) -> Result<Vec<Followed>, QueryError> {
        let sql = if renew {
            "UPDATE mcp_subscriptions SET renewed_at = now() WHERE session_digest = $1
             RETURNING uri, namespace, project_id, seen_term, seen_seq"
        } else {
            "SELECT uri, namespace, project_id, seen_term, seen_seq FROM mcp_subscriptions WHERE session_digest = $1"
        };
        sqlx::query_as(sql)
            .bind(&session.id_digest)
            .fetch_all(&self.pool)
            .await
            .step("mcp: read a session's subscriptions")
    }

    /// The session was told of `project` as it stands at `id`.
    async fn told(&self, session: &SessionFacts, project: &ProjectKey, id: ChangeId) -> Result<(), QueryError> {
        sqlx::query(
            "UPDATE mcp_subscriptions SET seen_term = $4, seen_seq = $5
              WHERE session_digest = $1 AND namespace = $2 AND project_id = $3",
        )
        .bind(&session.id_digest)
        .bind(&project.namespace)
        .bind(&project.project_id)
        .bind(id.term)
        .bind(id.seq)
        .execute(&self.pool)
        .await
        .step("mcp: note what a session was told")?;
        Ok(())
    }

    /// Drops the session's subscriptions in `namespace` (its caller may no longer read it).
    async fn drop_namespace(&self, session: &SessionFacts, namespace: &str) -> Result<(), QueryError> {
        sqlx::query("DELETE FROM mcp_subscriptions WHERE session_digest = $1 AND namespace = $2")
            .bind(&session.id_digest)
            .bind(namespace)
            .execute(&self.pool)
            .await
            .step("mcp: drop a revoked namespace's subscriptions")?;
        Ok(())
    }

    /// Deletes rows past `RETENTION`; how many.
    pub async fn prune(&self) -> Result<u64, QueryError> {
        let done = sqlx::query("DELETE FROM mcp_subscriptions WHERE renewed_at < now() - make_interval(secs => $1)")
            .bind(RETENTION.as_secs_f64())
            .execute(&self.pool)
            .await
            .step("mcp: prune old subscriptions")?;
        Ok(done.rows_affected())
    }

    async fn signal(&self, digest: &str) -> Result<(), QueryError> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(MCP_SUBSCRIPTIONS)
            .bind(digest)
            .execute(&self.pool)
            .await
            .step("mcp: signal a session's subscriptions")?;
        Ok(())
    }
}

/// `resources/subscribe`: authorized as status, then kept for the session.
pub async fn subscribe(
    state: &AppState,
    caller: &Caller,
    session: Option<&SessionFacts>,
    uri: &str,
) -> Result<(), ApiError> {
    let project = ProjectUri::parse(uri)?;
    state.auth.authorize(caller, "list", RESOURCE, &project.0.namespace).await?;
    let session = session.ok_or_else(no_session)?;
    // Read before the row is written: a change from here on is notified (`Baseline`).
    let seen = match state.agents.routing_change(&project.0.namespace, &project.0.project_id, None).await {
        Ok(change) => Some(change.id),
        // Kept without one: the session's stream then starts from its first look.
        Err(error) => {
            warn!(%error, "mcp: a subscription's baseline could not be read");
            None
        }
    };
    if !state.mcp.subscriptions.subscribe(session, uri, &project, seen).await? {
        return Err(ApiError::quota_exceeded(format!(
            "this session follows {MAX_FOLLOWED} resources (or your sessions {MAX_PER_OWNER}); unsubscribe first"
        )));
    }
    state.signals.wake_mcp_session(&session.id_digest);
    Ok(())
}

pub async fn unsubscribe(state: &AppState, session: Option<&SessionFacts>, uri: &str) -> Result<(), ApiError> {
    ProjectUri::parse(uri)?;
    let session = session.ok_or_else(no_session)?;
    state.mcp.subscriptions.unsubscribe(session, uri).await?;
    state.signals.wake_mcp_session(&session.id_digest);
    Ok(())
}

fn no_session() -> ApiError {
    ApiError::invalid("resources/subscribe needs the Mcp-Session-Id of an initialized session")
}

/// `GET /mcp` of a session: its notifications, as Server-Sent Events of JSON-RPC
/// messages.
pub fn stream(state: Arc<AppState>, follower: Follower, session: SessionFacts) -> Response {
    let (tx, mut rx) = mpsc::channel::<Event>(16);
    tokio::spawn(SessionStream { state, follower, session, tx }.run());
    let events = futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|e| e.map(Ok::<_, Infallible>)));
    let events: std::pin::Pin<Box<dyn Stream<Item = Result<Event, Infallible>> + Send>> = Box::pin(events);
    Sse::new(events).keep_alive(KeepAlive::new().interval(KEEPALIVE)).into_response()
}

struct SessionStream {
    state: Arc<AppState>,
    follower: Follower,
    session: SessionFacts,
    tx: mpsc::Sender<Event>,
}

impl SessionStream {
    async fn run(self) {
        let state = &self.state;
        let session_waiter = state.signals.mcp_session_waiter(&self.session.id_digest);
        let mut changes = Changes::default();
        let mut stopping = state.stopping.clone();
        let mut recheck = tokio::time::interval(RECHECK_EVERY);
        recheck.tick().await;
        let mut renew = tokio::time::interval(RENEW_EVERY);
        let mut renewing = true;
        loop {
            // Armed before the reads, so a change during them wakes the next round.
            let resubscribed = session_waiter.armed().woken();
            tokio::pin!(resubscribed);
            crate::failpoints::delay("mcp-session-stream-read").await;
            let followed = match state.mcp.subscriptions.followed(&self.session, std::mem::take(&mut renewing)).await {
                Ok(followed) => followed,
                Err(error) => {
                    warn!(%error, "mcp: a session's subscriptions could not be read; trying again");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    continue;
                }
            };
            let mut uris: HashMap<ProjectKey, Vec<String>> = HashMap::new();
            for f in followed {
                let key = ProjectKey { namespace: f.namespace.clone(), project_id: f.project_id.clone() };
                if let Some(id) = f.seen() {
                    changes.known(key.clone(), id);
                }
                uris.entry(key).or_default().push(f.uri);
            }
            let projects: Vec<ProjectKey> = uris.keys().cloned().collect();
            let waiters: Vec<_> = projects.iter().map(|p| state.signals.project_waiter(p)).collect();
            loop {
                let woken = any_woken(&waiters);
                for (project, id) in changes.look(state, &projects).await {
                    for uri in uris.get(&project).into_iter().flatten() {
                        let message = json!({"jsonrpc": "2.0", "method": "notifications/resources/updated",
                                             "params": {"uri": uri}});
                        if self.tx.send(Event::default().event("message").data(message.to_string())).await.is_err() {
                            return;
                        }
                    }
                    // A stream opened later starts from here; told again at worst.
                    if let Err(error) = state.mcp.subscriptions.told(&self.session, &project, id).await {
                        debug!(%error, "mcp: what a session was told could not be noted");
                    }
                }
                // Only a change looks again; a recheck that passes goes back to waiting.
                tokio::pin!(woken);
                let read_again = loop {
                    tokio::select! {
                        _ = &mut woken => break false,
                        _ = &mut resubscribed => break true,
                        _ = recheck.tick() => match self.recheck(&projects).await {
                            None => return,
                            // The revoked namespaces' subscriptions are gone: read the set again.
                            Some(true) => break true,
                            Some(false) => {}
                        },
                        _ = renew.tick() => {
                            renewing = true;
                            break true;
                        }
                        _ = self.tx.closed() => return,
                        _ = stopped(&mut stopping) => return,
                    }
                };
                if read_again {
                    break;
                }
            }
        }
    }

    /// The caller still authenticates (else the stream ends: None); subscriptions of
    /// namespaces it may no longer read are dropped (Some(true)).
    async fn recheck(&self, projects: &[ProjectKey]) -> Option<bool> {
        let state = &self.state;
        let caller = match state.auth.authenticate(&self.follower.headers, self.follower.peer).await {
            Ok(caller) => caller,
            Err(error) => {
                debug!(code = error.code, "mcp: a session stream's caller no longer authenticates; ending it");
                return None;
            }
        };
        let mut namespaces: Vec<&str> = projects.iter().map(|p| p.namespace.as_str()).collect();
        namespaces.sort_unstable();
        namespaces.dedup();
        let mut dropped = false;
        for namespace in namespaces {
            match state.auth.allowed(&caller, "list", RESOURCE, namespace, None).await {
                Ok(true) => {}
                Ok(false) => {
                    if let Err(error) = state.mcp.subscriptions.drop_namespace(&self.session, namespace).await {
                        warn!(%error, "mcp: a revoked namespace's subscriptions could not be dropped; ending the stream");
                        return None;
                    }
                    dropped = true;
                }
                Err(error) => {
                    debug!(code = error.code, "mcp: a session stream could not be authorized again; ending it");
                    return None;
                }
            }
        }
        Some(dropped)
    }
}

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
use std::sync::Arc;
use std::time::Duration;

use axum::response::Response;
use serde_json::json;
use tracing::{debug, warn};

use super::SessionFacts;
use super::resources::{Changes, Follower, MAX_FOLLOWED, ProjectUri, any_woken};
use crate::agents::RESOURCE;
use crate::auth::Caller;
use crate::db::QueryError;
use crate::mcp_store::{FollowQuota, McpStore, SessionRows};
use crate::signals::ProjectKey;
use crate::sse::{self, Frame};
use crate::streams::{Holder, Outbox};
use crate::watch::{KEEPALIVE, RECHECK_EVERY, stopped};
use crate::{ApiError, AppState};

/// Subscriptions one identity may hold over all its sessions.
pub const MAX_PER_OWNER: i64 = 256;
/// Rows not renewed for this long are deleted.
pub const RETENTION: Duration = Duration::from_secs(24 * 3600);
/// An open stream renews its session's rows this often.
const RENEW_EVERY: Duration = Duration::from_secs(600);

impl SessionFacts {
    /// The session's rows in `mcp_subscriptions`.
    fn rows(&self) -> SessionRows<'_> {
        SessionRows { session: &self.id_digest, owner: self.owner_digest() }
    }
}

/// Subscriptions nobody renewed for `RETENTION` are deleted.
pub async fn prune(store: &McpStore) -> Result<u64, QueryError> {
    store.prune(RETENTION).await
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
    let quota = FollowQuota { per_session: MAX_FOLLOWED as i64, per_owner: MAX_PER_OWNER };
    if !state.mcp.subscriptions.subscribe(session.rows(), uri, &project.0, seen, quota).await? {
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
    state.mcp.subscriptions.unsubscribe(&session.id_digest, uri).await?;
    state.signals.wake_mcp_session(&session.id_digest);
    Ok(())
}

fn no_session() -> ApiError {
    ApiError::invalid("resources/subscribe needs the Mcp-Session-Id of an initialized session")
}

/// `GET /mcp` of a session: its notifications, as Server-Sent Events of JSON-RPC
/// messages. A held stream of its caller (`streams`): 429 `too_many_streams` past its
/// share, ended after the stream lifetime, `reset` for a reader that falls behind.
pub fn stream(state: Arc<AppState>, follower: Follower, session: SessionFacts) -> Result<Response, ApiError> {
    let permit = state.streams.hold(Holder::Identity(follower.caller.username.clone()))?;
    let (outbox, events) = Outbox::new();
    let response = sse::response(events, KEEPALIVE);
    let response = crate::watch::held(response, permit, &state);
    tokio::spawn(SessionStream { state, follower, session, outbox }.run());
    Ok(response)
}

struct SessionStream {
    state: Arc<AppState>,
    follower: Follower,
    session: SessionFacts,
    outbox: Outbox,
}

impl SessionStream {
    /// Follows until the reader leaves, the caller loses its rights or the replica stops;
    /// then ends the stream, so its reader sees the end at once (a stopping replica
    /// otherwise held it open through its whole shutdown grace, and cut it mid-chunk).
    async fn run(self) {
        self.follow().await;
        self.outbox.end(None);
    }

    async fn follow(&self) {
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
            let followed =
                match state.mcp.subscriptions.followed(&self.session.id_digest, std::mem::take(&mut renewing)).await {
                    Ok(followed) => followed,
                    Err(error) => {
                        warn!(%error, "mcp: a session's subscriptions could not be read; trying again");
                        // A client that leaves while Postgres is down ends the stream now.
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_secs(2)) => continue,
                            _ = self.outbox.closed() => return,
                            _ = stopped(&mut stopping) => return,
                        }
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
                        let event = Frame::new("message", None, message.to_string().into());
                        if self.outbox.offer(event).await.is_err() {
                            return;
                        }
                    }
                    // A stream opened later starts from here; told again at worst.
                    if let Err(error) = state.mcp.subscriptions.told(&self.session.id_digest, &project, id).await {
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
                        _ = self.outbox.closed() => return,
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
                    if let Err(error) = state.mcp.subscriptions.drop_namespace(&self.session.id_digest, namespace).await
                    {
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

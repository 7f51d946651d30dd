//! `GET /api/v1/controller/{project_id}/watch`: a project's routing table as Server-Sent
//! Events (SPEC §11). First the table (`event: routing`, `id: <term>.<seq>`), then one
//! `routing` event per change of the project — made through any replica: the election's
//! write NOTIFYs, `signals` wakes this stream — and with `session_id`, that session's
//! nudges (`event: nudge`), each delivered once. A `Last-Event-ID` that is still the
//! project's current change resumes without the snapshot; any other starts afresh.
//! A comment every 15 s keeps proxies from closing an idle stream.
//!
//! Authorized as status (`list` on registrations), and again every `RECHECK_EVERY`: a
//! caller whose token or rights are revoked loses the stream (an `error` event says
//! why) rather than keeping it forever. A watch is a held stream of its caller
//! (`streams`): one of `PRISM_MAX_STREAMS_PER_IDENTITY`, at most
//! `PRISM_MAX_STREAM_SECONDS` long, and a reader that falls behind gets `reset`. Nudges are taken only by a caller that may
//! heartbeat the session (SPEC §4 rule 8), and only its own (`take_nudges`). A replica
//! that stops ends its streams first (clients reconnect to another).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use tracing::{debug, warn};

use super::AppState;
use super::agents::{RESOURCE, StatusQuery};
use super::auth::Caller;
use super::docs::{BadRequest, Forbidden, Internal, Invalid, TooManyRequests, Unauthenticated, Unavailable};
use super::error::{ApiError, ApiPath, ApiQuery, ClientAddr};
use crate::agent_sessions::ChangeId;
use crate::signals::ProjectKey;
use crate::sse::{self, Frame};
use crate::streams::{Holder, Outbox, bounded};

/// Comments on an idle stream (SPEC §11: every 15 s).
pub const KEEPALIVE: Duration = Duration::from_secs(15);
/// The caller's token and rights are checked again this often.
pub const RECHECK_EVERY: Duration = Duration::from_secs(15);
/// How long a watch holding a turn waits for its connection to take the event.
const TURN_WAIT: Duration = Duration::from_millis(5);
/// A table that could not be read is tried again after this.
const RETRY: Duration = Duration::from_secs(2);

/// One Server-Sent Event of a watch, as an SSE parser reads it (the document's schema of
/// the stream: each event conforms).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)] // Described, never built: the events are written as `sse::Frame`s.
pub struct WatchEvent {
    /// `routing` (data: the routing table, as status answers it), `nudge` (data: a
    /// nudge), `error` (data: `{"error": {"code", "message"}}`, then the stream ends),
    /// `reset` (the reader fell behind: the stream ends; watch again for a fresh table).
    #[schema(pattern = "^(routing|nudge|error|reset)$")]
    event: String,
    /// `<term>.<seq>`, on `routing` events.
    #[schema(pattern = "^[0-9]+[.][0-9]+$")]
    id: Option<String>,
    /// JSON text.
    data: String,
}

/// Watch a project's routing table (Server-Sent Events)
#[utoipa::path(
    get,
    path = "/api/v1/controller/{project_id}/watch",
    tag = "controller",
    params(
        ("project_id" = String, Path, min_length = 1, max_length = 128, pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$"),
        StatusQuery,
        ("Last-Event-ID" = Option<String>, Header, description = "The id of the last event seen: resumes when it is still current"),
    ),
    security(("kubernetes" = [])),
    responses(
        (status = 200, description = "`text/event-stream`: `routing` events (the routing table, id `<term>.<seq>`), `nudge` events, `error` when the stream ends for a reason, `reset` when the reader fell behind; it ends after PRISM_MAX_STREAM_SECONDS (watch again)", content_type = "text/event-stream", body = WatchEvent),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthenticated),
        (status = 403, response = Forbidden),
        (status = 422, response = Invalid),
        (status = 429, response = TooManyRequests),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    )
)]
pub async fn watch(
    State(state): State<Arc<AppState>>,
    ClientAddr(peer): ClientAddr,
    headers: HeaderMap,
    ApiPath(project_id): ApiPath<String>,
    ApiQuery(q): ApiQuery<StatusQuery>,
) -> Result<Response, ApiError> {
    let namespace = q.check(&project_id)?;
    let caller = state.auth.authenticate(&headers, peer).await?;
    state.auth.authorize(&caller, "list", RESOURCE, &namespace).await?;
    // Charged to the proven caller, after it may watch at all.
    let permit = state.streams.hold(Holder::Identity(caller.username.clone()))?;
    let resume: Option<ChangeId> =
        headers.get("last-event-id").and_then(|v| v.to_str().ok()).and_then(|s| s.trim().parse().ok());
    let project = ProjectKey { namespace, project_id };
    let waiter = state.signals.project_waiter(&project);
    let (outbox, events) = Outbox::new();
    let stream = Watch {
        state: state.clone(),
        headers: auth_headers(&headers),
        peer,
        caller,
        project,
        session_id: q.session_id().map(str::to_owned),
        outbox,
    };
    tokio::spawn(stream.run(waiter, resume));
    Ok(held(sse::response(events, KEEPALIVE), permit, &state))
}

/// A streamed response holding its caller's permit, ended at the stream lifetime.
pub fn held(response: Response, permit: crate::streams::Permit, state: &AppState) -> Response {
    let (parts, body) = response.into_parts();
    Response::from_parts(parts, bounded(body, permit, state.streams.lifetime()))
}

/// Resolves once the server stops (or its sender is gone).
pub async fn stopped(stopping: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

/// Only what authenticating a stream's caller again needs.
pub fn auth_headers(headers: &HeaderMap) -> HeaderMap {
    let mut kept = HeaderMap::new();
    if let Some(v) = headers.get(axum::http::header::AUTHORIZATION) {
        kept.insert(axum::http::header::AUTHORIZATION, v.clone());
    }
    kept
}

struct Watch {
    state: Arc<AppState>,
    headers: HeaderMap,
    peer: Option<IpAddr>,
    caller: Caller,
    project: ProjectKey,
    session_id: Option<String>,
    outbox: Outbox,
}

/// The `routing` event of `snapshot` as `session` sees it; an `error` event in the
/// impossible case that the table cannot be written as JSON. Without a session it is the
/// same for every watch of the project: written once per change and shared.
fn routing_event(snapshot: &crate::agent_sessions::RoutingSnapshot, session: Option<&str>) -> Frame {
    let write = |snapshot: &crate::agent_sessions::RoutingSnapshot| {
        Frame::json("routing", Some(&snapshot.id.to_string()), &snapshot.table(session)).unwrap_or_else(|error| {
            let error = ApiError::internal("watch: routing event", error);
            error_event(&error)
        })
    };
    match session {
        Some(_) => write(snapshot),
        None => Frame::from_shared(snapshot.rendered_once(|snapshot| write(snapshot).shared())),
    }
}

/// The `error` event a stream ends with.
fn error_event(error: &ApiError) -> Frame {
    let body = serde_json::json!({"error": {"code": error.code, "message": error.message}});
    Frame::new("error", None, body.to_string().into())
}

/// Why a stream ended.
enum End {
    /// The client went away, or the server stops.
    Quietly,
    /// Said to the client in an `error` event first.
    Because(ApiError),
}

impl Watch {
    async fn run(self, waiter: crate::signals::Waiter<ProjectKey>, resume: Option<ChangeId>) {
        let mut stopping = self.state.stopping.clone();
        let mut last = resume;
        let mut recheck = tokio::time::interval(RECHECK_EVERY);
        recheck.tick().await;
        let end = loop {
            // Armed before the read, so a change committed during it wakes the next one.
            let armed = waiter.armed();
            // One read for every watch of the project woken by this change (they ask
            // together); then they take turns putting it out (`streams::TURNS`), so that
            // the replica's other requests go between them.
            let current = self.state.agents.routing_snapshot(&self.project.namespace, &self.project.project_id).await;
            let turn = self.state.streams.turn().await;
            match current {
                Ok(current) if last != Some(current.id) => {
                    // Made when the reader takes it: until then the stream keeps the
                    // snapshot every watch of the project shares, not a table of its own.
                    let id = current.id;
                    let session = self.session().map(str::to_string);
                    let offered = self.outbox.try_offer_later(move || routing_event(&current, session.as_deref()));
                    if let Ok(None) = offered {
                        // The turn passes once the connection took the event to write it
                        // (or a moment passed): the writes of one change go out a few at
                        // a time, not 1,000 queued at once.
                        self.outbox.taken_within(TURN_WAIT).await;
                    }
                    // A reader not ready is waited for without the turn.
                    drop(turn);
                    let offered = match offered {
                        Ok(None) => Ok(()),
                        Ok(Some(pending)) => self.outbox.offer_pending(pending).await,
                        Err(refused) => Err(refused),
                    };
                    if offered.is_err() {
                        break End::Quietly;
                    }
                    last = Some(id);
                }
                Ok(_) => drop(turn),
                Err(error) => {
                    drop(turn);
                    warn!(namespace = %self.project.namespace, project_id = %self.project.project_id, %error,
                          "watch: the routing table could not be read; trying again");
                    // A client that leaves (or a replica that stops) while Postgres is
                    // down ends the stream now, not once Postgres is back.
                    tokio::select! {
                        _ = tokio::time::sleep(RETRY) => continue,
                        _ = self.outbox.closed() => break End::Quietly,
                        _ = stopped(&mut stopping) => break End::Quietly,
                    }
                }
            }
            if let Err(end) = self.deliver_nudges().await {
                break end;
            }
            // Only a change reads the table again: a recheck that passes goes back to
            // waiting (an idle stream costs its recheck, not a read every 15 s).
            let woken = armed.woken();
            tokio::pin!(woken);
            let ended = loop {
                tokio::select! {
                    _ = &mut woken => break None,
                    _ = recheck.tick() => {
                        if let Err(refused) = self.recheck().await {
                            break Some(End::Because(refused));
                        }
                    }
                    _ = self.outbox.closed() => break Some(End::Quietly),
                    _ = stopped(&mut stopping) => break Some(End::Quietly),
                }
            };
            if let Some(end) = ended {
                break end;
            }
        };
        if let End::Because(error) = end {
            debug!(namespace = %self.project.namespace, project_id = %self.project.project_id, code = error.code,
                   "watch ended");
            self.outbox.end(Some(error_event(&error)));
        } else {
            self.outbox.end(None);
        }
    }

    fn session(&self) -> Option<&str> {
        self.session_id.as_deref()
    }

    /// Still the caller, still allowed (a revoked token or role ends the stream).
    async fn recheck(&self) -> Result<(), ApiError> {
        let caller = self.state.auth.authenticate(&self.headers, self.peer).await?;
        self.state.auth.authorize(&caller, "list", RESOURCE, &self.project.namespace).await
    }

    /// The session's undelivered nudges, when the caller may heartbeat it.
    async fn deliver_nudges(&self) -> Result<(), End> {
        let Some(session_id) = self.session() else { return Ok(()) };
        let ns = &self.project.namespace;
        match self.state.auth.allowed(&self.caller, "create", RESOURCE, ns, None).await {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(error) => return Err(End::Because(error)),
        }
        let nudges = match self.state.agents.take_nudges(ns, session_id, &self.caller.username).await {
            Ok(nudges) => nudges,
            Err(error) => {
                warn!(namespace = %ns, %error, "watch: nudges could not be read; next change");
                return Ok(());
            }
        };
        for (n, nudge) in nudges.iter().enumerate() {
            let event = Frame::json("nudge", None, nudge)
                .map_err(|e| End::Because(ApiError::internal("watch: nudge event", e)))?;
            // Marked delivered when taken; one the stream could not hand out (its reader
            // left, or fell behind) is given back for the session's next answer.
            if self.outbox.offer_taken(event).await.is_err() {
                let left: Vec<uuid::Uuid> = nudges[n..].iter().map(|m| m.id).collect();
                if let Err(error) = self.state.agents.return_nudges(ns, session_id, &left).await {
                    warn!(namespace = %ns, %error, "watch: nudges not delivered could not be given back");
                }
                return Err(End::Quietly);
            }
        }
        Ok(())
    }
}

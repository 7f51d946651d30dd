//! A project's routing table as an MCP resource (SPEC §11):
//! `prism://{namespace}/projects/{project_id}`, listed per namespace, read as JSON (the
//! status shape), and followed where the protocol generation offers it: in 2026-07-28,
//! `subscriptions/listen` (here: one stream per listen, on whichever replica answers
//! it); in the session-based revisions, `resources/subscribe` and the session's GET
//! stream (`subscriptions`). A change is a change of the project's `term.seq` (the
//! watch's event id), heard through `signals` from any replica.
//!
//! Every read and every subscription is authorized as status (`list` on registrations
//! in the URI's namespace) before anything is looked up, and a listen is authorized
//! again every `RECHECK_EVERY`, as a watch is: a revoked caller loses it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use axum::http::HeaderMap;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};
use rmcp::ErrorData;
use rmcp::model::{
    ErrorCode, ListResourceTemplatesResult, ListResourcesResult, ReadResourceResult, Resource, ResourceContents,
    ResourceTemplate, ResourceUpdatedNotification, ResourceUpdatedNotificationParam, ServerNotification,
    SubscriptionFilter,
};
use rmcp::service::SubscriptionContext;
use serde_json::json;
use tracing::debug;

use crate::agent_sessions::ChangeId;
use crate::agents::{RESOURCE, check_identifier, check_namespace};
use crate::auth::Caller;
use crate::signals::ProjectKey;
use crate::watch::{RECHECK_EVERY, stopped};
use crate::{ApiError, AppState};

/// The URI template of SPEC §11.
pub const TEMPLATE: &str = "prism://{namespace}/projects/{project_id}";
const SCHEME: &str = "prism://";
const MIME: &str = "application/json";
/// Resources in one page of `resources/list`.
const PAGE: i64 = 100;
/// Resources one listen (or one session) may follow: what a caller can make one stream
/// wait on stays small.
pub const MAX_FOLLOWED: usize = 32;

/// What is kept of a project id in a URI: RFC 3986 unreserved characters; the rest is
/// percent-encoded (a project id may hold `/`, `?`, spaces, any printable character).
const ENCODED: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// A project named by a resource URI.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProjectUri(pub ProjectKey);

impl ProjectUri {
    pub fn new(namespace: &str, project_id: &str) -> Self {
        ProjectUri(ProjectKey { namespace: namespace.to_string(), project_id: project_id.to_string() })
    }

    /// `prism://<namespace>/projects/<project_id, percent-encoded>`; bad input is an
    /// `invalid_request` naming what is wrong.
    pub fn parse(uri: &str) -> Result<ProjectUri, ApiError> {
        let bad = |why: &str| ApiError::invalid(format!("resource uri {uri:?}: {why}; the form is {TEMPLATE}"));
        let rest = uri.strip_prefix(SCHEME).ok_or_else(|| bad("not a prism:// uri"))?;
        let (namespace, path) = rest.split_once('/').ok_or_else(|| bad("no path"))?;
        let encoded = path.strip_prefix("projects/").ok_or_else(|| bad("the path is not projects/<project_id>"))?;
        if encoded.contains(['/', '?', '#']) {
            return Err(bad("the project id must be one percent-encoded path segment"));
        }
        let project_id =
            percent_decode_str(encoded).decode_utf8().map_err(|_| bad("the project id is not UTF-8 once decoded"))?;
        check_namespace(namespace)?;
        check_identifier("project_id", &project_id, crate::crd::PROJECT_ID_MAX)?;
        Ok(ProjectUri::new(namespace, &project_id))
    }

    pub fn uri(&self) -> String {
        format!("{SCHEME}{}/projects/{}", self.0.namespace, utf8_percent_encode(&self.0.project_id, ENCODED))
    }

    fn resource(&self, term: i64) -> Resource {
        Resource::new(self.uri(), format!("{}/{}", self.0.namespace, self.0.project_id))
            .with_title(format!("Routing table of project {} in {}", self.0.project_id, self.0.namespace))
            .with_description(format!(
                "Master, peers and term (now {term}) of the project; read it again when notified"
            ))
            .with_mime_type(MIME)
    }
}

/// A refusal or bad input of a resources request, as the JSON-RPC error MCP gives it,
/// carrying the API's `{"error": {"code", "message"}}` as its data.
pub fn rpc_error(e: &ApiError) -> ErrorData {
    let code = match e.status.as_u16() {
        400 | 422 => ErrorCode::INVALID_PARAMS,
        500.. => ErrorCode::INTERNAL_ERROR,
        _ => ErrorCode::INVALID_REQUEST,
    };
    ErrorData::new(
        code,
        format!("{}: {}", e.code, e.message),
        Some(json!({"error": {"code": e.code, "message": e.message}})),
    )
}

pub fn templates() -> ListResourceTemplatesResult {
    let template = ResourceTemplate::new(TEMPLATE, "project-routing")
        .with_title("Routing table of a project")
        .with_description(
            "Who is master of the project, its peers and its election term (prism_status's answer). \
             namespace: the Kubernetes namespace; project_id: percent-encoded.",
        )
        .with_mime_type(MIME);
    ListResourceTemplatesResult::with_all_items(vec![template])
}

/// The projects of the caller's namespace (the `X-Prism-Namespace` header, else its
/// ServiceAccount's), a page at a time. No namespace known: nothing to list (the
/// template says how to name one).
pub async fn list(
    state: &AppState,
    caller: &Caller,
    namespace: Option<String>,
    cursor: Option<&str>,
) -> Result<ListResourcesResult, ApiError> {
    let Some(namespace) = namespace else { return Ok(ListResourcesResult::with_all_items(Vec::new())) };
    state.auth.authorize(caller, "list", RESOURCE, &namespace).await?;
    let after = match cursor {
        Some(c) => Some(
            B64.decode(c)
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .ok_or_else(|| ApiError::invalid("cursor: not one this server gave"))?,
        ),
        None => None,
    };
    let projects = state.agents.projects(&namespace, after.as_deref(), PAGE + 1).await?;
    let more = projects.len() as i64 > PAGE;
    let mut result = ListResourcesResult::with_all_items(
        projects.iter().take(PAGE as usize).map(|(p, term)| ProjectUri::new(&namespace, p).resource(*term)).collect(),
    );
    if more && let Some((last, _)) = projects.get(PAGE as usize - 1) {
        result.next_cursor = Some(B64.encode(last));
    }
    Ok(result)
}

/// SPEC §11: the routing table, as prism_status answers it, authorized first.
pub async fn read(state: &AppState, caller: &Caller, uri: &str) -> Result<ReadResourceResult, ApiError> {
    let project = ProjectUri::parse(uri)?;
    state.auth.authorize(caller, "list", RESOURCE, &project.0.namespace).await?;
    let table = state.agents.routing(&project.0.namespace, &project.0.project_id, None).await?;
    let text = serde_json::to_string(&table).map_err(|e| ApiError::internal("mcp: read the routing resource", e))?;
    Ok(ReadResourceResult::new(vec![ResourceContents::text(text, uri).with_mime_type(MIME)]))
}

/// The part of a `subscriptions/listen` filter this server honours: up to
/// `MAX_FOLLOWED` well-formed project URIs (no list-changed notifications: the tools
/// and the template never change).
pub fn accepted(requested: &SubscriptionFilter) -> SubscriptionFilter {
    let uris: Vec<String> = requested
        .resource_subscriptions
        .iter()
        .flatten()
        .filter(|uri| ProjectUri::parse(uri).is_ok())
        .take(MAX_FOLLOWED)
        .cloned()
        .collect();
    let mut honoured = SubscriptionFilter::new();
    honoured.resource_subscriptions = (!uris.is_empty()).then_some(uris);
    honoured
}

/// Who follows, as a stream re-checks it.
pub struct Follower {
    pub caller: Caller,
    pub headers: HeaderMap,
    pub peer: Option<IpAddr>,
}

impl Follower {
    /// Still the caller, and still allowed to read every followed namespace.
    pub async fn recheck(&self, state: &AppState, namespaces: &[String]) -> Result<(), ApiError> {
        let caller = state.auth.authenticate(&self.headers, self.peer).await?;
        for namespace in namespaces {
            state.auth.authorize(&caller, "list", RESOURCE, namespace).await?;
        }
        Ok(())
    }
}

/// Where followed projects stood when the caller was told it follows them: read before
/// a listen is acknowledged (the gate, `baseline`), or at a subscribe (kept with the
/// subscription). A stream compares its first look with it, so a change made between
/// the caller's "you follow it" and the stream's first read is notified, not taken for
/// the starting point.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Baseline(pub HashMap<ProjectKey, ChangeId>);

/// Reads the baseline of a listen before rmcp acknowledges it (it acknowledges before
/// the handler runs): the projects of the part of `requested` that is honoured, once
/// the caller may read every namespace named. None when it may not: the listen is
/// refused anyway, and nothing is looked up for it.
pub async fn baseline(state: &AppState, caller: &Caller, requested: &SubscriptionFilter) -> Option<Baseline> {
    let projects: Vec<ProjectKey> = accepted(requested)
        .resource_subscriptions
        .iter()
        .flatten()
        .filter_map(|uri| ProjectUri::parse(uri).ok())
        .map(|p| p.0)
        .collect();
    authorize_namespaces(state, caller, &projects).await.ok()?;
    let mut seen = HashMap::new();
    for project in projects {
        match state.agents.routing_change(&project.namespace, &project.project_id, None).await {
            Ok(now) => {
                seen.insert(project, now.id);
            }
            // Without a baseline the stream's first look is where the project starts.
            Err(error) => debug!(namespace = %project.namespace, project_id = %project.project_id, %error,
                                 "mcp: a listen's baseline could not be read"),
        }
    }
    Some(Baseline(seen))
}

/// The namespaces of `projects`, once each, after checking that the caller may read
/// every one (as status).
async fn authorize_namespaces(
    state: &AppState,
    caller: &Caller,
    projects: &[ProjectKey],
) -> Result<Vec<String>, ApiError> {
    let mut namespaces: Vec<String> = projects.iter().map(|p| p.namespace.clone()).collect();
    namespaces.sort();
    namespaces.dedup();
    for namespace in &namespaces {
        state.auth.authorize(caller, "list", RESOURCE, namespace).await?;
    }
    Ok(namespaces)
}

/// The changes of projects one stream follows: which of them changed since it last
/// looked (`term.seq`), from a project's baseline when it has one, else from the first
/// look.
#[derive(Default)]
pub struct Changes {
    seen: HashMap<ProjectKey, ChangeId>,
}

impl Changes {
    /// Where `project` stood when its follower was told it follows it, unless this
    /// stream has looked at it since.
    pub fn known(&mut self, project: ProjectKey, id: ChangeId) {
        self.seen.entry(project).or_insert(id);
    }

    /// Whether `now` is a change of `project` since it was last seen or known (not on
    /// the first sight of one without a baseline); `now` is then where it stands.
    fn changed(&mut self, project: &ProjectKey, now: ChangeId) -> bool {
        self.seen.insert(project.clone(), now).is_some_and(|before| before != now)
    }

    /// The projects whose change id is not the one seen last (see `changed`), forgetting
    /// those no longer followed. A project that could not be read counts as unchanged
    /// until it can.
    pub async fn look(&mut self, state: &AppState, projects: &[ProjectKey]) -> Vec<(ProjectKey, ChangeId)> {
        let mut changed = Vec::new();
        self.seen.retain(|p, _| projects.contains(p));
        for project in projects {
            match state.agents.routing_change(&project.namespace, &project.project_id, None).await {
                Ok(now) => {
                    if self.changed(project, now.id) {
                        changed.push((project.clone(), now.id));
                    }
                }
                Err(error) => debug!(namespace = %project.namespace, project_id = %project.project_id, %error,
                                      "mcp: a followed project could not be read; next wake"),
            }
        }
        changed
    }
}

/// Resolves when any of `projects` may have changed (or every waiter is woken).
pub async fn any_woken(waiters: &[crate::signals::Waiter<ProjectKey>]) {
    if waiters.is_empty() {
        return std::future::pending().await;
    }
    let armed: Vec<_> = waiters.iter().map(|w| Box::pin(w.armed().woken())).collect();
    futures::future::select_all(armed).await;
}

/// One `subscriptions/listen` (2026-07-28): `notifications/resources/updated` for each
/// change of a followed project, until the client cancels, the caller is refused, or
/// this replica stops (the final result: the client listens again, elsewhere).
pub async fn listen(
    state: Arc<AppState>,
    follower: Follower,
    baseline: Baseline,
    context: SubscriptionContext,
) -> Result<(), ErrorData> {
    let uris: Vec<String> = context.accepted().resource_subscriptions.clone().unwrap_or_default();
    let mut by_project: HashMap<ProjectKey, Vec<String>> = HashMap::new();
    for uri in &uris {
        let project = ProjectUri::parse(uri).map_err(|e| rpc_error(&e))?;
        by_project.entry(project.0).or_default().push(uri.clone());
    }
    let projects: Vec<ProjectKey> = by_project.keys().cloned().collect();
    let namespaces = authorize_namespaces(&state, &follower.caller, &projects).await.map_err(|e| rpc_error(&e))?;
    let waiters: Vec<_> = projects.iter().map(|p| state.signals.project_waiter(p)).collect();
    let mut changes = Changes::default();
    for (project, id) in baseline.0 {
        changes.known(project, id);
    }
    let mut stopping = state.stopping.clone();
    let mut recheck = tokio::time::interval(RECHECK_EVERY);
    recheck.tick().await;
    crate::failpoints::delay("mcp-listen-start").await;
    loop {
        // Armed before the look, so a change committed during it wakes the next one.
        let woken = any_woken(&waiters);
        for (project, _) in changes.look(&state, &projects).await {
            for uri in by_project.get(&project).into_iter().flatten() {
                let notification = ServerNotification::ResourceUpdatedNotification(ResourceUpdatedNotification::new(
                    ResourceUpdatedNotificationParam::new(uri.clone()),
                ));
                if context.sink().send(notification).await.is_err() {
                    return Ok(());
                }
            }
        }
        // Only a change looks again; a recheck that passes goes back to waiting.
        tokio::pin!(woken);
        loop {
            tokio::select! {
                _ = &mut woken => break,
                _ = recheck.tick() => follower.recheck(&state, &namespaces).await.map_err(|e| rpc_error(&e))?,
                _ = context.cancelled() => return Ok(()),
                _ = stopped(&mut stopping) => return Ok(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_since_the_baseline_is_one_and_the_first_sight_without_one_is_not() {
        let id = |term, seq| ChangeId { term, seq };
        let p = ProjectUri::new("agents", "shop").0;
        let q = ProjectUri::new("agents", "web").0;
        let mut changes = Changes::default();
        // Preempted between the acknowledgement and the first look: notified.
        changes.known(p.clone(), id(1, 3));
        assert!(changes.changed(&p, id(2, 4)));
        assert!(!changes.changed(&p, id(2, 4)), "seen now: no second notification");
        // A baseline never overrides what the stream has seen since.
        changes.known(p.clone(), id(1, 3));
        assert!(!changes.changed(&p, id(2, 4)));
        assert!(changes.changed(&p, id(2, 5)));
        // No baseline (it could not be read): the first look is where it starts.
        assert!(!changes.changed(&q, id(7, 1)));
        assert!(changes.changed(&q, id(7, 2)));
        // Unchanged since the baseline: nothing to tell.
        let mut fresh = Changes::default();
        fresh.known(q.clone(), id(7, 2));
        assert!(!fresh.changed(&q, id(7, 2)));
    }

    #[test]
    fn a_uri_names_one_project_and_round_trips() {
        let p = ProjectUri::new("agents", "web/app v2?#");
        let uri = p.uri();
        assert_eq!(uri, "prism://agents/projects/web%2Fapp%20v2%3F%23");
        assert_eq!(ProjectUri::parse(&uri).expect("parses"), p);
        assert_eq!(ProjectUri::parse("prism://agents/projects/shop").expect("plain").0.project_id, "shop");
        assert_eq!(ProjectUri::parse("prism://agents/projects/caf%C3%A9").expect("utf-8").0.project_id, "café");
    }

    #[test]
    fn a_bad_uri_is_an_invalid_request_saying_why() {
        for (uri, why) in [
            ("http://agents/projects/shop", "not a prism"),
            ("prism://agents", "no path"),
            ("prism://agents/jobs/1", "projects/"),
            ("prism://agents/projects/a/b", "one percent-encoded"),
            ("prism://agents/projects/a?x=1", "one percent-encoded"),
            ("prism://agents/projects/%FF", "UTF-8"),
            ("prism://Agents_/projects/shop", "namespace"),
            ("prism://agents/projects/", "project_id"),
            ("prism://agents/projects/%07", "project_id"),
        ] {
            let e = ProjectUri::parse(uri).expect_err(uri);
            assert_eq!(e.code, "invalid_request", "{uri}");
            assert!(e.message.contains(why), "{uri}: {}", e.message);
        }
        let long = format!("prism://agents/projects/{}", "x".repeat(129));
        assert!(ProjectUri::parse(&long).is_err());
    }

    #[test]
    fn a_listen_honours_only_project_uris_and_at_most_its_share() {
        let mut requested = SubscriptionFilter::new();
        requested.tools_list_changed = Some(true);
        requested.resource_subscriptions = Some(vec!["prism://a/projects/p".into(), "file:///etc/passwd".into()]);
        let honoured = accepted(&requested);
        assert_eq!(honoured.resource_subscriptions, Some(vec!["prism://a/projects/p".to_string()]));
        assert_eq!(honoured.tools_list_changed, None);
        requested.resource_subscriptions = Some((0..100).map(|i| format!("prism://a/projects/p{i}")).collect());
        assert_eq!(accepted(&requested).resource_subscriptions.map(|u| u.len()), Some(MAX_FOLLOWED));
        requested.resource_subscriptions = None;
        assert_eq!(accepted(&requested).resource_subscriptions, None);
    }

    #[test]
    fn refusals_keep_their_code_in_the_json_rpc_error() {
        let e = rpc_error(&ApiError::forbidden("no"));
        assert_eq!(e.code, ErrorCode::INVALID_REQUEST);
        assert_eq!(e.data.expect("data")["error"]["code"], "forbidden");
        assert_eq!(rpc_error(&ApiError::invalid("bad")).code, ErrorCode::INVALID_PARAMS);
        assert_eq!(rpc_error(&ApiError::internal("x", "y")).code, ErrorCode::INTERNAL_ERROR);
    }
}

//! Agent authentication and authorization through the Kubernetes API: the bearer token is
//! checked with a TokenReview (for the operator's own audiences, SPEC §12), the action
//! with a SubjectAccessReview on `controllerregistrations` in the namespace. Whoever may
//! `kubectl create` a registration may register over HTTP, nobody else. Decisions are
//! cached briefly so a chatty agent does not turn every call into two API round trips.
//! Tokens are never logged; the token cache is keyed by their SHA-256, the decision
//! cache by the whole identity the API server returned (username, uid, groups, extra):
//! two tokens of one user with different groups are two identities.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::http::HeaderMap;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::PostParams;
use kube::{Api, Client};
use moka::sync::Cache;
use sha2::{Digest, Sha256};

use super::ApiError;
use super::limits::Limits;
use crate::crd::GROUP;

const CACHE_TTL: Duration = Duration::from_secs(10);
/// Entries per cache. moka's admission policy (TinyLFU) keeps the tokens that are used
/// over a flood of one-off random ones, so a flood neither wipes nor crowds out the
/// agents' entries.
const CACHE_MAX: u64 = 10_000;
/// How long a token the API server accepted spares its holder the unauthenticated budget.
const KNOWN_TTL: Duration = Duration::from_secs(600);

/// The audience `kubectl create token … --audience` gives agents (SPEC §12).
pub const DEFAULT_AUDIENCE: &str = "prism-operator";

/// Who made the request, as the API server told us. Shared, not copied: every request
/// takes its caller from the token cache and puts it into its authorization question,
/// and a service account's identity is a dozen strings (its groups, its token's extra).
#[derive(Clone, Debug)]
pub struct Caller(Arc<Fingerprinted>);

/// The identity itself, and a hash of it taken once: the decision cache hashes its key
/// on every look-up.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    pub username: String,
    pub uid: Option<String>,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

struct Fingerprinted {
    identity: Identity,
    fingerprint: u64,
}

impl Caller {
    pub fn new(
        username: String,
        uid: Option<String>,
        groups: Vec<String>,
        extra: BTreeMap<String, Vec<String>>,
    ) -> Self {
        static KEYS: OnceLock<RandomState> = OnceLock::new();
        let identity = Identity { username, uid, groups, extra };
        let fingerprint = KEYS.get_or_init(RandomState::new).hash_one(&identity);
        Caller(Arc::new(Fingerprinted { identity, fingerprint }))
    }
}

impl std::ops::Deref for Caller {
    type Target = Identity;
    fn deref(&self) -> &Identity {
        &self.0.identity
    }
}

impl std::fmt::Debug for Fingerprinted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.identity.fmt(f)
    }
}

/// Equal identities are equal callers, whichever token brought them (two tokens of one
/// identity share its decisions).
impl PartialEq for Caller {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.0.fingerprint == other.0.fingerprint && self.0.identity == other.0.identity)
    }
}

impl Eq for Caller {}

impl std::hash::Hash for Caller {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.0.fingerprint);
    }
}

/// One authorization question, asked by one whole identity.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Question {
    caller: Caller,
    verb: &'static str,
    resource: &'static str,
    namespace: String,
    name: Option<String>,
}

pub struct Authorizer {
    client: Client,
    /// The audiences a token must be valid for (PRISM_TOKEN_AUDIENCES).
    audiences: Vec<String>,
    tokens: Cache<[u8; 32], Option<Caller>>,
    /// Tokens the API server accepted lately (longer than `tokens` keeps the answer):
    /// asking about them again is no unauthenticated work, so a flood of unknown tokens
    /// from an address never crowds out the agents there whose tokens are known.
    known: Cache<[u8; 32], ()>,
    decisions: Cache<Question, bool>,
    limits: std::sync::Arc<Limits>,
}

fn short_lived<K: std::hash::Hash + Eq + Send + Sync + 'static, V: Clone + Send + Sync + 'static>() -> Cache<K, V> {
    Cache::builder().max_capacity(CACHE_MAX).time_to_live(CACHE_TTL).build()
}

/// Sends a review (a TokenReview, a SubjectAccessReview) and returns it answered; the API
/// server not answering is a 503 `kubernetes_unavailable`.
async fn ask<K>(client: &Client, review: &K, what: &str) -> Result<K, ApiError>
where
    K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::Serialize
        + serde::de::DeserializeOwned,
{
    Api::<K>::all(client.clone()).create(&PostParams::default(), review).await.map_err(|e| {
        // The cause to the log only (see error.rs: the cluster's insides stay inside).
        tracing::warn!(error = %e, "{what} failed");
        ApiError::unavailable(
            "kubernetes_unavailable",
            format!("{what} failed: the Kubernetes API did not answer; retry"),
        )
    })
}

/// The bearer token of a request, if it has one.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(axum::http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Is the TokenReview's answer an identity for one of `wanted`? The API server answers
/// with the audiences (of those asked for) the token is valid for; a client must check
/// that the intersection is not empty rather than trust `authenticated` alone.
fn accepted(status: &k8s_openapi::api::authentication::v1::TokenReviewStatus, wanted: &[String]) -> Option<Caller> {
    if status.authenticated != Some(true) {
        return None;
    }
    let audiences = status.audiences.as_deref().unwrap_or_default();
    if !audiences.iter().any(|a| wanted.contains(a)) {
        return None;
    }
    let user = status.user.as_ref()?;
    let username = user.username.clone().filter(|u| !u.is_empty())?;
    Some(Caller::new(
        username,
        user.uid.clone(),
        user.groups.clone().unwrap_or_default(),
        user.extra.clone().unwrap_or_default(),
    ))
}

impl Authorizer {
    pub fn new(client: Client, audiences: Vec<String>, limits: std::sync::Arc<Limits>) -> Self {
        let known = Cache::builder().max_capacity(CACHE_MAX).time_to_live(KNOWN_TTL).build();
        Self { client, audiences, tokens: short_lived(), known, decisions: short_lived(), limits }
    }

    /// TokenReview: who is this? 401 `unauthenticated` without a token, 401
    /// `invalid_token` for one the API server does not accept for our audiences. A token
    /// not seen in the last seconds costs a TokenReview, which the caller's address pays
    /// for from its budget of unauthenticated requests (429 `rate_limited` when spent).
    pub async fn authenticate(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Result<Caller, ApiError> {
        let token = bearer(headers)
            .ok_or_else(|| ApiError::unauthenticated("unauthenticated", "a Kubernetes bearer token is required"))?;
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let caller = match self.tokens.get(&key) {
            Some(c) => c,
            None => {
                if !self.known.contains_key(&key) {
                    self.limits.unauthenticated(peer)?;
                }
                let review = TokenReview {
                    spec: TokenReviewSpec { token: token.to_string(), audiences: Some(self.audiences.clone()) },
                    ..Default::default()
                };
                let done = ask(&self.client, &review, "TokenReview").await?;
                let caller = done.status.as_ref().and_then(|s| accepted(s, &self.audiences));
                match &caller {
                    Some(_) => self.known.insert(key, ()),
                    None => self.known.invalidate(&key),
                }
                self.tokens.insert(key, caller.clone());
                caller
            }
        };
        if let Some(c) = &caller {
            super::record_caller(&c.username);
            // Charged once the API server has vouched for the identity: nobody spends
            // another identity's budget (SPEC §12).
            self.limits.identity(&c.username)?;
        }
        caller.ok_or_else(|| {
            ApiError::unauthenticated(
                "invalid_token",
                "the bearer token was not accepted (tokens need the audience the operator asks for: kubectl create token ... --audience prism-operator)",
            )
        })
    }

    /// SubjectAccessReview: may `caller` do `verb` on `resource` in `namespace`?
    /// 403 `forbidden` if not.
    pub async fn authorize(
        &self,
        caller: &Caller,
        verb: &'static str,
        resource: &'static str,
        namespace: &str,
    ) -> Result<(), ApiError> {
        self.authorize_named(caller, verb, resource, namespace, None).await
    }

    /// The same, for one named object.
    pub async fn authorize_named(
        &self,
        caller: &Caller,
        verb: &'static str,
        resource: &'static str,
        namespace: &str,
        name: Option<&str>,
    ) -> Result<(), ApiError> {
        if self.allowed(caller, verb, resource, namespace, name).await? {
            Ok(())
        } else {
            // Names the caller, the verb and the namespace the caller asked about: nothing
            // the caller did not say itself.
            Err(ApiError::forbidden(format!(
                "{} may not {verb} {resource}.{GROUP} in namespace {namespace}",
                caller.username
            )))
        }
    }

    /// The answer alone (errors only when the API server cannot be asked).
    pub async fn allowed(
        &self,
        caller: &Caller,
        verb: &'static str,
        resource: &'static str,
        namespace: &str,
        name: Option<&str>,
    ) -> Result<bool, ApiError> {
        let key = Question {
            caller: caller.clone(),
            verb,
            resource,
            namespace: namespace.to_string(),
            name: name.map(str::to_string),
        };
        if let Some(allowed) = self.decisions.get(&key) {
            return Ok(allowed);
        }
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(caller.username.clone()),
                uid: caller.uid.clone(),
                groups: Some(caller.groups.clone()),
                extra: Some(caller.extra.clone()),
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(namespace.to_string()),
                    verb: Some(verb.to_string()),
                    group: Some(GROUP.to_string()),
                    resource: Some(resource.to_string()),
                    name: name.map(str::to_string),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let done = ask(&self.client, &review, "SubjectAccessReview").await?;
        let allowed = done.status.map(|s| s.allowed).unwrap_or(false);
        self.decisions.insert(key, allowed);
        Ok(allowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::{TokenReviewStatus, UserInfo};

    fn status(authenticated: bool, audiences: &[&str], username: &str) -> TokenReviewStatus {
        TokenReviewStatus {
            authenticated: Some(authenticated),
            audiences: Some(audiences.iter().map(|a| a.to_string()).collect()),
            user: Some(UserInfo { username: Some(username.into()), ..Default::default() }),
            ..Default::default()
        }
    }

    #[test]
    fn a_token_is_accepted_only_for_an_audience_asked_for() {
        let wanted = vec![DEFAULT_AUDIENCE.to_string()];
        assert_eq!(
            accepted(&status(true, &["prism-operator"], "alice"), &wanted).map(|c| c.username.clone()),
            Some("alice".into())
        );
        assert_eq!(accepted(&status(true, &["https://kubernetes.default.svc"], "alice"), &wanted), None);
        assert_eq!(accepted(&status(true, &[], "alice"), &wanted), None, "no audience said: not ours");
        assert_eq!(accepted(&status(false, &["prism-operator"], "alice"), &wanted), None);
        assert_eq!(accepted(&status(true, &["prism-operator"], ""), &wanted), None, "no username, no identity");
    }

    #[test]
    fn two_tokens_of_one_user_with_other_groups_are_two_questions() {
        let caller = |groups: &[&str], extra: &[(&str, &str)]| {
            let extra = extra.iter().map(|(k, v)| (k.to_string(), vec![v.to_string()])).collect();
            Caller::new("alice".into(), Some("u1".into()), groups.iter().map(|g| g.to_string()).collect(), extra)
        };
        let alice = |groups: &[&str]| caller(groups, &[]);
        let q = |caller: Caller| Question {
            caller,
            verb: "create",
            resource: "controllerregistrations",
            namespace: "ns".into(),
            name: None,
        };
        let cache: Cache<Question, bool> = Cache::builder().max_capacity(10).build();
        cache.insert(q(alice(&["admins"])), true);
        assert_eq!(cache.get(&q(alice(&["admins"]))), Some(true), "the same identity, built again, is the same caller");
        assert_eq!(cache.get(&q(alice(&["viewers"]))), None, "another group set asks again");
        let extra = caller(&["admins"], &[("scopes", "read")]);
        assert_eq!(cache.get(&q(extra)), None, "another extra asks again");
    }
}

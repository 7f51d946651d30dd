//! Agent authentication and authorization through the Kubernetes API: the bearer token is
//! checked with a TokenReview, the action with a SubjectAccessReview on
//! `controllerregistrations` in the namespace. Whoever may `kubectl create` a
//! registration may register over HTTP, nobody else. Decisions are cached briefly so a
//! chatty agent does not turn every call into two API round trips. Tokens are never
//! logged; the cache is keyed by their SHA-256.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::PostParams;
use kube::{Api, Client};
use sha2::{Digest, Sha256};

use super::ApiError;
use crate::crd::GROUP;

const CACHE_TTL: Duration = Duration::from_secs(10);
const CACHE_MAX: usize = 10_000;

/// Who made the request, as the API server told us.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub username: String,
    pub uid: Option<String>,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

/// A value with the time it was learned.
type Cache<K, V> = Mutex<HashMap<K, (Instant, V)>>;
/// (username, verb, resource, namespace, name)
type Question = (String, String, String, String, String);

pub struct Authorizer {
    client: Client,
    tokens: Cache<[u8; 32], Option<Caller>>,
    decisions: Cache<Question, bool>,
}

fn cached<K: std::hash::Hash + Eq + Clone, V: Clone>(map: &Mutex<HashMap<K, (Instant, V)>>, key: &K) -> Option<V> {
    let map = map.lock().ok()?;
    map.get(key).filter(|(at, _)| at.elapsed() < CACHE_TTL).map(|(_, v)| v.clone())
}

fn remember<K: std::hash::Hash + Eq, V>(map: &Mutex<HashMap<K, (Instant, V)>>, key: K, value: V) {
    if let Ok(mut map) = map.lock() {
        if map.len() >= CACHE_MAX {
            map.retain(|_, (at, _)| at.elapsed() < CACHE_TTL);
            if map.len() >= CACHE_MAX {
                map.clear();
            }
        }
        map.insert(key, (Instant::now(), value));
    }
}

/// The bearer token of a request, if it has one.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(axum::http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

impl Authorizer {
    pub fn new(client: Client) -> Self {
        Self { client, tokens: Mutex::default(), decisions: Mutex::default() }
    }

    /// TokenReview: who is this? 401 `unauthenticated` without a token, 401
    /// `invalid_token` for one the API server does not accept.
    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        let token = bearer(headers)
            .ok_or_else(|| ApiError::unauthenticated("unauthenticated", "a Kubernetes bearer token is required"))?;
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let caller = match cached(&self.tokens, &key) {
            Some(c) => c,
            None => {
                let review = TokenReview {
                    spec: TokenReviewSpec { token: token.to_string(), audiences: None },
                    ..Default::default()
                };
                let done = Api::<TokenReview>::all(self.client.clone())
                    .create(&PostParams::default(), &review)
                    .await
                    .map_err(|e| {
                    ApiError::unavailable("kubernetes_unavailable", format!("TokenReview failed: {e}"))
                })?;
                let status = done.status.unwrap_or_default();
                let caller = match (status.authenticated, status.user) {
                    (Some(true), Some(user)) => Some(Caller {
                        username: user.username.unwrap_or_default(),
                        uid: user.uid,
                        groups: user.groups.unwrap_or_default(),
                        extra: user.extra.unwrap_or_default(),
                    }),
                    _ => None,
                };
                remember(&self.tokens, key, caller.clone());
                caller
            }
        };
        caller.ok_or_else(|| ApiError::unauthenticated("invalid_token", "the bearer token was not accepted"))
    }

    /// SubjectAccessReview: may `caller` do `verb` on `resource` in `namespace`?
    /// 403 `forbidden` if not.
    pub async fn authorize(
        &self,
        caller: &Caller,
        verb: &str,
        resource: &str,
        namespace: &str,
    ) -> Result<(), ApiError> {
        self.authorize_named(caller, verb, resource, namespace, None).await
    }

    /// The same, for one named object.
    pub async fn authorize_named(
        &self,
        caller: &Caller,
        verb: &str,
        resource: &str,
        namespace: &str,
        name: Option<&str>,
    ) -> Result<(), ApiError> {
        let key = (
            caller.username.clone(),
            verb.to_string(),
            resource.to_string(),
            namespace.to_string(),
            name.unwrap_or_default().to_string(),
        );
        let allowed = match cached(&self.decisions, &key) {
            Some(a) => a,
            None => {
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
                let done = Api::<SubjectAccessReview>::all(self.client.clone())
                    .create(&PostParams::default(), &review)
                    .await
                    .map_err(|e| {
                        ApiError::unavailable("kubernetes_unavailable", format!("SubjectAccessReview failed: {e}"))
                    })?;
                let allowed = done.status.map(|s| s.allowed).unwrap_or(false);
                remember(&self.decisions, key, allowed);
                allowed
            }
        };
        if allowed {
            Ok(())
        } else {
            Err(ApiError::forbidden(format!(
                "{} may not {verb} {resource}.{GROUP}{} in namespace {namespace}",
                caller.username,
                name.map(|n| format!(" {n}")).unwrap_or_default()
            )))
        }
    }
}

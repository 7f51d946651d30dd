//! What Runs do over HTTP, as a service: hello (prove possession, get a session lease),
//! heartbeat, claim jobs and report on them; plus the safe status projection.

use std::collections::BTreeMap;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::RegistryError;
use super::identity::{Identity, IdentityStore};
use super::jobs::{Job, JobStore, Step, StepRefused};
use super::proof;
use super::sessions::{HelloOutcome, NewSession, Renewal, RunAddress, Session, SessionStore, TokenCheck};
use crate::crd::RunTarget;

const TOKEN_PREFIX: &str = "prs1";
const NO_CAPACITY: &BTreeMap<String, i64> = &BTreeMap::new();

/// The hello request (SPEC §8).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    pub server_instance_id: String,
    pub component_kind: String,
    pub key_generation: i64,
    pub timestamp: i64,
    pub nonce: String,
    pub signature: String,
    #[serde(default)]
    pub version: Option<String>,
    #[serde(default)]
    pub target: Option<RunTarget>,
    #[serde(default)]
    pub capabilities: Option<Vec<String>>,
    #[serde(default)]
    pub capacity: Option<BTreeMap<String, i64>>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Granted {
    pub session_token: String,
    pub lease_ttl_seconds: u32,
    pub heartbeat_interval_seconds: u32,
}

/// Every failure of proof; the caller learns the code and nothing more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProofRefused {
    UnknownIdentity,
    StaleGeneration,
    BadSignature,
    ClockSkew,
    ReplayedNonce,
}

impl ProofRefused {
    pub fn code(self) -> &'static str {
        match self {
            ProofRefused::UnknownIdentity => "unknown_identity",
            ProofRefused::StaleGeneration => "stale_generation",
            ProofRefused::BadSignature => "bad_signature",
            ProofRefused::ClockSkew => "clock_skew",
            ProofRefused::ReplayedNonce => "replayed_nonce",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionRefused {
    /// Not a token this operator issued.
    InvalidToken,
    Superseded,
    Expired,
}

impl SessionRefused {
    pub fn code(self) -> &'static str {
        match self {
            SessionRefused::InvalidToken => "invalid_token",
            SessionRefused::Superseded => "session_superseded",
            SessionRefused::Expired => "session_expired",
        }
    }
}

/// Input shape errors: a 4xx before any proof is checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid(pub String);

fn name_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_lowercase()
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_')
}

/// Validates a capability/capacity snapshot: bounded, known-shape names, non-negative amounts.
pub fn check_snapshot(
    capabilities: Option<&Vec<String>>,
    capacity: Option<&BTreeMap<String, i64>>,
) -> Result<(), Invalid> {
    if let Some(caps) = capabilities {
        if caps.len() > 32 {
            return Err(Invalid("capabilities: at most 32 entries".into()));
        }
        if let Some(bad) = caps.iter().find(|c| !name_ok(c)) {
            return Err(Invalid(format!("capabilities: {bad:?} is not a name of [a-z0-9_] (max 63)")));
        }
    }
    if let Some(cap) = capacity {
        if cap.len() > 32 {
            return Err(Invalid("capacity: at most 32 entries".into()));
        }
        if let Some((k, _)) = cap.iter().find(|(k, _)| !name_ok(k)) {
            return Err(Invalid(format!("capacity: {k:?} is not a name of [a-z0-9_] (max 63)")));
        }
        if let Some((k, v)) = cap.iter().find(|(_, v)| **v < 0) {
            return Err(Invalid(format!("capacity: {k} must be a non-negative integer, got {v}")));
        }
    }
    Ok(())
}

/// The shapes an identity may have (the RunSession schema's). They carry no braces, so
/// the Redis hash tag `{server/component}` of the address's keys is always the whole
/// address and every key of one identity is on one cluster slot.
fn server_instance_id_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.bytes().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
}

fn component_kind_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= 63 && s.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
}

fn check_hello(h: &Hello) -> Result<(), Invalid> {
    if !server_instance_id_ok(&h.server_instance_id) {
        return Err(Invalid("server_instance_id: 1-253 characters of [A-Za-z0-9._-]".into()));
    }
    if !component_kind_ok(&h.component_kind) {
        return Err(Invalid("component_kind: a lowercase DNS label".into()));
    }
    if h.key_generation < 1 {
        return Err(Invalid("key_generation: an integer >= 1".into()));
    }
    if !proof::nonce_ok(&h.nonce) {
        return Err(Invalid("nonce: 16-128 characters of [A-Za-z0-9_-]".into()));
    }
    if let Some(v) = &h.version
        && (v.len() > 64 || !v.bytes().all(|c| c.is_ascii_alphanumeric() || b".+_-".contains(&c)))
    {
        return Err(Invalid("version: at most 64 characters of [A-Za-z0-9.+_-]".into()));
    }
    if let Some(t) = &h.target {
        let ok = |s: &str| !s.is_empty() && s.len() <= 32 && s.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_');
        if !ok(&t.os) || !ok(&t.arch) {
            return Err(Invalid("target: os and arch are 1-32 characters of [A-Za-z0-9_]".into()));
        }
    }
    check_snapshot(h.capabilities.as_ref(), h.capacity.as_ref())
}

/// A session token: a routing part naming the identity (not secret) and 256 random bits.
fn mint_token(a: &RunAddress) -> Result<String, RegistryError> {
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).map_err(|e| RegistryError::Entropy(e.to_string()))?;
    let route = URL_SAFE_NO_PAD.encode(format!("{}\n{}", a.server_instance_id, a.component_kind));
    Ok(format!("{TOKEN_PREFIX}.{route}.{}", URL_SAFE_NO_PAD.encode(secret)))
}

/// The address a token is for, if it is shaped like one of ours.
pub fn token_address(token: &str) -> Option<RunAddress> {
    let mut parts = token.split('.');
    let (Some(TOKEN_PREFIX), Some(route), Some(secret), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    if secret.len() != 43 {
        return None;
    }
    let route = String::from_utf8(URL_SAFE_NO_PAD.decode(route).ok()?).ok()?;
    let (server, component) = route.split_once('\n')?;
    // The route is the caller's text until checked: a forged one (say `}x`) would name
    // keys of two cluster slots and turn a 401 into a CROSSSLOT error (a 503).
    if !server_instance_id_ok(server) || !component_kind_ok(component) {
        return None;
    }
    Some(RunAddress { server_instance_id: server.to_string(), component_kind: component.to_string() })
}

/// Only this hash is stored.
pub fn token_hash(token: &str) -> String {
    Sha256::digest(token.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// What Runs do, as one service over the three stores: hello, heartbeat, claim, steps.
#[derive(Clone)]
pub struct RunRegistry {
    pub sessions: SessionStore,
    pub identities: IdentityStore,
    pub jobs: JobStore,
    pub default_lease_seconds: u32,
}

impl RunRegistry {
    pub fn lease_seconds(&self, identity: &Identity) -> u32 {
        identity.lease_seconds.map(|s| s.max(1) as u32).unwrap_or(self.default_lease_seconds)
    }

    /// Checks the proof and opens (or rotates) the session. The outer error is
    /// infrastructure (503); the inner one the refusal to report.
    pub async fn hello(
        &self,
        h: &Hello,
        now: DateTime<Utc>,
    ) -> Result<Result<(Identity, Granted), HelloError>, RegistryError> {
        if let Err(e) = check_hello(h) {
            return Ok(Err(HelloError::Invalid(e)));
        }
        let address =
            RunAddress { server_instance_id: h.server_instance_id.clone(), component_kind: h.component_kind.clone() };
        let Some(identity) = self.identities.live(&address).await? else {
            return Ok(Err(HelloError::Refused(ProofRefused::UnknownIdentity)));
        };
        if h.key_generation != identity.key_generation {
            return Ok(Err(HelloError::Refused(ProofRefused::StaleGeneration)));
        }
        if !proof::within_clock_window(h.timestamp, now.timestamp()) {
            return Ok(Err(HelloError::Refused(ProofRefused::ClockSkew)));
        }
        let message =
            proof::hello_message(&h.server_instance_id, &h.component_kind, h.key_generation, h.timestamp, &h.nonce);
        if proof::verify(&identity.public_key, &message, &h.signature).is_err() {
            return Ok(Err(HelloError::Refused(ProofRefused::BadSignature)));
        }
        let lease = self.lease_seconds(&identity);
        let token = mint_token(&address)?;
        let hash = token_hash(&token);
        let session = NewSession {
            token_hash: &hash,
            session_id: Uuid::new_v4(),
            generation: identity.key_generation,
            now,
            lease: std::time::Duration::from_secs(u64::from(lease)),
            version: h.version.as_deref(),
            target: h.target.as_ref(),
            capabilities: h.capabilities.as_deref().unwrap_or_default(),
            capacity: h.capacity.as_ref().unwrap_or(NO_CAPACITY),
        };
        // Nonces are remembered past both ends of the clock window.
        let nonce_ttl = std::time::Duration::from_secs((2 * proof::CLOCK_WINDOW_SECS + 60) as u64);
        if self.sessions.hello(&address, &h.nonce, &session, nonce_ttl).await? == HelloOutcome::ReplayedNonce {
            return Ok(Err(HelloError::Refused(ProofRefused::ReplayedNonce)));
        }
        let granted =
            Granted { session_token: token, lease_ttl_seconds: lease, heartbeat_interval_seconds: (lease / 3).max(1) };
        Ok(Ok((identity, granted)))
    }

    /// Checks a session token (renewing the lease when `renew` is given).
    pub async fn session(
        &self,
        token: &str,
        renew: Option<Renewal<'_>>,
    ) -> Result<Result<(RunAddress, Session), SessionRefused>, RegistryError> {
        let Some(address) = token_address(token) else {
            return Ok(Err(SessionRefused::InvalidToken));
        };
        Ok(match self.sessions.check(&address, &token_hash(token), renew).await? {
            TokenCheck::Valid(s) => Ok((address, s)),
            TokenCheck::Superseded => Err(SessionRefused::Superseded),
            TokenCheck::Expired => Err(SessionRefused::Expired),
        })
    }

    pub async fn claim(&self, address: &RunAddress, session: &Session, max: i64) -> Result<Vec<Job>, RegistryError> {
        self.jobs.claim(address, session.session_id, max).await
    }

    pub async fn step(
        &self,
        address: &RunAddress,
        id: Uuid,
        step: Step,
        body: Option<&Value>,
    ) -> Result<Result<Job, StepRefused>, RegistryError> {
        self.jobs.step(address, id, step, body).await
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum HelloError {
    Invalid(Invalid),
    Refused(ProofRefused),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_route_to_their_identity_and_carry_256_random_bits() {
        let t = RunAddress { server_instance_id: "srv-eu1.7".into(), component_kind: "run".into() };
        let a = mint_token(&t).expect("token");
        let b = mint_token(&t).expect("token");
        assert_ne!(a, b);
        assert_eq!(token_address(&a), Some(t));
        assert_eq!(token_hash(&a).len(), 64);
        assert_eq!(token_address("prs1.bad"), None);
        assert_eq!(token_address("Bearer something"), None);
        let forged = format!("{}x", a);
        assert_eq!(token_address(&forged), None);
        // A route that is not an identity's shape names no keys at all.
        for route in ["}x\nrun", "srv\n{run}", "\nrun", "srv\nRun"] {
            let forged = format!("{TOKEN_PREFIX}.{}.{}", URL_SAFE_NO_PAD.encode(route), "a".repeat(43));
            assert_eq!(token_address(&forged), None, "{route:?}");
        }
    }

    #[test]
    fn snapshots_are_bounded_and_non_negative() {
        let caps = vec!["lifecycle".to_string(), "protected_request".to_string()];
        let cap: BTreeMap<String, i64> = [("slots".to_string(), 4)].into();
        assert_eq!(check_snapshot(Some(&caps), Some(&cap)), Ok(()));
        assert!(check_snapshot(Some(&vec!["Has Space".to_string()]), None).is_err());
        assert!(check_snapshot(Some(&vec!["x".to_string(); 33]), None).is_err());
        let negative: BTreeMap<String, i64> = [("slots".to_string(), -1)].into();
        assert!(check_snapshot(None, Some(&negative)).is_err());
    }
}

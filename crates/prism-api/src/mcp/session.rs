//! MCP session ids that any replica can verify (SPEC §9). The session-based protocol
//! revisions (2025-03-26 … 2025-11-25) learn the client's facts once, at `initialize`,
//! and later requests carry only `Mcp-Session-Id`. Those facts (negotiated version,
//! `clientInfo.name`, the identity that initialized) travel inside the id itself, signed
//! with HMAC-SHA256 under a key every replica shares, so no replica keeps anything in
//! memory that a client's next request needs.
//!
//! Format: `ms1.<base64url(JSON facts)>.<base64url(HMAC)>`.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::db::QueryError;
use crate::mcp_store::McpStore;

const PREFIX: &str = "ms1";
/// Smallest key accepted from PRISM_MCP_SESSION_KEY, in bytes.
pub const MIN_KEY_BYTES: usize = 32;
/// Longest session id looked at (a signed id is well below this).
const MAX_ID_BYTES: usize = 2048;
/// Longest client name kept (clientInfo.name is the client's to choose).
const MAX_CLIENT_NAME: usize = 128;
/// A session id older than this is an unknown session (404): the client initializes
/// again. A leaked id is worth a day at most, and only to its own identity.
pub const MAX_SESSION_AGE_SECONDS: i64 = 24 * 3600;

/// What a session-based client told the server at `initialize`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionFacts {
    /// The negotiated protocol version.
    #[serde(rename = "v")]
    pub protocol_version: String,
    /// `clientInfo.name` (maps `agent_surface`).
    #[serde(rename = "c")]
    pub client_name: String,
    /// Who initialized: a digest of the TokenReview username, so that a session id is
    /// worth nothing to another identity.
    #[serde(rename = "u")]
    user: String,
    /// When (Unix seconds): the session ends `MAX_SESSION_AGE_SECONDS` later.
    #[serde(rename = "t")]
    issued_at: i64,
    /// A digest of the initializing identity's uid, when it has one: a ServiceAccount
    /// deleted and made again under the same name is another identity. Absent in ids
    /// signed before 0.2.0 (those are bound to the username alone until they age out).
    #[serde(rename = "i", default, skip_serializing_if = "Option::is_none")]
    uid: Option<String>,
    /// A digest of the signed id itself (set by `verify`): names the session where its
    /// subscriptions are kept.
    #[serde(skip)]
    pub id_digest: String,
}

fn user_digest(username: &str) -> String {
    B64.encode(&Sha256::digest(username.as_bytes())[..16])
}

impl SessionFacts {
    pub fn new(protocol_version: &str, client_name: &str, username: &str, uid: Option<&str>) -> Self {
        let client_name: String = client_name.chars().take(MAX_CLIENT_NAME).collect();
        SessionFacts {
            protocol_version: protocol_version.to_string(),
            client_name,
            user: user_digest(username),
            issued_at: chrono::Utc::now().timestamp(),
            uid: uid.map(user_digest),
            id_digest: String::new(),
        }
    }

    /// A digest of the initializing identity (who may use the session).
    pub fn owner_digest(&self) -> &str {
        &self.user
    }

    /// Was this session initialized by this identity (its username, and its uid when the
    /// id names one), no longer ago than `MAX_SESSION_AGE_SECONDS`?
    pub fn belongs_to(&self, username: &str, uid: Option<&str>, now: i64) -> bool {
        let uid_ok = match &self.uid {
            None => true,
            Some(digest) => uid.map(user_digest).as_ref() == Some(digest),
        };
        self.user == user_digest(username) && uid_ok && now - self.issued_at <= MAX_SESSION_AGE_SECONDS
    }
}

/// The HMAC key session ids are signed with (kept keyed, ready to clone per use).
#[derive(Clone)]
pub struct SessionKey(Hmac<Sha256>);

#[derive(Debug, thiserror::Error)]
pub enum SessionKeyError {
    #[error("mcp: no randomness for a new session key: {0}")]
    Entropy(String),
    #[error("mcp: the shared session key is unusable ({0} bytes)")]
    Unusable(usize),
    #[error(transparent)]
    Database(#[from] QueryError),
}

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

impl SessionKey {
    fn from_bytes(key: &[u8]) -> Option<Self> {
        if key.len() < MIN_KEY_BYTES {
            return None;
        }
        <Hmac<Sha256> as Mac>::new_from_slice(key).ok().map(SessionKey)
    }

    /// A key given in configuration (PRISM_MCP_SESSION_KEY): its bytes, at least 32.
    pub fn from_config(value: &str) -> Option<Self> {
        Self::from_bytes(value.as_bytes())
    }

    /// The key every replica of this database shares: the first replica to start writes
    /// a random one, every later start reads it.
    pub async fn shared(store: &McpStore) -> Result<Self, SessionKeyError> {
        let mut fresh = [0u8; 32];
        getrandom::fill(&mut fresh).map_err(|e| SessionKeyError::Entropy(e.to_string()))?;
        let key = store.shared_session_key(&fresh).await?;
        Self::from_bytes(&key).ok_or(SessionKeyError::Unusable(key.len()))
    }

    fn mac(&self, payload: &[u8]) -> Hmac<Sha256> {
        let mut mac = self.0.clone();
        mac.update(payload);
        mac
    }

    /// A session id carrying `facts`.
    pub fn sign(&self, facts: &SessionFacts) -> String {
        let payload = serde_json::to_vec(facts).unwrap_or_default();
        let tag = self.mac(&payload).finalize().into_bytes();
        format!("{PREFIX}.{}.{}", B64.encode(&payload), B64.encode(tag))
    }

    /// The facts of a session id this key signed; None for anything else.
    pub fn verify(&self, id: &str) -> Option<SessionFacts> {
        if id.len() > MAX_ID_BYTES {
            return None;
        }
        let mut parts = id.split('.');
        let (prefix, payload, tag) = (parts.next()?, parts.next()?, parts.next()?);
        if prefix != PREFIX || parts.next().is_some() {
            return None;
        }
        let payload = B64.decode(payload).ok()?;
        let tag = B64.decode(tag).ok()?;
        // Constant-time comparison.
        self.mac(&payload).verify_slice(&tag).ok()?;
        let mut facts: SessionFacts = serde_json::from_slice(&payload).ok()?;
        facts.id_digest = B64.encode(&Sha256::digest(id.as_bytes())[..24]);
        Some(facts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> SessionKey {
        SessionKey::from_bytes(&[byte; 32]).expect("key")
    }

    #[test]
    fn a_signed_id_verifies_and_carries_its_facts() {
        let facts = SessionFacts::new("2025-11-25", "claude-code", "system:serviceaccount:ns:agent", Some("uid-1"));
        let id = key(1).sign(&facts);
        assert!(id.starts_with("ms1."));
        let back = key(1).verify(&id).expect("verifies");
        assert_eq!(back.id_digest.len(), 32);
        assert_eq!(key(1).verify(&id).expect("again").id_digest, back.id_digest, "one session, one digest");
        assert_eq!(SessionFacts { id_digest: String::new(), ..back.clone() }, facts);
        let now = facts.issued_at;
        assert!(back.belongs_to("system:serviceaccount:ns:agent", Some("uid-1"), now));
        assert!(!back.belongs_to("system:serviceaccount:ns:other", Some("uid-1"), now));
        assert!(!back.belongs_to("system:serviceaccount:ns:agent", Some("uid-2"), now), "the name made again");
        assert!(!back.belongs_to("system:serviceaccount:ns:agent", None, now));
        assert!(back.belongs_to("system:serviceaccount:ns:agent", Some("uid-1"), now + MAX_SESSION_AGE_SECONDS));
        assert!(
            !back.belongs_to("system:serviceaccount:ns:agent", Some("uid-1"), now + MAX_SESSION_AGE_SECONDS + 1),
            "aged out"
        );
        // An id of 0.1.0 (no uid in it) is bound to the username until it ages out.
        let old = SessionFacts { uid: None, ..facts.clone() };
        let old = key(1).verify(&key(1).sign(&old)).expect("verifies");
        assert!(old.belongs_to("system:serviceaccount:ns:agent", Some("uid-9"), now));
    }

    #[test]
    fn forged_or_foreign_ids_do_not_verify() {
        let id = key(1).sign(&SessionFacts::new("2025-06-18", "codex-mcp-client", "alice", None));
        assert!(key(2).verify(&id).is_none(), "another key");
        let (head, tag) = id.rsplit_once('.').expect("dots");
        let forged_payload = B64.encode(br#"{"v":"2025-06-18","c":"claude-ai","u":"x","t":0}"#);
        assert!(key(1).verify(&format!("ms1.{forged_payload}.{tag}")).is_none(), "payload swapped");
        assert!(key(1).verify(&format!("{head}.AAAA")).is_none(), "tag swapped");
        for junk in ["", "ms1", "ms1..", "ms2.e30.AAAA", "random-uuid-from-elsewhere", &"x".repeat(5000)] {
            assert!(key(1).verify(junk).is_none(), "{junk:?}");
        }
    }

    #[test]
    fn configured_keys_must_be_long_enough() {
        assert!(SessionKey::from_config("short").is_none());
        assert!(SessionKey::from_config(&"k".repeat(32)).is_some());
    }

    #[test]
    fn client_names_are_bounded() {
        let facts = SessionFacts::new("2025-11-25", &"n".repeat(10_000), "u", None);
        assert_eq!(facts.client_name.len(), MAX_CLIENT_NAME);
    }
}

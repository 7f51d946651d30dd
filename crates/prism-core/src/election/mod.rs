//! The election's values (who a registration is, its role, why it left) and its rules
//! (SPEC §4), as one pure function.

pub mod registration;
pub mod restore;
pub mod rules;

pub use registration::{NewRegistration, ProjectView, Pruned, Quota, RegisterOutcome, Registration};

pub use rules::{Candidate, Cause, Decision, Event, MasterChange, ProjectState, Transition, decide, succession_order};

use crate::text_enum;

text_enum! {
    /// The agent surfaces a registration can come from (also a Postgres CHECK constraint).
    #[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
    pub enum AgentSurface {
        ClaudeDesktop = "claude_desktop",
        ClaudeCode = "claude_code",
        Codex = "codex",
        Cursor = "cursor",
        Other = "other",
    }
}

impl AgentSurface {
    pub fn is_desktop(self) -> bool {
        self == AgentSurface::ClaudeDesktop
    }
}

text_enum! {
    /// Why a registration left its project (also a Postgres CHECK constraint).
    #[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
    pub enum ReleaseReason {
        /// The session wrapped (its resource was deleted, or it called release).
        Wrapped = "wrapped",
        /// The session registered on another project.
        ContextSwitch = "context_switch",
        /// No heartbeat within the stale threshold: the sweep released it.
        StaleHeartbeatIncident = "stale_heartbeat_incident",
    }
}

#[cfg(feature = "sqlx")]
crate::sqlx_text!(AgentSurface, ReleaseReason);
#[cfg(feature = "utoipa")]
crate::utoipa_text!(AgentSurface, ReleaseReason);

/// A registration's role, spelled as Kubernetes spells enum values (`kubectl get` shows it);
/// the HTTP API and the routing table use the same spelling.
#[derive(serde::Serialize, serde::Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub enum Role {
    // Not (yet) in the election. (A doc comment here would reorder the schema's enum.)
    #[default]
    Pending,
    Master,
    Peer,
    Released,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Pending => "Pending",
            Role::Master => "Master",
            Role::Peer => "Peer",
            Role::Released => "Released",
        }
    }
}

/// Which change of a project a routing table shows: `<term>.<seq>` on a watch (SPEC
/// §11), `seq` counting the project's election writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChangeId {
    pub term: i64,
    pub seq: i64,
}

impl std::fmt::Display for ChangeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.term, self.seq)
    }
}

impl std::str::FromStr for ChangeId {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        let (term, seq) = s.split_once('.').ok_or(())?;
        Ok(ChangeId { term: term.parse().map_err(|_| ())?, seq: seq.parse().map_err(|_| ())? })
    }
}

//! Custom resource types (SPEC §3). Types only: no I/O, no behaviour beyond naming.
//!
//! The CRDs in `crds/` are generated from these types by `prism-operator crdgen`; a test
//! fails when the two differ, so edit the types, never the YAML.

// `#[kube(printcolumn(..))]` repeats `type_ = ..` once per column, by design of kube-derive.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of every prism resource.
pub const GROUP: &str = "prism.ntecdev.ai";
/// Label carrying `spec.projectId` on each ControllerRegistration, for label selectors.
pub const PROJECT_LABEL: &str = "prism.ntecdev.ai/project";
/// The finalizer that makes deleting a ControllerRegistration release it first.
pub const REGISTRATION_FINALIZER: &str = "prism.ntecdev.ai/release";

/// The Kubernetes identity (username) a ControllerRegistration belongs to (SPEC §12).
/// The API sets it on the resources it creates for its callers; the chart's admission
/// policy stamps the creator's username on those created with kubectl and refuses any
/// other value or a change. Trusted only where that policy is in force
/// (PRISM_TRUST_OWNER_ANNOTATION).
pub const OWNER_ANNOTATION: &str = "prism.ntecdev.ai/owner";
/// Set to `api` on the registrations the HTTP/MCP API creates: the API writes their rows
/// (one writer per registration) and their reconciler only reads them, and deletes such
/// a resource that never got a row (a call that died between the two steps).
pub const REGISTERED_BY_ANNOTATION: &str = "prism.ntecdev.ai/registered-by";
pub const REGISTERED_BY_API: &str = "api";

// The identifiers' limits are the domain's (SPEC §3.1), said once.
use prism_core::limits::{COMPONENT_KIND_MAX, SERVER_INSTANCE_ID_MAX};
pub use prism_core::limits::{PRINTABLE_PATTERN, PROJECT_ID_MAX, SESSION_ID_MAX, is_label_value};

// ---------------------------------------------------------------------------------------
// ControllerRegistration
// ---------------------------------------------------------------------------------------

/// An AI agent session registered for a project. The election decides which one is the
/// project's master; `status` is the answer.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "prism.ntecdev.ai",
    version = "v1alpha1",
    kind = "ControllerRegistration",
    namespaced,
    status = "ControllerRegistrationStatus",
    shortname = "creg",
    category = "prism",
    selectable = ".spec.projectId",
    doc = "An AI agent session registered for a project; a Postgres-backed election keeps exactly one master per project.",
    printcolumn(name = "Project", type_ = "string", json_path = ".spec.projectId"),
    printcolumn(name = "Surface", type_ = "string", json_path = ".spec.agentSurface"),
    printcolumn(name = "Role", type_ = "string", json_path = ".status.role"),
    printcolumn(name = "Term", type_ = "integer", json_path = ".status.term"),
    printcolumn(name = "Heartbeat", type_ = "date", json_path = ".status.lastHeartbeat"),
    // lastHeartbeat is refreshed every PRISM_STATUS_HEARTBEAT_SECONDS only (the API
    // server's write load); Stale is written the moment it turns, so live and stale read
    // apart at a glance whatever that setting is.
    printcolumn(name = "Stale", type_ = "string", json_path = r#".status.conditions[?(@.type=="Stale")].status"#),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
// Changing project is a context switch, which is a new registration: spec never changes.
#[x_kube(validation = Rule::new("self == oldSelf").message(
    "spec is immutable: to change project create a new ControllerRegistration (that is the context switch)"
))]
#[serde(rename_all = "camelCase")]
pub struct ControllerRegistrationSpec {
    /// The project this session registers for (printable: no control characters).
    #[schemars(length(min = 1, max = PROJECT_ID_MAX), pattern(PRINTABLE_PATTERN))]
    pub project_id: String,
    /// The agent session: one task of one agent, the `session_id` of every prism call
    /// (printable: no control characters).
    #[schemars(length(min = 1, max = SESSION_ID_MAX), pattern(PRINTABLE_PATTERN))]
    pub session_id: String,
    /// Which agent surface the session runs in; desktop sessions preempt the others.
    pub agent_surface: AgentSurface,
}

// The election's values are the domain's, with their JSON Schema.
pub use prism_core::election::{AgentSurface, ReleaseReason, Role};

/// Who a registration is: used for `status.master` and `status.preemptedBy`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RegistrationRef {
    pub name: String,
    pub session_id: String,
    pub agent_surface: AgentSurface,
}

#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ControllerRegistrationStatus {
    #[serde(default)]
    pub role: Role,
    #[serde(default)]
    pub is_master: bool,
    /// Project election epoch when this registration became master (a fencing token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub term: Option<i64>,
    /// The project's current master.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master: Option<RegistrationRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registered_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_reason: Option<ReleaseReason>,
    /// "you_were_preempted": set on a master demoted by a desktop registration.
    #[serde(default)]
    pub preempted: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempted_by: Option<RegistrationRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

// ---------------------------------------------------------------------------------------
// RunSession
// ---------------------------------------------------------------------------------------

/// The durable identity of one machine-side Run (server instance + component kind) and
/// its credential. The live session is a Redis lease; `status` is its safe projection.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "prism.ntecdev.ai",
    version = "v1alpha1",
    kind = "RunSession",
    namespaced,
    status = "RunSessionStatus",
    shortname = "rsess",
    category = "prism",
    selectable = ".spec.serverInstanceId",
    selectable = ".spec.componentKind",
    doc = "The durable identity and credential of a machine-side Run; its live session is a Redis TTL lease.",
    printcolumn(name = "Server", type_ = "string", json_path = ".spec.serverInstanceId"),
    printcolumn(name = "Component", type_ = "string", json_path = ".spec.componentKind"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Version", type_ = "string", json_path = ".status.version"),
    printcolumn(name = "Heartbeat", type_ = "date", json_path = ".status.lastHeartbeat"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct RunSessionSpec {
    /// The server instance this Run belongs to; with componentKind, unique in the cluster.
    #[schemars(length(min = 1, max = SERVER_INSTANCE_ID_MAX), regex(pattern = r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("serverInstanceId is immutable"))]
    pub server_instance_id: String,
    /// The kind of component (lowercase DNS label), e.g. `run`.
    #[schemars(length(min = 1, max = COMPONENT_KIND_MAX), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("componentKind is immutable"))]
    pub component_kind: String,
    pub credential: RunCredential,
    /// Lease length in seconds; overrides PRISM_RUN_LEASE_SECONDS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 5, max = 3600))]
    pub lease_seconds: Option<i32>,
    /// The platform's cordon (SPEC §5.1, Drain): while true the Run's claims hand out no
    /// new job (jobs in flight finish normally) and status shows `Draining`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
}

/// The Run's public key. Raising `generation` revokes every older key at once.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
// A new key needs a new generation, and generations never go back: otherwise a revoked
// key could be made valid again.
#[x_kube(
    validation = Rule::new("self.generation >= oldSelf.generation").message("credential.generation may not decrease"),
    validation = Rule::new("self.publicKey == oldSelf.publicKey || self.generation > oldSelf.generation").message("a new publicKey needs a higher credential.generation")
)]
pub struct RunCredential {
    /// Standard base64 (with padding) of the 32-byte Ed25519 public key.
    #[schemars(regex(pattern = r"^[A-Za-z0-9+/]{43}=$"))]
    pub public_key: String,
    #[schemars(range(min = 1))]
    pub generation: i64,
}

// A Run's values are the domain's, with their JSON Schema.
pub use prism_core::run::{RunPhase, RunTarget, UnavailableReason};

/// Safe projection of the Run's session: never a token, hash, key name, credential, host
/// path or socket.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RunSessionStatus {
    #[serde(default)]
    pub phase: RunPhase,
    #[serde(default)]
    pub online: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_started_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<RunTarget>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
    /// Name -> non-negative amount, e.g. `slots: 4`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("additionalProperties" = {"type": "integer", "format": "int64", "minimum": 0}))]
    pub capacity: BTreeMap<String, i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable_reason: Option<UnavailableReason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// Both CRDs as one multi-document YAML stream: what `crdgen` prints and `crds/` holds.
pub fn crds_yaml() -> Result<String, serde_yaml::Error> {
    let mut out = String::new();
    for crd in [ControllerRegistration::crd(), RunSession::crd()] {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&crd)?);
    }
    Ok(out)
}

/// File names under `crds/`, one per CRD, paired with its YAML.
pub fn crd_files() -> Result<Vec<(String, String)>, serde_yaml::Error> {
    [ControllerRegistration::crd(), RunSession::crd()]
        .into_iter()
        .map(|crd| {
            let name = crd.metadata.name.clone().unwrap_or_default();
            Ok((format!("{name}.yaml"), serde_yaml::to_string(&crd)?))
        })
        .collect()
}

//! prism-operator: controller elections (Postgres) and Run sessions (Redis) as
//! Kubernetes custom resources.

// Domain: resource types, the election (pure rules + Postgres), the registry of Runs
// (proofs, Redis leases, durable jobs).
pub use prism_kube::crd;
pub use prism_store::{election, run_registry};
// Services over the domain: what agents ask for, what MCP sessions keep, and the
// signal that a resource's status must be refreshed.
pub mod agent_sessions;
pub use prism_store::mcp_store;
pub mod refresh;
// Kubernetes glue (the prism-kube crate): reconcilers and the Lease that picks the
// replica running them.
pub use prism_kube::{leader, reconcilers};
// The HTTP API, the listener that serves it (TLS, server limits), and the client a Run
// uses to speak it.
pub mod api;
pub mod run_client;
pub use prism_store::signals;
pub mod transport;
// Process: configuration, subcommands, database connection, logs and metrics.
pub mod commands;
pub mod config;
pub use prism_store::db;
pub mod failpoints;
pub use prism_store::json_int;
pub mod telemetry;
pub use prism_kube::time;

// Strategies for the property tests of every input (tests only).
#[cfg(test)]
pub(crate) mod any_input;

/// Selects ring as the process's TLS provider for every client (kube, sqlx, reqwest),
/// whatever features dependencies enable. Idempotent; call before building clients.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

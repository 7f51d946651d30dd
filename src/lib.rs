//! prism-operator: controller elections (Postgres) and Run sessions (Redis) as
//! Kubernetes custom resources. This crate is the binary's: configuration, subcommands,
//! logs and traces, and the wiring of the layers, which are crates of their own
//! (docs/src/development/code-layout.md). Their modules are re-exported here under the
//! names the tests and benches use.

// Domain: resource types, the election (pure rules + Postgres), the registry of Runs
// (proofs, Redis leases, durable jobs).
pub use prism_kube::crd;
pub use prism_store::{election, run_registry};
// Services over the domain: what agents ask for, what MCP sessions keep, and the
// signal that a resource's status must be refreshed.
pub use prism_api::agent_sessions;
pub use prism_store::mcp_store;
pub mod refresh;
// Kubernetes glue (the prism-kube crate): reconcilers and the Lease that picks the
// replica running them.
pub use prism_kube::{leader, reconcilers};
// The HTTP API (the prism-api crate), the listener that serves it (TLS, server limits),
// and the client a Run uses to speak it.
pub use prism_api as api;
pub use prism_api::{failpoints, install_crypto_provider, metrics, run_client, transport};
pub use prism_store::signals;
// Process: configuration, subcommands, database connection, logs and traces.
pub mod commands;
pub mod config;
pub use prism_store::db;
pub use prism_store::json_int;
pub mod telemetry;
pub mod term_guard;
pub use prism_kube::time;

//! prism-operator: controller elections (Postgres) and Run sessions (Redis) as
//! Kubernetes custom resources.

pub mod agent_cmd;
pub mod api;
pub mod config;
pub mod controller;
pub mod crd;
pub mod db;
pub mod election;
pub mod leader;
pub mod runclient;
pub mod runtime;
pub mod server;
pub mod status_cmd;
pub mod telemetry;
pub mod triggers;

/// Selects ring as the process's TLS provider for every client (kube, sqlx, reqwest),
/// whatever features dependencies enable. Idempotent; call before building clients.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

//! prism-operator: controller elections (Postgres) and Run sessions (Redis) as
//! Kubernetes custom resources.

pub mod api;
pub mod config;
pub mod crd;
pub mod db;
pub mod runtime;
pub mod server;
pub mod telemetry;

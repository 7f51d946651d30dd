//! prism-operator: controller elections (Postgres) and Run sessions (Redis) as
//! Kubernetes custom resources.

pub mod api;
pub mod config;
pub mod controller;
pub mod crd;
pub mod db;
pub mod election;
pub mod runtime;
pub mod server;
pub mod status_cmd;
pub mod telemetry;

//! prism-operator's domain, with no I/O and none of the outer layers' crates (kube,
//! sqlx, axum, rmcp, redis; `tests/layers.rs` checks it): the identifiers' limits, the
//! election's values, rows and rules (SPEC §4), a Run's address, identity and session
//! (SPEC §5), the hello proof (SPEC §8), and the store traits the reconcilers drive.
//! The codecs the outer layers need for these types (JSON Schema for the CRDs, the
//! Postgres text codec, the OpenAPI schema) are behind features.

pub mod election;
pub mod limits;
pub mod proof;
pub mod release;
pub mod run;
pub mod store;
mod text_enum;

pub use text_enum::UnknownValue;

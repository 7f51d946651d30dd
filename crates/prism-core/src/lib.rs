//! prism-operator's domain, with no I/O and none of the outer layers' crates (kube,
//! sqlx, axum, rmcp, redis; `tests/layers.rs` checks it): the identifiers' limits, the
//! election's values and rules (SPEC §4), and the hello proof of a Run (SPEC §5, §8).
//! The codecs the outer layers need for these types (JSON Schema for the CRDs, the
//! Postgres text codec, the OpenAPI schema) are behind features.

pub mod election;
pub mod limits;
pub mod proof;
mod text_enum;

pub use text_enum::UnknownValue;

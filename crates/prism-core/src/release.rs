//! Which release this is (SPEC §15): one version for the binary, its crates and the
//! chart (tests/versions.rs holds them equal), reported by `prism-operator --version`,
//! `GET /version` and the `prism_build_info` metric.

/// This build's version (semver), the workspace's.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

//! prism-operator's Kubernetes side: the custom resource types (SPEC §3), the
//! reconcilers of both kinds and the loops beside them, the one status writer, the
//! safe projection of a Run's session into status, and the Lease that picks the replica
//! that reconciles. The stores are prism-core's traits: nothing here knows Postgres or
//! Redis, so every reconcile rule is tested against fakes in memory and kube's mocked
//! API server (`cargo test -p prism-kube`), beside the real-service suites.

pub mod crd;
pub mod crd_check;
pub mod leader;
pub mod projection;
pub mod reconcilers;
pub mod time;

#[cfg(test)]
mod fakes;

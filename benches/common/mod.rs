//! What the benchmarks share: how they measure and judge (`measure`), what they count
//! (`counts`), a convergence round of registrations on the API server (`converge`) and a
//! window of /metrics scrapes (`scrape`) the Run heartbeat's raw baseline (`raw`) and many Runs at once (`runs`).
//! Each bench uses part of it.
#![allow(dead_code)]

pub mod converge;
pub mod counts;
pub mod measure;
pub mod raw;
pub mod runs;
pub mod scrape;

/// The per-identity rate limit (SPEC §12, PRISM_RATE_PER_IDENTITY) opened wide: a bench's
/// thousands of simulated agents share one ServiceAccount, where real agents each have
/// their own identity and budget.
pub const UNTHROTTLED_RATE: (&str, &str) = ("PRISM_RATE_PER_IDENTITY", "1000000");
pub const UNTHROTTLED_BURST: (&str, &str) = ("PRISM_BURST_PER_IDENTITY", "10000000");
/// One source address's share of the connection cap (SPEC §12) opened to the whole cap: a
/// bench's clients all come from 127.0.0.1.
pub const UNCAPPED_ADDRESS: (&str, &str) = ("PRISM_MAX_CONNECTIONS_PER_ADDRESS", "1000000");

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

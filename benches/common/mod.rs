//! What the benchmarks share: how they measure and judge (`measure`) and what they count
//! (`counts`). Each bench uses part of it.
#![allow(dead_code)]

pub mod counts;
pub mod measure;

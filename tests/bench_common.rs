//! The benchmarks' shared measuring and counting code (benches/common), unit-tested with
//! the other tests: bench targets run without the test harness, so their #[test]s would
//! never run there.
#![allow(dead_code)]

#[path = "../benches/common/counts.rs"]
mod counts;
#[path = "../benches/common/measure.rs"]
mod measure;

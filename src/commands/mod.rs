//! The subcommands of `prism-operator` (SPEC §2), one module each; `crdgen` and
//! `migrate` are a few lines in `main.rs`.

mod api_client;
pub mod credential;
pub mod demo_run;
pub mod jobs;
pub mod run;
pub mod selftest;
pub mod status;

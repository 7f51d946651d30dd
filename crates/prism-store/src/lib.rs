//! prism-operator's stores: everything that speaks SQL or Redis. The API and the process
//! call them through their services' methods; the reconcilers through prism-core's traits
//! (`Elections`, `Runs`), which the election store and the registry implement.

// The pool, the migrations, typed text values and errors that name the step that failed.
pub mod db;
// The migrations and their two ledgers (the previous release runs on this schema).
pub mod migrations;
// The controller election (SPEC §4): the Postgres store around prism-core's rules.
pub mod election;
// The registry of Runs (SPEC §5): Redis leases, Postgres identities and jobs.
pub mod run_registry;
// What MCP sessions keep: the key that signs their ids, the resources they follow.
pub mod mcp_store;
// "Refresh these statuses" (the sending half) and what a replica hears of change on any.
pub mod identity_epochs;
pub mod refresh;
pub mod signals;
// A JSON integer read exactly, as the wire format's numbers are.
pub mod json_int;

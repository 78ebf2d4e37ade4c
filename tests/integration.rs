//! The integration tests, one binary: each module is one file of `tests/`, named as the file,
//! so `cargo test --workspace --all-features --test integration handoff::` runs `tests/handoff.rs`.
//!
//! One binary rather than one per file: each test binary links the crate, axum, tokio and redis
//! again, and 48 of them were most of the suite's build. A test file whose tests read or set
//! something of the whole process (a global `tracing` subscriber, the process's RSS) or compile
//! the crate's code under loom stays a binary of its own (see `suite/Cargo.toml`). Modules are
//! declared here without attributes (a file gates itself with `#![cfg(..)]`), so that the
//! check that every file runs (`suite/src/lib.rs`) reads them all. The tests here
//! start their own servers on free ports, so they run side by side like any others.

mod instances;
mod suite;
mod support;

mod acl;
mod bad_input;
mod body_keys;
mod capabilities;
mod cluster;
mod coalesce;
mod demo;
mod example_counts;
mod example_limits;
mod faults;
mod fenced;
mod group_commit;
mod handoff;
mod idempotency;
mod load;
mod memory;
mod middleware;
mod nothing_left;
mod ops;
mod orders;
mod paused_holder;
mod permits;
mod protocol_model;
mod redlock;
mod reentry;
mod replica;
mod runtimes;
mod sentinel;
mod shared;
mod spelling;
mod sql;
mod store_errors;
mod tls;
mod valkey;

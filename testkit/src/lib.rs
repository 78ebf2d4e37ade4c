//! The external processes that tower-lock's integration tests and benchmark start, in one
//! place: `redis-server` (alone, as a replica, as cluster nodes, as sentinels), a fault-injecting
//! TCP proxy, `wrk`, the benchmark's own child processes, and any service binary a test runs.
//!
//! | module | starts or reads |
//! |---|---|
//! | [`server`] | one [`RedisServer`] on a free loopback port, `redis-server` or `valkey-server` ([`Flavor`]); replicas; `redis-cli` |
//! | [`cluster`] | a [`RedisCluster`] of masters and replicas, or one node owning every slot |
//! | [`sentinel`] | a master, its replica and three sentinels ([`SentinelSetup`]) |
//! | [`tls`] | a private CA and its certificates ([`TestCerts`], by `openssl`); servers that speak TLS only ([`TlsOptions`]) |
//! | [`proxy`] | a [`Proxy`] between a client and a server, to inject network faults |
//! | [`stats`] | what a server counted: `INFO commandstats` and `INFO errorstats` |
//! | [`monitor`] | client-issued commands, counted (or recorded) over `MONITOR` |
//! | [`process`] | readiness probes, a service binary with its output captured, child guards |
//! | [`http`] | a small HTTP/1.1 client for a service a test started |
//! | [`wrk`] | one `wrk` run, parsed |
//! | [`port`] | free loopback ports |
//!
//! # Rules every helper keeps
//!
//! - **Only what it started.** Every server listens on 127.0.0.1 on a port the OS just handed
//!   out (never 6379), in a scratch directory of its own, with persistence off. Nothing here
//!   connects to, configures or stops a server it did not start: a developer's own Redis is safe.
//! - **Stopped on drop.** Each process is SIGKILLed and reaped when its guard drops, panics
//!   included, and its scratch directory removed.
//! - **Loud when a tool is missing.** A test that needs `redis-server` or `redis-cli` and cannot
//!   run it panics with the command that installs it (`apt-get install -y redis-server
//!   redis-tools`, or `scripts/test.sh`, which does); it never skips. The benchmark's
//!   [`require_tool`](process::require_tool) exits with the same hint.
//!
//! The kit does not depend on tower-lock: whatever knows the crate's key names, channels or
//! stores stays with the tests (`tests/support`) and the benchmark (`benches/lock_bench`).
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

pub mod cluster;
pub mod http;
pub mod monitor;
pub mod port;
pub mod process;
pub mod proxy;
pub mod sentinel;
pub mod server;
pub mod stats;
pub mod tls;
pub mod wrk;

pub use cluster::{RedisCluster, key_slot, one_node_cluster};
pub use port::{ClosedPort, free_port};
pub use proxy::Proxy;
pub use sentinel::SentinelSetup;
pub use server::{Flavor, RedisServer, ServerOptions, redis_cli};
pub use stats::{calls_of, errors_of};
pub use tls::{TestCerts, TlsOptions};

//! Free loopback ports: whatever the OS hands out for `127.0.0.1:0`, never Redis's default 6379
//! (a developer's own server may want it back).
//!
//! The port is free when this returns, not reserved: a process started on it may find it taken
//! by then. Every starter in this kit therefore tries up to five ports.

use std::net::TcpListener;

/// A loopback port that was free a moment ago, never 6379.
pub fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("no free loopback port");
        if port != 6379 {
            return port;
        }
    }
}

/// A loopback port that was free a moment ago with `port + 10000` free too (a cluster node's bus
/// port, which must also be a valid port), never 6379.
pub(crate) fn free_port_with_bus() -> u16 {
    loop {
        let port = free_port();
        if port <= u16::MAX - 10_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

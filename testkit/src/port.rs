//! Free loopback ports: whatever the OS hands out for `127.0.0.1:0`, never Redis's default 6379
//! (a developer's own server may want it back).
//!
//! The port is free when this returns, not reserved: a process started on it may find it taken
//! by then. Every starter in this kit therefore tries up to five ports, and takes a server for
//! its own only when the process answering there is the one it started. A test of an
//! unreachable server takes a [`ClosedPort`], where nothing can listen while it holds it.

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

/// A loopback port where nothing listens, for as long as the guard lives: a socket bound to it
/// that never listens, so a connection there is refused (`ECONNREFUSED`) and no server can
/// start on it meanwhile. For the tests of an unreachable server: a port that was merely free
/// a moment ago may meanwhile be another test's server, which the test would then reach.
#[derive(Debug)]
pub struct ClosedPort {
    // Held for its binding.
    _socket: tokio::net::TcpSocket,
    port: u16,
}

impl ClosedPort {
    /// Binds a socket to a free loopback port (never 6379), without listening.
    pub fn new() -> Self {
        loop {
            let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
            socket
                .bind(([127, 0, 0, 1], 0).into())
                .expect("a loopback port");
            let port = socket.local_addr().expect("its address").port();
            if port != 6379 {
                return Self {
                    _socket: socket,
                    port,
                };
            }
        }
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Default for ClosedPort {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_listens_on_a_closed_port_and_nothing_can_bind_it() {
        let closed = ClosedPort::new();
        let refused = std::net::TcpStream::connect(("127.0.0.1", closed.port()))
            .expect_err("a connection to a closed port was accepted");
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
        assert!(TcpListener::bind(("127.0.0.1", closed.port())).is_err());
    }
}

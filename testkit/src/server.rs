//! One `redis-server` on a free loopback port, started by the test or benchmark that owns the
//! [`RedisServer`] guard and killed when it drops; replicas of it; `redis-cli`.
//!
//! Every server runs with `--bind 127.0.0.1 --save "" --appendonly no` in a scratch directory of
//! its own, plus the caller's arguments (replication, cluster mode, an eviction policy). A
//! missing `redis-server` or `redis-cli` is a loud panic that says how to install it.

use std::{
    io::{Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{
    port::free_port,
    process::{kill, ping, scratch_dir, wait_until_up},
};

/// A `redis-server` this process started, on a free loopback port; SIGKILLed on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    /// How it was started, kept for restarts.
    options: ServerOptions,
}

/// How to start a [`RedisServer`]: extra `redis-server` arguments, and whether it runs in a
/// session of its own. Build with [`RedisServer::options`].
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct ServerOptions {
    args: Vec<String>,
    own_session: bool,
}

impl ServerOptions {
    /// Adds `redis-server` arguments (`--replicaof 127.0.0.1 <port>`, `--cluster-enabled yes`).
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    /// Runs the server in a session of its own (through `setsid`, which execs it in place, so
    /// the process this kit kills is `redis-server` itself), as a system service would run.
    ///
    /// With the kernel's autogroup scheduling on, each session gets an equal CPU share: a server
    /// in the caller's session shares one with the caller (and the load generator), and under
    /// load Redis, the bottleneck, gets a fraction of a core. The benchmark wants its own share;
    /// tests do not care. Needs `setsid` (util-linux).
    pub fn own_session(mut self, own: bool) -> Self {
        self.own_session = own;
        self
    }

    /// Starts the server. Panics, loudly, if `redis-server` is not installed or does not start.
    pub fn start(self) -> RedisServer {
        let dir = scratch_dir("redis");
        for _ in 0..5 {
            let mut server = RedisServer {
                child: None,
                port: free_port(),
                dir: dir.clone(),
                options: self.clone(),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!(
            "redis-server did not start on any of 5 free ports (is it installed? \
             `apt-get install -y redis-server`)"
        );
    }
}

impl RedisServer {
    /// Starts a fresh server. Panics, loudly, if `redis-server` is not installed.
    pub fn start() -> Self {
        Self::options().start()
    }

    /// Starts a fresh server with extra `redis-server` arguments.
    pub fn start_with(extra_args: &[&str]) -> Self {
        Self::options().args(extra_args).start()
    }

    /// Options for a server started otherwise: see [`ServerOptions`].
    pub fn options() -> ServerOptions {
        ServerOptions::default()
    }

    fn spawn(&mut self) -> bool {
        let mut command = if self.options.own_session {
            let mut command = Command::new("setsid");
            command.arg("redis-server");
            command
        } else {
            Command::new("redis-server")
        };
        let child = command
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.options.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run `{}` ({e}). The Redis tests and the benchmark need a real \
                     server: install it (`apt-get install -y redis-server`{}) or run \
                     `scripts/test.sh`, which does.",
                    if self.options.own_session {
                        "setsid redis-server"
                    } else {
                        "redis-server"
                    },
                    if self.options.own_session {
                        ", and util-linux for `setsid`"
                    } else {
                        ""
                    },
                )
            });
        self.child = Some(child);
        let port = self.port;
        if wait_until_up(&mut self.child, "redis-server", port, || ping(port)) {
            return true;
        }
        self.kill();
        false
    }

    /// The port it listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Its scratch directory (its working directory; removed on drop): a place for files that
    /// live as long as the server.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether it runs (not killed, not exited at start).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        kill(&mut self.child);
    }

    /// Starts the server again on the same port, with the same options, empty (no persistence).
    pub fn restart(&mut self) {
        self.kill();
        let start = Instant::now();
        while !self.spawn() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "redis-server did not restart on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A plain connection for inspecting or tampering with the server.
    pub async fn client(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("cannot connect to the test redis-server")
    }

    /// Starts a replica of `master` and waits until its replication link is up.
    pub fn replica_of(master: &RedisServer) -> Self {
        // Diskless sync waits 5 s by default for more replicas to join; no need here.
        master.cli(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"]);
        let port = master.port().to_string();
        let replica = Self::start_with(&["--replicaof", "127.0.0.1", &port]);
        replica.wait_for_info("master_link_status:up");
        master.wait_for_replica_acks(1);
        replica
    }

    /// Waits until `n` replicas acknowledge a write (after a sync, the master counts a replica
    /// only once it has sent its first `REPLCONF ACK`, up to a second later).
    pub fn wait_for_replica_acks(&self, n: usize) {
        let start = Instant::now();
        let probe = format!("INCR replication-probe\r\nWAIT {n} 100\r\n");
        loop {
            let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(2)))
                .unwrap();
            stream.write_all(probe.as_bytes()).unwrap();
            let mut reply = Vec::new();
            let mut buf = [0u8; 64];
            // Two integer replies: ":<counter>\r\n:<acks>\r\n".
            while reply.iter().filter(|&&b| b == b'\n').count() < 2 {
                let read = stream.read(&mut buf).unwrap();
                assert!(read > 0, "port {}: connection closed", self.port);
                reply.extend_from_slice(&buf[..read]);
            }
            let text = String::from_utf8_lossy(&reply);
            let acks: usize = text
                .lines()
                .nth(1)
                .and_then(|l| l.trim().strip_prefix(':')?.parse().ok())
                .unwrap_or(0);
            if acks >= n {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "port {}: {n} replicas never acknowledged: {text}",
                self.port
            );
        }
    }

    /// `redis-cli -p <port> <args>` against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        cli_on(self.port, args)
    }

    /// Polls `INFO` until it contains `needle`, for at most 10 s.
    pub fn wait_for_info(&self, needle: &str) {
        let start = Instant::now();
        while !self.cli(&["INFO"]).contains(needle) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "port {}: INFO never showed {needle:?}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `redis-cli` with `args` (name a port: `-p <port>`); panics, loudly, if it is missing or
/// fails.
pub fn redis_cli(args: &[&str]) -> String {
    let output = Command::new("redis-cli")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `redis-cli` ({e}). The cluster tests need it: install it \
                 (`apt-get install -y redis-tools`) or run `scripts/test.sh`, which does."
            )
        });
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "redis-cli {args:?} failed: {text}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    text
}

/// `redis-cli -p <port> <args>`.
pub(crate) fn cli_on(port: u16, args: &[&str]) -> String {
    let port = port.to_string();
    let mut all = vec!["-p", &port];
    all.extend_from_slice(args);
    redis_cli(&all)
}

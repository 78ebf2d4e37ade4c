//! Redis Sentinel on loopback: a master, its replica and three sentinels (`redis-server <conf>
//! --sentinel`, each with a config file of its own in its scratch directory), each process
//! SIGKILLed on drop. The sentinels monitor only the master this setup started.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{
    port::free_port,
    process::{kill, scratch_dir, wait_until_up},
    server::{Access, RedisServer, ServerOptions},
    tls::TlsOptions,
};

/// The name the sentinels monitor the master under.
pub const MASTER_NAME: &str = "mymaster";

/// One `redis-server --sentinel`, with its own (rewritable) config file; killed on drop.
#[derive(Debug)]
pub struct SentinelServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    tls: Option<TlsOptions>,
}

impl SentinelServer {
    /// Starts a sentinel monitoring the master on `master_port` (quorum 2), which it considers
    /// down after `down_after` without an answer. Panics, loudly, if `redis-server` cannot run
    /// as a sentinel.
    pub fn start(master_port: u16, down_after: Duration) -> Self {
        Self::start_with(master_port, None, None, down_after)
    }

    /// Like [`start`](Self::start), for a master that speaks TLS (`tls`: the sentinel then
    /// speaks TLS only too, and reaches the servers over TLS) or needs `password`.
    pub fn start_with(
        master_port: u16,
        tls: Option<&TlsOptions>,
        password: Option<&str>,
        down_after: Duration,
    ) -> Self {
        for _ in 0..5 {
            // A directory of its own per try: a failed try's is removed when it is dropped.
            let dir = scratch_dir("sentinel");
            let port = free_port();
            let conf = dir.join("sentinel.conf");
            let mut extra = String::new();
            match tls {
                None => extra += &format!("port {port}\n"),
                Some(tls) => {
                    for (name, value) in tls.server_settings(port) {
                        extra += &format!("{name} {value}\n");
                    }
                }
            }
            std::fs::write(
                &conf,
                format!(
                    "{extra}\
                     bind 127.0.0.1\n\
                     daemonize no\n\
                     dir {dir}\n\
                     sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
                     sentinel down-after-milliseconds {MASTER_NAME} {down_after}\n\
                     sentinel failover-timeout {MASTER_NAME} 2000\n\
                     sentinel parallel-syncs {MASTER_NAME} 1\n\
                     {auth}",
                    dir = dir.display(),
                    down_after = down_after.as_millis(),
                    auth = password
                        .map(|p| format!("sentinel auth-pass {MASTER_NAME} {p}\n"))
                        .unwrap_or_default(),
                ),
            )
            .expect("cannot write a sentinel config file");
            let child = Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "cannot run `redis-server --sentinel` ({e}). The Sentinel tests need \
                         it: install it (`apt-get install -y redis-server redis-tools`) or run \
                         `scripts/test.sh`, which does."
                    )
                });
            let mut sentinel = Self {
                child: Some(child),
                port,
                dir,
                tls: tls.cloned(),
            };
            if sentinel.wait_until_up() {
                return sentinel;
            }
            sentinel.kill();
        }
        panic!("redis-server --sentinel did not start on any of 5 free ports");
    }

    fn wait_until_up(&mut self) -> bool {
        let port = self.port;
        let access = self.access();
        wait_until_up(&mut self.child, "sentinel", port, || access.process_id())
    }

    fn access(&self) -> Access {
        Access {
            port: self.port,
            tls: self.tls.clone(),
            password: None,
        }
    }

    /// The port it listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/` (`rediss://` with TLS).
    pub fn url(&self) -> String {
        self.access().url()
    }

    /// `redis-cli -p <port> <args>` against this sentinel.
    pub fn cli(&self, args: &[&str]) -> String {
        self.access().cli(args)
    }

    /// One field of `SENTINEL MASTER mymaster` (redis-cli prints it as alternating lines).
    pub fn master_field(&self, field: &str) -> Option<String> {
        let text = self.cli(&["SENTINEL", "MASTER", MASTER_NAME]);
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        lines
            .chunks(2)
            .find(|pair| pair[0] == field)
            .and_then(|pair| pair.get(1))
            .map(|v| (*v).to_owned())
    }

    /// The master's port as this sentinel sees it now.
    pub fn master_port(&self) -> Option<u16> {
        let text = self.cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME]);
        text.lines().nth(1)?.trim().parse().ok()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        kill(&mut self.child);
    }
}

impl Drop for SentinelServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A master with one replica, watched by three sentinels.
#[derive(Debug)]
pub struct SentinelSetup {
    /// The master the sentinels monitor at the start (as [`MASTER_NAME`]).
    pub master: RedisServer,
    /// Its replica, which a failover promotes.
    pub replica: RedisServer,
    /// Three sentinels, quorum 2.
    pub sentinels: Vec<SentinelServer>,
}

impl SentinelSetup {
    /// Starts everything and waits until each sentinel knows the replica and the two other
    /// sentinels (what a failover needs), for at most 15 s. The sentinels fail over after the
    /// master has not answered for `down_after`.
    pub fn start(down_after: Duration) -> Self {
        Self::start_with(RedisServer::options(), down_after)
    }

    /// Like [`start`](Self::start), the master and its replica started with `options` (their
    /// TLS and password; the sentinels then speak TLS too, and know the password).
    pub fn start_with(options: ServerOptions, down_after: Duration) -> Self {
        let master = options.start();
        let replica = RedisServer::replica_of(&master);
        let sentinels: Vec<SentinelServer> = (0..3)
            .map(|_| {
                SentinelServer::start_with(
                    master.port(),
                    master.tls(),
                    master.password(),
                    down_after,
                )
            })
            .collect();
        let setup = Self {
            master,
            replica,
            sentinels,
        };
        let start = Instant::now();
        for sentinel in &setup.sentinels {
            loop {
                let ready = sentinel.master_field("num-other-sentinels").as_deref() == Some("2")
                    && sentinel.master_field("num-slaves").as_deref() == Some("1");
                if ready {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(15),
                    "sentinel on port {} never saw the replica and the other sentinels: {}",
                    sentinel.port(),
                    sentinel.cli(&["SENTINEL", "MASTER", MASTER_NAME])
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        setup
    }

    /// Every sentinel's URL.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(SentinelServer::url).collect()
    }

    /// Waits until every sentinel names `port` as the master, for at most `within`.
    pub fn wait_for_master(&self, port: u16, within: Duration) {
        let start = Instant::now();
        while !self.sentinels.iter().all(|s| s.master_port() == Some(port)) {
            assert!(
                start.elapsed() < within,
                "the sentinels never named port {port} as the master: {:?}",
                self.sentinels
                    .iter()
                    .map(SentinelServer::master_port)
                    .collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

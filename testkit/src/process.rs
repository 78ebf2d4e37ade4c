//! Process plumbing shared by every starter: readiness probes, scratch directories, a service
//! binary with its output captured, a guard for child processes, and the benchmark's check that
//! a tool is installed.
//!
//! Everything started here is SIGKILLed and reaped when its guard drops, panics included.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

/// The `process_id` that the server (or sentinel) on `127.0.0.1:port` reports in `INFO server`,
/// if one answers.
pub fn process_id(port: u16) -> Option<u32> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    stream.write_all(b"INFO server\r\n").ok()?;
    let mut reader = BufReader::new(stream);
    let mut header = String::new();
    reader.read_line(&mut header).ok()?;
    let len: usize = header.strip_prefix('$')?.trim_end().parse().ok()?;
    let mut body = vec![0; len];
    reader.read_exact(&mut body).ok()?;
    process_id_in(&String::from_utf8_lossy(&body))
}

/// The `process_id:` field of an `INFO` reply.
pub(crate) fn process_id_in(info: &str) -> Option<u32> {
    info.lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .and_then(|pid| pid.trim().parse().ok())
}

/// Waits up to 10 s until the server `child` runs answers on `port`, as itself: `process_id`
/// must give the child's pid. A port that was free a moment ago may have been taken since by a
/// server another test started (ports are picked, then bound by the server); then the child
/// exits, and a probe that only pinged would have handed the test that other server. `false`
/// (and the child forgotten) if the child exits first or does not answer in time.
pub fn wait_until_up(
    child: &mut Option<Child>,
    what: &str,
    port: u16,
    mut process_id: impl FnMut() -> Option<u32>,
) -> bool {
    let Some(pid) = child.as_ref().map(Child::id) else {
        return false;
    };
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if let Some(status) = child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            eprintln!("{what} on port {port} exited early: {status}");
            *child = None;
            return false;
        }
        match process_id() {
            Some(answering) if answering == pid => return true,
            Some(other) => {
                eprintln!("{what} on port {port}: another process ({other}) answers there");
                return false;
            }
            None => {}
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// SIGKILLs and reaps `child`, if any (a crash, as far as the process can tell).
pub fn kill(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

static NEXT_DIR: AtomicUsize = AtomicUsize::new(0);

/// A fresh, empty scratch directory for one process of this kit,
/// `<temp>/tower-lock-<kind>-<pid>-<n>`. Its owner removes it on drop.
pub(crate) fn scratch_dir(kind: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tower-lock-{kind}-{}-{}",
        std::process::id(),
        NEXT_DIR.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create a scratch dir {}: {e}", dir.display()));
    dir
}

/// The first line `name` prints for `args` (its version, say), or a clear message and exit
/// code 1 if it cannot be run: `apt-get install -y <package>` installs it.
///
/// For programs such as the benchmark, where a missing tool is the user's to fix before
/// anything starts; tests panic instead (see the crate docs).
pub fn require_tool(name: &str, args: &[&str], package: &str) -> String {
    match Command::new(name).args(args).output() {
        Ok(out) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            text.lines().next().unwrap_or("").trim().to_owned()
        }
        Err(e) => {
            eprintln!(
                "error: `{name}` is required by this benchmark but could not be run ({e}).\n\
                 Install it (Debian: `apt-get install -y {package}`) or run `scripts/bench.sh`, \
                 which installs it."
            );
            std::process::exit(1);
        }
    }
}

/// Child processes, SIGKILLed if still running when the guard drops, and reaped either way.
#[derive(Debug, Default)]
pub struct Children(pub Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

/// The most output kept per [`Process`].
const MAX_OUTPUT: usize = 1 << 20;

/// A service binary a test started, with everything it writes to stdout and stderr kept (up
/// to 1 MiB) to look for panics; SIGKILLed on drop.
#[derive(Debug)]
pub struct Process {
    child: Option<Child>,
    output: Arc<Mutex<String>>,
}

impl Process {
    /// Spawns `command` (stdin closed, stdout and stderr captured) and waits up to `within` for
    /// a line of its output containing `ready` (such as "listening on").
    ///
    /// `None` if it exits first, say because the port it was given was taken meanwhile: its
    /// output is printed to stderr, under `what`, and the caller may try another port. Panics
    /// if it cannot be spawned, or prints neither `ready` nor exits within `within`.
    pub fn start(mut command: Command, what: &str, ready: &str, within: Duration) -> Option<Self> {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        let output = Arc::new(Mutex::new(String::new()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let output = Arc::clone(&output);
            let ready_tx = ready_tx.clone();
            let ready = ready.to_owned();
            // Drains the pipe until the process exits, so it never blocks on a full pipe.
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    if line.contains(&ready) {
                        let _ = ready_tx.send(true);
                    }
                    let mut out = output.lock().unwrap();
                    if out.len() < MAX_OUTPUT {
                        out.push_str(&line);
                        out.push('\n');
                    }
                }
                let _ = ready_tx.send(false);
            });
        }
        drop(ready_tx);
        let mut process = Self {
            child: Some(child),
            output,
        };
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match ready_rx.recv_timeout(left) {
                Ok(true) => return Some(process),
                // One pipe closed: the process is exiting (a port race?); check the other.
                Ok(false) => {
                    if !process.is_running() {
                        break;
                    }
                }
                Err(_) => panic!(
                    "{what} did not print {ready:?} within {within:?}:\n{}",
                    process.output()
                ),
            }
        }
        eprintln!("{what} exited at start:\n{}", process.output());
        process.kill();
        None
    }

    /// Runs `command` (stdin closed) to its end, for at most `within` (then SIGKILLs it):
    /// its exit status (`None` if it had to be killed), everything it printed on stdout and
    /// stderr, and how long it ran. Panics if it cannot be spawned.
    pub fn run(mut command: Command, what: &str, within: Duration) -> Finished {
        let started = Instant::now();
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        let readers: Vec<_> = [
            Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ]
        .into_iter()
        .map(|mut stream| {
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = stream.read_to_string(&mut text);
                text
            })
        })
        .collect();
        let status = loop {
            if let Some(status) = child.try_wait().ok().flatten() {
                break Some(status);
            }
            if started.elapsed() > within {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let took = started.elapsed();
        let output = readers
            .into_iter()
            .map(|reader| reader.join().unwrap_or_default())
            .collect();
        Finished {
            status,
            output,
            took,
        }
    }

    /// `kill -9`: the process dies without cleaning anything up.
    pub fn kill(&mut self) {
        kill(&mut self.child);
    }

    /// Everything the process printed so far.
    pub fn output(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    /// The process's id, while it has not been killed.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends it `signal` (`STOP`, `CONT`, ...) with `kill`; panics if that fails.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid().expect("the process was killed");
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .unwrap_or_else(|e| panic!("cannot run kill -{signal}: {e}"));
        assert!(status.success(), "kill -{signal} {pid} failed");
    }

    /// Whether the process still runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }
}

/// How a process [`Process::run`] ran ended.
#[derive(Debug)]
pub struct Finished {
    /// Its exit status; `None` if it did not end in time and was killed.
    pub status: Option<std::process::ExitStatus>,
    /// Everything it printed, stdout then stderr.
    pub output: String,
    /// How long it ran.
    pub took: Duration,
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

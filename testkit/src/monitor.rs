//! Counting (or recording) the commands clients send to a server this kit started, with
//! `MONITOR`.
//!
//! `INFO commandstats` cannot tell a client's commands from a script's: Redis 7 counts the
//! commands a Lua script runs under their own names. `MONITOR` shows every command with its
//! source, `[0 127.0.0.1:50828]` for a client and `[0 lua]` for a script, so a [`Monitor`]
//! counts the lines from clients until it sees a marker (`ECHO <unique>`) that it sends itself
//! when asked to finish. `MONITOR` costs the server some CPU per command.

use std::{
    collections::BTreeMap,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use redis::aio::MultiplexedConnection;
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    task::JoinHandle,
};

/// Client-issued commands by name (upper case).
#[derive(Debug, Default, Clone)]
pub struct CommandCounts(BTreeMap<String, u64>);

impl CommandCounts {
    /// Every command counted.
    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// How many times `name` (upper case) was sent.
    pub fn get(&self, name: &str) -> u64 {
        self.0.get(name).copied().unwrap_or(0)
    }

    /// Every command counted, by name (upper case), with its count.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u64)> {
        self.0.iter().map(|(name, n)| (name.as_str(), *n))
    }

    /// Each command's count divided by `ops`, by name: `EVALSHA 2.00, SET 1.00`, or `none`.
    pub fn per(&self, ops: f64) -> String {
        if self.0.is_empty() {
            return "none".to_owned();
        }
        self.0
            .iter()
            .map(|(name, n)| format!("{name} {:.2}", *n as f64 / ops))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What a [`Monitor`] saw before its marker.
#[derive(Debug, Default)]
struct Seen {
    counts: CommandCounts,
    /// Every client command with its arguments, when recording.
    commands: Option<Vec<Vec<String>>>,
}

/// A `MONITOR` connection counting every command a client sends, and none that a script runs,
/// until it sees its marker (sent by [`finish`](Self::finish)).
#[derive(Debug)]
pub struct Monitor {
    reader: JoinHandle<std::io::Result<Seen>>,
    marker: String,
}

static NEXT_MARKER: AtomicU64 = AtomicU64::new(0);

impl Monitor {
    /// Starts counting the commands clients send to `127.0.0.1:port`.
    pub async fn start(port: u16) -> Self {
        Self::open(port, false).await
    }

    /// Like [`start`](Self::start), and also keeps every client command with its arguments,
    /// for [`finish_recorded`](Self::finish_recorded). Costs more per command: for checks, not
    /// for timed windows.
    pub async fn start_recording(port: u16) -> Self {
        Self::open(port, true).await
    }

    async fn open(port: u16, record: bool) -> Self {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect MONITOR");
        stream.write_all(b"MONITOR\r\n").await.expect("MONITOR");
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        reader.read_until(b'\n', &mut line).await.expect("MONITOR");
        assert!(line.starts_with(b"+OK"), "MONITOR answered {line:?}");
        let marker = format!(
            "tower-lock-monitor-marker-{}-{}",
            std::process::id(),
            NEXT_MARKER.fetch_add(1, Ordering::Relaxed)
        );
        let needle = marker.clone();
        let reader = tokio::spawn(async move {
            let mut seen = Seen {
                commands: record.then(Vec::new),
                ..Seen::default()
            };
            let mut line = Vec::with_capacity(512);
            loop {
                line.clear();
                if reader.read_until(b'\n', &mut line).await? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                let text = String::from_utf8_lossy(&line);
                if text.contains(&needle) {
                    return Ok(seen);
                }
                if let Some(name) = client_command(&text) {
                    *seen.counts.0.entry(name).or_insert(0) += 1;
                    if let Some(commands) = seen.commands.as_mut() {
                        commands.push(arguments(&text));
                    }
                }
            }
        });
        Self { reader, marker }
    }

    /// Sends the marker on `ctl` (any other connection to the same server) and returns what
    /// clients sent before it.
    pub async fn finish(self, ctl: &mut MultiplexedConnection) -> CommandCounts {
        self.seen(ctl).await.counts
    }

    /// Like [`finish`](Self::finish), for a monitor started with
    /// [`start_recording`](Self::start_recording): every client command before the marker, in
    /// order, as its arguments (the command's name first, as sent).
    pub async fn finish_recorded(self, ctl: &mut MultiplexedConnection) -> Vec<Vec<String>> {
        self.seen(ctl)
            .await
            .commands
            .expect("a monitor started with `start_recording`")
    }

    async fn seen(self, ctl: &mut MultiplexedConnection) -> Seen {
        let _: String = redis::cmd("ECHO")
            .arg(&self.marker)
            .query_async(ctl)
            .await
            .expect("ECHO marker");
        tokio::time::timeout(Duration::from_secs(60), self.reader)
            .await
            .expect("the MONITOR reader did not reach its marker in 60 s")
            .expect("MONITOR reader panicked")
            .expect("MONITOR stream failed")
    }
}

/// `+1700000000.123456 [0 127.0.0.1:50828] "SET" "b" "1"`: the command's name, unless a script
/// ran it (`[0 lua]`).
fn client_command(line: &str) -> Option<String> {
    let open = line.find('[')?;
    let close = open + line[open..].find(']')?;
    let client = line[open + 1..close].split_whitespace().nth(1)?;
    if client == "lua" {
        return None;
    }
    let rest = line[close + 1..].trim_start().strip_prefix('"')?;
    Some(rest[..rest.find('"')?].to_ascii_uppercase())
}

/// The quoted arguments of a `MONITOR` line, unescaped (`\"`, `\\`, `\n`, `\r`, `\t`, `\xHH`).
fn arguments(line: &str) -> Vec<String> {
    let Some(close) = line.find(']') else {
        return Vec::new();
    };
    let mut args = Vec::new();
    let mut chars = line[close + 1..].chars();
    while let Some(c) = chars.next() {
        if c != '"' {
            continue;
        }
        let mut arg = String::new();
        while let Some(c) = chars.next() {
            match c {
                '"' => break,
                '\\' => match chars.next() {
                    Some('n') => arg.push('\n'),
                    Some('r') => arg.push('\r'),
                    Some('t') => arg.push('\t'),
                    Some('x') => {
                        let hex: String = chars.by_ref().take(2).collect();
                        arg.push(char::from(u8::from_str_radix(&hex, 16).unwrap_or(b'?')));
                    }
                    Some(other) => arg.push(other),
                    None => {}
                },
                c => arg.push(c),
            }
        }
        args.push(arg);
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_client_commands_and_skips_scripts() {
        let client = "+1700000000.123456 [0 127.0.0.1:50828] \"set\" \"b\" \"1\"\r\n";
        let script = "+1700000000.123456 [0 lua] \"SET\" \"b\" \"1\"\r\n";
        assert_eq!(client_command(client).as_deref(), Some("SET"));
        assert_eq!(client_command(script), None);
        assert_eq!(arguments(client), ["set", "b", "1"]);
    }

    #[test]
    fn unescapes_arguments() {
        let line = r#"+1.0 [0 127.0.0.1:1] "ECHO" "a \"q\" \\ \x01" "" "tower-lock:{k}""#;
        assert_eq!(
            arguments(line),
            ["ECHO", "a \"q\" \\ \u{1}", "", "tower-lock:{k}"]
        );
    }
}

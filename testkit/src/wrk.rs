//! One `wrk` run against a server on loopback, parsed: requests per second, errors and (with
//! [`Wrk::run_with_latency`]) the latency percentiles.
//!
//! Check that `wrk` is installed first, with [`require_tool`](crate::process::require_tool).

use std::{
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

/// wrk's shape: threads and open connections.
#[derive(Debug, Clone, Copy)]
pub struct Wrk {
    /// `-t`.
    pub threads: u32,
    /// `-c`.
    pub connections: u32,
}

/// What one wrk run measured.
#[derive(Debug, Clone, Copy)]
pub struct WrkOut {
    /// `Requests/sec`.
    pub rps: f64,
    /// Non-2xx answers plus socket errors.
    pub errors: u64,
    /// The median latency, when asked for (`--latency`).
    pub p50: Option<Duration>,
    /// The 99th percentile latency, when asked for (`--latency`).
    pub p99: Option<Duration>,
}

impl Wrk {
    /// Runs wrk for `secs` against `http://127.0.0.1:<port>/` with the Lua `script` (which
    /// shapes the requests), a 5 s request timeout, and parses its report. Panics if wrk fails.
    pub fn run(&self, port: u16, secs: u64, script: &Path) -> WrkOut {
        self.run_inner(port, secs, script, false)
    }

    /// [`run`](Self::run) with wrk's latency distribution (`--latency`): `p50` and `p99` set.
    pub fn run_with_latency(&self, port: u16, secs: u64, script: &Path) -> WrkOut {
        self.run_inner(port, secs, script, true)
    }

    fn run_inner(&self, port: u16, secs: u64, script: &Path, latency: bool) -> WrkOut {
        let mut wrk = Command::new("wrk");
        if latency {
            wrk.arg("--latency");
        }
        let out = wrk
            .arg(format!("-t{}", self.threads))
            .arg(format!("-c{}", self.connections))
            .arg(format!("-d{secs}s"))
            .args(["--timeout", "5s", "-s"])
            .arg(script)
            .arg(format!("http://127.0.0.1:{port}/"))
            .stdin(Stdio::null())
            .output()
            .expect("cannot run wrk");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "wrk failed: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        parse(&text)
    }
}

/// A latency as wrk prints it: `812.00us`, `1.23ms`, `2.00s`.
fn duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else {
        return None;
    };
    let value: f64 = number.trim().parse().ok()?;
    Some(Duration::from_secs_f64(value * scale))
}

fn parse(text: &str) -> WrkOut {
    let mut rps = None;
    let mut errors = 0;
    let (mut p50, mut p99) = (None, None);
    for line in text.lines() {
        let line = line.trim();
        if let Some(v) = line.strip_prefix("50%") {
            p50 = duration(v);
        } else if let Some(v) = line.strip_prefix("99%") {
            p99 = duration(v);
        } else if let Some(v) = line.strip_prefix("Requests/sec:") {
            rps = v.trim().parse().ok();
        } else if let Some(v) = line.strip_prefix("Non-2xx or 3xx responses:") {
            errors += v.trim().parse::<u64>().unwrap_or(0);
        } else if let Some(v) = line.strip_prefix("Socket errors:") {
            errors += v
                .split(',')
                .filter_map(|part| part.split_whitespace().last()?.parse::<u64>().ok())
                .sum::<u64>();
        }
    }
    WrkOut {
        rps: rps.unwrap_or_else(|| panic!("no Requests/sec in wrk's output:\n{text}")),
        errors,
        p50,
        p99,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_report() {
        let report = "Running 1s test @ http://127.0.0.1:1/\n  \
                      2 threads and 50 connections\n  \
                      Socket errors: connect 0, read 2, write 0, timeout 3\n  \
                      Non-2xx or 3xx responses: 7\n\
                      Requests/sec:  41234.56\n\
                      Transfer/sec:      4.00MB\n";
        let out = parse(report);
        assert_eq!(out.rps, 41234.56);
        assert_eq!(out.errors, 12);
        assert_eq!(out.p50, None);
    }

    #[test]
    fn parses_the_latency_distribution() {
        let report = "  Latency Distribution\n     50%  812.00us\n     75%    1.02ms\n     \
                      90%    1.50ms\n     99%    3.25ms\nRequests/sec:  1000.00\n";
        let out = parse(report);
        assert_eq!(out.p50, Some(Duration::from_micros(812)));
        assert_eq!(out.p99, Some(Duration::from_micros(3250)));
    }
}

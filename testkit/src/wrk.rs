//! One `wrk` run against a server on loopback, parsed: requests per second and errors.
//!
//! Check that `wrk` is installed first, with [`require_tool`](crate::process::require_tool).

use std::{
    path::Path,
    process::{Command, Stdio},
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
}

impl Wrk {
    /// Runs wrk for `secs` against `http://127.0.0.1:<port>/` with the Lua `script` (which
    /// shapes the requests), a 5 s request timeout, and parses its report. Panics if wrk fails.
    pub fn run(&self, port: u16, secs: u64, script: &Path) -> WrkOut {
        let out = Command::new("wrk")
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

fn parse(text: &str) -> WrkOut {
    let mut rps = None;
    let mut errors = 0;
    for line in text.lines() {
        let line = line.trim();
        if let Some(v) = line.strip_prefix("Requests/sec:") {
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
    }
}

//! The machine and the versions the report names: CPU, memory, kernel, load, tool and crate
//! versions, the git revision.

use std::{collections::BTreeMap, path::Path, process::Command};

pub(crate) fn command_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_owned()
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

pub(crate) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

pub(crate) fn memory_total() -> String {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let kb: f64 = s
                .lines()
                .find(|l| l.starts_with("MemTotal:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some(format!("{:.1} GiB", kb / (1024.0 * 1024.0)))
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// Versions of `names` in the crate's `Cargo.lock`.
pub(crate) fn locked_versions(names: &[&str]) -> Vec<(String, String)> {
    let lock = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.lock"))
        .unwrap_or_default();
    let mut found: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut name = None;
    for line in lock.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = Some(n.trim_matches('"').to_owned());
        } else if let (Some(v), Some(n)) = (line.strip_prefix("version = "), name.take())
            && names.contains(&n.as_str())
        {
            found
                .entry(n)
                .or_default()
                .push(v.trim_matches('"').to_owned());
        }
    }
    names
        .iter()
        .map(|n| {
            let v = found
                .get(*n)
                .map(|v| v.join(", "))
                .unwrap_or_else(|| "not in Cargo.lock".to_owned());
            ((*n).to_owned(), v)
        })
        .collect()
}

pub(crate) fn git_revision() -> String {
    let dir = env!("CARGO_MANIFEST_DIR");
    let head = command_line("git", &["-C", dir, "rev-parse", "--short", "HEAD"]);
    // The benchmark's own outputs (the report, the counts' profiles, kept in the repository)
    // are not changes to what it measures.
    let dirty = Command::new("git")
        .args([
            "-C",
            dir,
            "status",
            "--porcelain",
            "--",
            ":(top)",
            ":(top,exclude)docs/BENCHMARKS.md",
            ":(top,exclude)suite/target",
        ])
        .output()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    if dirty {
        format!("{head}, with uncommitted changes")
    } else {
        head
    }
}

//! Reading what valgrind's callgrind and `strace -c` wrote, for scenario h: a run's total
//! instructions, its instructions by function (inclusive and self, from `callgrind_annotate`),
//! and its system calls by name.

use std::{collections::BTreeMap, path::Path, process::Command};

/// Instructions by name (a function, a crate, a system call), as counted in one run, or per
/// operation once two runs are subtracted.
pub(crate) type ByName = BTreeMap<String, f64>;

/// The total instructions of a callgrind output file (its `summary:` line).
pub(crate) fn total_instructions(file: &Path) -> f64 {
    let text =
        std::fs::read_to_string(file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
    text.lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no summary line in {}", file.display()))
}

/// Instructions by function in a callgrind output file, inclusive (a function and everything it
/// called) or self, as `callgrind_annotate` reports them (every function, no threshold).
pub(crate) fn by_function(file: &Path, inclusive: bool) -> ByName {
    let out = Command::new("callgrind_annotate")
        .arg(format!(
            "--inclusive={}",
            if inclusive { "yes" } else { "no" }
        ))
        .arg("--threshold=100")
        .arg(file)
        .output()
        .expect("run callgrind_annotate (it comes with valgrind)");
    assert!(
        out.status.success(),
        "callgrind_annotate {} failed: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut functions = ByName::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some((ir, name)) = function_line(line) {
            *functions.entry(name).or_default() += ir;
        }
    }
    functions
}

/// `1,234,567 (12.34%)  ???:tower_lock::engine::acquire::acquire [/path/to/binary]`: the count
/// and the function's name (without its file and object); `None` for any other line.
fn function_line(line: &str) -> Option<(f64, String)> {
    let line = line.trim_start();
    let (count, rest) = line.split_once(' ')?;
    let ir: f64 = count.replace(',', "").parse().ok()?;
    let rest = rest.trim_start();
    // The percentage column, when there is one.
    let rest = match rest.strip_prefix('(') {
        Some(after) => after.split_once(')')?.1.trim_start(),
        None => rest,
    };
    // `file:function [object]`: the file ends at the first single colon.
    let bytes = rest.as_bytes();
    let colon = (0..bytes.len()).find(|&i| {
        bytes[i] == b':' && bytes.get(i + 1) != Some(&b':') && (i == 0 || bytes[i - 1] != b':')
    })?;
    let function = &rest[colon + 1..];
    let function = match function.rfind(" [") {
        Some(at) if function.ends_with(']') => &function[..at],
        _ => function,
    };
    (!function.is_empty()).then(|| (ir, function.trim().to_owned()))
}

/// Where a function's own instructions are counted: its crate (generic code of `core`, `alloc`
/// and `std` counts to the first other crate its name mentions, whose type it was made for),
/// or the C library's allocator, copies and the rest.
pub(crate) fn bucket(function: &str) -> String {
    const ALLOCATOR: [&str; 12] = [
        "malloc",
        "free",
        "realloc",
        "calloc",
        "cfree",
        "_int_malloc",
        "_int_free",
        "_int_realloc",
        "malloc_consolidate",
        "unlink_chunk",
        "tcache_init",
        "__libc_malloc",
    ];
    let plain = function.split('(').next().unwrap_or(function).trim();
    if ALLOCATOR.contains(&plain) || plain.starts_with("_int_free") {
        return "(libc: malloc, free)".to_owned();
    }
    if plain.starts_with("__mem") || plain.starts_with("mem") || plain.contains("memcpy") {
        return "(libc: memcpy, memset, memcmp)".to_owned();
    }
    // The first segment of every path in the name: `core` in `core::ptr::drop_in_place<..>`,
    // `tower_lock` in its type argument.
    let bytes = function.as_bytes();
    let mut roots = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts = bytes[i].is_ascii_lowercase() || bytes[i] == b'_';
        let after_path = i >= 1 && bytes[i - 1] == b':';
        let inside_word = i >= 1 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if starts && !after_path && !inside_word {
            let end = (i..bytes.len())
                .find(|&j| !(bytes[j].is_ascii_alphanumeric() || bytes[j] == b'_'))
                .unwrap_or(bytes.len());
            if function[end..].starts_with("::") {
                roots.push(&function[i..end]);
            }
            i = end;
        } else {
            i += 1;
        }
    }
    let standard = |c: &&str| matches!(*c, "core" | "alloc" | "std");
    match roots.iter().find(|c| !standard(c)).or(roots.first()) {
        Some(name) => (*name).to_owned(),
        None => "(libc and the kernel interface: syscall wrappers, locks, the rest)".to_owned(),
    }
}

/// Self instructions summed by [`bucket`].
pub(crate) fn by_bucket(self_costs: &ByName) -> ByName {
    let mut buckets = ByName::new();
    for (function, ir) in self_costs {
        *buckets.entry(bucket(function)).or_default() += ir;
    }
    buckets
}

/// System calls by name from `strace -c -U name,calls -o <file>`.
pub(crate) fn syscalls(file: &Path) -> ByName {
    let text =
        std::fs::read_to_string(file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
    let mut calls = ByName::new();
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        let (Some(name), Some(n), None) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if name == "total" {
            continue;
        }
        if let Ok(n) = n.parse::<f64>() {
            *calls.entry(name.to_owned()).or_default() += n;
        }
    }
    calls
}

/// `(long - short) / ops` for every name in either.
pub(crate) fn per_op(long: &ByName, short: &ByName, ops: f64) -> ByName {
    let mut out = ByName::new();
    for name in long.keys().chain(short.keys()) {
        let l = long.get(name).copied().unwrap_or(0.0);
        let s = short.get(name).copied().unwrap_or(0.0);
        out.insert(name.clone(), (l - s) / ops);
    }
    out
}

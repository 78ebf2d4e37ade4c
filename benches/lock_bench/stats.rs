//! Figures across runs: the median, its range, and the number formats of the report.

pub(crate) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `median (min–max)`, or just the value for a single run.
pub(crate) fn stat(values: &[f64], fmt: impl Fn(f64) -> String) -> String {
    if values.is_empty() {
        return "–".to_owned();
    }
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if values.len() == 1 || (max - min).abs() < f64::EPSILON {
        fmt(median(values))
    } else {
        format!("{} ({}–{})", fmt(median(values)), fmt(min), fmt(max))
    }
}

pub(crate) fn f0(x: f64) -> String {
    format!("{x:.0}")
}

pub(crate) fn f1(x: f64) -> String {
    format!("{x:.1}")
}

pub(crate) fn f2(x: f64) -> String {
    format!("{x:.2}")
}

pub(crate) fn mib(x: f64) -> String {
    format!("{:.1} MiB", x / (1024.0 * 1024.0))
}

pub(crate) fn kib(x: f64) -> String {
    format!("{:.0} KiB", x / 1024.0)
}

pub(crate) fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "**not met**" }
}

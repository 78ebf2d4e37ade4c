//! What operators look at, against what the crate emits: the Grafana dashboard
//! (`ops/grafana/tower-lock.json`), the Prometheus alerting rules
//! (`ops/prometheus/tower-lock.rules.yml`) and the metrics table of `docs/OBSERVABILITY.md`.
//!
//! A real `examples/inventory.rs` process (built with the `metrics` feature) on a real
//! `redis-server` is driven through every path a metric counts (a purchase renewed while it
//! works, a 409, a lease deleted behind its holder, Redis killed under a holder, then an acquire
//! it cannot answer), and its `GET /metrics` is scraped. Every metric a query of the dashboard or
//! the alerts names must be there, with every label its matchers and `by (...)` clauses name,
//! and every value its `=` and `=~` matchers name; the documented table must be exactly what was
//! scraped: names, kinds, labels.
#![cfg(feature = "metrics")]

use crate::instances;
use crate::support;

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use instances::{Instance, set_stock};
use support::LockKeys;
use tower_lock_testkit::{RedisServer, http::Http};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// Labels Prometheus adds to every series it scrapes (the target's), not the crate's.
const TARGET_LABELS: [&str; 2] = ["job", "instance"];

// ---- The scrape. ---------------------------------------------------------------------------

/// One exported metric family: its kind (`# TYPE`), and each series' labels.
#[derive(Debug, Default)]
struct Family {
    kind: String,
    series: Vec<BTreeMap<String, String>>,
}

impl Family {
    fn label_names(&self) -> BTreeSet<String> {
        self.series.iter().flat_map(|s| s.keys().cloned()).collect()
    }

    fn has_value(&self, label: &str, value: &str) -> bool {
        self.series
            .iter()
            .any(|s| s.get(label).is_some_and(|v| v == value))
    }
}

/// The Prometheus text format, by family (a histogram's `_bucket`, `_sum` and `_count` lines
/// under its own name, without their `le`).
fn parse_exposition(text: &str) -> BTreeMap<String, Family> {
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE <name> <kind>");
            families.entry(name.to_owned()).or_default().kind = kind.to_owned();
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).expect("a sample line");
        let name = &line[..name_end];
        let labels = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end + 1..]).0
        } else {
            BTreeMap::new()
        };
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| name.strip_suffix(suffix))
            .find(|base| families.get(*base).is_some_and(|f| f.kind == "histogram"))
            .unwrap_or(name)
            .to_owned();
        // A histogram's `le` is the bucket's, not a label of the metric.
        let mut labels = labels;
        labels.remove("le");
        families.entry(family).or_default().series.push(labels);
    }
    families
}

/// `name="value",...}` (after the `{`): the labels, and the rest after the `}`. Values are
/// double-quoted with `\"`, `\\` and `\n` escapes, and may hold braces and commas.
fn parse_labels(mut s: &str) -> (BTreeMap<String, String>, &str) {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start_matches([',', ' ']);
        if let Some(rest) = s.strip_prefix('}') {
            return (labels, rest);
        }
        let eq = s.find(['=', '!']).expect("a label matcher");
        let name = s[..eq].trim().to_owned();
        let quote = s[eq..].find('"').expect("a quoted value") + eq;
        let mut value = String::new();
        let mut chars = s[quote + 1..].char_indices();
        let end = loop {
            match chars.next().expect("a closing quote") {
                (_, '\\') => match chars.next().expect("an escape").1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (i, '"') => break quote + 1 + i + 1,
                (_, c) => value.push(c),
            }
        };
        labels.insert(name, value);
        s = &s[end..];
    }
}

// ---- The queries. --------------------------------------------------------------------------

/// One selector's matchers: (label, operator, value).
type Matchers = Vec<(String, String, String)>;

/// What one PromQL expression asks of the crate's metrics.
#[derive(Debug, Default)]
struct Query {
    /// Each selector: the metric's family, whether it reads `_bucket` (so `le` is a label),
    /// and its matchers (label, operator, value).
    selectors: Vec<(String, bool, Matchers)>,
    /// Labels named in `by (...)` clauses.
    grouping: BTreeSet<String>,
}

fn parse_promql(expr: &str) -> Query {
    let mut query = Query::default();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i] as char;
        if c == '"' {
            // A string outside a selector (none in these files, but skip it whole).
            i += 1 + expr[i + 1..].find('"').expect("a closing quote") + 1;
            continue;
        }
        if !(c.is_ascii_alphabetic() || c == '_') {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            i += 1;
        }
        let word = &expr[start..i];
        let rest = expr[i..].trim_start();
        if word == "by" || word == "without" {
            let inner = rest.strip_prefix('(').expect("by (...)");
            let close = inner.find(')').expect("by (...)");
            query.grouping.extend(
                inner[..close]
                    .split(',')
                    .map(|l| l.trim().to_owned())
                    .filter(|l| !l.is_empty()),
            );
            continue;
        }
        if !word.starts_with("tower_lock_") {
            continue;
        }
        let (family, bucket) = match word.strip_suffix("_bucket") {
            Some(base) => (base, true),
            None => (
                word.strip_suffix("_sum")
                    .or_else(|| word.strip_suffix("_count"))
                    .unwrap_or(word),
                false,
            ),
        };
        let mut matchers = Vec::new();
        if let Some(inner) = rest.strip_prefix('{') {
            let close = inner.find('}').expect("a closing brace");
            for matcher in inner[..close].split(',').filter(|m| !m.trim().is_empty()) {
                let op_at = matcher.find(['=', '!']).expect("a matcher operator");
                let value_at = matcher.find('"').expect("a quoted matcher value");
                let label = matcher[..op_at].trim().to_owned();
                let op = matcher[op_at..value_at].trim().to_owned();
                let value = matcher[value_at..].trim().trim_matches('"').to_owned();
                matchers.push((label, op, value));
            }
        }
        query.selectors.push((family.to_owned(), bucket, matchers));
    }
    query
}

/// Every query of the dashboard (its panels' targets and its variables), with where it is.
fn dashboard_queries() -> Vec<(String, String)> {
    let path = format!("{ROOT}/ops/grafana/tower-lock.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard's JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a target's expr");
            queries.push((format!("panel {:?}", panel["title"]), expr.to_owned()));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if let Some(query) = variable["definition"].as_str() {
            queries.push((format!("variable {:?}", variable["name"]), query.to_owned()));
        }
    }
    queries
}

/// Every alert's `expr` (a plain one-line value, or a folded `>-` block).
fn alert_queries() -> Vec<(String, String)> {
    let path = format!("{ROOT}/ops/prometheus/tower-lock.rules.yml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut queries = Vec::new();
    let mut alert = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if let Some(name) = trimmed.strip_prefix("- alert:") {
            alert = name.trim().to_owned();
        } else if let Some(value) = trimmed.strip_prefix("expr:") {
            let indent = line.len() - trimmed.len();
            let value = value.trim();
            let expr = if value == ">-" || value == "|" {
                let mut block = Vec::new();
                while let Some(next) = lines.peek() {
                    let next_indent = next.len() - next.trim_start().len();
                    if next.trim().is_empty() || next_indent <= indent {
                        break;
                    }
                    block.push(next.trim());
                    lines.next();
                }
                block.join(" ")
            } else {
                value.to_owned()
            };
            queries.push((format!("alert {alert}"), expr));
        }
    }
    queries
}

/// What `docs/OBSERVABILITY.md`'s metrics table lists: name, kind, label names.
fn documented_metrics() -> BTreeMap<String, (String, BTreeSet<String>)> {
    let doc = std::fs::read_to_string(format!("{ROOT}/docs/OBSERVABILITY.md")).unwrap();
    let table = doc
        .split_once("| metric | kind | labels | meaning |")
        .expect("docs/OBSERVABILITY.md has the metrics table")
        .1;
    table
        .lines()
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .map(|row| {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`').to_owned();
            // Label names are the backticked words not inside parentheses (which hold values).
            let mut labels = BTreeSet::new();
            let mut depth = 0;
            for (i, part) in cells[3].split('`').enumerate() {
                if i % 2 == 1 && depth == 0 {
                    labels.insert(part.to_owned());
                } else if i % 2 == 0 {
                    depth += part.matches('(').count();
                    depth -= part.matches(')').count();
                }
            }
            (name, (cells[2].to_owned(), labels))
        })
        .collect()
}

// ---- Driving the example. ------------------------------------------------------------------

async fn purchase(port: u16, sku: &str, work_ms: u64) -> u16 {
    Http::new(port)
        .request(
            "POST",
            &format!("/items/{sku}/purchase?work_ms={work_ms}"),
            None,
        )
        .await
        .expect("a purchase")
        .status
}

/// Waits until the one lock key of the running purchase is in Redis, and answers it.
async fn held_key(server: &RedisServer) -> Vec<u8> {
    let started = Instant::now();
    loop {
        let mut keys = server.lock_keys().await;
        keys.retain(|k| support::is_lock_key(k));
        if let Some(key) = keys.pop() {
            return key;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "no key held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `key`'s holder renewed it (its time to live went up), and so has its lease.
async fn renewed(server: &RedisServer, key: &[u8]) {
    let mut conn = server.client().await;
    let started = Instant::now();
    let mut least = i64::MAX;
    loop {
        let pttl: i64 = redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .expect("PTTL");
        assert!(
            pttl > 0,
            "the lease ended before it was renewed: PTTL {pttl}"
        );
        if pttl > least.saturating_add(20) {
            return;
        }
        least = least.min(pttl);
        assert!(started.elapsed() < Duration::from_secs(10), "no renewal");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every path a metric counts, through one instance; its `GET /metrics` afterwards.
async fn scrape_after_every_path() -> String {
    let mut server = RedisServer::start();
    // Renewed every 100 ms; no waiting for a held key.
    let instance = Instance::start(
        &server.url(),
        &[("LOCK_TTL_MS", "300"), ("LOCK_WAIT_MS", "0")],
    );
    let port = instance.port;
    set_stock(port, "apple", 100).await;
    set_stock(port, "cherry", 100).await;

    // Acquired, renewed, released; and a second purchase at the same time is contended.
    // Held long enough to be seen however slowly this test is scheduled.
    let worker = tokio::spawn(purchase(port, "apple", 1500));
    held_key(&server).await;
    assert_eq!(purchase(port, "apple", 0).await, 409);
    assert_eq!(worker.await.unwrap(), 200);

    // A lease deleted behind its holder: the renewal finds it gone (not_held), 503.
    let worker = tokio::spawn(purchase(port, "apple", 2000));
    let key = held_key(&server).await;
    support::delete_key(&server, &key).await;
    assert_eq!(worker.await.unwrap(), 503);

    // Redis killed under a holder: renewals fail until the lease runs out (expired, 503), its
    // release fails; then an acquire fails (503), on another key (this process still queues
    // `cherry` behind the release it keeps trying). On a key of its own: `apple`'s previous
    // holder, whose lease was deleted, may still be letting go of it in this process.
    let worker = tokio::spawn(purchase(port, "cherry", 2000));
    let key = held_key(&server).await;
    // Killed once the holder renewed, so it surely holds the lease: killed as soon as the key
    // is seen, the acquire's answer may be lost with Redis, and then nothing was held to fail
    // to release.
    renewed(&server, &key).await;
    server.kill();
    assert_eq!(worker.await.unwrap(), 503);
    assert_eq!(purchase(port, "banana", 0).await, 503);

    // The holder of `cherry` answered at once and its release was spawned: its failure is
    // recorded when the store gives up on it (within the store timeout).
    let started = std::time::Instant::now();
    loop {
        let reply = Http::new(port)
            .request("GET", "/metrics", None)
            .await
            .expect("GET /metrics");
        assert_eq!(reply.status, 200);
        let text = String::from_utf8(reply.body).unwrap();
        let recorded = text.contains("tower_lock_release_errors_total");
        if recorded || started.elapsed().as_secs() >= 10 {
            instance.assert_no_panic();
            if !recorded {
                eprintln!(
                    "no release failure recorded; the instance printed:\n{}",
                    instance.output()
                );
            }
            return text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboards_alerts_and_docs_name_what_the_crate_emits() {
    let scraped = parse_exposition(&scrape_after_every_path().await);
    let ours: BTreeMap<&String, &Family> = scraped
        .iter()
        .filter(|(name, _)| name.starts_with("tower_lock_"))
        .collect();
    let mut problems = Vec::new();

    let queries: Vec<(String, String)> = dashboard_queries()
        .into_iter()
        .chain(alert_queries())
        .collect();
    assert!(queries.len() > 20, "too few queries found: {queries:?}");
    for (place, expr) in &queries {
        let query = parse_promql(expr);
        if query.selectors.is_empty() {
            problems.push(format!("{place}: no tower_lock_ metric in {expr}"));
        }
        let mut labels: BTreeSet<String> = TARGET_LABELS.map(str::to_owned).into();
        for (family, bucket, matchers) in &query.selectors {
            let Some(found) = ours.get(family) else {
                problems.push(format!("{place}: {family} is not emitted"));
                continue;
            };
            let mut names = found.label_names();
            if *bucket {
                if found.kind != "histogram" {
                    problems.push(format!(
                        "{place}: {family} is a {}, not a histogram",
                        found.kind
                    ));
                }
                names.insert("le".to_owned());
            }
            labels.extend(names.iter().cloned());
            for (label, op, value) in matchers {
                if TARGET_LABELS.contains(&label.as_str()) {
                    continue;
                }
                if !names.contains(label) {
                    problems.push(format!("{place}: {family} has no label {label}"));
                    continue;
                }
                let values: Vec<&str> = match op.as_str() {
                    "=" => vec![value.as_str()],
                    "=~" if !value.contains('$') && !value.contains(".*") => {
                        value.split('|').collect()
                    }
                    _ => Vec::new(),
                };
                for value in values {
                    if !found.has_value(label, value) {
                        problems.push(format!("{place}: {family} never has {label}=\"{value}\""));
                    }
                }
            }
        }
        for label in &query.grouping {
            if !labels.contains(label) {
                problems.push(format!("{place}: groups by {label}, which no metric has"));
            }
        }
    }

    let documented = documented_metrics();
    for (name, (kind, labels)) in &documented {
        match ours.get(name) {
            None => problems.push(format!("OBSERVABILITY.md: {name} is not emitted")),
            Some(found) => {
                if &found.kind != kind {
                    problems.push(format!(
                        "OBSERVABILITY.md: {name} is a {}, documented as a {kind}",
                        found.kind
                    ));
                }
                if &found.label_names() != labels {
                    problems.push(format!(
                        "OBSERVABILITY.md: {name} has labels {:?}, documented {labels:?}",
                        found.label_names()
                    ));
                }
            }
        }
    }
    for name in ours.keys() {
        if !documented.contains_key(*name) {
            problems.push(format!("OBSERVABILITY.md does not list {name}"));
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn the_parsers_read_what_they_check() {
    let families = parse_exposition(
        "# TYPE tower_lock_wait_seconds histogram\n\
         tower_lock_wait_seconds_bucket{scope=\"POST /a/{id},x\",outcome=\"acquired\",le=\"0.5\"} 1\n\
         tower_lock_wait_seconds_sum{scope=\"POST /a/{id},x\",outcome=\"acquired\"} 0.1\n\
         # TYPE tower_lock_acquired_total counter\n\
         tower_lock_acquired_total{scope=\"say \\\"hi\\\"\"} 3\n",
    );
    let wait = &families["tower_lock_wait_seconds"];
    assert_eq!(wait.kind, "histogram");
    assert!(wait.has_value("scope", "POST /a/{id},x"));
    assert!(!wait.label_names().contains("le"));
    assert!(families["tower_lock_acquired_total"].has_value("scope", "say \"hi\""));

    let query = parse_promql(
        "histogram_quantile(0.99, sum by (le, scope) (rate(tower_lock_wait_seconds_bucket\
         {job=~\"$job\", outcome=\"acquired\"}[5m]))) / sum(tower_lock_leases_held)",
    );
    assert_eq!(query.selectors.len(), 2);
    assert_eq!(query.selectors[0].0, "tower_lock_wait_seconds");
    assert!(query.selectors[0].1);
    assert_eq!(
        query.selectors[0].2[1],
        ("outcome".into(), "=".into(), "acquired".into())
    );
    assert_eq!(
        query.grouping,
        BTreeSet::from(["le".into(), "scope".into()])
    );
    assert!(alert_queries().len() >= 5);
}

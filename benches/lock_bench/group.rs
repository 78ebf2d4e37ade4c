//! Scenario f, group commit: the layer against the hand-written lock (scenario a's `baseline`)
//! at 1, 50 and 256 connections, with the latency percentiles and Redis's CPU per request; the
//! layer with `WAIT 1` on a master with a replica against the same layer without it; and the
//! client commands of one request sent alone.

use std::{
    fmt::Write as _,
    path::Path,
    sync::{Arc, atomic::AtomicU64},
    time::Duration,
};

use axum::Router;
use tower_lock::{Key, LockLayer, RedisStore};
use tower_lock_testkit::{RedisServer, wrk::Wrk};

use crate::{
    Settings,
    common::{ROUTE, cpu_us_per, flushall, redis_cpu, runtime},
    http::{self, Variant},
    stats::{f0, f1, f2, median, stat, verdict},
};

/// The connection counts measured, with wrk's threads for each.
pub(crate) const SHAPES: [Wrk; 3] = [
    Wrk {
        threads: 1,
        connections: 1,
    },
    Wrk {
        threads: 2,
        connections: 50,
    },
    Wrk {
        threads: 2,
        connections: 256,
    },
];

/// What is served in one case of the scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Server {
    /// Scenario a's hand-written lock: `SET NX PX` + compare-and-delete script.
    Baseline,
    /// `LockLayer` on `RedisStore::connect`.
    Layer,
    /// `LockLayer` on a master with one replica, without `WAIT`.
    LayerReplicated,
    /// `LockLayer` on a master with one replica, `wait_for_replicas(1, 500 ms)`.
    LayerWait,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Self::Baseline => "hand-written lock (`SET NX PX` + compare-and-delete)",
            Self::Layer => "`LockLayer`",
            Self::LayerReplicated => "`LockLayer`, master with a replica, no `WAIT`",
            Self::LayerWait => "`LockLayer`, master with a replica, `WAIT 1` per batch",
        }
    }
}

/// One wrk run of one case.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupSample {
    pub(crate) server: Server,
    pub(crate) connections: u32,
    pub(crate) rps: f64,
    pub(crate) errors: u64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    /// `used_cpu_user + used_cpu_sys` of the master over the run, per request served.
    pub(crate) redis_us: f64,
}

/// What the scenario measured: its samples per run, and the client commands one request sent
/// alone costs.
#[derive(Debug, Default)]
pub(crate) struct GroupResults {
    pub(crate) runs: Vec<Vec<GroupSample>>,
    pub(crate) alone_commands: Option<usize>,
}

/// Scenario f, `s.runs` times.
pub(crate) fn run(redis: &RedisServer, s: &Settings) -> GroupResults {
    let script = redis.dir().join("distinct-keys.lua");
    std::fs::write(&script, http::WRK_SCRIPT).expect("write the wrk script");
    let alone = runtime()
        .block_on(http::sent_by(Variant::Layer, redis))
        .len();
    eprintln!("f. one request alone: {alone} client commands");
    let master = RedisServer::options().own_session(true).start();
    let replica = RedisServer::replica_of(&master);
    let mut runs = Vec::new();
    for run in 0..s.runs {
        let mut samples = Vec::new();
        for shape in SHAPES {
            for server in [Server::Baseline, Server::Layer] {
                samples.push(case(server, redis, shape, s, &script));
                log(run, samples.last().expect("pushed"));
            }
        }
        let shape = SHAPES[1];
        for server in [Server::LayerReplicated, Server::LayerWait] {
            samples.push(case(server, &master, shape, s, &script));
            log(run, samples.last().expect("pushed"));
        }
        runs.push(samples);
    }
    drop(replica);
    GroupResults {
        runs,
        alone_commands: Some(alone),
    }
}

fn log(run: usize, x: &GroupSample) {
    eprintln!(
        "f. run {}: {:<44} c={:<3} {:>8.0} req/s, p50 {:.2} ms, p99 {:.2} ms, Redis {:.1} µs/request, {} errors",
        run + 1,
        x.server.name(),
        x.connections,
        x.rps,
        x.p50_ms,
        x.p99_ms,
        x.redis_us,
        x.errors
    );
}

async fn app(server: Server, url: &str) -> Router {
    let layer = |store: RedisStore| {
        Router::new()
            .route(ROUTE, axum::routing::post(|| async { "ok" }))
            .route_layer(LockLayer::new(store, Key::path_param("sku")))
    };
    match server {
        Server::Baseline => {
            http::http_app(Variant::Baseline, url, Arc::new(AtomicU64::new(0))).await
        }
        Server::Layer | Server::LayerReplicated => {
            layer(RedisStore::connect(url).await.expect("RedisStore::connect"))
        }
        Server::LayerWait => layer(
            RedisStore::connect(url)
                .await
                .expect("RedisStore::connect")
                .wait_for_replicas(1, Duration::from_millis(500))
                .expect("wait_for_replicas"),
        ),
    }
}

fn case(
    server: Server,
    redis: &RedisServer,
    shape: Wrk,
    s: &Settings,
    script: &Path,
) -> GroupSample {
    let url = redis.url();
    let rt = runtime();
    rt.block_on(flushall(&url));
    let app = rt.block_on(app(server, &url));
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind a loopback port");
    let port = listener.local_addr().expect("local addr").port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = rt.spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await
    });
    let _ = shape.run(port, s.warmup_s, script);
    let cpu_before = rt.block_on(redis_cpu(&url));
    let measured = shape.run_with_latency(port, s.http_s, script);
    let cpu_after = rt.block_on(redis_cpu(&url));
    let _ = stop.send(());
    let _ = rt.block_on(async { tokio::time::timeout(Duration::from_secs(3), serving).await });
    rt.shutdown_timeout(Duration::from_secs(2));
    let requests = measured.rps * s.http_s as f64;
    let ms = |d: Option<Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0);
    GroupSample {
        server,
        connections: shape.connections,
        rps: measured.rps,
        errors: measured.errors,
        p50_ms: ms(measured.p50),
        p99_ms: ms(measured.p99),
        redis_us: cpu_us_per(cpu_before, cpu_after, requests),
    }
}

fn values(
    r: &GroupResults,
    server: Server,
    connections: u32,
    f: impl Fn(&GroupSample) -> f64,
) -> Vec<f64> {
    r.runs
        .iter()
        .filter_map(|run| {
            run.iter()
                .find(|x| x.server == server && x.connections == connections)
                .map(&f)
        })
        .collect()
}

fn ratios(
    r: &GroupResults,
    num: Server,
    den: Server,
    connections: u32,
    f: impl Fn(&GroupSample) -> f64,
) -> Vec<f64> {
    r.runs
        .iter()
        .filter_map(|run| {
            let get = |server| {
                run.iter()
                    .find(|x| x.server == server && x.connections == connections)
                    .map(&f)
            };
            Some(get(num)? / get(den)?)
        })
        .collect()
}

/// The group-commit targets, for the summary table.
pub(crate) fn render_targets(w: &mut String, r: &GroupResults) {
    if r.runs.is_empty() {
        return;
    }
    let rps = |x: &GroupSample| x.rps;
    for (connections, target) in [(50, 1.0), (256, 1.2)] {
        let v = ratios(r, Server::Layer, Server::Baseline, connections, rps);
        let _ = writeln!(
            w,
            "| group commit: layer ≥ {target:.1} × the hand-written lock at {connections} connections (f.) | {} | {} |",
            stat(&v, f2),
            verdict(median(&v) >= target)
        );
    }
    let wait = ratios(r, Server::LayerWait, Server::Layer, 50, rps);
    let _ = writeln!(
        w,
        "| group commit: master + replica with `WAIT 1` ≥ 0.7 × one instance, 50 connections (f.) | {} | {} |",
        stat(&wait, f2),
        verdict(median(&wait) >= 0.7)
    );
    let cpu = ratios(r, Server::Layer, Server::Baseline, 50, |x| x.redis_us);
    let _ = writeln!(
        w,
        "| group commit: Redis CPU per request, layer below the hand-written lock, 50 connections (f.) | {} × | {} |",
        stat(&cpu, f2),
        verdict(median(&cpu) < 1.0)
    );
    if let Some(n) = r.alone_commands {
        let _ = writeln!(
            w,
            "| group commit: exactly 2 client commands for a request sent alone (f.) | {n} | {} |",
            verdict(n == 2)
        );
    }
}

/// Section f of the report.
pub(crate) fn render(w: &mut String, s: &Settings, r: &GroupResults) {
    if r.runs.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "## f. Group commit\n\nThe layer on distinct keys with an empty handler against scenario \
         a's hand-written lock (`SET NX PX`, then a compare-and-delete script, one request at a \
         time on one shared multiplexed connection), wrk for {} s per case at each connection \
         count (`-t1 -c1`, `-t2 -c50`, `-t2 -c256`, `--latency`). Redis CPU is `used_cpu_user + \
         used_cpu_sys` from `INFO cpu` before and after the measured run, divided by the \
         requests served. The replica rows run on a second `redis-server` with a replica \
         attached (`RedisServer::replica_of`), both started by the benchmark.\n",
        s.http_s
    );
    let _ = writeln!(
        w,
        "| server | connections | req/s | p50 ms | p99 ms | Redis CPU µs/request | errors |\n|---|---|---|---|---|---|---|"
    );
    let mut rows: Vec<(Server, u32)> = Vec::new();
    for x in r.runs.iter().flatten() {
        if !rows.contains(&(x.server, x.connections)) {
            rows.push((x.server, x.connections));
        }
    }
    for (server, connections) in rows {
        let errors: u64 = r
            .runs
            .iter()
            .flatten()
            .filter(|x| x.server == server && x.connections == connections)
            .map(|x| x.errors)
            .sum();
        let _ = writeln!(
            w,
            "| {} | {connections} | {} | {} | {} | {} | {errors} |",
            server.name(),
            stat(&values(r, server, connections, |x| x.rps), f0),
            stat(&values(r, server, connections, |x| x.p50_ms), f2),
            stat(&values(r, server, connections, |x| x.p99_ms), f2),
            stat(&values(r, server, connections, |x| x.redis_us), f1),
        );
    }
    let _ = writeln!(w, "\n| ratio (per run, then median) | value |\n|---|---|");
    for connections in [1, 50, 256] {
        let v = ratios(r, Server::Layer, Server::Baseline, connections, |x| x.rps);
        let _ = writeln!(
            w,
            "| layer / hand-written, req/s, {connections} connection(s) | {} |",
            stat(&v, f2)
        );
        let v = ratios(r, Server::Layer, Server::Baseline, connections, |x| {
            x.redis_us
        });
        let _ = writeln!(
            w,
            "| layer / hand-written, Redis CPU per request, {connections} connection(s) | {} |",
            stat(&v, f2)
        );
    }
    let v = ratios(r, Server::LayerWait, Server::Layer, 50, |x| x.rps);
    let _ = writeln!(
        w,
        "| `WAIT 1` with a replica / one instance, req/s | {} |",
        stat(&v, f2)
    );
    let v = ratios(r, Server::LayerWait, Server::LayerReplicated, 50, |x| x.rps);
    let _ = writeln!(
        w,
        "| `WAIT 1` / the same master without `WAIT`, req/s | {} |",
        stat(&v, f2)
    );
    if let Some(n) = r.alone_commands {
        let _ = writeln!(
            w,
            "\nA request sent alone (after a warm-up request, MONITOR recording) costs {n} client \
             commands: its acquire goes out at once, in a batch of one, and so does its release. \
             Under load, scenario a's commands per request show the batching.\n"
        );
    }
}

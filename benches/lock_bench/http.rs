//! Scenario a, HTTP overhead: wrk against axum serving one route, with no lock, with the
//! hand-written baselines (plain commands, the crate's own scripts by hand, a bb8 pool), and
//! with `LockLayer`.

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::{Path as UrlPath, State},
    http::{Request, StatusCode},
    routing::post,
};
use bb8_redis::{RedisConnectionManager, bb8};
use redis::{Script, aio::MultiplexedConnection};
use tower::ServiceExt;
use tower_lock::{Key, LockLayer, RedisStore, store::Token};
use tower_lock_testkit::{RedisServer, monitor::Monitor, wrk::Wrk};

use crate::{
    Settings,
    common::{
        RELEASE_LUA, ROUTE, TTL_MS, control, cpu_us_per, flushall, purchase, redis_cpu, runtime,
        tag,
    },
    protocol::{self, CrateScripts},
};

/// wrk's shape: 2 threads, 50 connections.
pub(crate) const WRK: Wrk = Wrk {
    threads: 2,
    connections: 50,
};

/// A wrk script that sends each request to a path of its own (`/items/<key>/purchase`), so
/// every request locks a distinct key.
pub(crate) const WRK_SCRIPT: &str = r#"-- Written by benches/lock_bench/http.rs: one distinct key per request.
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local prefix = ""
local n = 0
function init(args)
  math.randomseed(os.time() * 1000 + (tid or 0))
  prefix = tostring(tid or 0) .. "-" .. tostring(math.random(1, 2147483647)) .. "-"
end
function request()
  n = n + 1
  return wrk.format("POST", "/items/" .. prefix .. n .. "/purchase")
end
"#;

/// Scenario a, `s.runs` times: every variant in turn per run, on an emptied server. Checks
/// first that the "same scripts" baseline still sends what the layer sends.
pub(crate) fn run(redis: &RedisServer, s: &Settings) -> Vec<Vec<(Variant, HttpSample)>> {
    check_same_scripts(redis);
    let script = redis.dir().join("distinct-keys.lua");
    std::fs::write(&script, WRK_SCRIPT).expect("write the wrk script");
    let url = redis.url();
    let mut runs = Vec::new();
    for run in 0..s.runs {
        let mut samples = Vec::new();
        for variant in VARIANTS {
            if !s.wants_variant(variant.short()) {
                continue;
            }
            runtime().block_on(flushall(&url));
            let sample = http_run(variant, redis, s, &script);
            eprintln!(
                "a. run {}: {:<16} {:>9.0} req/s, {} errors, Redis {:.1} µs/request, commands/request {:?}",
                run + 1,
                variant.short(),
                sample.rps,
                sample.errors,
                sample.redis_us,
                sample.commands.as_ref().map(|c| c.0)
            );
            samples.push((variant, sample));
        }
        runs.push(samples);
    }
    runs
}

/// Sends one request through the layer and one through the "same scripts" baseline, each after
/// a warm-up request, with MONITOR recording, and stops the benchmark unless both sent the same
/// scripts with the same arguments (see `protocol`).
fn check_same_scripts(redis: &RedisServer) {
    let rt = runtime();
    let layer = rt.block_on(sent_by(Variant::Layer, redis));
    let baseline = rt.block_on(sent_by(Variant::BaselineScripts, redis));
    rt.shutdown_timeout(Duration::from_secs(2));
    if let Err(drift) = protocol::compare(&layer, &baseline) {
        panic!(
            "the \"same scripts\" baseline no longer sends what the layer sends: {drift}. \
             Update the stand-ins in benches/lock_bench/protocol.rs."
        );
    }
    eprintln!("a. checked: the \"same scripts\" baseline sends the layer's scripts and arguments");
}

/// The client commands one uncontended request through `variant` sends, after a warm-up
/// request (script loads, hand-off subscription), on an emptied server.
pub(crate) async fn sent_by(variant: Variant, redis: &RedisServer) -> Vec<Vec<String>> {
    let url = redis.url();
    flushall(&url).await;
    let app = http_app(variant, &url, Arc::new(AtomicU64::new(0))).await;
    let tag = tag();
    let send = |n: u32| app.clone().oneshot(purchase(&format!("check-{tag}-{n}")));
    let warm = send(0).await.expect("infallible");
    assert_eq!(
        warm.status(),
        StatusCode::OK,
        "{variant:?}: warm-up request"
    );
    let mut ctl = control(&url).await;
    let monitor = Monitor::start_recording(redis.port()).await;
    let response = send(1).await.expect("infallible");
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "{variant:?}: checked request"
    );
    // A release may land after the response: let it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    monitor.finish_recorded(&mut ctl).await
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Variant {
    Hello,
    Baseline,
    BaselineScripts,
    Bb8Defaults,
    Layer,
}

pub(crate) const VARIANTS: [Variant; 5] = [
    Variant::Hello,
    Variant::Baseline,
    Variant::BaselineScripts,
    Variant::Bb8Defaults,
    Variant::Layer,
];

impl Variant {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::Hello => "axum hello world (no Redis)",
            Self::Baseline => {
                "baseline: `SET NX PX` + `EVALSHA` compare-and-delete, one shared multiplexed connection"
            }
            Self::BaselineScripts => {
                "baseline, same scripts: `EVALSHA` of the crate's own acquire and release scripts (fencing token, hand-off queue check), with the keys and arguments the layer sends, one shared multiplexed connection"
            }
            Self::Bb8Defaults => {
                "bb8-redis 0.26 with its defaults (`PING` on checkout, 10 connections), one checkout per command, same 2 commands as the baseline"
            }
            Self::Layer => {
                "`LockLayer` (`RedisStore::connect`, `Key::path_param(\"sku\")`, default config), trivial handler"
            }
        }
    }

    pub(crate) fn short(self) -> &'static str {
        match self {
            Self::Hello => "hello",
            Self::Baseline => "baseline",
            Self::BaselineScripts => "baseline-scripts",
            Self::Bb8Defaults => "bb8-defaults",
            Self::Layer => "layer",
        }
    }
}

struct Direct {
    conn: MultiplexedConnection,
    /// `Some`: the crate's own acquire and release scripts, with the keys and arguments the
    /// layer sends, instead of a plain `SET NX PX` and `RELEASE_LUA`.
    scripts: Option<CrateScripts>,
    release: Script,
}

fn lock_key(sku: &str) -> String {
    format!("bench:{{{sku}}}")
}

async fn direct_handler(
    State(state): State<Arc<Direct>>,
    UrlPath(sku): UrlPath<String>,
) -> Result<&'static str, StatusCode> {
    let token = Token::generate().map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let key = lock_key(&sku);
    let mut conn = state.conn.clone();
    let acquired = match &state.scripts {
        None => redis::cmd("SET")
            .arg(&key)
            .arg(token.as_bytes())
            .arg("NX")
            .arg("PX")
            .arg(TTL_MS)
            .query_async::<Option<String>>(&mut conn)
            .await
            .map(|reply| reply.is_some()),
        Some(scripts) => scripts.acquire(&mut conn, &key, &token).await,
    }
    .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    if !acquired {
        return Err(StatusCode::CONFLICT);
    }
    let released = match &state.scripts {
        None => {
            state
                .release
                .key(&key)
                .arg(token.as_bytes())
                .invoke_async::<i64>(&mut conn)
                .await
        }
        Some(scripts) => scripts.release(&mut conn, &key, &token).await,
    };
    released.map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    Ok("ok")
}

struct Pooled {
    pool: bb8::Pool<RedisConnectionManager>,
    release: Script,
}

async fn pooled_handler(
    State(state): State<Arc<Pooled>>,
    UrlPath(sku): UrlPath<String>,
) -> Result<&'static str, StatusCode> {
    let unavailable = |_| StatusCode::SERVICE_UNAVAILABLE;
    let token = Token::generate().map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let key = lock_key(&sku);
    let acquired = {
        let mut conn = state.pool.get().await.map_err(|_| unavailable(()))?;
        redis::cmd("SET")
            .arg(&key)
            .arg(token.as_bytes())
            .arg("NX")
            .arg("PX")
            .arg(TTL_MS)
            .query_async::<Option<String>>(&mut *conn)
            .await
            .map_err(|_| unavailable(()))?
            .is_some()
    };
    if !acquired {
        return Err(StatusCode::CONFLICT);
    }
    let mut conn = state.pool.get().await.map_err(|_| unavailable(()))?;
    state
        .release
        .key(&key)
        .arg(token.as_bytes())
        .invoke_async::<i64>(&mut *conn)
        .await
        .map_err(|_| unavailable(()))?;
    Ok("ok")
}

pub(crate) async fn http_app(variant: Variant, url: &str, requests: Arc<AtomicU64>) -> Router {
    let router = match variant {
        Variant::Hello => Router::new().route(ROUTE, post(|| async { "ok" })),
        Variant::Baseline | Variant::BaselineScripts => {
            let state = Arc::new(Direct {
                conn: control(url).await,
                scripts: (variant == Variant::BaselineScripts).then(CrateScripts::new),
                release: Script::new(RELEASE_LUA),
            });
            Router::new()
                .route(ROUTE, post(direct_handler))
                .with_state(state)
        }
        Variant::Bb8Defaults => {
            let manager = RedisConnectionManager::new(url).expect("bb8 manager");
            let pool = bb8::Pool::builder().build(manager).await.expect("bb8 pool");
            let state = Arc::new(Pooled {
                pool,
                release: Script::new(RELEASE_LUA),
            });
            Router::new()
                .route(ROUTE, post(pooled_handler))
                .with_state(state)
        }
        Variant::Layer => {
            let store = RedisStore::connect(url).await.expect("RedisStore::connect");
            Router::new()
                .route(ROUTE, post(|| async { "ok" }))
                .route_layer(LockLayer::new(store, Key::path_param("sku")))
        }
    };
    // Counts requests as they arrive (before the lock), for commands per request.
    router.layer(tower::util::MapRequestLayer::new(
        move |request: Request<Body>| {
            requests.fetch_add(1, Ordering::Relaxed);
            request
        },
    ))
}

pub(crate) struct HttpSample {
    pub(crate) rps: f64,
    pub(crate) errors: u64,
    /// `used_cpu_user + used_cpu_sys` of the server over the timed run, per request served.
    pub(crate) redis_us: f64,
    /// Client-issued Redis commands per request, from a separate counting pass.
    pub(crate) commands: Option<(f64, String)>,
}

fn http_run(variant: Variant, redis: &RedisServer, s: &Settings, script: &Path) -> HttpSample {
    let url = redis.url();
    let rt = runtime();
    let requests = Arc::new(AtomicU64::new(0));
    let app = rt.block_on(http_app(variant, &url, Arc::clone(&requests)));
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
    let _ = WRK.run(port, s.warmup_s, script);
    let cpu_before = rt.block_on(redis_cpu(&url));
    let measured = WRK.run(port, s.http_s, script);
    let cpu_after = rt.block_on(redis_cpu(&url));
    let commands = (variant != Variant::Hello).then(|| {
        let (mut ctl, monitor) = rt.block_on(async {
            let ctl = control(&url).await;
            (ctl, Monitor::start(redis.port()).await)
        });
        let before = requests.load(Ordering::SeqCst);
        let _ = WRK.run(port, s.count_s, script);
        // Requests cut off when wrk stopped still release (in spawned tasks): let them land.
        std::thread::sleep(Duration::from_millis(300));
        let counts = rt.block_on(monitor.finish(&mut ctl));
        let n = (requests.load(Ordering::SeqCst) - before).max(1) as f64;
        (counts.total() as f64 / n, counts.per(n))
    });
    let _ = stop.send(());
    let _ = rt.block_on(async { tokio::time::timeout(Duration::from_secs(3), serving).await });
    rt.shutdown_timeout(Duration::from_secs(2));
    HttpSample {
        rps: measured.rps,
        errors: measured.errors,
        redis_us: cpu_us_per(cpu_before, cpu_after, measured.rps * s.http_s as f64),
        commands,
    }
}

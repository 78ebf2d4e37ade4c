//! Scenario g, orders of several keys: wrk against one axum app whose single purchases
//! (`POST /items/<sku>/purchase`, `Key::path_param`) and orders (`POST /orders`, the SKUs of a
//! JSON body through `Key::json`) lock SKUs in one namespace through one `Locker`, as
//! `examples/inventory.rs` does. Orders of 1, 2 and 3 SKUs against single purchases, each
//! request on keys of its own (what a lease on several keys costs), and 2- and 3-SKU orders
//! against purchases on a shared pool of SKUs (what overlapping sets cost under contention).

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode},
    routing::post,
};
use tower::ServiceExt;
use tower_lock::{Key, LockLayer, Locker, RedisStore};
use tower_lock_testkit::{RedisServer, monitor::Monitor};

use crate::{
    Settings,
    common::{ROUTE, control, cpu_us_per, flushall, redis_cpu, runtime},
    http::WRK,
};

/// The namespace both routes lock SKUs in.
const NAMESPACE: &str = "sku";

/// How many SKUs the shared pool has.
pub(crate) const POOL: u32 = 100;

/// What one variant sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Variant {
    /// SKUs per request: 0 for a single purchase (one SKU, in the path), else an order of
    /// that many SKUs (in the body).
    pub(crate) skus: usize,
    /// Keys of its own per request, or drawn from the shared pool of `POOL` SKUs.
    pub(crate) pooled: bool,
}

pub(crate) const VARIANTS: [Variant; 7] = [
    Variant {
        skus: 0,
        pooled: false,
    },
    Variant {
        skus: 1,
        pooled: false,
    },
    Variant {
        skus: 2,
        pooled: false,
    },
    Variant {
        skus: 3,
        pooled: false,
    },
    Variant {
        skus: 0,
        pooled: true,
    },
    Variant {
        skus: 2,
        pooled: true,
    },
    Variant {
        skus: 3,
        pooled: true,
    },
];

impl Variant {
    pub(crate) fn short(self) -> String {
        let what = match self.skus {
            0 => "purchase".to_owned(),
            n => format!("order-{n}"),
        };
        if self.pooled {
            format!("{what}, pool")
        } else {
            what
        }
    }

    pub(crate) fn describe(self) -> String {
        let what = match self.skus {
            0 => "single purchase, `POST /items/<sku>/purchase` (`Key::path_param`)".to_owned(),
            1 => "order of 1 SKU, `POST /orders` (`Key::json(\"/items/*/sku\")`)".to_owned(),
            n => format!("order of {n} SKUs, `POST /orders` (`Key::json(\"/items/*/sku\")`)"),
        };
        if self.pooled {
            format!("{what}, SKUs drawn from {POOL}")
        } else {
            format!("{what}, SKUs of its own")
        }
    }

    /// The wrk script that sends this variant's requests.
    fn script(self) -> String {
        let keys = self.skus.max(1);
        let pick = if self.pooled {
            // Distinct SKUs from the pool, in a random order.
            format!(
                "local picked, seen = {{}}, {{}}
  while #picked < {keys} do
    local sku = math.random(1, {POOL})
    if not seen[sku] then seen[sku] = true; picked[#picked + 1] = 'sku-' .. sku end
  end"
            )
        } else {
            format!(
                "local picked = {{}}
  for i = 1, {keys} do picked[i] = prefix .. n .. '-' .. i end"
            )
        };
        let request = if self.skus == 0 {
            "return wrk.format('POST', '/items/' .. picked[1] .. '/purchase')".to_owned()
        } else {
            "local items = {}
  for i, sku in ipairs(picked) do items[i] = '{\"sku\":\"' .. sku .. '\",\"qty\":1}' end
  return wrk.format('POST', '/orders', { ['Content-Type'] = 'application/json' },
    '{\"items\":[' .. table.concat(items, ',') .. ']}')"
                .to_owned()
        };
        format!(
            "-- Written by benches/lock_bench/sets.rs: {}.
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set(\"tid\", threads)
end
local prefix = \"\"
local n = 0
function init(args)
  math.randomseed(os.time() * 1000 + (tid or 0))
  prefix = tostring(tid or 0) .. \"-\" .. tostring(math.random(1, 2147483647)) .. \"-\"
end
function request()
  n = n + 1
  {pick}
  {request}
end
",
            self.describe()
        )
    }
}

/// One variant's run.
pub(crate) struct SetSample {
    pub(crate) rps: f64,
    pub(crate) errors: u64,
    /// `used_cpu_user + used_cpu_sys` of the server over the timed run, per request served.
    pub(crate) redis_us: f64,
    /// Client-issued Redis commands per request, from a separate counting pass.
    pub(crate) commands: (f64, String),
}

/// Scenario g, `s.runs` times: every variant in turn per run, on an emptied server.
pub(crate) fn run(redis: &RedisServer, s: &Settings) -> Vec<Vec<(Variant, SetSample)>> {
    check(redis);
    let scripts: Vec<(Variant, PathBuf)> = VARIANTS
        .iter()
        .map(|&v| {
            let path = redis
                .dir()
                .join(format!("sets-{}.lua", v.short().replace(", ", "-")));
            std::fs::write(&path, v.script()).expect("write a wrk script");
            (v, path)
        })
        .collect();
    let url = redis.url();
    let mut runs = Vec::new();
    for run in 0..s.runs {
        let mut samples = Vec::new();
        for (variant, script) in &scripts {
            runtime().block_on(flushall(&url));
            let sample = measure(redis, s, script);
            eprintln!(
                "g. run {}: {:<16} {:>9.0} req/s, {} errors, Redis {:.1} µs/request, commands/request {:.2}",
                run + 1,
                variant.short(),
                sample.rps,
                sample.errors,
                sample.redis_us,
                sample.commands.0,
            );
            samples.push((*variant, sample));
        }
        runs.push(samples);
    }
    runs
}

/// The app: both routes, one locker, one namespace, trivial handlers. Counts requests as they
/// arrive (before the lock), for commands per request.
async fn app(url: &str, requests: Arc<AtomicU64>) -> Router {
    let store = RedisStore::connect(url).await.expect("RedisStore::connect");
    let locker = Locker::new(store);
    let purchase =
        LockLayer::from_locker(locker.clone(), Key::path_param("sku")).namespace(NAMESPACE);
    let order = LockLayer::from_locker(locker, Key::json("/items/*/sku").expect("a JSON pointer"))
        .namespace(NAMESPACE);
    Router::new()
        .route(ROUTE, post(|| async { "ok" }).route_layer(purchase))
        .route("/orders", post(|| async { "ok" }).route_layer(order))
        .layer(tower::util::MapRequestLayer::new(
            move |request: Request<Body>| {
                requests.fetch_add(1, Ordering::Relaxed);
                request
            },
        ))
}

/// Before measuring: an order of 3 SKUs and a purchase each answer 200, and the order sends two
/// client commands once the scripts are loaded (one acquire, one release, whatever its size).
fn check(redis: &RedisServer) {
    let rt = runtime();
    rt.block_on(async {
        let url = redis.url();
        flushall(&url).await;
        let app = app(&url, Arc::new(AtomicU64::new(0))).await;
        let order = |skus: &[&str]| {
            let items: Vec<String> = skus
                .iter()
                .map(|s| format!("{{\"sku\":\"{s}\",\"qty\":1}}"))
                .collect();
            Request::post("/orders")
                .header("content-type", "application/json")
                .body(Body::from(format!("{{\"items\":[{}]}}", items.join(","))))
                .expect("request")
        };
        let status = app
            .clone()
            .oneshot(order(&["w1", "w2", "w3"]))
            .await
            .unwrap()
            .status();
        assert_eq!(status, StatusCode::OK, "f: a warm-up order");
        let mut ctl = control(&url).await;
        let monitor = Monitor::start(redis.port()).await;
        let status = app
            .clone()
            .oneshot(order(&["c1", "c2", "c3"]))
            .await
            .unwrap()
            .status();
        assert_eq!(status, StatusCode::OK, "f: the checked order");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let counts = monitor.finish(&mut ctl).await;
        assert_eq!(
            counts.total(),
            2,
            "f: an uncontended order of 3 SKUs sent {}",
            counts.per(1.0)
        );
        let purchase = crate::common::purchase("c2");
        let status = app.clone().oneshot(purchase).await.unwrap().status();
        assert_eq!(status, StatusCode::OK, "f: a purchase");
    });
    rt.shutdown_timeout(Duration::from_secs(2));
    eprintln!("g. checked: an order of 3 SKUs is one acquire and one release (2 commands)");
}

fn measure(redis: &RedisServer, s: &Settings, script: &Path) -> SetSample {
    let url = redis.url();
    let rt = runtime();
    let requests = Arc::new(AtomicU64::new(0));
    let app = rt.block_on(app(&url, Arc::clone(&requests)));
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
    let _ = stop.send(());
    let _ = rt.block_on(async { tokio::time::timeout(Duration::from_secs(3), serving).await });
    rt.shutdown_timeout(Duration::from_secs(2));
    SetSample {
        rps: measured.rps,
        errors: measured.errors,
        redis_us: cpu_us_per(cpu_before, cpu_after, measured.rps * s.http_s as f64),
        commands: (counts.total() as f64 / n, counts.per(n)),
    }
}

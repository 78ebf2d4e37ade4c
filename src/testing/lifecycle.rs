//! Every lifecycle case of a held lease, through both layers: `LockLayer` and
//! `IdempotencyLayer` run on the one engine, so each case must end alike in both: the same
//! status, within the same time, with the same outcome on the `lock` span (except where the
//! layer's own result names it: a stored record is `stored`, not `completed`), and with nothing
//! left locked. On paused time and a scripted in-memory store: milliseconds per case.

use std::{
    convert::Infallible,
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use tokio::time::{Instant, sleep, timeout};
use tower::{Layer, ServiceExt, service_fn, util::BoxCloneService};
use tracing::{
    Subscriber,
    field::{Field, Visit},
    span,
};
use tracing_subscriber::{Registry, layer::Context as LayerContext, prelude::*};

use super::Scripted;
use crate::telemetry::outcome::documented::{self, Recorder};
use crate::{
    IdempotencyLayer, Key, Lease, LockConfig, LockLayer, Wait,
    config::OnLeaseLost,
    fence::FencedData,
    idempotency::{IdempotencyConfig, SharedKeySpace},
};

const MS: Duration = Duration::from_millis(1);
const TTL: Duration = Duration::from_millis(3000);

/// What the handler does.
#[derive(Debug, Clone, Copy)]
enum Handler {
    /// Answers 200 after this long.
    Works(Duration),
    /// Returns an error from the inner service after this long.
    Fails(Duration),
    /// Panics after this long.
    Panics(Duration),
    /// Answers 200 at once with a body that streams for this long.
    Streams(Duration),
    /// Sends a fenced batch at once, then answers 200 after this long.
    WritesFenced(Duration),
}

/// What happens to the store meanwhile.
#[derive(Debug, Clone, Copy)]
enum Fault {
    None,
    /// The lease is deleted behind its holder after this long.
    LeaseDeleted(Duration),
    /// The store goes down after this long.
    StoreDown(Duration),
    /// Releases (and record writes) take this long.
    SlowRelease(Duration),
    /// Another holder has the key, for longer than the request waits.
    Held,
}

/// How the span's outcome is expected.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    /// The same in both layers.
    Same(Option<&'static str>),
    /// Named by each layer's own result: (LockLayer, IdempotencyLayer).
    PerLayer(&'static str, &'static str),
}

struct Case {
    name: &'static str,
    handler: Handler,
    fault: Fault,
    on_lease_lost: OnLeaseLost,
    max_hold: Option<Duration>,
    /// The response future is dropped after this long.
    drop_after: Option<Duration>,
    /// `None`: no response (an inner error, or the future dropped).
    status: Option<u16>,
    /// The response (with its body) is complete within these bounds.
    within: (Duration, Duration),
    outcome: Outcome,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    Lock,
    Idempotency,
}

/// The inner service's error.
#[derive(Debug)]
struct Failure;

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the handler failed")
    }
}

impl std::error::Error for Failure {}

type Svc = BoxCloneService<Request<Body>, Response<Body>, Failure>;

fn handler(kind: Handler) -> Svc {
    let data = FencedData::in_memory();
    BoxCloneService::new(service_fn(move |req: Request<Body>| {
        let data = data.clone();
        async move {
            match kind {
                Handler::Works(d) => {
                    sleep(d).await;
                    Ok(Response::new(Body::from("done")))
                }
                Handler::Fails(d) => {
                    sleep(d).await;
                    Err(Failure)
                }
                Handler::Panics(d) => {
                    sleep(d).await;
                    panic!("the handler panicked");
                }
                Handler::Streams(d) => {
                    let chunks = futures_util::stream::unfold(0u8, move |n| async move {
                        if n == 4 {
                            return None;
                        }
                        sleep(d / 4).await;
                        Some((Ok::<_, Infallible>(Bytes::from(vec![b'x'; 8])), n + 1))
                    });
                    Ok(Response::new(Body::from_stream(chunks)))
                }
                Handler::WritesFenced(d) => {
                    let lease = req.extensions().get::<Lease>().expect("a lease").clone();
                    data.batch(&lease).set("k", "v").apply().await.unwrap();
                    sleep(d).await;
                    Ok(Response::new(Body::from("done")))
                }
            }
        }
    }))
}

/// The `outcome` each `lock` span recorded, in order.
#[derive(Clone, Default)]
struct Outcomes(Arc<Mutex<Vec<String>>>);

impl<S: Subscriber> tracing_subscriber::Layer<S> for Outcomes {
    fn on_record(&self, _: &span::Id, values: &span::Record<'_>, _: LayerContext<'_, S>) {
        struct Find<'a>(&'a Mutex<Vec<String>>);
        impl Visit for Find<'_> {
            fn record_str(&mut self, field: &Field, value: &str) {
                if field.name() == "outcome" {
                    self.0.lock().unwrap().push(value.to_owned());
                }
            }
            fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
        }
        values.record(&mut Find(&self.0));
    }
}

/// Runs `case` through `which` layer; the failures, if any.
async fn run(case: &Case, which: Which) -> Vec<String> {
    let store = Scripted::new();
    let mut lock = LockConfig::builder()
        .ttl(TTL)
        .wait(Wait::constant(50 * MS).unwrap().deadline(500 * MS));
    if let Some(max) = case.max_hold {
        lock = lock.max_hold(max);
    }
    let lock = lock.build().unwrap();
    let service = match which {
        Which::Lock => BoxCloneService::new(
            LockLayer::with_config(store.clone(), Key::path(), lock.clone())
                .on_lease_lost(case.on_lease_lost)
                .hold_until_body_end(true)
                .layer(handler(case.handler))
                .map_response(|r| r.map(Body::new)),
        ),
        Which::Idempotency => BoxCloneService::new(
            IdempotencyLayer::with_config(
                store.clone(),
                SharedKeySpace,
                IdempotencyConfig::builder()
                    .lock(lock.clone())
                    .build()
                    .unwrap(),
            )
            .on_lease_lost(case.on_lease_lost)
            .layer(handler(case.handler))
            .map_response(|r| r.map(Body::new)),
        ),
    };
    let service = tower_http::catch_panic::CatchPanicLayer::new()
        .layer(service)
        .map_response(|r| r.map(Body::new));
    let other = crate::Locker::with_config(store.clone(), lock);
    let _held = match case.fault {
        Fault::Held => Some(other.acquire(held_key(which)).await.unwrap()),
        _ => None,
    };
    let faults = tokio::spawn(inject(case.fault, store.clone()));
    let request = Request::post("/pay")
        .header("idempotency-key", "0123456789abcdef")
        .body(Body::from("{}"))
        .unwrap();
    let started = Instant::now();
    let response = async {
        let response = service.oneshot(request).await.ok()?;
        let status = response.status();
        response.into_body().collect().await.ok()?;
        Some(status)
    };
    let answer = match case.drop_after {
        Some(after) => timeout(after, response).await.ok().flatten(),
        None => response.await,
    };
    let took = started.elapsed();
    drop(faults);
    let mut failures = Vec::new();
    if answer.map(|s| s.as_u16()) != case.status {
        failures.push(format!("status {answer:?}, expected {:?}", case.status));
    }
    if took < case.within.0 || took > case.within.1 {
        failures.push(format!(
            "answered after {took:?}, expected {:?}",
            case.within
        ));
    }
    // Nothing left: a spawned release has run, or the lease expired (the store down).
    store.set_down(false);
    store.set_release_delay(Duration::ZERO);
    sleep(TTL + 100 * MS).await;
    let left = store.inner.held() - usize::from(_held.is_some());
    if left != 0 {
        failures.push(format!("{left} lease(s) left"));
    }
    // The other holder's span ends `released`, which the caller leaves out.
    if let Some(held) = _held {
        held.release().await.unwrap();
    }
    failures
}

/// The other holder's key: the one the layer under test locks (the layers' keys differ).
fn held_key(which: Which) -> crate::key::LockKey {
    match which {
        Which::Lock => crate::key::LockKey::new("tower-lock:", "path", b"/pay", 512).unwrap(),
        Which::Idempotency => {
            let value = b"0:0123456789abcdef";
            crate::key::LockKey::new("tower-lock:", "idempotency", value, value.len()).unwrap()
        }
    }
}

/// Brings `fault` about on `store` while the request runs.
async fn inject(fault: Fault, store: Scripted) {
    match fault {
        Fault::LeaseDeleted(after) => {
            sleep(after).await;
            store.set_forget(true);
        }
        Fault::StoreDown(after) => {
            sleep(after).await;
            store.set_down(true);
        }
        Fault::SlowRelease(d) => store.set_release_delay(d),
        Fault::None | Fault::Held => {}
    }
}

fn cases() -> Vec<Case> {
    let mut cases = completions();
    cases.extend(faults());
    cases
}

/// A case that completes at once; the others change what differs from it.
fn case(name: &'static str) -> Case {
    Case {
        name,
        handler: Handler::Works(Duration::ZERO),
        fault: Fault::None,
        on_lease_lost: OnLeaseLost::Abort,
        max_hold: None,
        drop_after: None,
        status: Some(200),
        within: (Duration::ZERO, 5 * MS),
        outcome: Outcome::PerLayer("completed", "stored"),
    }
}

/// Handlers that complete, fail, panic or run long, and requests dropped.
fn completions() -> Vec<Case> {
    use Outcome::{PerLayer, Same};
    vec![
        case("completes at once"),
        Case {
            handler: Handler::Works(10_000 * MS),
            within: (10_000 * MS, 10_010 * MS),
            ..case("renewed while a handler runs three times the TTL")
        },
        Case {
            handler: Handler::Fails(100 * MS),
            status: None,
            within: (100 * MS, 105 * MS),
            outcome: Same(Some("failed")),
            ..case("the inner service fails")
        },
        Case {
            handler: Handler::Works(10_000 * MS),
            fault: Fault::LeaseDeleted(500 * MS),
            status: Some(503),
            // Noticed by the first renewal, at a third of the TTL (or up to a renewal tick, 8 ms, before).
            within: (992 * MS, 1010 * MS),
            outcome: Same(Some("lease_lost")),
            ..case("lease deleted while the handler runs, abort")
        },
        Case {
            handler: Handler::Works(2000 * MS),
            fault: Fault::LeaseDeleted(500 * MS),
            on_lease_lost: OnLeaseLost::Continue,
            within: (2000 * MS, 2010 * MS),
            // The handler finished without its lease; nobody else holds the key, so its record
            // is stored all the same (a retry replays it rather than running it again).
            outcome: PerLayer("completed_lease_lost", "stored"),
            ..case("lease deleted while the handler runs, continue")
        },
        Case {
            handler: Handler::WritesFenced(2000 * MS),
            fault: Fault::LeaseDeleted(500 * MS),
            // Not aborted: its write may have landed, and only its own answer can say so.
            within: (2000 * MS, 2010 * MS),
            outcome: PerLayer("completed_lease_lost", "stored"),
            ..case("lease deleted after the handler's fenced write, abort")
        },
        Case {
            handler: Handler::WritesFenced(2000 * MS),
            within: (2000 * MS, 2010 * MS),
            ..case("a handler with a fenced write")
        },
    ]
}

/// The store losing the lease, failing, or slow to release, and a key held elsewhere.
fn faults() -> Vec<Case> {
    use Outcome::{PerLayer, Same};
    vec![
        Case {
            handler: Handler::Works(10_000 * MS),
            fault: Fault::StoreDown(500 * MS),
            status: Some(503),
            // Renewals retried while the lease is valid, then it runs out.
            within: (3000 * MS, 3010 * MS),
            outcome: Same(Some("lease_lost")),
            ..case("store down while the handler runs")
        },
        Case {
            handler: Handler::Works(10_000 * MS),
            max_hold: Some(2000 * MS),
            status: Some(503),
            within: (2000 * MS, 2010 * MS),
            outcome: Same(Some("lease_lost")),
            ..case("the request outlives max_hold")
        },
        Case {
            handler: Handler::Panics(100 * MS),
            status: Some(500),
            within: (100 * MS, 105 * MS),
            outcome: Same(Some("dropped")),
            ..case("the handler panics")
        },
        Case {
            fault: Fault::Held,
            drop_after: Some(200 * MS),
            status: None,
            within: (200 * MS, 205 * MS),
            outcome: Same(None),
            ..case("dropped while acquiring")
        },
        Case {
            handler: Handler::Works(10_000 * MS),
            drop_after: Some(500 * MS),
            status: None,
            within: (500 * MS, 505 * MS),
            outcome: Same(Some("dropped")),
            ..case("dropped while the handler runs")
        },
        Case {
            handler: Handler::Works(100 * MS),
            fault: Fault::SlowRelease(1000 * MS),
            drop_after: Some(300 * MS),
            status: None,
            within: (300 * MS, 305 * MS),
            // `LockLayer` knows its outcome before it releases; the idempotency layer once its
            // record-and-release call answers, which the drop cut short.
            outcome: PerLayer("completed", "dropped"),
            ..case("dropped while releasing")
        },
        Case {
            fault: Fault::Held,
            status: Some(409),
            within: (500 * MS, 505 * MS),
            outcome: Same(Some("contended")),
            ..case("held by another until the wait deadline")
        },
        Case {
            handler: Handler::Streams(2000 * MS),
            // The lease lasts until the body ends (`hold_until_body_end`, and the idempotency
            // layer reads the body to record it).
            within: (2000 * MS, 2010 * MS),
            ..case("a body streamed after the handler")
        },
    ]
}

#[tokio::test(start_paused = true)]
async fn every_lifecycle_case_ends_alike_through_both_layers() {
    let outcomes = Outcomes::default();
    let _default = Registry::default().with(outcomes.clone()).set_default();
    let mut failures = Vec::new();
    for case in cases() {
        for which in [Which::Lock, Which::Idempotency] {
            outcomes.0.lock().unwrap().clear();
            for failure in run(&case, which).await {
                failures.push(format!("{} ({which:?}): {failure}", case.name));
            }
            let mut recorded = outcomes.0.lock().unwrap().clone();
            // docs/OBSERVABILITY.md lists each outcome under the layers that record it.
            let recorder = match which {
                Which::Lock => Recorder::LockLayer,
                Which::Idempotency => Recorder::IdempotencyLayer,
            };
            for outcome in &recorded {
                let by = if outcome == "released" {
                    Recorder::Locker
                } else {
                    recorder
                };
                if !documented::records(by, outcome) {
                    failures.push(format!(
                        "{} ({which:?}): docs/OBSERVABILITY.md does not list `{outcome}` for \
                         {by:?}",
                        case.name
                    ));
                }
            }
            recorded.retain(|outcome| outcome != "released");
            let expected = match (case.outcome, which) {
                (Outcome::Same(outcome), _) => outcome,
                (Outcome::PerLayer(lock, _), Which::Lock) => Some(lock),
                (Outcome::PerLayer(_, idempotency), Which::Idempotency) => Some(idempotency),
            };
            // The other holder's span (when there is one) records nothing until it ends.
            let expected: Vec<String> = expected.into_iter().map(str::to_owned).collect();
            if recorded != expected {
                failures.push(format!(
                    "{} ({which:?}): outcomes {recorded:?}, expected {expected:?}",
                    case.name
                ));
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

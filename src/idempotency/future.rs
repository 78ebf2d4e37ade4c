use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, ready},
};

use bytes::{Bytes, BytesMut};
use http::{Request, Response, request::Parts};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::task::futures::TaskLocalFuture;
use tower::{BoxError, Service};
use tracing::Span;

use super::{
    body::ResponseBody,
    collect::{Collect, Collected},
    error::IdempotencyError,
    key::IdempotencyKey,
    record::Record,
    state::IdempotencyState,
};
use crate::{
    background::bounded,
    engine::{Guarded, Held, Hold, LetGo, Release, poll_guarded},
    error::LockError,
    key::LockKey,
    store::{BoxFuture, StoreError, StoreErrorKind},
    telemetry::{self, Outcome},
};

pin_project! {
    /// Response future of [`IdempotencyService`](super::IdempotencyService).
    ///
    /// A state machine: reading the request body → acquiring the key's lock → looking up its
    /// record (replay, or 422) → running the inner service under the lease (the engine's one
    /// lifecycle, as `LockLayer`'s) → reading the response body → storing the record and
    /// releasing the lock in one step. Dropped before the record is written, it leaves one
    /// spawned, token-checked release behind, and the key is free for a retry.
    pub struct ResponseFuture<S, ReqBody, ResBody>
    where
        S: Service<Request<ReqBody>>,
        ResBody: Body,
    {
        #[pin]
        state: State<S, ReqBody, S::Future, ResBody, S::Error>,
        layer: Arc<IdempotencyState>,
        // The `lock` span, as `LockLayer`'s (disabled for requests without a key).
        span: Span,
    }
}

type Output<B, E> = Result<Response<ResponseBody<B>>, E>;

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody, F, ResBody, E>
    where
        ResBody: Body,
    {
        Reading {
            #[pin]
            body: ReqBody,
            buf: BytesMut,
            begun: Option<Begun<S>>,
        },
        Acquiring {
            acquire: BoxFuture<Result<Hold, LockError>>,
            pending: Option<Pending<S, ReqBody>>,
        },
        LookingUp {
            lookup: BoxFuture<Result<Option<Bytes>, StoreError>>,
            pending: Option<Pending<S, ReqBody>>,
            // `None` when the lock was contended: then only a record can answer.
            hold: Option<Hold>,
            contended: Option<LockError>,
        },
        Running {
            // Run with the lease as what its task holds, so that a nested acquire of its key
            // re-enters it (as behind the lock layer).
            #[pin]
            fut: TaskLocalFuture<Held, F>,
            run: Option<Run>,
        },
        Collecting {
            collect: Collect<ResBody>,
            run: Option<Run>,
        },
        Completing {
            complete: Release,
            stored: Arc<AtomicBool>,
            run: Option<Run>,
            response: Option<Response<ResponseBody<ResBody>>>,
        },
        Releasing {
            release: Release,
            output: Option<Output<ResBody, E>>,
        },
        Passthrough {
            #[pin]
            fut: F,
        },
        Done {
            output: Option<Output<ResBody, E>>,
        },
    }
}

/// A request with a valid key, before its body is read.
pub(crate) struct Begun<S> {
    pub(crate) service: S,
    pub(crate) parts: Parts,
    pub(crate) key: LockKey,
    pub(crate) idempotency_key: IdempotencyKey,
}

/// A request read and fingerprinted, waiting for its lock and record.
pub(crate) struct Pending<S, ReqBody> {
    service: S,
    request: Request<ReqBody>,
    key: LockKey,
    fingerprint: [u8; 32],
}

/// The held lock while the inner service runs and its response is read.
pub(crate) struct Run {
    hold: Hold,
    key: LockKey,
    fingerprint: [u8; 32],
}

const POLLED_AFTER_READY: &str = "idempotency ResponseFuture polled after completion";

impl<S, ReqBody, ResBody> ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<ReqBody>>,
    ResBody: Body,
{
    pub(crate) fn passthrough(layer: Arc<IdempotencyState>, fut: S::Future) -> Self {
        Self {
            state: State::Passthrough { fut },
            layer,
            span: Span::none(),
        }
    }

    pub(crate) fn rejected(layer: Arc<IdempotencyState>, response: Response<Bytes>) -> Self {
        Self {
            state: State::Done {
                output: Some(Ok(response.map(ResponseBody::full))),
            },
            layer,
            span: Span::none(),
        }
    }

    pub(crate) fn reading(layer: Arc<IdempotencyState>, begun: Begun<S>, body: ReqBody) -> Self {
        let span = telemetry::span(&begun.key, 1, layer.config.lock().key_display());
        Self {
            state: State::Reading {
                body,
                buf: BytesMut::new(),
                begun: Some(begun),
            },
            layer,
            span,
        }
    }
}

/// Answers `response` with `outcome`: after releasing the lock, if the request holds it.
fn answer<S, ReqBody, F, ResBody: Body, E>(
    span: &Span,
    hold: Option<Hold>,
    outcome: Outcome,
    response: Response<Bytes>,
) -> State<S, ReqBody, F, ResBody, E> {
    let output = Some(Ok(response.map(ResponseBody::full)));
    match hold {
        Some(mut hold) => {
            hold.finish(outcome);
            State::Releasing {
                release: hold.release(),
                output,
            }
        }
        None => {
            telemetry::record_end(span, outcome, None);
            State::Done { output }
        }
    }
}

/// The state of a [`ResponseFuture`] for service `S`.
type StateOf<S, ReqBody, ResBody> = State<
    S,
    ReqBody,
    <S as Service<Request<ReqBody>>>::Future,
    ResBody,
    <S as Service<Request<ReqBody>>>::Error,
>;

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: Body + From<Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
{
    type Output = Output<ResBody, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.span.enter();
        let (layer, span): (&IdempotencyState, &Span) = (this.layer, this.span);
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Reading { body, buf, begun } => {
                    ready!(poll_reading::<S, _, _>(layer, span, body, buf, begun, cx))
                }
                StateProj::Acquiring { acquire, pending } => {
                    ready!(poll_acquiring(layer, span, acquire, pending, cx))
                }
                StateProj::LookingUp {
                    lookup,
                    pending,
                    hold,
                    contended,
                } => ready!(poll_looking_up(
                    layer, span, lookup, pending, hold, contended, cx
                )),
                StateProj::Running { fut, run } => ready!(poll_running(layer, fut, run, cx)),
                StateProj::Collecting { collect, run } => {
                    ready!(poll_collecting::<S, _, _>(layer, collect, run, cx))
                }
                StateProj::Completing {
                    complete,
                    stored,
                    run,
                    response,
                } => {
                    let result = ready!(Pin::new(complete).poll(cx));
                    completed(taken(run), stored, result);
                    return Poll::Ready(Ok(taken(response)));
                }
                StateProj::Releasing { release, output } => {
                    // A failed release is logged by the release; the TTL frees the key.
                    let _ = ready!(Pin::new(release).poll(cx));
                    return Poll::Ready(taken(output));
                }
                StateProj::Passthrough { fut } => {
                    let output = ready!(fut.poll(cx));
                    return Poll::Ready(output.map(|r| r.map(ResponseBody::inner)));
                }
                StateProj::Done { output } => return Poll::Ready(taken(output)),
            };
            this.state.set(next);
        }
    }
}

/// What a state keeps until it moves on, taken as it does.
fn taken<T>(slot: &mut Option<T>) -> T {
    slot.take().expect(POLLED_AFTER_READY)
}

/// The answer `response`, without the lock (none was taken, or it is not ours).
fn rejected<S, ReqBody, F, ResBody: Body, E>(
    response: Response<Bytes>,
) -> State<S, ReqBody, F, ResBody, E> {
    State::Done {
        output: Some(Ok(response.map(ResponseBody::full))),
    }
}

/// Reading the request body: then fingerprinting it and acquiring the key's lock, or a 400 or
/// 413.
fn poll_reading<S, ReqBody, ResBody>(
    layer: &IdempotencyState,
    span: &Span,
    body: Pin<&mut ReqBody>,
    buf: &mut BytesMut,
    begun: &mut Option<Begun<S>>,
    cx: &mut Context<'_>,
) -> Poll<StateOf<S, ReqBody, ResBody>>
where
    S: Service<Request<ReqBody>>,
    ReqBody: Body + From<Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body,
{
    let config = &layer.config;
    if let Err(error) = ready!(read_body(body, buf, config.max_request_body, cx)) {
        let response = layer.reject(error);
        return Poll::Ready(answer(span, None, Outcome::BadRequest, response));
    }
    let Begun {
        service,
        parts,
        key,
        idempotency_key,
    } = taken(begun);
    let bytes = buf.split().freeze();
    let fingerprint = config.fingerprint.digest(&parts, &bytes);
    let mut request = Request::from_parts(parts, ReqBody::from(bytes));
    request.extensions_mut().insert(idempotency_key);
    let mut terms = layer
        .locker
        .terms(Some(config.lock().max_hold()))
        .with_on_lost(layer.on_lost);
    if let Some(wait) = &layer.wait {
        terms = terms.with_wait(wait.clone());
    }
    if let Some(ttl) = layer.ttl {
        terms = terms.with_ttl(ttl);
    }
    let acquire = layer.locker.hold(key.clone().into(), span.clone(), terms);
    Poll::Ready(State::Acquiring {
        acquire: Box::pin(acquire),
        pending: Some(Pending {
            service,
            request,
            key,
            fingerprint,
        }),
    })
}

/// Acquiring the key's lock: then looking up its record, held or not (a record answers a
/// retry whatever holds the lock), or a 503.
fn poll_acquiring<S, ReqBody, ResBody>(
    layer: &IdempotencyState,
    span: &Span,
    acquire: &mut BoxFuture<Result<Hold, LockError>>,
    pending: &mut Option<Pending<S, ReqBody>>,
    cx: &mut Context<'_>,
) -> Poll<StateOf<S, ReqBody, ResBody>>
where
    S: Service<Request<ReqBody>>,
    ResBody: Body,
{
    let (hold, contended) = match ready!(acquire.as_mut().poll(cx)) {
        Ok(hold) => (Some(hold), None),
        // Still held: by the first request, running, or by a retry that is replaying its
        // record right now. The record tells which.
        Err(error @ LockError::Contended { .. }) => (None, Some(error)),
        Err(error) => {
            telemetry::record_not_acquired(span, &error);
            return Poll::Ready(rejected(layer.reject(error.into())));
        }
    };
    let pending = pending.take();
    let key = pending.as_ref().expect(POLLED_AFTER_READY).key.clone();
    let store_timeout = layer.config.lock().store_timeout();
    let lookup: BoxFuture<_> = Box::pin(bounded(
        store_timeout,
        Arc::clone(&layer.records).lookup(key),
    ));
    Poll::Ready(State::LookingUp {
        lookup,
        pending,
        hold,
        contended,
    })
}

/// Looking up the key's record: a replay, a 422 for another request under the key, or, with
/// no record, running the request (the lock held) or a 409 (the lock contended).
fn poll_looking_up<S, ReqBody, ResBody>(
    layer: &IdempotencyState,
    span: &Span,
    lookup: &mut BoxFuture<Result<Option<Bytes>, StoreError>>,
    pending: &mut Option<Pending<S, ReqBody>>,
    hold: &mut Option<Hold>,
    contended: &mut Option<LockError>,
    cx: &mut Context<'_>,
) -> Poll<StateOf<S, ReqBody, ResBody>>
where
    S: Service<Request<ReqBody>>,
    ResBody: Body,
{
    let found = ready!(lookup.as_mut().poll(cx)).and_then(decode);
    let pending = taken(pending);
    let hold = hold.take();
    let (outcome, response) = match found {
        Err(error) => (
            Outcome::StoreError,
            layer.reject(LockError::from(error).into()),
        ),
        Ok(Some(record)) if record.fingerprint != pending.fingerprint => (
            Outcome::KeyReused,
            layer.reject(IdempotencyError::KeyReused),
        ),
        Ok(Some(record)) => {
            tracing::debug!(
                status = %record.status,
                "idempotency key finished before; replaying its response"
            );
            (Outcome::Replayed, record.replay())
        }
        Ok(None) => {
            return Poll::Ready(match hold {
                Some(hold) => start(pending, hold, layer.locker.engine().store.identity()),
                None => {
                    let error = taken(contended);
                    telemetry::record_not_acquired(span, &error);
                    rejected(layer.reject(error.into()))
                }
            });
        }
    };
    Poll::Ready(answer(span, hold, outcome, response))
}

/// Running the inner service under the lease: then reading a response to store, or releasing
/// (an error, a response not stored), or, once the lease is lost, aborting it.
fn poll_running<S, ReqBody, ResBody>(
    layer: &IdempotencyState,
    fut: Pin<&mut TaskLocalFuture<Held, S::Future>>,
    run: &mut Option<Run>,
    cx: &mut Context<'_>,
) -> Poll<StateOf<S, ReqBody, ResBody>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes>,
{
    let running = run.as_mut().expect(POLLED_AFTER_READY);
    let output = match ready!(poll_guarded(fut, &mut running.hold, cx)) {
        Guarded::Done(output) => output,
        Guarded::Aborted(reason) => {
            let response = layer.reject(LockError::LeaseLost(reason).into());
            let output = Some(Ok(response.map(ResponseBody::full)));
            // Moving on drops the running state, and the inner future with it (abort).
            return Poll::Ready(match taken(run).hold.abort(reason) {
                Some(release) => State::Releasing { release, output },
                None => State::Done { output },
            });
        }
    };
    let mut running = taken(run);
    let response = match output {
        Ok(response) => response,
        Err(error) => {
            running.hold.finish(Outcome::Failed);
            return Poll::Ready(State::Releasing {
                release: running.hold.release(),
                output: Some(Err(error)),
            });
        }
    };
    let config = &layer.config;
    let (head, body) = response.into_parts();
    // A holder whose fenced write was refused is stale: a newer request has used the resource
    // since, and this answer (a 409 `#stale-write`, most likely) is not the key's. Not stored,
    // so that a retry runs and finds what the newer request did.
    let stale = running.hold.lease().was_refused();
    let storable = config.store_when.should_store(&head) && !stale;
    let too_large = body.size_hint().lower() > config.max_response_body as u64;
    if !storable || too_large {
        tracing::debug!(
            status = %head.status,
            too_large,
            stale,
            "response not stored; a retry runs again"
        );
        running.hold.finish(Outcome::NotStored);
        return Poll::Ready(State::Releasing {
            release: running.hold.release(),
            output: Some(Ok(Response::from_parts(head, ResponseBody::inner(body)))),
        });
    }
    Poll::Ready(State::Collecting {
        collect: Collect::new(head, body, config.max_response_body),
        run: Some(running),
    })
}

/// Reading the response body, the lease renewed meanwhile: then storing the record with the
/// release, or releasing (a body larger than the limit, handed on as it is).
fn poll_collecting<S, ReqBody, ResBody>(
    layer: &IdempotencyState,
    collect: &mut Collect<ResBody>,
    run: &mut Option<Run>,
    cx: &mut Context<'_>,
) -> Poll<StateOf<S, ReqBody, ResBody>>
where
    S: Service<Request<ReqBody>>,
    ResBody: Body<Data = Bytes>,
{
    // Keep the lease renewed while the body is read. A loss now is settled by the record
    // write, which stores the record only if no newer request is there.
    let running = run.as_mut().expect(POLLED_AFTER_READY);
    let _ = running.hold.poll_lost(cx);
    let collected = ready!(collect.poll(cx));
    let mut running = taken(run);
    Poll::Ready(match collected {
        Collected::Whole {
            head,
            data,
            trailers,
        } => completing(layer, running, head, data, trailers),
        Collected::Partial(response) => {
            running.hold.finish(Outcome::NotStored);
            State::Releasing {
                release: running.hold.release(),
                output: Some(Ok(response)),
            }
        }
    })
}

/// Stores the record of a whole response with the release, in one step.
fn completing<S, ReqBody, F, ResBody: Body, E>(
    layer: &IdempotencyState,
    mut running: Run,
    head: http::response::Parts,
    data: Bytes,
    trailers: Option<http::HeaderMap>,
) -> State<S, ReqBody, F, ResBody, E> {
    let config = &layer.config;
    let record = Record {
        fingerprint: running.fingerprint,
        status: head.status,
        headers: head
            .headers
            .iter()
            .filter(|(name, _)| config.replay_headers.contains(name))
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect(),
        body: data.clone(),
    };
    // The record written with the release, in one step, fenced by the lease's token; after a
    // failure sent again in a spawned task while the lease is valid (it is token-checked), and
    // never followed by a plain release, which would free the key without the record. The
    // release's answer says whether the key was released; `stored`, whether the record was
    // written.
    let stored = Arc::new(AtomicBool::new(false));
    let complete = {
        let (records, key) = (Arc::clone(&layer.records), running.key.clone());
        let (token, retention) = (running.hold.token().clone(), config.retention);
        let fencing_token = running.hold.lease().fencing_token();
        let (record, stored) = (record.encode(), Arc::clone(&stored));
        running.hold.let_go_with(LetGo::new(move || {
            let stored = Arc::clone(&stored);
            let complete = Arc::clone(&records).complete(
                key.clone(),
                token.clone(),
                fencing_token,
                record.clone(),
                retention,
            );
            Box::pin(async move {
                let completed = complete.await?;
                stored.store(completed.stored, Ordering::Relaxed);
                Ok(completed.released)
            })
        }))
    };
    let body = ResponseBody::full_with_trailers(data, trailers);
    State::Completing {
        complete,
        stored,
        run: Some(running),
        response: Some(Response::from_parts(head, body)),
    }
}

/// Settles the hold once the record write (and release) answered.
fn completed(running: Run, stored: &AtomicBool, result: Result<bool, StoreError>) {
    let outcome = match &result {
        Ok(released) if stored.load(Ordering::Relaxed) => {
            if !released {
                tracing::warn!(
                    "the lease was lost before the response could be stored; nobody else holds \
                     the key, so it is stored all the same"
                );
            }
            Outcome::Stored
        }
        Ok(_) => {
            tracing::warn!(
                "the lease was lost before the response could be stored, and a newer request \
                 holds the key or stored its own: this one is not stored"
            );
            Outcome::NotStored
        }
        // Failed: it is sent again in a spawned task while the lease is valid; a retry
        // meanwhile gets 409, then the record. Never a plain release, which would free the key
        // without the record.
        Err(error) => {
            tracing::warn!(
                error = error as &dyn std::error::Error,
                "storing the idempotency record failed; sending it again while the lease is \
                 valid"
            );
            Outcome::NotStored
        }
    };
    running.hold.settle(outcome, result.as_ref().copied());
}

/// Reads the request body into `buf`, up to `limit` bytes.
fn read_body<B>(
    mut body: Pin<&mut B>,
    buf: &mut BytesMut,
    limit: usize,
    cx: &mut Context<'_>,
) -> Poll<Result<(), IdempotencyError>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    loop {
        match ready!(body.as_mut().poll_frame(cx)) {
            Some(Ok(frame)) => {
                // Request trailers are not part of the fingerprint; dropped.
                if let Ok(data) = frame.into_data() {
                    if buf.len() + bytes::Buf::remaining(&data) > limit {
                        return Poll::Ready(Err(IdempotencyError::BodyTooLarge { limit }));
                    }
                    bytes::BufMut::put(buf, data);
                }
            }
            Some(Err(error)) => {
                let error: BoxError = error.into();
                return Poll::Ready(Err(IdempotencyError::BodyUnreadable(Arc::from(error))));
            }
            None => return Poll::Ready(Ok(())),
        }
    }
}

/// A record read from the store, decoded.
fn decode(raw: Option<Bytes>) -> Result<Option<Record>, StoreError> {
    raw.map(|raw| {
        Record::decode(raw).ok_or_else(|| {
            StoreError::msg(
                StoreErrorKind::Backend,
                "an idempotency record in the store could not be decoded",
            )
        })
    })
    .transpose()
}

/// Starts the inner service under the lock.
fn start<S, ReqBody, ResBody>(
    pending: Pending<S, ReqBody>,
    hold: Hold,
    store: crate::store::StoreId,
) -> State<S, ReqBody, S::Future, ResBody, S::Error>
where
    S: Service<Request<ReqBody>>,
    ResBody: Body,
{
    let Pending {
        mut service,
        mut request,
        key,
        fingerprint,
    } = pending;
    request.extensions_mut().insert(hold.lease().clone());
    let fut = Held::within_current(hold.lease().clone(), store).scope(service.call(request));
    State::Running {
        fut,
        run: Some(Run {
            hold,
            key,
            fingerprint,
        }),
    }
}

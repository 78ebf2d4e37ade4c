use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use http::{Request, Response, request::Parts};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::timeout;
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
    engine::{Guarded, Hold, LetGo, Release, poll_guarded},
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
            #[pin]
            fut: F,
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

/// `fut`, bounded by `limit`.
fn bounded<T: Send + 'static>(
    limit: Duration,
    fut: BoxFuture<Result<T, StoreError>>,
) -> BoxFuture<Result<T, StoreError>> {
    Box::pin(async move {
        timeout(limit, fut)
            .await
            .unwrap_or_else(|_| Err(StoreError::timeout(limit)))
    })
}

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
        let layer: &Arc<IdempotencyState> = this.layer;
        let config = &layer.config;
        let store_timeout = config.lock().store_timeout();
        loop {
            match this.state.as_mut().project() {
                StateProj::Reading { body, buf, begun } => {
                    if let Err(error) = ready!(read_body(body, buf, config.max_request_body, cx)) {
                        let response = layer.reject(error);
                        let state = answer(this.span, None, Outcome::BadRequest, response);
                        this.state.set(state);
                        continue;
                    }
                    let Begun {
                        service,
                        parts,
                        key,
                        idempotency_key,
                    } = begun.take().expect(POLLED_AFTER_READY);
                    let bytes = buf.split().freeze();
                    let fingerprint = config.fingerprint.digest(&parts, &bytes);
                    let mut request = Request::from_parts(parts, ReqBody::from(bytes));
                    request.extensions_mut().insert(idempotency_key);
                    let terms = layer.locker.terms(Some(config.lock().max_hold()));
                    let acquire = layer
                        .locker
                        .hold(key.clone().into(), this.span.clone(), terms);
                    this.state.set(State::Acquiring {
                        acquire: Box::pin(acquire),
                        pending: Some(Pending {
                            service,
                            request,
                            key,
                            fingerprint,
                        }),
                    });
                }
                StateProj::Acquiring { acquire, pending } => {
                    let (hold, contended) = match ready!(acquire.as_mut().poll(cx)) {
                        Ok(hold) => (Some(hold), None),
                        // Still held: by the first request, running, or by a retry that is
                        // replaying its record right now. The record tells which.
                        Err(error @ LockError::Contended { .. }) => (None, Some(error)),
                        Err(error) => {
                            telemetry::record_not_acquired(this.span, &error);
                            let response = layer.reject(error.into());
                            this.state.set(State::Done {
                                output: Some(Ok(response.map(ResponseBody::full))),
                            });
                            continue;
                        }
                    };
                    let pending = pending.take();
                    let key = pending.as_ref().expect(POLLED_AFTER_READY).key.clone();
                    let lookup = bounded(store_timeout, Arc::clone(&layer.records).lookup(key));
                    this.state.set(State::LookingUp {
                        lookup,
                        pending,
                        hold,
                        contended,
                    });
                }
                StateProj::LookingUp {
                    lookup,
                    pending,
                    hold,
                    contended,
                } => {
                    let found = ready!(lookup.as_mut().poll(cx)).and_then(decode);
                    let pending = pending.take().expect(POLLED_AFTER_READY);
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
                        Ok(None) => match hold {
                            Some(hold) => {
                                this.state.set(start(pending, hold));
                                continue;
                            }
                            None => {
                                let error = contended.take().expect(POLLED_AFTER_READY);
                                telemetry::record_not_acquired(this.span, &error);
                                let response = layer.reject(error.into());
                                this.state.set(State::Done {
                                    output: Some(Ok(response.map(ResponseBody::full))),
                                });
                                continue;
                            }
                        },
                    };
                    this.state.set(answer(this.span, hold, outcome, response));
                }
                StateProj::Running { fut, run } => {
                    let running = run.as_mut().expect(POLLED_AFTER_READY);
                    let output = match ready!(poll_guarded(fut, &mut running.hold, cx)) {
                        Guarded::Done(output) => output,
                        Guarded::Aborted(reason) => {
                            let response = layer.reject(LockError::LeaseLost(reason).into());
                            let output = Some(Ok(response.map(ResponseBody::full)));
                            // Dropping the running state drops the inner future (abort).
                            let running = run.take().expect(POLLED_AFTER_READY);
                            match running.hold.abort(reason) {
                                Some(release) => {
                                    this.state.set(State::Releasing { release, output })
                                }
                                None => this.state.set(State::Done { output }),
                            }
                            continue;
                        }
                    };
                    let mut running = run.take().expect(POLLED_AFTER_READY);
                    let response = match output {
                        Ok(response) => response,
                        Err(error) => {
                            running.hold.finish(Outcome::Failed);
                            this.state.set(State::Releasing {
                                release: running.hold.release(),
                                output: Some(Err(error)),
                            });
                            continue;
                        }
                    };
                    let (head, body) = response.into_parts();
                    let storable = config.store_when.should_store(&head);
                    let too_large = body.size_hint().lower() > config.max_response_body as u64;
                    if !storable || too_large {
                        tracing::debug!(
                            status = %head.status,
                            too_large,
                            "response not stored; a retry runs again"
                        );
                        running.hold.finish(Outcome::NotStored);
                        this.state.set(State::Releasing {
                            release: running.hold.release(),
                            output: Some(Ok(Response::from_parts(head, ResponseBody::inner(body)))),
                        });
                        continue;
                    }
                    this.state.set(State::Collecting {
                        collect: Collect::new(head, body, config.max_response_body),
                        run: Some(running),
                    });
                }
                StateProj::Collecting { collect, run } => {
                    // Keep the lease renewed while the body is read. A loss now is settled by the
                    // record write, which stores the record only if no newer request is there.
                    let running = run.as_mut().expect(POLLED_AFTER_READY);
                    let _ = running.hold.poll_lost(cx);
                    let collected = ready!(collect.poll(cx));
                    let mut running = run.take().expect(POLLED_AFTER_READY);
                    let (head, data, trailers) = match collected {
                        Collected::Whole {
                            head,
                            data,
                            trailers,
                        } => (head, data, trailers),
                        Collected::Partial(response) => {
                            running.hold.finish(Outcome::NotStored);
                            this.state.set(State::Releasing {
                                release: running.hold.release(),
                                output: Some(Ok(response)),
                            });
                            continue;
                        }
                    };
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
                    // The record written with the release, in one step, fenced by the lease's
                    // token; after a failure sent again in a spawned task while the lease is
                    // valid (it is token-checked), and never followed by a plain release, which
                    // would free the key without the record. The release's answer says whether
                    // the key was released; `stored`, whether the record was written.
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
                    this.state.set(State::Completing {
                        complete,
                        stored,
                        run: Some(running),
                        response: Some(Response::from_parts(head, body)),
                    });
                }
                StateProj::Completing {
                    complete,
                    stored,
                    run,
                    response,
                } => {
                    let result = ready!(Pin::new(complete).poll(cx));
                    let running = run.take().expect(POLLED_AFTER_READY);
                    let outcome = match &result {
                        Ok(released) if stored.load(Ordering::Relaxed) => {
                            if !released {
                                tracing::warn!(
                                    "the lease was lost before the response could be stored; \
                                     nobody else holds the key, so it is stored all the same"
                                );
                            }
                            Outcome::Stored
                        }
                        Ok(_) => {
                            tracing::warn!(
                                "the lease was lost before the response could be stored, and a \
                                 newer request holds the key or stored its own: this one is not \
                                 stored"
                            );
                            Outcome::NotStored
                        }
                        // Failed: it is sent again in a spawned task while the lease is
                        // valid; a retry meanwhile gets 409, then the record. Never a plain
                        // release, which would free the key without the record.
                        Err(error) => {
                            tracing::warn!(
                                error = error as &dyn std::error::Error,
                                "storing the idempotency record failed; sending it again while \
                                 the lease is valid"
                            );
                            Outcome::NotStored
                        }
                    };
                    running.hold.settle(outcome, result.as_ref().copied());
                    return Poll::Ready(Ok(response.take().expect(POLLED_AFTER_READY)));
                }
                StateProj::Releasing { release, output } => {
                    // A failed release is logged by the release; the TTL frees the key.
                    let _ = ready!(Pin::new(release).poll(cx));
                    return Poll::Ready(output.take().expect(POLLED_AFTER_READY));
                }
                StateProj::Passthrough { fut } => {
                    let output = ready!(fut.poll(cx));
                    return Poll::Ready(output.map(|r| r.map(ResponseBody::inner)));
                }
                StateProj::Done { output } => {
                    return Poll::Ready(output.take().expect(POLLED_AFTER_READY));
                }
            }
        }
    }
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
    let fut = service.call(request);
    State::Running {
        fut,
        run: Some(Run {
            hold,
            key,
            fingerprint,
        }),
    }
}

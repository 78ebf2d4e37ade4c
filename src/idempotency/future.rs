use std::{
    collections::VecDeque,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request, Response, request::Parts};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::timeout;
use tower::{BoxError, Service};
use tracing::Span;

use super::{
    body::ResponseBody, error::IdempotencyError, key::IdempotencyKey, layer::Shared, record::Record,
};
use crate::{
    config::OnLeaseLost,
    error::LockError,
    key::LockKey,
    lease::Lease,
    locker::{Held, Release, ReleaseGuard},
    renew::Renewer,
    store::{BoxFuture, StoreError, StoreErrorKind},
    telemetry,
};

pin_project! {
    /// Response future of [`IdempotencyService`](super::IdempotencyService).
    ///
    /// A state machine: reading the request body → acquiring the key's lock → looking up its
    /// record (replay, or 422) → running the inner service (renewing the lease) → reading the
    /// response body → storing the record and releasing the lock in one step. Dropped before
    /// the record is written, it leaves one spawned, token-checked release behind, and the key
    /// is free for a retry.
    pub struct ResponseFuture<S, ReqBody, ResBody>
    where
        S: Service<Request<ReqBody>>,
        ResBody: Body,
    {
        #[pin]
        state: State<S, ReqBody, S::Future, ResBody, S::Error>,
        shared: Arc<Shared>,
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
            acquire: BoxFuture<Result<Held, LockError>>,
            pending: Option<Pending<S, ReqBody>>,
        },
        LookingUp {
            lookup: BoxFuture<Result<Option<Bytes>, StoreError>>,
            pending: Option<Pending<S, ReqBody>>,
            // `None` when the lock was contended: then only a record can answer.
            held: Option<Held>,
            contended: Option<LockError>,
        },
        Running {
            #[pin]
            fut: F,
            run: Option<Run>,
        },
        Collecting {
            body: Option<Pin<Box<ResBody>>>,
            head: Option<http::response::Parts>,
            chunks: VecDeque<Bytes>,
            size: usize,
            trailers: Option<HeaderMap>,
            run: Option<Run>,
        },
        Completing {
            complete: BoxFuture<Result<bool, StoreError>>,
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

/// A held lock while the inner service runs and its response is read.
pub(crate) struct Run {
    renewer: Option<Renewer>,
    lease: Lease,
    guard: ReleaseGuard,
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
    pub(crate) fn passthrough(shared: Arc<Shared>, fut: S::Future) -> Self {
        Self {
            state: State::Passthrough { fut },
            shared,
            span: Span::none(),
        }
    }

    pub(crate) fn rejected(shared: Arc<Shared>, response: Response<Bytes>) -> Self {
        Self {
            state: State::Done {
                output: Some(Ok(response.map(ResponseBody::full))),
            },
            shared,
            span: Span::none(),
        }
    }

    pub(crate) fn reading(shared: Arc<Shared>, begun: Begun<S>, body: ReqBody) -> Self {
        let span = telemetry::span(&begun.key, shared.config.lock.key_display());
        Self {
            state: State::Reading {
                body,
                buf: BytesMut::new(),
                begun: Some(begun),
            },
            shared,
            span,
        }
    }
}

/// Releases `held` (if the lock is ours) before answering `response`.
fn answer<S, ReqBody, F, ResBody: Body, E>(
    held: Option<Held>,
    response: Response<Bytes>,
) -> State<S, ReqBody, F, ResBody, E> {
    let output = Some(Ok(response.map(ResponseBody::full)));
    match held {
        Some(mut held) => State::Releasing {
            release: held.guard.release_now(),
            output,
        },
        None => State::Done { output },
    }
}

/// How reading a response body for the record ended.
enum Collected<E> {
    End,
    TooLarge,
    Failed(E),
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
        let shared: &Arc<Shared> = this.shared;
        let config = &shared.config;
        let store_timeout = config.lock.store_timeout();
        loop {
            match this.state.as_mut().project() {
                StateProj::Reading {
                    mut body,
                    buf,
                    begun,
                } => {
                    let limit = config.max_request_body;
                    let read: Result<(), IdempotencyError> = loop {
                        match ready!(body.as_mut().poll_frame(cx)) {
                            Some(Ok(frame)) => {
                                // Request trailers are not part of the fingerprint; dropped.
                                if let Ok(data) = frame.into_data() {
                                    if buf.len() + bytes::Buf::remaining(&data) > limit {
                                        break Err(IdempotencyError::BodyTooLarge { limit });
                                    }
                                    bytes::BufMut::put(&mut *buf, data);
                                }
                            }
                            Some(Err(error)) => {
                                let error: BoxError = error.into();
                                break Err(IdempotencyError::BodyUnreadable(Arc::from(error)));
                            }
                            None => break Ok(()),
                        }
                    };
                    if let Err(error) = read {
                        telemetry::record_end("bad_request", None);
                        let response = shared.reject(error);
                        this.state.set(answer(None, response));
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
                    let acquire = Box::pin(shared.locker.clone().acquire_held(key.clone()));
                    this.state.set(State::Acquiring {
                        acquire,
                        pending: Some(Pending {
                            service,
                            request,
                            key,
                            fingerprint,
                        }),
                    });
                }
                StateProj::Acquiring { acquire, pending } => {
                    let (held, contended) = match ready!(acquire.as_mut().poll(cx)) {
                        Ok(held) => {
                            let waited = held
                                .acquired_at
                                .saturating_duration_since(held.requested_at);
                            telemetry::record_acquired(
                                held.lease.fencing_token(),
                                held.attempts,
                                waited,
                            );
                            (Some(held), None)
                        }
                        // Still held: by the first request, running, or by a retry that is
                        // replaying its record right now. The record tells which.
                        Err(error) if matches!(error, LockError::Contended { .. }) => {
                            (None, Some(error))
                        }
                        Err(error) => {
                            telemetry::record_end(telemetry::outcome(&error), None);
                            let response = shared.reject(error.into());
                            this.state.set(answer(None, response));
                            continue;
                        }
                    };
                    let pending = pending.take();
                    let key = pending.as_ref().expect(POLLED_AFTER_READY).key.clone();
                    let lookup = bounded(store_timeout, Arc::clone(&shared.records).lookup(key));
                    this.state.set(State::LookingUp {
                        lookup,
                        pending,
                        held,
                        contended,
                    });
                }
                StateProj::LookingUp {
                    lookup,
                    pending,
                    held,
                    contended,
                } => {
                    let found = ready!(lookup.as_mut().poll(cx));
                    let pending = pending.take().expect(POLLED_AFTER_READY);
                    let mut held = held.take();
                    let found = found.and_then(|raw| {
                        raw.map(|raw| {
                            Record::decode(raw).ok_or_else(|| {
                                StoreError::msg(
                                    StoreErrorKind::Backend,
                                    "an idempotency record in the store could not be decoded",
                                )
                            })
                        })
                        .transpose()
                    });
                    let (outcome, response) = match found {
                        Err(error) => ("store_error", shared.reject(LockError::from(error).into())),
                        Ok(Some(record)) if record.fingerprint != pending.fingerprint => {
                            ("key_reused", shared.reject(IdempotencyError::KeyReused))
                        }
                        Ok(Some(record)) => {
                            tracing::debug!(
                                status = %record.status,
                                "idempotency key finished before; replaying its response"
                            );
                            ("replayed", record.replay())
                        }
                        Ok(None) => {
                            if let Some(held) = held.take() {
                                this.state.set(start(shared, pending, held));
                                continue;
                            }
                            let error = contended.take().expect(POLLED_AFTER_READY);
                            (telemetry::outcome(&error), shared.reject(error.into()))
                        }
                    };
                    telemetry::record_end(outcome, held.as_ref().map(|h| &h.lease));
                    this.state.set(answer(held, response));
                    continue;
                }
                StateProj::Running { fut, run } => {
                    if let Some(running) = run.as_mut() {
                        let lost = match running.renewer.as_mut() {
                            Some(renewer) => renewer.poll_lost(cx),
                            None => Poll::Pending,
                        };
                        if let Poll::Ready(reason) = lost {
                            running.renewer = None;
                            if config.lock.on_lease_lost() == OnLeaseLost::Abort {
                                telemetry::record_end("lease_lost", Some(&running.lease));
                                let response = shared.reject(LockError::LeaseLost(reason).into());
                                let release = running.guard.release_now();
                                // Dropping the running state drops the inner future: abort.
                                this.state.set(State::Releasing {
                                    release,
                                    output: Some(Ok(response.map(ResponseBody::full))),
                                });
                                continue;
                            }
                        }
                    }
                    let output = ready!(fut.poll(cx));
                    let mut running = run.take().expect(POLLED_AFTER_READY);
                    let response = match output {
                        Ok(response) => response,
                        Err(error) => {
                            telemetry::record_end("failed", Some(&running.lease));
                            this.state.set(State::Releasing {
                                release: running.guard.release_now(),
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
                        telemetry::record_end("not_stored", Some(&running.lease));
                        this.state.set(State::Releasing {
                            release: running.guard.release_now(),
                            output: Some(Ok(Response::from_parts(head, ResponseBody::inner(body)))),
                        });
                        continue;
                    }
                    this.state.set(State::Collecting {
                        body: Some(Box::pin(body)),
                        head: Some(head),
                        chunks: VecDeque::new(),
                        size: 0,
                        trailers: None,
                        run: Some(running),
                    });
                }
                StateProj::Collecting {
                    body,
                    head,
                    chunks,
                    size,
                    trailers,
                    run,
                } => {
                    // Keep the lease renewed while the body is read. A loss now is found by
                    // the record write, which then writes nothing.
                    if let Some(running) = run.as_mut()
                        && let Some(renewer) = running.renewer.as_mut()
                        && renewer.poll_lost(cx).is_ready()
                    {
                        running.renewer = None;
                    }
                    let reading = body.as_mut().expect(POLLED_AFTER_READY);
                    let limit = config.max_response_body;
                    let collected = loop {
                        match ready!(reading.as_mut().poll_frame(cx)) {
                            None => break Collected::End,
                            Some(Err(error)) => break Collected::Failed(error),
                            Some(Ok(frame)) => match frame.into_data() {
                                Ok(data) => {
                                    *size += data.len();
                                    chunks.push_back(data);
                                    if *size > limit {
                                        break Collected::TooLarge;
                                    }
                                }
                                Err(frame) => {
                                    if let Ok(more) = frame.into_trailers() {
                                        trailers.get_or_insert_with(HeaderMap::new).extend(more);
                                    }
                                }
                            },
                        }
                    };
                    let mut running = run.take().expect(POLLED_AFTER_READY);
                    let head = head.take().expect(POLLED_AFTER_READY);
                    let rest = body.take().expect(POLLED_AFTER_READY);
                    let chunks = std::mem::take(chunks);
                    let error = match collected {
                        Collected::End => {
                            let data = concat(chunks);
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
                            let complete = bounded(
                                store_timeout,
                                Arc::clone(&shared.records).complete(
                                    running.key.clone(),
                                    running.guard.token().clone(),
                                    record.encode(),
                                    config.retention,
                                ),
                            );
                            let body = ResponseBody::full_with_trailers(data, trailers.take());
                            this.state.set(State::Completing {
                                complete,
                                run: Some(running),
                                response: Some(Response::from_parts(head, body)),
                            });
                            continue;
                        }
                        Collected::TooLarge => {
                            tracing::debug!(
                                limit,
                                "response larger than max_response_body: not stored; a retry runs again"
                            );
                            None
                        }
                        Collected::Failed(error) => {
                            tracing::debug!("response body failed: not stored");
                            Some(error)
                        }
                    };
                    telemetry::record_end("not_stored", Some(&running.lease));
                    let body = ResponseBody::prefixed(chunks, error, rest);
                    this.state.set(State::Releasing {
                        release: running.guard.release_now(),
                        output: Some(Ok(Response::from_parts(head, body))),
                    });
                }
                StateProj::Completing {
                    complete,
                    run,
                    response,
                } => {
                    let result = ready!(complete.as_mut().poll(cx));
                    let mut running = run.take().expect(POLLED_AFTER_READY);
                    let outcome = if matches!(result, Ok(true)) {
                        "stored"
                    } else {
                        "not_stored"
                    };
                    telemetry::record_end(outcome, Some(&running.lease));
                    match result {
                        Ok(true) => running.guard.disarm(true),
                        Ok(false) => {
                            running.guard.disarm(false);
                            tracing::warn!(
                                "the lease was lost before the response could be stored; a \
                                 retry runs the handler again"
                            );
                        }
                        // Maybe written, maybe not: the still-armed guard spawns a token-checked
                        // release as `running` drops, which is a no-op if it was.
                        Err(error) => tracing::warn!(
                            error = &error as &dyn std::error::Error,
                            "storing the idempotency record failed; a retry runs the handler again"
                        ),
                    }
                    drop(running);
                    return Poll::Ready(Ok(response.take().expect(POLLED_AFTER_READY)));
                }
                StateProj::Releasing { release, output } => {
                    // A failed release is logged by the guard; the TTL frees the key.
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

/// Starts the inner service under the lock.
fn start<S, ReqBody, ResBody>(
    shared: &Shared,
    pending: Pending<S, ReqBody>,
    held: Held,
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
    request.extensions_mut().insert(held.lease.clone());
    let max_hold = shared.config.lock.max_hold();
    let renewer = shared.locker.renewer(&held, Some(max_hold));
    let fut = service.call(request);
    State::Running {
        fut,
        run: Some(Run {
            renewer: Some(renewer),
            lease: held.lease,
            guard: held.guard,
            key,
            fingerprint,
        }),
    }
}

fn concat(mut chunks: VecDeque<Bytes>) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop_front().unwrap_or_default(),
        _ => {
            let mut all = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
            for chunk in chunks {
                all.extend_from_slice(&chunk);
            }
            all.freeze()
        }
    }
}

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::task::futures::TaskLocalFuture;
use tower::Service;
use tracing::Span;

use super::{
    body::{BodyHold, ResponseBody},
    read::Reading,
    state::LockState,
};
use crate::{
    engine::{Guarded, Held, Hold, Release, poll_guarded},
    error::LockError,
    key::KeySet,
    store::BoxFuture,
    telemetry::{self, Outcome},
};

pin_project! {
    /// Response future of [`LockService`](super::LockService).
    ///
    /// A state machine: reading the body (a layer whose keys are in it) → acquiring (with the
    /// wait policy) → running the inner service (renewing the lease on a timer) → releasing →
    /// done. Dropped in any state, it leaves nothing behind but one spawned, token-checked
    /// release.
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody, S::Future, S::Response, S::Error>,
        // The `lock` span (disabled for requests that are not locked).
        span: Span,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody, F, R, E> {
        Reading {
            state: Arc<LockState>,
            read: Reading<ReqBody>,
            service: Option<S>,
        },
        Acquiring {
            state: Arc<LockState>,
            acquire: BoxFuture<Result<Hold, LockError>>,
            service: Option<S>,
            request: Option<Request<ReqBody>>,
        },
        // A request passed through unlocked.
        Passing {
            #[pin]
            fut: F,
        },
        Running {
            // Run with the lease as what its task holds, so that a nested acquire of its keys
            // re-enters it.
            #[pin]
            fut: TaskLocalFuture<Held, F>,
            state: Option<Arc<LockState>>,
            // `None` once the inner service answered.
            hold: Option<Hold>,
        },
        Releasing {
            release: Release,
            output: Option<Result<R, E>>,
        },
        // A rejection sent once the lease is released (the request outlived `max_hold`).
        ReleasingRejected {
            release: Release,
            response: Option<Response<Bytes>>,
        },
        Rejected {
            response: Option<Response<Bytes>>,
        },
    }
}

const POLLED_AFTER_READY: &str = "ResponseFuture polled after completion";

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn unlocked(fut: S::Future) -> Self {
        Self {
            state: State::Passing { fut },
            span: Span::none(),
        }
    }

    pub(crate) fn rejected(response: Response<Bytes>) -> Self {
        Self {
            state: State::Rejected {
                response: Some(response),
            },
            span: Span::none(),
        }
    }

    pub(crate) fn acquiring(
        state: Arc<LockState>,
        keys: KeySet,
        service: S,
        request: Request<ReqBody>,
    ) -> Self {
        let (state, span) = acquiring(state, keys, service, request);
        Self { state, span }
    }

    /// Reads the body for the keys first.
    pub(crate) fn reading(state: Arc<LockState>, read: Reading<ReqBody>, service: S) -> Self {
        Self {
            state: State::Reading {
                state,
                read,
                service: Some(service),
            },
            span: Span::none(),
        }
    }
}

/// The state of a [`ResponseFuture`] for service `S`.
type StateOf<S, ReqBody> = State<
    S,
    ReqBody,
    <S as Service<Request<ReqBody>>>::Future,
    <S as Service<Request<ReqBody>>>::Response,
    <S as Service<Request<ReqBody>>>::Error,
>;

/// The acquiring state for `keys`, and the lease's span.
fn acquiring<S, ReqBody>(
    state: Arc<LockState>,
    keys: KeySet,
    service: S,
    request: Request<ReqBody>,
) -> (StateOf<S, ReqBody>, Span)
where
    S: Service<Request<ReqBody>>,
{
    let locker = &state.locker;
    let span = match keys.first() {
        Some(key) => telemetry::span(key, keys.len(), locker.config().key_display()),
        None => Span::none(),
    };
    let terms = locker.terms(Some(locker.config().max_hold()));
    let acquire = Box::pin(locker.hold(keys, span.clone(), terms));
    let state = State::Acquiring {
        state,
        acquire,
        service: Some(service),
        request: Some(request),
    };
    (state, span)
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let _entered = this.span.enter();
            match this.state.as_mut().project() {
                StateProj::Reading {
                    state,
                    read,
                    service,
                } => {
                    let read = ready!(read.as_mut().poll(cx));
                    let state = Arc::clone(state);
                    let mut service = service.take().expect(POLLED_AFTER_READY);
                    drop(_entered);
                    match read {
                        Ok((request, Some(keys))) => {
                            let (next, span) = acquiring(state, keys, service, request);
                            *this.span = span;
                            this.state.set(next);
                        }
                        Ok((request, None)) => this.state.set(State::Passing {
                            fut: service.call(request),
                        }),
                        Err(rejection) => this.state.set(State::Rejected {
                            response: Some(state.reject(rejection.into())),
                        }),
                    }
                }
                StateProj::Acquiring {
                    state,
                    acquire,
                    service,
                    request,
                } => {
                    let hold = match ready!(acquire.as_mut().poll(cx)) {
                        Ok(hold) => hold,
                        Err(error) => {
                            telemetry::record_not_acquired(this.span, &error);
                            let response = state.reject(error);
                            this.state.set(State::Rejected {
                                response: Some(response),
                            });
                            continue;
                        }
                    };
                    let mut request = request.take().expect(POLLED_AFTER_READY);
                    request.extensions_mut().insert(hold.lease().clone());
                    let fut = service.take().expect(POLLED_AFTER_READY).call(request);
                    let store = state.locker.engine().store.identity();
                    let fut = Held::within_current(hold.lease().clone(), store).scope(fut);
                    let state = Some(Arc::clone(state));
                    this.state.set(State::Running {
                        fut,
                        state,
                        hold: Some(hold),
                    });
                }
                StateProj::Passing { fut } => {
                    let output = ready!(fut.poll(cx));
                    return Poll::Ready(output.map(|r| r.map(ResponseBody::new)));
                }
                StateProj::Running { fut, state, hold } => {
                    let held = hold.as_mut().expect(POLLED_AFTER_READY);
                    let output = match ready!(poll_guarded(fut, held, cx)) {
                        Guarded::Done(output) => output,
                        Guarded::Aborted(reason) => {
                            let state = state.take().expect(POLLED_AFTER_READY);
                            let response = state.reject(LockError::LeaseLost(reason));
                            // Dropping the running state drops the inner future (abort).
                            let hold = hold.take().expect(POLLED_AFTER_READY);
                            match hold.abort(reason) {
                                Some(release) => this.state.set(State::ReleasingRejected {
                                    release,
                                    response: Some(response),
                                }),
                                None => this.state.set(State::Rejected {
                                    response: Some(response),
                                }),
                            }
                            continue;
                        }
                    };
                    let state = state.take().expect(POLLED_AFTER_READY);
                    let mut hold = hold.take().expect(POLLED_AFTER_READY);
                    hold.finish(match &output {
                        Err(_) => Outcome::Failed,
                        Ok(_) if hold.lease().is_lost() => Outcome::CompletedLeaseLost,
                        Ok(_) => Outcome::Completed,
                    });
                    match output {
                        Ok(response) if state.locker.config().hold_until_body_end() => {
                            let hold = BodyHold::new(hold.into_background(state.locker.engine()));
                            return Poll::Ready(Ok(
                                response.map(|body| ResponseBody::holding(body, hold))
                            ));
                        }
                        output => {
                            // Release before handing the response on, so a client that retries
                            // at once never meets its own lock.
                            this.state.set(State::Releasing {
                                release: hold.release(),
                                output: Some(output),
                            });
                        }
                    }
                }
                StateProj::Releasing { release, output } => {
                    // A failed release is logged by the release; the TTL frees the key.
                    let _ = ready!(Pin::new(release).poll(cx));
                    let output = output.take().expect(POLLED_AFTER_READY);
                    return Poll::Ready(output.map(|r| r.map(ResponseBody::new)));
                }
                StateProj::ReleasingRejected { release, response } => {
                    let _ = ready!(Pin::new(release).poll(cx));
                    let response = response.take().expect(POLLED_AFTER_READY);
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
                StateProj::Rejected { response } => {
                    let response = response.take().expect(POLLED_AFTER_READY);
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}

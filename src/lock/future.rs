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
    error::{LockError, LostReason},
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
    let mut terms = locker
        .terms(Some(locker.config().max_hold()))
        .with_on_lost(state.on_lost);
    if let Some(wait) = &state.wait {
        terms = terms.with_wait(wait.clone());
    }
    if let Some(ttl) = state.ttl {
        terms = terms.with_ttl(ttl);
    }
    let acquire = Box::pin(locker.hold(keys, span.clone(), terms));
    let state = State::Acquiring {
        state,
        acquire,
        service: Some(service),
        request: Some(request),
    };
    (state, span)
}

/// What the future's output is for service `S`.
type OutputOf<S, ReqBody, ResBody> =
    Result<Response<ResponseBody<ResBody>>, <S as Service<Request<ReqBody>>>::Error>;

/// Where one state's step leads.
enum Step<St, Out> {
    /// The future is ready with this.
    Ready(Out),
    /// On to this state.
    Next(St),
    /// On to this state, in this span (the lock's, once the body named the keys).
    NextIn(St, Span),
}

/// A step of a [`ResponseFuture`] for service `S`.
type StepOf<S, ReqBody, ResBody> = Step<StateOf<S, ReqBody>, OutputOf<S, ReqBody, ResBody>>;

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = OutputOf<S, ReqBody, ResBody>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let entered = this.span.enter();
            let step = match this.state.as_mut().project() {
                StateProj::Reading {
                    state,
                    read,
                    service,
                } => ready!(poll_reading(state, read, service, cx)),
                StateProj::Acquiring {
                    state,
                    acquire,
                    service,
                    request,
                } => ready!(poll_acquiring(
                    state, acquire, service, request, this.span, cx
                )),
                StateProj::Passing { fut } => Step::Ready(handed_on(ready!(fut.poll(cx)))),
                StateProj::Running { fut, state, hold } => {
                    ready!(poll_running::<S, ReqBody, ResBody>(fut, state, hold, cx))
                }
                StateProj::Releasing { release, output } => {
                    // A failed release is logged by the release; the TTL frees the key.
                    let _ = ready!(Pin::new(release).poll(cx));
                    Step::Ready(handed_on(taken(output)))
                }
                StateProj::ReleasingRejected { release, response } => {
                    let _ = ready!(Pin::new(release).poll(cx));
                    Step::Ready(Ok(taken(response).map(ResponseBody::full)))
                }
                StateProj::Rejected { response } => {
                    Step::Ready(Ok(taken(response).map(ResponseBody::full)))
                }
            };
            match step {
                Step::Ready(output) => return Poll::Ready(output),
                // In the span still: dropping the state left (the inner future, on an abort)
                // happens in it.
                Step::Next(next) => this.state.set(next),
                Step::NextIn(next, span) => {
                    drop(entered);
                    *this.span = span;
                    this.state.set(next);
                }
            }
        }
    }
}

/// The inner service's answer, as the layer hands it on.
fn handed_on<B, E>(output: Result<Response<B>, E>) -> Result<Response<ResponseBody<B>>, E> {
    output.map(|response| response.map(ResponseBody::new))
}

/// What a state keeps until it moves on, taken as it does.
fn taken<T>(slot: &mut Option<T>) -> T {
    slot.take().expect(POLLED_AFTER_READY)
}

/// Reading the body: then acquiring the keys it names, passing it through (no key), or
/// rejecting it.
fn poll_reading<S, ReqBody, ResBody>(
    state: &Arc<LockState>,
    read: &mut Reading<ReqBody>,
    service: &mut Option<S>,
    cx: &mut Context<'_>,
) -> Poll<StepOf<S, ReqBody, ResBody>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    let read = ready!(read.as_mut().poll(cx));
    let state = Arc::clone(state);
    let mut service = taken(service);
    Poll::Ready(match read {
        Ok((request, Some(keys))) => {
            let (next, span) = acquiring(state, keys, service, request);
            Step::NextIn(next, span)
        }
        Ok((request, None)) => Step::Next(State::Passing {
            fut: service.call(request),
        }),
        Err(rejection) => Step::Next(State::Rejected {
            response: Some(state.reject(rejection.into())),
        }),
    })
}

/// Acquiring: then running the inner service with the lease, or rejecting the request.
fn poll_acquiring<S, ReqBody, ResBody>(
    state: &Arc<LockState>,
    acquire: &mut BoxFuture<Result<Hold, LockError>>,
    service: &mut Option<S>,
    request: &mut Option<Request<ReqBody>>,
    span: &Span,
    cx: &mut Context<'_>,
) -> Poll<StepOf<S, ReqBody, ResBody>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    let hold = match ready!(acquire.as_mut().poll(cx)) {
        Ok(hold) => hold,
        Err(error) => {
            telemetry::record_not_acquired(span, &error);
            return Poll::Ready(Step::Next(State::Rejected {
                response: Some(state.reject(error)),
            }));
        }
    };
    let mut request = taken(request);
    request.extensions_mut().insert(hold.lease().clone());
    let fut = taken(service).call(request);
    Poll::Ready(Step::Next(State::Running {
        fut: Held::within_current(hold.lease().clone(), state.locker.engine().store.identity())
            .scope(fut),
        state: Some(Arc::clone(state)),
        hold: Some(hold),
    }))
}

/// Running the inner service under the lease: then releasing (or handing the lease to the
/// body), or, once the lease is lost, aborting it.
fn poll_running<S, ReqBody, ResBody>(
    fut: Pin<&mut TaskLocalFuture<Held, S::Future>>,
    state: &mut Option<Arc<LockState>>,
    hold: &mut Option<Hold>,
    cx: &mut Context<'_>,
) -> Poll<StepOf<S, ReqBody, ResBody>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    let held = hold.as_mut().expect(POLLED_AFTER_READY);
    let output = match ready!(poll_guarded(fut, held, cx)) {
        Guarded::Done(output) => output,
        Guarded::Aborted(reason) => return Poll::Ready(aborted(taken(state), taken(hold), reason)),
    };
    let state = taken(state);
    let mut hold = taken(hold);
    hold.finish(match &output {
        Err(_) => Outcome::Failed,
        Ok(_) if hold.lease().is_lost() => Outcome::CompletedLeaseLost,
        Ok(_) => Outcome::Completed,
    });
    Poll::Ready(match output {
        Ok(response) if state.hold_until_body_end => {
            let hold = BodyHold::new(hold.into_background(state.locker.engine()));
            Step::Ready(Ok(response.map(|body| ResponseBody::holding(body, hold))))
        }
        // Release before handing the response on, so a client that retries at once never
        // meets its own lock.
        output => Step::Next(State::Releasing {
            release: hold.release(),
            output: Some(output),
        }),
    })
}

/// The lease was lost while the inner service ran: the 503, once the lease is released if it
/// is still ours. Moving on drops the running state, and the inner future with it (abort).
fn aborted<S, ReqBody, Out>(
    state: Arc<LockState>,
    hold: Hold,
    reason: LostReason,
) -> Step<StateOf<S, ReqBody>, Out>
where
    S: Service<Request<ReqBody>>,
{
    let response = Some(state.reject(LockError::LeaseLost(reason)));
    match hold.abort(reason) {
        Some(release) => Step::Next(State::ReleasingRejected { release, response }),
        None => Step::Next(State::Rejected { response }),
    }
}

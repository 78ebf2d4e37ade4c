use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower::Service;
use tracing::Span;

use crate::{
    body::{BodyHold, ResponseBody},
    config::OnLeaseLost,
    error::{LockError, LostReason},
    key::LockKey,
    layer::Shared,
    lease::Lease,
    locker::{Held, Release, ReleaseGuard},
    renew::Renewer,
    store::BoxFuture,
    telemetry,
};

pin_project! {
    /// Response future of [`LockService`](crate::LockService).
    ///
    /// A state machine: acquiring (with the wait policy) → running the inner service (renewing
    /// the lease on a timer) → releasing → done. Dropped in any state, it leaves nothing behind
    /// but one spawned, token-checked release.
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
        Acquiring {
            shared: Arc<Shared>,
            acquire: BoxFuture<Result<Held, LockError>>,
            service: Option<S>,
            request: Option<Request<ReqBody>>,
        },
        Running {
            #[pin]
            fut: F,
            // `None` for a request passed through unlocked.
            running: Option<Running>,
        },
        Releasing {
            release: Release,
            output: Option<Result<R, E>>,
        },
        Rejected {
            response: Option<Response<Bytes>>,
        },
        // A rejection sent once the lease is released (the request outlived `max_hold`).
        ReleasingRejected {
            release: Release,
            response: Option<Response<Bytes>>,
        },
    }
}

/// A held lease while the inner service runs.
pub(crate) struct Running {
    pub(crate) shared: Arc<Shared>,
    pub(crate) lease: Lease,
    pub(crate) renewer: Option<Renewer>,
    pub(crate) guard: ReleaseGuard,
}

const POLLED_AFTER_READY: &str = "ResponseFuture polled after completion";

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn unlocked(fut: S::Future) -> Self {
        Self {
            state: State::Running { fut, running: None },
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
        shared: Arc<Shared>,
        key: LockKey,
        service: S,
        request: Request<ReqBody>,
    ) -> Self {
        let span = telemetry::span(&key, shared.locker.config().key_display());
        let acquire = Box::pin(shared.locker.clone().acquire_held(key));
        Self {
            state: State::Acquiring {
                shared,
                acquire,
                service: Some(service),
                request: Some(request),
            },
            span,
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.span.enter();
        loop {
            match this.state.as_mut().project() {
                StateProj::Acquiring {
                    shared,
                    acquire,
                    service,
                    request,
                } => {
                    let held = match ready!(acquire.as_mut().poll(cx)) {
                        Ok(held) => held,
                        Err(error) => {
                            if let LockError::Contended {
                                attempts, waited, ..
                            } = &error
                            {
                                Span::current().record("attempts", attempts);
                                Span::current().record("wait_ms", waited.as_millis() as u64);
                            }
                            telemetry::record_end(telemetry::outcome(&error), None);
                            let response = shared.reject(error);
                            this.state.set(State::Rejected {
                                response: Some(response),
                            });
                            continue;
                        }
                    };
                    let waited = held
                        .acquired_at
                        .saturating_duration_since(held.requested_at);
                    telemetry::record_acquired(held.lease.fencing_token(), held.attempts, waited);
                    let mut request = request.take().expect(POLLED_AFTER_READY);
                    request.extensions_mut().insert(held.lease.clone());
                    let max_hold = shared.locker.config().max_hold();
                    let renewer = shared.locker.renewer(&held, Some(max_hold));
                    let running = Running {
                        shared: Arc::clone(shared),
                        lease: held.lease,
                        renewer: Some(renewer),
                        guard: held.guard,
                    };
                    let fut = service.take().expect(POLLED_AFTER_READY).call(request);
                    this.state.set(State::Running {
                        fut,
                        running: Some(running),
                    });
                }
                StateProj::Running { fut, running } => {
                    // The inner future first: one that is ready at once (no waiting) never
                    // starts the renewal timer.
                    let output = match fut.poll(cx) {
                        Poll::Ready(output) => output,
                        Poll::Pending => {
                            if let Some(held) = running.as_mut() {
                                let lost = match held.renewer.as_mut() {
                                    Some(renewer) => renewer.poll_lost(cx),
                                    None => Poll::Pending,
                                };
                                if let Poll::Ready(reason) = lost {
                                    held.renewer = None;
                                    let config = held.shared.locker.config();
                                    if config.on_lease_lost() == OnLeaseLost::Abort {
                                        telemetry::record_end("lease_lost", Some(&held.lease));
                                        let response =
                                            held.shared.reject(LockError::LeaseLost(reason));
                                        if reason == LostReason::MaxHold {
                                            // Still ours: release before answering.
                                            let release = held.guard.release_now();
                                            this.state.set(State::ReleasingRejected {
                                                release,
                                                response: Some(response),
                                            });
                                        } else {
                                            // Likely not ours any more, the store maybe down:
                                            // dropping the running state drops the inner
                                            // future (abort) and the armed guard, which
                                            // releases in a spawned task.
                                            this.state.set(State::Rejected {
                                                response: Some(response),
                                            });
                                        }
                                        continue;
                                    }
                                }
                            }
                            return Poll::Pending;
                        }
                    };
                    let Some(mut held) = running.take() else {
                        return Poll::Ready(output.map(|r| r.map(ResponseBody::new)));
                    };
                    let end = if held.lease.is_lost() {
                        "completed_lease_lost"
                    } else {
                        "completed"
                    };
                    telemetry::record_end(end, Some(&held.lease));
                    match output {
                        Ok(response) if held.shared.locker.config().hold_until_body_end() => {
                            let hold = BodyHold::new(held);
                            return Poll::Ready(Ok(
                                response.map(|body| ResponseBody::holding(body, hold))
                            ));
                        }
                        output => {
                            // Release before handing the response on, so a client that retries
                            // at once never meets its own lock.
                            let release = held.guard.release_now();
                            this.state.set(State::Releasing {
                                release,
                                output: Some(output),
                            });
                        }
                    }
                }
                StateProj::Releasing { release, output } => {
                    // A failed release is logged by the guard; the TTL frees the key.
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

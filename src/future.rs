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

use crate::{
    body::{BodyHold, ResponseBody},
    config::OnLeaseLost,
    error::LockError,
    key::LockKey,
    layer::Shared,
    locker::{Held, ReleaseGuard},
    renew::Renewer,
    store::{BoxFuture, StoreError},
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
            release: BoxFuture<Result<bool, StoreError>>,
            output: Option<Output<R, E>>,
        },
        Rejected {
            response: Option<Response<Bytes>>,
        },
    }
}

/// A held lease while the inner service runs.
pub(crate) struct Running {
    pub(crate) shared: Arc<Shared>,
    pub(crate) renewer: Option<Renewer>,
    pub(crate) guard: ReleaseGuard,
}

enum Output<R, E> {
    Inner(Result<R, E>),
    Rejection(Response<Bytes>),
}

const POLLED_AFTER_READY: &str = "ResponseFuture polled after completion";

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn unlocked(fut: S::Future) -> Self {
        Self {
            state: State::Running { fut, running: None },
        }
    }

    pub(crate) fn rejected(response: Response<Bytes>) -> Self {
        Self {
            state: State::Rejected {
                response: Some(response),
            },
        }
    }

    pub(crate) fn acquiring(
        shared: Arc<Shared>,
        key: LockKey,
        service: S,
        request: Request<ReqBody>,
    ) -> Self {
        let acquire = Box::pin(shared.locker.clone().acquire_held(key));
        Self {
            state: State::Acquiring {
                shared,
                acquire,
                service: Some(service),
                request: Some(request),
            },
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
                            let response = shared.reject(error);
                            this.state.set(State::Rejected {
                                response: Some(response),
                            });
                            continue;
                        }
                    };
                    let mut request = request.take().expect(POLLED_AFTER_READY);
                    request.extensions_mut().insert(held.lease.clone());
                    let max_hold = shared.locker.config().max_hold_value();
                    let renewer = shared.locker.renewer(&held, Some(max_hold));
                    let running = Running {
                        shared: Arc::clone(shared),
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
                    if let Some(held) = running.as_mut() {
                        let lost = match held.renewer.as_mut() {
                            Some(renewer) => renewer.poll_lost(cx),
                            None => Poll::Pending,
                        };
                        if let Poll::Ready(reason) = lost {
                            held.renewer = None;
                            let config = held.shared.locker.config();
                            if config.on_lease_lost_value() == OnLeaseLost::Abort {
                                let response = held.shared.reject(LockError::LeaseLost(reason));
                                let release = held.guard.release_now();
                                // Dropping the running state drops the inner future: abort.
                                this.state.set(State::Releasing {
                                    release,
                                    output: Some(Output::Rejection(response)),
                                });
                                continue;
                            }
                        }
                    }
                    let output = ready!(fut.poll(cx));
                    let Some(mut held) = running.take() else {
                        return Poll::Ready(output.map(|r| r.map(ResponseBody::new)));
                    };
                    match output {
                        Ok(response) if held.shared.locker.config().hold_until_body_end_value() => {
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
                                output: Some(Output::Inner(output)),
                            });
                        }
                    }
                }
                StateProj::Releasing { release, output } => {
                    // A failed release is logged by the guard; the TTL frees the key.
                    let _ = ready!(release.as_mut().poll(cx));
                    return Poll::Ready(match output.take().expect(POLLED_AFTER_READY) {
                        Output::Inner(result) => result.map(|r| r.map(ResponseBody::new)),
                        Output::Rejection(response) => Ok(response.map(ResponseBody::full)),
                    });
                }
                StateProj::Rejected { response } => {
                    let response = response.take().expect(POLLED_AFTER_READY);
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}

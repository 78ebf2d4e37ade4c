//! The idempotency layer's own answers, as problem+json.

use bytes::Bytes;
use http::{Response, StatusCode, header};

use super::error::IdempotencyError;
use crate::response::{ProblemJson, RejectionResponse, problem};

/// Builds the response for a request the idempotency layer answers itself.
///
/// Implemented for closures `Fn(&IdempotencyError, StatusCode) -> Response<Bytes>`; the default
/// is [`IdempotencyProblem`].
pub trait IdempotencyResponse: Send + Sync + 'static {
    /// The response for `error`; `status` is the status the layer assigns to it.
    fn response(&self, error: &IdempotencyError, status: StatusCode) -> Response<Bytes>;
}

impl<F> IdempotencyResponse for F
where
    F: Fn(&IdempotencyError, StatusCode) -> Response<Bytes> + Send + Sync + 'static,
{
    fn response(&self, error: &IdempotencyError, status: StatusCode) -> Response<Bytes> {
        self(error, status)
    }
}

/// The default [`IdempotencyResponse`]: RFC 9457 `application/problem+json`, with `type` under
/// [`PROBLEM_TYPE_BASE`](crate::response::PROBLEM_TYPE_BASE); the lock's own errors (409, 503) exactly as
/// [`LockLayer`](crate::LockLayer) answers them, `Retry-After` included. See the
/// [module docs](super#responses) for the table.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct IdempotencyProblem;

impl IdempotencyResponse for IdempotencyProblem {
    fn response(&self, error: &IdempotencyError, status: StatusCode) -> Response<Bytes> {
        let (kind, title, detail) = match error {
            IdempotencyError::Lock(error) => return ProblemJson.response(error, status),
            IdempotencyError::MissingKey => (
                "idempotency-key-missing",
                "Idempotency key missing",
                "this operation requires an `Idempotency-Key` header; send a unique key \
                 (such as a UUID) and the same key again when retrying"
                    .to_owned(),
            ),
            IdempotencyError::InvalidKey(detail) => (
                "idempotency-key-invalid",
                "Invalid idempotency key",
                detail.to_string(),
            ),
            IdempotencyError::KeyReused => (
                "idempotency-key-reused",
                "Idempotency key reused",
                "this idempotency key was already used for a different request (another \
                 method, path, content type or body); use a new key for a new request"
                    .to_owned(),
            ),
            IdempotencyError::BodyTooLarge { limit } => (
                "request-body-too-large",
                "Request body too large",
                format!("the request body is larger than the {limit} bytes accepted"),
            ),
            IdempotencyError::BodyUnreadable(_) => (
                "request-body-unreadable",
                "Request body unreadable",
                "the request body could not be read".to_owned(),
            ),
            IdempotencyError::PrincipalRejected(rejection) => {
                let (kind, title) = match (rejection.is_client_error(), rejection.challenge()) {
                    (false, _) => (
                        "idempotency-principal-missing",
                        "Idempotency principal missing",
                    ),
                    (true, Some(_)) => (
                        "idempotency-principal-unauthorized",
                        "Caller not authenticated",
                    ),
                    (true, None) => ("idempotency-principal-invalid", "Invalid caller"),
                };
                let mut response = problem(status, kind, title, rejection.detail());
                if let Some(challenge) = rejection.challenge() {
                    response
                        .headers_mut()
                        .insert(header::WWW_AUTHENTICATE, challenge.clone());
                }
                return response;
            }
        };
        problem(status, kind, title, &detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::LockConfig, error::LockError};
    use crate::{idempotency::PrincipalRejection, response::PROBLEM_TYPE_BASE};
    use http::HeaderValue;
    use std::time::Duration;

    #[test]
    fn problems() {
        let lock = LockConfig::default();
        let reused = IdempotencyError::KeyReused;
        let r = IdempotencyProblem.response(&reused, reused.status(&lock));
        assert_eq!(r.status(), 422);
        assert_eq!(
            r.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(body["status"], 422);
        assert_eq!(
            body["type"],
            format!("{PROBLEM_TYPE_BASE}#idempotency-key-reused")
        );
        let err = IdempotencyError::invalid_key("the \"key\" is bad".into());
        let r = IdempotencyProblem.response(&err, err.status(&lock));
        assert_eq!(r.status(), 400);
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(body["detail"], "the \"key\" is bad");
        let contended = IdempotencyError::Lock(LockError::from(crate::store::StoreError::timeout(
            Duration::from_secs(1),
        )));
        let r = IdempotencyProblem.response(&contended, contended.status(&lock));
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let big = IdempotencyError::BodyTooLarge { limit: 10 };
        assert_eq!(big.status(&lock), 413);
        let missing = IdempotencyError::from(PrincipalRejection::missing());
        assert_eq!(missing.status(&lock), 500);
        let r = IdempotencyProblem.response(&missing, missing.status(&lock));
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(
            body["type"],
            format!("{PROBLEM_TYPE_BASE}#idempotency-principal-missing")
        );
        assert_eq!(body["detail"], PrincipalRejection::missing().detail());
        // The detail a principal gives goes to the client, whatever the kind.
        let said = IdempotencyError::from(
            PrincipalRejection::missing().with_detail("the tenant layer did not run"),
        );
        let r = IdempotencyProblem.response(&said, said.status(&lock));
        assert_eq!(r.status(), 500);
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(body["detail"], "the tenant layer did not run");
        let who = IdempotencyError::from(PrincipalRejection::unauthorized(
            HeaderValue::from_static("Bearer"),
        ));
        let r = IdempotencyProblem.response(&who, who.status(&lock));
        assert_eq!(r.status(), 401);
        assert_eq!(r.headers()[header::WWW_AUTHENTICATE], "Bearer");
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(
            body["type"],
            format!("{PROBLEM_TYPE_BASE}#idempotency-principal-unauthorized")
        );
        let bad = IdempotencyError::from(PrincipalRejection::bad_request("not an account id"));
        let r = IdempotencyProblem.response(&bad, bad.status(&lock));
        assert_eq!(r.status(), 400);
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(body["detail"], "not an account id");
        assert_eq!(
            body["type"],
            format!("{PROBLEM_TYPE_BASE}#idempotency-principal-invalid")
        );
    }
}

//! The idempotency layer's own answers, as problem+json.

use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode, header};

use super::error::IdempotencyError;

use crate::response::{Rejection, lock_problem, problem, with_body};

impl Rejection<'_, IdempotencyError> {
    /// The `Retry-After` the default response sends, in whole seconds: the lock's (for
    /// [`IdempotencyError::Lock`]), else `None`.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.error() {
            IdempotencyError::Lock(error) => Rejection::new(error, self.status()).retry_after(),
            _ => None,
        }
    }

    /// The default response: RFC 9457 `application/problem+json`, with `type` under
    /// [`PROBLEM_TYPE_BASE`](crate::response::PROBLEM_TYPE_BASE); the lock's own errors (409,
    /// 503) exactly as [`LockLayer`](crate::LockLayer) answers them, `Retry-After` included. See
    /// the [module docs](super#responses) for the table.
    pub fn problem(&self) -> Response<Bytes> {
        idempotency_problem(self.error(), self.status())
    }

    /// A response with this status, the `Retry-After` and `WWW-Authenticate` the default sends,
    /// and `body`; add a `Content-Type` for it.
    pub fn with_body(&self, body: impl Into<Bytes>) -> Response<Bytes> {
        let mut response = with_body(self.status(), self.retry_after(), body.into());
        if let IdempotencyError::PrincipalRejected(rejection) = self.error()
            && let Some(challenge) = rejection.challenge()
        {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, challenge.clone());
        }
        response
    }
}

/// The default response for a request the idempotency layer answers itself.
pub(crate) fn idempotency_problem(error: &IdempotencyError, status: StatusCode) -> Response<Bytes> {
    let (kind, title, detail) = match error {
        IdempotencyError::Lock(error) => return lock_problem(error, status),
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
                 method, path, query, content type or body); use a new key for a new request"
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::LockError;
    use crate::{idempotency::PrincipalRejection, response::PROBLEM_TYPE_BASE};
    use http::HeaderValue;
    use std::time::Duration;

    #[test]
    fn problems() {
        let reused = IdempotencyError::KeyReused;
        let r = idempotency_problem(&reused, reused.status());
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
        let r = idempotency_problem(&err, err.status());
        assert_eq!(r.status(), 400);
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(body["detail"], "the \"key\" is bad");
        let contended = IdempotencyError::Lock(LockError::from(crate::store::StoreError::timeout(
            Duration::from_secs(1),
        )));
        let r = idempotency_problem(&contended, contended.status());
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let big = IdempotencyError::BodyTooLarge { limit: 10 };
        assert_eq!(big.status(), 413);
        let missing = IdempotencyError::from(PrincipalRejection::missing());
        assert_eq!(missing.status(), 500);
        let r = idempotency_problem(&missing, missing.status());
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
        let r = idempotency_problem(&said, said.status());
        assert_eq!(r.status(), 500);
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(body["detail"], "the tenant layer did not run");
        let who = IdempotencyError::from(PrincipalRejection::unauthorized(
            HeaderValue::from_static("Bearer"),
        ));
        let r = idempotency_problem(&who, who.status());
        assert_eq!(r.status(), 401);
        assert_eq!(r.headers()[header::WWW_AUTHENTICATE], "Bearer");
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(
            body["type"],
            format!("{PROBLEM_TYPE_BASE}#idempotency-principal-unauthorized")
        );
        let bad = IdempotencyError::from(PrincipalRejection::bad_request("not an account id"));
        let r = idempotency_problem(&bad, bad.status());
        assert_eq!(r.status(), 400);
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(body["detail"], "not an account id");
        assert_eq!(
            body["type"],
            format!("{PROBLEM_TYPE_BASE}#idempotency-principal-invalid")
        );
    }
}

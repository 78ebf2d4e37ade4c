//! axum's extractor rejections as problems, so that a route answers in one format.

use axum::response::{IntoResponse, Response};
use http::StatusCode;

use super::problem;

/// An axum extractor's rejection (a body that is not JSON, a missing `Content-Type`, a query
/// that does not parse) as an `application/problem+json` response like the layers' own: the
/// rejection's status and message, `type` [`#request-rejected`](super#request-rejected).
///
/// Without it, one route answers in two formats: the layers' refusals (a bad lock key, a bad
/// idempotency key) are problems, while axum's `Json` answers a malformed body with
/// `text/plain`. axum lets an extractor name its rejection type: wrap the extractors with
/// `#[derive(FromRequest)]` (axum's `macros` feature) and `rejection(ProblemRejection)`, or
/// with axum-extra's `WithRejection<Json<T>, ProblemRejection>`. It converts from any of axum's
/// rejections (`JsonRejection`, `FormRejection`, `QueryRejection`, `PathRejection`, ...), and
/// with `?` from a `Result<Json<T>, JsonRejection>` a handler takes.
///
/// ```
/// use axum::{Router, extract::FromRequest, routing::post};
/// use serde::Deserialize;
/// use tower_lock::response::ProblemRejection;
///
/// /// axum's `Json`, whose rejections are problems.
/// #[derive(FromRequest)]
/// #[from_request(via(axum::Json), rejection(ProblemRejection))]
/// struct Json<T>(T);
///
/// #[derive(Deserialize)]
/// struct Payment {
///     amount: u64,
/// }
///
/// async fn create_payment(Json(payment): Json<Payment>) -> String {
///     format!("paid {}", payment.amount)
/// }
///
/// let app: Router = Router::new().route("/payments", post(create_payment));
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// # use tower::ServiceExt;
/// # use http_body_util::BodyExt;
/// // A body without its `Content-Type`: axum's 415, as a problem.
/// let request = http::Request::post("/payments")
///     .body(axum::body::Body::from(r#"{"amount":1250}"#))
///     .unwrap();
/// let response = app.oneshot(request).await.unwrap();
/// assert_eq!(response.status(), 415);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// let body = response.into_body().collect().await.unwrap().to_bytes();
/// let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
/// assert!(problem["type"].as_str().unwrap().ends_with("#request-rejected"));
/// # });
/// ```
///
/// The [`IdempotencyLayer`](crate::IdempotencyLayer)'s default
/// [`store_when`](crate::idempotency::IdempotencyConfig::store_when) does not store these (400, 413, 415,
/// 422), in either format: the client's corrected retry with the same key runs the handler.
#[derive(Debug, Clone)]
pub struct ProblemRejection {
    status: StatusCode,
    detail: String,
}

impl ProblemRejection {
    /// The rejection's status (400, 413, 415, 422, or 500 for a route that does not fit its
    /// extractor).
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The rejection's message, axum's own (the problem's `detail`).
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

impl ProblemRejection {
    /// The `application/problem+json` response (type
    /// [`#request-rejected`](super#request-rejected)) with the rejection's status and message.
    pub fn problem(&self) -> http::Response<bytes::Bytes> {
        problem(
            self.status,
            "request-rejected",
            "Request rejected",
            &self.detail,
        )
    }
}

/// (Not `std::error::Error`: it converts from every type that is a rejection and an `Error`,
/// which would then include itself.)
impl std::fmt::Display for ProblemRejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

/// Any axum rejection: its message, and the status of the response it would have been.
impl<R> From<R> for ProblemRejection
where
    R: IntoResponse + std::error::Error,
{
    fn from(rejection: R) -> Self {
        let detail = rejection.to_string();
        let status = rejection.into_response().status();
        Self { status, detail }
    }
}

impl IntoResponse for ProblemRejection {
    fn into_response(self) -> Response {
        self.problem().map(axum::body::Body::from)
    }
}

#[cfg(test)]
mod tests {
    use axum::extract::rejection::{JsonRejection, MissingJsonContentType};
    use http_body_util::BodyExt;

    use super::*;

    #[tokio::test]
    async fn an_axum_rejection_keeps_its_status_and_message() {
        let axum_said = JsonRejection::from(MissingJsonContentType::default());
        let (status, text) = (axum_said.status(), axum_said.body_text());
        let rejection = ProblemRejection::from(axum_said);
        assert_eq!((rejection.status(), rejection.detail()), (status, &*text));
        let response = rejection.into_response();
        assert_eq!(response.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(
            response.headers()[http::header::CONTENT_TYPE],
            "application/problem+json"
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(problem["status"], 415);
        assert_eq!(problem["detail"], text);
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("/response/#request-rejected")
        );
    }
}

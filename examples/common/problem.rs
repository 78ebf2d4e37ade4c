//! Problem details (RFC 9457) for the examples' own errors, the same shape the lock layer
//! answers with.

use axum::{
    Json,
    extract::rejection::JsonRejection,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::Serialize;

/// An `application/problem+json` body.
#[derive(Debug, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    kind: String,
    title: &'static str,
    status: u16,
    detail: String,
}

impl Problem {
    pub fn new(
        status: StatusCode,
        slug: &str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            // A real service would point this at its own documentation.
            kind: format!("https://example.com/problems/{slug}"),
            title,
            status: status.as_u16(),
            detail: detail.into(),
        }
    }

    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "Bad request",
            detail,
        )
    }

    pub fn bad_json(rejection: JsonRejection) -> Self {
        // axum answers 415 for a missing content type and 422 for well-formed JSON of the wrong
        // shape; this API calls every unusable body a 400, except the content type.
        let status = match rejection {
            JsonRejection::MissingJsonContentType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            _ => StatusCode::BAD_REQUEST,
        };
        Self::new(
            status,
            "invalid-body",
            "Invalid request body",
            rejection.body_text(),
        )
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", "Not found", detail)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            [(header::CONTENT_TYPE, "application/problem+json")],
            Json(self),
        )
            .into_response()
    }
}

/// A handler's error answer: the example's own problem, or a fenced write's (with the crate's
/// problem types: `#stale-write` 409, `#data-store-unavailable` 503, `#fenced-write-invalid`
/// 500; see `tower_lock::response`).
#[derive(Debug)]
pub enum Refusal {
    Problem(Problem),
    Fence(tower_lock::fence::FenceError),
    /// A lease the handler takes itself (a permit), not granted: the crate's problem (429 for
    /// a permit, 409, 503).
    Lock(tower_lock::LockError),
}

impl From<tower_lock::LockError> for Refusal {
    fn from(error: tower_lock::LockError) -> Self {
        Self::Lock(error)
    }
}

/// A call refused before it was sent (a share the store cannot count): the crate's problem
/// (500, `#config`).
impl From<tower_lock::ConfigError> for Refusal {
    fn from(error: tower_lock::ConfigError) -> Self {
        Self::Lock(error.into())
    }
}

impl From<Problem> for Refusal {
    fn from(problem: Problem) -> Self {
        Self::Problem(problem)
    }
}

impl From<tower_lock::fence::FenceError> for Refusal {
    fn from(error: tower_lock::fence::FenceError) -> Self {
        Self::Fence(error)
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Self::Problem(problem) => problem.into_response(),
            Self::Fence(error) => error.into_response(),
            Self::Lock(error) => error.into_response(),
        }
    }
}

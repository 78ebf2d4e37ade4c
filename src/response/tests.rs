//! Tests of the parent module: the default problems, the hooks, and the one error contract.

use super::*;
use crate::{
    error::LostReason,
    key::KeyRejection,
    store::{StoreError, StoreErrorKind},
};

fn json(response: &Response<Bytes>) -> serde_json::Value {
    serde_json::from_slice(response.body()).unwrap()
}

#[test]
fn a_hook_keeps_the_status_and_retry_after() {
    let contended = LockError::Contended {
        expires_in: Some(Duration::from_millis(2_500)),
        waited: Duration::ZERO,
        attempts: 1,
        permits: None,
    };
    let rejection = Rejection::new(&contended, contended.status());
    assert_eq!(rejection.status(), StatusCode::CONFLICT);
    assert_eq!(json(&rejection.problem())["status"], 409);
    // Another status: the response's and the problem's.
    let rejection = rejection.with_status(StatusCode::LOCKED);
    assert_eq!(rejection.status(), StatusCode::LOCKED);
    assert_eq!(rejection.retry_after(), Some(Duration::from_secs(3)));
    let custom = rejection.with_body("busy");
    assert_eq!(custom.status(), StatusCode::LOCKED);
    assert_eq!(custom.headers()[header::RETRY_AFTER], "3");
    assert_eq!(custom.body(), "busy");
    let default = rejection.problem();
    assert_eq!(default.status(), StatusCode::LOCKED);
    assert_eq!(default.headers()[header::RETRY_AFTER], "3");
    assert_eq!(json(&default)["status"], 423);
    let bad = LockError::Key(KeyRejection::missing("the header `x-sku`"));
    let rejection = Rejection::new(&bad, StatusCode::BAD_REQUEST);
    assert_eq!(rejection.retry_after(), None);
    assert!(
        !rejection
            .with_body("no")
            .headers()
            .contains_key(header::RETRY_AFTER)
    );
}

#[test]
fn every_problem_type_has_its_section() {
    let docs = include_str!("../response.rs");
    let kinds = [
        "lock-contended",
        "lock-store-unavailable",
        "lease-lost",
        "invalid-lock-key",
        "request-body-too-large",
        "lock-key-misconfigured",
        "lock-key-misused",
        "permits-exhausted",
        "lock-misconfigured",
        "idempotency-key-missing",
        "idempotency-key-invalid",
        "idempotency-key-reused",
        "request-body-unreadable",
        "idempotency-principal-missing",
        "idempotency-principal-unauthorized",
        "idempotency-principal-invalid",
        "request-rejected",
        "stale-write",
        "data-store-unavailable",
        "fenced-write-invalid",
        "layer-missing",
    ];
    for kind in kinds {
        assert!(
            docs.contains(&format!("\n//! ## {kind}\n")),
            "no section for the problem type {kind}"
        );
    }
    // Every `type` the crate emits is one of them (each emitting site names its kind as a
    // string literal next to its title).
    for source in [
        include_str!("../response.rs"),
        include_str!("../idempotency/response.rs"),
        include_str!("extractor.rs"),
        include_str!("../fence/error.rs"),
    ] {
        for literal in source.split('"').skip(1).step_by(2) {
            let emitted = literal.starts_with("lock-")
                || literal.starts_with("lease-")
                || literal.starts_with("idempotency-")
                || literal.starts_with("request-")
                || literal.starts_with("invalid-")
                || literal.starts_with("stale-")
                || literal.starts_with("data-store-")
                || literal.starts_with("fenced-")
                || literal.starts_with("layer-");
            if emitted && !literal.contains(' ') && !literal.contains('{') {
                assert!(kinds.contains(&literal), "{literal} has no section");
            }
        }
    }
}

#[cfg(feature = "axum")]
#[test]
fn a_lock_error_is_the_layers_problem() {
    use axum::response::IntoResponse;
    let error = LockError::Contended {
        expires_in: Some(Duration::from_millis(2500)),
        waited: Duration::ZERO,
        attempts: 1,
        permits: None,
    };
    let response = error.into_response();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(response.headers()[header::RETRY_AFTER], "3");
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    let store = LockError::Store(StoreError::msg(StoreErrorKind::Timeout, "slow"));
    assert_eq!(
        store.into_response().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[test]
fn problem_bodies() {
    let contended = LockError::Contended {
        expires_in: Some(Duration::from_millis(2100)),
        waited: Duration::ZERO,
        attempts: 1,
        permits: None,
    };
    let r = lock_problem(&contended, StatusCode::CONFLICT);
    assert_eq!(r.status(), 409);
    assert_eq!(
        r.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    assert_eq!(r.headers()[header::RETRY_AFTER], "3");
    let body = json(&r);
    assert_eq!(body["status"], 409);
    assert!(body["type"].as_str().unwrap().ends_with("#lock-contended"));

    let short = LockError::Contended {
        expires_in: Some(Duration::from_millis(5)),
        waited: Duration::ZERO,
        attempts: 1,
        permits: None,
    };
    assert_eq!(
        lock_problem(&short, StatusCode::CONFLICT).headers()[header::RETRY_AFTER],
        "1"
    );

    let store = LockError::Store(StoreError::msg(
        StoreErrorKind::Unavailable,
        "secret internals",
    ));
    let r = lock_problem(&store, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    assert!(
        !String::from_utf8_lossy(r.body()).contains("secret"),
        "store internals leak"
    );

    let lost = LockError::LeaseLost(LostReason::NotHeld);
    assert!(
        json(&lock_problem(&lost, StatusCode::SERVICE_UNAVAILABLE))["type"]
            .as_str()
            .unwrap()
            .ends_with("#lease-lost")
    );

    let bad = LockError::Key(KeyRejection::invalid("the \"key\" is bad"));
    let r = lock_problem(&bad, StatusCode::BAD_REQUEST);
    assert_eq!(
        json(&r)["detail"],
        "the \"key\" is bad",
        "detail must be JSON-escaped"
    );
    assert!(r.headers().get(header::RETRY_AFTER).is_none());
}

#[test]
fn each_error_has_its_status() {
    let contended = LockError::Contended {
        expires_in: None,
        waited: Duration::ZERO,
        attempts: 1,
        permits: None,
    };
    assert_eq!(contended.status(), StatusCode::CONFLICT);
    assert_eq!(
        LockError::LeaseLost(LostReason::Expired).status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    let large = LockError::Key(KeyRejection::body_too_large(10));
    assert_eq!(large.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let r = lock_problem(&large, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        json(&r)["type"]
            .as_str()
            .unwrap()
            .ends_with("#request-body-too-large")
    );
    let misconfigured = LockError::Key(KeyRejection::misconfigured("x"));
    assert_eq!(misconfigured.status(), StatusCode::INTERNAL_SERVER_ERROR);
    // No permit of a key's freed in time: its own status and problem, with Retry-After.
    let limited = LockError::Contended {
        expires_in: Some(Duration::from_millis(2500)),
        waited: Duration::ZERO,
        attempts: 1,
        permits: Some(4),
    };
    assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
    let r = lock_problem(&limited, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.headers()[header::RETRY_AFTER], "3");
    let body = json(&r);
    assert!(
        body["type"]
            .as_str()
            .unwrap()
            .ends_with("#permits-exhausted")
    );
    assert!(body["detail"].as_str().unwrap().contains("all 4 permits"));
}

/// Every error and rejection the crate returns keeps one contract: `status()`, `problem()`
/// as `application/problem+json` with that status, `Display`, `Error`, and (axum) the same
/// problem as its response.
#[cfg(feature = "axum")]
#[tokio::test]
async fn every_error_answers_its_status_as_a_problem() {
    use axum::{
        extract::{
            FromRequestParts,
            rejection::{JsonRejection, MissingJsonContentType},
        },
        response::IntoResponse,
    };

    use crate::{
        Lease,
        error::ConfigError,
        fence::FenceError,
        idempotency::{IdempotencyError, IdempotencyKey, PrincipalRejection},
    };

    macro_rules! check {
        ($error:expr, $status:expr) => {{
            let error = $error;
            let _: &dyn std::error::Error = &error;
            check!(@ error, $status)
        }};
        (@ $error:expr, $status:expr) => {{
            let error = $error;
            let status: u16 = $status;
            assert!(!error.to_string().is_empty());
            assert_eq!(error.status(), status, "{error}");
            let problem = error.problem();
            assert_eq!(problem.status(), status, "{error}");
            assert_eq!(
                problem.headers()[header::CONTENT_TYPE],
                "application/problem+json"
            );
            assert_eq!(json(&problem)["status"], status, "{error}");
            let response = error.into_response();
            assert_eq!(response.status(), status);
            assert_eq!(
                response.headers()[header::CONTENT_TYPE],
                "application/problem+json"
            );
        }};
    }

    let contended = |permits| LockError::Contended {
        expires_in: None,
        waited: Duration::ZERO,
        attempts: 1,
        permits,
    };
    assert!(contended(Some(4)).is_permits_exhausted());
    assert!(!contended(None).is_permits_exhausted());
    check!(contended(None), 409);
    check!(contended(Some(4)), 429);
    let store = StoreError::msg(StoreErrorKind::Timeout, "no answer from 10.0.0.7:6379");
    check!(LockError::Store(store.clone()), 503);
    check!(LockError::LeaseLost(LostReason::Expired), 503);
    check!(store.clone(), 503);
    assert!(!String::from_utf8_lossy(store.problem().body()).contains("10.0.0.7"));
    check!(ConfigError::new("permits", "at least 1"), 500);
    check!(KeyRejection::invalid("empty"), 400);
    check!(KeyRejection::body_too_large(16), 413);
    check!(KeyRejection::misconfigured("no such parameter"), 500);
    check!(FenceError::Store(store), 503);
    check!(IdempotencyError::MissingKey, 400);
    check!(IdempotencyError::KeyReused, 422);
    check!(IdempotencyError::Lock(contended(None)), 409);
    check!(
        PrincipalRejection::unauthorized(HeaderValue::from_static("Bearer")),
        401
    );
    check!(PrincipalRejection::missing(), 500);
    let (mut parts, ()) = http::Request::new(()).into_parts();
    let lease = Lease::from_request_parts(&mut parts, &())
        .await
        .unwrap_err();
    check!(lease, 500);
    let key = IdempotencyKey::from_request_parts(&mut parts, &())
        .await
        .unwrap_err();
    check!(key, 500);
    check!(@
        super::ProblemRejection::from(JsonRejection::from(MissingJsonContentType::default())),
        415
    );
}

/// A key taken another way than its holders took it is the server's mistake: 500, its own
/// problem type, no `Retry-After` (retrying does not help), where an outage is a 503.
#[test]
fn a_misused_key_is_a_server_error_not_an_outage() {
    use crate::store::{StoreError, StoreErrorKind};
    let misused = LockError::Store(StoreError::msg(StoreErrorKind::Misused, "capacity of 2"));
    assert_eq!(misused.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let response = misused.problem();
    assert!(!response.headers().contains_key(header::RETRY_AFTER));
    let body = String::from_utf8(response.into_body().to_vec()).unwrap();
    assert!(body.contains("#lock-key-misused"), "{body}");
    assert!(
        !body.contains("capacity of 2"),
        "store internals in the body: {body}"
    );
    let outage = LockError::Store(StoreError::msg(StoreErrorKind::Unavailable, "down"));
    assert_eq!(outage.status(), StatusCode::SERVICE_UNAVAILABLE);
}

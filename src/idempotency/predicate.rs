//! Which of the handler's responses are stored and replayed.

use std::{fmt, sync::Arc};

use http::response::Parts;

/// Decides, from the response head (status, headers, extensions), whether a handler's response
/// is stored and replayed to retries with the same key, or not stored, so that a retry runs the
/// handler again. Set it with [`IdempotencyConfig::store_when`](super::IdempotencyConfig::store_when).
///
/// | predicate | stores | a retry runs the handler again after |
/// |---|---|---|
/// | [`NotRejected`] (the default) | 1xx–4xx but 400, 408, 413, 415, 422, 429 | a 5xx, or a 4xx that refused the request before it ran |
/// | [`NotServerError`] | 1xx–4xx | a 5xx |
/// | [`NotError`] | 1xx–3xx | a 4xx or 5xx |
/// | [`Always`] | every status | nothing |
/// | a closure `Fn(&Parts) -> bool` | what it returns `true` for | the rest |
///
/// Whatever it says, the layer's own answers (400, 409, 413, 422, 503) are never stored, nor
/// are responses over [`max_response_body`](super::IdempotencyConfig::max_response_body).
///
/// The default stores what the handler decided (a 201, a 402 for a declined card, a 404, a 409
/// on state that changed) and leaves out the answers that refuse a request before it runs: a
/// body that does not parse (axum's `Json` and `Form` answer 400, 415 or 422, and so do most
/// validation layers), one too large (413), a request that timed out arriving (408) or was
/// rate-limited (429). As at Stripe, a request that failed validation stores nothing, so the
/// client's corrected retry with the same key runs. An API whose other 4xx mean "correct it and
/// retry with the same key" (a declined card the customer then replaces) stores only what is
/// final for it:
///
/// ```
/// use http::{StatusCode, response::Parts};
/// use tower_lock::idempotency::{IdempotencyConfig, NotError, NotRejected, StorePredicate};
///
/// // Neither a 4xx nor a 5xx is stored.
/// let config = IdempotencyConfig::builder().store_when(NotError).build()?;
/// // What the default stores, but a declined payment.
/// let config = IdempotencyConfig::builder()
///     .store_when(|head: &Parts| {
///         head.status != StatusCode::PAYMENT_REQUIRED && NotRejected.should_store(head)
///     })
///     .build()?;
/// # let _ = config;
/// # Ok::<(), tower_lock::ConfigError>(())
/// ```
pub trait StorePredicate: Send + Sync + 'static {
    /// Whether the response with this head is stored and replayed.
    fn should_store(&self, response: &Parts) -> bool;
}

impl<F> StorePredicate for F
where
    F: Fn(&Parts) -> bool + Send + Sync + 'static,
{
    fn should_store(&self, response: &Parts) -> bool {
        self(response)
    }
}

/// The default [`StorePredicate`]: every response but a server error (5xx) and the client
/// errors that refuse a request before it runs, so that a retry after either runs the handler
/// again.
///
/// Not stored: 5xx; 400 Bad Request, 413 Content Too Large, 415 Unsupported Media Type and 422
/// Unprocessable Content (what axum's extractors answer for a body, query or path that does not
/// parse, and validation layers for a request they refuse); 408 Request Timeout and 429 Too Many
/// Requests (the client is told to send it again). Every other response is the key's outcome
/// and replays: 1xx–3xx, and the 4xx a handler decides on (402, 403, 404, 409, ...). A handler
/// that answers 400 or 422 after acting (it charged, then found something wrong) must store
/// that itself, with a closure that marks it (see [`StorePredicate`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NotRejected;

impl StorePredicate for NotRejected {
    fn should_store(&self, response: &Parts) -> bool {
        use http::StatusCode as S;
        !response.status.is_server_error()
            && !matches!(
                response.status,
                S::BAD_REQUEST
                    | S::REQUEST_TIMEOUT
                    | S::PAYLOAD_TOO_LARGE
                    | S::UNSUPPORTED_MEDIA_TYPE
                    | S::UNPROCESSABLE_ENTITY
                    | S::TOO_MANY_REQUESTS
            )
    }
}

/// A [`StorePredicate`] that stores every response but a server error (5xx): every 4xx is the
/// key's outcome and replays, a request refused for its syntax included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NotServerError;

impl StorePredicate for NotServerError {
    fn should_store(&self, response: &Parts) -> bool {
        !response.status.is_server_error()
    }
}

/// A [`StorePredicate`] that stores neither client errors (4xx) nor server errors (5xx): a
/// retry after either runs the handler again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NotError;

impl StorePredicate for NotError {
    fn should_store(&self, response: &Parts) -> bool {
        !response.status.is_client_error() && !response.status.is_server_error()
    }
}

/// A [`StorePredicate`] that stores every response, 5xx included: a retry never runs the
/// handler again once it answered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Always;

impl StorePredicate for Always {
    fn should_store(&self, _response: &Parts) -> bool {
        true
    }
}

/// The predicate in an [`IdempotencyConfig`](super::IdempotencyConfig), printed by its type.
#[derive(Clone)]
pub(super) struct StoreWhen {
    predicate: Arc<dyn StorePredicate>,
    name: &'static str,
}

impl StoreWhen {
    pub(super) fn new<P: StorePredicate>(predicate: P) -> Self {
        Self {
            predicate: Arc::new(predicate),
            name: std::any::type_name::<P>(),
        }
    }

    pub(super) fn should_store(&self, response: &Parts) -> bool {
        self.predicate.should_store(response)
    }

    pub(super) fn predicate(&self) -> &dyn StorePredicate {
        &*self.predicate
    }
}

impl Default for StoreWhen {
    fn default() -> Self {
        Self::new(NotRejected)
    }
}

impl fmt::Debug for StoreWhen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Response, StatusCode};

    fn head(status: u16) -> Parts {
        let mut response = Response::new(());
        *response.status_mut() = StatusCode::from_u16(status).unwrap();
        response.into_parts().0
    }

    #[test]
    fn built_ins_by_status() {
        for (status, not_rejected, not_server_error, not_error) in [
            (200, true, true, true),
            (201, true, true, true),
            (303, true, true, true),
            (400, false, true, false),
            (402, true, true, false),
            (403, true, true, false),
            (404, true, true, false),
            (408, false, true, false),
            (409, true, true, false),
            (413, false, true, false),
            (415, false, true, false),
            (422, false, true, false),
            (429, false, true, false),
            (500, false, false, false),
            (503, false, false, false),
        ] {
            let head = head(status);
            assert_eq!(NotRejected.should_store(&head), not_rejected, "{status}");
            assert_eq!(
                NotServerError.should_store(&head),
                not_server_error,
                "{status}"
            );
            assert_eq!(NotError.should_store(&head), not_error, "{status}");
            assert!(Always.should_store(&head), "{status}");
        }
    }

    #[test]
    fn closures_and_the_default() {
        let when = StoreWhen::new(|head: &Parts| head.headers.contains_key("x-final"));
        let mut final_head = head(402);
        final_head
            .headers
            .insert("x-final", http::HeaderValue::from_static("1"));
        assert!(when.should_store(&final_head));
        assert!(!when.should_store(&head(200)));
        let default = StoreWhen::default();
        assert!(default.should_store(&head(404)) && !default.should_store(&head(500)));
        assert!(
            !default.should_store(&head(422)),
            "a refused request stored"
        );
        assert!(
            format!("{default:?}").ends_with("NotRejected"),
            "{default:?}"
        );
    }
}

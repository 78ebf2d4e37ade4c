//! Which of the handler's responses are stored and replayed.

use std::{fmt, sync::Arc};

use http::response::Parts;

/// Decides, from the response head (status, headers, extensions), whether a handler's response
/// is stored and replayed to retries with the same key, or not stored, so that a retry runs the
/// handler again. Set it with [`IdempotencyConfig::store_when`](super::IdempotencyConfig::store_when).
///
/// | predicate | stores | a retry runs the handler again after |
/// |---|---|---|
/// | [`NotServerError`] (the default) | 1xx–4xx | a 5xx |
/// | [`NotError`] | 1xx–3xx | a 4xx or 5xx |
/// | [`Always`] | every status | nothing |
/// | a closure `Fn(&Parts) -> bool` | what it returns `true` for | the rest |
///
/// Whatever it says, the layer's own answers (400, 409, 413, 422, 503) are never stored, nor
/// are responses over [`max_response_body`](super::IdempotencyConfig::max_response_body).
///
/// Storing a 4xx (the default) is what the IETF draft and Stripe do: the key's request had an
/// outcome, and a retry gets it again. An API whose 4xx mean "correct it and retry with the same
/// key" (a declined card the customer then replaces, a 409 on state that changes) stores only
/// what is final for it:
///
/// ```
/// use http::{StatusCode, response::Parts};
/// use tower_lock::{
///     IdempotencyConfig,
///     idempotency::{NotError, NotServerError, StorePredicate},
/// };
///
/// // Neither a 4xx nor a 5xx is stored.
/// let config = IdempotencyConfig::builder().store_when(NotError).build()?;
/// // Every outcome but a declined payment (and 5xx).
/// let config = IdempotencyConfig::builder()
///     .store_when(|head: &Parts| {
///         head.status != StatusCode::PAYMENT_REQUIRED && NotServerError.should_store(head)
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

/// The default [`StorePredicate`]: every response but a server error (5xx), so that a retry
/// after a failure the handler reported runs it again.
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
        Self::new(NotServerError)
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
    fn built_ins_by_status_class() {
        for (status, not_server_error, not_error) in [
            (200, true, true),
            (201, true, true),
            (303, true, true),
            (400, true, false),
            (402, true, false),
            (409, true, false),
            (500, false, false),
            (503, false, false),
        ] {
            let head = head(status);
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
            format!("{default:?}").ends_with("NotServerError"),
            "{default:?}"
        );
    }
}

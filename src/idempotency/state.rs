//! [`IdempotencyState`]: what every clone of an `IdempotencyService` shares: the locker, the
//! records, the settings, and how a request's keys and the layer's own answers are made.

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, request::Parts};

use super::{
    config::IdempotencyConfig,
    error::IdempotencyError,
    key::{self, IdempotencyKey},
    principal::{Principal, PrincipalRejection},
};
use crate::{
    config::OnLeaseLost,
    engine::Locker,
    error::LockError,
    key::LockKey,
    response::{Rejection, Respond},
    store::Records,
    wait::Wait,
};

/// What every clone of the service needs, behind one `Arc`.
#[derive(Clone)]
pub(crate) struct IdempotencyState {
    pub(crate) locker: Locker,
    pub(crate) records: Arc<dyn Records>,
    pub(crate) config: IdempotencyConfig,
    pub(super) principal: Arc<dyn Principal>,
    /// Whether the principal is [`SharedKeySpace`](super::SharedKeySpace), the only one whose
    /// requests share one key space (an empty id from any other is no caller).
    pub(super) shared_key_space: bool,
    /// The rejection hook; `None`: the default problem+json.
    pub(super) respond: Option<Arc<Respond<IdempotencyError>>>,
    /// The layer's wait policy ([`IdempotencyLayer::wait`](super::IdempotencyLayer::wait));
    /// `None`: the locker's.
    pub(super) wait: Option<Wait>,
    /// The layer's TTL ([`IdempotencyLayer::ttl`](super::IdempotencyLayer::ttl)); `None`: the
    /// locker's.
    pub(super) ttl: Option<std::time::Duration>,
    /// What a lost lease does to the handler
    /// ([`IdempotencyLayer::on_lease_lost`](super::IdempotencyLayer::on_lease_lost)).
    pub(super) on_lost: OnLeaseLost,
}

impl IdempotencyState {
    /// The request's lock key and idempotency key: `Ok(None)` to pass it through. Who asks is
    /// checked before the key is (a request with neither credentials nor a key is a 401, not
    /// a 400), except for a request passed through without a key, which needs neither.
    pub(crate) fn begin(
        &self,
        parts: &Parts,
    ) -> Result<Option<(LockKey, IdempotencyKey)>, IdempotencyError> {
        let config = &self.config;
        let read = key::read(
            &parts.headers,
            &config.header,
            config.min_key_len,
            config.max_key_len,
        );
        if matches!(read, Ok(None)) && !config.required {
            return Ok(None);
        }
        let principal = if self.shared_key_space {
            Bytes::new()
        } else {
            match self.principal.principal(parts)? {
                id if id.is_empty() => return Err(PrincipalRejection::missing().into()),
                id => id,
            }
        };
        let key = read?.ok_or(IdempotencyError::MissingKey)?;
        let key = IdempotencyKey::new(key, principal);
        let value = key.scoped_value();
        let lock = LockKey::new(
            config.lock.key_prefix(),
            &config.namespace,
            &value,
            value.len(),
        )
        .map_err(LockError::Key)?;
        Ok(Some((lock, key)))
    }

    /// The response for a request the layer answers itself, with the error in its extensions.
    pub(crate) fn reject(&self, error: IdempotencyError) -> Response<Bytes> {
        let status = error.status();
        if status.is_server_error() {
            tracing::warn!(error = &error as &dyn std::error::Error, %status, "idempotency layer answered");
        } else {
            tracing::debug!(error = &error as &dyn std::error::Error, %status, "idempotency layer answered");
        }
        let mut response = match &self.respond {
            None => super::response::idempotency_problem(&error, status),
            Some(respond) => respond(&Rejection::new(&error, status)),
        };
        response.extensions_mut().insert(error);
        response
    }
}

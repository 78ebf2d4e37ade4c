//! [`LockState`]: what every clone of a `LockService` shares: the locker, the key source, and
//! how a request's keys and rejections are made.

use std::{collections::HashSet, sync::Arc};

use bytes::Bytes;
use http::{Response, request::Parts};

use crate::{
    config::OnLeaseLost,
    engine::Locker,
    error::LockError,
    key::{KeyRejection, KeySet, KeyValues, LockKey, Scope, Share, Source},
    response::{Rejection, Respond, lock_problem},
    telemetry::Chain,
    wait::Wait,
};

/// How much of a request body a layer whose keys are in the body reads (default).
pub(crate) const DEFAULT_MAX_BODY: usize = 1 << 20;

/// What every clone of the service needs, behind one `Arc` (axum clones the service per request).
#[derive(Clone)]
pub(crate) struct LockState {
    pub(crate) locker: Locker,
    pub(super) source: Source,
    /// What keys are scoped by: the layer's namespace, or the source's default
    /// ([`LockLayer::namespace`](super::LockLayer::namespace)).
    pub(super) scope: Scope,
    /// The rejection hook; `None`: the default problem+json.
    pub(super) respond: Option<Arc<Respond<LockError>>>,
    /// The most body bytes a source that reads the body gets (larger: 413).
    pub(super) max_body: usize,
    /// The keys' permits ([`LockLayer::permits`](super::LockLayer::permits)).
    pub(super) permits: Option<u32>,
    /// Which requests take their keys shared
    /// ([`LockLayer::shared_when`](super::LockLayer::shared_when)).
    pub(super) shared_when: Option<SharedWhen>,
    /// The layer's wait policy ([`LockLayer::wait`](super::LockLayer::wait)); `None`: the
    /// locker's.
    pub(super) wait: Option<Wait>,
    /// The layer's TTL ([`LockLayer::ttl`](super::LockLayer::ttl)); `None`: the locker's.
    pub(super) ttl: Option<std::time::Duration>,
    /// What a lost lease does to the handler
    /// ([`LockLayer::on_lease_lost`](super::LockLayer::on_lease_lost)).
    pub(super) on_lost: OnLeaseLost,
    /// Whether the lease lasts until the response body ends
    /// ([`LockLayer::hold_until_body_end`](super::LockLayer::hold_until_body_end)).
    pub(super) hold_until_body_end: bool,
}

/// A layer's choice of the requests that take their keys shared.
pub(super) type SharedWhen = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;

impl LockState {
    /// Whether the key source reads the body.
    pub(crate) fn reads_body(&self) -> bool {
        matches!(self.source, Source::Body(_))
    }

    /// The request's lock keys from its head: `Ok(None)` to pass it through unlocked.
    pub(crate) fn keys(&self, parts: &mut Parts) -> Result<Option<KeySet>, KeyRejection> {
        let values = self.source.head_keys(parts)?;
        self.key_set(parts, values)
    }

    /// `values` as the request's lock keys, scoped and counted.
    fn key_set(
        &self,
        parts: &Parts,
        values: Option<KeyValues>,
    ) -> Result<Option<KeySet>, KeyRejection> {
        values
            .map(|values| {
                self.scoped(parts, &values)
                    .map(|keys| self.counted(parts, keys))
            })
            .transpose()
    }

    /// `keys` with the share the layer takes for this request: one of the permits, shared or
    /// exclusive; the plain lease without either setting.
    fn counted(&self, parts: &Parts, keys: KeySet) -> KeySet {
        let share = match (&self.shared_when, self.permits) {
            (None, None) => return keys,
            (None, Some(permits)) => Share::permit(permits),
            (Some(shared), permits) => {
                let capacity = permits.unwrap_or(Share::READERS);
                match shared(parts) {
                    true => Share::permit(capacity),
                    false => Share::exclusive(capacity),
                }
            }
        };
        // Checked by the builder: never an error here.
        match share {
            Ok(share) => keys.map_share(|_| Some(share)),
            Err(_) => keys,
        }
    }

    /// The request's lock keys from its head and `body`: `Ok(None)` to pass it through unlocked.
    pub(crate) fn body_keys(
        &self,
        parts: &mut Parts,
        body: &Bytes,
    ) -> Result<Option<KeySet>, KeyRejection> {
        let max = self.locker.config().max_keys();
        let values = self.source.body_keys(parts, body, max)?;
        self.key_set(parts, values)
    }

    /// `values` as lock keys: each scoped and prefixed, at most `max_keys` distinct ones (a
    /// value given twice is one key, and counts once). Keys are made only up to the first value
    /// past the limit, so the keys made are bounded by the limit; a repeated value costs one
    /// lookup of its bytes, so the walk over a source's values is as long as the list the source
    /// built (a source that turns client input into values one for one bounds its input: the
    /// body sources stop at the limit themselves).
    fn scoped(&self, parts: &Parts, values: &KeyValues) -> Result<KeySet, KeyRejection> {
        let max = self.locker.config().max_keys();
        let keys = match values.as_slice() {
            [] => return Err(KeyRejection::invalid("the request names no lock key")),
            [value] => KeySet::from(self.key(parts, value)?),
            values => {
                let mut distinct = HashSet::with_capacity(values.len().min(max));
                let mut keys = Vec::with_capacity(values.len().min(max));
                for value in values {
                    if distinct.contains(&value[..]) {
                        continue;
                    }
                    if distinct.len() == max {
                        return Err(KeyRejection::invalid(format!(
                            "the request names more than {max} lock keys; the limit is {max}"
                        )));
                    }
                    distinct.insert(&value[..]);
                    keys.push(self.key(parts, value)?);
                }
                KeySet::from(keys)
            }
        };
        Ok(keys)
    }

    /// `value`'s lock key.
    fn key(&self, parts: &Parts, value: &[u8]) -> Result<LockKey, KeyRejection> {
        let config = self.locker.config();
        let scope = match &self.scope {
            Scope::Named(name) => [&**name, "", ""],
            Scope::Route(params) => route_scope(matched_path(parts), params),
            Scope::Template => [matched_path(parts).unwrap_or("path"), "", ""],
        };
        LockKey::from_parts(config.key_prefix(), &scope, value, config.max_key_len())
    }

    /// The response for a rejected request, with the error in its extensions.
    pub(crate) fn reject(&self, error: LockError) -> Response<Bytes> {
        let status = error.status();
        match &error {
            LockError::Key(rejection) => {
                tracing::debug!(%status, reason = rejection.detail(), "rejected: bad lock key")
            }
            other => tracing::warn!(%status, error = %Chain(other), "request rejected"),
        }
        let mut response = match &self.respond {
            None => lock_problem(&error, status),
            Some(respond) => respond(&Rejection::new(&error, status)),
        };
        response.extensions_mut().insert(error);
        response
    }
}

/// The scope of a key from path parameters `params`: the matched `route` up to the end of the
/// segment that holds the last of them (`/accounts/{id}` of `/accounts/{id}/withdraw`), so that
/// every route below a resource, whatever its method, shares the resource's locks; outside a
/// route that names them, the last parameter's name in braces (`{id}`).
fn route_scope<'a>(route: Option<&'a str>, params: &'a [Arc<str>]) -> [&'a str; 3] {
    let end = route.and_then(|route| {
        params
            .iter()
            .filter_map(|param| param_end(route, param))
            .max()
            .map(|end| &route[..end])
    });
    match (end, params.last()) {
        (Some(resource), _) => [resource, "", ""],
        (None, Some(last)) => ["{", last, "}"],
        (None, None) => ["", "", ""],
    }
}

/// Where the segment of `route` that captures `param` (`{param}` or `{*param}`) ends.
fn param_end(route: &str, param: &str) -> Option<usize> {
    let mut at = 0;
    while let Some(open) = route[at..].find('{') {
        let start = at + open + 1;
        let rest = &route[start..];
        let name = rest.strip_prefix('*').unwrap_or(rest);
        if let Some(after) = name.strip_prefix(param)
            && after.starts_with('}')
        {
            let close = route.len() - after.len() + 1;
            return Some(
                route[close..]
                    .find('/')
                    .map_or(route.len(), |slash| close + slash),
            );
        }
        at = start;
    }
    None
}

/// The route template axum matched (`/items/{sku}/purchase`), for the default scope of path
/// parameters.
fn matched_path(parts: &Parts) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(path) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return Some(path.as_str());
    }
    let _ = parts;
    None
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::route_scope;

    /// A path parameter's default scope is the route up to the segment that holds it, whatever
    /// follows; the last of several; `{name}` outside a route that has it.
    #[test]
    fn a_path_parameter_is_scoped_by_the_resource_it_names() {
        let scope = |route: Option<&str>, params: &[&str]| {
            let params: Vec<Arc<str>> = params.iter().map(|&p| Arc::from(p)).collect();
            route_scope(route, &params).concat()
        };
        let id = &["id"][..];
        assert_eq!(scope(Some("/accounts/{id}"), id), "/accounts/{id}");
        assert_eq!(scope(Some("/accounts/{id}/withdraw"), id), "/accounts/{id}");
        assert_eq!(scope(Some("/users/{id}"), id), "/users/{id}");
        // A name that only begins like the parameter's is another parameter.
        assert_eq!(scope(Some("/a/{idx}/b/{id}/c"), id), "/a/{idx}/b/{id}");
        assert_eq!(scope(Some("/files/{*id}"), id), "/files/{*id}");
        assert_eq!(
            scope(Some("/carts/{cart}/items/{sku}/x"), &["sku", "cart"]),
            "/carts/{cart}/items/{sku}"
        );
        assert_eq!(scope(Some("/other/{x}"), id), "{id}");
        assert_eq!(scope(None, id), "{id}");
        assert_eq!(scope(None, &[]), "");
    }
}

//! The request fingerprint: what a retry must repeat to be replayed.

use http::{HeaderName, request::Parts};
use sha2::{Digest, Sha256};

/// Which parts of a request make up its fingerprint, a SHA-256 digest stored with the record.
///
/// A request whose key has a record but whose fingerprint differs is answered 422: the client
/// reused a key for a different request. By default the fingerprint covers the method, the
/// request path (not the route template: `/orders/1` and `/orders/2` differ) with its query
/// string (`?amount=5` and `?amount=50` differ; as sent, so reordered or re-encoded parameters
/// differ too: turn it off for clients that sign or re-sign URLs per attempt; a request without a
/// query has the digest it had before the query counted),
/// the body's media type (`Content-Type` without its parameters, case-insensitive:
/// the same bytes sent as JSON and as a form are two requests) and the body's bytes. Turn parts
/// off, or add request headers:
///
/// ```
/// use http::HeaderName;
/// use tower_lock::idempotency::Fingerprint;
///
/// // The body alone, plus the API version header.
/// let fingerprint = Fingerprint::default()
///     .method(false)
///     .path(false)
///     .header(HeaderName::from_static("api-version"));
/// # let _ = fingerprint;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    method: bool,
    path: bool,
    query: bool,
    content_type: bool,
    body: bool,
    headers: Vec<HeaderName>,
}

impl Default for Fingerprint {
    fn default() -> Self {
        Self {
            method: true,
            path: true,
            query: true,
            content_type: true,
            body: true,
            headers: Vec::new(),
        }
    }
}

impl Fingerprint {
    /// Whether the method counts (default `true`).
    #[must_use]
    pub fn method(mut self, on: bool) -> Self {
        self.method = on;
        self
    }

    /// Whether the request path counts (default `true`).
    #[must_use]
    pub fn path(mut self, on: bool) -> Self {
        self.path = on;
        self
    }

    /// Whether the query string counts (default `true`), byte for byte as sent.
    #[must_use]
    pub fn query(mut self, on: bool) -> Self {
        self.query = on;
        self
    }

    /// Whether the body's media type counts (default `true`): the `Content-Type` header's
    /// `type/subtype`, lowercased, without parameters (`application/json; charset=utf-8` is
    /// `application/json`); a request without the header differs from one with it.
    #[must_use]
    pub fn content_type(mut self, on: bool) -> Self {
        self.content_type = on;
        self
    }

    /// Whether the body's bytes count (default `true`).
    #[must_use]
    pub fn body(mut self, on: bool) -> Self {
        self.body = on;
        self
    }

    /// Adds a request header whose values count (in order; a missing header counts as absent).
    #[must_use]
    pub fn header(mut self, name: HeaderName) -> Self {
        self.headers.push(name);
        self
    }

    /// The digest of `parts` and `body`. Every part is tagged and length-prefixed, so no two
    /// different requests can share an encoding.
    pub(crate) fn digest(&self, parts: &Parts, body: &[u8]) -> [u8; 32] {
        let mut hash = Sha256::new();
        let mut part = |tag: u8, bytes: &[u8]| {
            hash.update([tag]);
            hash.update((bytes.len() as u64).to_be_bytes());
            hash.update(bytes);
        };
        part(0, b"tower-lock idempotency fingerprint v1");
        if self.method {
            part(b'm', parts.method.as_str().as_bytes());
        }
        if self.path {
            part(b'p', parts.uri.path().as_bytes());
        }
        // Only a query there is: a request without one has the digest it had before the query
        // counted (records stored then still match their retries).
        if self.query
            && let Some(query) = parts.uri.query().filter(|q| !q.is_empty())
        {
            part(b'q', query.as_bytes());
        }
        if self.content_type
            && let Some(value) = parts.headers.get(http::header::CONTENT_TYPE)
        {
            let essence = value
                .as_bytes()
                .split(|&b| b == b';')
                .next()
                .unwrap_or_default();
            part(b't', &essence.trim_ascii().to_ascii_lowercase());
        }
        for name in &self.headers {
            part(b'h', name.as_str().as_bytes());
            for value in parts.headers.get_all(name) {
                part(b'v', value.as_bytes());
            }
        }
        if self.body {
            part(b'b', body);
        }
        hash.finalize().into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(method: &str, uri: &str) -> Parts {
        typed(method, uri, None)
    }

    fn typed(method: &str, uri: &str, content_type: Option<&str>) -> Parts {
        let mut request = http::Request::builder()
            .method(method)
            .uri(uri)
            .header("api-version", "2");
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn the_media_type_counts_without_its_parameters() {
        let f = Fingerprint::default();
        let json = f.digest(&typed("POST", "/a", Some("application/json")), b"{}");
        assert_eq!(
            json,
            f.digest(
                &typed("POST", "/a", Some("Application/JSON; charset=utf-8")),
                b"{}"
            )
        );
        assert_ne!(json, f.digest(&typed("POST", "/a", None), b"{}"));
        assert_ne!(
            json,
            f.digest(&typed("POST", "/a", Some("text/plain")), b"{}")
        );
        let untyped = Fingerprint::default().content_type(false);
        assert_eq!(
            untyped.digest(&typed("POST", "/a", Some("application/json")), b"{}"),
            untyped.digest(&typed("POST", "/a", None), b"{}")
        );
    }

    #[test]
    fn parts_count_as_configured() {
        let f = Fingerprint::default();
        let base = f.digest(&parts("POST", "/a"), b"{}");
        assert_ne!(
            f.digest(&parts("POST", "/a?x=1"), b"{}"),
            f.digest(&parts("POST", "/a?x=2"), b"{}"),
            "query not counted"
        );
        assert_ne!(base, f.digest(&parts("PUT", "/a"), b"{}"));
        assert_ne!(base, f.digest(&parts("POST", "/b"), b"{}"));
        assert_ne!(base, f.digest(&parts("POST", "/a"), b"{ }"));
        let body_only = Fingerprint::default().method(false).path(false);
        assert_eq!(
            body_only.digest(&parts("POST", "/a"), b"1"),
            body_only.digest(&parts("PUT", "/b"), b"1")
        );
        let no_body = Fingerprint::default().body(false);
        assert_eq!(
            no_body.digest(&parts("POST", "/a"), b"1"),
            no_body.digest(&parts("POST", "/a"), b"2")
        );
        assert_eq!(
            f.digest(&parts("POST", "/a"), b"{}"),
            Fingerprint::default()
                .query(false)
                .digest(&parts("POST", "/a"), b"{}"),
            "a request without a query changed its digest"
        );
        let without_query = Fingerprint::default().query(false);
        assert_eq!(
            without_query.digest(&parts("POST", "/a?x=1"), b""),
            without_query.digest(&parts("POST", "/a?x=2"), b"")
        );
        let header = Fingerprint::default().header(HeaderName::from_static("api-version"));
        assert_ne!(
            header.digest(&parts("POST", "/a"), b""),
            f.digest(&parts("POST", "/a"), b"")
        );
    }
}

//! Reading the `Idempotency-Key` header.

use bytes::Bytes;
use http::{HeaderMap, HeaderName};

use super::error::IdempotencyError;

/// The request's idempotency key and principal, in the request extensions while the handler
/// runs. With the `axum` feature it is an extractor: a handler behind
/// [`IdempotencyLayer`](crate::IdempotencyLayer) takes `key: IdempotencyKey` (or
/// `Option<IdempotencyKey>`), the key the layer read and checked.
///
/// The [`Lease`](crate::Lease) is there too: its [`fencing_token`](crate::Lease::fencing_token)
/// and [`key`](crate::Lease::key) let a handler make its own writes conditional, which closes
/// the window the layer cannot (see the [module docs](super#what-the-layer-cannot-close)).
#[derive(Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    key: Bytes,
    principal: Bytes,
}

impl std::fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The principal may be a secret (an API key): never in a log line.
        f.debug_struct("IdempotencyKey")
            .field("key", &self.as_str())
            .field(
                "principal",
                &format_args!("<{} bytes>", self.principal.len()),
            )
            .finish()
    }
}

impl IdempotencyKey {
    pub(crate) fn new(key: Bytes, principal: Bytes) -> Self {
        Self { key, principal }
    }

    /// The key the client sent, unquoted. Always visible ASCII.
    pub fn as_str(&self) -> &str {
        // Only printable ASCII gets through parsing.
        std::str::from_utf8(&self.key).unwrap_or_default()
    }

    /// The principal it is scoped by (empty in a [`SharedKeySpace`](super::SharedKeySpace)).
    pub fn principal(&self) -> &[u8] {
        &self.principal
    }

    /// The value locked on and recorded under: the principal, length-prefixed, then the key.
    pub(crate) fn scoped_value(&self) -> Vec<u8> {
        let len = self.principal.len().to_string();
        let mut value = Vec::with_capacity(len.len() + 1 + self.principal.len() + self.key.len());
        value.extend_from_slice(len.as_bytes());
        value.push(b':');
        value.extend_from_slice(&self.principal);
        value.extend_from_slice(&self.key);
        value
    }
}

/// The header's key: `Ok(None)` when it is absent.
pub(crate) fn read(
    headers: &HeaderMap,
    name: &HeaderName,
    min: usize,
    max: usize,
) -> Result<Option<Bytes>, IdempotencyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(IdempotencyError::invalid_key(format!(
            "the `{name}` header is sent more than once; send it once"
        )));
    }
    let key = parse(value.as_bytes()).map_err(|why| {
        IdempotencyError::invalid_key(format!(
            "the `{name}` header must be a structured-field string (\"...\") or a bare token: {why}"
        ))
    })?;
    if key.len() < min {
        return Err(IdempotencyError::invalid_key(format!(
            "the key in the `{name}` header is {} bytes long; the shortest accepted is {min}",
            key.len()
        )));
    }
    if key.len() > max {
        return Err(IdempotencyError::invalid_key(format!(
            "the key in the `{name}` header is {} bytes long; the longest accepted is {max}",
            key.len()
        )));
    }
    Ok(Some(key))
}

/// A Structured Field string (RFC 9651 §3.3.3: `"..."` with `\"` and `\\` escapes, printable
/// ASCII) or, as Stripe's clients send, a bare key without quotes. Both spell the same key:
/// `"abc"` and `abc` are one key.
///
/// A bare key holds only the characters of a Structured Field token (`tchar`, `:` and `/`),
/// first character included (a token must start with a letter or `*`; a bare UUID starts with
/// a digit, and is accepted). Nothing else: a comma, a semicolon, a space, `=`, parentheses or
/// brackets could be read by a proxy or a structured-field parser as a list, parameters or
/// another item, so that two hops see two keys (`a,b` joined from two field lines, or split
/// into them).
pub(crate) fn parse(raw: &[u8]) -> Result<Bytes, &'static str> {
    let raw = raw.trim_ascii();
    if raw.is_empty() {
        return Err("it is empty");
    }
    let Some(quoted) = raw.strip_prefix(b"\"") else {
        if raw.iter().copied().all(is_token_char) {
            return Ok(Bytes::copy_from_slice(raw));
        }
        return Err(
            "a bare key may hold only letters, digits and `!#$%&'*+-.^_`|~:/` (no comma, \
             semicolon, space or quote); quote any other key as a string",
        );
    };
    let mut out = Vec::with_capacity(quoted.len());
    let mut bytes = quoted.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err("only `\\\"` and `\\\\` are escapes"),
            },
            b'"' => {
                return if bytes.next().is_some() {
                    Err("nothing may follow the closing quote")
                } else if out.is_empty() {
                    Err("the string is empty")
                } else {
                    Ok(Bytes::from(out))
                };
            }
            0x20..=0x7e => out.push(b),
            _ => return Err("a string may hold only printable ASCII"),
        }
    }
    Err("the closing quote is missing")
}

/// A character of a Structured Field token (RFC 9651 §3.3.4): `tchar` (RFC 9110), `:` or `/`.
fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structured_strings_and_bare_tokens() {
        assert_eq!(parse(br#""8e03-ab""#).unwrap(), "8e03-ab");
        assert_eq!(parse(b"8e03-ab").unwrap(), "8e03-ab");
        assert_eq!(parse(b"  \"a b\"  ").unwrap(), "a b");
        assert_eq!(parse(br#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
        // Every token character, bare; a comma only inside a string.
        assert_eq!(
            parse(b"*Az09!#$%&'+-.^_`|~:/").unwrap(),
            "*Az09!#$%&'+-.^_`|~:/"
        );
        assert_eq!(parse(br#""a,b""#).unwrap(), "a,b");
        for bad in [
            &b""[..],
            b"\"\"",
            b"\"abc",
            b"\"abc\"x",
            b"\"a\\nb\"",
            b"a b",
            b"ab\"",
            b"\"\xc3\xa9\"",
            b"\"a\tb\"",
            // What a proxy could split or join: a list, parameters, an inner list.
            b"key,with,commas,longer-than-twenty-chars",
            b"a;b=1",
            b"(a b)",
            b"a=b",
            b"a@b",
            b"[a]",
            b"{a}",
            b"a\\b",
            b"a?b",
        ] {
            assert!(
                parse(bad).is_err(),
                "{:?} accepted",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn lengths_and_repeats() {
        let name = HeaderName::from_static("idempotency-key");
        let mut headers = HeaderMap::new();
        assert_eq!(read(&headers, &name, 4, 8).unwrap(), None);
        headers.insert(&name, "\"abc\"".parse().unwrap());
        let short = read(&headers, &name, 4, 8).expect_err("too short accepted");
        assert_eq!(
            short.to_string(),
            "the idempotency key is invalid: the key in the `idempotency-key` header is 3 bytes \
             long; the shortest accepted is 4"
        );
        headers.insert(&name, "abcd".parse().unwrap());
        assert_eq!(read(&headers, &name, 4, 8).unwrap().unwrap(), "abcd");
        headers.insert(&name, "abcdefghi".parse().unwrap());
        assert!(read(&headers, &name, 4, 8).is_err(), "too long accepted");
        headers.insert(&name, "abcd".parse().unwrap());
        headers.append(&name, "abcd".parse().unwrap());
        assert!(read(&headers, &name, 4, 8).is_err(), "repeated accepted");
    }

    #[test]
    fn scoped_values_are_injective() {
        let a = IdempotencyKey::new(Bytes::from("1:xkey"), Bytes::from("ab"));
        let b = IdempotencyKey::new(Bytes::from("xkey"), Bytes::from("ab:1"));
        assert_ne!(a.scoped_value(), b.scoped_value());
        assert_eq!(a.scoped_value(), b"2:ab1:xkey");
    }
}

#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for IdempotencyKey {
    type Rejection = MissingIdempotencyKey;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyKey>()
            .cloned()
            .ok_or(MissingIdempotencyKey { _priv: () })
    }
}

/// `Option<IdempotencyKey>`: `None` on routes without the layer.
#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<IdempotencyKey>().cloned())
    }
}

/// Rejection of the [`IdempotencyKey`] extractor: the request did not pass through an
/// [`IdempotencyLayer`](crate::IdempotencyLayer) (a client's missing header is answered by the
/// layer, with a 400, before the handler). A server bug, so a 500.
#[cfg(feature = "axum")]
#[derive(Debug)]
pub struct MissingIdempotencyKey {
    _priv: (),
}

#[cfg(feature = "axum")]
impl MissingIdempotencyKey {
    const MESSAGE: &'static str = "The `IdempotencyKey` extractor found no key: this route is not \
        wrapped in a `tower_lock::IdempotencyLayer`. Add `.route_layer(IdempotencyLayer::new(..))` \
        to the route, or extract `Option<IdempotencyKey>`.";
}

#[cfg(feature = "axum")]
impl MissingIdempotencyKey {
    /// 500: a route that extracts the key without the layer is the server's mistake.
    pub fn status(&self) -> http::StatusCode {
        http::StatusCode::INTERNAL_SERVER_ERROR
    }

    /// The `application/problem+json` response (type
    /// [`#layer-missing`](crate::response#layer-missing)); the detail names the fix.
    pub fn problem(&self) -> http::Response<bytes::Bytes> {
        crate::response::layer_missing(Self::MESSAGE)
    }
}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for MissingIdempotencyKey {
    fn into_response(self) -> axum::response::Response {
        tracing::error!("{}", Self::MESSAGE);
        self.problem().map(axum::body::Body::from)
    }
}

#[cfg(feature = "axum")]
impl std::fmt::Display for MissingIdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(Self::MESSAGE)
    }
}

#[cfg(feature = "axum")]
impl std::error::Error for MissingIdempotencyKey {}

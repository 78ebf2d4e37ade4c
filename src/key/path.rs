use bytes::Bytes;
use http::request::Parts;
use percent_encoding::percent_decode;

use super::{KeyRejection, KeySource, KeyValues};

/// Locks on the request path as the router resolves it, whatever its spelling.
/// Created by [`Key::path`](super::Key::path).
///
/// A router matches on the raw path and percent-decodes what it captures, so
/// `/accounts/1/withdraw` and `/accounts/%31/withdraw` are one resource to the handler. The
/// value is therefore the path with each segment percent-decoded (as axum decodes, so a
/// malformed escape such as `%zz` stays as it is), then written back canonically: segments
/// joined by `/`, with only `%` and `/` inside a segment escaped (`%25`, `%2F`). So every
/// spelling of one path gives one value, and a `%2F` inside a segment, which a router takes for
/// part of one segment, never meets the `/` between two segments. A path without `%` is its own
/// canonical form. The query is ignored; `.`, `..`, empty segments and a trailing `/` are kept,
/// as routers keep them.
///
/// Under axum, on a matched route, the value is built from what the router resolved, whatever
/// the spelling: the route template with each parameter replaced by its decoded value. This
/// differs from the above in two places: a catch-all (`/files/{*path}`) captures `a%2Fb/c` and
/// `a/b/c` alike as `a/b/c`, so both give `/files/a/b/c`; and under [`Router::nest`], whose
/// inner routes see the path without the prefix but whose matched template has it, the value
/// is the whole path (`/api/accounts/1`), the prefix included.
///
/// [`Router::nest`]: https://docs.rs/axum/0.8/axum/struct.Router.html#method.nest
///
/// A segment that is not UTF-8 once percent-decoded is a 400, as axum rejects such a path
/// parameter.
#[derive(Debug, Clone)]
pub struct PathKey {
    _priv: (),
}

impl PathKey {
    pub(super) fn new() -> Self {
        Self { _priv: () }
    }
}

impl PathKey {
    /// The value of a request no router resolved: the path itself when it has no `%`, else
    /// the path canonicalized.
    fn unrouted(parts: &Parts) -> Result<KeyValues, KeyRejection> {
        let path = parts.uri.path();
        if !path.contains('%') {
            return Ok(Bytes::copy_from_slice(path.as_bytes()).into());
        }
        Ok(Bytes::from(canonical(path)?).into())
    }
}

/// Under axum, on a matched route, reads the route's parameters: called from a source of your
/// own, from a copy of the request's extensions (see [`PathParamKey`]); a layer built with the
/// source itself reads them in place.
///
/// [`PathParamKey`]: super::PathParamKey
impl KeySource for PathKey {
    fn keys(&self, parts: &Parts) -> Result<Option<KeyValues>, KeyRejection> {
        #[cfg(feature = "axum")]
        if let Some(resolved) = routed::resolved(parts, super::path_param::path_params_of)? {
            return Ok(Some(Bytes::from(resolved).into()));
        }
        Self::unrouted(parts).map(Some)
    }
}

#[cfg(feature = "axum")]
impl super::into::sealed::Routed for PathKey {
    fn keys_routed(&self, parts: &mut Parts) -> Result<Option<KeyValues>, KeyRejection> {
        if let Some(resolved) = routed::resolved(&mut *parts, super::path_param::path_params)? {
            return Ok(Some(Bytes::from(resolved).into()));
        }
        Self::unrouted(parts).map(Some)
    }
}

/// `path` with each segment percent-decoded and escaped back (see [`PathKey`]).
fn canonical(path: &str) -> Result<Vec<u8>, KeyRejection> {
    let mut out = Vec::with_capacity(path.len());
    for (i, segment) in path.split('/').enumerate() {
        if i > 0 {
            out.push(b'/');
        }
        let decoded: std::borrow::Cow<'_, [u8]> = percent_decode(segment.as_bytes()).into();
        if std::str::from_utf8(&decoded).is_err() {
            return Err(KeyRejection::invalid(
                "the request path is not valid UTF-8 once percent-decoded",
            ));
        }
        escape(&decoded, &mut out);
    }
    Ok(out)
}

/// Writes one decoded segment: `%` and `/` escaped, every other byte as it is.
fn escape(segment: &[u8], out: &mut Vec<u8>) {
    for &b in segment {
        match b {
            b'%' => out.extend_from_slice(b"%25"),
            b'/' => out.extend_from_slice(b"%2F"),
            _ => out.push(b),
        }
    }
}

#[cfg(feature = "axum")]
mod routed {
    use axum::extract::{MatchedPath, RawPathParams};
    use http::request::Parts;
    use percent_encoding::percent_decode;

    use super::{KeyRejection, escape};

    /// The path axum resolved: the matched template with its parameters' decoded values, the
    /// parameters read by `path_params`. `None` when no route matched (or the parameters do
    /// not fit the template).
    pub(super) fn resolved<P>(
        parts: P,
        path_params: fn(P) -> Result<Option<RawPathParams>, KeyRejection>,
    ) -> Result<Option<Vec<u8>>, KeyRejection>
    where
        P: std::ops::Deref<Target = Parts>,
    {
        let Some(template) = parts.extensions.get::<MatchedPath>().cloned() else {
            return Ok(None);
        };
        let Some(params) = path_params(parts)? else {
            return Ok(None);
        };
        let params: Vec<(&str, &str)> = params.iter().collect();
        Ok(substitute(template.as_str(), &params))
    }

    /// Walks a matchit template: `{{` and `}}` are literal braces, `{name}` a parameter that
    /// ends its segment, `{*name}` a catch-all that ends the route. Parameters are matched to
    /// `params` in order, by name.
    pub(super) fn substitute(template: &str, params: &[(&str, &str)]) -> Option<Vec<u8>> {
        let t = template.as_bytes();
        let mut params = params.iter();
        let mut out = Vec::with_capacity(t.len() + 16);
        // The current segment: its static text so far (raw, as it appears in the path), and
        // what is already decoded.
        let mut raw = Vec::new();
        let mut segment = Vec::new();
        let mut i = 0;
        while i < t.len() {
            match (t[i], t.get(i + 1)) {
                (b'{', Some(b'{')) | (b'}', Some(b'}')) => {
                    raw.push(t[i]);
                    i += 2;
                }
                (b'/', _) => {
                    segment.extend(percent_decode(&raw));
                    raw.clear();
                    escape(&segment, &mut out);
                    segment.clear();
                    out.push(b'/');
                    i += 1;
                }
                (b'{', _) => {
                    let mut name = Vec::new();
                    i += 1;
                    loop {
                        match (t.get(i)?, t.get(i + 1)) {
                            (b'{', Some(b'{')) | (b'}', Some(b'}')) => {
                                name.push(t[i]);
                                i += 2;
                            }
                            (b'}', _) => break,
                            (&b, _) => {
                                name.push(b);
                                i += 1;
                            }
                        }
                    }
                    i += 1;
                    let (catch_all, name) = match name.strip_prefix(b"*") {
                        Some(name) => (true, name),
                        None => (false, &name[..]),
                    };
                    let (param, value) = params.next()?;
                    if param.as_bytes() != name {
                        return None;
                    }
                    segment.extend(percent_decode(&raw));
                    raw.clear();
                    if catch_all {
                        // The router does not tell `%2F` from `/` in what a catch-all captures.
                        for (k, piece) in value.split('/').enumerate() {
                            if k > 0 {
                                escape(&segment, &mut out);
                                segment.clear();
                                out.push(b'/');
                            }
                            segment.extend_from_slice(piece.as_bytes());
                        }
                    } else {
                        segment.extend_from_slice(value.as_bytes());
                    }
                }
                (b, _) => {
                    raw.push(b);
                    i += 1;
                }
            }
        }
        if params.next().is_some() {
            return None;
        }
        segment.extend(percent_decode(&raw));
        escape(&segment, &mut out);
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(uri: &str) -> Result<Option<KeyValues>, KeyRejection> {
        let parts = http::Request::get(uri).body(()).unwrap().into_parts().0;
        PathKey::new().keys(&parts)
    }

    fn value(uri: &str) -> String {
        let values = key(uri).unwrap().unwrap();
        String::from_utf8(values.as_slice()[0].to_vec()).unwrap()
    }

    #[test]
    fn spellings_of_one_path_are_one_value() {
        assert_eq!(value("/a/b?q=1"), "/a/b");
        assert_eq!(value("/accounts/%31/withdraw"), "/accounts/1/withdraw");
        assert_eq!(value("/%61%2f%62"), "/a%2Fb");
        assert_eq!(value("/a%2Fb"), value("/a%2fb"));
        assert_ne!(value("/a%2Fb"), value("/a/b"));
        // A literal or escaped `%`; a malformed escape stays as it is, as axum leaves it.
        assert_eq!(value("/100%25"), "/100%25");
        assert_eq!(value("/%zz"), value("/%25zz"));
        assert_eq!(value("/%4"), "/%254");
        assert_eq!(value("/caf%C3%A9"), "/café");
        // Kept as a router keeps them.
        assert_eq!(value("/a/./../b//"), "/a/./../b//");
        assert_eq!(value("/a/%2E%2E"), "/a/..");
        assert_ne!(value("/a/"), value("/a"));
        assert_eq!(value("/"), "/");
    }

    #[test]
    fn not_utf8_once_decoded_is_a_400() {
        let err = key("/a/%FF").unwrap_err();
        assert!(err.is_client_error());
        assert!(err.detail().contains("UTF-8"), "{err}");
    }

    #[cfg(feature = "axum")]
    #[test]
    fn templates_are_filled_with_decoded_params() {
        use routed::substitute;
        let s =
            |t: &str, p: &[(&str, &str)]| substitute(t, p).map(|v| String::from_utf8(v).unwrap());
        assert_eq!(s("/a/{x}/b", &[("x", "1/2%")]).unwrap(), "/a/1%2F2%25/b");
        assert_eq!(s("/f/{*rest}", &[("rest", "a/b/")]).unwrap(), "/f/a/b/");
        assert_eq!(s("/f/x{*rest}", &[("rest", "y/z")]).unwrap(), "/f/xy/z");
        assert_eq!(s("/p/img-{id}", &[("id", "7")]).unwrap(), "/p/img-7");
        assert_eq!(s("/{{lit}}/%41", &[]).unwrap(), "/{lit}/A");
        assert_eq!(s("/{a}}b}", &[("a}b", "v")]).unwrap(), "/v");
        // Parameters that do not fit: fall back to the path.
        assert_eq!(s("/a/{x}", &[]), None);
        assert_eq!(s("/a/{x}", &[("y", "1")]), None);
        assert_eq!(s("/a", &[("x", "1")]), None);
        assert_eq!(s("/a/{x", &[("x", "1")]), None);
    }
}

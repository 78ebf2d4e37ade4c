use bytes::Bytes;
use http::{HeaderName, request::Parts};

use super::{KeyRejection, KeySource, KeyValues};
use crate::error::ConfigError;

/// Locks on a request header's value. Created by [`Key::header`](super::Key::header).
#[derive(Debug, Clone)]
pub struct HeaderKey {
    name: HeaderName,
    optional: bool,
}

impl HeaderKey {
    pub(super) fn new(name: &str) -> Result<Self, ConfigError> {
        let name = HeaderName::try_from(name).map_err(|_| {
            ConfigError::new(
                "Key::header",
                format!("`{name}` is not a valid header name (RFC 9110 token characters)"),
            )
        })?;
        Ok(Self {
            name,
            optional: false,
        })
    }

    /// Passes requests without the header through unlocked, instead of answering 400.
    #[must_use]
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }
}

impl HeaderKey {
    /// The header's name (lowercase), for the layer's default scope.
    pub(super) fn name(&self) -> &str {
        self.name.as_str()
    }
}

impl KeySource for HeaderKey {
    fn keys(&self, parts: &Parts) -> Result<Option<KeyValues>, KeyRejection> {
        let name = &self.name;
        let mut values = parts.headers.get_all(name).iter();
        let Some(value) = values.next() else {
            return if self.optional {
                Ok(None)
            } else {
                Err(KeyRejection::missing(format_args!("`{name}` header")))
            };
        };
        if values.next().is_some() {
            return Err(KeyRejection::invalid(format!(
                "the `{name}` header is sent more than once; send it once"
            )));
        }
        if value.is_empty() {
            return Err(KeyRejection::invalid(format!(
                "the `{name}` header is empty"
            )));
        }
        Ok(Some(Bytes::copy_from_slice(value.as_bytes()).into()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::Key;
    use super::*;

    fn parts(headers: &[(&str, &[u8])]) -> Parts {
        let mut req = http::Request::post("/p");
        for (name, value) in headers {
            req = req.header(*name, http::HeaderValue::from_bytes(value).unwrap());
        }
        req.body(()).unwrap().into_parts().0
    }

    #[test]
    fn header_present_missing_repeated_empty() {
        let source = Key::header("Idempotency-Key").unwrap();
        let got = source.keys(&parts(&[("idempotency-key", b"abc")]));
        assert_eq!(got.unwrap().unwrap().as_slice(), ["abc"]);

        let missing = source.keys(&parts(&[])).unwrap_err();
        assert!(missing.is_client_error());
        assert!(missing.detail().contains("idempotency-key"), "{missing}");
        assert_eq!(source.clone().optional().keys(&parts(&[])).unwrap(), None);

        let twice = [("idempotency-key", &b"a"[..]), ("idempotency-key", b"b")];
        assert!(
            source
                .keys(&parts(&twice))
                .unwrap_err()
                .detail()
                .contains("more than once")
        );
        assert!(source.keys(&parts(&[("idempotency-key", b"")])).is_err());
    }

    #[test]
    fn opaque_bytes_pass_through() {
        let source = Key::header("x-k").unwrap();
        let got = source
            .keys(&parts(&[("x-k", b"\xff\xfe\t x")]))
            .unwrap()
            .unwrap();
        assert_eq!(&got.as_slice()[0][..], b"\xff\xfe\t x");
    }

    /// A name that is no header name is refused when the source is made, not per request.
    #[test]
    fn a_bad_header_name_is_refused_when_made() {
        for bad in ["bad header", "", "x:y", "é"] {
            let refused = Key::header(bad).unwrap_err();
            assert_eq!(refused.field(), "Key::header", "{bad:?}");
        }
    }
}

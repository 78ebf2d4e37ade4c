//! [`JsonKeys`]: lock keys from fields of a JSON request body.

use std::{fmt, sync::Arc};

use bytes::Bytes;
use http::request::Parts;
use serde_json::Value;

use super::{BodyKeySource, KeyRejection, KeyValues};

/// Locks on fields of a JSON request body. Created by [`Key::json`](super::Key::json).
///
/// Each field is named by a JSON pointer (RFC 6901: `/items/0/sku`), in which a `*` segment
/// stands for every element of an array: `/items/*/sku` is the `sku` of every item.
/// [`and`](Self::and) adds more fields; every value found is one key. A value must be a string
/// (its UTF-8 bytes are the key value) or a number (its JSON text: `7` and `7.0` are two
/// keys; canonicalize in your own [`BodyKeySource`] if that matters).
///
/// | the body | answer |
/// |---|---|
/// | JSON, every field found, each a string or number | lock on them all |
/// | not JSON | 400 |
/// | a field missing, or an array under `*` empty | 400; with [`optional`](Self::optional), the request passes through unlocked if no field at all is found |
/// | a field that is not a string or number | 400 |
/// | larger than the layer's `max_request_body` | 413 |
///
/// Error details name the pointer, never the body's values.
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use axum::{Router, routing::post};
/// use tower_lock::{Key, LockLayer, MemoryStore};
///
/// // `{"from": "alice", "to": "bob", "amount": 5}`: lock both accounts.
/// let transfers = LockLayer::new(MemoryStore::new(), Key::json("/from").and("/to"))
///     .namespace("account");
/// // `{"items": [{"sku": "a", "qty": 2}, ...]}`: lock every SKU of the cart.
/// let checkout = LockLayer::new(MemoryStore::new(), Key::json("/items/*/sku"))
///     .namespace("sku");
/// let app: Router = Router::new()
///     .route("/transfers", post(|| async { "moved" }).route_layer(transfers))
///     .route("/checkout", post(|| async { "sold" }).route_layer(checkout));
/// # }
/// ```
#[derive(Clone)]
pub struct JsonKeys {
    pointers: Vec<Pointer>,
    optional: bool,
}

#[derive(Clone)]
struct Pointer {
    text: Arc<str>,
    /// The segments, unescaped; `Err` for a pointer that is not one (a misconfiguration).
    segments: Result<Arc<[String]>, ()>,
}

impl Pointer {
    fn parse(text: &str) -> Self {
        let segments = match text.strip_prefix('/') {
            None if text.is_empty() => Ok(Arc::from([])),
            None => Err(()),
            Some(rest) => Ok(rest
                .split('/')
                .map(|s| s.replace("~1", "/").replace("~0", "~"))
                .collect()),
        };
        Self {
            text: Arc::from(text),
            segments,
        }
    }
}

impl JsonKeys {
    pub(super) fn new(pointer: &str) -> Self {
        Self {
            pointers: vec![Pointer::parse(pointer)],
            optional: false,
        }
    }

    /// Also locks on the field(s) at `pointer`.
    #[must_use]
    pub fn and(mut self, pointer: &str) -> Self {
        self.pointers.push(Pointer::parse(pointer));
        self
    }

    /// Passes a request through unlocked when none of the fields is in its body (a valid JSON
    /// body, though), instead of answering 400.
    #[must_use]
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }
}

/// What looking a pointer up found.
enum Found {
    Values,
    /// Nothing at all (a member missing on the way, an empty array).
    Nothing {
        at: String,
    },
}

/// Collects the values at `segments` under `value` into `out`; `path` is where `value` is.
fn collect(
    value: &Value,
    segments: &[String],
    path: &mut String,
    out: &mut Vec<Bytes>,
) -> Result<Found, KeyRejection> {
    let Some((first, rest)) = segments.split_first() else {
        let bytes = match value {
            Value::String(s) => Bytes::copy_from_slice(s.as_bytes()),
            Value::Number(n) => Bytes::from(n.to_string()),
            _ => {
                return Err(KeyRejection::invalid(format!(
                    "the lock key at `{}` in the request body is not a string or a number",
                    display(path)
                )));
            }
        };
        out.push(bytes);
        return Ok(Found::Values);
    };
    let len = path.len();
    let found = match value {
        Value::Array(items) if first == "*" => {
            if items.is_empty() {
                path.push_str("/*");
                Found::Nothing { at: path.clone() }
            } else {
                let mut found = Found::Values;
                for (i, item) in items.iter().enumerate() {
                    path.push_str(&format!("/{i}"));
                    if let nothing @ Found::Nothing { .. } = collect(item, rest, path, out)? {
                        found = nothing;
                    }
                    path.truncate(len);
                }
                return Ok(found);
            }
        }
        Value::Array(items) => match first.parse::<usize>().ok().and_then(|i| items.get(i)) {
            Some(item) => {
                push_segment(path, first);
                collect(item, rest, path, out)?
            }
            None => {
                push_segment(path, first);
                Found::Nothing { at: path.clone() }
            }
        },
        Value::Object(members) => match members.get(first) {
            Some(member) => {
                push_segment(path, first);
                collect(member, rest, path, out)?
            }
            None => {
                push_segment(path, first);
                Found::Nothing { at: path.clone() }
            }
        },
        _ => {
            push_segment(path, first);
            Found::Nothing { at: path.clone() }
        }
    };
    path.truncate(len);
    Ok(found)
}

fn push_segment(path: &mut String, segment: &str) {
    path.push('/');
    path.push_str(&segment.replace('~', "~0").replace('/', "~1"));
}

fn display(path: &str) -> &str {
    if path.is_empty() { "/" } else { path }
}

impl BodyKeySource for JsonKeys {
    fn keys(&self, _parts: &Parts, body: &Bytes) -> Result<Option<KeyValues>, KeyRejection> {
        let value: Value = serde_json::from_slice(body).map_err(|e| {
            // serde_json's syntax errors say what and where, never quote the input.
            KeyRejection::invalid(format!(
                "the request body is not JSON ({e}), so its lock keys cannot be read"
            ))
        })?;
        let mut out = Vec::new();
        let mut missing = None;
        for pointer in &self.pointers {
            let segments = pointer.segments.as_ref().map_err(|()| {
                KeyRejection::misconfigured(format!(
                    "`{}` is not a JSON pointer (it must be empty or start with `/`)",
                    pointer.text
                ))
            })?;
            let mut path = String::new();
            if let Found::Nothing { at } = collect(&value, segments, &mut path, &mut out)? {
                missing.get_or_insert(at);
            }
        }
        match missing {
            None => Ok(Some(KeyValues::from(out))),
            Some(_) if self.optional && out.is_empty() => Ok(None),
            Some(at) => Err(KeyRejection::invalid(format!(
                "the request body has no `{at}`, which this route needs as a lock key"
            ))),
        }
    }
}

impl fmt::Debug for JsonKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonKeys")
            .field(
                "pointers",
                &self.pointers.iter().map(|p| &*p.text).collect::<Vec<_>>(),
            )
            .field("optional", &self.optional)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::Key;
    use super::*;

    fn keys(source: &JsonKeys, body: &str) -> Result<Option<Vec<String>>, KeyRejection> {
        let parts = http::Request::post("/").body(()).unwrap().into_parts().0;
        Ok(source
            .keys(&parts, &Bytes::copy_from_slice(body.as_bytes()))?
            .map(|v| {
                v.iter()
                    .map(|b| String::from_utf8(b.to_vec()).unwrap())
                    .collect()
            }))
    }

    #[test]
    fn fields_and_every_element_of_an_array() {
        let cart = Key::json("/items/*/sku");
        let got = keys(&cart, r#"{"items":[{"sku":"a","qty":2},{"sku":7}]}"#);
        assert_eq!(got.unwrap().unwrap(), ["a", "7"]);
        let transfer = Key::json("/from").and("/to");
        let got = keys(&transfer, r#"{"from":"alice","to":"bob","amount":5}"#);
        assert_eq!(got.unwrap().unwrap(), ["alice", "bob"]);
        let nested = Key::json("/a~1b/0/c~0d");
        assert_eq!(
            keys(&nested, r#"{"a/b":[{"c~d":"x"}]}"#).unwrap().unwrap(),
            ["x"]
        );
        assert_eq!(
            keys(&Key::json(""), r#""whole""#).unwrap().unwrap(),
            ["whole"]
        );
    }

    #[test]
    fn bad_bodies_are_client_errors_that_name_the_field_not_the_value() {
        let cart = Key::json("/items/*/sku");
        for (body, says) in [
            ("not json", "not JSON"),
            ("{\"items\": [", "not JSON"),
            (r#"{"items":[]}"#, "`/items/*`"),
            (r#"{"items":[{"sku":"a"},{"qty":1}]}"#, "`/items/1/sku`"),
            (r#"{}"#, "`/items`"),
            (r#"{"items":{"sku":"a"}}"#, "`/items/*`"),
            (
                r#"{"items":[{"sku":{"secret-value":1}}]}"#,
                "not a string or a number",
            ),
            (r#"{"items":[{"sku":null}]}"#, "not a string or a number"),
        ] {
            let error = keys(&cart, body).unwrap_err();
            assert!(error.is_client_error(), "{body}: {error}");
            assert!(error.detail().contains(says), "{body}: {error}");
            assert!(!error.detail().contains("secret"), "{error}");
        }
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(keys(&cart, &deep).unwrap_err().is_client_error());
    }

    #[test]
    fn optional_passes_a_body_without_the_field_through() {
        let optional = Key::json("/items/*/sku").optional();
        assert_eq!(keys(&optional, r#"{"other":1}"#).unwrap(), None);
        assert_eq!(keys(&optional, r#"{"items":[]}"#).unwrap(), None);
        assert!(keys(&optional, "nope").is_err(), "not JSON is still a 400");
    }

    #[test]
    fn a_pointer_that_is_not_one_is_a_misconfiguration() {
        let error = keys(&Key::json("items"), "{}").unwrap_err();
        assert!(!error.is_client_error(), "{error}");
    }
}

//! [`JsonKeys`]: lock keys from fields of a JSON request body.

use std::{collections::HashSet, fmt, fmt::Write as _, sync::Arc};

use bytes::Bytes;
use http::request::Parts;
use serde::de::{
    self, Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
};

use serde_json::value::RawValue;

use super::{BodyKeySource, KeyRejection, KeyValues};
use crate::error::ConfigError;

/// Locks on fields of a JSON request body. Created by [`Key::json`](super::Key::json).
///
/// Each field is named by a JSON pointer (RFC 6901: `/items/0/sku`), in which a `*` segment
/// stands for every element of an array: `/items/*/sku` is the `sku` of every item. A pointer
/// that is not one (neither empty nor starting with `/`, or with a `~` not followed by `0` or
/// `1`) is refused when the source is made ([`Key::json`](super::Key::json) and
/// [`and`](Self::and) return a [`ConfigError`]). As RFC 6901 says, a segment addresses an
/// element of an array only when it is an index without sign or leading zero (`0`, `12`, never
/// `01` or `+1`); any other segment names no element (a field missing). [`and`](Self::and)
/// adds more fields; every value found is one key. A value must be a string (its UTF-8 bytes,
/// unescaped, are the key value) or a number (its text exactly as the body has it: `7`, `7.0`
/// and `7e0` are three keys; canonicalize in your own [`BodyKeySource`] if that matters).
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
/// let transfers = LockLayer::new(MemoryStore::new(), Key::json("/from")?.and("/to")?)
///     .namespace("account");
/// // `{"items": [{"sku": "a", "qty": 2}, ...]}`: lock every SKU of the cart.
/// let checkout = LockLayer::new(MemoryStore::new(), Key::json("/items/*/sku")?)
///     .namespace("sku");
/// let app: Router = Router::new()
///     .route("/transfers", post(|| async { "moved" }).route_layer(transfers))
///     .route("/checkout", post(|| async { "sold" }).route_layer(checkout));
/// # }
/// # Ok::<(), tower_lock::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct JsonKeys {
    pointers: Vec<Pointer>,
    optional: bool,
}

#[derive(Clone)]
struct Pointer {
    text: Arc<str>,
    /// The segments, unescaped.
    segments: Arc<[String]>,
}

impl Pointer {
    fn parse(text: &str) -> Result<Self, ConfigError> {
        let refused = |why: &str| {
            ConfigError::new(
                "Key::json",
                format!("`{text}` is not a JSON pointer (RFC 6901): {why}"),
            )
        };
        let segments = match text.strip_prefix('/') {
            None if text.is_empty() => Arc::from([]),
            None => return Err(refused("it must be empty or start with `/`")),
            Some(rest) => rest
                .split('/')
                .map(unescape)
                .collect::<Option<Arc<[String]>>>()
                .ok_or_else(|| refused("a `~` must be followed by `0` or `1`"))?,
        };
        Ok(Self {
            text: Arc::from(text),
            segments,
        })
    }
}

/// A pointer's segment unescaped (`~1` is `/`, `~0` is `~`); `None` for any other `~`.
fn unescape(segment: &str) -> Option<String> {
    let mut out = String::with_capacity(segment.len());
    let mut chars = segment.chars();
    while let Some(c) = chars.next() {
        out.push(match c {
            '~' => match chars.next()? {
                '0' => '~',
                '1' => '/',
                _ => return None,
            },
            c => c,
        });
    }
    Some(out)
}

/// The array index a segment names, as RFC 6901 reads it: `0`, or digits without a leading
/// zero; `None` for anything else (`01`, `+1`, `-`, a name), which addresses no element.
fn index(segment: &str) -> Option<usize> {
    let bytes = segment.as_bytes();
    let canonical = match bytes {
        [b'0'] => true,
        [b'1'..=b'9', rest @ ..] => rest.iter().all(u8::is_ascii_digit),
        _ => false,
    };
    if canonical {
        segment.parse().ok()
    } else {
        None
    }
}

impl JsonKeys {
    pub(super) fn new(pointer: &str) -> Result<Self, ConfigError> {
        Ok(Self {
            pointers: vec![Pointer::parse(pointer)?],
            optional: false,
        })
    }

    /// The pointers, separated by spaces, for the layer's default scope.
    pub(super) fn pointer_list(&self) -> String {
        let texts: Vec<&str> = self.pointers.iter().map(|p| &*p.text).collect();
        texts.join(" ")
    }

    /// Also locks on the field(s) at `pointer`; a [`ConfigError`] if it is not a JSON pointer.
    pub fn and(mut self, pointer: &str) -> Result<Self, ConfigError> {
        self.pointers.push(Pointer::parse(pointer)?);
        Ok(self)
    }

    /// Passes a request through unlocked when none of the fields is in its body (a valid JSON
    /// body, though), instead of answering 400.
    #[must_use]
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }
}

/// The pointers as a tree of segments: one walk of the body follows them all.
#[derive(Default)]
struct Node {
    /// A pointer ends here: the value is a key.
    key: bool,
    /// Segments that follow, with their nodes, in the order the pointers name them.
    next: Vec<(String, Node)>,
}

impl Node {
    fn add(&mut self, segments: &[String]) {
        match segments.split_first() {
            None => self.key = true,
            Some((first, rest)) => {
                let i = match self.next.iter().position(|(s, _)| s == first) {
                    Some(i) => i,
                    None => {
                        self.next.push((first.clone(), Self::default()));
                        self.next.len() - 1
                    }
                };
                self.next[i].1.add(rest);
            }
        }
    }
}

/// What a walk of the body found: the values, each once, in the order read; where a field is
/// missing (the first place, in document order); and why it stopped, if it did.
struct Found {
    values: Vec<Bytes>,
    distinct: HashSet<Bytes>,
    /// The most distinct values taken before reading stops.
    max: usize,
    missing: Option<String>,
    rejection: Option<KeyRejection>,
}

impl Found {
    fn key(&mut self, value: Bytes) -> Result<(), KeyRejection> {
        if self.distinct.contains(&value) {
            return Ok(());
        }
        if self.values.len() == self.max {
            return Err(KeyRejection::invalid(format!(
                "the request names more than {max} lock keys; the limit is {max}",
                max = self.max
            )));
        }
        self.distinct.insert(value.clone());
        self.values.push(value);
        Ok(())
    }

    fn missing(&mut self, path: &str) {
        self.missing.get_or_insert_with(|| display(path).to_owned());
    }

    /// Stops the walk with `rejection` (as a serde error, which ends the parse at once).
    fn stop<E: de::Error>(&mut self, rejection: KeyRejection) -> E {
        self.rejection = Some(rejection);
        E::custom("stopped")
    }
}

/// The value at `path` in the body, where the pointers' nodes `at` are (several pointers may
/// reach one value: `/items/*/sku` and `/items/0/sku`).
struct Walk<'a> {
    at: Vec<&'a Node>,
    path: &'a mut String,
    found: &'a mut Found,
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        if self.is_key() {
            // A key's place: the value's text as the body has it (a number's literal, not
            // what it parses to).
            let raw = <&RawValue>::deserialize(deserializer)?;
            return self.key(raw.get());
        }
        deserializer.deserialize_any(self)
    }
}

impl Walk<'_> {
    fn is_key(&self) -> bool {
        self.at.iter().any(|node| node.key)
    }

    /// The value at a key's place, `text` as the body has it: a string (its value) or a number
    /// (its text) is a key, anything else is refused.
    fn key<E: de::Error>(self, text: &str) -> Result<(), E> {
        let value = match text.as_bytes().first() {
            Some(b'"') => {
                let value: String = serde_json::from_str(text).map_err(E::custom)?;
                Bytes::from(value)
            }
            Some(b'-' | b'0'..=b'9') => Bytes::copy_from_slice(text.as_bytes()),
            _ => {
                let rejection = KeyRejection::invalid(format!(
                    "the lock key at `{}` in the request body is not a string or a number",
                    display(self.path)
                ));
                return Err(self.found.stop(rejection));
            }
        };
        if let Err(rejection) = self.found.key(value) {
            return Err(self.found.stop(rejection));
        }
        self.not_a_container()
    }

    /// A value that has no members or elements: every segment expected under it is missing.
    fn not_a_container<E>(self) -> Result<(), E> {
        if let Some((segment, _)) = self.at.iter().flat_map(|node| &node.next).next() {
            let len = self.path.len();
            push_segment(self.path, segment);
            self.found.missing(self.path);
            self.path.truncate(len);
        }
        Ok(())
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    // Below, the value is at no key's place (see `deserialize`): only its members and
    // elements may matter.

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.not_a_container()
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.not_a_container()
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.not_a_container()
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.not_a_container()
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.not_a_container()
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.not_a_container()
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let expected: Vec<&str> = self
            .at
            .iter()
            .flat_map(|node| node.next.iter().map(|(s, _)| s.as_str()))
            .collect();
        let mut seen = vec![false; expected.len()];
        while let Some(name) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            let matched: Vec<usize> = (0..expected.len())
                .filter(|&i| expected[i] == name)
                .collect();
            if matched.is_empty() {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            let len = self.path.len();
            push_segment(self.path, &name);
            if matched.iter().any(|&i| seen[i]) {
                let rejection = KeyRejection::invalid(format!(
                    "the request body has `{}` twice; a lock key's field must be named once",
                    self.path
                ));
                return Err(self.found.stop(rejection));
            }
            for &i in &matched {
                seen[i] = true;
            }
            let at: Vec<&Node> = self
                .at
                .iter()
                .flat_map(|node| &node.next)
                .filter(|(s, _)| *s == name)
                .map(|(_, node)| node)
                .collect();
            map.next_value_seed(Walk {
                at,
                path: &mut *self.path,
                found: &mut *self.found,
            })?;
            self.path.truncate(len);
        }
        if let Some(i) = seen.iter().position(|seen| !seen) {
            let len = self.path.len();
            push_segment(self.path, expected[i]);
            self.found.missing(self.path);
            self.path.truncate(len);
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let segments = || self.at.iter().flat_map(|node| &node.next);
        let every: Vec<&Node> = segments()
            .filter(|(s, _)| s == "*")
            .map(|(_, node)| node)
            .collect();
        let indexed: Vec<(usize, &Node)> = segments()
            .filter_map(|(s, node)| Some((index(s)?, node)))
            .collect();
        let mut len = 0usize;
        loop {
            let at: Vec<&Node> = every
                .iter()
                .copied()
                .chain(indexed.iter().filter(|(i, _)| *i == len).map(|(_, n)| *n))
                .collect();
            let more = if at.is_empty() {
                seq.next_element::<IgnoredAny>()?.is_some()
            } else {
                let end = self.path.len();
                let _ = write!(self.path, "/{len}");
                let more = seq
                    .next_element_seed(Walk {
                        at,
                        path: &mut *self.path,
                        found: &mut *self.found,
                    })?
                    .is_some();
                self.path.truncate(end);
                more
            };
            if !more {
                break;
            }
            len += 1;
        }
        // What the array did not have: an element at all (for `*`), the one at an index, or a
        // member's name (an array has none).
        let absent = segments().find(|(s, _)| match s.as_str() {
            "*" => len == 0,
            s => index(s).is_none_or(|i| i >= len),
        });
        if let Some((segment, _)) = absent {
            let end = self.path.len();
            push_segment(self.path, segment);
            self.found.missing(self.path);
            self.path.truncate(end);
        }
        Ok(())
    }
}

fn push_segment(path: &mut String, segment: &str) {
    path.push('/');
    path.push_str(&segment.replace('~', "~0").replace('/', "~1"));
}

fn display(path: &str) -> &str {
    if path.is_empty() { "/" } else { path }
}

impl BodyKeySource for JsonKeys {
    fn keys(&self, parts: &Parts, body: &Bytes) -> Result<Option<KeyValues>, KeyRejection> {
        self.keys_at_most(parts, body, usize::MAX)
    }

    /// Reads the body once, as it parses it, and stops at the first of: more than `max`
    /// distinct values, a field of a key's path named twice in one object, a key that is not a
    /// string or number, the end.
    fn keys_at_most(
        &self,
        _parts: &Parts,
        body: &Bytes,
        max: usize,
    ) -> Result<Option<KeyValues>, KeyRejection> {
        let mut root = Node::default();
        for pointer in &self.pointers {
            root.add(&pointer.segments);
        }
        let mut found = Found {
            values: Vec::new(),
            distinct: HashSet::new(),
            max,
            missing: None,
            rejection: None,
        };
        let mut path = String::new();
        let mut deserializer = serde_json::Deserializer::from_slice(body);
        let walked = Walk {
            at: vec![&root],
            path: &mut path,
            found: &mut found,
        }
        .deserialize(&mut deserializer)
        .and_then(|()| deserializer.end());
        if let Some(rejection) = found.rejection.take() {
            return Err(rejection);
        }
        walked.map_err(|e| {
            // serde_json's syntax errors say what and where, never quote the input.
            KeyRejection::invalid(format!(
                "the request body is not JSON ({e}), so its lock keys cannot be read"
            ))
        })?;
        match found.missing {
            None => Ok(Some(KeyValues::from(found.values))),
            Some(_) if self.optional && found.values.is_empty() => Ok(None),
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
        let cart = Key::json("/items/*/sku").unwrap();
        let got = keys(&cart, r#"{"items":[{"sku":"a","qty":2},{"sku":7}]}"#);
        assert_eq!(got.unwrap().unwrap(), ["a", "7"]);
        let transfer = Key::json("/from").unwrap().and("/to").unwrap();
        let got = keys(&transfer, r#"{"from":"alice","to":"bob","amount":5}"#);
        assert_eq!(got.unwrap().unwrap(), ["alice", "bob"]);
        let nested = Key::json("/a~1b/0/c~0d").unwrap();
        assert_eq!(
            keys(&nested, r#"{"a/b":[{"c~d":"x"}]}"#).unwrap().unwrap(),
            ["x"]
        );
        assert_eq!(
            keys(&Key::json("").unwrap(), r#""whole""#)
                .unwrap()
                .unwrap(),
            ["whole"]
        );
    }

    #[test]
    fn bad_bodies_are_client_errors_that_name_the_field_not_the_value() {
        let cart = Key::json("/items/*/sku").unwrap();
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
        let optional = Key::json("/items/*/sku").unwrap().optional();
        assert_eq!(keys(&optional, r#"{"other":1}"#).unwrap(), None);
        assert_eq!(keys(&optional, r#"{"items":[]}"#).unwrap(), None);
        assert!(keys(&optional, "nope").is_err(), "not JSON is still a 400");
    }

    #[test]
    fn one_walk_follows_every_pointer_and_keeps_each_value_once() {
        let parts = http::Request::post("/").body(()).unwrap().into_parts().0;
        let both = Key::json("/items/*/sku")
            .unwrap()
            .and("/items/0/sku")
            .unwrap()
            .and("/n")
            .unwrap();
        let body = Bytes::from_static(br#"{"n": 7.0, "items": [{"sku": "a"}, {"sku": 2}]}"#);
        let values = both.keys(&parts, &body).unwrap().unwrap();
        let values: Vec<&[u8]> = values.iter().map(|v| &v[..]).collect();
        assert_eq!(values, [&b"7.0"[..], b"a", b"2"]);
        // At most one: the second distinct value stops the walk, whatever follows it.
        let body = Bytes::from_static(br#"{"items": [{"sku": "a"}, {"sku": "a"}, {"sku": "b"}, !"#);
        let error = Key::json("/items/*/sku")
            .unwrap()
            .keys_at_most(&parts, &body, 1)
            .unwrap_err();
        assert!(error.detail().contains("limit is 1"), "{error}");
        // Named twice on a key's path, at any depth; elsewhere, left alone.
        for (body, twice) in [
            (r#"{"items": [{"sku": "a", "sku": "a"}]}"#, "/items/0/sku"),
            (r#"{"items": [], "items": []}"#, "/items"),
        ] {
            let error = keys(&Key::json("/items/*/sku").unwrap(), body).unwrap_err();
            assert!(
                error.detail().contains(&format!("`{twice}` twice")),
                "{error}"
            );
        }
        let fine = r#"{"x": 1, "x": 2, "items": [{"sku": "a", "q": 1, "q": 2}]}"#;
        assert_eq!(
            keys(&Key::json("/items/*/sku").unwrap(), fine)
                .unwrap()
                .unwrap(),
            ["a"]
        );
    }

    #[test]
    fn a_pointer_that_is_not_one_is_refused_when_made() {
        for bad in ["items", "/~2", "/items/~", "/a~b"] {
            let error = Key::json(bad).unwrap_err();
            assert_eq!(error.field(), "Key::json");
            assert!(error.to_string().contains(&format!("`{bad}`")), "{error}");
            let error = Key::json("/ok").unwrap().and(bad).unwrap_err();
            assert!(error.to_string().contains(&format!("`{bad}`")), "{error}");
        }
        for good in ["", "/", "/~0~1", "/items/01", "/items/-", "/a b"] {
            assert!(Key::json(good).is_ok(), "{good}");
        }
    }

    /// An array element is addressed by an index as RFC 6901 writes it, and by nothing else: a
    /// leading zero or a sign names no element (in an object, they are names like any other).
    #[test]
    fn only_an_index_without_sign_or_leading_zero_addresses_an_element() {
        let items = r#"{"items": ["a", "b"]}"#;
        assert_eq!(
            keys(&Key::json("/items/1").unwrap(), items)
                .unwrap()
                .unwrap(),
            ["b"]
        );
        for pointer in ["/items/01", "/items/+1", "/items/-", "/items/1.0"] {
            let error = keys(&Key::json(pointer).unwrap(), items).unwrap_err();
            assert!(error.detail().contains("has no"), "{pointer}: {error}");
        }
        let named = r#"{"items": {"01": "x", "+1": "y"}}"#;
        let both = Key::json("/items/01").unwrap().and("/items/+1").unwrap();
        assert_eq!(keys(&both, named).unwrap().unwrap(), ["x", "y"]);
    }

    /// A number's key is its text as the body has it, whatever it parses to.
    #[test]
    fn a_number_is_its_text() {
        let n = Key::json("/n").unwrap();
        for text in [
            "7",
            "-7",
            "7.0",
            "7.50",
            "1e2",
            "-0",
            "1E+2",
            "18446744073709551616",
        ] {
            let body = format!(r#"{{"n": {text} }}"#);
            assert_eq!(keys(&n, &body).unwrap().unwrap(), [text], "{body}");
        }
        assert_eq!(
            keys(&n, r#"{"n": "a\u00e9\"b"}"#).unwrap().unwrap(),
            ["a\u{e9}\"b"]
        );
    }
}

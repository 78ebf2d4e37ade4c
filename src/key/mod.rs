//! Key sources: how a request becomes lock keys.
//!
//! A [`KeySource`] looks at the request head and answers one of three things:
//!
//! - `Ok(Some(values))`: lock on these values ([`KeyValues`]: one, or several taken as one
//!   lease);
//! - `Ok(None)`: this request needs no lock, pass it through unlocked;
//! - `Err(KeyRejection)`: the request is malformed (400), or the route is misconfigured (500).
//!
//! A [`BodyKeySource`] answers the same from the head and the body; a layer built with one
//! ([`Key::json`], [`Key::body`]) reads the body first.
//!
//! The built-ins are constructed through [`Key`]:
//!
//! | source | value | no key | bad key |
//! |---|---|---|---|
//! | [`Key::header`] | the header's bytes | header missing and [`HeaderKey::optional`] | missing (default), repeated, empty |
//! | [`Key::path_param`] (feature `axum`) | a matched route's path parameter, percent-decoded | the request matched no route; the route has no such parameter and [`PathParamKey::optional`] | not UTF-8 once decoded; parameter not in the route (500); layer outside the router (500) |
//! | [`Key::path_params`] (feature `axum`) | several path parameters, one key each, one lease | as `path_param` | as `path_param` |
//! | [`Key::path`] | the request path, each segment percent-decoded ([`PathKey`]) | never | a segment not UTF-8 once decoded |
//! | [`Key::from_fn`] / any closure or [`KeySource`] | what it computes from the head: one value or several | `Ok(None)` | `Err(..)`; no value at all |
//! | [`Key::json`] | fields of a JSON body, by JSON pointer ([`JsonKeys`]) | [`JsonKeys::optional`] and no field found | not JSON, a field missing or not a string or number; body too large (413) |
//! | [`Key::body`] / any [`BodyKeySource`] | what it computes from the head and the body | `Ok(None)` | `Err(..)`; no value at all; body too large (413) |
//!
//! A layer's type is [`LockLayer`](crate::LockLayer) whatever its source (see [`IntoKeys`]).
//!
//! One resource is one lock whatever its spelling: the sources that read the path key on what
//! the router resolves (percent-decoded), not on the raw bytes, so `/accounts/%31` and
//! `/accounts/1` take the same lock. A header's value is taken byte for byte, as the handler
//! reads it; if the application treats two spellings as one resource (case-insensitive ids,
//! leading zeros), canonicalize in a closure.
//!
//! # Scoping
//!
//! The value is not the whole key. The layer joins a configurable prefix (default `tower-lock:`),
//! a *scope* and the value into the [`LockKey`] sent to the store. The scope names the kind of
//! resource, so that every route (and method) that locks the same value of the same kind
//! excludes the others and shares its [fenced data](crate::fence). Unless a namespace is set
//! with [`LockLayer::namespace`](crate::LockLayer::namespace), it is the source's:
//!
//! | source | default scope |
//! |---|---|
//! | [`Key::path_param`], [`Key::path_params`] | the matched route up to the (last) parameter: `/items/{sku}` for `POST /items/{sku}/purchase` and `DELETE /items/{sku}` alike; `{sku}` outside a route that has it |
//! | [`Key::header`] | `header <name>`: `header x-merchant-id` |
//! | [`Key::json`] | `json <pointers>`: `json /from /to` |
//! | [`Key::path`] | the matched route template (`/items/{sku}/purchase`): the path's own route; `path` outside a route |
//! | [`Key::from_fn`], [`Key::body`], a source of your own | `key` |
//!
//! The method is never part of it (a client chooses it). Two sources that name one resource
//! (an account from the path on one route, from a JSON field on another) have different
//! scopes: give their layers one namespace. A namespace also keeps apart what the default
//! would join (two `key` sources whose values could coincide).
//!
//! The value never appears in the key: the key holds its *digest*, the first 128 bits of its
//! SHA-256 in hex, so that a key name read from Redis (`SCAN`, `MONITOR`, a backup) shows
//! nothing a client sent in clear, nor an idempotency principal (an API key). The digest is
//! unkeyed, so it hides secrets, not values that can be guessed: whoever reads key names can
//! hash candidates (account `1`, a known SKU) and find theirs (see `docs/SECURITY.md`). The
//! scope is the server's and stays readable. The encoding is length-prefixed, so no value, whatever its
//! bytes, can produce a key that belongs to another scope or falls outside the prefix. It
//! starts with a Redis Cluster hash tag:
//!
//! ```text
//! <prefix>{<tag>}<scope length>:<scope>:<digest>
//! tower-lock:{42894}12:/items/{sku}:a07836af8f060bc5aaf0c07eaada638f   (sku-123)
//! ```
//!
//! `<tag>` is a number chosen so that the key's hash slot is the CRC16 of the whole scoped name,
//! `<scope length>:<scope>:<digest>`, modulo 16384: the keys of one route spread over every slot
//! (and every master of a cluster), whatever braces the scope or value holds, and companion keys
//! the store derives from the key share its slot: the hand-off queue and the idempotency record
//! (`<prefix>{<tag>}queue:…` and `<prefix>{<tag>}record:…`, a role where a lock key has the
//! scope's length, so no value can spell one) and the fencing counter (`<prefix>fence:{<tag>}`,
//! or `<prefix>fence`). The prefix may not contain `{` or `}`.
//!
//! # Limits
//!
//! A value may hold any bytes, including invalid UTF-8 and control characters (its digest is
//! what the store sees); [`LockKey::value`] gives it back in this process. An empty value is rejected with 400, and so is a value longer than
//! [`LockConfig::max_key_len`](crate::LockConfig::max_key_len) bytes (default 512).

mod body;
pub(crate) mod build;
mod header;
mod into;
mod json;
mod path;
#[cfg(feature = "axum")]
mod path_param;
mod set;
mod share;
mod values;

use std::{fmt, ops::Range, sync::Arc};

use http::request::Parts;

use crate::{
    concat::{Concat, decimal},
    slot,
};

pub use body::{BodyKeySource, BodyKeys};
#[cfg(any(test, doc))]
pub(crate) use build::Key;
pub use header::HeaderKey;
pub use into::IntoKeys;
pub(crate) use into::sealed::{Scope, Source};
pub use json::JsonKeys;
pub use path::PathKey;
#[cfg(feature = "axum")]
pub use path_param::{PathParamKey, PathParamsKey};
pub use set::KeySet;
pub use share::Share;
pub use values::KeyValues;

/// Derives the values of a request's lock keys from its head: one (a SKU, an idempotency key)
/// or several (both accounts of a transfer, taken as one lease).
///
/// Implemented for the built-ins (see [`Key`]) and for any closure
/// `Fn(&Parts) -> Result<Option<V>, KeyRejection>` whose `V` converts into [`KeyValues`]
/// (`Bytes`, `String`, `&'static str`, `KeyValues`, `Vec<Bytes>`, `[Bytes; N]`);
/// [`Key::from_fn`] writes such a closure without type annotations.
///
/// ```
/// use bytes::Bytes;
/// use http::request::Parts;
/// use tower_lock::key::{KeyRejection, KeySource, KeyValues};
///
/// /// Locks on the tenant id that an earlier layer put into the extensions.
/// struct TenantKey;
///
/// #[derive(Clone)]
/// struct TenantId(u64);
///
/// impl KeySource for TenantKey {
///     fn keys(&self, parts: &Parts) -> Result<Option<KeyValues>, KeyRejection> {
///         match parts.extensions.get::<TenantId>() {
///             Some(TenantId(id)) => Ok(Some(id.to_string().into())),
///             None => Err(KeyRejection::missing("tenant id")),
///         }
///     }
/// }
///
/// /// `X-Accounts: 17, 42`: lock every account named, as one lease.
/// struct Accounts;
///
/// impl KeySource for Accounts {
///     fn keys(&self, parts: &Parts) -> Result<Option<KeyValues>, KeyRejection> {
///         let header = parts
///             .headers
///             .get("x-accounts")
///             .ok_or_else(|| KeyRejection::missing("`x-accounts` header"))?;
///         let list = header
///             .to_str()
///             .map_err(|_| KeyRejection::invalid("`x-accounts` is not text"))?;
///         Ok(Some(list.split(',').map(|a| Bytes::copy_from_slice(a.trim().as_bytes())).collect()))
///     }
/// }
/// ```
///
/// A source that reads the request body is a [`BodyKeySource`] instead.
pub trait KeySource: Send + Sync + 'static {
    /// The values to lock on, `None` to pass the request through unlocked, or a rejection.
    ///
    /// The layer takes every value's key as one lease; a value given twice is one key, and no
    /// value at all is a 400.
    fn keys(&self, parts: &Parts) -> Result<Option<KeyValues>, KeyRejection>;
}

impl<F, V> KeySource for F
where
    F: Fn(&Parts) -> Result<Option<V>, KeyRejection> + Send + Sync + 'static,
    V: Into<KeyValues>,
{
    fn keys(&self, parts: &Parts) -> Result<Option<KeyValues>, KeyRejection> {
        Ok(self(parts)?.map(Into::into))
    }
}

/// Why a request's lock key could not be derived.
///
/// Most rejections are the client's fault and answer 400; a [`misconfigured`](Self::misconfigured)
/// source answers 500, since no request can fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRejection {
    detail: Arc<str>,
    kind: RejectionKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RejectionKind {
    /// The client's fault: 400.
    Invalid,
    /// The request body is larger than the layer reads: 413.
    TooLarge,
    /// The route's: 500.
    Misconfigured,
}

impl KeyRejection {
    /// A required part of the request (a header, an extension) is missing.
    pub fn missing(what: impl fmt::Display) -> Self {
        Self::invalid(format!(
            "the request has no {what}, which this route needs as its lock key"
        ))
    }

    /// The request carries a key, but it is unusable; `detail` says why.
    pub fn invalid(detail: impl Into<Arc<str>>) -> Self {
        Self {
            detail: detail.into(),
            kind: RejectionKind::Invalid,
        }
    }

    /// The request body, where the keys are, is larger than the layer reads (413).
    pub fn body_too_large(limit: usize) -> Self {
        Self {
            detail: format!(
                "the request body is larger than the {limit} bytes this route reads for its lock keys"
            )
            .into(),
            kind: RejectionKind::TooLarge,
        }
    }

    /// The key source cannot work on this route at all (a server-side mistake: 500).
    pub fn misconfigured(detail: impl Into<Arc<str>>) -> Self {
        Self {
            detail: detail.into(),
            kind: RejectionKind::Misconfigured,
        }
    }

    /// What is wrong, in a sentence fit for the response body.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// `true` when the client can fix it (400, or 413 for a body too large), `false` when the
    /// route is misconfigured (500).
    pub fn is_client_error(&self) -> bool {
        self.kind != RejectionKind::Misconfigured
    }

    /// `true` when the request body was larger than the layer reads (413).
    pub fn is_body_too_large(&self) -> bool {
        self.kind == RejectionKind::TooLarge
    }

    /// 400 (the client's key), 413 (a body too large to read the keys from) or 500 (a
    /// misconfigured source).
    pub fn status(&self) -> http::StatusCode {
        match self.kind {
            RejectionKind::Invalid => http::StatusCode::BAD_REQUEST,
            RejectionKind::TooLarge => http::StatusCode::PAYLOAD_TOO_LARGE,
            RejectionKind::Misconfigured => http::StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The `application/problem+json` response the layer answers this rejection with (types
    /// `#invalid-lock-key`, `#request-body-too-large` or `#lock-key-misconfigured`).
    pub fn problem(&self) -> http::Response<bytes::Bytes> {
        crate::response::lock_problem(&crate::LockError::Key(self.clone()), self.status())
    }
}

impl fmt::Display for KeyRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

impl std::error::Error for KeyRejection {}

/// The full key of one lock, as sent to the store.
///
/// Cheap to clone. See the [module docs](self#scoping) for its layout.
///
/// Two keys are equal when they name the same lock (the same bytes).
#[derive(Clone)]
pub struct LockKey {
    /// The key's name (what the store writes), then the value it was derived from.
    full: Arc<[u8]>,
    /// Where the name ends in `full`.
    name: usize,
    /// The hash tag, braces included, right after the prefix.
    tag: Range<usize>,
    scope: Range<usize>,
    value: Range<usize>,
    /// The Redis Cluster hash slot the tag names.
    slot: u16,
    /// How much of the key's capacity the lease takes; `None`: the plain exclusive lease.
    /// Not part of the key's identity (equality and hash are the bytes').
    share: Option<Share>,
}

impl PartialEq for LockKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for LockKey {}

impl std::hash::Hash for LockKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

/// The length of a value's digest in a key name: 128 bits of SHA-256, in hex.
const DIGEST_LEN: usize = 32;

/// The digest that stands for `value` in a key name: the first 128 bits of its SHA-256, in
/// lowercase hex. One-way and collision-resistant (finding two values that share a lock costs
/// about 2^64 hashes), so a name shows nothing a client sent, and no client can make its key
/// land on another's.
fn digest(value: &[u8]) -> [u8; DIGEST_LEN] {
    use sha2::Digest as _;
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let hash = sha2::Sha256::digest(value);
    let mut out = [0u8; DIGEST_LEN];
    for (pair, byte) in out.chunks_exact_mut(2).zip(&hash[..DIGEST_LEN / 2]) {
        pair[0] = HEX[usize::from(byte >> 4)];
        pair[1] = HEX[usize::from(byte & 0xf)];
    }
    out
}

impl LockKey {
    pub_with_test_util! {
        /// Builds a key from its prefix, scope and value, checking the value's length.
        ///
        /// The layer and [`Locker::key`](crate::Locker::key) build keys; a test of a store that
        /// needs one by hand has this (feature `test-util`).
        /// A prefix that contains `{` or `}` is refused as
        /// [misconfigured](KeyRejection::misconfigured): the key's hash tag must be the first.
        fn new(
            prefix: &str,
            scope: &str,
            value: &[u8],
            max_len: usize,
        ) -> Result<Self, KeyRejection> {
            if prefix.contains(['{', '}']) {
                return Err(KeyRejection::misconfigured(
                    "the key prefix must not contain `{` or `}` (the key's hash tag starts after it)",
                ));
            }
            Self::from_parts(prefix, &[scope], value, max_len)
        }
    }

    /// [`new`](Self::new) with the scope given in pieces (joined), for a scope the layer puts
    /// together per request, without an intermediate string. The prefix is the config's,
    /// checked for braces when the config was validated.
    pub(crate) fn from_parts(
        prefix: &str,
        scope: &[&str],
        value: &[u8],
        max_len: usize,
    ) -> Result<Self, KeyRejection> {
        if value.is_empty() {
            return Err(KeyRejection::invalid("the lock key is empty"));
        }
        if value.len() > max_len {
            return Err(KeyRejection::invalid(format!(
                "the lock key is {} bytes long; the limit is {max_len}",
                value.len()
            )));
        }
        Ok(Self::build(prefix, scope, value))
    }

    fn build(prefix: &str, scope: &[&str], value: &[u8]) -> Self {
        debug_assert!(!prefix.contains(['{', '}']), "a key prefix with braces");
        let scope_len: usize = scope.iter().map(|s| s.len()).sum();
        let mut digits = [0u8; 20];
        let digits = decimal(scope_len as u64, &mut digits);
        let digest = digest(value);
        // The slot of the whole scoped name, `<scope length>:<scope>:<digest>`, and a tag that
        // hashes to it.
        let crc = scope
            .iter()
            .fold(
                slot::Crc16::default().update(digits).update(b":"),
                |crc, piece| crc.update(piece.as_bytes()),
            )
            .update(b":")
            .update(&digest);
        let slot = crc.slot();
        let mut tag = [0u8; 20];
        let tag = decimal(u64::from(slot::tag(slot)), &mut tag);
        // `prefix{<tag>}<scope length>:<scope>:<digest>`, then the value itself (kept for the
        // process, never sent), put together on the stack when it fits (most keys), then copied
        // once into the key's one allocation.
        let name_len = prefix.len() + tag.len() + 2 + digits.len() + 1 + scope_len + 1 + DIGEST_LEN;
        let mut buf = Concat::<256>::with_capacity(name_len + value.len());
        let tag_start = buf.push(prefix.as_bytes());
        buf.push(b"{");
        buf.push(tag);
        let tag_end = buf.push(b"}");
        buf.push(digits);
        let scope_start = buf.push(b":");
        let mut scope_end = scope_start;
        for piece in scope {
            scope_end = buf.push(piece.as_bytes());
        }
        buf.push(b":");
        let name_end = buf.push(&digest);
        debug_assert_eq!(name_end, name_len);
        let value_end = buf.push(value);
        Self {
            full: Arc::from(buf.as_bytes()),
            name: name_len,
            tag: tag_start..tag_end,
            scope: scope_start..scope_end,
            value: name_end..value_end,
            slot,
            share: None,
        }
    }

    /// The whole key, as the store writes it: `<prefix>{<tag>}<scope length>:<scope>:<digest>`
    /// (see the [module docs](self#scoping)). It holds no byte of the value.
    pub fn as_bytes(&self) -> &[u8] {
        &self.full[..self.name]
    }

    /// The prefix the key was built with (the bytes before its hash tag).
    pub(crate) fn prefix(&self) -> &[u8] {
        &self.full[..self.tag.start]
    }

    /// The key's hash tag, braces included (`{<tag>}`): a key that contains it, and no brace
    /// before it, lives in the same Redis Cluster hash slot.
    pub(crate) fn hash_tag(&self) -> &[u8] {
        &self.full[self.tag.clone()]
    }

    /// The key's Redis Cluster hash slot.
    pub(crate) fn slot(&self) -> u16 {
        self.slot
    }

    /// The scope: the namespace, or the source's default (see the [module docs](self#scoping)).
    pub fn scope(&self) -> &str {
        // The scope was copied in from a `&str`, so this cannot fail.
        std::str::from_utf8(&self.full[self.scope.clone()]).unwrap_or_default()
    }

    /// The value the key source derived (a SKU, an idempotency key, ...). Kept in this process
    /// only: the store sees its digest (see [`as_bytes`](Self::as_bytes)).
    pub fn value(&self) -> &[u8] {
        &self.full[self.value.clone()]
    }

    /// This key taken with `share` of its capacity (a permit, a reader, a writer): see
    /// [`Share`].
    pub fn with_share(mut self, share: Share) -> Self {
        self.share = Some(share);
        self
    }

    /// How much of the key's capacity the lease takes; `None` for the plain exclusive lease.
    /// A store that counts holders ([`Capabilities::counts`](crate::store::Capabilities::counts))
    /// admits a lease only while the weights of the key's live holders, its own included, sum
    /// to at most the capacity.
    pub fn share(&self) -> Option<Share> {
        self.share
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The name, never the value: a key in a logged error shows what a store shows.
        f.debug_struct("LockKey")
            .field("scope", &self.scope())
            .field(
                "digest",
                &String::from_utf8_lossy(&self.as_bytes()[self.name - DIGEST_LEN..]),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn parts(req: http::Request<()>) -> Parts {
        req.into_parts().0
    }

    /// `<prefix>{<tag>}<scope length>:<scope>:<digest of value>`, its parts, and its slot: that
    /// of the whole scoped name.
    fn assert_layout(key: &LockKey, prefix: &str, scope: &str, value: &[u8]) {
        let scoped = [
            format!("{}:{scope}:", scope.len()).as_bytes(),
            &digest(value)[..],
        ]
        .concat();
        // The slot of all of `scoped`'s bytes, braces or not.
        let whole = slot::Crc16::default().update(&scoped).slot();
        let tag = format!("{{{}}}", slot::tag(whole));
        assert_eq!(
            key.as_bytes(),
            [prefix.as_bytes(), tag.as_bytes(), &scoped].concat(),
            "{key:?}"
        );
        assert_eq!(key.prefix(), prefix.as_bytes());
        assert_eq!(key.hash_tag(), tag.as_bytes());
        assert_eq!(key.slot(), whole);
        assert_eq!(
            slot::of(key.as_bytes()),
            whole,
            "Redis's rule gives another slot"
        );
        assert_eq!((key.scope(), key.value()), (scope, value));
    }

    #[test]
    fn key_layout_is_length_prefixed() {
        let key = LockKey::new("p:", "POST /a", b"v:1}", 64).unwrap();
        assert_layout(&key, "p:", "POST /a", b"v:1}");

        // Longer than the stack buffer the key is put together in; an empty and a two-digit
        // scope length; braces in the scope and value.
        let value = vec![b'v'; 300];
        let key = LockKey::from_parts("p:", &["POST ", "/items/{sku}"], &value, 512).unwrap();
        assert_layout(&key, "p:", "POST /items/{sku}", &value);
        let key = LockKey::new("", "", b"{v}", 64).unwrap();
        assert_layout(&key, "", "", b"{v}");
    }

    #[test]
    fn the_layout_does_not_change() {
        // Instances that share locks must build the same keys: these bytes are the layout. The
        // value is its digest: SHA-256("sku-123") begins a07836af..., and no byte of it shows.
        let key = LockKey::new("tower-lock:", "POST /items/{sku}/purchase", b"sku-123", 64);
        assert_eq!(
            String::from_utf8_lossy(key.unwrap().as_bytes()),
            "tower-lock:{9044}26:POST /items/{sku}/purchase:a07836af8f060bc5aaf0c07eaada638f"
        );
        // The default scope of `Key::path_param("sku")` on that route (the module docs' example).
        let key = LockKey::new("tower-lock:", "/items/{sku}", b"sku-123", 64);
        assert_eq!(
            String::from_utf8_lossy(key.unwrap().as_bytes()),
            "tower-lock:{42894}12:/items/{sku}:a07836af8f060bc5aaf0c07eaada638f"
        );
    }

    #[test]
    fn names_show_no_byte_of_the_value() {
        // A secret as the value: neither the name nor the key's Debug shows it.
        let secret = b"sk_live_4eC39HqLyjWDarjtT1zdp7dc";
        let key = LockKey::new("tower-lock:", "POST /payments", secret, 64).unwrap();
        let name = String::from_utf8_lossy(key.as_bytes()).into_owned();
        let debug = format!("{key:?}");
        for shown in [&name, &debug] {
            assert!(!shown.contains("sk_live"), "{shown}");
            assert!(!shown.contains("4eC39"), "{shown}");
        }
        assert_eq!(key.value(), secret, "the process keeps the value");
        // Values that differ in one byte share nothing but their scope.
        let other = LockKey::new(
            "tower-lock:",
            "POST /payments",
            b"sk_live_4eC39HqLyjWDarjtT1zdp7dd",
            64,
        );
        assert_ne!(key, other.unwrap());
    }

    #[test]
    fn keys_of_one_route_spread_over_the_slots() {
        // The route template's braces must not end the hash tag early (which put every key of
        // a route in one slot): 1,000 SKUs on one route reach about 970 slots.
        let slots: std::collections::HashSet<u16> = (0..1000)
            .map(|i| {
                let sku = format!("sku-{i}");
                let key = LockKey::new(
                    "tower-lock:",
                    "POST /items/{sku}/purchase",
                    sku.as_bytes(),
                    64,
                )
                .unwrap();
                slot::of(key.as_bytes())
            })
            .collect();
        assert!(slots.len() > 900, "{} slots", slots.len());
    }

    #[test]
    fn a_prefix_with_braces_is_refused() {
        for prefix in ["a{", "}", "x{y}:"] {
            let err = LockKey::new(prefix, "s", b"v", 64).unwrap_err();
            assert!(!err.is_client_error(), "{err}");
            assert!(err.detail().contains("prefix"), "{err}");
        }
    }

    #[test]
    fn values_cannot_forge_another_scope() {
        // Scope "a" with value "b:c" must differ from scope "a:b" with value "c".
        let one = LockKey::new("p:", "a", b"b:c", 64).unwrap();
        let two = LockKey::new("p:", "a:b", b"c", 64).unwrap();
        assert_ne!(one.as_bytes(), two.as_bytes());
    }

    #[test]
    fn empty_and_long_values_are_rejected() {
        assert!(
            LockKey::new("p:", "s", b"", 8)
                .unwrap_err()
                .is_client_error()
        );
        let err = LockKey::new("p:", "s", b"123456789", 8).unwrap_err();
        assert!(err.detail().contains("limit is 8"), "{err}");
        assert!(LockKey::new("p:", "s", b"12345678", 8).is_ok());
    }

    #[test]
    fn any_bytes_are_a_value() {
        let key = LockKey::new("p:", "s", &[0, 0xff, b'\n', b'{'], 8).unwrap();
        assert_eq!(key.value(), &[0, 0xff, b'\n', b'{']);
        assert!(format!("{key:?}").contains("LockKey"));
    }

    #[test]
    fn path_and_closure_sources() {
        let mut p = parts(http::Request::get("/a/b?q=1").body(()).unwrap());
        assert_eq!(Key::path().keys(&p).unwrap().unwrap().as_slice(), ["/a/b"]);
        let source = Key::from_fn(|parts| {
            if parts.uri.query().is_some() {
                Ok(None::<Bytes>)
            } else {
                Err(KeyRejection::invalid("no query"))
            }
        });
        assert_eq!(source.keys(&p).unwrap(), None);
        p = parts(http::Request::get("/a").body(()).unwrap());
        assert_eq!(source.keys(&p).unwrap_err().detail(), "no query");
        // One value or several, each answer type without annotations.
        let one = Key::from_fn(|parts| Ok(Some(parts.uri.path().to_owned())));
        assert_eq!(one.keys(&p).unwrap().unwrap().as_slice(), ["/a"]);
        let two = Key::from_fn(|_| Ok(Some([Bytes::from("x"), Bytes::from("y")])));
        assert_eq!(two.keys(&p).unwrap().unwrap().as_slice(), ["x", "y"]);
    }
}

//! What a [`LockLayer`](crate::LockLayer) can be built with: [`IntoKeys`].

use std::sync::Arc;

use super::{BodyKeySource, BodyKeys, JsonKeys, KeySource};

/// What a [`LockLayer`](crate::LockLayer) can be built with: every [`KeySource`], which reads
/// the request head, and the sources that read the body too, [`JsonKeys`]
/// ([`Key::json`](super::Key::json)) and [`BodyKeys`] ([`Key::body`](super::Key::body)).
///
/// A head source leaves the body alone; a body source has the layer buffer the body, up to
/// [`max_request_body`](crate::LockLayer::max_request_body), and hand the handler the same
/// bytes. The source also gives the layer's default scope (see the [module docs](super#scoping)).
/// Sealed.
pub trait IntoKeys: sealed::Sealed {}

#[allow(unreachable_pub)]
pub(crate) mod sealed {
    use bytes::Bytes;
    use http::request::Parts;

    use super::*;
    use crate::key::{KeyRejection, KeyValues};

    /// Keeps [`IntoKeys`](super::IntoKeys) to the crate's kinds of key sources, and turns one
    /// into what the layer holds.
    pub trait Sealed: Sized {
        /// The source, as the layer holds it.
        fn into_source(self) -> Source;

        /// What the source's keys are scoped by when the layer has no namespace: the kind of
        /// resource they name.
        fn default_scope(&self) -> Scope;
    }

    /// What a layer's keys are scoped by without a namespace: the kind of resource the source
    /// names, so that two routes (or methods) that lock the same resource share its locks.
    #[derive(Clone, Debug)]
    pub enum Scope {
        /// The matched route up to the segment of the last of these path parameters:
        /// `/accounts/{id}` for `POST /accounts/{id}/withdraw` as for `DELETE /accounts/{id}`.
        /// Outside a route that has them, the last parameter's name in braces (`{id}`).
        Route(Arc<[Arc<str>]>),
        /// The whole matched route template (`/items/{sku}/purchase`), for a value that is the
        /// whole path: the path's own route, as the router resolved it; `path` outside a route.
        Template,
        /// A name of its own: `header x-sku`, `json /from /to`, or a namespace.
        Named(Arc<str>),
    }

    /// A source that reads axum's path parameters, which axum's extractor reads only from a
    /// `&mut Parts`: the layer calls it with the request's own head.
    #[cfg(feature = "axum")]
    pub trait Routed: Send + Sync + 'static {
        /// [`KeySource::keys`], reading the parameters in place.
        fn keys_routed(&self, parts: &mut Parts) -> Result<Option<KeyValues>, KeyRejection>;
    }

    /// A layer's key source.
    #[derive(Clone)]
    pub enum Source {
        /// Reads the head.
        Head(Arc<dyn KeySource>),
        /// A built-in that reads the path parameters, in place.
        #[cfg(feature = "axum")]
        Routed(Arc<dyn Routed>),
        /// Reads the head and the body.
        Body(Arc<dyn BodyKeySource>),
    }

    impl Source {
        /// The request's key values from its head alone; a body source is refused (the
        /// layer's type never pairs one with a head-only service).
        pub fn head_keys(&self, parts: &mut Parts) -> Result<Option<KeyValues>, KeyRejection> {
            match self {
                Self::Head(source) => source.keys(parts),
                #[cfg(feature = "axum")]
                Self::Routed(source) => source.keys_routed(parts),
                Self::Body(_) => Err(KeyRejection::misconfigured(
                    "the key source reads the body, but the layer was built for the head",
                )),
            }
        }

        /// The request's key values from its head and `body`, at most `max` distinct ones
        /// (see [`BodyKeySource::keys_at_most`]).
        pub fn body_keys(
            &self,
            parts: &mut Parts,
            body: &Bytes,
            max: usize,
        ) -> Result<Option<KeyValues>, KeyRejection> {
            match self {
                Self::Body(source) => source.keys_at_most(parts, body, max),
                _ => self.head_keys(parts),
            }
        }
    }

    impl std::fmt::Debug for Source {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(match self {
                Self::Head(_) => "Source::Head",
                #[cfg(feature = "axum")]
                Self::Routed(_) => "Source::Routed",
                Self::Body(_) => "Source::Body",
            })
        }
    }
}

impl<K: KeySource> sealed::Sealed for K {
    fn into_source(self) -> sealed::Source {
        // The built-ins that read axum's path parameters read them in place, with the
        // request's `&mut Parts`, rather than from a copy of its extensions as their
        // `KeySource::keys` must.
        #[cfg(feature = "axum")]
        let this = match routed(self) {
            Ok(routed) => return sealed::Source::Routed(routed),
            Err(this) => this,
        };
        #[cfg(not(feature = "axum"))]
        let this = self;
        sealed::Source::Head(Arc::new(this))
    }

    fn default_scope(&self) -> sealed::Scope {
        let any: &dyn std::any::Any = self;
        #[cfg(feature = "axum")]
        {
            use super::{PathParamKey, PathParamsKey};
            if let Some(param) = any.downcast_ref::<PathParamKey>() {
                return sealed::Scope::Route(Arc::from([param.name()]));
            }
            if let Some(params) = any.downcast_ref::<PathParamsKey>() {
                return sealed::Scope::Route(params.names().collect());
            }
        }
        if any.is::<super::PathKey>() {
            return sealed::Scope::Template;
        }
        let name = if let Some(header) = any.downcast_ref::<super::HeaderKey>() {
            format!("header {}", header.name())
        } else {
            // A source of the application's: its values are its own to tell apart.
            "key".to_owned()
        };
        sealed::Scope::Named(name.into())
    }
}

/// `source` as a [`Routed`](sealed::Routed) source when it is one of the built-ins that read
/// the path parameters; else `source` back.
#[cfg(feature = "axum")]
fn routed<K: KeySource>(source: K) -> Result<Arc<dyn sealed::Routed>, K> {
    use super::{PathKey, PathParamKey, PathParamsKey};
    as_routed::<PathParamKey, K>(source)
        .or_else(as_routed::<PathParamsKey, K>)
        .or_else(as_routed::<PathKey, K>)
}

/// `source` as a [`Routed`](sealed::Routed) source when it is a `T`; else `source` back.
#[cfg(feature = "axum")]
fn as_routed<T: sealed::Routed, K: 'static>(source: K) -> Result<Arc<dyn sealed::Routed>, K> {
    let mut slot = Some(source);
    let any: &mut dyn std::any::Any = &mut slot;
    match any.downcast_mut::<Option<T>>().and_then(Option::take) {
        Some(found) => Ok(Arc::new(found)),
        None => Err(slot
            .take()
            .expect("a source that is not a `T` stays in its slot")),
    }
}

impl<K: KeySource> IntoKeys for K {}

impl sealed::Sealed for JsonKeys {
    fn into_source(self) -> sealed::Source {
        sealed::Source::Body(Arc::new(self))
    }

    fn default_scope(&self) -> sealed::Scope {
        sealed::Scope::Named(format!("json {}", self.pointer_list()).into())
    }
}

impl IntoKeys for JsonKeys {}

impl<S: BodyKeySource> sealed::Sealed for BodyKeys<S> {
    fn into_source(self) -> sealed::Source {
        sealed::Source::Body(Arc::new(self))
    }

    fn default_scope(&self) -> sealed::Scope {
        sealed::Scope::Named("key".into())
    }
}

impl<S: BodyKeySource> IntoKeys for BodyKeys<S> {}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::{super::Key, sealed::Sealed};

    #[test]
    fn each_source_is_held_as_what_it_reads() {
        let held = |source: super::sealed::Source| format!("{source:?}");
        let closure = Key::from_fn(|parts| Ok(Some(Bytes::from(parts.uri.path().to_owned()))));
        assert_eq!(held(closure.into_source()), "Source::Head");
        assert_eq!(
            held(Key::header("x").unwrap().into_source()),
            "Source::Head"
        );
        assert_eq!(held(Key::json("/a").unwrap().into_source()), "Source::Body");
        let body = Key::body(|_, body| Ok(Some(body.clone())));
        assert_eq!(held(body.into_source()), "Source::Body");
        // The path-parameter built-ins read the parameters in place, without a copy.
        #[cfg(feature = "axum")]
        {
            assert_eq!(held(Key::path_param("a").into_source()), "Source::Routed");
            assert_eq!(
                held(Key::path_params(["a"]).into_source()),
                "Source::Routed"
            );
            assert_eq!(held(Key::path().into_source()), "Source::Routed");
        }
    }
}

//! What a [`LockLayer`](crate::LockLayer) can be built with: [`IntoKeys`], and where its keys
//! come from, [`FromHead`] or [`FromBody`].

use std::sync::Arc;

use super::{BodyKeySource, BodyKeys, JsonKeys, KeySetSource};

/// A layer whose key source reads the request head alone: any [`KeySource`](super::KeySource)
/// or [`KeySetSource`]. The layer leaves the body alone and works with any body type.
#[derive(Debug, Clone, Copy)]
pub enum FromHead {}

/// A layer whose key source reads the request body too ([`Key::json`](super::Key::json),
/// [`Key::body`](super::Key::body)): it buffers the body, up to its
/// [`max_request_body`](crate::LockLayer::max_request_body), and hands the handler the same
/// bytes, so its body type must be built from [`Bytes`](bytes::Bytes) (`axum::body::Body` is).
#[derive(Debug, Clone, Copy)]
pub enum FromBody {}

/// What a [`LockLayer`](crate::LockLayer) can be built with: every [`KeySetSource`] (and so
/// every [`KeySource`](super::KeySource)), which reads the request head, and the sources that
/// read the body, [`Key::json`](super::Key::json) and [`Key::body`](super::Key::body).
///
/// [`From`](Self::From) says which, and so which layer it builds: `LockLayer<FromHead>` (the
/// plain `LockLayer`) or `LockLayer<FromBody>`. Sealed.
pub trait IntoKeys: sealed::Sealed {
    /// Where the keys come from: [`FromHead`] or [`FromBody`].
    type From;
}

#[allow(unreachable_pub)]
pub(crate) mod sealed {
    use super::*;

    /// Keeps [`IntoKeys`](super::IntoKeys) to the crate's kinds of key sources, and turns one
    /// into what the layer holds.
    pub trait Sealed: Sized {
        /// The source, as the layer holds it.
        fn into_source(self) -> Source;
    }

    /// A layer's key source.
    #[derive(Clone)]
    pub enum Source {
        Head(Arc<dyn KeySetSource>),
        Body(Arc<dyn BodyKeySource>),
    }

    impl std::fmt::Debug for Source {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(match self {
                Self::Head(_) => "Source::Head",
                Self::Body(_) => "Source::Body",
            })
        }
    }
}

impl<T: KeySetSource> sealed::Sealed for T {
    fn into_source(self) -> sealed::Source {
        sealed::Source::Head(Arc::new(self))
    }
}

impl<T: KeySetSource> IntoKeys for T {
    type From = FromHead;
}

impl sealed::Sealed for JsonKeys {
    fn into_source(self) -> sealed::Source {
        sealed::Source::Body(Arc::new(self))
    }
}

impl IntoKeys for JsonKeys {
    type From = FromBody;
}

impl<S: BodyKeySource> sealed::Sealed for BodyKeys<S> {
    fn into_source(self) -> sealed::Source {
        sealed::Source::Body(Arc::new(self))
    }
}

impl<S: BodyKeySource> IntoKeys for BodyKeys<S> {
    type From = FromBody;
}

//! [`TlsConfig`]: which certificate authorities the stores trust for a Redis server's TLS
//! certificate, and the client certificate they present (the `tls` feature).
//!
//! TLS itself is chosen by the URL: `rediss://` connects over TLS, `redis://` does not. With
//! the feature on and no [`TlsConfig`], a `rediss://` URL trusts the operating system's CA
//! store; a `TlsConfig` replaces it with a private CA bundle, and adds a client certificate
//! for servers that ask for one (`tls-auth-clients yes`: mutual TLS).
//!
//! rustls does the TLS, with the *ring* crypto provider, which the crate installs as the
//! process's default before its first TLS connection unless the application installed one
//! already (so an application that wants aws-lc-rs, for FIPS say, installs it first and keeps
//! it). Certificates are always verified: there is no setting that turns that off.

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::Arc,
};

use redis::{
    Client, ClientTlsConfig, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, TlsCertificates,
};
use rustls::{
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    sign::CertifiedKey,
};

use super::{
    StoreError, StoreErrorKind,
    redis::{redis_error, refuse_insecure},
};

/// TLS settings for the connections to Redis: a private CA bundle, and a client certificate
/// and key for mutual TLS (the `tls` feature).
///
/// Give it to a store's `connect_with_tls` ([`RedisStore`](crate::RedisStore::connect_with_tls),
/// [`RedlockStore`](crate::store::RedlockStore::connect_with_tls), `ClusterStore::connect_with_tls`,
/// `SentinelStore::connect_with_tls`), or turn a URL into a [`ConnectionInfo`] with
/// [`connection_info`](Self::connection_info) for a connection, manager or pool of your own.
/// The URLs say `rediss://`; a `TlsConfig` that names any certificate refuses a `redis://`
/// URL (a [`Config`](StoreErrorKind::Config) error), which would send the password and the
/// locks in clear.
///
/// Files are read when a store connects, so a missing or unreadable file, a file without a
/// PEM certificate, or a key that is not the certificate's, is a
/// [`Tls`](StoreErrorKind::Tls) error at start-up that names the file. Neither `Debug` nor
/// any error shows a key or a certificate's contents.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_lock::{RedisStore, store::TlsConfig};
///
/// let tls = TlsConfig::new()
///     .ca_cert_file("/etc/redis/tls/ca.pem")
///     .client_cert_files("/etc/redis/tls/client.pem", "/etc/redis/tls/client.key");
/// let store = RedisStore::connect_with_tls("rediss://locker:secret@redis.internal:6380/", &tls).await?;
/// # let _ = store; Ok(()) }
/// ```
///
/// # In a configuration file
///
/// With the `serde` feature it deserializes from a table whose keys are all optional: a CA
/// bundle (`ca_cert`, a file, or `ca_cert_pem`, the PEM itself), and a client certificate and
/// its key (`client_cert` and `client_key`, files, or `client_cert_pem` and `client_key_pem`).
/// Unknown keys, a value given both ways, or a certificate without its key are errors.
///
/// ```toml
/// [redis.tls]
/// ca_cert = "/etc/redis/tls/ca.pem"
/// client_cert = "/etc/redis/tls/client.pem"
/// client_key = "/etc/redis/tls/client.key"
/// ```
///
/// # The crypto provider
///
/// rustls does the TLS, with the *ring* crypto provider, which the crate installs as the
/// process's default before its first TLS connection unless the application installed one
/// already: an application that wants aws-lc-rs (for FIPS, say) installs it first and keeps
/// it. Either way rustls never has to guess, which it cannot when a build enables both of its
/// providers ("Could not automatically determine the process-level CryptoProvider").
/// Certificates are always verified: no setting turns that off (a `rediss://...#insecure`
/// URL is refused).
#[derive(Clone, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Deserialize),
    serde(try_from = "TlsConfigRepr")
)]
pub struct TlsConfig {
    ca_cert: Option<Pem>,
    client: Option<(Pem, Pem)>,
}

/// A PEM document, given inline or as a file to read.
#[derive(Clone)]
enum Pem {
    Inline(Arc<[u8]>),
    File(PathBuf),
}

impl Pem {
    fn read(&self, what: &str) -> Result<Arc<[u8]>, StoreError> {
        match self {
            Self::Inline(pem) => Ok(Arc::clone(pem)),
            Self::File(path) => std::fs::read(path).map(Arc::from).map_err(|e| {
                StoreError::new(
                    StoreErrorKind::Tls,
                    format!("cannot read the {what} {}", path.display()),
                    e,
                )
            }),
        }
    }

    /// Where the document comes from, for messages: the file, or "(inline PEM)".
    fn origin(&self) -> String {
        match self {
            Self::Inline(_) => "(inline PEM)".to_owned(),
            Self::File(path) => path.display().to_string(),
        }
    }
}

impl TlsConfig {
    /// No CA bundle (the operating system's CA store is trusted) and no client certificate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts the certificate authorities in `pem` (one or more PEM certificates), and only
    /// them, for the servers' certificates.
    #[must_use]
    pub fn ca_cert_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_cert = Some(Pem::Inline(Arc::from(pem.into())));
        self
    }

    /// Trusts the certificate authorities in the PEM file at `path`, and only them, for the
    /// servers' certificates. The file is read when a store connects.
    #[must_use]
    pub fn ca_cert_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_cert = Some(Pem::File(path.into()));
        self
    }

    /// Presents the client certificate `cert` (PEM: the certificate, then any intermediates)
    /// with its private key `key` (PEM: PKCS#8, PKCS#1 or SEC1), for servers that
    /// authenticate their clients by certificate (`tls-auth-clients yes`).
    #[must_use]
    pub fn client_cert_pem(mut self, cert: impl Into<Vec<u8>>, key: impl Into<Vec<u8>>) -> Self {
        self.client = Some((
            Pem::Inline(Arc::from(cert.into())),
            Pem::Inline(Arc::from(key.into())),
        ));
        self
    }

    /// Like [`client_cert_pem`](Self::client_cert_pem), from the PEM files at `cert` and
    /// `key`, read when a store connects.
    #[must_use]
    pub fn client_cert_files(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client = Some((Pem::File(cert.into()), Pem::File(key.into())));
        self
    }

    /// Whether it names no certificate at all (the operating system's CA store, no client
    /// certificate): the same as no `TlsConfig`.
    pub fn is_empty(&self) -> bool {
        self.ca_cert.is_none() && self.client.is_none()
    }

    /// The certificates, read and checked, as the redis crate takes them (for a
    /// `ClusterClientBuilder::certs`, a `SentinelClientBuilder`, `Client::build_with_tls`).
    ///
    /// Also installs the crate's crypto provider as the process's default unless one is
    /// installed already (see [the crypto provider](TlsConfig#the-crypto-provider)), so that a
    /// client built with them does
    /// not panic in rustls.
    pub fn certificates(&self) -> Result<TlsCertificates, StoreError> {
        let provider = crypto_provider();
        let root_cert = match &self.ca_cert {
            None => None,
            Some(source) => {
                let pem = source.read("CA bundle")?;
                let certs = parse_certs(&pem, "CA bundle", source)?;
                let mut roots = rustls::RootCertStore::empty();
                for cert in certs {
                    roots.add(cert).map_err(|e| {
                        tls_error(
                            format!(
                                "the CA bundle {} has an unusable certificate",
                                source.origin()
                            ),
                            e,
                        )
                    })?;
                }
                Some(pem.to_vec())
            }
        };
        let client_tls = match &self.client {
            None => None,
            Some((cert_source, key_source)) => {
                let cert = cert_source.read("client certificate")?;
                let key = key_source.read("client key")?;
                let chain = parse_certs(&cert, "client certificate", cert_source)?;
                // The parser's error may quote a line of the file: it is left out.
                let der = PrivateKeyDer::from_pem_slice(&key).map_err(|_| {
                    StoreError::msg(
                        StoreErrorKind::Tls,
                        format!(
                            "the client key {} holds no PEM private key (PKCS#8, PKCS#1 or SEC1)",
                            key_source.origin()
                        ),
                    )
                })?;
                CertifiedKey::from_der(chain, der, &provider).map_err(|e| {
                    tls_error(
                        format!(
                            "the client key {} does not go with the client certificate {}",
                            key_source.origin(),
                            cert_source.origin()
                        ),
                        e,
                    )
                })?;
                Some(ClientTlsConfig {
                    client_cert: cert.to_vec(),
                    client_key: key.to_vec(),
                })
            }
        };
        Ok(TlsCertificates {
            client_tls,
            root_cert,
        })
    }

    /// `url` (`rediss://[user:password@]host:port/db`) with these settings, for a connection,
    /// `ConnectionManager` or bb8-redis pool of your own:
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// // The redis crate of the version tower-lock uses (1.x); a bb8-redis pool's
    /// // `RedisConnectionManager::new` takes the same value.
    /// use redis::{Client, aio::ConnectionManager};
    /// use tower_lock::{RedisStore, store::TlsConfig};
    ///
    /// let tls = TlsConfig::new().ca_cert_file("/etc/redis/tls/ca.pem");
    /// let client = Client::open(tls.connection_info("rediss://redis.internal:6380/")?)?;
    /// let store = RedisStore::from_connection_manager(ConnectionManager::new(client).await?);
    /// # let _ = store; Ok(()) }
    /// ```
    ///
    /// A `redis://` URL is returned as it is when this names no certificate, and refused
    /// otherwise (see the [type's docs](Self)). Installs the crypto provider, as
    /// [`certificates`](Self::certificates) does.
    pub fn connection_info<T: AsRef<str>>(&self, url: T) -> Result<ConnectionInfo, StoreError> {
        let info = url.as_ref().into_connection_info().map_err(redis_error)?;
        self.apply(info)
    }

    /// `info` with these settings; see [`connection_info`](Self::connection_info).
    pub(crate) fn apply(&self, info: ConnectionInfo) -> Result<ConnectionInfo, StoreError> {
        refuse_insecure(&info)?;
        match info.addr() {
            ConnectionAddr::TcpTls { .. } => {
                let certificates = self.certificates()?;
                Client::build_with_tls(info, certificates)
                    .map(|client| client.get_connection_info().clone())
                    .map_err(redis_error)
            }
            _ if self.is_empty() => Ok(info),
            addr => Err(StoreError::msg(
                StoreErrorKind::Config,
                format!(
                    "TLS settings are given for {addr}, whose URL is not `rediss://`: the \
                     connection would not use TLS (write `rediss://`)"
                ),
            )),
        }
    }
}

/// The process's rustls crypto provider: the one installed, or *ring*, installed now. Called
/// before every TLS connection the crate makes, so that rustls never has to guess (it panics
/// when the build enables both of its providers and none is installed).
pub(crate) fn crypto_provider() -> Arc<CryptoProvider> {
    if let Some(provider) = CryptoProvider::get_default() {
        return Arc::clone(provider);
    }
    // Another thread may install one meanwhile: then that one is the default.
    let _ = rustls::crypto::ring::default_provider().install_default();
    CryptoProvider::get_default()
        .map(Arc::clone)
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()))
}

/// Installs the provider when `info` is a TLS address.
pub(crate) fn prepare(info: &ConnectionInfo) {
    if matches!(info.addr(), ConnectionAddr::TcpTls { .. }) {
        crypto_provider();
    }
}

fn parse_certs(
    pem: &[u8],
    what: &str,
    source: &Pem,
) -> Result<Vec<CertificateDer<'static>>, StoreError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| {
            StoreError::msg(
                StoreErrorKind::Tls,
                format!("the {what} {} is not valid PEM", source.origin()),
            )
        })?;
    if certs.is_empty() {
        return Err(StoreError::msg(
            StoreErrorKind::Tls,
            format!("the {what} {} holds no PEM certificate", source.origin()),
        ));
    }
    Ok(certs)
}

fn tls_error(
    message: String,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> StoreError {
    StoreError::new(StoreErrorKind::Tls, message, source)
}

impl fmt::Debug for Pem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Inline(pem) => write!(f, "<{} bytes of PEM>", pem.len()),
            Self::File(path) => fmt::Debug::fmt(Path::new(path), f),
        }
    }
}

/// Shows where each part comes from (a file's path, or the size of inline PEM), never a key.
impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("ca_cert", &self.ca_cert)
            .field("client_cert", &self.client.as_ref().map(|(cert, _)| cert))
            .field("client_key", &self.client.as_ref().map(|(_, key)| key))
            .finish()
    }
}

/// The serde form: see [`TlsConfig`]'s docs.
#[cfg(feature = "serde")]
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TlsConfigRepr {
    #[serde(default)]
    ca_cert: Option<PathBuf>,
    #[serde(default)]
    ca_cert_pem: Option<String>,
    #[serde(default)]
    client_cert: Option<PathBuf>,
    #[serde(default)]
    client_cert_pem: Option<String>,
    #[serde(default)]
    client_key: Option<PathBuf>,
    #[serde(default)]
    client_key_pem: Option<String>,
}

#[cfg(feature = "serde")]
impl TryFrom<TlsConfigRepr> for TlsConfig {
    type Error = String;

    fn try_from(repr: TlsConfigRepr) -> Result<Self, String> {
        fn one(
            name: &str,
            file: Option<PathBuf>,
            pem: Option<String>,
        ) -> Result<Option<Pem>, String> {
            match (file, pem) {
                (Some(_), Some(_)) => Err(format!("give `{name}` or `{name}_pem`, not both")),
                (Some(path), None) => Ok(Some(Pem::File(path))),
                (None, Some(pem)) => Ok(Some(Pem::Inline(Arc::from(pem.into_bytes())))),
                (None, None) => Ok(None),
            }
        }
        let ca_cert = one("ca_cert", repr.ca_cert, repr.ca_cert_pem)?;
        let cert = one("client_cert", repr.client_cert, repr.client_cert_pem)?;
        let key = one("client_key", repr.client_key, repr.client_key_pem)?;
        let client = match (cert, key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            (Some(_), None) => return Err("`client_cert` needs its `client_key`".to_owned()),
            (None, Some(_)) => return Err("`client_key` needs its `client_cert`".to_owned()),
        };
        Ok(Self { ca_cert, client })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_where_never_what() {
        let tls = TlsConfig::new()
            .ca_cert_file("/etc/ca.pem")
            .client_cert_pem(
                "-----BEGIN CERTIFICATE-----",
                "-----BEGIN PRIVATE KEY----- s3cret",
            );
        let debug = format!("{tls:?}");
        assert!(debug.contains("/etc/ca.pem"), "{debug}");
        assert!(
            !debug.contains("s3cret") && !debug.contains("BEGIN"),
            "{debug}"
        );
    }

    #[test]
    fn a_missing_file_names_it() {
        let error = TlsConfig::new()
            .ca_cert_file("/nonexistent/ca.pem")
            .certificates()
            .unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Tls);
        assert!(error.to_string().contains("/nonexistent/ca.pem"), "{error}");
    }

    #[test]
    fn a_bundle_without_certificates_is_refused() {
        let error = TlsConfig::new()
            .ca_cert_pem("not a certificate")
            .certificates()
            .unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Tls);
        assert!(error.to_string().contains("no PEM certificate"), "{error}");
    }

    #[test]
    fn settings_for_a_plain_url_are_refused() {
        let tls = TlsConfig::new().ca_cert_pem("x");
        let error = tls
            .connection_info("redis://:pw@127.0.0.1:6380/")
            .unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Config);
        assert!(error.to_string().contains("rediss://"), "{error}");
        assert!(!format!("{error:?}").contains("pw"), "{error:?}");
        // Without certificates, a plain URL is left as it is.
        assert!(
            TlsConfig::new()
                .connection_info("redis://127.0.0.1/")
                .is_ok()
        );
    }

    #[cfg(feature = "serde")]
    #[test]
    fn deserializes_files_or_pem_and_refuses_ambiguity() {
        let tls: TlsConfig = serde_json::from_str(
            r#"{"ca_cert": "/etc/ca.pem", "client_cert": "/c.pem", "client_key": "/c.key"}"#,
        )
        .unwrap();
        assert!(format!("{tls:?}").contains("/c.key"));
        let tls: TlsConfig = serde_json::from_str(r#"{"ca_cert_pem": "-----BEGIN"}"#).unwrap();
        assert!(!tls.is_empty());
        assert!(serde_json::from_str::<TlsConfig>("{}").unwrap().is_empty());
        for bad in [
            r#"{"ca_cert": "/a", "ca_cert_pem": "b"}"#,
            r#"{"client_cert": "/c.pem"}"#,
            r#"{"client_key_pem": "k"}"#,
            r#"{"ca_certs": "/a"}"#,
        ] {
            assert!(serde_json::from_str::<TlsConfig>(bad).is_err(), "{bad}");
        }
    }
}

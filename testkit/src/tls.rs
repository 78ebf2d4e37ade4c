//! TLS for the test servers: [`TestCerts`], a private CA and the certificates it signs, made
//! with the `openssl` command-line tool in a scratch directory; and [`TlsOptions`], how a
//! server started by this kit uses them (`--port 0 --tls-port <port>`, with or without
//! `--tls-auth-clients yes`).
//!
//! | file | what |
//! |---|---|
//! | [`ca`](TestCerts::ca) | the CA that signs the servers' and the client's certificates |
//! | [`server_cert`](TestCerts::server_cert), [`server_key`](TestCerts::server_key) | for `127.0.0.1` and `localhost` |
//! | [`wrong_host_cert`](TestCerts::wrong_host_cert), [`wrong_host_key`](TestCerts::wrong_host_key) | signed by the CA, for `other.example` only |
//! | [`client_cert`](TestCerts::client_cert), [`client_key`](TestCerts::client_key) | a client certificate the CA signed |
//! | [`other_ca`](TestCerts::other_ca) | a second CA, which signed [`untrusted_client_cert`](TestCerts::untrusted_client_cert) and nothing the servers use |

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
};

use crate::process::scratch_dir;

/// A private CA and the certificates it signs (P-256 keys, valid for two days), in a scratch
/// directory removed on drop.
#[derive(Debug)]
pub struct TestCerts {
    dir: PathBuf,
}

impl TestCerts {
    /// Makes everything with `openssl`. Panics, loudly, if it is not installed.
    pub fn generate() -> Arc<Self> {
        let certs = Self {
            dir: scratch_dir("tls"),
        };
        certs.ca_pair("ca", "tower-lock test CA");
        certs.ca_pair("other-ca", "tower-lock untrusted CA");
        certs.signed(
            "server",
            "ca",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        );
        certs.signed(
            "wrong-host",
            "ca",
            "subjectAltName=DNS:other.example\nextendedKeyUsage=serverAuth,clientAuth\n",
        );
        certs.signed("client", "ca", "extendedKeyUsage=clientAuth\n");
        certs.signed(
            "untrusted-client",
            "other-ca",
            "extendedKeyUsage=clientAuth\n",
        );
        Arc::new(certs)
    }

    /// The CA certificate (PEM) that signed the servers' and the client's certificates.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// Another CA's certificate: trusting it alone, a client rejects the servers.
    pub fn other_ca(&self) -> PathBuf {
        self.dir.join("other-ca.pem")
    }

    /// The servers' certificate, for `127.0.0.1` and `localhost`.
    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("server.pem")
    }

    /// Its key.
    pub fn server_key(&self) -> PathBuf {
        self.dir.join("server.key")
    }

    /// A certificate the CA signed for `other.example` only.
    pub fn wrong_host_cert(&self) -> PathBuf {
        self.dir.join("wrong-host.pem")
    }

    /// Its key.
    pub fn wrong_host_key(&self) -> PathBuf {
        self.dir.join("wrong-host.key")
    }

    /// A client certificate the CA signed.
    pub fn client_cert(&self) -> PathBuf {
        self.dir.join("client.pem")
    }

    /// Its key.
    pub fn client_key(&self) -> PathBuf {
        self.dir.join("client.key")
    }

    /// A client certificate signed by [`other_ca`](Self::other_ca): servers refuse it.
    pub fn untrusted_client_cert(&self) -> PathBuf {
        self.dir.join("untrusted-client.pem")
    }

    /// Its key.
    pub fn untrusted_client_key(&self) -> PathBuf {
        self.dir.join("untrusted-client.key")
    }

    /// The directory the files are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn ca_pair(&self, name: &str, subject: &str) {
        openssl(
            &self.dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.pem"),
                "-days",
                "2",
                "-subj",
                &format!("/CN={subject}"),
            ],
        );
    }

    fn signed(&self, name: &str, ca: &str, extensions: &str) {
        let ext = self.dir.join(format!("{name}.ext"));
        std::fs::write(&ext, extensions).expect("cannot write an openssl extensions file");
        openssl(
            &self.dir,
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
                "-subj",
                &format!("/CN={name}"),
            ],
        );
        openssl(
            &self.dir,
            &[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                &format!("{ca}.pem"),
                "-CAkey",
                &format!("{ca}.key"),
                "-CAcreateserial",
                "-out",
                &format!("{name}.pem"),
                "-days",
                "2",
                "-extfile",
                &format!("{name}.ext"),
            ],
        );
    }
}

impl Drop for TestCerts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `openssl` ({e}). The TLS tests make their certificates with it: \
                 install it (`apt-get install -y openssl`) or run `scripts/test.sh`, which does."
            )
        });
    assert!(
        output.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// How a server started by this kit speaks TLS: only TLS (`--port 0 --tls-port <port>`), with
/// [`TestCerts`]'s server certificate (or the one for another host), trusting its CA for
/// client certificates, which it requires or not; and TLS for replication, the cluster bus
/// and the sentinels' connections.
#[derive(Debug, Clone)]
pub struct TlsOptions {
    pub(crate) certs: Arc<TestCerts>,
    pub(crate) auth_clients: bool,
    pub(crate) wrong_host: bool,
}

impl TlsOptions {
    /// TLS with `certs`, client certificates not required.
    pub fn new(certs: &Arc<TestCerts>) -> Self {
        Self {
            certs: Arc::clone(certs),
            auth_clients: false,
            wrong_host: false,
        }
    }

    /// Requires a client certificate signed by the CA (`--tls-auth-clients yes`): mutual TLS.
    #[must_use]
    pub fn auth_clients(mut self, required: bool) -> Self {
        self.auth_clients = required;
        self
    }

    /// Presents the certificate for `other.example` instead of the one for `127.0.0.1`.
    #[must_use]
    pub fn wrong_host(mut self) -> Self {
        self.wrong_host = true;
        self
    }

    /// The certificates.
    pub fn certs(&self) -> &Arc<TestCerts> {
        &self.certs
    }

    /// The `redis-server` arguments (or sentinel config lines, without the dashes) for TLS on
    /// `port`.
    pub(crate) fn server_settings(&self, port: u16) -> Vec<(&'static str, String)> {
        let (cert, key) = if self.wrong_host {
            (self.certs.wrong_host_cert(), self.certs.wrong_host_key())
        } else {
            (self.certs.server_cert(), self.certs.server_key())
        };
        vec![
            ("port", "0".to_owned()),
            ("tls-port", port.to_string()),
            ("tls-cert-file", cert.display().to_string()),
            ("tls-key-file", key.display().to_string()),
            ("tls-ca-cert-file", self.certs.ca().display().to_string()),
            (
                "tls-auth-clients",
                if self.auth_clients { "yes" } else { "no" }.to_owned(),
            ),
            ("tls-replication", "yes".to_owned()),
        ]
    }

    /// `redis-cli`'s TLS arguments (with the client certificate, which every server accepts).
    pub(crate) fn cli_args(&self) -> Vec<String> {
        vec![
            "--tls".to_owned(),
            "--cacert".to_owned(),
            self.certs.ca().display().to_string(),
            "--cert".to_owned(),
            self.certs.client_cert().display().to_string(),
            "--key".to_owned(),
            self.certs.client_key().display().to_string(),
        ]
    }

    /// The redis crate's certificates for the kit's own connections (the CA, and the client
    /// certificate, which every server accepts); installs the *ring* provider if none is.
    #[cfg(feature = "tls")]
    pub(crate) fn redis_certificates(&self) -> redis::TlsCertificates {
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let read = |path: PathBuf| {
            std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
        };
        redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: read(self.certs.client_cert()),
                client_key: read(self.certs.client_key()),
            }),
            root_cert: Some(read(self.certs.ca())),
        }
    }
}

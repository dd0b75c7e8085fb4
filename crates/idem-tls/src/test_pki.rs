//! Certificates made on the spot for tests (feature `_test-pki`): a CA and
//! a server certificate it signs for `localhost` and `127.0.0.1`, as PEM
//! strings and as files in a directory of their own, removed on drop.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose};

/// A CA, a server certificate it signed, and their files.
#[derive(Debug)]
pub struct TestPki {
    /// The CA certificate (PEM).
    pub ca_pem: String,
    /// The server certificate (PEM), for `localhost` and `127.0.0.1`.
    pub cert_pem: String,
    /// The server's private key (PEM, PKCS#8).
    pub key_pem: String,
    dir: PathBuf,
}

impl TestPki {
    /// A new CA and server certificate named `name` (a directory under the
    /// system's temporary directory holds `ca.pem`, `server.pem` and
    /// `server.key`).
    pub fn new(name: &str) -> Self {
        let ca_key = KeyPair::generate().expect("a CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, format!("idem test CA {name}"));
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key).expect("the CA certificate");
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().expect("a server key");
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).expect("server parameters");
        params.distinguished_name.push(rcgen::DnType::CommonName, "localhost");
        let cert = params.signed_by(&key, &issuer).expect("the server certificate");
        let dir = std::env::temp_dir().join(format!("idem-pki-{name}-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&dir).expect("the certificates' directory");
        let pki = Self {
            ca_pem: ca_cert.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            dir,
        };
        std::fs::write(pki.ca_file(), &pki.ca_pem).expect("ca.pem");
        std::fs::write(pki.cert_file(), &pki.cert_pem).expect("server.pem");
        std::fs::write(pki.key_file(), &pki.key_pem).expect("server.key");
        pki
    }

    /// The directory of the files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `ca.pem`.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// `server.pem`.
    pub fn cert_file(&self) -> PathBuf {
        self.dir.join("server.pem")
    }

    /// `server.key`.
    pub fn key_file(&self) -> PathBuf {
        self.dir.join("server.key")
    }

    /// rustls server settings presenting the server certificate (HTTP/1.1).
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        crate::server_config(&self.cert_file(), &self.key_file()).expect("the server's settings")
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A reqwest client builder, with ring installed as the process's provider
/// first (see [`crate::install_default_provider`]).
pub fn http_builder() -> reqwest::ClientBuilder {
    crate::install_default_provider();
    reqwest::Client::builder()
}

/// A default reqwest client (see [`http_builder`]).
pub fn http_client() -> reqwest::Client {
    http_builder().build().expect("a reqwest client")
}

/// `GET url` with a default client, as `reqwest::get`.
pub async fn get(url: impl reqwest::IntoUrl) -> reqwest::Result<reqwest::Response> {
    http_client().get(url).send().await
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    (u64::from(nanos) << 16) | NEXT.fetch_add(1, Ordering::Relaxed)
}

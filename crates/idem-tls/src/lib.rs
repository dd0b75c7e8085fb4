//! TLS client settings shared by idem's connections.
//!
//! Every TLS connection idem makes (outbound calls, the gateway's upstream,
//! the client library, and the CA files given to stores and brokers) trusts
//! one of two sets of roots:
//!
//! - [`Roots::Platform`]: the platform's certificate store, read by
//!   `rustls-native-certs` (on Linux the system bundle, honouring
//!   `SSL_CERT_FILE` and `SSL_CERT_DIR`), so a private CA installed on the
//!   machine is trusted as every other program trusts it;
//! - [`Roots::CaFile`]: the certificates of one PEM file, and nothing else.
//!
//! The cryptography is rustls on ring: no OpenSSL, and one provider only.
//!
//! A failed handshake is described with [`handshake_failure`], which finds
//! the rustls error in any error's chain:
//!
//! ```
//! let roots = idem_tls::Roots::ca_file(None::<&str>);
//! assert_eq!(roots, idem_tls::Roots::Platform);
//! let io = std::io::Error::new(
//!     std::io::ErrorKind::InvalidData,
//!     rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
//! );
//! assert_eq!(
//!     idem_tls::handshake_failure(&io).as_deref(),
//!     Some("TLS handshake failed: invalid peer certificate: UnknownIssuer")
//! );
//! ```

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use rustls;
use rustls::crypto::CryptoProvider;
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Why TLS settings cannot be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A CA or certificate file cannot be read or holds no usable
    /// certificate.
    #[error("{what} {}: {why}", path.display())]
    CaFile {
        /// Which file: `CA file` or `certificate file`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A private key file cannot be read or holds no usable key.
    #[error("key file {}: {why}", path.display())]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// rustls refused the settings.
    #[error("TLS settings: {0}")]
    Settings(String),
}

/// A `Result` whose error is [`TlsError`].
pub type Result<T, E = TlsError> = std::result::Result<T, E>;

/// The certificates a connection trusts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Roots {
    /// The platform's certificate store (empty if the platform has none:
    /// every server is then refused as `UnknownIssuer`).
    #[default]
    Platform,
    /// The certificates of this PEM file only.
    CaFile(PathBuf),
}

impl Roots {
    /// A CA file if one is given, else the platform's store.
    pub fn ca_file(path: Option<impl Into<PathBuf>>) -> Self {
        path.map_or(Roots::Platform, |p| Roots::CaFile(p.into()))
    }

    /// The trusted certificates.
    pub fn store(&self) -> Result<RootCertStore> {
        match self {
            Roots::Platform => platform_roots(),
            Roots::CaFile(path) => ca_file_roots(path),
        }
    }

    /// rustls settings for a client that verifies servers against these
    /// roots, with no client certificate; `alpn` is left empty.
    pub fn client_config(&self) -> Result<ClientConfig> {
        install_default_provider();
        let config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Settings(e.to_string()))?
            .with_root_certificates(self.store()?)
            .with_no_client_auth();
        Ok(config)
    }
}

/// The crypto provider of every connection: ring.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes ring the process's default rustls provider, unless one is
/// installed already (then nothing changes). Code that builds TLS settings
/// without naming a provider takes the process's default — a reqwest client
/// built without idem's settings panics without one when, as here, ring is
/// the only provider compiled in. Settings made by this crate install it;
/// binaries call it first thing.
pub fn install_default_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// rustls server settings presenting the certificate chain of `cert_file`
/// with the private key of `key_file` (both PEM), offering HTTP/1.1.
pub fn server_config(cert_file: &Path, key_file: &Path) -> Result<Arc<rustls::ServerConfig>> {
    install_default_provider();
    let certs = read_pem_certs(cert_file, "certificate file")?;
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| TlsError::KeyFile {
        path: key_file.to_owned(),
        why: format!("holds no usable PEM private key: {e}"),
    })?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Settings(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Settings(format!("{}: {e}", cert_file.display())))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The PEM certificates of `path`, read and checked.
pub fn read_ca_file(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    read_pem_certs(path, "CA file")
}

fn read_pem_certs(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>> {
    let bad = |why: String| TlsError::CaFile {
        what,
        path: path.to_owned(),
        why,
    };
    let pem = std::fs::read(path).map_err(|e| bad(format!("cannot be read: {e}")))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("is not a PEM file of certificates: {e}")))?;
    if certs.is_empty() {
        return Err(bad("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into()));
    }
    Ok(certs)
}

fn ca_file_roots(path: &Path) -> Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    for cert in read_ca_file(path)? {
        store.add(cert).map_err(|e| TlsError::CaFile {
            what: "CA file",
            path: path.to_owned(),
            why: format!("holds a certificate that cannot be a root: {e}"),
        })?;
    }
    Ok(store)
}

fn platform_roots() -> Result<RootCertStore> {
    // A platform without a store (a bare container image) still makes
    // plain-HTTP clients: its https connections fail their handshakes with
    // `UnknownIssuer`, which names the cause.
    let found = rustls_native_certs::load_native_certs();
    let mut store = RootCertStore::empty();
    store.add_parsable_certificates(found.certs);
    Ok(store)
}

/// `TLS handshake failed: <rustls's reason>` if `e`'s chain holds a rustls
/// error (also inside an `io::Error`, where TLS streams put it), or if a
/// link of the chain is only the text of one (drivers that keep an I/O
/// error's message alone), else `None`.
pub fn handshake_failure(e: &(dyn StdError + 'static)) -> Option<String> {
    handshake_error(e).or_else(|| {
        let mut next: Option<&(dyn StdError + 'static)> = Some(e);
        while let Some(err) = next {
            if let Some(found) = handshake_text(&err.to_string()) {
                return Some(found);
            }
            next = err.source();
        }
        None
    })
}

/// The text of rustls's handshake errors, by the start of their message.
const RUSTLS_MESSAGES: [&str; 7] = [
    "invalid peer certificate: ",
    "received corrupt message of type ",
    "peer is incompatible: ",
    "peer misbehaved: ",
    "received fatal alert: ",
    "peer sent no certificates",
    "peer doesn't support any known protocol",
];

/// `TLS handshake failed: <reason>` if `text` is, or ends with, a rustls
/// handshake error's message.
fn handshake_text(text: &str) -> Option<String> {
    RUSTLS_MESSAGES
        .iter()
        .filter_map(|m| text.find(m))
        .min()
        .map(|at| format!("TLS handshake failed: {}", &text[at..]))
}

fn handshake_error(e: &(dyn StdError + 'static)) -> Option<String> {
    let mut next: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = next {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(format!("TLS handshake failed: {tls}"));
        }
        if let Some(inner) = err.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref())
            && let Some(found) = handshake_error(inner as &(dyn StdError + 'static))
        {
            return Some(found);
        }
        next = err.source();
    }
    None
}

#[cfg(feature = "_test-pki")]
pub mod test_pki;

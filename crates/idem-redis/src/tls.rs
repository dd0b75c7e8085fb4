//! TLS of Redis connections: `rediss://` URLs verified against the
//! platform's roots, or against the CA of a `ca_file=PATH` URL parameter
//! (removed from the URL before it reaches the driver).

use std::path::{Path, PathBuf};

use idem_core::{Error, Result};

/// The URL without its `ca_file` parameter, and that parameter.
pub(crate) fn split_ca_file(url: &str) -> Result<(String, Option<PathBuf>)> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), None));
    };
    let mut ca = None;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.strip_prefix("ca_file=") {
            Some(path) if !path.is_empty() => ca = Some(PathBuf::from(path)),
            Some(_) => return Err(Error::Config("Redis URL: ca_file= names no file".into())),
            None => kept.push(pair),
        }
    }
    if ca.is_some() && !base.starts_with("rediss://") {
        return Err(Error::Config(idem_core::redact_credentials(&format!(
            "Redis URL {base:?}: ca_file is for TLS connections (rediss://)"
        ))));
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((url, ca))
}

/// The CA file's PEM text, checked.
#[cfg(feature = "tls")]
fn ca_pem(path: &Path) -> Result<Vec<u8>> {
    idem_tls::read_ca_file(path).map_err(|e| Error::Config(format!("Redis: {e}")))?;
    std::fs::read(path).map_err(|e| Error::Config(format!("Redis: CA file {}: cannot be read: {e}", path.display())))
}

/// A client for `info`, trusting only `ca`'s certificates when given.
pub(crate) fn client(info: redis::ConnectionInfo, ca: Option<&Path>, url: &str) -> Result<redis::Client> {
    let bad = |e: redis::RedisError| Error::Config(idem_core::redact_credentials(&format!("Redis URL {url:?}: {e}")));
    match ca {
        #[cfg(feature = "tls")]
        Some(path) => redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca_pem(path)?),
            },
        )
        .map_err(bad),
        #[cfg(not(feature = "tls"))]
        Some(_) => Err(Error::Config(
            "Redis: ca_file needs TLS, and this build has none (the `tls` feature of idem-redis)".into(),
        )),
        None => redis::Client::open(info).map_err(bad),
    }
}

/// The cluster builder, trusting only `ca`'s certificates when given.
pub(crate) fn cluster_certs(
    builder: redis::cluster::ClusterClientBuilder,
    ca: Option<&Path>,
) -> Result<redis::cluster::ClusterClientBuilder> {
    match ca {
        #[cfg(feature = "tls")]
        Some(path) => Ok(builder.certs(redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca_pem(path)?),
        })),
        #[cfg(not(feature = "tls"))]
        Some(_) => Err(Error::Config(
            "Redis: ca_file needs TLS, and this build has none (the `tls` feature of idem-redis)".into(),
        )),
        None => Ok(builder),
    }
}

/// A first connection's failure: a failed TLS handshake says so, naming
/// the server; anything else is the store's error.
pub(crate) fn connect_error(url: &str, e: redis::RedisError) -> Error {
    #[cfg(feature = "tls")]
    if let Some(failed) = idem_tls::handshake_failure(&e) {
        let at = idem_core::redact_credentials(url);
        return Error::store(idem_core::StoreErrorKind::Unavailable, format!("Redis {at}: {failed}"));
    }
    let _ = url;
    crate::store_error(e)
}

//! TLS of the API listener: a PEM certificate chain and private key read into a rustls
//! server configuration (ring, HTTP/1.1 by ALPN), and read again when the files change,
//! as a mounted Secret's do when the kubelet swaps its `..data` symlink.
//!
//! The live configuration is axum-server's [`RustlsConfig`], which new handshakes read
//! and [`Reloader`] swaps; connections already open keep the certificate they started
//! with. A changed pair that cannot be used (unreadable, not PEM, a key that does not fit
//! the certificate) is logged once and the previous certificate stays in service.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use tracing::{info, warn};

/// How often the files are compared with what is being served. The kubelet refreshes a
/// mounted Secret within about a minute of its change; a few seconds more is nothing.
pub const RELOAD_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Which of the two files a problem is in (and the setting that names it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsFile {
    Certificate,
    Key,
}

impl TlsFile {
    pub fn variable(self) -> &'static str {
        match self {
            TlsFile::Certificate => "PRISM_TLS_CERT_FILE",
            TlsFile::Key => "PRISM_TLS_KEY_FILE",
        }
    }
}

/// Why a certificate/key pair cannot be served. No variant carries key material.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        file: TlsFile,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{} is not PEM: {detail}", path.display())]
    NotPem { file: TlsFile, path: PathBuf, detail: String },
    #[error("{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{} holds no PEM private key (PKCS#8, PKCS#1 or SEC1)", path.display())]
    NoKey { path: PathBuf },
    #[error("the key in {} does not fit the certificate in {}: {detail}", key.display(), cert.display())]
    Unusable { cert: PathBuf, key: PathBuf, detail: String },
    #[error("the certificate in {} is not valid now (valid from {not_before} to {not_after})", path.display())]
    NotValidNow { path: PathBuf, not_before: String, not_after: String },
    #[error("the certificate in {} does not cover {} that the served one does", path.display(), missing.join(", "))]
    OtherNames { path: PathBuf, missing: Vec<String> },
}

impl TlsError {
    /// The setting to fix.
    pub fn variable(&self) -> &'static str {
        match self {
            TlsError::Read { file, .. } | TlsError::NotPem { file, .. } => file.variable(),
            TlsError::NoCertificate { .. } | TlsError::NotValidNow { .. } | TlsError::OtherNames { .. } => {
                TlsFile::Certificate.variable()
            }
            TlsError::NoKey { .. } | TlsError::Unusable { .. } => TlsFile::Key.variable(),
        }
    }
}

/// The two files `PRISM_TLS_CERT_FILE` and `PRISM_TLS_KEY_FILE` name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A pair as read: the server configuration and what tells one pair from another.
pub struct Loaded {
    pub config: Arc<ServerConfig>,
    /// SHA-256 of the leaf certificate (hex): what `openssl x509 -fingerprint -sha256`
    /// shows, for logs.
    pub fingerprint: String,
    /// SHA-256 over both files' bytes: a change of either is a change.
    digest: [u8; 32],
    /// The DNS names and IP addresses the leaf certificate is for (its subjectAltName).
    names: std::collections::BTreeSet<String>,
}

/// Names the certificate only: nothing of the key is ever printed.
impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("fingerprint", &self.fingerprint).finish_non_exhaustive()
    }
}

impl CertFiles {
    /// Reads and checks both files now (at start: a bad pair stops the process).
    pub fn load(&self) -> Result<Loaded, TlsError> {
        let cert = std::fs::read(&self.cert).map_err(|e| self.read_error(TlsFile::Certificate, e))?;
        let key = std::fs::read(&self.key).map_err(|e| self.read_error(TlsFile::Key, e))?;
        self.parse(&cert, &key)
    }

    /// Both files' bytes as one consistent pair, or None while they are being swapped:
    /// the certificate is read again after the key, so a pair read across a swap (new
    /// certificate, old key, or the other way) is never taken for a bad pair.
    async fn read_consistent(&self) -> Result<Option<(Vec<u8>, Vec<u8>)>, TlsError> {
        let cert = tokio::fs::read(&self.cert).await.map_err(|e| self.read_error(TlsFile::Certificate, e))?;
        let key = tokio::fs::read(&self.key).await.map_err(|e| self.read_error(TlsFile::Key, e))?;
        let again = tokio::fs::read(&self.cert).await.map_err(|e| self.read_error(TlsFile::Certificate, e))?;
        Ok((again == cert).then_some((cert, key)))
    }

    fn read_error(&self, file: TlsFile, source: io::Error) -> TlsError {
        let path = match file {
            TlsFile::Certificate => self.cert.clone(),
            TlsFile::Key => self.key.clone(),
        };
        TlsError::Read { file, path, source }
    }

    /// The server configuration of a PEM chain and key: ring, TLS 1.2 and 1.3, no client
    /// certificates, ALPN `http/1.1` (the listener speaks HTTP/1.1 only: see
    /// `transport`), and rustls's check that the key belongs to the leaf certificate.
    pub fn parse(&self, cert_pem: &[u8], key_pem: &[u8]) -> Result<Loaded, TlsError> {
        let chain = CertificateDer::pem_slice_iter(cert_pem).collect::<Result<Vec<_>, _>>().map_err(|e| {
            TlsError::NotPem { file: TlsFile::Certificate, path: self.cert.clone(), detail: e.to_string() }
        })?;
        let leaf = chain.first().ok_or_else(|| TlsError::NoCertificate { path: self.cert.clone() })?;
        let fingerprint = hex(&Sha256::digest(leaf.as_ref()));
        let names = self.valid_now(leaf.as_ref())?;
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| match e {
            rustls::pki_types::pem::Error::NoItemsFound => TlsError::NoKey { path: self.key.clone() },
            // The parser's own words name the PEM structure, never the key's bytes.
            other => TlsError::NotPem { file: TlsFile::Key, path: self.key.clone(), detail: other.to_string() },
        })?;
        let unusable = |e: rustls::Error| TlsError::Unusable {
            cert: self.cert.clone(),
            key: self.key.clone(),
            detail: e.to_string(),
        };
        let mut config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(unusable)?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(unusable)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Loaded { config: Arc::new(config), fingerprint, digest: digest(cert_pem, key_pem), names })
    }

    /// The leaf's names, once it is known to be valid now: an expired certificate (or one
    /// not yet valid) would fail every client's handshake, so it is never served.
    fn valid_now(&self, leaf: &[u8]) -> Result<std::collections::BTreeSet<String>, TlsError> {
        use x509_parser::extensions::GeneralName;
        let not_pem = |detail: String| TlsError::NotPem { file: TlsFile::Certificate, path: self.cert.clone(), detail };
        let (_, cert) =
            x509_parser::parse_x509_certificate(leaf).map_err(|e| not_pem(format!("not an X.509 certificate: {e}")))?;
        let validity = cert.validity();
        if !validity.is_valid() {
            return Err(TlsError::NotValidNow {
                path: self.cert.clone(),
                not_before: validity.not_before.to_string(),
                not_after: validity.not_after.to_string(),
            });
        }
        let mut names = std::collections::BTreeSet::new();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                match name {
                    GeneralName::DNSName(dns) => {
                        names.insert(dns.to_ascii_lowercase());
                    }
                    GeneralName::IPAddress(bytes) => {
                        let ip = match bytes.len() {
                            4 => <[u8; 4]>::try_from(*bytes).ok().map(|b| std::net::IpAddr::from(b).to_string()),
                            16 => <[u8; 16]>::try_from(*bytes).ok().map(|b| std::net::IpAddr::from(b).to_string()),
                            _ => None,
                        };
                        names.extend(ip);
                    }
                    _ => {}
                }
            }
        }
        Ok(names)
    }
}

fn digest(cert: &[u8], key: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update((cert.len() as u64).to_le_bytes());
    h.update(cert);
    h.update(key);
    h.finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What one look at the files found.
#[derive(Debug)]
pub enum Checked {
    /// The files hold what is being served (or are in the middle of a swap).
    Unchanged,
    /// A new pair is being served from now on.
    Reloaded { fingerprint: String },
    /// The files changed to something that cannot be served; the previous pair stays.
    Kept(TlsError),
    /// The same unusable content as last time (already reported).
    StillKept,
}

/// Watches the files and swaps the live configuration when they hold a new, good pair.
pub struct Reloader {
    files: CertFiles,
    live: RustlsConfig,
    serving: [u8; 32],
    /// The names the served certificate covers: a new one must cover them all, or the
    /// clients that reach the API under one of them would fail their handshake.
    names: std::collections::BTreeSet<String>,
    /// Counts each refusal (`prism_tls_reloads_refused_total`).
    refusals: prometheus_client::metrics::counter::Counter,
    /// What the last refusal was about (the content's digest, or the read error), so a
    /// bad pair is reported once, not every few seconds.
    refused: Option<String>,
}

impl Reloader {
    /// Starts serving `loaded`; returns the watcher and the configuration to serve.
    pub fn new(
        files: CertFiles,
        loaded: Loaded,
        refusals: prometheus_client::metrics::counter::Counter,
    ) -> (Reloader, RustlsConfig) {
        let live = RustlsConfig::from_config(loaded.config);
        let reloader = Reloader {
            files,
            live: live.clone(),
            serving: loaded.digest,
            names: loaded.names,
            refused: None,
            refusals,
        };
        (reloader, live)
    }

    pub async fn check(&mut self) -> Checked {
        let (cert, key) = match self.files.read_consistent().await {
            Ok(Some(pair)) => pair,
            Ok(None) => return Checked::Unchanged,
            Err(e) => return self.refuse(e.to_string(), e),
        };
        let seen = digest(&cert, &key);
        if seen == self.serving {
            self.refused = None;
            return Checked::Unchanged;
        }
        match self.files.parse(&cert, &key) {
            Ok(loaded) if !loaded.names.is_superset(&self.names) => {
                let missing = self.names.difference(&loaded.names).cloned().collect();
                self.refuse(hex(&seen), TlsError::OtherNames { path: self.files.cert.clone(), missing })
            }
            Ok(loaded) => {
                self.live.reload_from_config(loaded.config);
                self.serving = loaded.digest;
                self.names = loaded.names;
                self.refused = None;
                Checked::Reloaded { fingerprint: loaded.fingerprint }
            }
            Err(e) => self.refuse(hex(&seen), e),
        }
    }

    fn refuse(&mut self, what: String, e: TlsError) -> Checked {
        if self.refused.as_deref() == Some(what.as_str()) {
            return Checked::StillKept;
        }
        self.refused = Some(what);
        self.refusals.inc();
        Checked::Kept(e)
    }

    /// Looks every `every` until the task is dropped, logging what changed.
    pub async fn run(mut self, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            match self.check().await {
                Checked::Unchanged | Checked::StillKept => {}
                Checked::Reloaded { fingerprint } => {
                    info!(cert = %self.files.cert.display(), sha256 = %fingerprint, "TLS certificate reloaded")
                }
                Checked::Kept(error) => warn!(
                    %error,
                    variable = error.variable(),
                    "TLS files changed but cannot be served; still serving the previous certificate"
                ),
            }
        }
    }
}

/// A CA and a server certificate it signed for 127.0.0.1 and localhost, as PEM:
/// (ca, cert, key). For tests (this crate's, and the test kit's: the `test-util` feature).
#[cfg(any(test, feature = "test-util"))]
pub fn test_pair(cn: &str) -> (String, String, String) {
    test_pair_for(cn, &["localhost", "127.0.0.1"], None)
}

/// The same for other names, and (`expired`) valid only in 2020.
#[cfg(any(test, feature = "test-util"))]
pub fn test_pair_for(cn: &str, names: &[&str], expired: Option<()>) -> (String, String, String) {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name.push(rcgen::DnType::CommonName, format!("{cn} CA"));
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let ca = rcgen::CertifiedIssuer::self_signed(ca, ca_key).expect("CA certificate");
    let mut leaf = rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
        .expect("leaf parameters");
    leaf.distinguished_name.push(rcgen::DnType::CommonName, cn);
    if expired.is_some() {
        leaf.not_before = rcgen::date_time_ymd(2020, 1, 1);
        leaf.not_after = rcgen::date_time_ymd(2020, 12, 31);
    }
    let key = rcgen::KeyPair::generate().expect("leaf key");
    let cert = leaf.signed_by(&key, &ca).expect("leaf certificate");
    (ca.pem(), cert.pem(), key.serialize_pem())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn files(dir: &Path) -> CertFiles {
        CertFiles { cert: dir.join("tls.crt"), key: dir.join("tls.key") }
    }

    fn tempdir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("prism-tls-unit-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_good_pair_loads_and_bad_ones_say_which_file_and_why() {
        let dir = tempdir();
        let f = files(&dir);
        let (_, cert, key) = test_pair("one");
        let (_, other_cert, _) = test_pair("two");

        let e = f.load().unwrap_err();
        assert_eq!(e.variable(), "PRISM_TLS_CERT_FILE");
        assert!(e.to_string().starts_with(&format!("cannot read {}", f.cert.display())), "{e}");

        std::fs::write(&f.cert, &cert).unwrap();
        let e = f.load().unwrap_err();
        assert_eq!(e.variable(), "PRISM_TLS_KEY_FILE", "{e}");

        std::fs::write(&f.key, &key).unwrap();
        let loaded = f.load().unwrap();
        assert_eq!(loaded.fingerprint.len(), 64);
        assert_eq!(loaded.config.alpn_protocols, vec![b"http/1.1".to_vec()]);

        // A key that is not the certificate's: rustls refuses the pair.
        std::fs::write(&f.cert, &other_cert).unwrap();
        let e = f.load().unwrap_err();
        assert!(matches!(e, TlsError::Unusable { .. }), "{e}");
        assert_eq!(e.variable(), "PRISM_TLS_KEY_FILE");

        // The files swapped: no certificate, no key, broken PEM.
        std::fs::write(&f.cert, &key).unwrap();
        assert!(matches!(f.load().unwrap_err(), TlsError::NoCertificate { .. }));
        std::fs::write(&f.cert, &cert).unwrap();
        std::fs::write(&f.key, &cert).unwrap();
        let e = f.load().unwrap_err();
        assert!(matches!(e, TlsError::NoKey { .. }), "{e}");
        std::fs::write(&f.key, "-----BEGIN PRIVATE KEY-----\nAAAA\n").unwrap();
        let e = f.load().unwrap_err();
        assert!(matches!(e, TlsError::NotPem { file: TlsFile::Key, .. }), "{e}");
        // An expired certificate is not served, at start either.
        let (_, expired, expired_key) = test_pair_for("expired", &["localhost"], Some(()));
        std::fs::write(&f.cert, &expired).unwrap();
        std::fs::write(&f.key, &expired_key).unwrap();
        let e = f.load().unwrap_err();
        assert!(matches!(e, TlsError::NotValidNow { .. }) && e.variable() == "PRISM_TLS_CERT_FILE", "{e}");
        assert!(e.to_string().contains("2020"), "{e}");
        // Errors never carry the key: the message of a mismatch names paths only.
        std::fs::write(&f.key, &key).unwrap();
        std::fs::write(&f.cert, &other_cert).unwrap();
        let body = key.lines().nth(1).unwrap();
        assert!(!f.load().unwrap_err().to_string().contains(body));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// The layout the kubelet gives a mounted Secret: `tls.crt -> ..data/tls.crt`,
    /// `..data -> ..<timestamp>`, and an update is one rename of `..data`.
    fn secret_version(dir: &Path, version: &str, cert: &str, key: &str) {
        let data = dir.join(version);
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(data.join("tls.crt"), cert).unwrap();
        std::fs::write(data.join("tls.key"), key).unwrap();
        let tmp = dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(version, &tmp).unwrap();
        std::fs::rename(&tmp, dir.join("..data")).unwrap();
        for name in ["tls.crt", "tls.key"] {
            if std::fs::symlink_metadata(dir.join(name)).is_err() {
                std::os::unix::fs::symlink(format!("..data/{name}"), dir.join(name)).unwrap();
            }
        }
    }

    #[tokio::test]
    async fn the_reloader_follows_a_secret_swap_and_keeps_the_old_pair_when_the_new_one_is_bad() {
        crate::install_crypto_provider();
        let dir = tempdir();
        let f = files(&dir);
        let (_, cert1, key1) = test_pair("first");
        let (_, cert2, key2) = test_pair("second");
        secret_version(&dir, "..v1", &cert1, &key1);
        let loaded = f.load().unwrap();
        let first = loaded.fingerprint.clone();
        let refusals = prometheus_client::metrics::counter::Counter::default();
        let (mut reloader, live) = Reloader::new(f.clone(), loaded, refusals.clone());
        let served = |live: &RustlsConfig| Arc::as_ptr(&live.get_inner());
        let before = served(&live);
        assert!(matches!(reloader.check().await, Checked::Unchanged));
        assert_eq!(served(&live), before);

        // A bad pair (new certificate, the old key): reported once, the old pair served.
        secret_version(&dir, "..v2", &cert2, &key1);
        assert!(matches!(reloader.check().await, Checked::Kept(TlsError::Unusable { .. })));
        assert!(matches!(reloader.check().await, Checked::StillKept));
        assert_eq!(served(&live), before);

        // An expired pair, and a pair for other names: refused, the old pair served, each
        // counted once (#43.9).
        let (_, expired, expired_key) = test_pair_for("expired", &["localhost", "127.0.0.1"], Some(()));
        secret_version(&dir, "..v2e", &expired, &expired_key);
        assert!(matches!(reloader.check().await, Checked::Kept(TlsError::NotValidNow { .. })));
        let (_, elsewhere, elsewhere_key) = test_pair_for("elsewhere", &["prism.example.com"], None);
        secret_version(&dir, "..v2n", &elsewhere, &elsewhere_key);
        let Checked::Kept(TlsError::OtherNames { missing, .. }) = reloader.check().await else { panic!("not refused") };
        assert_eq!(missing, ["127.0.0.1", "localhost"]);
        assert!(matches!(reloader.check().await, Checked::StillKept));
        assert_eq!(served(&live), before);
        assert_eq!(refusals.get(), 3, "the bad key, the expired pair, the other names");

        // The good pair: served from now on.
        secret_version(&dir, "..v3", &cert2, &key2);
        let Checked::Reloaded { fingerprint } = reloader.check().await else { panic!("not reloaded") };
        assert_ne!(fingerprint, first);
        assert_ne!(served(&live), before);
        assert!(matches!(reloader.check().await, Checked::Unchanged));

        // The files gone (a Secret deleted): said once, the last pair still served.
        let now = served(&live);
        std::fs::remove_file(dir.join("..data")).unwrap();
        assert!(matches!(reloader.check().await, Checked::Kept(TlsError::Read { .. })));
        assert!(matches!(reloader.check().await, Checked::StillKept));
        assert_eq!(served(&live), now);
        let _ = std::fs::remove_dir_all(dir);
    }
}

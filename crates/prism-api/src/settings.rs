//! The API's own settings: the flags and environment variables of its listener, its
//! tokens, its limits and TLS (flattened into `prism-operator run`), each parsed into the
//! type of the part it configures. Read once at start, before anything connects: a bad
//! value stops the process with one line naming it.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::PathBuf;

use clap::Args;

use crate::limits::{Limits, Rate};
use crate::mcp::{AllowedHosts, SessionKey, session::MIN_KEY_BYTES};
use crate::transport::CertFiles;

#[derive(Debug, Clone, Args)]
pub struct ApiArgs {
    /// Address of the HTTP API (and /healthz, /readyz, /metrics).
    #[arg(long, env = "PRISM_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// Host names (or host:port) under which clients reach /mcp: a request's Host header,
    /// and the Origin of a browser's, must be one of them (`*` admits any). The chart adds
    /// its Service's names.
    #[arg(long, env = "PRISM_MCP_ALLOWED_HOSTS", value_delimiter = ',', default_value = "localhost,127.0.0.1,::1")]
    pub mcp_allowed_hosts: Vec<String>,
    /// Key (at least 32 characters) that signs MCP session ids; every replica needs the
    /// same. Default: a random key kept in Postgres, shared by every replica.
    #[arg(long, env = "PRISM_MCP_SESSION_KEY", hide_env_values = true)]
    pub mcp_session_key: Option<String>,
    /// Audiences an agent's token must be valid for (TokenReview `spec.audiences`, SPEC
    /// §12): tokens made with `kubectl create token ... --audience prism-operator` are no
    /// credential for the API server itself. Adding the API server's own audience (its
    /// issuer, e.g. https://kubernetes.default.svc.cluster.local) accepts plain tokens too.
    #[arg(long, env = "PRISM_TOKEN_AUDIENCES", value_delimiter = ',', default_value = "prism-operator")]
    pub token_audiences: Vec<String>,
    /// Requests per second one source address may make that cost a TokenReview (a token
    /// not seen in the last seconds) or a hello; 429 `rate_limited` beyond it.
    #[arg(long, env = "PRISM_UNAUTHENTICATED_RATE", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub unauthenticated_rate: u32,
    /// How many of those may come at once.
    #[arg(long, env = "PRISM_UNAUTHENTICATED_BURST", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub unauthenticated_burst: u32,
    /// Hellos per second per Run identity, and the burst (SPEC §12: 1/s, burst 10).
    #[arg(long, env = "PRISM_HELLO_RATE", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub hello_rate: u32,
    #[arg(long, env = "PRISM_HELLO_BURST", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub hello_burst: u32,
    /// Calls per second one Kubernetes identity may make once authenticated (SPEC §12),
    /// and the burst; 429 `rate_limited` beyond. Every session an identity runs shares it.
    #[arg(long, env = "PRISM_RATE_PER_IDENTITY", default_value_t = 500,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub rate_per_identity: u32,
    #[arg(long, env = "PRISM_BURST_PER_IDENTITY", default_value_t = 5000,
          value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub burst_per_identity: u32,
    /// Live registrations one Kubernetes identity may own (SPEC §12); 429 `quota_exceeded`.
    #[arg(long, env = "PRISM_MAX_SESSIONS_PER_IDENTITY", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_sessions_per_identity: u32,
    /// Live registrations per namespace (SPEC §12); 429 `quota_exceeded`.
    #[arg(long, env = "PRISM_MAX_SESSIONS_PER_NAMESPACE", default_value_t = 10_000,
          value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub max_sessions_per_namespace: u32,
    /// PEM certificate chain of the API listener; with --tls-key-file the listener serves
    /// TLS only. Both files are read again when they change (a mounted Secret).
    #[arg(long, env = "PRISM_TLS_CERT_FILE")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of that certificate (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "PRISM_TLS_KEY_FILE")]
    pub tls_key_file: Option<PathBuf>,
    /// Connections the API listener keeps open at once; one more is closed at once (the
    /// client retries, through a Service on another replica).
    #[arg(long, env = "PRISM_MAX_CONNECTIONS", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_connections: u32,
    /// The most of those connections one source address holds (SPEC §12: a share of the
    /// cap, so one address cannot take every slot); default a quarter of the cap. Behind a
    /// proxy that connects from one address, raise it to the cap.
    #[arg(long, env = "PRISM_MAX_CONNECTIONS_PER_ADDRESS",
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_connections_per_address: Option<u32>,
    /// Held requests (SSE watches, MCP GET streams and `subscriptions/listen`, long-poll
    /// claims) one Kubernetes identity, or one Run session, may hold at once on a replica;
    /// 429 `too_many_streams` beyond (SPEC §12).
    #[arg(long, env = "PRISM_MAX_STREAMS_PER_IDENTITY", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_streams_per_identity: u32,
    /// How long one held stream lives before it ends cleanly (its client resumes).
    #[arg(long, env = "PRISM_MAX_STREAM_SECONDS", default_value_t = 3600,
          value_parser = clap::value_parser!(u32).range(10..=86_400))]
    pub max_stream_seconds: u32,
}

/// A setting of the API that cannot be used, named by its variable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SettingsError {
    #[error("{0} is malformed: {1}")]
    Malformed(&'static str, String),
    #[error("{0} is set but {1} is not: set both or neither")]
    Unpaired(&'static str, &'static str),
    #[error("{0}: {1}")]
    Unusable(&'static str, String),
}

/// The API's settings, read and checked.
pub struct ApiSettings {
    /// Where it listens, and how many connections it keeps open at once.
    pub listen: SocketAddr,
    pub max_connections: usize,
    /// One source address's share of them (None: a quarter).
    pub max_connections_per_address: Option<usize>,
    /// The audiences an agent's token must be valid for (at least one).
    pub audiences: Vec<String>,
    /// The rate limits of unauthenticated work (SPEC §12).
    pub limits: Limits,
    /// Live registrations one identity, and one namespace, may own (SPEC §12).
    pub max_sessions_per_identity: u32,
    pub max_sessions_per_namespace: u32,
    /// Hosts `/mcp` may be reached under (DNS-rebinding defence).
    pub allowed_hosts: AllowedHosts,
    /// The configured key signing MCP session ids; None: the one in Postgres.
    pub session_key: Option<SessionKey>,
    /// The listener's certificate and key, read and checked; None: plain HTTP.
    pub tls: Option<CertFiles>,
    /// The held streams' bounds (SPEC §12).
    pub streams: std::sync::Arc<crate::streams::Streams>,
}

impl ApiArgs {
    /// Parses and checks every setting, the TLS files read as the listener will read them.
    pub fn read(&self) -> Result<ApiSettings, SettingsError> {
        let audiences = self.audiences()?;
        let allowed_hosts = AllowedHosts::parse(&self.mcp_allowed_hosts)
            .map_err(|e| SettingsError::Malformed("PRISM_MCP_ALLOWED_HOSTS", e))?;
        let session_key = match self.mcp_session_key.as_deref() {
            None => None,
            Some(value) => Some(SessionKey::from_config(value).ok_or_else(|| {
                SettingsError::Malformed("PRISM_MCP_SESSION_KEY", format!("use at least {MIN_KEY_BYTES} characters"))
            })?),
        };
        let tls = self.tls_files()?;
        if let Some(files) = &tls {
            // Read as the listener will: readable, PEM, a key that fits the certificate.
            files.load().map_err(|e| SettingsError::Unusable(e.variable(), e.to_string()))?;
        }
        Ok(ApiSettings {
            listen: self.listen,
            max_connections: self.max_connections as usize,
            max_connections_per_address: self.max_connections_per_address.map(|n| n as usize),
            audiences,
            limits: self.limits(),
            max_sessions_per_identity: self.max_sessions_per_identity,
            max_sessions_per_namespace: self.max_sessions_per_namespace,
            allowed_hosts,
            session_key,
            tls,
            streams: crate::streams::Streams::new(
                self.max_streams_per_identity as usize,
                std::time::Duration::from_secs(u64::from(self.max_stream_seconds)),
            ),
        })
    }

    /// PRISM_TOKEN_AUDIENCES, without empty entries; at least one.
    fn audiences(&self) -> Result<Vec<String>, SettingsError> {
        let audiences: Vec<String> =
            self.token_audiences.iter().map(|a| a.trim().to_string()).filter(|a| !a.is_empty()).collect();
        if audiences.is_empty() {
            return Err(SettingsError::Malformed("PRISM_TOKEN_AUDIENCES", "name at least one audience".into()));
        }
        if let Some(bad) = audiences.iter().find(|a| a.len() > 256 || a.chars().any(char::is_control)) {
            return Err(SettingsError::Malformed("PRISM_TOKEN_AUDIENCES", format!("{bad:?} is not an audience")));
        }
        Ok(audiences)
    }

    fn limits(&self) -> Limits {
        let rate = |per_second: u32, burst: u32| Rate {
            per_second: NonZeroU32::new(per_second).unwrap_or(NonZeroU32::MIN),
            burst: NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN),
        };
        Limits::new(
            rate(self.unauthenticated_rate, self.unauthenticated_burst),
            rate(self.hello_rate, self.hello_burst),
            rate(self.rate_per_identity, self.burst_per_identity),
        )
    }

    /// The certificate and key files, when TLS is configured: both or neither.
    fn tls_files(&self) -> Result<Option<CertFiles>, SettingsError> {
        let set = |p: &Option<PathBuf>| p.clone().filter(|p| !p.as_os_str().is_empty());
        match (set(&self.tls_cert_file), set(&self.tls_key_file)) {
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => Ok(Some(CertFiles { cert, key })),
            (Some(_), None) => Err(SettingsError::Unpaired("PRISM_TLS_CERT_FILE", "PRISM_TLS_KEY_FILE")),
            (None, Some(_)) => Err(SettingsError::Unpaired("PRISM_TLS_KEY_FILE", "PRISM_TLS_CERT_FILE")),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// The API's flags as `prism-operator run` has them (flattened).
    #[derive(Parser)]
    struct Run {
        #[command(flatten)]
        api: ApiArgs,
    }

    fn parse(args: &[&str]) -> Result<ApiArgs, clap::Error> {
        let argv = std::iter::once("run").chain(args.iter().copied());
        Run::try_parse_from(argv).map(|r| r.api)
    }

    fn run_args(args: &[&str]) -> ApiArgs {
        parse(args).unwrap()
    }

    fn error(a: &ApiArgs) -> String {
        match a.read() {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn defaults_follow_the_spec() {
        let a = run_args(&[]);
        assert_eq!(a.listen.to_string(), "0.0.0.0:8080");
        assert_eq!(a.mcp_allowed_hosts, ["localhost", "127.0.0.1", "::1"]);
        assert!(a.mcp_session_key.is_none());
        assert_eq!((a.hello_rate, a.hello_burst), (1, 10));
        assert_eq!((a.rate_per_identity, a.burst_per_identity), (500, 5000));
        assert_eq!((a.unauthenticated_rate, a.unauthenticated_burst), (20, 100));
        assert_eq!((a.max_sessions_per_identity, a.max_sessions_per_namespace), (100, 10_000));
        let settings = a.read().unwrap();
        assert_eq!(settings.audiences, ["prism-operator"]);
        assert_eq!(settings.max_connections, 4096);
        assert_eq!((a.max_streams_per_identity, settings.streams.lifetime().as_secs()), (16, 3600));
        assert!(settings.tls.is_none() && settings.session_key.is_none());
    }

    #[test]
    fn audiences_are_a_list_of_at_least_one() {
        let mut a = run_args(&[]);
        a.token_audiences = vec!["prism-operator".into(), " https://kubernetes.default.svc ".into()];
        assert_eq!(a.audiences().unwrap(), ["prism-operator", "https://kubernetes.default.svc"]);
        a.token_audiences = vec![" ".into()];
        assert!(error(&a).starts_with("PRISM_TOKEN_AUDIENCES is malformed"));
        let parsed = run_args(&["--token-audiences", "a,b"]);
        assert_eq!(parsed.token_audiences, ["a", "b"]);
    }

    #[test]
    fn mcp_settings_are_checked_at_start() {
        let mut a = run_args(&[]);
        a.mcp_allowed_hosts = vec!["prism.example.com".into(), "svc.ns.svc:8080".into()];
        assert!(a.read().is_ok());
        a.mcp_allowed_hosts = vec!["http://x/".into()];
        assert!(error(&a).starts_with("PRISM_MCP_ALLOWED_HOSTS is malformed"));
        a.mcp_allowed_hosts = vec!["*".into()];
        a.mcp_session_key = Some("too short".into());
        assert!(error(&a).starts_with("PRISM_MCP_SESSION_KEY is malformed"));
        a.mcp_session_key = Some("k".repeat(MIN_KEY_BYTES));
        assert!(a.read().is_ok_and(|s| s.session_key.is_some()));
        let parsed = run_args(&["--mcp-allowed-hosts", "a.example,b.example:80"]);
        assert_eq!(parsed.mcp_allowed_hosts, ["a.example", "b.example:80"]);
    }

    #[test]
    fn tls_is_both_files_or_neither_and_they_are_read_at_start() {
        crate::install_crypto_provider();
        let mut a = run_args(&[]);
        a.tls_cert_file = None;
        a.tls_key_file = None;
        assert_eq!(a.tls_files(), Ok(None));
        assert_eq!(a.max_connections, 4096);
        a.tls_cert_file = Some("/nonexistent/tls.crt".into());
        assert_eq!(error(&a), "PRISM_TLS_CERT_FILE is set but PRISM_TLS_KEY_FILE is not: set both or neither");
        a.tls_key_file = Some("/nonexistent/tls.key".into());
        let e = error(&a);
        assert!(e.starts_with("PRISM_TLS_CERT_FILE: cannot read /nonexistent/tls.crt"), "{e}");
        assert_eq!(e.lines().count(), 1);
        a.tls_cert_file = Some("".into());
        assert_eq!(a.tls_files(), Err(SettingsError::Unpaired("PRISM_TLS_KEY_FILE", "PRISM_TLS_CERT_FILE")));

        let dir = std::env::temp_dir().join(format!("prism-config-tls-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let (_, cert, key) = crate::transport::tls::test_pair("config");
        std::fs::write(dir.join("tls.crt"), cert).unwrap();
        std::fs::write(dir.join("tls.key"), "not a key").unwrap();
        let a = run_args(&[
            "--tls-cert-file",
            dir.join("tls.crt").to_str().unwrap(),
            "--tls-key-file",
            dir.join("tls.key").to_str().unwrap(),
        ]);
        let e = error(&a);
        assert!(e.starts_with("PRISM_TLS_KEY_FILE: ") && e.contains("no PEM private key"), "{e}");
        std::fs::write(dir.join("tls.key"), key).unwrap();
        assert!(a.read().is_ok_and(|s| s.tls.is_some()));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_connection_cap_is_bounded() {
        assert_eq!(run_args(&["--max-connections", "10"]).max_connections, 10);
        assert!(parse(&["--max-connections", "0"]).is_err());
    }
}

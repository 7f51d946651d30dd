//! What `run` reads from its settings for the layers it wires: each value parsed by the
//! type of the layer it configures, here, so that `config` (the flags and their own
//! checks) depends on no layer. Read once at start, before anything connects: a bad
//! value stops the process with one line naming it.

use std::num::NonZeroU32;
use std::path::PathBuf;

use crate::api::limits::{Limits, Rate};
use crate::api::mcp::{AllowedHosts, SessionKey, session::MIN_KEY_BYTES};
use crate::config::{ConfigError, RunArgs};
use crate::transport::CertFiles;

/// The settings of `run` that belong to the API and its listener.
pub struct Settings {
    /// The rate limits of unauthenticated work (SPEC §12).
    pub limits: Limits,
    /// Hosts `/mcp` may be reached under (DNS-rebinding defence).
    pub allowed_hosts: AllowedHosts,
    /// The configured key signing MCP session ids; None: the one in Postgres.
    pub session_key: Option<SessionKey>,
    /// The API listener's certificate and key, read and checked; None: plain HTTP.
    pub tls: Option<CertFiles>,
}

impl Settings {
    /// Checks `args` as `config` does, then parses and checks what the layers own.
    pub fn read(args: &RunArgs) -> Result<Settings, ConfigError> {
        args.validate()?;
        let allowed_hosts = AllowedHosts::parse(&args.mcp_allowed_hosts)
            .map_err(|e| ConfigError::Malformed("PRISM_MCP_ALLOWED_HOSTS", e))?;
        let session_key = match args.mcp_session_key.as_deref() {
            None => None,
            Some(value) => Some(SessionKey::from_config(value).ok_or_else(|| {
                ConfigError::Malformed("PRISM_MCP_SESSION_KEY", format!("use at least {MIN_KEY_BYTES} characters"))
            })?),
        };
        let tls = tls_files(args)?;
        if let Some(files) = &tls {
            // Read as the listener will: readable, PEM, a key that fits the certificate.
            files.load().map_err(|e| ConfigError::Unusable(e.variable(), e.to_string()))?;
        }
        Ok(Settings { limits: limits(args), allowed_hosts, session_key, tls })
    }
}

fn limits(args: &RunArgs) -> Limits {
    let rate = |per_second: u32, burst: u32| Rate {
        per_second: NonZeroU32::new(per_second).unwrap_or(NonZeroU32::MIN),
        burst: NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN),
    };
    Limits::new(rate(args.unauthenticated_rate, args.unauthenticated_burst), rate(args.hello_rate, args.hello_burst))
}

/// The certificate and key files, when TLS is configured: both or neither.
fn tls_files(args: &RunArgs) -> Result<Option<CertFiles>, ConfigError> {
    let set = |p: &Option<PathBuf>| p.clone().filter(|p| !p.as_os_str().is_empty());
    match (set(&args.tls_cert_file), set(&args.tls_key_file)) {
        (None, None) => Ok(None),
        (Some(cert), Some(key)) => Ok(Some(CertFiles { cert, key })),
        (Some(_), None) => Err(ConfigError::Unpaired("PRISM_TLS_CERT_FILE", "PRISM_TLS_KEY_FILE")),
        (None, Some(_)) => Err(ConfigError::Unpaired("PRISM_TLS_KEY_FILE", "PRISM_TLS_CERT_FILE")),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::config::{Cli, Command};

    fn run_args(args: &[&str]) -> RunArgs {
        let mut argv = vec!["prism-operator", "run", "--database-url", "postgres://a@b/c", "--redis-url", "redis://x"];
        argv.extend_from_slice(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Run(r) => *r,
            _ => unreachable!("parsed the run subcommand"),
        }
    }

    fn error(a: &RunArgs) -> String {
        match Settings::read(a) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn mcp_settings_are_checked_at_start() {
        let mut a = run_args(&[]);
        a.mcp_allowed_hosts = vec!["prism.example.com".into(), "svc.ns.svc:8080".into()];
        assert!(Settings::read(&a).is_ok());
        a.mcp_allowed_hosts = vec!["http://x/".into()];
        assert!(error(&a).starts_with("PRISM_MCP_ALLOWED_HOSTS is malformed"));
        a.mcp_allowed_hosts = vec!["*".into()];
        a.mcp_session_key = Some("too short".into());
        assert!(error(&a).starts_with("PRISM_MCP_SESSION_KEY is malformed"));
        a.mcp_session_key = Some("k".repeat(MIN_KEY_BYTES));
        assert!(Settings::read(&a).is_ok_and(|s| s.session_key.is_some()));
        let parsed = run_args(&["--mcp-allowed-hosts", "a.example,b.example:80"]);
        assert_eq!(parsed.mcp_allowed_hosts, ["a.example", "b.example:80"]);
    }

    #[test]
    fn config_errors_come_first() {
        let mut a = run_args(&[]);
        a.redis_prefix = String::new();
        assert!(error(&a).starts_with("PRISM_REDIS_PREFIX is malformed"));
    }

    #[test]
    fn tls_is_both_files_or_neither_and_they_are_read_at_start() {
        crate::install_crypto_provider();
        let mut a = run_args(&[]);
        a.tls_cert_file = None;
        a.tls_key_file = None;
        assert_eq!(tls_files(&a), Ok(None));
        assert_eq!(a.max_connections, 4096);
        a.tls_cert_file = Some("/nonexistent/tls.crt".into());
        assert_eq!(error(&a), "PRISM_TLS_CERT_FILE is set but PRISM_TLS_KEY_FILE is not: set both or neither");
        a.tls_key_file = Some("/nonexistent/tls.key".into());
        let e = error(&a);
        assert!(e.starts_with("PRISM_TLS_CERT_FILE: cannot read /nonexistent/tls.crt"), "{e}");
        assert_eq!(e.lines().count(), 1);
        a.tls_cert_file = Some("".into());
        assert_eq!(tls_files(&a), Err(ConfigError::Unpaired("PRISM_TLS_KEY_FILE", "PRISM_TLS_CERT_FILE")));

        let dir = std::env::temp_dir().join(format!("prism-config-tls-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let (_, cert, key) = prism_api::transport::tls::test_pair("config");
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
        assert!(Settings::read(&a).is_ok_and(|s| s.tls.is_some()));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_connection_cap_is_bounded() {
        assert_eq!(run_args(&["--max-connections", "10"]).max_connections, 10);
        let argv = ["prism-operator", "run", "--max-connections", "0"];
        assert!(Cli::try_parse_from(argv).is_err());
    }
}

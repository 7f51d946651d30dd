//! The `Host`/`Origin` allow-list of `/mcp` (SPEC §9; the MCP transport's defence against
//! DNS rebinding). An entry is a host name or address, optionally with `:port`; without a
//! port it admits any port. `*` admits every host. A request's `Host` must match; its
//! `Origin`, when it has one (a browser), must name an allowed host as well.

use axum::http::{HeaderMap, StatusCode, Uri, header};

use crate::ApiError;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    host: String,
    port: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllowedHosts {
    Any,
    Only(Vec<Entry>),
}

/// Hosts compare without case and without IPv6 brackets.
fn normalize(host: &str) -> String {
    host.trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase()
}

/// `host`, `host:port`, `[v6]:port` or a bare IPv6 address.
fn parse_entry(raw: &str) -> Option<Entry> {
    let raw = raw.trim();
    if raw.is_empty() {
        return None;
    }
    if raw.parse::<std::net::Ipv6Addr>().is_ok() {
        return Some(Entry { host: normalize(raw), port: None });
    }
    let authority: axum::http::uri::Authority = raw.parse().ok()?;
    if authority.as_str().contains('@') {
        return None;
    }
    Some(Entry { host: normalize(authority.host()), port: authority.port_u16() })
}

impl AllowedHosts {
    /// Parses the configured list; the error names the entry that is not a host.
    pub fn parse(entries: &[String]) -> Result<Self, String> {
        if entries.iter().any(|e| e.trim() == "*") {
            return Ok(AllowedHosts::Any);
        }
        let parsed: Result<Vec<Entry>, String> =
            entries.iter().map(|e| parse_entry(e).ok_or_else(|| format!("{e:?} is not a host or host:port"))).collect();
        let parsed = parsed?;
        if parsed.is_empty() {
            return Err("the list is empty (use * to admit any host)".into());
        }
        Ok(AllowedHosts::Only(parsed))
    }

    fn admits(&self, host: &str, port: Option<u16>) -> bool {
        match self {
            AllowedHosts::Any => true,
            AllowedHosts::Only(entries) => {
                let host = normalize(host);
                entries.iter().any(|e| e.host == host && e.port.is_none_or(|p| Some(p) == port))
            }
        }
    }

    /// 403 `host_not_allowed` / `origin_not_allowed` unless the request may reach `/mcp`.
    pub fn check(&self, uri: &Uri, headers: &HeaderMap) -> Result<(), ApiError> {
        if *self == AllowedHosts::Any {
            return Ok(());
        }
        let refuse = |code, what: &str| {
            ApiError::new(
                StatusCode::FORBIDDEN,
                code,
                format!("{what} is not in the MCP allow-list (PRISM_MCP_ALLOWED_HOSTS)"),
            )
        };
        // HTTP/1.1 has Host; HTTP/2 carries it in the URI's authority.
        let host = match headers.get(header::HOST) {
            Some(value) => value.to_str().ok().and_then(|h| h.parse::<axum::http::uri::Authority>().ok()),
            None => uri.authority().cloned(),
        };
        match host {
            Some(a) if self.admits(a.host(), a.port_u16()) => {}
            _ => return Err(refuse("host_not_allowed", "the Host header")),
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = origin.to_str().ok().and_then(|o| o.parse::<Uri>().ok());
            let admitted = origin
                .as_ref()
                .filter(|o| o.scheme().is_some())
                .and_then(Uri::authority)
                .is_some_and(|a| self.admits(a.host(), a.port_u16()));
            if !admitted {
                return Err(refuse("origin_not_allowed", "the Origin header"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn list(entries: &[&str]) -> AllowedHosts {
        AllowedHosts::parse(&entries.iter().map(|s| s.to_string()).collect::<Vec<_>>()).expect("parses")
    }

    fn check(allowed: &AllowedHosts, host: Option<&str>, origin: Option<&str>) -> Result<(), &'static str> {
        let mut headers = HeaderMap::new();
        if let Some(h) = host {
            headers.insert(header::HOST, HeaderValue::from_str(h).expect("header"));
        }
        if let Some(o) = origin {
            headers.insert(header::ORIGIN, HeaderValue::from_str(o).expect("header"));
        }
        allowed.check(&Uri::from_static("/mcp"), &headers).map_err(|e| e.code)
    }

    #[test]
    fn loopback_and_service_names_pass_others_do_not() {
        let allowed = list(&["localhost", "127.0.0.1", "::1", "prism-prism-operator.prism-system.svc:8080"]);
        assert_eq!(check(&allowed, Some("127.0.0.1:8080"), None), Ok(()));
        assert_eq!(check(&allowed, Some("LOCALHOST"), None), Ok(()));
        assert_eq!(check(&allowed, Some("[::1]:9000"), None), Ok(()));
        assert_eq!(check(&allowed, Some("prism-prism-operator.prism-system.svc:8080"), None), Ok(()));
        assert_eq!(check(&allowed, Some("prism-prism-operator.prism-system.svc:9999"), None), Err("host_not_allowed"));
        assert_eq!(check(&allowed, Some("evil.example"), None), Err("host_not_allowed"));
        assert_eq!(check(&allowed, None, None), Err("host_not_allowed"));
    }

    #[test]
    fn a_browser_origin_must_be_allowed_too() {
        let allowed = list(&["localhost"]);
        assert_eq!(check(&allowed, Some("localhost:8080"), Some("http://localhost:3000")), Ok(()));
        assert_eq!(check(&allowed, Some("localhost:8080"), Some("https://evil.example")), Err("origin_not_allowed"));
        assert_eq!(check(&allowed, Some("localhost:8080"), Some("null")), Err("origin_not_allowed"));
    }

    #[test]
    fn star_admits_everything_and_junk_is_refused_at_start() {
        assert_eq!(check(&list(&["*"]), Some("anything:1"), Some("https://x.example")), Ok(()));
        assert!(AllowedHosts::parse(&["http://x/".to_string()]).is_err());
        assert!(AllowedHosts::parse(&["user@host".to_string()]).is_err());
        assert!(AllowedHosts::parse(&[]).is_err());
    }
}

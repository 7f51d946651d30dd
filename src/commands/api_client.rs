//! The CLI's client of the operator's HTTP API (not of Kubernetes): the base URL, the
//! bearer token, the HTTP client trusting a private CA, and the API's refusals as one
//! line (SPEC §6). `jobs` and `selftest` speak through it.

use std::time::Duration;

use anyhow::Context as _;
use reqwest::{StatusCode, Url};
use serde::Deserialize;

use crate::config::ApiClientArgs;
use crate::run_client;

/// How long one API request may take before the CLI gives up (the API's own request
/// timeout is 30 s, SPEC §12).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(35);

/// A refusal of the API, `{"error": {"code", "message"}}` (SPEC §6); shown as
/// `error: <code>: <message>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub status: u16,
    pub code: String,
    pub message: String,
}

/// The API's error answer `body` with HTTP `status`, as one line. An answer that is not the
/// API's (a proxy's HTML page) still gives a code: `http_<status>`.
pub fn api_error(status: StatusCode, body: &[u8]) -> ApiError {
    #[derive(Deserialize)]
    struct Body {
        error: Detail,
    }
    #[derive(Deserialize)]
    struct Detail {
        code: String,
        #[serde(default)]
        message: String,
    }
    match serde_json::from_slice::<Body>(body) {
        Ok(Body { error }) if !error.code.trim().is_empty() => {
            ApiError { status: status.as_u16(), code: one_line(&error.code), message: one_line(&error.message) }
        }
        _ => ApiError {
            status: status.as_u16(),
            code: format!("http_{}", status.as_u16()),
            message: format!(
                "{} (the answer is not the operator API's)",
                status.canonical_reason().unwrap_or("unexpected status")
            ),
        },
    }
}

/// Text from the server as one line of a terminal: control characters (newlines, escape
/// sequences a Run could put in an error) become spaces.
pub(crate) fn one_line(s: &str) -> String {
    s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect::<String>().trim().to_string()
}

/// `--api` with `segments` appended to its path (an API behind a path prefix keeps it).
pub fn api_url(api: &str, segments: &[&str]) -> anyhow::Result<Url> {
    let bad = || format!("--api / PRISM_API {api:?} is not an http:// or https:// URL");
    let mut url = Url::parse(api.trim()).with_context(bad)?;
    anyhow::ensure!(matches!(url.scheme(), "http" | "https") && url.host().is_some(), bad());
    url.set_query(None);
    url.set_fragment(None);
    url.path_segments_mut().map_err(|()| anyhow::anyhow!(bad()))?.pop_if_empty().extend(segments);
    Ok(url)
}

/// The client side of one command: where the API is, the token, the HTTP client.
pub(crate) struct Api {
    pub(crate) base: String,
    token: String,
    pub(crate) http: reqwest::Client,
}

impl Api {
    pub(crate) fn new(args: &ApiClientArgs) -> anyhow::Result<Api> {
        Self::with_token(&args.api, &args.token, args.ca_cert.as_deref())
    }

    /// The API at `api` with `token`, trusting `ca_cert` beside the system's roots.
    pub(crate) fn with_token(api: &str, token: &str, ca_cert: Option<&std::path::Path>) -> anyhow::Result<Api> {
        let token = token.trim();
        anyhow::ensure!(!token.is_empty(), "the token (--token, PRISM_TOKEN) is empty");
        // Never echoed: a bad token is named, not printed.
        anyhow::ensure!(
            token.chars().all(|c| c.is_ascii_graphic()),
            "the token (--token, PRISM_TOKEN) has characters a bearer token cannot have"
        );
        // Checked before anything is sent, so a typo is named as such.
        api_url(api, &[])?;
        let http = run_client::http_client(ca_cert)?;
        Ok(Api { base: api.trim().to_string(), token: token.to_string(), http })
    }

    /// Sends `request` with the token; a refusal is an `ApiError`; the success status and body.
    pub(crate) async fn send(&self, request: reqwest::RequestBuilder) -> anyhow::Result<(StatusCode, Vec<u8>)> {
        let response = request
            .bearer_auth(&self.token)
            .timeout(REQUEST_TIMEOUT)
            .send()
            .await
            .with_context(|| format!("cannot reach the operator's API at {}", self.base))?;
        let status = response.status();
        let body = response.bytes().await.with_context(|| format!("reading the answer of {}", self.base))?.to_vec();
        if !status.is_success() {
            return Err(api_error(status, &body).into());
        }
        Ok((status, body))
    }

    pub(crate) async fn get<T: serde::de::DeserializeOwned>(&self, url: Url, what: &str) -> anyhow::Result<T> {
        let (_, body) = self.send(self.http.get(url)).await?;
        decode(&body, what)
    }
}

/// The API's answer as `T`; a mismatch names the field.
pub(crate) fn decode<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> anyhow::Result<T> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| anyhow::anyhow!("the API's answer is not {what}: {e}"))
}

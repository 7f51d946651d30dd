//! A Run's side of the runtime wire format (SPEC §8): sign a hello with the Run's
//! Ed25519 key, heartbeat the session, claim jobs and report on them. Used by
//! `prism-operator demo-run`, the tests and the benchmark; third-party Runs implement
//! the same few calls in their own language.

use std::collections::BTreeMap;
use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ed25519_dalek::{Signer, SigningKey};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::run_registry::jobs::{Job, JobKind};
use crate::run_registry::proof;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// With its causes: reqwest's own text ("error sending request for url …") does not
    /// say whether the connection was refused, timed out or reset, which a log must.
    #[error("HTTP: {}", causes(.0))]
    Http(#[from] reqwest::Error),
    /// The operator said no: HTTP status, the error code of the body, and when to try
    /// again if it said (`Retry-After`: a rate limit, an unavailable backend).
    #[error("{status} {code}: {message}")]
    Refused { status: u16, code: String, message: String, retry_after: Option<std::time::Duration> },
    #[error("no session: say hello first")]
    NoSession,
    #[error("key file: {0}")]
    Key(String),
}

impl ClientError {
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Refused { code, .. } => Some(code),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct Granted {
    pub session_token: String,
    pub lease_ttl_seconds: u64,
    pub heartbeat_interval_seconds: u64,
}

/// A new Ed25519 key pair: (private key bytes, standard base64 public key).
pub fn new_key() -> Result<(SigningKey, String), ClientError> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| ClientError::Key(e.to_string()))?;
    let key = SigningKey::from_bytes(&seed);
    let public = STANDARD.encode(key.verifying_key().to_bytes());
    Ok((key, public))
}

/// Key files hold the 32-byte seed as standard base64 on one line.
pub fn key_to_file_text(key: &SigningKey) -> String {
    format!("{}\n", STANDARD.encode(key.to_bytes()))
}

pub fn read_key(path: &Path) -> Result<SigningKey, ClientError> {
    let text = std::fs::read_to_string(path).map_err(|e| ClientError::Key(format!("{}: {e}", path.display())))?;
    let seed: [u8; 32] = STANDARD
        .decode(text.trim())
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| ClientError::Key(format!("{}: not a base64 Ed25519 seed", path.display())))?;
    Ok(SigningKey::from_bytes(&seed))
}

/// How long the client keeps an idle connection for reuse. The API closes a connection
/// that has waited 10 s for its next request (its header read timeout covers that wait,
/// SPEC §12), and a Run heartbeats every lease/3 — 10 s with the default lease — so a
/// connection kept longer would be closed by the server just as the next heartbeat takes
/// it, and that heartbeat would fail. Dropped at 5 s, the next call opens a fresh one.
pub const POOL_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// How long one call of a Run may take before it fails (a long-poll claim: this beyond its
/// wait). Without a bound, a call that is never answered (a replica hung mid-answer, a
/// connection lost without a reset) holds the Run forever while its lease runs out. (The
/// fault harness hung once after its load, every task idle: the Runs' calls were the only
/// waits in it that nothing bounded.)
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long opening a connection may take. A replica that has just gone can still be
/// chosen by the Service for a second or two, and a connection to its address is then
/// neither refused nor answered: without this bound the call waits out its
/// [`CALL_TIMEOUT`] (40 s for a long poll), longer than the default 30 s lease, and
/// the Run loses its session over one unlucky connection. Five seconds is far above a
/// connect (and TLS handshake) to a live replica, even a busy one.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

fn client_builder() -> reqwest::ClientBuilder {
    crate::install_crypto_provider();
    reqwest::Client::builder().pool_idle_timeout(POOL_IDLE_TIMEOUT).connect_timeout(CONNECT_TIMEOUT)
}

/// An error with its chain of causes, `: `-separated.
fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        // hyper and reqwest repeat a cause's text in their own at times.
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

/// An HTTP client for the operator's API that also trusts the CA certificates (PEM) in
/// `ca_cert`, for an operator serving TLS with a private CA.
pub fn http_client(ca_cert: Option<&Path>) -> anyhow::Result<reqwest::Client> {
    use anyhow::Context as _;
    let mut builder = client_builder();
    if let Some(path) = ca_cert {
        let what = || format!("CA certificate {} (--ca-cert, PRISM_CA_CERT)", path.display());
        let pem = std::fs::read(path).with_context(what)?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem).with_context(what)?;
        anyhow::ensure!(!certs.is_empty(), "{}: no PEM certificate in it", what());
        builder = builder.tls_certs_merge(certs);
    }
    builder.build().context("cannot build the HTTP client")
}

fn random_nonce() -> String {
    let mut b = [0u8; 18];
    // A failed entropy read still yields a unique-enough nonce from the clock; the
    // operator's replay guard rejects a repeat anyway.
    if getrandom::fill(&mut b).is_err() {
        b[..16].copy_from_slice(
            &std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos()
                .to_le_bytes(),
        );
    }
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

/// A claim's answer (SPEC §6).
#[derive(Clone, Debug, Deserialize)]
pub struct Claimed {
    pub jobs: Vec<Job>,
    /// Jobs held whose cancel was requested: stop each, complete it `cancelled`.
    #[serde(default)]
    pub cancel: Vec<uuid::Uuid>,
}

pub struct RunClient {
    http: reqwest::Client,
    base: String,
    pub server_instance_id: String,
    pub component_kind: String,
    pub generation: i64,
    key: SigningKey,
    pub token: Option<String>,
    pub version: String,
    pub capabilities: Vec<String>,
    pub capacity: BTreeMap<String, i64>,
    /// Sent with each heartbeat when set: whether the Run is draining (SPEC §5.1).
    pub draining: Option<bool>,
    /// Whether steps name the attempt their claim answered (SPEC §12; default true).
    /// Off: steps as a Run written before attempts were named sends them.
    pub name_attempts: bool,
    /// The attempt each job this client claimed is at, until it completes it.
    attempts: std::sync::Mutex<std::collections::HashMap<uuid::Uuid, i32>>,
}

async fn answer<T: serde::de::DeserializeOwned>(r: reqwest::Response) -> Result<T, ClientError> {
    let status = r.status();
    if status.is_success() {
        return Ok(r.json().await?);
    }
    let retry_after = r
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(std::time::Duration::from_secs);
    let body: Value = r.json().await.unwrap_or(Value::Null);
    Err(ClientError::Refused {
        status: status.as_u16(),
        code: body["error"]["code"].as_str().unwrap_or("unknown").to_string(),
        message: body["error"]["message"].as_str().unwrap_or_default().to_string(),
        retry_after,
    })
}

impl RunClient {
    pub fn new(base: &str, server_instance_id: &str, component_kind: &str, generation: i64, key: SigningKey) -> Self {
        Self {
            // Building fails only where reqwest::Client::new() would panic (no TLS backend).
            http: client_builder().build().unwrap_or_else(|_| reqwest::Client::new()),
            base: base.trim_end_matches('/').to_string(),
            server_instance_id: server_instance_id.into(),
            component_kind: component_kind.into(),
            generation,
            key,
            token: None,
            version: env!("CARGO_PKG_VERSION").into(),
            // Every job kind: a Run that advertises fewer is handed only those (SPEC §5.1).
            capabilities: JobKind::ALL.iter().map(|k| k.to_string()).collect(),
            capacity: [("slots".to_string(), 4)].into(),
            draining: None,
            name_attempts: true,
            attempts: Default::default(),
        }
    }

    /// Sends through `http` (and its connection pool) instead of a client of its own:
    /// thousands of simulated Runs in one process (the scale bench) share one.
    pub fn with_http(mut self, http: reqwest::Client) -> Self {
        self.http = http;
        self
    }

    /// Points the client at another operator replica (same session).
    pub fn set_base(&mut self, base: &str) {
        self.base = base.trim_end_matches('/').to_string();
    }

    /// The signed hello body for `timestamp` and `nonce` (SPEC §8).
    pub fn hello_body(&self, timestamp: i64, nonce: &str) -> Value {
        let message =
            proof::hello_message(&self.server_instance_id, &self.component_kind, self.generation, timestamp, nonce);
        let signature = STANDARD.encode(self.key.sign(message.as_bytes()).to_bytes());
        json!({
            "server_instance_id": self.server_instance_id,
            "component_kind": self.component_kind,
            "key_generation": self.generation,
            "timestamp": timestamp,
            "nonce": nonce,
            "signature": signature,
            "version": self.version,
            "target": {"os": std::env::consts::OS, "arch": if std::env::consts::ARCH == "x86_64" { "amd64" } else { std::env::consts::ARCH }},
            "capabilities": self.capabilities,
            "capacity": self.capacity,
        })
    }

    pub async fn post_hello(&self, body: &Value) -> Result<Granted, ClientError> {
        let hello = self.http.post(format!("{}/api/v1/runtime/hello", self.base)).json(body).timeout(CALL_TIMEOUT);
        answer(hello.send().await?).await
    }

    /// Proves possession of the key and keeps the session token.
    pub async fn hello(&mut self) -> Result<Granted, ClientError> {
        let now = chrono::Utc::now().timestamp();
        let granted = self.post_hello(&self.hello_body(now, &random_nonce())).await?;
        self.token = Some(granted.session_token.clone());
        Ok(granted)
    }

    /// `hello`, waiting out what the operator asks to wait (`Retry-After` on a 429 or a
    /// 503) and trying again, for at most `patience` in all; a refusal without
    /// `Retry-After` (a failed proof) is answered at once. A Run that gave up at its first
    /// 429 could be kept offline by anybody able to make its operator busy.
    pub async fn hello_patiently(&mut self, patience: std::time::Duration) -> Result<Granted, ClientError> {
        let until = tokio::time::Instant::now() + patience;
        loop {
            match self.hello().await {
                Err(ClientError::Refused { retry_after: Some(wait), ref code, .. })
                    if tokio::time::Instant::now() + wait <= until =>
                {
                    tracing::warn!(%code, wait_seconds = wait.as_secs(), "hello refused for now; trying again after Retry-After");
                    tokio::time::sleep(wait.min(std::time::Duration::from_secs(60))).await;
                }
                answer => return answer,
            }
        }
    }

    fn token(&self) -> Result<&str, ClientError> {
        self.token.as_deref().ok_or(ClientError::NoSession)
    }

    /// The session token of the last hello, for calls this client does not make itself.
    pub fn session_token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    pub async fn heartbeat(&self) -> Result<Value, ClientError> {
        let mut body = json!({"capabilities": self.capabilities, "capacity": self.capacity});
        if let Some(draining) = self.draining {
            body["draining"] = json!(draining);
        }
        let r = self
            .http
            .post(format!("{}/api/v1/runtime/heartbeat", self.base))
            .bearer_auth(self.token()?)
            .json(&body)
            .timeout(CALL_TIMEOUT)
            .send()
            .await?;
        answer(r).await
    }

    pub async fn claim(&self, max: i64) -> Result<Vec<Job>, ClientError> {
        Ok(self.claim_and_cancels(max).await?.jobs)
    }

    /// A claim's whole answer: the jobs claimed, and the held jobs to stop.
    pub async fn claim_and_cancels(&self, max: i64) -> Result<Claimed, ClientError> {
        self.claim_waiting(max, 0).await
    }

    /// A long-poll claim (SPEC §11): answered at once when a job is claimable or a cancel
    /// is pending, else when one comes, or empty after `wait_seconds` (0 to 60).
    pub async fn claim_waiting(&self, max: i64, wait_seconds: u64) -> Result<Claimed, ClientError> {
        let body =
            if wait_seconds == 0 { json!({"max": max}) } else { json!({"max": max, "wait_seconds": wait_seconds}) };
        let r = self
            .http
            .post(format!("{}/api/v1/runtime/jobs/claim", self.base))
            .bearer_auth(self.token()?)
            .json(&body)
            .timeout(CALL_TIMEOUT + std::time::Duration::from_secs(wait_seconds))
            .send()
            .await?;
        let claimed: Claimed = answer(r).await?;
        if let Ok(mut attempts) = self.attempts.lock() {
            for job in &claimed.jobs {
                if let Some(n) = job.attempt {
                    attempts.insert(job.id, n);
                }
            }
        }
        Ok(claimed)
    }

    /// The attempt this client claimed `job` at, if it still holds it.
    pub fn attempt_of(&self, job: &uuid::Uuid) -> Option<i32> {
        self.attempts.lock().ok().and_then(|a| a.get(job).copied())
    }

    /// `action` is `ack`, `progress` or `complete`. The body names the attempt this client
    /// claimed the job at (unless it names one itself, or `name_attempts` is off).
    pub async fn step(&self, job: &uuid::Uuid, action: &str, body: Option<Value>) -> Result<Job, ClientError> {
        let body = match (self.name_attempts.then(|| self.attempt_of(job)).flatten(), body) {
            (Some(n), None) => Some(json!({"attempt": n})),
            (Some(n), Some(Value::Object(mut b))) => {
                b.entry("attempt").or_insert(json!(n));
                Some(Value::Object(b))
            }
            (_, body) => body,
        };
        let named =
            body.as_ref().and_then(|b| b.get("attempt")).and_then(Value::as_i64).and_then(|n| i32::try_from(n).ok());
        let mut req = self
            .http
            .post(format!("{}/api/v1/runtime/jobs/{job}/{action}", self.base))
            .bearer_auth(self.token()?)
            .timeout(CALL_TIMEOUT);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let done = answer(req.send().await?).await;
        // Completed, or refused as over (finished, another attempt): nothing more to name,
        // unless the step named another attempt than the one this client holds.
        let over = match &done {
            Ok(_) => action == "complete",
            Err(e) => {
                matches!(e.code(), Some("job_finished" | "stale_attempt" | "deadline_exceeded" | "job_not_found"))
            }
        };
        if over && let Ok(mut attempts) = self.attempts.lock() {
            let held = attempts.get(job).copied();
            if named.is_none() || named == held {
                attempts.remove(job);
            }
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener whose accept queue is full drops new connections' SYNs: the connect is
    /// neither refused nor answered, as with a replica the Service still names after it
    /// went. Real sockets; no mock.
    #[tokio::test]
    async fn a_connection_nobody_answers_fails_at_the_connect_timeout_and_says_so() {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(1).unwrap();
        let addr = listener.local_addr().unwrap();
        // Never accepted: these fill the queue (Linux takes backlog + 1).
        let mut held = Vec::new();
        for _ in 0..4 {
            if let Ok(Ok(s)) =
                tokio::time::timeout(std::time::Duration::from_millis(300), tokio::net::TcpStream::connect(addr)).await
            {
                held.push(s);
            }
        }
        let http = http_client(None).unwrap();
        let started = std::time::Instant::now();
        let sent = http.get(format!("http://{addr}/healthz")).timeout(CALL_TIMEOUT).send().await;
        let took = started.elapsed();
        let err = ClientError::from(sent.expect_err("nobody answers"));
        assert!(
            took < CONNECT_TIMEOUT + std::time::Duration::from_secs(3),
            "failed after {took:?}, not at the connect timeout"
        );
        assert!(took >= CONNECT_TIMEOUT - std::time::Duration::from_millis(500), "failed early ({took:?}): {err}");
        assert!(err.to_string().contains("tcp connect error: deadline has elapsed"), "the log says why: {err}");
        drop(held);
    }
}

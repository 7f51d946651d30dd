//! The API listener as a client meets it (SPEC §12 "Transport" and the server limits of
//! "Bounded"), against the operator binary with real Postgres, Redis and kube-apiserver:
//! TLS only when a certificate is configured, the certificate reloaded when its files
//! change the way a mounted Secret's do, slow clients cut while others are served,
//! one-line errors for a bad pair, and SIGTERM still ending the process cleanly.

use prism_testkit as support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::{CertificateDer, ServerName};
use support::{Operator, TestDb, control_plane};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A CA of the test's own, and server certificates it signs for 127.0.0.1 and localhost.
struct Pki {
    ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

struct Leaf {
    cert_pem: String,
    key_pem: String,
    der: Vec<u8>,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, format!("{name} test CA"));
        let key = rcgen::KeyPair::generate().expect("CA key");
        Pki { ca: rcgen::CertifiedIssuer::self_signed(params, key).expect("CA") }
    }

    fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    fn leaf(&self, serial: u64) -> Leaf {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.subject_alt_names = vec![
            rcgen::SanType::DnsName("localhost".try_into().expect("dns name")),
            rcgen::SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        ];
        params.serial_number = Some(rcgen::SerialNumber::from(serial));
        params.distinguished_name.push(rcgen::DnType::CommonName, format!("prism-operator serial {serial}"));
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca).expect("sign");
        Leaf { cert_pem: cert.pem(), key_pem: key.serialize_pem(), der: cert.der().to_vec() }
    }
}

/// A directory laid out as the kubelet mounts a Secret: `tls.crt -> ..data/tls.crt`,
/// `..data -> ..<version>`; an update writes a new version and renames `..data` over.
struct SecretDir {
    dir: PathBuf,
    versions: u32,
}

impl SecretDir {
    fn new() -> SecretDir {
        let dir = std::env::temp_dir().join(format!("prism-transport-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        SecretDir { dir, versions: 0 }
    }

    fn cert(&self) -> PathBuf {
        self.dir.join("tls.crt")
    }

    fn key(&self) -> PathBuf {
        self.dir.join("tls.key")
    }

    fn put(&mut self, cert_pem: &str, key_pem: &str) {
        self.versions += 1;
        let version = format!("..v{}", self.versions);
        let data = self.dir.join(&version);
        std::fs::create_dir_all(&data).expect("version dir");
        std::fs::write(data.join("tls.crt"), cert_pem).expect("write cert");
        std::fs::write(data.join("tls.key"), key_pem).expect("write key");
        let tmp = self.dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&version, &tmp).expect("symlink");
        std::fs::rename(&tmp, self.dir.join("..data")).expect("swap ..data");
        for name in ["tls.crt", "tls.key"] {
            if std::fs::symlink_metadata(self.dir.join(name)).is_err() {
                std::os::unix::fs::symlink(format!("..data/{name}"), self.dir.join(name)).expect("symlink");
            }
        }
    }
}

impl Drop for SecretDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A CA, a certificate it signed (`serial`), and a Secret-style directory serving it.
fn serving(name: &str, serial: u64) -> (Pki, Leaf, SecretDir) {
    let pki = Pki::new(name);
    let leaf = pki.leaf(serial);
    let mut secret = SecretDir::new();
    secret.put(&leaf.cert_pem, &leaf.key_pem);
    (pki, leaf, secret)
}

/// An operator serving TLS from `secret`, watching a namespace of its own.
struct TlsOperator {
    op: Operator,
    db: TestDb,
    ns: String,
    client: kube::Client,
}

async fn start_tls_operator(secret: &SecretDir, hint: &str) -> TlsOperator {
    let cp = control_plane().await;
    let client = cp.client().await;
    let ns = support::namespace(&client, hint).await;
    let db = TestDb::new().await;
    let cert = secret.cert().to_string_lossy().into_owned();
    let key = secret.key().to_string_lossy().into_owned();
    let op = Operator::start(cp, &db.url, &ns, &[("PRISM_TLS_CERT_FILE", &cert), ("PRISM_TLS_KEY_FILE", &key)]).await;
    TlsOperator { op, db, ns, client }
}

async fn tls_operator(secret: &SecretDir, hint: &str) -> (Operator, TestDb) {
    let t = start_tls_operator(secret, hint).await;
    (t.op, t.db)
}

fn addr_of(op: &Operator) -> SocketAddr {
    let hostport = op.base.strip_prefix("https://").expect("the operator serves https");
    hostport.parse().expect("host:port")
}

/// A client that trusts the test CA only.
fn https_client(ca_pem: &str) -> reqwest::Client {
    prism_operator::install_crypto_provider();
    let ca = reqwest::Certificate::from_pem(ca_pem.as_bytes()).expect("CA PEM");
    reqwest::Client::builder().tls_certs_only([ca]).build().expect("client")
}

fn connector(ca_pem: &str) -> tokio_rustls::TlsConnector {
    use rustls::pki_types::pem::PemObject as _;
    prism_operator::install_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("CA PEM")).expect("CA");
    let config = rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// A fresh TLS connection (as a client that checks the certificate) and the certificate
/// the server presented on it.
async fn connect(addr: SocketAddr, ca_pem: &str) -> (TlsStream<TcpStream>, Vec<u8>) {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::IpAddress(Ipv4Addr::LOCALHOST.into());
    let conn = connector(ca_pem).connect(name, tcp).await.expect("TLS handshake with the test CA");
    let leaf = conn.get_ref().1.peer_certificates().and_then(|c| c.first()).expect("a certificate").to_vec();
    (conn, leaf)
}

/// One request on a kept-alive HTTP/1.1 connection; the status and body of the answer.
async fn get<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(conn: &mut S, path: &str) -> (u16, String) {
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    conn.write_all(request.as_bytes()).await.expect("write request");
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = conn.read(&mut chunk).await.expect("read answer");
        assert!(n > 0, "connection closed before an answer: {:?}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("status");
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("content-length");
    while buf.len() < head_end + length {
        let n = conn.read(&mut chunk).await.expect("read body");
        assert!(n > 0, "connection closed mid-body");
        buf.extend_from_slice(&chunk[..n]);
    }
    (status, String::from_utf8_lossy(&buf[head_end..head_end + length]).into_owned())
}

async fn wait_for_log(op: &Operator, needle: &str, secs: u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !op.logs().contains(needle) {
        assert!(Instant::now() < deadline, "no {needle:?} in the log within {secs} s:\n{}", op.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn https_only_with_the_ca_and_the_certificate_reloaded_when_the_secret_changes() {
    let (pki, first, mut secret) = serving("reload", 1001);
    let ca = pki.ca_pem();
    let second = pki.leaf(1002);
    let (op, _db) = tls_operator(&secret, "tls").await;
    let addr = addr_of(&op);

    // HTTPS with the CA: health and the API answer.
    let https = https_client(&ca);
    let r = https.get(op.url("/healthz")).send().await.expect("https /healthz with the CA");
    assert_eq!(r.status(), 200);
    let r = https.get(op.url("/api/v1/controller/P/status?namespace=x")).send().await.expect("https API");
    assert_eq!(r.status(), 401, "the API behind TLS answers as before (no token)");

    // Without the CA (the system's roots only) the certificate is not trusted; plain
    // HTTP gets no HTTP answer.
    prism_operator::install_crypto_provider();
    let untrusting = reqwest::Client::builder().build().expect("client");
    assert!(untrusting.get(op.url("/healthz")).send().await.is_err(), "a client without the CA must refuse");
    let plain = support::http().get(format!("http://{addr}/healthz")).send().await;
    assert!(plain.is_err(), "plain HTTP to the TLS port must fail, got {plain:?}");
    let mut raw = TcpStream::connect(addr).await.expect("connect");
    raw.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("write");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(15), raw.read_to_end(&mut answer)).await;
    assert!(!String::from_utf8_lossy(&answer).contains("HTTP/1.1 200"), "{answer:?}");

    // A connection opened before the change.
    let (mut old, served) = connect(addr, &ca).await;
    assert_eq!(served, first.der, "the configured certificate is served");
    assert_eq!(get(&mut old, "/healthz").await.0, 200);

    // The Secret changes: a fresh connection soon gets the new certificate, and the old
    // connection carries on (its requests keep being answered, over its first handshake).
    secret.put(&second.cert_pem, &second.key_pem);
    let changed_at = Instant::now();
    loop {
        let (_, served) = connect(addr, &ca).await;
        if served == second.der {
            break;
        }
        assert_eq!(served, first.der, "either certificate, nothing else");
        assert!(changed_at.elapsed() < Duration::from_secs(20), "the new certificate not served within 20 s");
        assert_eq!(get(&mut old, "/healthz").await.0, 200, "the old connection keeps answering");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("new certificate served {:?} after the files changed", changed_at.elapsed());
    assert_eq!(get(&mut old, "/healthz").await.0, 200, "the old connection still answers after the reload");
    assert_eq!(old.get_ref().1.peer_certificates().expect("certs")[0].as_ref(), first.der.as_slice());
    wait_for_log(&op, "TLS certificate reloaded", 5).await;
    let r = https.get(op.url("/healthz")).send().await.expect("https after the reload");
    assert_eq!(r.status(), 200);

    // A bad pair (a new certificate with the old key): logged, and the last good pair
    // stays in service.
    let third = pki.leaf(1003);
    secret.put(&third.cert_pem, &second.key_pem);
    wait_for_log(&op, "cannot be served; still serving the previous certificate", 20).await;
    let (_, served) = connect(addr, &ca).await;
    assert_eq!(served, second.der, "the previous certificate is still served");
    // The key never reaches the log.
    let key_line = second.key_pem.lines().nth(1).expect("key body");
    assert!(!op.logs().contains(key_line));
}

#[tokio::test]
async fn slow_clients_are_cut_while_others_are_served() {
    let (pki, _leaf, secret) = serving("limits", 7);
    let ca = pki.ca_pem();
    let (op, _db) = tls_operator(&secret, "limits").await;
    let addr = addr_of(&op);

    // Slowloris: the request line and one header, never the blank line, on 20
    // connections at once.
    let started = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..20 {
        let ca = ca.clone();
        slow.push(tokio::spawn(async move {
            let (mut conn, _) = connect(addr, &ca).await;
            conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.expect("write");
            let mut rest = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(30), conn.read_to_end(&mut rest)).await;
            (started.elapsed(), String::from_utf8_lossy(&rest).into_owned())
        }));
    }
    // A body trickled in: 200 bytes promised, one sent every 2 s.
    let trickle = {
        let ca = ca.clone();
        tokio::spawn(async move {
            let (conn, _) = connect(addr, &ca).await;
            let (mut reader, mut writer) = tokio::io::split(conn);
            let head = "POST /api/v1/runtime/hello HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{";
            writer.write_all(head.as_bytes()).await.expect("write");
            let sent = Instant::now();
            let dripping = tokio::spawn(async move {
                for _ in 0..30 {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    if writer.write_all(b" ").await.is_err() {
                        return;
                    }
                }
            });
            let mut answer = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(60), reader.read_to_end(&mut answer)).await;
            dripping.abort();
            (sent.elapsed(), String::from_utf8_lossy(&answer).into_owned())
        })
    };

    // Meanwhile /healthz keeps answering, on fresh connections.
    let https = https_client(&ca);
    while started.elapsed() < Duration::from_secs(12) {
        let t = Instant::now();
        let r = https.get(op.url("/healthz")).send().await.expect("healthz while slow clients hold connections");
        assert_eq!(r.status(), 200);
        assert!(t.elapsed() < Duration::from_secs(2), "healthz took {:?}", t.elapsed());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for handle in slow {
        let (took, answer) = handle.await.expect("slow client");
        assert!(
            took >= Duration::from_secs(9) && took < Duration::from_secs(16),
            "a slow-header connection should be closed after about 10 s, took {took:?}"
        );
        assert!(!answer.contains("200 OK"), "{answer}");
    }
    let (took, answer) = trickle.await.expect("trickle");
    assert!(took >= Duration::from_secs(29) && took < Duration::from_secs(40), "cut after about 30 s: {took:?}");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(answer.contains(r#"{"error":{"code":"request_timeout","message":"#), "{answer}");
    let r = https.get(op.url("/healthz")).send().await.expect("healthz afterwards");
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn sigterm_ends_a_tls_operator_with_a_connection_open() {
    let (pki, _leaf, secret) = serving("term", 9);
    let (mut op, _db) = tls_operator(&secret, "term").await;
    let (mut conn, _) = connect(addr_of(&op), &pki.ca_pem()).await;
    assert_eq!(get(&mut conn, "/healthz").await.0, 200);
    let killed = Command::new("kill").args(["-TERM", &op.pid().to_string()]).status().expect("kill");
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = op.exited() {
            break status;
        }
        assert!(Instant::now() < deadline, "still running 10 s after SIGTERM:\n{}", op.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(status.success(), "{status}:\n{}", op.logs());
    assert!(op.logs().contains("stopped"), "{}", op.logs());
}

/// `prism-operator run` with the given TLS settings; its one line on stderr.
fn start_error(env: &[(&str, &Path)]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_prism-operator"))
        .arg("run")
        .env("DATABASE_URL", "postgres://u:pw@127.0.0.1:1/db")
        .env("REDIS_URL", "redis://127.0.0.1:1")
        .env_remove("PRISM_TLS_CERT_FILE")
        .env_remove("PRISM_TLS_KEY_FILE")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr).trim_end().to_string();
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr:?}");
    stderr
}

#[test]
fn a_bad_tls_setting_stops_the_start_with_one_line() {
    let pki = Pki::new("errors");
    let leaf = pki.leaf(1);
    let other = pki.leaf(2);
    let mut secret = SecretDir::new();
    secret.put(&leaf.cert_pem, &other.key_pem);
    let (cert, key) = (secret.cert(), secret.key());
    let missing = secret.dir.join("missing.crt");

    let e = start_error(&[("PRISM_TLS_CERT_FILE", &cert)]);
    assert_eq!(e, "error: PRISM_TLS_CERT_FILE is set but PRISM_TLS_KEY_FILE is not: set both or neither");
    let e = start_error(&[("PRISM_TLS_KEY_FILE", &key)]);
    assert_eq!(e, "error: PRISM_TLS_KEY_FILE is set but PRISM_TLS_CERT_FILE is not: set both or neither");
    let e = start_error(&[("PRISM_TLS_CERT_FILE", &missing), ("PRISM_TLS_KEY_FILE", &key)]);
    assert!(e.starts_with("error: PRISM_TLS_CERT_FILE: cannot read ") && e.contains("missing.crt"), "{e}");
    let e = start_error(&[("PRISM_TLS_CERT_FILE", &key), ("PRISM_TLS_KEY_FILE", &key)]);
    assert!(e.starts_with("error: PRISM_TLS_CERT_FILE: ") && e.contains("no PEM certificate"), "{e}");
    let e = start_error(&[("PRISM_TLS_CERT_FILE", &cert), ("PRISM_TLS_KEY_FILE", &key)]);
    assert!(e.starts_with("error: PRISM_TLS_KEY_FILE: the key in") && e.contains("does not fit"), "{e}");
    let key_line = other.key_pem.lines().nth(1).expect("key body");
    assert!(!e.contains(key_line), "no key material in the error");
}

/// The API closes a connection idle for 10 s (hyper's header read timeout also bounds the
/// wait for the next request), which is also the heartbeat interval a Run is told with the
/// default lease: the bundled Run client must not reuse a connection the server is closing
/// (before it dropped idle connections early, about one heartbeat in 25 failed so).
#[tokio::test]
async fn runs_heartbeating_at_the_advertised_interval_meet_no_closed_connection() {
    use prism_operator::run_client::{self, RunClient};
    let (pki, _leaf, secret) = serving("idle", 11);
    let ca_path = secret.dir.join("ca.crt");
    std::fs::write(&ca_path, pki.ca_pem()).expect("write CA");
    let t = start_tls_operator(&secret, "idle").await;
    let api: kube::Api<prism_operator::crd::RunSession> = kube::Api::namespaced(t.client.clone(), &t.ns);
    let mut tasks = Vec::new();
    for i in 0..3 {
        let server = format!("srv-idle-{i}");
        let key = support::create_run_session(&api, &format!("idle-{i}"), &server, None).await;
        // As demo-run builds it (--ca-cert).
        let http = run_client::http_client(Some(&ca_path)).expect("client");
        let mut run = RunClient::new(&t.op.base, &server, "run", 1, key).with_http(http);
        tasks.push(tokio::spawn(async move {
            // The first hello may come before the reconciler mirrored the identity.
            let mut granted = None;
            for _ in 0..40 {
                match run.hello().await {
                    Ok(g) => {
                        granted = Some(g);
                        break;
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
                }
            }
            let granted = granted.expect("hello within 20 s");
            assert_eq!(granted.heartbeat_interval_seconds, 8, "the default lease's interval");
            let mut failed = Vec::new();
            for _ in 0..5 {
                tokio::time::sleep(Duration::from_secs(granted.heartbeat_interval_seconds)).await;
                if let Err(e) = run.heartbeat().await {
                    failed.push(e.to_string());
                }
                if let Err(e) = run.claim(10).await {
                    failed.push(e.to_string());
                }
            }
            failed
        }));
    }
    for task in tasks {
        let failed = task.await.expect("run");
        assert!(failed.is_empty(), "calls failed at the advertised interval: {failed:?}");
    }
}

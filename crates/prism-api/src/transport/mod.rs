//! The API listener (SPEC §12 "Transport" and the server limits of "Bounded"): HTTP/1.1
//! over TCP, or over TLS only when a certificate is configured, with
//!
//! * a header read timeout (10 s): a client that opens a connection and sends its
//!   request line and headers slowly, or nothing at all, is disconnected. hyper's timer
//!   also covers the wait for the next request on a kept-alive connection, so an idle
//!   connection is closed after the same 10 s;
//! * a TLS handshake timeout (10 s);
//! * a request timeout (30 s, [`timeout`]): 408 `request_timeout`;
//! * a cap on open connections ([`cap`], `PRISM_MAX_CONNECTIONS`): one more is closed
//!   at once;
//! * a fixed kernel send buffer per connection ([`Limits::send_buffer`]): what a peer
//!   that does not read can make the kernel hold for it is bounded, and a held stream
//!   sees such a reader fall behind after a table or two, not after megabytes;
//! * while the replica stops, every answer closes its connection ([`closing`]); then a
//!   graceful shutdown: the listener closes, idle connections close, requests in flight
//!   get [`Limits::shutdown_grace`] to finish.
//!
//! HTTP/2 is not offered (ALPN `http/1.1`, no prior-knowledge h2): hyper's HTTP/2
//! server has no header read timeout, so the slow-client bound would not hold there,
//! and every client of the API (HTTP libraries, MCP SDKs, the Run client) speaks
//! HTTP/1.1.
//!
//! axum-server runs hyper with a timer (axum::serve has none, so hyper's timeouts never
//! fire there) and swaps the rustls configuration without a restart ([`tls`]).

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum_server::Handle;
use axum_server::accept::DefaultAcceptor;
use axum_server::tls_rustls::RustlsAcceptor;
use tokio::net::TcpListener;
use tracing::{debug, info};

pub mod cap;
pub mod closing;
pub mod drain;
pub mod timeout;
pub mod tls;

pub use tls::CertFiles;

/// The server limits; [`Limits::spec`] gives SPEC §12's.
#[derive(Clone, Debug)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub tls_handshake_timeout: Duration,
    pub request_timeout: Duration,
    pub max_connections: usize,
    /// The most of them one source address holds.
    pub max_connections_per_address: usize,
    /// How long requests in flight may take to finish after shutdown begins (the
    /// kubelet's default grace before SIGKILL is 30 s).
    pub shutdown_grace: Duration,
    /// Counts reloaded certificates refused (`prism_tls_reloads_refused_total`).
    pub tls_refusals: prometheus_client::metrics::counter::Counter,
    /// SO_SNDBUF of each connection (set on the listener; its connections inherit it).
    /// Left to itself Linux grows the buffer of a connection whose peer does not read up
    /// to `net.ipv4.tcp_wmem`'s maximum (4 MiB by default): a stalled watch then took 4 MiB
    /// of events into the kernel before its one-event outbox saw it fall behind (SPEC
    /// §12), and the operator wrote each of them (the abuse bench: 1,000 such watches,
    /// 20 changes a second, most of them never reset in 10 s). The kernel doubles the
    /// value; 256 KiB in flight still carries 2.5 MB/s to a client 100 ms away.
    pub send_buffer: usize,
}

/// [`Limits::send_buffer`] of SPEC §12's limits.
pub const SEND_BUFFER: usize = 128 * 1024;

impl Limits {
    /// SPEC §12's limits; one address's share of the connections, a quarter by default.
    pub fn spec(max_connections: usize, per_address: Option<usize>) -> Limits {
        Limits {
            max_connections_per_address: per_address.unwrap_or(max_connections.div_ceil(4)),
            header_read_timeout: Duration::from_secs(10),
            tls_handshake_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connections,
            shutdown_grace: Duration::from_secs(20),
            tls_refusals: Default::default(),
            send_buffer: SEND_BUFFER,
        }
    }
}

/// What is said at start about a listener without TLS (None: nothing to say).
pub fn plain_http_warning(listen: SocketAddr, tls: bool) -> Option<String> {
    (!tls && !listen.ip().is_loopback()).then(|| {
        format!(
            "the API on {listen} is plain HTTP on a non-loopback address: bearer tokens and session tokens cross the network in clear text; set PRISM_TLS_CERT_FILE and PRISM_TLS_KEY_FILE (chart: tls.enabled)"
        )
    })
}

/// The API's listener on `addr`, its connections' kernel send buffer bounded
/// ([`Limits::send_buffer`]): set before `listen`, so that every connection inherits it,
/// even one the kernel accepts before the server first asks for it.
pub fn listen(addr: SocketAddr, limits: &Limits) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    // As TcpListener::bind does: a restarted replica binds while old connections linger.
    socket.set_reuseaddr(true)?;
    socket.set_send_buffer_size(u32::try_from(limits.send_buffer).unwrap_or(u32::MAX))?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Serves `app` on `listener` (from [`listen`]), closing each connection after its answer once `closing`
/// is true, until `shutdown` completes, then drains connections. With `tls`, the pair is
/// read now (an error is returned if it cannot be served) and watched for changes while
/// serving.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<&CertFiles>,
    limits: &Limits,
    closing: tokio::sync::watch::Receiver<bool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // The drain outside the timeout: a handler cut at 30 s leaves a body that is not read on.
    let app = drain::apply(timeout::RequestTimeout::new(limits.request_timeout).apply(app));
    let app = closing::apply(app, closing);
    let make_service = app.into_make_service_with_connect_info::<SocketAddr>();
    let handle: Handle<SocketAddr> = Handle::new();
    let grace = limits.shutdown_grace;
    let on_shutdown = handle.clone();
    tokio::spawn(async move {
        shutdown.await;
        on_shutdown.graceful_shutdown(Some(grace));
    });
    let mut server = axum_server::Server::from_listener(listener).handle(handle).http1_only();
    // A connection whose reader stalls keeps at most this much in hyper's own buffer (and
    // the streams' one waiting event, SPEC §12): hyper's default (~400 KiB) let 1,000
    // stalled watches of a busy project pull 400 KiB each out of their one-event outboxes
    // (the abuse bench: +476 MiB). A request's head must fit in it too (64 KiB is ample).
    server.http_builder().http1().header_read_timeout(Some(limits.header_read_timeout)).max_buf_size(64 * 1024);
    // TLS handshakes that fail, connections over the cap: the peer's business, not an
    // operator error (the cap warns by itself).
    let server = server.accept_error_handler(|peer: Option<&SocketAddr>, error: &std::io::Error| {
        debug!(peer = ?peer, %error, "connection not accepted");
    });
    let capped =
        cap::ConnectionCap::new(DefaultAcceptor::new(), limits.max_connections, limits.max_connections_per_address);
    match tls {
        None => server.acceptor(capped).serve(make_service).await.context("serving HTTP"),
        Some(files) => {
            let loaded = files.load().map_err(|e| anyhow::anyhow!("{}: {e}", e.variable()))?;
            info!(cert = %files.cert.display(), sha256 = %loaded.fingerprint, "API serves TLS only");
            let (reloader, config) = tls::Reloader::new(files.clone(), loaded, limits.tls_refusals.clone());
            let watch = tokio::spawn(reloader.run(tls::RELOAD_CHECK_EVERY));
            let acceptor = RustlsAcceptor::new(config).handshake_timeout(limits.tls_handshake_timeout).acceptor(capped);
            let served = server.acceptor(acceptor).serve(make_service).await.context("serving HTTPS");
            watch.abort();
            served
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::sync::oneshot;

    use super::*;

    fn limits() -> Limits {
        Limits {
            header_read_timeout: Duration::from_millis(600),
            tls_handshake_timeout: Duration::from_millis(600),
            request_timeout: Duration::from_millis(800),
            max_connections: 2,
            max_connections_per_address: 2,
            shutdown_grace: Duration::from_secs(5),
            tls_refusals: Default::default(),
            send_buffer: SEND_BUFFER,
        }
    }

    fn app() -> Router {
        Router::new()
            .route("/fast", get(|| async { "fast" }))
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    "slow"
                }),
            )
            .route("/echo", post(|body: String| async move { body }))
            .route("/refuse", post(|| async { axum::http::StatusCode::UNAUTHORIZED }))
    }

    struct Running {
        addr: SocketAddr,
        stop: Option<oneshot::Sender<()>>,
        done: tokio::task::JoinHandle<anyhow::Result<()>>,
    }

    async fn start(app: Router, limits: Limits, tls: Option<CertFiles>) -> Running {
        crate::install_crypto_provider();
        let listener = listen("127.0.0.1:0".parse().unwrap(), &limits).unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let done = tokio::spawn(async move {
            serve(listener, app, tls.as_ref(), &limits, tokio::sync::watch::channel(false).1, async move {
                let _ = stopped.await;
            })
            .await
        });
        Running { addr, stop: Some(stop), done }
    }

    /// Writes `request`, then reads until the server closes; returns what it answered
    /// and how long the connection lasted.
    async fn exchange(addr: SocketAddr, request: &[u8]) -> (String, Duration) {
        let started = std::time::Instant::now();
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(request).await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut answer)).await;
        (String::from_utf8_lossy(&answer).into_owned(), started.elapsed())
    }

    #[tokio::test]
    async fn slow_headers_are_cut_at_the_header_timeout_and_a_slow_handler_at_the_request_timeout() {
        let server = start(app(), limits(), None).await;
        // The request line and one header, never the blank line.
        let (answer, took) = exchange(server.addr, b"GET /fast HTTP/1.1\r\nHost: x\r\n").await;
        assert!(took >= Duration::from_millis(500) && took < Duration::from_secs(3), "{took:?} {answer:?}");
        assert!(!answer.contains("200 OK"), "{answer}");

        let (answer, took) = exchange(server.addr, b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains(r#"{"error":{"code":"request_timeout","message":"#), "{answer}");
        assert!(took < Duration::from_millis(1400), "cut before the handler finished: {took:?}");

        // A body trickled in slower than the request timeout.
        let mut conn = TcpStream::connect(server.addr).await.unwrap();
        conn.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab").await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut answer)).await;
        assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 408"), "{answer:?}");

        let (answer, _) = exchange(server.addr, b"GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("fast"), "{answer}");
    }

    #[tokio::test]
    async fn a_refusal_before_the_body_is_read_waits_for_it_and_keeps_the_connection() {
        let server = start(app(), limits(), None).await;
        let body = vec![b'x'; 40_000];
        let mut conn = TcpStream::connect(server.addr).await.unwrap();
        let head = format!("POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len());
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(&body[..8_000]).await.unwrap();
        // The handler answers now, with 32 KB still to come.
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Without the drain the server has closed by now: these writes fail or are reset.
        let _ = conn.write_all(&body[8_000..]).await;
        let _ = conn.write_all(b"GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut answer)).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
        assert!(answer.contains("HTTP/1.1 200") && answer.ends_with("fast"), "the next request on it: {answer}");
    }

    #[tokio::test]
    async fn waiting_routes_get_their_wait_and_untimed_ones_are_not_cut() {
        const WAITING: &[(&str, Option<Duration>)] = &[("/slow", None), ("/poll", Some(Duration::from_secs(60)))];
        let waiting = WAITING;
        let policy = timeout::RequestTimeout { limit: Duration::from_millis(300), waiting };
        assert_eq!(policy.limit_for(Some("/slow")), None);
        assert_eq!(policy.limit_for(Some("/poll")), Some(Duration::from_millis(60_300)));
        assert_eq!(policy.limit_for(Some("/fast")), Some(Duration::from_millis(300)));
        assert_eq!(policy.limit_for(None), Some(Duration::from_millis(300)));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = policy.apply(app());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let (answer, _) = exchange(addr, b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("slow"), "{answer}");
    }

    #[tokio::test]
    async fn connections_over_the_cap_are_closed_and_the_cap_frees_with_them() {
        let mut l = limits();
        l.header_read_timeout = Duration::from_secs(30);
        let server = start(app(), l, None).await;
        let held = [TcpStream::connect(server.addr).await.unwrap(), TcpStream::connect(server.addr).await.unwrap()];
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (answer, took) = exchange(server.addr, b"GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert_eq!(answer, "", "the third connection is closed unanswered");
        assert!(took < Duration::from_secs(2), "at once: {took:?}");
        drop(held);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (answer, _) = exchange(server.addr, b"GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    /// SPEC §12: one address holds at most its share of the cap; another address is
    /// served while it does (127.0.0.2 is a second loopback address).
    #[tokio::test]
    async fn one_address_holds_at_most_its_share_of_the_cap() {
        let mut l = limits();
        l.header_read_timeout = Duration::from_secs(30);
        (l.max_connections, l.max_connections_per_address) = (4, 2);
        let server = start(app(), l, None).await;
        let held = [TcpStream::connect(server.addr).await.unwrap(), TcpStream::connect(server.addr).await.unwrap()];
        tokio::time::sleep(Duration::from_millis(200)).await;
        let request = b"GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        let (answer, took) = exchange(server.addr, request).await;
        assert_eq!(answer, "", "the address's third connection is closed unanswered");
        assert!(took < Duration::from_secs(2), "at once: {took:?}");
        let other = tokio::net::TcpSocket::new_v4().unwrap();
        other.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut conn = other.connect(server.addr).await.unwrap();
        conn.write_all(request).await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut answer)).await;
        assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"), "another address is served");
        drop(held);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (answer, _) = exchange(server.addr, request).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "the share frees with its connections: {answer}");
    }

    /// A peer that stops reading holds at most the bounded kernel buffer (and hyper's
    /// 64 KiB): the body is not polled on. Unbounded, Linux let ~4 MiB through here.
    #[tokio::test]
    async fn a_reader_that_stalls_is_sent_no_more_than_the_bounded_buffers() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let produced = Arc::new(AtomicUsize::new(0));
        let counted = produced.clone();
        let flood = Router::new().route(
            "/flood",
            get(move || {
                let counted = counted.clone();
                async move {
                    let chunks = futures::stream::repeat_with(move || {
                        counted.fetch_add(16 * 1024, Ordering::Relaxed);
                        Ok::<_, std::convert::Infallible>(axum::body::Bytes::from(vec![b'x'; 16 * 1024]))
                    });
                    axum::body::Body::from_stream(chunks)
                }
            }),
        );
        let mut l = limits();
        l.request_timeout = Duration::from_secs(30);
        let server = start(flood, l, None).await;
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut conn = socket.connect(server.addr).await.unwrap();
        conn.write_all(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let mut head = [0u8; 12];
        conn.read_exact(&mut head).await.unwrap();
        assert_eq!(&head[9..12], b"200");
        // Never read again: whatever the server writes from now on stays in buffers.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let sent = produced.load(Ordering::Relaxed);
        // 2 x 128 KiB in the kernel, 64 KiB in hyper, the peer's 4 KiB window, a chunk or two.
        assert!(sent <= 512 * 1024, "{sent} bytes were taken from the body for a reader that stalled");
        drop(conn);
    }

    #[tokio::test]
    async fn shutdown_lets_the_request_in_flight_finish_and_closes_the_listener() {
        let mut l = limits();
        l.request_timeout = Duration::from_secs(5);
        let mut server = start(app(), l, None).await;
        let addr = server.addr;
        let in_flight =
            tokio::spawn(
                async move { exchange(addr, b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await },
            );
        tokio::time::sleep(Duration::from_millis(300)).await;
        let _ = server.stop.take().map(|s| s.send(()));
        let (answer, _) = in_flight.await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("slow"), "{answer}");
        tokio::time::timeout(Duration::from_secs(5), &mut server.done).await.unwrap().unwrap().unwrap();
        assert!(TcpStream::connect(addr).await.is_err(), "the listener is closed");
    }

    #[tokio::test]
    async fn tls_only_with_a_certificate() {
        let (ca, cert, key) = tls::test_pair("unit");
        let dir = std::env::temp_dir().join(format!("prism-serve-unit-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = CertFiles { cert: dir.join("tls.crt"), key: dir.join("tls.key") };
        std::fs::write(&files.cert, cert).unwrap();
        std::fs::write(&files.key, key).unwrap();
        let server = start(app(), limits(), Some(files)).await;

        // Plain HTTP to the TLS port: no HTTP answer.
        let (answer, _) = exchange(server.addr, b"GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(!answer.contains("HTTP/1.1 200"), "{answer:?}");

        let mut roots = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject as _;
        roots.add(rustls::pki_types::CertificateDer::from_pem_slice(ca.as_bytes()).unwrap()).unwrap();
        let client = rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
        let tcp = TcpStream::connect(server.addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut conn = connector.connect(name, tcp).await.unwrap();
        assert_eq!(conn.get_ref().1.alpn_protocol(), None, "no ALPN asked, none forced");
        conn.write_all(b"GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut answer = Vec::new();
        let _ = conn.read_to_end(&mut answer).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("fast"), "{answer}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn plain_http_is_warned_about_off_loopback_only() {
        let warn = |addr: &str, tls| plain_http_warning(addr.parse().unwrap(), tls);
        assert!(warn("0.0.0.0:8080", false).is_some_and(|w| w.contains("PRISM_TLS_CERT_FILE")));
        assert!(warn("10.1.2.3:8080", false).is_some());
        assert!(warn("[::]:8080", false).is_some());
        assert_eq!(warn("0.0.0.0:8080", true), None);
        assert_eq!(warn("127.0.0.1:8080", false), None);
        assert_eq!(warn("[::1]:8080", false), None);
    }
}

//! A stopping replica ends its kept-alive connections one answer at a time.
//!
//! Why: the shutdown delay (`PRISM_SHUTDOWN_DELAY_SECONDS`) keeps new connections
//! answered until the Service forgets this replica, but a client's pooled connection goes
//! on reaching it: the Service chose the pod when the connection opened. When the replica
//! finally closes such a connection, a request the client sends at that moment meets a
//! reset (the HTTP/1.1 race every keep-alive client can lose), and the client's next call
//! fails. Once the replica is stopping every answer says `Connection: close`, so the
//! client opens its next connection through the Service, to a replica that is not
//! stopping; by the end of the delay only connections that sent nothing through it are
//! left to close (SPEC §15: a rolling update fails no call).

use axum::Router;
use axum::extract::Request;
use axum::http::HeaderValue;
use axum::http::header::CONNECTION;
use axum::middleware::Next;
use tokio::sync::watch;

/// `router` answering with `Connection: close` once `closing` is true.
pub fn apply(router: Router, closing: watch::Receiver<bool>) -> Router {
    router.layer(axum::middleware::from_fn(move |request: Request, next: Next| {
        let closing = closing.clone();
        async move {
            let mut response = next.run(request).await;
            // Read after the handler: a long poll answered because the replica stops
            // closes its connection too.
            if *closing.borrow() {
                response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            }
            response
        }
    }))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    /// Two requests on one connection; what came back before the server closed it (or
    /// the wait ran out: the connection was kept).
    async fn two_on_one(addr: std::net::SocketAddr) -> String {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let mut first = vec![0u8; 1024];
        let n = conn.read(&mut first).await.unwrap();
        // The second request on the kept connection (it fails, or reads EOF, if closed).
        let _ = conn.write_all(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n").await;
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_millis(500), conn.read_to_end(&mut rest)).await;
        String::from_utf8_lossy(&first[..n]).into_owned() + &String::from_utf8_lossy(&rest)
    }

    #[tokio::test]
    async fn a_stopping_replica_closes_each_connection_after_its_answer() {
        let (closing_tx, closing) = watch::channel(false);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = apply(Router::new().route("/x", get(|| async { "x" })), closing);
        tokio::spawn(async move { axum::serve(listener, app).await });

        let serving = two_on_one(addr).await;
        assert_eq!(serving.matches("HTTP/1.1 200").count(), 2, "kept alive while serving: {serving}");
        assert!(!serving.to_ascii_lowercase().contains("connection: close"), "{serving}");

        closing_tx.send(true).unwrap();
        let stopping = two_on_one(addr).await;
        assert!(stopping.to_ascii_lowercase().contains("connection: close"), "{stopping}");
        assert_eq!(stopping.matches("HTTP/1.1 200").count(), 1, "closed after the first answer: {stopping}");
    }
}

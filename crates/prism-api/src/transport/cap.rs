//! The cap on open connections (`PRISM_MAX_CONNECTIONS`): an axum-server acceptor that
//! holds one permit per open connection, for as long as the connection lives.
//!
//! A connection over the cap is closed at once rather than made to wait. A waiting
//! connection would still hold its socket and the client would hear nothing until its
//! own connect or read timeout; closed, the client (or the Service in front of the
//! replicas) retries at once, against another replica when there is one, and the
//! process's file descriptors and memory stay bounded whatever the peer does.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum_server::accept::Accept;
use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::warn;

/// At most one warning per this long while connections are being refused.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Wraps the acceptor that runs first on a new connection (before TLS).
#[derive(Clone)]
pub struct ConnectionCap<A> {
    inner: A,
    permits: Arc<Semaphore>,
    max: usize,
    refused: Arc<Refusals>,
}

impl<A> ConnectionCap<A> {
    pub fn new(inner: A, max: usize) -> Self {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        ConnectionCap { inner, permits: Arc::new(Semaphore::new(max)), max, refused: Arc::default() }
    }
}

impl<A, I, S> Accept<I, S> for ConnectionCap<A>
where
    A: Accept<I, S>,
    A::Future: Send + 'static,
    A::Stream: Send + 'static,
    A::Service: Send + 'static,
{
    type Stream = Capped<A::Stream>;
    type Service = A::Service;
    type Future = BoxFuture<'static, io::Result<(Self::Stream, Self::Service)>>;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                let inner = self.inner.accept(stream, service);
                Box::pin(async move {
                    let (stream, service) = inner.await?;
                    Ok((Capped { inner: stream, _permit: permit }, service))
                })
            }
            Err(_) => {
                // Dropping the stream closes the connection.
                drop(stream);
                self.refused.note(self.max);
                Box::pin(std::future::ready(Err(io::Error::other(format!(
                    "connection refused: {} connections open (PRISM_MAX_CONNECTIONS)",
                    self.max
                )))))
            }
        }
    }
}

/// Counts refusals and says so now and then, not once per connection (a flood would
/// otherwise flood the log too).
#[derive(Default)]
struct Refusals {
    since_warning: AtomicU64,
    warned_at: Mutex<Option<Instant>>,
}

impl Refusals {
    fn note(&self, max: usize) {
        self.since_warning.fetch_add(1, Ordering::Relaxed);
        let Ok(mut warned_at) = self.warned_at.try_lock() else { return };
        if warned_at.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            return;
        }
        *warned_at = Some(Instant::now());
        let refused = self.since_warning.swap(0, Ordering::Relaxed);
        warn!(refused, max_connections = max, "connection cap reached: new connections are closed at once");
    }
}

/// A connection's stream and its permit: the permit returns when the stream is dropped.
pub struct Capped<S> {
    inner: S,
    _permit: OwnedSemaphorePermit,
}

impl<S: AsyncRead + Unpin> AsyncRead for Capped<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Capped<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

//! The cap on open connections (`PRISM_MAX_CONNECTIONS`): an axum-server acceptor that
//! holds one permit per open connection, for as long as the connection lives; and each
//! source address's share of it (`PRISM_MAX_CONNECTIONS_PER_ADDRESS`, a quarter of the
//! cap by default, SPEC §12), so that one address cannot hold every slot and lock every
//! other client out.
//!
//! A connection over the cap is closed at once rather than made to wait. A waiting
//! connection would still hold its socket and the client would hear nothing until its
//! own connect or read timeout; closed, the client (or the Service in front of the
//! replicas) retries at once, against another replica when there is one, and the
//! process's file descriptors and memory stay bounded whatever the peer does.

use std::io;
use std::net::IpAddr;
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

use crate::shares::Shares;

/// At most one warning per this long while connections are being refused.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The source address of an accepted connection (None: not known, not counted).
pub trait PeerOf {
    fn peer_ip(&self) -> Option<IpAddr>;
}

impl PeerOf for tokio::net::TcpStream {
    fn peer_ip(&self) -> Option<IpAddr> {
        self.peer_addr().ok().map(|a| a.ip())
    }
}

/// Wraps the acceptor that runs first on a new connection (before TLS).
#[derive(Clone)]
pub struct ConnectionCap<A> {
    inner: A,
    permits: Arc<Semaphore>,
    max: usize,
    shares: Arc<Shares<IpAddr>>,
    refused: Arc<Refusals>,
}

/// One connection's place in its address's share; given back when dropped.
pub type AddressPermit = crate::shares::Share<IpAddr>;

impl<A> ConnectionCap<A> {
    /// `per_address`: the most connections one source address holds (at most `max`).
    pub fn new(inner: A, max: usize, per_address: usize) -> Self {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        let shares = Shares::new(per_address.clamp(1, max));
        ConnectionCap { inner, permits: Arc::new(Semaphore::new(max)), max, shares, refused: Arc::default() }
    }
}

impl<A, I, S> Accept<I, S> for ConnectionCap<A>
where
    A: Accept<I, S>,
    A::Future: Send + 'static,
    A::Stream: Send + 'static,
    A::Service: Send + 'static,
    I: PeerOf,
{
    type Stream = Capped<A::Stream>;
    type Service = A::Service;
    type Future = BoxFuture<'static, io::Result<(Self::Stream, Self::Service)>>;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        let share = match stream.peer_ip() {
            Some(ip) => match self.shares.take(ip) {
                Some(permit) => Some(permit),
                None => {
                    drop(stream);
                    self.refused.note(self.max, Some(self.shares.per_key()));
                    return Box::pin(std::future::ready(Err(io::Error::other(format!(
                        "connection refused: this address holds {} connections (PRISM_MAX_CONNECTIONS_PER_ADDRESS)",
                        self.shares.per_key()
                    )))));
                }
            },
            None => None,
        };
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                let inner = self.inner.accept(stream, service);
                Box::pin(async move {
                    let (stream, service) = inner.await?;
                    Ok((Capped { inner: stream, _permit: permit, _share: share }, service))
                })
            }
            Err(_) => {
                // Dropping the stream closes the connection.
                drop(stream);
                self.refused.note(self.max, None);
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
    /// `per_address`: set when an address's share was the limit, not the whole cap.
    fn note(&self, max: usize, per_address: Option<usize>) {
        self.since_warning.fetch_add(1, Ordering::Relaxed);
        let Ok(mut warned_at) = self.warned_at.try_lock() else { return };
        if warned_at.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            return;
        }
        *warned_at = Some(Instant::now());
        let refused = self.since_warning.swap(0, Ordering::Relaxed);
        match per_address {
            None => warn!(refused, max_connections = max, "connection cap reached: new connections are closed at once"),
            Some(share) => warn!(
                refused,
                max_connections_per_address = share,
                "an address holds its share of the connection cap: its new connections are closed at once"
            ),
        }
    }
}

/// A connection's stream and its permits: they return when the stream is dropped.
pub struct Capped<S> {
    inner: S,
    _permit: OwnedSemaphorePermit,
    _share: Option<AddressPermit>,
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

//! Answers given before the request body was read (a refusal: 401 without a token, 403,
//! 404, 429) wait for the rest of the body, up to the body limit and [`DRAIN_WAIT`],
//! before they are sent.
//!
//! Why: hyper closes a connection whose request body was not read to the end, and a
//! socket closed with unread bytes in its receive buffer makes the kernel send a TCP RST
//! at once. A client still sending its body (anything larger than what hyper read with
//! the headers, ~16 KB) then often sees the reset before the answer: one request in
//! about a hundred with an 18 KB body and no token failed with "connection reset" (or,
//! over TLS, "EOF occurred in violation of protocol") instead of its 401 (the fuzz run of
//! CI, 2026-12-03). Read to the end, the answer arrives and the connection stays open
//! for the next request.
//!
//! Not drained: a body over the limit (413: reading on is what the limit refuses) and a
//! body too slow for the request timeout (408); both are closed as before.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt as _;

use crate::MAX_BODY_BYTES;

/// The longest an answer waits for the unread rest of its request's body.
pub const DRAIN_WAIT: Duration = Duration::from_secs(1);

/// `router` with every route (and the fallback) draining what its handler left unread.
pub fn apply(router: Router) -> Router {
    router.layer(axum::middleware::from_fn(drain_unread))
}

async fn drain_unread(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    if body.is_end_stream() {
        // No body (a GET, Content-Length: 0): nothing can be left unread.
        return next.run(Request::from_parts(parts, body)).await;
    }
    let left = Arc::new(Mutex::new(None));
    let body = Body::new(Returned { body: Some(body), left: left.clone() });
    let response = next.run(Request::from_parts(parts, body)).await;
    if matches!(response.status(), StatusCode::PAYLOAD_TOO_LARGE | StatusCode::REQUEST_TIMEOUT) {
        return response;
    }
    let unread = left.lock().ok().and_then(|mut slot| slot.take());
    if let Some(rest) = unread {
        discard(rest).await;
    }
    response
}

/// Reads and drops `body` up to the body limit, for at most [`DRAIN_WAIT`].
async fn discard(mut body: Body) {
    let read = async {
        let mut seen = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            seen += frame.data_ref().map_or(0, Bytes::len);
            if seen > MAX_BODY_BYTES {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_WAIT, read).await;
}

/// The request body as the handler sees it; dropped before its end, it hands what is
/// left back to the middleware (through `left`).
struct Returned {
    body: Option<Body>,
    left: Arc<Mutex<Option<Body>>>,
}

impl http_body::Body for Returned {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let Some(body) = this.body.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(body).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            // Read to the end, or broken: nothing to hand back.
            this.body = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.body.as_ref().map(|b| b.size_hint()).unwrap_or_else(|| SizeHint::with_exact(0))
    }
}

impl Drop for Returned {
    fn drop(&mut self) {
        if let Some(body) = self.body.take().filter(|b| !b.is_end_stream())
            && let Ok(mut slot) = self.left.lock()
        {
            *slot = Some(body);
        }
    }
}

//! Server-Sent Events as this API writes them (SPEC §11): each event written once into
//! `Bytes` and sent as they are. A watch's `routing` event is the same for every watch of
//! the project that names no session, so it is written once per change and shared
//! (`Frame::shared`): 1,000 watches of a busy project cost one serialization per change and
//! one copy in memory, even while their readers stall with it in hyper's queue (axum's
//! `Event` is a buffer of each stream's own, made per stream).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use futures::Stream;

/// One event, written. At most three pieces (a head, a shared body, a tail), sent in order.
#[derive(Clone, Debug)]
pub struct Frame {
    parts: [Bytes; 3],
}

const END: &[u8] = b"\n\n";

impl Frame {
    /// `event: <name>` with an optional `id:` and `data:` that is one line (JSON as
    /// serde_json writes it has no raw line breaks: they are escaped inside strings).
    pub fn new(name: &str, id: Option<&str>, data: Bytes) -> Frame {
        Frame { parts: [head(name, id), data, Bytes::from_static(END)] }
    }

    /// `new` of `value` as JSON.
    pub fn json(name: &str, id: Option<&str>, value: &impl serde::Serialize) -> Result<Frame, serde_json::Error> {
        Ok(Frame::new(name, id, Bytes::from(serde_json::to_vec(value)?)))
    }

    /// A whole frame as one piece, to share between streams (`Bytes` clones are references).
    pub fn shared(&self) -> Bytes {
        let mut whole = Vec::with_capacity(self.len());
        for part in &self.parts {
            whole.extend_from_slice(part);
        }
        Bytes::from(whole)
    }

    /// A frame written before (`shared`), sent as it is.
    pub fn from_shared(whole: Bytes) -> Frame {
        Frame { parts: [whole, Bytes::new(), Bytes::new()] }
    }

    /// The frame's length in bytes.
    fn len(&self) -> usize {
        self.parts.iter().map(Bytes::len).sum()
    }

    /// The frame as text (tests and logs).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.shared()).into_owned()
    }
}

fn head(name: &str, id: Option<&str>) -> Bytes {
    // Names and ids are ours (`routing`, `<term>.<seq>`): one line each, no user text.
    let mut head = format!("event: {}\n", one_line(name));
    if let Some(id) = id {
        head.push_str("id: ");
        head.push_str(&one_line(id));
        head.push('\n');
    }
    head.push_str("data: ");
    Bytes::from(head)
}

/// A field value cannot hold a line break (it would end the field early); ours never do,
/// and this keeps it so.
fn one_line(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains(['\n', '\r']) { s.replace(['\n', '\r'], " ").into() } else { s.into() }
}

/// The comment sent on an idle stream (SPEC §11: every 15 s).
const KEEPALIVE_COMMENT: &[u8] = b":\n\n";

/// A `text/event-stream` response of `frames`, with a keep-alive comment after each
/// `keepalive` without an event.
pub fn response(frames: impl Stream<Item = Frame> + Send + 'static, keepalive: Duration) -> Response {
    let body = Body::from_stream(Pieces {
        frames: Box::pin(frames),
        pending: Vec::new(),
        keepalive,
        idle: Box::pin(tokio::time::sleep(keepalive)),
    });
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// The frames' pieces as body chunks, and the keep-alive.
struct Pieces {
    frames: Pin<Box<dyn Stream<Item = Frame> + Send>>,
    /// What is left of the frame being sent, last piece first.
    pending: Vec<Bytes>,
    keepalive: Duration,
    idle: Pin<Box<tokio::time::Sleep>>,
}

impl Stream for Pieces {
    type Item = Result<Bytes, std::convert::Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(piece) = self.pending.pop() {
            return Poll::Ready(Some(Ok(piece)));
        }
        match self.frames.as_mut().poll_next(cx) {
            Poll::Ready(Some(frame)) => {
                let deadline = tokio::time::Instant::now() + self.keepalive;
                self.idle.as_mut().reset(deadline);
                let [a, b, c] = frame.parts;
                self.pending = [c, b].into_iter().filter(|p| !p.is_empty()).collect();
                Poll::Ready(Some(Ok(a)))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                if self.idle.as_mut().poll(cx).is_ready() {
                    let deadline = tokio::time::Instant::now() + self.keepalive;
                    self.idle.as_mut().reset(deadline);
                    // Polled once so the new deadline wakes this task.
                    let _ = self.idle.as_mut().poll(cx);
                    return Poll::Ready(Some(Ok(Bytes::from_static(KEEPALIVE_COMMENT))));
                }
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[test]
    fn a_frame_is_one_event_as_an_sse_parser_reads_it() {
        let frame = Frame::json("routing", Some("3.7"), &serde_json::json!({"a": "line\nbreak"})).expect("json");
        assert_eq!(frame.text(), "event: routing\nid: 3.7\ndata: {\"a\":\"line\\nbreak\"}\n\n");
        let same = Frame::from_shared(frame.shared());
        assert_eq!(same.text(), frame.text(), "shared, then sent as it is");
        assert_eq!(Frame::new("reset", None, Bytes::from_static(b"{}")).text(), "event: reset\ndata: {}\n\n");
        assert_eq!(Frame::new("x\ny", Some("1\r2"), Bytes::new()).text(), "event: x y\nid: 1 2\ndata: \n\n");
    }

    #[tokio::test(start_paused = true)]
    async fn the_body_is_the_frames_and_a_comment_on_each_idle_interval() {
        let (tx, rx) = futures::channel::mpsc::unbounded::<Frame>();
        let response = response(rx, Duration::from_secs(15));
        assert_eq!(response.headers()[header::CONTENT_TYPE], "text/event-stream");
        let mut body = response.into_body().into_data_stream();
        tx.unbounded_send(Frame::new("a", None, Bytes::from_static(b"1"))).expect("send");
        let mut got = Vec::new();
        for _ in 0..3 {
            got.extend_from_slice(&body.next().await.expect("piece").expect("ok"));
        }
        assert_eq!(got, b"event: a\ndata: 1\n\n");
        let idle = tokio::time::Instant::now();
        assert_eq!(&body.next().await.expect("keep-alive").expect("ok")[..], KEEPALIVE_COMMENT);
        assert_eq!(idle.elapsed(), Duration::from_secs(15), "after an idle interval");
        assert_eq!(&body.next().await.expect("again").expect("ok")[..], KEEPALIVE_COMMENT);
        drop(tx);
        assert!(body.next().await.is_none(), "ends with its frames");
    }
}

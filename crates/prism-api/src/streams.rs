//! Held requests — SSE watches, MCP GET streams and `subscriptions/listen`, long-poll
//! claims — are bounded like everything else a caller can make grow (SPEC §12, "Streams
//! are bounded too"):
//!
//! * at most `per_caller` held at once per Kubernetes identity and per Run session
//!   (429 `too_many_streams` beyond), counted on this replica;
//! * each lives at most `lifetime`, then ends cleanly (its client resumes);
//! * a reader that does not keep up is never buffered for: one event may wait for it,
//!   and past that the stream ends with a `reset` event (the client resumes from a
//!   fresh snapshot). `Outbox` is that one-event buffer; a writer with a second event
//!   gives the reader `READER_GRACE` to take the first (events made together, such as a
//!   table and a nudge, do not reset a reader that keeps up).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::body::Bytes;
use http_body::{Body as HttpBody, Frame as BodyFrame, SizeHint};
use tokio::sync::Notify;

use super::ApiError;
use crate::shares::Shares;
use crate::sse::Frame;

/// Whose held requests a stream counts against.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Holder {
    /// A Kubernetes identity (its username: every token of it counts together).
    Identity(String),
    /// A Run's session.
    RunSession(uuid::Uuid),
}

/// The held streams of this replica, by holder.
pub struct Streams {
    lifetime: Duration,
    held: Arc<Shares<Holder>>,
    /// Turns to hand a change to a stream (`turn`).
    turns: tokio::sync::Semaphore,
}

/// How many streams hand out a change at once. One change of a project wakes every
/// watch of it; all at once, 1,000 watches put ~15 ms of work on the runtime's queue
/// ahead of any request that arrives then (the abuse bench: an agent's heartbeat p99
/// 0.9 ms quiet, 15 ms under 1,000 watches of a project changing 20 times a second).
/// Taking turns, the queue holds a few dozen of them at a time and requests go between.
pub const TURNS: usize = 16;

/// A held request's place; given back when dropped.
pub type Permit = crate::shares::Share<Holder>;

impl Streams {
    pub fn new(per_caller: usize, lifetime: Duration) -> Arc<Self> {
        Arc::new(Streams { lifetime, held: Shares::new(per_caller), turns: tokio::sync::Semaphore::new(TURNS) })
    }

    /// A turn to hand a change to a stream: held while the stream puts it out
    /// (`Outbox::try_offer_later`), never while it reads or waits for its reader.
    pub async fn turn(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        // Never closed: None only if it were.
        self.turns.acquire().await.ok()
    }

    /// How long one stream may live (`PRISM_MAX_STREAM_SECONDS`).
    pub fn lifetime(&self) -> Duration {
        self.lifetime
    }

    /// One more held request of `holder`, or 429 `too_many_streams` when it holds its
    /// share already. The permit gives the place back when dropped.
    pub fn hold(&self, holder: Holder) -> Result<Permit, ApiError> {
        self.held.take(holder).ok_or_else(|| {
            let refused = ApiError::new(
                axum::http::StatusCode::TOO_MANY_REQUESTS,
                "too_many_streams",
                format!(
                    "this caller holds {} streams (watches, MCP streams and listens, long-poll claims) already \
                     (PRISM_MAX_STREAMS_PER_IDENTITY); end one first",
                    self.held.per_key()
                ),
            );
            ApiError { retry_after: Some(Duration::from_secs(1)), ..refused }
        })
    }

    /// Streams held by `holder` now.
    pub fn held_by(&self, holder: &Holder) -> usize {
        self.held.held_by(holder)
    }

    /// Holders with a stream now (the map never keeps one that holds none).
    pub fn holders(&self) -> usize {
        self.held.keys()
    }
}

/// A streamed response body that holds its permit while it lives and ends, cleanly, once
/// its lifetime is over: the client sees the stream close after a whole event and resumes.
pub fn bounded(body: Body, permit: Permit, lifetime: Duration) -> Body {
    Body::new(Bounded { inner: body, _permit: permit, deadline: Box::pin(tokio::time::sleep(lifetime)) })
}

struct Bounded {
    inner: Body,
    _permit: Permit,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl HttpBody for Bounded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<BodyFrame<Bytes>, axum::Error>>> {
        if self.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// How long a writer with an event waits for the reader to take the one before it.
pub const READER_GRACE: Duration = Duration::from_secs(2);

/// An event for the reader, or how to make it once the reader takes it: a watch's table
/// is made from a snapshot its project's watches share, so a stream whose reader stalls
/// keeps a reference rather than a copy of its own.
enum Waiting {
    Made(Frame),
    Later(Box<dyn FnOnce() -> Frame + Send>),
}

impl Waiting {
    fn make(self) -> Frame {
        match self {
            Waiting::Made(event) => event,
            Waiting::Later(make) => make(),
        }
    }
}

/// An event a reader was not ready for (`Outbox::try_offer_later`).
pub struct Pending(Waiting);

/// What one stream has for its reader: at most one event waiting, then the end.
#[derive(Default)]
struct Slot {
    waiting: Option<Waiting>,
    /// The last event, sent after the waiting one (a `reset` or an `error`).
    last: Option<Frame>,
    /// Nothing comes after `last` (or after `waiting`, without one).
    ended: bool,
    /// The reader went away.
    dropped: bool,
}

/// The writing side of a stream with a one-event buffer (see the module's doc).
#[derive(Clone)]
pub struct Outbox {
    slot: Arc<Mutex<Slot>>,
    /// The reader may have something to take.
    ready: Arc<Notify>,
    /// The reader took the waiting event.
    taken: Arc<Notify>,
    gone: Arc<Notify>,
}

/// Why `Outbox::offer` took no event.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The reader went away.
    Gone,
    /// The reader was an event behind already: the stream ends with a `reset`.
    Behind,
}

impl Outbox {
    /// An outbox and the stream of events its reader gets.
    pub fn new() -> (Outbox, impl futures::Stream<Item = Frame> + Send + 'static) {
        let outbox = Outbox {
            slot: Default::default(),
            ready: Arc::new(Notify::new()),
            taken: Arc::new(Notify::new()),
            gone: Arc::new(Notify::new()),
        };
        let reader = Reader(outbox.clone());
        let events = futures::stream::unfold(reader, |reader| async move {
            let event = reader.next().await?;
            Some((event, reader))
        });
        (outbox, events)
    }

    /// Puts `event` out for the reader. A reader that has not taken the event before it
    /// within `READER_GRACE` gets a `reset` event after that one, and the stream ends: it
    /// is never buffered for.
    pub async fn offer(&self, event: Frame) -> Result<(), Refused> {
        self.offer_within(Waiting::Made(event), READER_GRACE).await
    }

    /// `offer` of the event `make` makes when the reader takes it (made once, by the
    /// reader's task).
    pub async fn offer_later(&self, make: impl FnOnce() -> Frame + Send + 'static) -> Result<(), Refused> {
        self.offer_within(Waiting::Later(Box::new(make)), READER_GRACE).await
    }

    /// `offer_later` without waiting: the event is put out if nothing waits for the
    /// reader, and handed back (`Some`) if something does, to be offered with
    /// `offer_pending` — outside whatever turn the caller holds.
    pub fn try_offer_later(&self, make: impl FnOnce() -> Frame + Send + 'static) -> Result<Option<Pending>, Refused> {
        Ok(self.try_put(Waiting::Later(Box::new(make)))?.map(Pending))
    }

    /// Waits at most `within` for the reader to take what waits for it (a turn's
    /// holder sees its event on its way before passing the turn on).
    pub async fn taken_within(&self, within: Duration) {
        let until = tokio::time::Instant::now() + within;
        loop {
            let taken = self.taken.notified();
            if self.slot.lock().map(|s| s.waiting.is_none() || s.dropped).unwrap_or(true) {
                return;
            }
            if tokio::time::timeout_at(until, taken).await.is_err() {
                return;
            }
        }
    }

    /// `offer` of an event `try_offer_later` handed back.
    pub async fn offer_pending(&self, pending: Pending) -> Result<(), Refused> {
        self.offer_within(pending.0, READER_GRACE).await
    }

    /// Puts `event` out if nothing waits; hands it back if something does.
    fn try_put(&self, event: Waiting) -> Result<Option<Waiting>, Refused> {
        let mut slot = self.slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if slot.dropped || slot.ended {
            return Err(Refused::Gone);
        }
        if slot.waiting.is_some() {
            return Ok(Some(event));
        }
        slot.waiting = Some(event);
        drop(slot);
        self.ready.notify_one();
        Ok(None)
    }

    async fn offer_within(&self, event: Waiting, grace: Duration) -> Result<(), Refused> {
        let until = tokio::time::Instant::now() + grace;
        let mut event = event;
        loop {
            let taken = self.taken.notified();
            event = match self.try_put(event)? {
                None => return Ok(()),
                Some(event) => event,
            };
            if tokio::time::Instant::now() >= until {
                let mut slot = self.slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                if slot.dropped || slot.ended {
                    return Err(Refused::Gone);
                }
                if slot.waiting.is_none() {
                    // Taken since the look above: no reset for a reader that kept up.
                    slot.waiting = Some(event);
                    drop(slot);
                    self.ready.notify_one();
                    return Ok(());
                }
                slot.last = Some(reset_event());
                slot.ended = true;
                drop(slot);
                self.ready.notify_one();
                return Err(Refused::Behind);
            }
            let _ = tokio::time::timeout_at(until, taken).await;
        }
    }

    /// `offer`, then waits until the reader has taken the event (handed it to the
    /// connection): for what must not be lost to a stream that ends (a nudge, marked
    /// delivered only once it is out). `Gone`: the reader went away before taking it.
    pub async fn offer_taken(&self, event: Frame) -> Result<(), Refused> {
        self.offer(event).await?;
        loop {
            let taken = self.taken.notified();
            {
                let slot = self.slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                if slot.waiting.is_none() {
                    return Ok(());
                }
                if slot.dropped {
                    return Err(Refused::Gone);
                }
            }
            tokio::select! {
                _ = taken => {}
                _ = self.closed() => {}
            }
        }
    }

    /// Ends the stream after what is waiting, with `last` (an `error` event) if given.
    pub fn end(&self, last: Option<Frame>) {
        let mut slot = self.slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !slot.ended {
            slot.last = last;
            slot.ended = true;
        }
        drop(slot);
        self.ready.notify_one();
    }

    /// Resolves when the reader has gone away (its response body was dropped).
    pub async fn closed(&self) {
        loop {
            let notified = self.gone.notified();
            if self.slot.lock().map(|s| s.dropped).unwrap_or(true) {
                return;
            }
            notified.await;
        }
    }
}

/// The `reset` event of a stream whose reader fell behind.
fn reset_event() -> Frame {
    let body = serde_json::json!({"reason": "slow_reader", "message": "the stream's reader fell behind; resume from a fresh snapshot"});
    Frame::new("reset", None, body.to_string().into())
}

struct Reader(Outbox);

impl Reader {
    async fn next(&self) -> Option<Frame> {
        loop {
            let notified = self.0.ready.notified();
            {
                let mut slot = self.0.slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                if let Some(event) = slot.waiting.take() {
                    drop(slot);
                    self.0.taken.notify_one();
                    return Some(event.make());
                }
                if slot.ended {
                    return slot.last.take();
                }
            }
            notified.await;
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if let Ok(mut slot) = self.0.slot.lock() {
            slot.dropped = true;
        }
        self.0.gone.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn data(text: &str) -> Frame {
        Frame::new("message", None, Bytes::copy_from_slice(text.as_bytes()))
    }

    #[test]
    fn a_holder_gets_its_share_and_the_place_comes_back() {
        let streams = Streams::new(2, Duration::from_secs(60));
        let alice = Holder::Identity("alice".into());
        let a = streams.hold(alice.clone()).expect("first");
        let _b = streams.hold(alice.clone()).expect("second");
        let refused = streams.hold(alice.clone()).err().expect("third refused");
        assert_eq!((refused.status.as_u16(), refused.code), (429, "too_many_streams"));
        assert!(refused.retry_after.is_some(), "with Retry-After");
        assert!(streams.hold(Holder::RunSession(uuid::Uuid::nil())).is_ok(), "another holder has its own share");
        drop(a);
        assert!(streams.hold(alice).is_ok(), "a place came back");
    }

    #[tokio::test]
    async fn a_reader_an_event_behind_gets_a_reset_and_the_end() {
        let (outbox, events) = Outbox::new();
        tokio::pin!(events);
        outbox.offer(data("1")).await.expect("one may wait");
        let grace = Duration::from_millis(50);
        assert_eq!(outbox.offer_within(Waiting::Made(data("2")), grace).await, Err(Refused::Behind));
        assert_eq!(outbox.offer(data("3")).await, Err(Refused::Gone), "nothing after the end");
        let got: Vec<String> = events.by_ref().map(|e| e.text()).collect().await;
        assert_eq!(got.len(), 2, "the waiting event, then the reset: {got:?}");
        assert!(got[0].contains("data: 1") && got[1].contains("reset"), "{got:?}");
    }

    /// A stalled reader's stream keeps what makes its event (a watch: the snapshot its
    /// project's watches share), not the event: it is made once, when taken, and never
    /// for a reader that went away.
    #[tokio::test]
    async fn an_event_offered_later_is_made_once_when_the_reader_takes_it() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let made = Arc::new(AtomicUsize::new(0));
        let maker = |made: Arc<AtomicUsize>| {
            move || {
                made.fetch_add(1, Ordering::SeqCst);
                data("table")
            }
        };
        let (outbox, events) = Outbox::new();
        let mut events = Box::pin(events);
        outbox.offer_later(maker(made.clone())).await.expect("waits");
        assert_eq!(made.load(Ordering::SeqCst), 0, "not made while the reader stalls");
        let got = events.next().await.expect("some").text();
        assert!(got.contains("data: table"), "{got}");
        assert_eq!(made.load(Ordering::SeqCst), 1, "made when taken");
        outbox.offer_later(maker(made.clone())).await.expect("waits");
        drop(events);
        assert_eq!(made.load(Ordering::SeqCst), 1, "never made for a reader that left");
    }

    #[tokio::test]
    async fn a_reader_that_keeps_up_gets_every_event_and_a_dropped_one_is_seen() {
        let (outbox, events) = Outbox::new();
        let mut events = Box::pin(events);
        for n in 0..5 {
            outbox.offer(data(&n.to_string())).await.expect("kept up");
            assert!(events.next().await.expect("some").text().contains(&format!("data: {n}")));
        }
        // Two events made together: the second waits for the reader to take the first.
        let reading = tokio::spawn(async move {
            let mut got = Vec::new();
            for _ in 0..2 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                got.push(events.next().await.expect("some").text());
            }
            (got, events)
        });
        outbox.offer(data("a")).await.expect("first");
        outbox.offer(data("b")).await.expect("second, once the first is taken");
        let (got, mut events) = reading.await.expect("reader");
        assert!(got[0].contains("data: a") && got[1].contains("data: b"), "{got:?}");
        outbox.end(Some(Frame::new("error", None, Bytes::from_static(b"{}"))));
        assert!(events.next().await.expect("last").text().contains("error"));
        assert!(events.next().await.is_none());
        let (outbox, events) = Outbox::new();
        drop(events);
        tokio::time::timeout(Duration::from_secs(1), outbox.closed()).await.expect("the reader's going is seen");
        assert_eq!(outbox.offer(data("x")).await, Err(Refused::Gone));
    }

    #[tokio::test]
    async fn an_event_offered_to_be_taken_is_told_whether_the_reader_took_it() {
        let (outbox, events) = Outbox::new();
        let mut events = Box::pin(events);
        let reading = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let got = events.next().await.expect("some").text();
            (got, events)
        });
        outbox.offer_taken(data("nudge")).await.expect("taken");
        let (got, events) = reading.await.expect("reader");
        assert!(got.contains("data: nudge"), "{got}");
        // A reader that goes away without taking it: Gone, so the sender can give it back.
        let dropping = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(events);
        });
        assert_eq!(outbox.offer_taken(data("lost?")).await, Err(Refused::Gone));
        dropping.await.expect("dropped");
    }

    /// A watch holding a turn puts its event out without waiting for a stalled reader: a
    /// reader with an event still waiting hands the next one back, to be offered (and
    /// waited for, up to the grace) without the turn.
    #[tokio::test]
    async fn an_event_is_handed_back_when_the_reader_is_not_ready_and_offered_later() {
        let (outbox, events) = Outbox::new();
        let mut events = Box::pin(events);
        assert!(matches!(outbox.try_offer_later(|| data("1")), Ok(None)), "put out at once");
        let pending = match outbox.try_offer_later(|| data("2")) {
            Ok(Some(pending)) => pending,
            _ => panic!("handed back while 1 waits"),
        };
        // Not taken yet: the turn's wait ends by its bound.
        let waited = std::time::Instant::now();
        outbox.taken_within(Duration::from_millis(50)).await;
        assert!(waited.elapsed() >= Duration::from_millis(50));
        let reading = tokio::spawn(async move {
            let first = events.next().await.expect("1").text();
            let second = events.next().await.expect("2").text();
            (first, second, events)
        });
        outbox.offer_pending(pending).await.expect("offered once 1 was taken");
        let (first, second, events) = reading.await.expect("reader");
        assert!(first.contains("data: 1") && second.contains("data: 2"), "{first} {second}");
        drop(events);
        assert!(matches!(outbox.try_offer_later(|| data("3")), Err(Refused::Gone)), "nothing for a reader gone");
    }

    #[tokio::test(start_paused = true)]
    async fn a_bounded_body_ends_at_its_lifetime_and_gives_its_place_back() {
        let streams = Streams::new(1, Duration::from_secs(60));
        let holder = Holder::Identity("bob".into());
        let permit = streams.hold(holder.clone()).expect("hold");
        let endless = Body::from_stream(futures::stream::pending::<Result<Bytes, std::convert::Infallible>>());
        let body = bounded(endless, permit, Duration::from_secs(60));
        let collected = tokio::time::timeout(Duration::from_secs(61), axum::body::to_bytes(body, 1024)).await;
        assert!(collected.expect("ended by its lifetime").expect("bytes").is_empty());
        assert_eq!(streams.held_by(&holder), 0, "the place is back once the body is gone");
    }
}

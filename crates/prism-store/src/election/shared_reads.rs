//! Reads of one project asked for at once, made once.
//!
//! Every reconcile of a registration reads its whole project, and a project's
//! registrations are reconciled together: at their shared status-heartbeat slot, and all
//! of them after each role change. So a read is gathered for a moment (`GATHER`) before
//! it starts, and everyone who asks for the same project meanwhile gets its answer.
//!
//! A caller only ever joins a read that has not started yet. That is what keeps the answer
//! as fresh as a read of its own: it starts after the caller asked, so it sees every
//! commit made before. (Joining a read already under way would not: a reconcile that a
//! change on another replica triggered could get a view read before that change
//! committed, and nothing would trigger it again.) Hence this and not moka's coalescing
//! of in-flight loads, which joins a load whenever it began.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

/// How long a read waits for others to ask for the same thing before it starts. The
/// registrations of a project come back from the controller's queue within a millisecond
/// of each other; a few more cover a busy runtime.
pub const GATHER: Duration = Duration::from_millis(5);

/// A read's answer as its joiners see it: None until it is made; Some(None) if it failed
/// (each joiner then reads on its own, to get its own error).
type Answer<V> = Option<Option<V>>;

pub struct SharedReads<K, V> {
    gathering: Arc<Mutex<HashMap<K, watch::Receiver<Answer<V>>>>>,
    gather: Duration,
}

impl<K, V> Clone for SharedReads<K, V> {
    fn clone(&self) -> Self {
        Self { gathering: Arc::clone(&self.gathering), gather: self.gather }
    }
}

impl<K: Hash + Eq + Clone, V: Clone> SharedReads<K, V> {
    pub fn new(gather: Duration) -> Self {
        Self { gathering: Arc::default(), gather }
    }

    /// `read`'s answer for `key`, from a read that starts after this call: this caller's
    /// own, or one that was still gathering when it asked.
    pub async fn read<E, F, Fut>(&self, key: K, read: F) -> Result<V, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<V, E>>,
    {
        let joined = {
            let mut gathering = self.gathering.lock().unwrap_or_else(PoisonError::into_inner);
            match gathering.get(&key) {
                Some(rx) => Err(rx.clone()),
                None => {
                    let (tx, rx) = watch::channel(None);
                    gathering.insert(key.clone(), rx.clone());
                    Ok((tx, Gathering { reads: self, key, rx }))
                }
            }
        };
        match joined {
            Err(mut rx) => {
                if let Ok(answer) = rx.wait_for(Option::is_some).await
                    && let Some(Some(view)) = answer.clone()
                {
                    return Ok(view);
                }
                // The read failed, or its caller went away before making it.
                read().await
            }
            Ok((tx, gathering)) => {
                tokio::time::sleep(self.gather).await;
                // From here on, whoever asks starts a read of their own.
                drop(gathering);
                let answer = read().await;
                tx.send_replace(Some(answer.as_ref().ok().cloned()));
                answer
            }
        }
    }

    #[cfg(test)]
    fn gathering(&self) -> usize {
        self.gathering.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

/// A read open to joiners; closed when dropped, also when its caller goes away while it
/// gathers (the joiners then see the sender gone, and read on their own).
struct Gathering<'a, K: Hash + Eq, V> {
    reads: &'a SharedReads<K, V>,
    key: K,
    rx: watch::Receiver<Answer<V>>,
}

impl<K: Hash + Eq, V> Drop for Gathering<'_, K, V> {
    fn drop(&mut self) {
        let mut gathering = self.reads.gathering.lock().unwrap_or_else(PoisonError::into_inner);
        // Only this read's entry: a later one may have the key by now.
        if gathering.get(&self.key).is_some_and(|rx| rx.same_channel(&self.rx)) {
            gathering.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::sync::oneshot;

    type Reads = SharedReads<&'static str, u64>;

    /// A read that counts itself and answers what `value` holds when it starts.
    async fn counted(made: &AtomicUsize, value: &AtomicUsize) -> Result<u64, String> {
        made.fetch_add(1, Ordering::SeqCst);
        Ok(value.load(Ordering::SeqCst) as u64)
    }

    #[tokio::test(start_paused = true)]
    async fn callers_asking_at_once_share_one_read() {
        let reads = Reads::new(GATHER);
        let (made, value) = (AtomicUsize::new(0), AtomicUsize::new(7));
        let answers =
            futures::future::join_all((0..10).map(|_| reads.read("team-a/checkout", || counted(&made, &value)))).await;
        assert_eq!(made.load(Ordering::SeqCst), 1, "one read for ten callers");
        assert!(answers.iter().all(|a| a == &Ok(7)), "{answers:?}");
        assert_eq!(reads.gathering(), 0, "nothing left open");
    }

    #[tokio::test(start_paused = true)]
    async fn other_projects_are_read_apart() {
        let reads = Reads::new(GATHER);
        let (made, value) = (AtomicUsize::new(0), AtomicUsize::new(1));
        let (a, b) = tokio::join!(
            reads.read("team-a/checkout", || counted(&made, &value)),
            reads.read("team-a/billing", || counted(&made, &value)),
        );
        assert_eq!((a, b), (Ok(1), Ok(1)));
        assert_eq!(made.load(Ordering::SeqCst), 2);
    }

    /// The promise the reconciles rely on: a caller never gets a read that started before
    /// it asked, so a change committed before the call is in the answer.
    #[tokio::test(start_paused = true)]
    async fn a_caller_never_joins_a_read_already_under_way() {
        let reads = Reads::new(GATHER);
        let value = AtomicUsize::new(1);
        let (started_tx, started_rx) = oneshot::channel::<()>();
        let (finish_tx, finish_rx) = oneshot::channel::<()>();
        let first = reads.read("p", || async {
            let seen = value.load(Ordering::SeqCst) as u64;
            let _ = started_tx.send(());
            let _ = finish_rx.await;
            Ok::<_, String>(seen)
        });
        let second = async {
            started_rx.await.expect("the first read started");
            // A change commits while the first read is under way; then the second asks.
            value.store(2, Ordering::SeqCst);
            let answer = reads.read("p", || async { Ok::<_, String>(value.load(Ordering::SeqCst) as u64) }).await;
            let _ = finish_tx.send(());
            answer
        };
        let (first, second) = tokio::join!(first, second);
        assert_eq!(first, Ok(1));
        assert_eq!(second, Ok(2), "the second caller read after the change");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_read_leaves_each_joiner_to_read_alone() {
        let reads = Reads::new(GATHER);
        let made = AtomicUsize::new(0);
        let first = reads.read("p", || async {
            made.fetch_add(1, Ordering::SeqCst);
            Err::<u64, _>("connection reset".to_string())
        });
        let second = reads.read("p", || async {
            made.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(3)
        });
        let (first, second) = tokio::join!(first, second);
        assert_eq!(first, Err("connection reset".to_string()));
        assert_eq!(second, Ok(3), "the joiner made its own read");
        assert_eq!(made.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_gone_while_gathering_does_not_strand_its_joiners() {
        let reads = Reads::new(GATHER);
        let (made, value) = (AtomicUsize::new(0), AtomicUsize::new(5));
        let mut first = Box::pin(reads.read("p", || counted(&made, &value)));
        // The first caller starts gathering, then is dropped (its reconcile cancelled).
        assert!(futures::poll!(first.as_mut()).is_pending());
        let joiner = reads.read("p", || counted(&made, &value));
        let mut joiner = Box::pin(joiner);
        assert!(futures::poll!(joiner.as_mut()).is_pending());
        drop(first);
        assert_eq!(reads.gathering(), 0, "the dropped read is closed");
        assert_eq!(joiner.await, Ok(5), "the joiner read on its own");
        assert_eq!(reads.read("p", || counted(&made, &value)).await, Ok(5), "a later caller is not stuck");
        assert_eq!(made.load(Ordering::SeqCst), 2);
    }
}

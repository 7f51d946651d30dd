//! "The status of these resources must be refreshed": sent by whatever changed what a
//! status shows (an election, a Run's hello, the runtime registry going or coming back),
//! received by the reconcilers of the leader replica, whichever replica sent it.
//!
//! One path for every signal: a Postgres NOTIFY on a channel per kind, payload
//! `namespace/name`. Sent inside the transaction that made the change, it is delivered
//! at commit and never for a rolled-back change; the leader LISTENs and feeds each
//! notification once into its controllers. Notifications sent while the listener is not
//! connected (Postgres restarting, the leader just elected) are lost, so every time it
//! (re)connects it asks the controllers to reconcile everything once: nothing waits for
//! a periodic requeue after an outage.

use std::time::Duration;

use kube::runtime::reflector::ObjectRef;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tracing::warn;

use crate::crd::{ControllerRegistration, RunSession};
pub use crate::reconcilers::Receivers;
pub use prism_store::refresh::{Kind, NamespacedName, announce, announce_now};

struct Senders {
    registrations: mpsc::UnboundedSender<ObjectRef<ControllerRegistration>>,
    run_sessions: mpsc::UnboundedSender<ObjectRef<RunSession>>,
    all_registrations: mpsc::UnboundedSender<()>,
    all_run_sessions: mpsc::UnboundedSender<()>,
}

impl Senders {
    /// Signals may have been missed: refresh everything once.
    fn deliver_all(&self) {
        // As in `deliver`: a closed receiver means the controllers are stopping.
        let _ = self.all_registrations.send(());
        let _ = self.all_run_sessions.send(());
    }

    fn deliver(&self, channel: &str, payload: &str) {
        let Some(target) = NamespacedName::from_payload(payload) else {
            warn!(channel, payload, "ignoring a refresh signal that names no namespace/name");
            return;
        };
        // A closed receiver means the controllers are stopping: nothing left to refresh.
        if channel == Kind::Registration.channel() {
            let _ = self.registrations.send(ObjectRef::new(&target.name).within(&target.namespace));
        } else if channel == Kind::RunSession.channel() {
            let _ = self.run_sessions.send(ObjectRef::new(&target.name).within(&target.namespace));
        }
    }
}

/// Listens on both channels until the returned receivers are dropped: returns them and
/// the listening loop, which the caller runs beside its controllers.
pub fn listen(pool: PgPool) -> (Receivers, impl Future<Output = ()>) {
    let (registrations, registrations_rx) = mpsc::unbounded_channel();
    let (run_sessions, run_sessions_rx) = mpsc::unbounded_channel();
    let (all_registrations, all_registrations_rx) = mpsc::unbounded_channel();
    let (all_run_sessions, all_run_sessions_rx) = mpsc::unbounded_channel();
    let senders = Senders { registrations, run_sessions, all_registrations, all_run_sessions };
    let receivers = Receivers {
        registrations: registrations_rx,
        run_sessions: run_sessions_rx,
        all_registrations: all_registrations_rx,
        all_run_sessions: all_run_sessions_rx,
    };
    (receivers, listen_loop(pool, senders))
}

async fn listen_loop(pool: PgPool, senders: Senders) {
    const RETRY: Duration = Duration::from_secs(2);
    // A connection of its own: one taken from the controllers' pool would be one fewer.
    let pool = crate::db::listener_pool(&pool);
    while !senders.registrations.is_closed() {
        let mut listener = match sqlx::postgres::PgListener::connect_with(&pool).await {
            Ok(mut listener) => {
                listener.eager_reconnect(false);
                listener
            }
            Err(error) => {
                warn!(%error, "refresh signals: cannot connect to LISTEN; retrying");
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        if let Err(error) = listener.listen_all([Kind::Registration.channel(), Kind::RunSession.channel()]).await {
            warn!(%error, "refresh signals: LISTEN failed; retrying");
            tokio::time::sleep(RETRY).await;
            continue;
        }
        senders.deliver_all();
        loop {
            // Not `recv`: it reconnects silently, and what was sent meanwhile would be
            // lost without the `deliver_all` a new connection owes.
            match listener.try_recv().await {
                Ok(Some(notification)) => senders.deliver(notification.channel(), notification.payload()),
                Ok(None) => {
                    warn!("refresh signals: listener lost its connection; reconnecting");
                    break;
                }
                Err(error) => {
                    warn!(%error, "refresh signals: listener failed; reconnecting");
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_signal_reaches_its_own_kind_once() {
        let (registrations, mut reg_rx) = mpsc::unbounded_channel();
        let (run_sessions, mut run_rx) = mpsc::unbounded_channel();
        let (all_registrations, mut all_reg_rx) = mpsc::unbounded_channel();
        let (all_run_sessions, mut all_run_rx) = mpsc::unbounded_channel();
        let senders = Senders { registrations, run_sessions, all_registrations, all_run_sessions };
        senders.deliver(Kind::Registration.channel(), "a/r1");
        senders.deliver(Kind::RunSession.channel(), "b/s1");
        senders.deliver("other", "c/x");
        assert_eq!(reg_rx.try_recv().ok(), Some(ObjectRef::new("r1").within("a")));
        assert!(reg_rx.try_recv().is_err(), "delivered once");
        assert_eq!(run_rx.try_recv().ok(), Some(ObjectRef::new("s1").within("b")));
        assert!(run_rx.try_recv().is_err());
        assert!(all_reg_rx.try_recv().is_err() && all_run_rx.try_recv().is_err(), "no resync without a reconnect");
        senders.deliver_all();
        assert_eq!((all_reg_rx.try_recv().ok(), all_run_rx.try_recv().ok()), (Some(()), Some(())));
    }
}

//! "Reconcile this now" for resources an election or a Run's hello changed: the HTTP
//! API, the store's callers and the NOTIFY listener send, the leader's controllers
//! receive. Its own module so that the election and API layers need nothing of the
//! controllers.

use std::sync::Arc;

use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc;

use crate::crd::{ControllerRegistration, RunSession};
use crate::election::Touched;

/// Sends "reconcile this now" for resources changed from elsewhere (an election, a
/// hello), so their status follows within a second rather than at the next resync.
/// The receiving ends belong to the controllers of the current term of leadership:
/// `open()` makes new ones each term; with no controllers running here, sends are dropped.
#[derive(Clone, Default)]
pub struct Triggers {
    registrations: Arc<std::sync::Mutex<Option<mpsc::UnboundedSender<ObjectRef<ControllerRegistration>>>>>,
    runsessions: Arc<std::sync::Mutex<Option<mpsc::UnboundedSender<ObjectRef<RunSession>>>>>,
}

impl Triggers {
    pub fn registrations(&self, touched: impl IntoIterator<Item = Touched>) {
        if let Ok(slot) = self.registrations.lock()
            && let Some(tx) = slot.as_ref()
        {
            for t in touched {
                let _ = tx.send(ObjectRef::new(&t.name).within(&t.namespace));
            }
        }
    }

    pub fn runsession(&self, namespace: &str, name: &str) {
        if let Ok(slot) = self.runsessions.lock()
            && let Some(tx) = slot.as_ref()
        {
            let _ = tx.send(ObjectRef::new(name).within(namespace));
        }
    }

    /// New channels for a new set of controllers; the previous receivers stop receiving.
    pub fn open(&self) -> Receivers {
        let (reg_tx, reg_rx) = mpsc::unbounded_channel();
        let (run_tx, run_rx) = mpsc::unbounded_channel();
        if let Ok(mut slot) = self.registrations.lock() {
            *slot = Some(reg_tx);
        }
        if let Ok(mut slot) = self.runsessions.lock() {
            *slot = Some(run_tx);
        }
        Receivers { registrations: reg_rx, runsessions: run_rx }
    }
}

pub struct Receivers {
    pub(crate) registrations: mpsc::UnboundedReceiver<ObjectRef<ControllerRegistration>>,
    pub(crate) runsessions: mpsc::UnboundedReceiver<ObjectRef<RunSession>>,
}

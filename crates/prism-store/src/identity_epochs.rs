//! The newest epoch of each Run address this replica has heard of (`Signals`), so that a
//! heartbeat — which reads only Redis — refuses a session of an older epoch even while
//! Redis does not know it (SPEC §12: revocations are level-triggered). The reconciler's
//! fence ends such a session in Redis; when that write failed, or a Redis failover or
//! restore lost it, the session went on heartbeating and its RunSession showed Online.
//!
//! Epochs come from one Postgres sequence and only rise: an address's live identity has
//! the newest epoch of its address (a rotation or a revocation takes a new one; a new
//! identity after a revocation, a newer one still). So the map keeps the largest epoch
//! heard per address, and a session is stale only when its epoch is below it. What the
//! map does not know (not heard of yet, evicted, never listened) refuses nothing: Redis's
//! fence and the claims' Postgres check stay the first lines.

use crate::run_registry::RunAddress;

/// Addresses remembered at most; past it the least used are forgotten (they refuse
/// nothing then). A RunSession is one entry: a tenant creating many fills this, never
/// memory.
const MAX_ADDRESSES: u64 = 200_000;

#[derive(Clone)]
pub struct IdentityEpochs {
    newest: moka::sync::Cache<RunAddress, i64>,
}

impl Default for IdentityEpochs {
    fn default() -> Self {
        Self::with_capacity(MAX_ADDRESSES)
    }
}

impl IdentityEpochs {
    fn with_capacity(capacity: u64) -> Self {
        Self { newest: moka::sync::Cache::builder().max_capacity(capacity).build() }
    }

    /// `epoch` was taken at `address` (heard, or read at a rescan).
    pub fn heard(&self, address: &RunAddress, epoch: i64) {
        self.newest.entry_by_ref(address).and_upsert_with(|known| match known {
            Some(known) if *known.value() >= epoch => *known.value(),
            _ => epoch,
        });
    }

    /// Whether a session opened in `epoch` at `address` is known to be of an older one.
    pub fn stale(&self, address: &RunAddress, epoch: i64) -> bool {
        self.newest.get(address).is_some_and(|newest| epoch < newest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(server: &str) -> RunAddress {
        RunAddress { server_instance_id: server.into(), component_kind: "run".into() }
    }

    #[test]
    fn a_session_is_stale_only_below_the_newest_epoch_heard_at_its_address() {
        let epochs = IdentityEpochs::default();
        assert!(!epochs.stale(&at("a"), 1), "nothing heard: nothing refused");
        epochs.heard(&at("a"), 5);
        assert!(epochs.stale(&at("a"), 4));
        assert!(!epochs.stale(&at("a"), 5), "the current epoch");
        assert!(!epochs.stale(&at("a"), 6), "a hello newer than what was heard");
        assert!(!epochs.stale(&at("b"), 1), "another address");
        epochs.heard(&at("a"), 3);
        assert!(epochs.stale(&at("a"), 4), "an older epoch heard late never lowers it");
    }

    proptest! {
        /// Whatever order the epochs are heard in, the verdict is the one of their maximum.
        #[test]
        fn heard_in_any_order_the_newest_wins(heard in proptest::collection::vec(1i64..100, 1..20), session in 1i64..100) {
            let epochs = IdentityEpochs::default();
            for e in &heard {
                epochs.heard(&at("a"), *e);
            }
            let newest = heard.iter().copied().max().unwrap_or(0);
            prop_assert_eq!(epochs.stale(&at("a"), session), session < newest);
        }
    }
}

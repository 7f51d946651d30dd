//! Rate limits (SPEC §12 "Bounded"): on what a caller can make the operator do before it
//! knows who the caller is — a TokenReview for a token not seen lately, a hello — charged
//! to the source address; on proven hellos, charged to the Run identity; and on the calls
//! of a proven Kubernetes identity, charged to it. All are keyed token buckets (governor);
//! a spent bucket is 429 `rate_limited` with `Retry-After`. Buckets are this replica's: behind a Service of N replicas a caller
//! gets up to N times the rate, which still bounds it.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

use super::ApiError;

/// A rate: so many a second, with a burst of so many at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub per_second: NonZeroU32,
    pub burst: NonZeroU32,
}

impl Rate {
    fn quota(self) -> Quota {
        Quota::per_second(self.per_second).allow_burst(self.burst)
    }
}

pub struct Limits {
    /// Requests that cost a TokenReview (a token not in the cache), and hellos, per
    /// source address.
    per_address: DefaultKeyedRateLimiter<IpAddr>,
    /// Hellos per Run identity (`server/component`).
    hellos: DefaultKeyedRateLimiter<String>,
    /// Authenticated calls per Kubernetes identity (its username).
    per_identity: DefaultKeyedRateLimiter<String>,
}

impl Limits {
    pub fn new(unauthenticated: Rate, hellos: Rate, per_identity: Rate) -> Self {
        Self {
            per_address: RateLimiter::keyed(unauthenticated.quota()),
            hellos: RateLimiter::keyed(hellos.quota()),
            per_identity: RateLimiter::keyed(per_identity.quota()),
        }
    }

    /// Counts one call of a Kubernetes identity the API server has vouched for
    /// (`PRISM_RATE_PER_IDENTITY`): a flood of one identity's calls is refused before it
    /// costs access reviews and database work that other tenants wait behind.
    pub fn identity(&self, username: &str) -> Result<(), ApiError> {
        spend(&self.per_identity, &username.to_string(), "too many calls of this identity")
    }

    /// Counts one unauthenticated request of `peer` (none known: not limited; every
    /// server this operator runs tells the handlers the peer).
    pub fn unauthenticated(&self, peer: Option<IpAddr>) -> Result<(), ApiError> {
        match peer {
            Some(ip) => spend(&self.per_address, &ip, "too many unauthenticated requests from this address"),
            None => Ok(()),
        }
    }

    /// Counts one hello for a Run identity whose proof checked out (`identity`:
    /// `server/component`, validated). Charged only after the signature verifies, so that
    /// nobody can spend a Run's budget with hellos in its name (SPEC §12); what came before
    /// the proof was charged to the source address (`unauthenticated`).
    pub fn proven_hello(&self, identity: &str) -> Result<(), ApiError> {
        spend(&self.hellos, &identity.to_string(), "too many hellos for this Run identity")
    }

    /// Forgets buckets that are full again, so the key sets do not grow with every
    /// address or identity ever seen (run every few seconds).
    pub fn prune(&self) {
        self.per_address.retain_recent();
        self.per_address.shrink_to_fit();
        self.hellos.retain_recent();
        self.hellos.shrink_to_fit();
        self.per_identity.retain_recent();
        self.per_identity.shrink_to_fit();
    }

    /// Keys held (for tests).
    pub fn tracked(&self) -> usize {
        self.per_address.len() + self.hellos.len() + self.per_identity.len()
    }
}

fn spend<K: std::hash::Hash + Eq + Clone>(
    limiter: &DefaultKeyedRateLimiter<K>,
    key: &K,
    message: &str,
) -> Result<(), ApiError> {
    limiter.check_key(key).map_err(|not_until| {
        let wait = not_until.wait_time_from(DefaultClock::default().now());
        ApiError::rate_limited(message, wait.max(Duration::from_secs(1)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(per_second: u32, burst: u32) -> Rate {
        Rate {
            per_second: NonZeroU32::new(per_second).expect("non-zero"),
            burst: NonZeroU32::new(burst).expect("non-zero"),
        }
    }

    #[test]
    fn a_spent_bucket_is_429_with_retry_after_and_other_keys_are_unaffected() {
        let limits = Limits::new(rate(1, 3), rate(1, 2), rate(1, 2));
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        for _ in 0..3 {
            assert!(limits.unauthenticated(Some(a)).is_ok());
        }
        let refused = limits.unauthenticated(Some(a)).expect_err("burst spent");
        assert_eq!((refused.status.as_u16(), refused.code), (429, "rate_limited"));
        assert!(refused.retry_after.is_some_and(|d| d >= Duration::from_secs(1)));
        assert!(limits.unauthenticated(Some(b)).is_ok(), "another address has its own bucket");
        assert!(limits.unauthenticated(None).is_ok());

        // Proven hellos spend the identity's bucket, and nothing else.
        assert!(limits.proven_hello("srv/run").is_ok());
        assert!(limits.proven_hello("srv/run").is_ok());
        assert_eq!(limits.proven_hello("srv/run").expect_err("hello burst spent").code, "rate_limited");
        assert!(limits.proven_hello("srv/other").is_ok(), "another identity has its own bucket");
        let c: IpAddr = "10.0.0.3".parse().expect("ip");
        assert!(limits.unauthenticated(Some(c)).is_ok(), "the address's bucket is its own");

        // A proven identity's calls spend its own bucket.
        assert!(limits.identity("system:serviceaccount:a:agent").is_ok());
        assert!(limits.identity("system:serviceaccount:a:agent").is_ok());
        assert_eq!(limits.identity("system:serviceaccount:a:agent").expect_err("spent").code, "rate_limited");
        assert!(limits.identity("system:serviceaccount:b:agent").is_ok(), "another identity has its own bucket");
    }
}

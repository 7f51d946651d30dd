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
    /// Run session tokens that checked out lately (their SHA-256): a Run's own calls are
    /// not charged to its address; any other token is, before it costs a Redis look-up.
    known_sessions: moka::sync::Cache<[u8; 32], ()>,
    /// Run addresses whose drain change was announced within `DRAIN_ANNOUNCE_EVERY`, and
    /// those with an announcement waiting for its turn.
    drain_announced: moka::sync::Cache<String, ()>,
    drain_waiting: moka::sync::Cache<String, ()>,
}

/// At most one status refresh per Run address this often for its drain changes: a Run
/// that flips `draining` on every heartbeat, as fast as it likes, costs the API server
/// one status write (and Event) per period, not one per flip.
pub const DRAIN_ANNOUNCE_EVERY: Duration = Duration::from_secs(2);

/// When to announce a Run's drain change (`Limits::drain_announce`).
#[derive(Debug, PartialEq, Eq)]
pub enum Announce {
    /// Now.
    Now,
    /// After `DRAIN_ANNOUNCE_EVERY` (then `drain_announced_late`): the latest state is
    /// announced then.
    Later,
    /// Not at all: an announcement already waits, and will carry this change too.
    Waiting,
}

/// How long a session token that checked out is taken for known (a Run calls every few
/// seconds; a token superseded meanwhile is refused by the look-up all the same).
const KNOWN_SESSION_TTL: Duration = Duration::from_secs(600);

impl Limits {
    pub fn new(unauthenticated: Rate, hellos: Rate, per_identity: Rate) -> Self {
        Self {
            per_address: RateLimiter::keyed(unauthenticated.quota()),
            hellos: RateLimiter::keyed(hellos.quota()),
            per_identity: RateLimiter::keyed(per_identity.quota()),
            known_sessions: moka::sync::Cache::builder().max_capacity(100_000).time_to_live(KNOWN_SESSION_TTL).build(),
            drain_announced: moka::sync::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(DRAIN_ANNOUNCE_EVERY)
                .build(),
            drain_waiting: moka::sync::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(DRAIN_ANNOUNCE_EVERY * 5)
                .build(),
        }
    }

    /// A Run address's drain changed: when to have its status refreshed.
    pub fn drain_announce(&self, address: &str) -> Announce {
        if self.drain_announced.contains_key(address) {
            if self.drain_waiting.contains_key(address) {
                return Announce::Waiting;
            }
            self.drain_waiting.insert(address.to_string(), ());
            return Announce::Later;
        }
        self.drain_announced.insert(address.to_string(), ());
        Announce::Now
    }

    /// The waiting announcement of `address` is being made now.
    pub fn drain_announced_late(&self, address: &str) {
        self.drain_waiting.invalidate(address);
        self.drain_announced.insert(address.to_string(), ());
    }

    /// Counts a request with a Run session token against its source address, unless the
    /// token checked out lately (SPEC §12: the session routes are no way around the
    /// per-address limit; a flood of made-up tokens is refused before its look-ups).
    pub fn session_token(&self, token: &str, peer: Option<IpAddr>) -> Result<(), ApiError> {
        if self.known_sessions.contains_key(&token_digest(token)) {
            return Ok(());
        }
        self.unauthenticated(peer)
    }

    /// A session token checked out (`valid`), or was refused (not valid).
    pub fn session_checked(&self, token: &str, valid: bool) {
        if valid {
            self.known_sessions.insert(token_digest(token), ());
        } else {
            self.known_sessions.invalidate(&token_digest(token));
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

fn token_digest(token: &str) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::digest(token.as_bytes()).into()
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

        // Session tokens: unknown ones spend the address's bucket; one that checked out
        // does not, until it is refused.
        let d: IpAddr = "10.0.0.4".parse().expect("ip");
        limits.session_checked("prs1.good", true);
        for _ in 0..10 {
            assert!(limits.session_token("prs1.good", Some(d)).is_ok());
        }
        for n in 0..3 {
            assert!(limits.session_token(&format!("prs1.made-up-{n}"), Some(d)).is_ok());
        }
        assert!(limits.session_token("prs1.made-up-9", Some(d)).is_err(), "the address's burst is spent");
        assert!(limits.session_token("prs1.good", Some(d)).is_ok(), "the known token is not charged");
        limits.session_checked("prs1.good", false);
        assert!(limits.session_token("prs1.good", Some(d)).is_err(), "refused once, it is charged again");

        // Drain announcements: one now, one later for any number of changes meanwhile.
        assert_eq!(limits.drain_announce("srv/run"), Announce::Now);
        assert_eq!(limits.drain_announce("srv/run"), Announce::Later);
        for _ in 0..10 {
            assert_eq!(limits.drain_announce("srv/run"), Announce::Waiting);
        }
        assert_eq!(limits.drain_announce("srv/other"), Announce::Now, "each address its own");
        limits.drain_announced_late("srv/run");
        assert_eq!(limits.drain_announce("srv/run"), Announce::Later, "the late one started a new period");
    }
}

//! Live roles as an agent's heartbeat answers them, kept in memory while this replica
//! hears every change of the election (issue 19: "invalidate on change (the NOTIFY path
//! exists), or do not cache roles"; issue 23: the role read was 62 % of the steady
//! Postgres load at 10,000 sessions).
//!
//! An entry is used only when nothing may have changed its project since the read that
//! made it began. Every read takes a ticket from one counter before it starts; every
//! change of a project (this process's own commits at once, other replicas' through the
//! `prism_projects` NOTIFY) takes one too and is remembered per project. An entry whose
//! ticket is older than its project's last change, or than the moment this replica last
//! started listening, is not used and not stored. While not listening (starting, Postgres
//! restarting) nothing is used: every answer reads Postgres, as before.
//!
//! So an answer is never older than a change this replica committed, and older than
//! another replica's change only by that NOTIFY's delivery (the time Postgres takes to
//! hand a committed notification to a listener: milliseconds). Entries also expire
//! after `ENTRY_TTL`, a bound on anything missed by a path that does not notify.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;

use super::LiveRole;
use crate::signals::{ProjectKey, SessionKey};

/// How long an entry is used at most: the bound on a change no NOTIFY tells of. Agents
/// heartbeat about once a minute, so each session reads Postgres once in this time (it
/// was 300 s: 33 reads a second at 10,000 sessions, a third of the steady load).
pub const ENTRY_TTL: Duration = prism_core::store::UNNOTIFIED_CHANGE_BOUND;
/// A project's last change is remembered longer than any entry read before it lives.
const CHANGE_TTL: Duration = Duration::from_secs(ENTRY_TTL.as_secs() + 60);
/// Sessions held at most; beyond it the least used go (they read Postgres again).
const MAX_ENTRIES: u64 = 100_000;

/// A read's place in the order of reads and changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket(u64);

/// Shared by every store of the process and by its signal listener (clones share).
#[derive(Clone)]
pub struct LiveRoles {
    inner: Arc<Inner>,
}

struct Inner {
    clock: AtomicU64,
    /// False until the listener has started, and whenever it lost its connection.
    listening: AtomicBool,
    /// The clock when listening last started or stopped: older reads are not trusted.
    since: AtomicU64,
    /// Project -> the clock at its last change.
    changed: moka::sync::Cache<ProjectKey, u64>,
    entries: moka::sync::Cache<SessionKey, (u64, LiveRole)>,
    /// Roles read from Postgres (`prism_controller_role_reads_total`): the rest were held.
    reads: Counter,
}

impl Default for LiveRoles {
    fn default() -> Self {
        Self::counting(Counter::default())
    }
}

impl LiveRoles {
    /// Counts the reads from Postgres in `reads`.
    pub fn counting(reads: Counter) -> Self {
        LiveRoles {
            inner: Arc::new(Inner {
                clock: AtomicU64::new(1),
                listening: AtomicBool::new(false),
                since: AtomicU64::new(0),
                changed: moka::sync::Cache::builder().time_to_live(CHANGE_TTL).build(),
                entries: moka::sync::Cache::builder().max_capacity(MAX_ENTRIES).time_to_live(ENTRY_TTL).build(),
                reads,
            }),
        }
    }
}

impl LiveRoles {
    fn tick(&self) -> u64 {
        self.inner.clock.fetch_add(1, Ordering::SeqCst)
    }

    /// Taken before a read from Postgres begins (and counts it).
    pub fn ticket(&self) -> Ticket {
        self.inner.reads.inc();
        Ticket(self.tick())
    }

    /// Whether a read that took `ticket` may answer for `project` now: listening, and
    /// no change of the project (or gap in listening) since the ticket.
    fn current(&self, ticket: u64, project: &ProjectKey) -> bool {
        self.inner.listening.load(Ordering::SeqCst)
            && ticket > self.inner.since.load(Ordering::SeqCst)
            && self.inner.changed.get(project).is_none_or(|at| ticket > at)
    }

    /// The session's role, if one is held and still current.
    pub fn get(&self, namespace: &str, session_id: &str) -> Option<LiveRole> {
        let key = SessionKey { namespace: namespace.to_string(), session_id: session_id.to_string() };
        let (ticket, role) = self.inner.entries.get(&key)?;
        let project = ProjectKey { namespace: key.namespace.clone(), project_id: role.project_id.clone() };
        if self.current(ticket, &project) {
            Some(role)
        } else {
            self.inner.entries.invalidate(&key);
            None
        }
    }

    /// Keeps what a read that took `ticket` found, unless something changed since.
    pub fn put(&self, ticket: Ticket, namespace: &str, session_id: &str, role: &LiveRole) {
        let project = ProjectKey { namespace: namespace.to_string(), project_id: role.project_id.clone() };
        if self.current(ticket.0, &project) {
            let key = SessionKey { namespace: namespace.to_string(), session_id: session_id.to_string() };
            self.inner.entries.insert(key, (ticket.0, role.clone()));
        }
    }

    /// The project's election changed (a commit of this process, or a notification).
    pub fn changed(&self, namespace: &str, project_id: &str) {
        let project = ProjectKey { namespace: namespace.to_string(), project_id: project_id.to_string() };
        self.inner.changed.insert(project, self.tick());
    }

    /// The listener (re)started: changes made before are not known; reads from now on are.
    pub fn listening(&self) {
        self.inner.since.store(self.tick(), Ordering::SeqCst);
        self.inner.listening.store(true, Ordering::SeqCst);
    }

    /// The listener stopped: nothing held is used until it is back.
    pub fn deaf(&self) {
        self.inner.listening.store(false, Ordering::SeqCst);
        self.inner.since.store(self.tick(), Ordering::SeqCst);
        self.inner.entries.invalidate_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn role(project: &str, master: bool) -> LiveRole {
        LiveRole { project_id: project.into(), is_master: master, preempted: false, project_term: 1, owner: None }
    }

    fn listening() -> LiveRoles {
        let roles = LiveRoles::default();
        roles.listening();
        roles
    }

    #[test]
    fn a_read_is_kept_and_answers_until_its_project_changes() {
        let roles = listening();
        let t = roles.ticket();
        roles.put(t, "ns", "s", &role("P", true));
        assert_eq!(roles.get("ns", "s"), Some(role("P", true)));
        roles.changed("ns", "Q");
        assert_eq!(roles.get("ns", "s"), Some(role("P", true)), "another project's change leaves it");
        roles.changed("other", "P");
        assert_eq!(roles.get("ns", "s"), Some(role("P", true)), "the same project id in another namespace too");
        roles.changed("ns", "P");
        assert_eq!(roles.get("ns", "s"), None, "its project changed");
        assert_eq!(roles.get("ns", "s"), None);
    }

    #[test]
    fn a_read_that_began_before_a_change_is_not_kept() {
        let roles = listening();
        let t = roles.ticket();
        // The change commits while the read is on its way: it may have read either side.
        roles.changed("ns", "P");
        roles.put(t, "ns", "s", &role("P", true));
        assert_eq!(roles.get("ns", "s"), None);
        // A read after the change is kept.
        let t = roles.ticket();
        roles.put(t, "ns", "s", &role("P", false));
        assert_eq!(roles.get("ns", "s"), Some(role("P", false)));
    }

    #[test]
    fn nothing_is_used_or_kept_while_not_listening() {
        let roles = LiveRoles::default();
        let t = roles.ticket();
        roles.put(t, "ns", "s", &role("P", true));
        assert_eq!(roles.get("ns", "s"), None, "before the listener started");
        roles.listening();
        roles.put(t, "ns", "s", &role("P", true));
        assert_eq!(roles.get("ns", "s"), None, "a read from before it started");
        let t = roles.ticket();
        roles.put(t, "ns", "s", &role("P", true));
        assert_eq!(roles.get("ns", "s"), Some(role("P", true)));
        roles.deaf();
        assert_eq!(roles.get("ns", "s"), None, "lost the connection: changes may be missed");
        roles.listening();
        assert_eq!(roles.get("ns", "s"), None, "what was held before the gap stays gone");
        let late = roles.ticket();
        roles.deaf();
        roles.listening();
        roles.put(late, "ns", "s", &role("P", true));
        assert_eq!(roles.get("ns", "s"), None, "a read across a gap is not kept");
    }
}

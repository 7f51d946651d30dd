//! The election rules of SPEC §4 as one pure function: the live candidates of a project
//! plus an event in, the next state and the list of role changes out. No I/O, no clock:
//! the store around it reads candidates under a project lock and writes the result.

use std::cmp::Ordering;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{AgentSurface, ReleaseReason};
use crate::text_enum;

/// A live registration as the election sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub id: Uuid,
    pub surface: AgentSurface,
    pub registered_at: DateTime<Utc>,
    pub is_master: bool,
}

/// One project's live registrations and its current term.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ProjectState {
    pub term: i64,
    pub live: Vec<Candidate>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A registration arrives (its `is_master` is ignored).
    Register(Candidate),
    /// Registrations leave: wrap, context switch, or a stale sweep (several at once).
    Release { ids: Vec<Uuid>, reason: ReleaseReason },
}

text_enum! {
    /// Why the master changed; stored in `controller_election_events.cause`.
    pub enum Cause {
        /// A registration became master of a project that had none.
        Elected = "elected",
        /// A desktop registration took over from a non-desktop master.
        Preempted = "preempted",
        /// The master left for one of these reasons (and a successor, if any, was promoted).
        Wrapped = "wrapped",
        ContextSwitch = "context_switch",
        StaleHeartbeatIncident = "stale_heartbeat_incident",
    }
}

#[cfg(feature = "sqlx")]
crate::sqlx_text!(Cause);
#[cfg(feature = "utoipa")]
crate::utoipa_text!(Cause);

impl From<ReleaseReason> for Cause {
    fn from(reason: ReleaseReason) -> Self {
        match reason {
            ReleaseReason::Wrapped => Cause::Wrapped,
            ReleaseReason::ContextSwitch => Cause::ContextSwitch,
            ReleaseReason::StaleHeartbeatIncident => Cause::StaleHeartbeatIncident,
        }
    }
}

/// A change of master, for the election history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MasterChange {
    pub previous: Option<Uuid>,
    /// None: the project is left without a master (nobody live).
    pub master: Option<Uuid>,
    pub cause: Cause,
}

/// What one registration's role became.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// A new registration joined as master.
    JoinedAsMaster,
    /// A new registration joined as peer.
    JoinedAsPeer,
    /// The master became a peer because a desktop registered (sets `preempted`).
    Preempted { by: Uuid },
    /// A peer became master because the master left.
    Promoted,
    /// The registration left (it was master or peer).
    Released { was_master: bool, reason: ReleaseReason },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The project after the event.
    pub next: ProjectState,
    /// Set when the master changed; `next.term` has then risen by one if there is a master.
    pub master_change: Option<MasterChange>,
    /// Every registration whose role changed, in the order to apply them (demotions and
    /// releases before promotions, so the single-master index is never violated).
    pub transitions: Vec<(Uuid, Transition)>,
}

impl ProjectState {
    pub fn master(&self) -> Option<&Candidate> {
        self.live.iter().find(|c| c.is_master)
    }
}

/// Succession order (rules 3 and 5): desktops first, then earliest `registered_at`, then
/// the smaller id, so the outcome never depends on row order.
pub fn succession_order(a: &Candidate, b: &Candidate) -> Ordering {
    b.surface
        .is_desktop()
        .cmp(&a.surface.is_desktop())
        .then(a.registered_at.cmp(&b.registered_at))
        .then(a.id.cmp(&b.id))
}

fn best(live: &[Candidate]) -> Option<Uuid> {
    live.iter().min_by(|a, b| succession_order(a, b)).map(|c| c.id)
}

fn set_master(live: &mut [Candidate], id: Uuid) {
    for c in live.iter_mut() {
        c.is_master = c.id == id;
    }
}

/// Applies one event to a project (SPEC §4 rules 1-6; rule 7, the context switch, is a
/// release on the old project followed by a registration on the new one).
pub fn decide(state: &ProjectState, event: &Event) -> Decision {
    let mut next = state.clone();
    let previous = state.master().map(|c| c.id);
    let mut transitions = Vec::new();
    let mut master_change = None;

    match event {
        Event::Register(new) => {
            // Rule 6: the same registration again changes nothing.
            if state.live.iter().any(|c| c.id == new.id) {
                return Decision { next, master_change: None, transitions };
            }
            next.live.push(Candidate { is_master: false, ..new.clone() });
            match state.master() {
                // Rule 1: no live master, so this election installs one. Normally the
                // newcomer is alone; if earlier state left peers without a master, the
                // succession order repairs it.
                None => {
                    let winner = best(&next.live).unwrap_or(new.id);
                    set_master(&mut next.live, winner);
                    next.term += 1;
                    for c in &next.live {
                        let t = match (c.id == new.id, c.id == winner) {
                            (true, true) => Transition::JoinedAsMaster,
                            (true, false) => Transition::JoinedAsPeer,
                            (false, true) => Transition::Promoted,
                            (false, false) => continue,
                        };
                        transitions.push((c.id, t));
                    }
                    // Newcomer last among promotions: apply demotions/releases first.
                    transitions.sort_by_key(|(id, _)| *id == new.id);
                    master_change = Some(MasterChange { previous, master: Some(winner), cause: Cause::Elected });
                }
                // Rule 2: a desktop registering preempts a non-desktop master (only a registration
                // preempts: a heartbeat or a wrap never does).
                Some(master) if new.surface.is_desktop() && !master.surface.is_desktop() => {
                    set_master(&mut next.live, new.id);
                    next.term += 1;
                    transitions.push((master.id, Transition::Preempted { by: new.id }));
                    transitions.push((new.id, Transition::JoinedAsMaster));
                    master_change = Some(MasterChange { previous, master: Some(new.id), cause: Cause::Preempted });
                }
                // Rules 3 and 4: everyone else (including later desktops) is a peer.
                Some(_) => transitions.push((new.id, Transition::JoinedAsPeer)),
            }
        }
        Event::Release { ids, reason } => {
            let leaving: Vec<&Candidate> = state.live.iter().filter(|c| ids.contains(&c.id)).collect();
            if leaving.is_empty() {
                return Decision { next, master_change: None, transitions };
            }
            for c in &leaving {
                transitions.push((c.id, Transition::Released { was_master: c.is_master, reason: *reason }));
            }
            next.live.retain(|c| !ids.contains(&c.id));
            let master_left = leaving.iter().any(|c| c.is_master);
            // Rule 5: the best live peer is promoted at once (also repairs a masterless
            // project when a peer leaves).
            if master_left || next.master().is_none() {
                let successor = best(&next.live);
                if let Some(s) = successor {
                    set_master(&mut next.live, s);
                    next.term += 1;
                    transitions.push((s, Transition::Promoted));
                }
                if master_left || successor.is_some() {
                    master_change = Some(MasterChange { previous, master: successor, cause: Cause::from(*reason) });
                }
            }
        }
    }
    Decision { next, master_change, transitions }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use proptest::prelude::*;

    fn at(secs: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000 + secs, 0).single().expect("valid time")
    }

    fn cand(n: u128, surface: AgentSurface, t: i64) -> Candidate {
        Candidate { id: Uuid::from_u128(n), surface, registered_at: at(t), is_master: false }
    }

    fn apply(state: &ProjectState, event: Event) -> (ProjectState, Decision) {
        let d = decide(state, &event);
        (d.next.clone(), d)
    }

    fn master_id(s: &ProjectState) -> Option<u128> {
        s.master().map(|c| c.id.as_u128())
    }

    use AgentSurface::*;

    #[test]
    fn first_registration_becomes_master_with_term_one() {
        let (s, d) = apply(&ProjectState::default(), Event::Register(cand(1, ClaudeCode, 0)));
        assert_eq!(master_id(&s), Some(1));
        assert_eq!(s.term, 1);
        assert_eq!(d.transitions, vec![(Uuid::from_u128(1), Transition::JoinedAsMaster)]);
        assert_eq!(d.master_change.map(|c| c.cause), Some(Cause::Elected));
    }

    #[test]
    fn second_non_desktop_is_a_peer_and_term_stays() {
        let (s, _) = apply(&ProjectState::default(), Event::Register(cand(1, ClaudeCode, 0)));
        let (s, d) = apply(&s, Event::Register(cand(2, Codex, 1)));
        assert_eq!(master_id(&s), Some(1));
        assert_eq!(s.term, 1);
        assert_eq!(d.transitions, vec![(Uuid::from_u128(2), Transition::JoinedAsPeer)]);
        assert!(d.master_change.is_none());
    }

    #[test]
    fn desktop_preempts_a_non_desktop_master() {
        let (s, _) = apply(&ProjectState::default(), Event::Register(cand(1, Cursor, 0)));
        let (s, d) = apply(&s, Event::Register(cand(2, ClaudeDesktop, 1)));
        assert_eq!(master_id(&s), Some(2));
        assert_eq!(s.term, 2);
        assert_eq!(
            d.transitions,
            vec![
                (Uuid::from_u128(1), Transition::Preempted { by: Uuid::from_u128(2) }),
                (Uuid::from_u128(2), Transition::JoinedAsMaster)
            ]
        );
        assert_eq!(d.master_change.map(|c| c.cause), Some(Cause::Preempted));
    }

    #[test]
    fn a_later_desktop_does_not_preempt_a_desktop_master() {
        let (s, _) = apply(&ProjectState::default(), Event::Register(cand(1, ClaudeDesktop, 0)));
        let (s, d) = apply(&s, Event::Register(cand(2, ClaudeDesktop, 1)));
        assert_eq!(master_id(&s), Some(1));
        assert_eq!(d.transitions, vec![(Uuid::from_u128(2), Transition::JoinedAsPeer)]);
    }

    #[test]
    fn release_of_the_master_promotes_desktops_first_then_the_earliest() {
        let mut s = ProjectState::default();
        for c in [cand(1, Codex, 0), cand(2, ClaudeCode, 1), cand(3, ClaudeDesktop, 2), cand(4, ClaudeDesktop, 3)] {
            s = apply(&s, Event::Register(c)).0;
        }
        assert_eq!(master_id(&s), Some(3));
        assert_eq!(s.term, 2);
        let (s, d) = apply(&s, Event::Release { ids: vec![Uuid::from_u128(3)], reason: ReleaseReason::Wrapped });
        assert_eq!(master_id(&s), Some(4), "the other desktop, though registered last");
        assert_eq!(s.term, 3);
        assert_eq!(d.master_change.map(|c| c.cause), Some(Cause::Wrapped));
        let (s, _) = apply(&s, Event::Release { ids: vec![Uuid::from_u128(4)], reason: ReleaseReason::ContextSwitch });
        assert_eq!(master_id(&s), Some(1), "then the earliest non-desktop");
        assert_eq!(s.term, 4);
    }

    #[test]
    fn release_of_a_peer_changes_no_master() {
        let mut s = ProjectState::default();
        for c in [cand(1, Codex, 0), cand(2, ClaudeCode, 1)] {
            s = apply(&s, Event::Register(c)).0;
        }
        let (s2, d) =
            apply(&s, Event::Release { ids: vec![Uuid::from_u128(2)], reason: ReleaseReason::StaleHeartbeatIncident });
        assert_eq!(master_id(&s2), Some(1));
        assert_eq!(s2.term, s.term);
        assert!(d.master_change.is_none());
        assert_eq!(d.transitions.len(), 1);
    }

    #[test]
    fn last_release_leaves_no_master_and_the_next_registration_masters() {
        let (s, _) = apply(&ProjectState::default(), Event::Register(cand(1, Codex, 0)));
        let (s, d) = apply(&s, Event::Release { ids: vec![Uuid::from_u128(1)], reason: ReleaseReason::Wrapped });
        assert!(s.live.is_empty());
        assert_eq!(s.term, 1, "no new master, no new term");
        assert_eq!(
            d.master_change,
            Some(MasterChange { previous: Some(Uuid::from_u128(1)), master: None, cause: Cause::Wrapped })
        );
        let (s, _) = apply(&s, Event::Register(cand(2, Other, 5)));
        assert_eq!(master_id(&s), Some(2));
        assert_eq!(s.term, 2);
    }

    #[test]
    fn sweeping_master_and_successor_at_once_promotes_once() {
        let mut s = ProjectState::default();
        for c in [cand(1, Codex, 0), cand(2, ClaudeCode, 1), cand(3, Cursor, 2)] {
            s = apply(&s, Event::Register(c)).0;
        }
        let ids = vec![Uuid::from_u128(1), Uuid::from_u128(2)];
        let (s, d) = apply(&s, Event::Release { ids, reason: ReleaseReason::StaleHeartbeatIncident });
        assert_eq!(master_id(&s), Some(3));
        assert_eq!(s.term, 2);
        assert_eq!(d.transitions.last(), Some(&(Uuid::from_u128(3), Transition::Promoted)));
    }

    #[test]
    fn registering_again_is_idempotent() {
        let (s, _) = apply(&ProjectState::default(), Event::Register(cand(1, Codex, 0)));
        let (s2, d) = apply(&s, Event::Register(cand(1, Codex, 0)));
        assert_eq!(s, s2);
        assert!(d.transitions.is_empty() && d.master_change.is_none());
        let (s3, d) = apply(&s, Event::Release { ids: vec![Uuid::from_u128(9)], reason: ReleaseReason::Wrapped });
        assert_eq!(s, s3, "releasing someone not live changes nothing");
        assert!(d.transitions.is_empty());
    }

    #[test]
    fn a_masterless_project_is_repaired_by_the_next_event() {
        // Peers without a master (e.g. rows written by hand): registering elects the best.
        let s = ProjectState { term: 7, live: vec![cand(1, Codex, 0), cand(2, ClaudeDesktop, 1)] };
        let (s, d) = apply(&s, Event::Register(cand(3, Other, 2)));
        assert_eq!(master_id(&s), Some(2));
        assert_eq!(s.term, 8);
        assert!(d.transitions.contains(&(Uuid::from_u128(2), Transition::Promoted)));
        assert!(d.transitions.contains(&(Uuid::from_u128(3), Transition::JoinedAsPeer)));
    }

    #[test]
    fn a_masterless_project_is_not_decided_on_the_master_alone() {
        // The store's shortcut (decide on the master only) must flag a master change here,
        // so that it reads the whole project and repairs it.
        let full = ProjectState { term: 7, live: vec![cand(1, Codex, 0), cand(2, ClaudeDesktop, 1)] };
        let master_only = ProjectState { term: 7, live: vec![] };
        let quick = decide(&master_only, &Event::Register(cand(3, Other, 2)));
        assert!(quick.master_change.is_some());
        assert_eq!(decide(&full, &Event::Register(cand(3, Other, 2))).next.master().map(|c| c.id.as_u128()), Some(2));
    }

    // ---- properties over random histories ----------------------------------------------

    #[derive(Clone, Debug)]
    enum Op {
        Register { session: u8, project: u8, surface: u8 },
        Release { session: u8 },
        Sweep { sessions: Vec<u8> },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..12, 0u8..3, 0u8..5).prop_map(|(session, project, surface)| Op::Register { session, project, surface }),
            2 => (0u8..12).prop_map(|session| Op::Release { session }),
            1 => proptest::collection::vec(0u8..12, 0..4).prop_map(|sessions| Op::Sweep { sessions }),
        ]
    }

    /// A small world of projects and sessions driven like the store drives the rules:
    /// a session live on another project leaves it first (context switch).
    struct World {
        projects: Vec<ProjectState>,
        // session -> (project, registration id)
        live: std::collections::HashMap<u8, (usize, Uuid)>,
        next_id: u128,
        clock: i64,
    }

    impl World {
        fn release(&mut self, project: usize, ids: Vec<Uuid>, reason: ReleaseReason) -> Decision {
            let d = decide(&self.projects[project], &Event::Release { ids, reason });
            self.check(project, &d);
            self.projects[project] = d.next.clone();
            d
        }

        fn check(&self, project: usize, d: &Decision) {
            let before = &self.projects[project];
            let masters = d.next.live.iter().filter(|c| c.is_master).count();
            assert!(masters <= 1, "never two masters");
            assert_eq!(masters == 1, !d.next.live.is_empty(), "live registrations always have a master");
            assert!(d.next.term >= before.term, "term never goes back");
            let changed = before.master().map(|c| c.id) != d.next.master().map(|c| c.id);
            if changed && d.next.master().is_some() {
                assert_eq!(d.next.term, before.term + 1, "a new master raises the term by one");
            } else {
                assert_eq!(d.next.term, before.term, "term rises only with a new master");
            }
            if let Some(m) = d.next.master()
                && d.next.live.iter().any(|c| c.surface.is_desktop())
            {
                assert!(m.surface.is_desktop(), "a desktop masters whenever one is live");
            }
            // Anyone installed other than by preemption is the best by succession order.
            if let Some(MasterChange { master: Some(m), cause, .. }) = &d.master_change
                && *cause != Cause::Preempted
            {
                assert_eq!(Some(*m), best(&d.next.live), "promotion follows the succession order");
            }
            let applied: Vec<Uuid> = d.transitions.iter().map(|(id, _)| *id).collect();
            let mut dedup = applied.clone();
            dedup.sort();
            dedup.dedup();
            assert_eq!(dedup.len(), applied.len(), "each registration changes role once per event");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn invariants_hold_over_random_histories(ops in proptest::collection::vec(op(), 1..60)) {
            let mut w = World { projects: vec![ProjectState::default(); 3], live: Default::default(), next_id: 1, clock: 0 };
            for op in ops {
                w.clock += 1;
                match op {
                    Op::Register { session, project, surface } => {
                        let project = project as usize;
                        if let Some(&(p, id)) = w.live.get(&session) {
                            if p == project {
                                // Rule 6: same session, same project: idempotent.
                                let before = w.projects[p].clone();
                                let c = before.live.iter().find(|c| c.id == id).cloned().expect("live");
                                let d = decide(&before, &Event::Register(c));
                                prop_assert_eq!(&d.next, &before);
                                continue;
                            }
                            // Rule 7: context switch releases the old project first.
                            w.release(p, vec![id], ReleaseReason::ContextSwitch);
                            w.live.remove(&session);
                        }
                        let id = Uuid::from_u128(w.next_id);
                        w.next_id += 1;
                        let c = Candidate { id, surface: AgentSurface::ALL[surface as usize], registered_at: at(w.clock), is_master: false };
                        let before = w.projects[project].clone();
                        let d = decide(&before, &Event::Register(c.clone()));
                        w.check(project, &d);
                        // The store decides on the master alone first and reads the whole
                        // project only when that changes the master: both must agree.
                        let master_only = ProjectState { term: before.term, live: before.master().cloned().into_iter().collect() };
                        let quick = decide(&master_only, &Event::Register(c.clone()));
                        prop_assert_eq!(quick.master_change.is_some(), d.master_change.is_some());
                        if quick.master_change.is_none() {
                            prop_assert_eq!(&quick.transitions, &d.transitions);
                        }
                        // Preemption only by a desktop registering, and only of a non-desktop.
                        if let Some(old) = before.master()
                            && d.next.master().map(|m| m.id) != Some(old.id)
                        {
                            prop_assert!(c.surface.is_desktop() && !old.surface.is_desktop());
                            prop_assert_eq!(d.next.master().map(|m| m.id), Some(id));
                        }
                        w.projects[project] = d.next;
                        w.live.insert(session, (project, id));
                    }
                    Op::Release { session } => {
                        if let Some((p, id)) = w.live.remove(&session) {
                            w.release(p, vec![id], ReleaseReason::Wrapped);
                        }
                    }
                    Op::Sweep { sessions } => {
                        for p in 0..w.projects.len() {
                            let ids: Vec<Uuid> = sessions.iter().filter_map(|s| w.live.get(s)).filter(|(q, _)| *q == p).map(|(_, id)| *id).collect();
                            if ids.is_empty() { continue; }
                            let d = w.release(p, ids.clone(), ReleaseReason::StaleHeartbeatIncident);
                            prop_assert!(d.transitions.iter().filter(|(_, t)| matches!(t, Transition::Promoted)).count() <= 1);
                        }
                        for s in &sessions { w.live.remove(s); }
                    }
                }
            }
        }
    }
}

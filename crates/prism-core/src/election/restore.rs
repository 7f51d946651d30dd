//! A restore never reissues a term (SPEC §15): the rules, without I/O.
//!
//! Every term change appends one election event, numbered by a sequence that never goes
//! back but when Postgres is restored from a backup (or replaced). The operator keeps a
//! mark outside Postgres — how far that sequence had gone and the highest term then — and
//! compares it with the database at start: a database whose history is behind the mark
//! forgot terms it issued, and every project's term is raised above everything seen.

/// How far above the mark's highest term a restore raises every project: the mark is
/// written within a second of each change (and at a clean stop), so terms issued after
/// its last write — by a replica that died before writing it — are fewer than this.
pub const RESTORE_MARGIN: i64 = 1_000;

/// What the database says: how far its election history goes, and its highest term.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct History {
    /// The last number the election history's sequence gave (0: none yet).
    pub events: i64,
    /// The highest term any project holds.
    pub highest_term: i64,
}

/// What to do with the database at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It knows everything the mark saw.
    Current,
    /// It forgot changes: every project's term goes above `above` (`raised`).
    Restored { above: i64 },
}

/// Compares the database with the mark (none before the first start of a release that
/// keeps one) and the highest `status.term` any registration shows.
pub fn verdict(db: History, mark: Option<History>, highest_status_term: i64) -> Verdict {
    let behind_mark = mark.is_some_and(|m| db.events < m.events || db.highest_term < m.highest_term);
    let behind_status = highest_status_term > db.highest_term;
    if behind_mark || behind_status {
        let seen = mark.map_or(0, |m| m.highest_term).max(highest_status_term);
        Verdict::Restored { above: seen + RESTORE_MARGIN }
    } else {
        Verdict::Current
    }
}

/// A project's term after a restore: above `above`, and above what it holds.
pub fn raised(above: i64, held: i64) -> i64 {
    above.max(held) + 1
}

/// The mark to keep after `db` was read: never lower than the one kept (a replica that
/// reads a moment late does not take it back).
pub fn next_mark(kept: Option<History>, db: History) -> History {
    match kept {
        Some(k) => History { events: k.events.max(db.events), highest_term: k.highest_term.max(db.highest_term) },
        None => db,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn h(events: i64, highest_term: i64) -> History {
        History { events, highest_term }
    }

    #[test]
    fn a_database_with_the_history_the_mark_saw_is_current() {
        assert_eq!(verdict(h(7, 3), Some(h(7, 3)), 3), Verdict::Current);
        assert_eq!(verdict(h(9, 4), Some(h(7, 3)), 3), Verdict::Current, "ahead of the mark: changes since");
        assert_eq!(verdict(h(7, 3), None, 2), Verdict::Current, "no mark yet, statuses behind");
    }

    #[test]
    fn the_issue_s_case_is_raised_above_every_term_issued() {
        // pg_dump at term 1 (history 1), two preemptions to term 3 (history 3), restore.
        let v = verdict(h(1, 1), Some(h(3, 3)), 3);
        assert_eq!(v, Verdict::Restored { above: 3 + RESTORE_MARGIN });
        let Verdict::Restored { above } = v else { unreachable!() };
        assert!(raised(above, 1) > 3);
    }

    #[test]
    fn a_status_showing_a_term_the_database_never_had_is_a_restore_without_a_mark() {
        assert_eq!(verdict(h(1, 1), None, 3), Verdict::Restored { above: 3 + RESTORE_MARGIN });
    }

    #[test]
    fn a_new_empty_database_under_a_kept_mark_is_a_restore() {
        assert_eq!(verdict(History::default(), Some(h(40, 12)), 0), Verdict::Restored { above: 12 + RESTORE_MARGIN });
    }

    #[test]
    fn the_mark_never_goes_back() {
        assert_eq!(next_mark(Some(h(9, 5)), h(7, 6)), h(9, 6));
        assert_eq!(next_mark(None, h(7, 6)), h(7, 6));
    }

    proptest! {
        /// A history of term changes over projects, the mark written after some of them,
        /// a backup taken at some point, a restore: the verdict is Current only when the
        /// backup lost nothing, and a raise puts every project above every term issued
        /// (changes after the mark's last write fewer than the margin).
        #[test]
        fn no_term_is_issued_twice_across_a_restore(
            changes in proptest::collection::vec(0usize..4, 1..200),
            backup_at in 0usize..200,
            marked_at in 0usize..200,
        ) {
            let mut terms = [0i64; 4];
            let mut states = vec![(History::default(), terms)];
            for (i, p) in changes.iter().enumerate() {
                terms[*p] += 1;
                states.push((History { events: i as i64 + 1, highest_term: *terms.iter().max().unwrap_or(&0) }, terms));
            }
            let last = states.len() - 1;
            let (backup, backup_terms) = states[backup_at.min(last)];
            let mark = states[marked_at.min(last)].0;
            let issued_max = states[last].1;
            match verdict(backup, Some(mark), 0) {
                Verdict::Current => prop_assert!(backup.events >= mark.events),
                Verdict::Restored { above } => {
                    for (p, held) in backup_terms.iter().enumerate() {
                        prop_assert!(raised(above, *held) > issued_max[p], "project {} reissues", p);
                    }
                }
            }
        }
    }
}

"""SPEC §10's invariants, checked from Postgres alone by code that shares nothing with the
operator: the tables are read with `psql` and the rules below are written from SPEC §4
and §10, not from src/election.

    python3 check_invariants.py DATABASE_URL [--namespace-prefix P] [--completions FILE]

Election (per project, history rows in id order, which is the order the per-project
lock admitted them):
  * every change of master is one row: each row's previous_master_id is the master of
    the row before it (NULL for the first), and the last row's master and term are the
    project's current ones;
  * the term only rises: by exactly one for a row with a new master, unchanged for a
    row that leaves the project without one, except above a restore's raise
    (controller_term_restores, SPEC §15), after which it continues from the raised term;
  * no term number is held by two masters;
  * at most one live master at any instant: the masters' intervals are the gaps between
    consecutive rows, so the chain above makes them disjoint; and now, at most one live
    registration has is_master, and it is the project's master, in the project's term.
Jobs: every job is in a state SPEC §5.1 allows, finished ones have completed_at, and no job
id appears twice among the completions the load acknowledged (--completions: one job id
per line, as the load's Runs were told "completed"), each of which is finished in the
database. From each job's history of state changes (runtime_job_events, written by the
database's own trigger) and the election history (SPEC §10):
  * a job is finished at most once, and nothing follows its finish;
  * it is claimed at most max_attempts times, and as many times as its attempts say;
  * no step of a finished or superseded attempt changed it (SPEC §12): a change made by a
    Run's step that named its attempt (the history's step_attempt) is of that attempt,
    and follows that attempt's claim or ack — the job in flight at that attempt;
  * a fenced job is never claimed after its term has passed: at each claim its project's
    master term was the fence's, and no change of master to a later term had been
    recorded more than 5 s before the claim (a change commits after its row's time).
Durable rows under Redis faults (SPEC §5, §10: Redis losing data changes no durable row):
--save-durable FILE writes the rows no Run traffic may change (run_identities, every
column); --durable-before FILE compares them now with that file and names each row that
changed, appeared or vanished.

Prints the counts checked; a violation prints the project (or job), the rule and the
rows, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys

JOB_STATES = {"queued", "claimed", "running", "succeeded", "failed", "cancelled"}
FINISHED = {"succeeded", "failed", "cancelled"}


SPLIT = "@@prism-checker-split@@"


def snapshot(url: str, queries: list[str]) -> list[list[list[str]]]:
    """Tab-separated rows of each query, all read in one REPEATABLE READ transaction: the
    tables are compared with each other, so they must be one instant's (the operator may
    still be writing). NULL comes back as the empty string."""
    script = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;\n"
    script += f"\\echo {SPLIT}\n".join(q.rstrip(";") + ";\n" for q in queries) + "COMMIT;\n"
    out = subprocess.run(
        ["psql", url, "-XAtq", "-v", "ON_ERROR_STOP=1", "-F", "\t"],
        input=script,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    parts = out.split(SPLIT + "\n")
    return [[line.split("\t") for line in part.splitlines() if line] for part in parts]


def check_elections(url: str, prefix: str, violations: list[str]) -> dict[str, int]:
    like = prefix.replace("\\", "\\\\").replace("_", "\\_").replace("%", "\\%") + "%"
    quoted = like.replace("'", "''")
    events, project_rows, master_rows, restore_rows = snapshot(
        url,
        [
            "SELECT namespace, project_id, id, term, master_id, previous_master_id, cause, created_at, "
            "extract(epoch FROM created_at) "
            f"FROM controller_election_events WHERE namespace LIKE '{quoted}' ORDER BY namespace, project_id, id",
            f"SELECT namespace, project_id, term, master_id FROM controller_projects WHERE namespace LIKE '{quoted}'",
            "SELECT namespace, project_id, id, master_term FROM controller_registrations "
            f"WHERE is_master AND released_at IS NULL AND namespace LIKE '{quoted}'",
            # SPEC §15: a restored database raises each project's term past every term seen
            # outside it; the raise is a row here, not an election event.
            "SELECT namespace, project_id, extract(epoch FROM at), term_before, term_after "
            f"FROM controller_term_restores WHERE namespace LIKE '{quoted}' ORDER BY id",
        ],
    )
    history = collections.defaultdict(list)
    for ns, project, event_id, term, master, previous, cause, at, epoch in events:
        history[(ns, project)].append((int(event_id), int(term), master, previous, cause, at, float(epoch)))
    raises = collections.defaultdict(list)
    for ns, project, at, before, after in restore_rows:
        raises[(ns, project)].append((float(at), int(before), int(after)))
    projects = {(ns, project): (int(term), master) for ns, project, term, master in project_rows}
    live_masters = collections.defaultdict(list)
    for ns, project, reg_id, master_term in master_rows:
        live_masters[(ns, project)].append((reg_id, int(master_term) if master_term else None))

    changes = 0
    for key in sorted(set(projects) | set(history)):
        name = f"{key[0]}/{key[1]}"
        events = history.get(key, [])
        # The master named by the row before holds the project over [since, this row's time).
        master, term, since = "", 0, "the beginning"
        pending = list(raises.get(key, []))
        holders: dict[int, set[str]] = collections.defaultdict(set)
        for event_id, t, new_master, previous, cause, at, epoch in events:
            changes += 1
            # A raise before this row: terms continue above it.
            while pending and pending[0][0] <= epoch:
                _, before, after = pending.pop(0)
                if after <= max(term, before):
                    violations.append(f"{name}: a restore 'raised' term {max(term, before)} to {after}, not above it")
                term = max(term, after)
            if new_master:
                holders[t].add(new_master)
                if len(holders[t]) > 1:
                    violations.append(f"{name}: term {t} was held by two masters: {sorted(holders[t])}")
            row = f"row {event_id} at {at}: term {t}, master {new_master or 'none'}, previous {previous or 'none'}, {cause}"
            if previous != master:
                violations.append(
                    f"{name}: over [{since}, {at}] {master or 'none'} was master by the history, but {row} says the master was"
                    f" {previous or 'none'}: two masters overlap, or a change of master has no row of its own"
                )
            want = term + 1 if new_master else term
            if t != want:
                violations.append(f"{name}: term {t} where {want} was due (after term {term}): {row}")
            master, term, since = new_master, t, at
        for _, _, after in pending:
            term = max(term, after)
        current = projects.get(key)
        if current is None:
            violations.append(f"{name}: history without a project row")
            continue
        if (term, master) != (current[0], current[1]) and events:
            violations.append(
                f"{name}: the history ends at term {term}, master {master or 'none'}; the project says term {current[0]}, master {current[1] or 'none'}"
            )
        masters = live_masters.get(key, [])
        if len(masters) > 1:
            violations.append(f"{name}: {len(masters)} live masters now: {masters}")
        for reg_id, master_term in masters:
            if reg_id != current[1] or master_term != current[0]:
                violations.append(
                    f"{name}: live master {reg_id} (its term {master_term}) is not the project's master {current[1] or 'none'} in term {current[0]}"
                )
    return {"projects": len(projects), "changes of master": changes}


def check_jobs(url: str, completions: str | None, violations: list[str]) -> dict[str, int]:
    states = collections.Counter()
    state_of = {}
    jobs, events, changes = snapshot(
        url,
        [
            "SELECT id, state, completed_at, attempts, max_attempts, fence_namespace, fence_project_id, fence_term "
            "FROM runtime_jobs",
            "SELECT job_id, id, state, attempts, project_term, extract(epoch FROM at), step_attempt "
            "FROM runtime_job_events ORDER BY job_id, id",
            "SELECT namespace, project_id, term, extract(epoch FROM created_at) FROM controller_election_events "
            "WHERE master_id IS NOT NULL",
        ],
    )
    history = collections.defaultdict(list)
    steps_named = 0
    for job_id, event_id, state, attempts, project_term, at, step_attempt in events:
        history[job_id].append((int(event_id), state, int(attempts), project_term, float(at)))
        if step_attempt:
            steps_named += 1
            before = history[job_id][-2] if len(history[job_id]) > 1 else None
            if int(step_attempt) != int(attempts) or not (
                before and before[1] in ("claimed", "running") and before[2] == int(step_attempt)
            ):
                violations.append(
                    f"job {job_id}: a step of attempt {step_attempt} made it {state} at attempt {attempts} "
                    f"(the change before: {before})"
                )
    # When each project's terms began (the row's time; the change commits a little later).
    began = collections.defaultdict(list)
    for ns, project, term, at in changes:
        began[(ns, project)].append((int(term), float(at)))
    claims_checked = fenced_claims = 0
    for job_id, state, completed_at, attempts, max_attempts, fence_ns, fence_project, fence_term in jobs:
        states[state] += 1
        state_of[job_id] = state
        if state not in JOB_STATES:
            violations.append(f"job {job_id}: state {state!r} is not one SPEC §5.1 allows")
        if state in FINISHED and not completed_at:
            violations.append(f"job {job_id}: {state} without completed_at")
        steps = history.get(job_id, [])
        finishes = [e for e in steps if e[1] in FINISHED]
        if len(finishes) > 1:
            violations.append(f"job {job_id}: finished {len(finishes)} times: {finishes}")
        if finishes and steps[-1] is not finishes[-1]:
            violations.append(f"job {job_id}: changed after it finished: {steps}")
        if finishes and finishes[-1][1] != state:
            violations.append(f"job {job_id}: finished {finishes[-1][1]} by its history, {state} now")
        claims = [e for e in steps if e[1] == "claimed"]
        claims_checked += len(claims)
        if len(claims) > int(max_attempts):
            violations.append(f"job {job_id}: claimed {len(claims)} times, max_attempts {max_attempts}")
        if steps and len(claims) != int(attempts):
            violations.append(f"job {job_id}: {len(claims)} claims in its history, attempts says {attempts}")
        if fence_term:
            for _, _, _, project_term, at in claims:
                fenced_claims += 1
                if project_term != fence_term:
                    violations.append(
                        f"job {job_id}: claimed when its project {fence_ns}/{fence_project} was in term "
                        f"{project_term or 'none (no master)'}, fenced to term {fence_term}"
                    )
                later = [(t, b) for t, b in began.get((fence_ns, fence_project), []) if t > int(fence_term) and b < at - 5]
                if later:
                    violations.append(
                        f"job {job_id}: claimed at {at}, fenced to term {fence_term}, after term {later[0][0]} began at {later[0][1]}"
                    )
    counts = {
        "jobs": sum(states.values()),
        **{f"jobs {s}": n for s, n in sorted(states.items())},
        "claims": claims_checked,
        "steps naming their attempt": steps_named,
        "fenced claims": fenced_claims,
    }
    if completions:
        with open(completions, encoding="utf-8") as f:
            acked = collections.Counter(line.strip() for line in f if line.strip())
        for job_id, n in acked.items():
            if n > 1:
                violations.append(f"job {job_id}: acknowledged as completed {n} times")
            if state_of.get(job_id) not in FINISHED:
                violations.append(f"job {job_id}: acknowledged as completed, but {state_of.get(job_id, 'absent')} in the database")
        counts["completions acknowledged"] = sum(acked.values())
    return counts


DURABLE = "SELECT id, namespace, name, server_instance_id, component_kind, public_key, key_generation, lease_seconds, created_at, updated_at, revoked_at FROM run_identities ORDER BY id"


def durable_rows(url: str) -> dict[str, str]:
    (rows,) = snapshot(url, [DURABLE])
    return {row[0]: "\t".join(row) for row in rows}


def check_durable(url: str, before: str, violations: list[str]) -> dict[str, int]:
    with open(before, encoding="utf-8") as f:
        then = dict(line.rstrip("\n").split("\t", 1) for line in f if line.strip())
    then = {k: f"{k}\t{v}" for k, v in then.items()}
    now = durable_rows(url)
    for key in sorted(set(then) | set(now)):
        if then.get(key) != now.get(key):
            violations.append(f"run_identities {key} changed: before {then.get(key, 'absent')!r}, now {now.get(key, 'absent')!r}")
    return {"durable rows compared": len(then)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("database_url")
    parser.add_argument("--namespace-prefix", default="")
    parser.add_argument("--completions")
    parser.add_argument("--save-durable", metavar="FILE")
    parser.add_argument("--durable-before", metavar="FILE")
    args = parser.parse_args()
    if args.save_durable:
        rows = durable_rows(args.database_url)
        with open(args.save_durable, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in rows.values())
        print(f"saved {len(rows)} durable rows")
        return
    violations: list[str] = []
    counts = check_elections(args.database_url, args.namespace_prefix, violations)
    counts.update(check_jobs(args.database_url, args.completions, violations))
    if args.durable_before:
        counts.update(check_durable(args.database_url, args.durable_before, violations))
    print("checked: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    for v in violations:
        print(f"VIOLATION {v}")
    if violations:
        sys.exit(1)
    print("invariants hold")


if __name__ == "__main__":
    main()

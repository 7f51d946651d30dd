"""Schemathesis hooks for scripts/fuzz-api: a refused request writes nothing.

Before every call the rows of every durable table are counted; after a 4xx answer they
are counted again and must be the same (SPEC §6: bad input "changes nothing"). The
counts come from one psql round trip against $DATABASE_URL; the run uses one worker, so
nothing else of the fuzzer's writes in between. FUZZ_COUNTS_LOG (if set) receives one
line per checked refusal, so the script can print how many it checked.
"""

import os
import subprocess

import schemathesis

TABLES = [
    "controller_projects",
    "controller_registrations",
    "controller_election_events",
    "nudges",
    "run_identities",
    "runtime_jobs",
    "mcp_session_key",
]
QUERY = "SELECT " + ", ".join(f"(SELECT count(*) FROM {t})" for t in TABLES)

_before = None


def counts():
    out = subprocess.run(
        ["psql", os.environ["DATABASE_URL"], "-XtAqc", QUERY],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()
    return dict(zip(TABLES, (int(n) for n in out.split("|"))))


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    global _before
    _before = counts()


@schemathesis.check
def refused_request_writes_nothing(ctx, response, case):
    """A 4xx answer left every durable table as it was."""
    if not 400 <= response.status_code < 500 or _before is None:
        return None
    after = counts()
    changed = {t: (_before[t], after[t]) for t in TABLES if _before[t] != after[t]}
    log = os.environ.get("FUZZ_COUNTS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{response.status_code} {case.method} {case.path} {'changed' if changed else 'unchanged'}\n")
    if changed:
        raise AssertionError(f"refused with {response.status_code} but rows changed (before, after): {changed}")
    return None

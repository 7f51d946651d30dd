"""Schemathesis hooks for scripts/fuzz-api.

- Every answer's status is appended to $FUZZ_LOG ("status METHOD path"), for the counts
  the script prints.
- A refused request writes nothing (SPEC §6: bad input "changes nothing"): before every
  call the rows of every durable table are counted; after a 4xx answer they are counted
  again and must be the same, or the check `refused_request_writes_nothing` fails. The
  counts come from one query on one connection to $DATABASE_URL; the run uses one
  worker, so no other request of the fuzzer's writes in between.
"""

import os

import psycopg
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
_conn = None


def counts():
    global _conn
    if _conn is None or _conn.closed:
        _conn = psycopg.connect(os.environ["DATABASE_URL"], autocommit=True)
    row = _conn.execute(QUERY).fetchone()
    return dict(zip(TABLES, row))


def _log(line):
    path = os.environ.get("FUZZ_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    global _before
    _before = counts()


@schemathesis.hook
def after_call(ctx, case, response):
    _log(f"{response.status_code} {case.method} {case.path}")


@schemathesis.check
def refused_request_writes_nothing(ctx, response, case):
    """A 4xx answer left every durable table as it was."""
    if not 400 <= response.status_code < 500 or _before is None:
        return None
    after = counts()
    changed = {t: (_before[t], after[t]) for t in TABLES if _before[t] != after[t]}
    _log(f"refusal {'WROTE' if changed else 'clean'} {response.status_code} {case.method} {case.path}")
    if changed:
        raise AssertionError(f"refused with {response.status_code} but rows changed (before, after): {changed}")
    return None

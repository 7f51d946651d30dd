"""Schemathesis hooks for scripts/fuzz-api.

- Every answer's status is appended to $FUZZ_LOG ("status METHOD path"), for the counts
  the script prints.
- A refused request writes nothing (SPEC §6: bad input "changes nothing"): before every
  call the durable state is read by value (state.py: a digest of every row of every
  table, and the metadata and spec of every ControllerRegistration and RunSession); after
  a 4xx answer it is read again and must be the same, but for what state.py excuses
  (the late heartbeat of a session an earlier accepted call named, the job reaper, a
  finalizer finishing an earlier delete), or the check `refused_request_writes_nothing`
  fails. The run uses one worker, so no other request of the fuzzer's writes in between;
  and since a coalesced heartbeat lands up to 250 ms after its answer, what changes
  between a refusal's answer and the next request is that refusal's too ("refusal
  WROTE-LATE" in the log, which fails the run as well).
- An accepted register's project_id and session_id are printable (`printable_ids`,
  SPEC §3.1).
- A long-poll claim (SPEC §11) that would wait more than a second is sent with
  `wait_seconds: 1` (0, 1 and what is out of bounds are sent as generated):
  with no job queued for the fuzz's Run each would wait its whole time, and a hundred
  of them half an hour.
"""

import json
import os
import sys
import time

import schemathesis

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from state import Durable, control_char_fields, diff, session_strings  # noqa: E402

_durable = None
_before = None
# session_id -> when an accepted request named it (its heartbeat may land later).
_beats = {}
# (snapshot after, "METHOD path") of the last refusal, until the next request.
_last_refusal = None


def durable():
    global _durable
    if _durable is None:
        _durable = Durable()
    return _durable


def _log(line):
    path = os.environ.get("FUZZ_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _named(case):
    body = case.body if isinstance(case.body, (dict, list)) else None
    return session_strings(body, dict(case.query or {}))


def _short_wait(case):
    body = case.body
    if case.path.endswith("/jobs/claim") and isinstance(body, dict):
        wait = body.get("wait_seconds")
        # JSON has one number type: 10.0 is a wait of 10 s too.
        if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 1 < wait <= 60:
            body["wait_seconds"] = 1


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    global _before, _last_refusal
    _short_wait(case)
    _before = durable().snapshot()
    if _last_refusal is not None:
        after, what = _last_refusal
        _last_refusal = None
        changes = diff(after, _before, _beats)
        if changes:
            _log(f"refusal WROTE-LATE {what}: " + " | ".join(changes[:8]))


@schemathesis.hook
def after_call(ctx, case, response):
    _log(f"{response.status_code} {case.method} {case.path}")
    if 200 <= response.status_code < 300:
        now = time.monotonic()
        for s in _named(case):
            _beats[s] = now


@schemathesis.check
def printable_ids(ctx, response, case):
    """SPEC §3.1: a registration's projectId and sessionId are printable (no control
    characters): a register that takes one is a failure."""
    if case.path != "/api/v1/controller/register" or not 200 <= response.status_code < 300:
        return None
    body = case.body if isinstance(case.body, dict) else {}
    bad = control_char_fields(body)
    _log(f"printable {'BAD ' + json.dumps(body)[:400] if bad else 'clean'}")
    if bad:
        raise AssertionError(f"register accepted a control character in {', '.join(bad)}: {json.dumps(body)[:300]}")
    return None


@schemathesis.check
def refused_request_writes_nothing(ctx, response, case):
    """A 4xx answer left every durable row and resource as it was."""
    global _last_refusal
    if not 400 <= response.status_code < 500 or _before is None:
        return None
    after = durable().snapshot()
    changes = diff(_before, after, _beats)
    what = f"{response.status_code} {case.method} {case.path}"
    _last_refusal = (after, what)
    _log(f"refusal {'WROTE' if changes else 'clean'} {what}")
    if changes:
        sent = {"query": case.query, "body": case.body if isinstance(case.body, (dict, list, str)) else repr(case.body)}
        raise AssertionError(
            f"refused with {response.status_code} but changed: " + " | ".join(changes[:8])
            + f"\nrequest: {case.method} {case.formatted_path} {json.dumps(sent, default=str)[:600]}"
        )
    return None

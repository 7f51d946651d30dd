"""The durable state of a playground, by value: every row of every table of $DATABASE_URL
and the ControllerRegistrations and RunSessions of the cluster of $KUBECONFIG (metadata
and spec; not status), so that scripts/fuzz-api can tell whether a refused request wrote
anything, row counts unchanged or not.

    snap = Durable().snapshot()          # before the request
    ...                                  # the request
    changes = diff(snap, Durable().snapshot(), recent_beats)

A snapshot costs, on one Postgres connection, one REPEATABLE READ transaction: its MVCC
snapshot first (one statement: while it is the last one's, no transaction ended since and
the last snapshot's rows stand); when it moved, one statement that digests every table
(md5 over its rows in primary-key order), and the rows of only those tables whose digest
moved (the rows of the others are the ones already read). Beside it, one LIST per resource
type (metadata only), each in a thread of its own on a kept-alive HTTPS connection to the
API server, decoded only when its bytes changed. About 8 ms while nothing moves. Tables
and columns are read from the catalogue at every full read, so a table or column that a
later migration adds is covered without a change here.

What may legitimately move while a refused request is in flight, and so is excused (each
excuse is as narrow as the writer it stands for; see `diff`):

* `controller_registrations.last_heartbeat` of a session that an earlier *accepted* call
  named: heartbeats are coalesced (SPEC §4 rule 8, crates/prism-store/src/election/heartbeat.rs), so the
  UPDATE of an accepted call lands up to one window (250 ms) after its answer, i.e. maybe
  while the next request, a refused one, is in flight. Only that column, only forwards,
  only for sessions named by an accepted call in the last `BEAT_WINDOW` seconds; any other
  row's heartbeat that moves is a write.
* a `runtime_jobs` row whose attempt the job reaper ended: it was claimed or running with
  its visibility deadline (`visible_at`) or attempt deadline (`deadline_at`) passed by the
  time of the second snapshot, and only the reaper's columns changed (crates/prism-store/src/run_registry/
  jobs.rs `reap`); or one whose cancel was requested longer than the cancel grace
  (`PRISM_JOB_CANCEL_GRACE_SECONDS`, 30 s) before the second snapshot, ended `cancelled`
  by the reaper (which names the cause `grace`); the `runtime_job_events` rows the
  database's trigger added for that change; and the namespace's `runtime_job_queue_counts`
  (kept by a statement trigger, migration 20261206000005) by exactly the net number of
  those jobs that entered or left `queued` in it (a requeue adds one).
* `controller_registrations.resource_gone` of a row released before the request, going
  from false to true: the reconciler records that the released registration's resource is
  gone (its finalizer ran, or retention deleted it).
* a resource that was being deleted already (`deletionTimestamp` set before the request):
  its finalizer (the operator's release of an earlier wrap) removes itself and the API
  server then drops the object. Only the `finalizers` list may change, or the object go.
* of every resource: `status` (the controllers' answer, moved by reconciles of earlier
  writes), `metadata.resourceVersion` (moves with every status write) and
  `metadata.managedFields` (field ownership bookkeeping that status writes also move; a
  write to metadata or spec by a refused request shows in the fields themselves, and in
  `metadata.generation`, which moves with every spec change).
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
import requests
import yaml

# Heartbeats of accepted calls named in this many seconds before a snapshot may land in
# it: the coalescing window (250 ms) plus the UPDATE's own latency, with a margin for a
# loaded 2-core machine.
BEAT_WINDOW = 1.5
# Columns the job reaper writes (crates/prism-store/src/run_registry/jobs.rs `reap`), and those a job
# lifecycle with attempts and errors adds to that transition (SPEC §5.1).
REAPER_COLUMNS = {
    "state", "claimed_at", "visible_at", "claimed_by_session", "updated_at",
    "attempts", "last_error", "completed_at", "deadline_at", "eligible_at",
}
# The operator's cancel grace: a job in flight asked to stop is cancelled this long after.
CANCEL_GRACE = float(os.environ.get("PRISM_JOB_CANCEL_GRACE_SECONDS", "30"))
# Columns never printed in a change (their values are secrets).
SECRET_COLUMNS = {"key", "token", "token_hash", "session_token_hash"}
RESOURCES = [
    ("prism.ntecdev.ai/v1alpha1", "controllerregistrations"),
    ("prism.ntecdev.ai/v1alpha1", "runsessions"),
]


@dataclass
class Snapshot:
    taken_at: float  # time.monotonic() when it was taken (the moment of its reads)
    db_now: float  # Postgres' clock then, epoch seconds (for the reaper's deadlines)
    digests: dict[str, str]
    rows: dict[str, dict[str, dict[str, Any]]]  # table -> primary key (JSON) -> row
    resources: dict[str, dict[str, Any]]  # "plural/namespace/name" -> normalized object
    counts: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        tables = " ".join(f"{t}={n}" for t, n in sorted(self.counts.items()))
        return f"{tables} resources={len(self.resources)}"


class Kube:
    """A client of the API server of $KUBECONFIG: enough to LIST two resource types."""

    def __init__(self, kubeconfig: str):
        cfg = yaml.safe_load(open(kubeconfig))
        context_name = cfg.get("current-context") or cfg["contexts"][0]["name"]
        context = next(c["context"] for c in cfg["contexts"] if c["name"] == context_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == context["cluster"])
        user = next((u["user"] for u in cfg.get("users", []) if u["name"] == context.get("user")), {})
        base = os.path.dirname(os.path.abspath(kubeconfig))
        self._tmp = tempfile.TemporaryDirectory(prefix="fuzz-kube-")
        self.server = cluster["server"].rstrip("/")
        self.session = requests.Session()  # the caller's thread's (the self-test patches with it)
        self._local = threading.local()  # a session per LIST thread: requests' are not thread-safe
        self._lock = threading.Lock()
        self._last: dict[str, tuple[bytes, list]] = {}  # plural -> (answer, its items)
        # Given with every request: requests lets $REQUESTS_CA_BUNDLE (which .dev/env may
        # point at the operator's CA) win over a session's own `verify`.
        self.verify = self._file(cluster, "certificate-authority", base) or not cluster.get(
            "insecure-skip-tls-verify", False
        )
        cert, key = self._file(user, "client-certificate", base), self._file(user, "client-key", base)
        self.cert = (cert, key) if cert and key else None
        self.headers = {"Authorization": f"Bearer {user['token']}"} if user.get("token") else {}
        self.session.cert, self.session.headers = self.cert, {**self.session.headers, **self.headers}

    def _file(self, section: dict, name: str, base: str) -> str | None:
        if section.get(f"{name}-data"):
            path = os.path.join(self._tmp.name, name)
            with open(path, "wb") as f:
                f.write(base64.b64decode(section[f"{name}-data"]))
            return path
        if section.get(name):
            return os.path.join(base, section[name])
        return None

    def list(self, group_version: str, plural: str) -> list[dict[str, Any]]:
        """Every object, normalized (below): its metadata (PartialObjectMetadataList: half the bytes of the whole
        objects, and no status to drop). A spec change shows in `metadata.generation`,
        which the API server raises on every change of anything but metadata and status
        (both CRDs have the status subresource). An answer byte for byte the same as the
        last one is not decoded again."""
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.cert, session.headers = self.cert, {**session.headers, **self.headers}
        r = session.get(f"{self.server}/apis/{group_version}/{plural}", timeout=30, verify=self.verify,
                        headers={"Accept": "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"})
        r.raise_for_status()
        with self._lock:
            last = self._last.get(plural)
            if last is not None and last[0] == r.content:
                return last[1]
        items = [normalize(o) for o in r.json().get("items") or []]
        with self._lock:
            self._last[plural] = (r.content, items)
        return items


def normalize(obj: dict[str, Any]) -> dict[str, Any]:
    """A resource without what moves without a write to its metadata or spec (above).
    (The LIST gives metadata only; `status` is dropped here too for a whole object.)"""
    obj = {k: v for k, v in obj.items() if k != "status"}
    meta = {k: v for k, v in obj.get("metadata", {}).items() if k not in ("resourceVersion", "managedFields")}
    obj["metadata"] = meta
    return obj


class Durable:
    def __init__(self, database_url: str | None = None, kubeconfig: str | None = None):
        self.database_url = database_url or os.environ["DATABASE_URL"]
        self.kube = Kube(kubeconfig or os.environ["KUBECONFIG"])
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(RESOURCES))
        self._last = None  # (MVCC snapshot, the snapshot's table part) of the last read
        self.conn: psycopg.Connection | None = None
        # table -> (digest, rows) of the last snapshot: rows are re-read only when the
        # digest moved.
        self.cache: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {}

    def _connect(self) -> psycopg.Connection:
        if self.conn is None or self.conn.closed:
            self.conn = psycopg.connect(self.database_url, autocommit=True)
        return self.conn

    def _tables(self, cur) -> dict[str, list[str]]:
        """Every table of the schema on the search path, with its primary key columns
        (sqlx's own bookkeeping aside)."""
        cur.execute(
            """SELECT c.relname,
                      coalesce((SELECT array_agg(a.attname ORDER BY k.ord)
                                FROM pg_index i, unnest(i.indkey) WITH ORDINALITY k(attnum, ord), pg_attribute a
                                WHERE i.indrelid = c.oid AND i.indisprimary AND a.attrelid = c.oid
                                  AND a.attnum = k.attnum), '{}')
               FROM pg_class c
               WHERE c.relkind IN ('r', 'p') AND c.relnamespace = current_schema()::regnamespace
                 AND c.relname NOT LIKE '\\_sqlx%'
                 -- What an MCP session follows (resources/subscribe) is bookkeeping of the
                 -- caller's own session, like an open watch: any reader may subscribe.
                 AND c.relname <> 'mcp_subscriptions'
               ORDER BY c.relname"""
        )
        return {name: list(pk) for name, pk in cur.fetchall()}

    @staticmethod
    def _key(pk: list[str]) -> str:
        # The row's identity: its primary key as JSON text (the whole row without one).
        return "to_jsonb(ARRAY[" + ", ".join(f'"{c}"::text' for c in pk) + "])::text" if pk else "to_jsonb(t)::text"

    def snapshot(self) -> Snapshot:
        # The two LISTs run beside the Postgres reads (each waits on I/O): a snapshot costs
        # the slowest of the three, not their sum.
        lists = [self.pool.submit(self.kube.list, gv, plural) for gv, plural in RESOURCES]
        taken_at, db_now, digests, counts, rows = self._tables_snapshot()
        resources = {}
        for (gv, plural), listed in zip(RESOURCES, lists):
            for obj in listed.result():
                m = obj["metadata"]
                resources[f"{plural}/{m.get('namespace')}/{m['name']}"] = obj
        return Snapshot(taken_at, db_now, digests, rows, resources, counts)

    def _tables_snapshot(self):
        conn = self._connect()
        with conn.transaction(), conn.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            # The transaction's own MVCC snapshot (which transactions it sees): if it is the
            # last one's, so are the rows, and the digests need not be computed again. Not
            # the WAL insert position: a commit's record is in the WAL while it fsyncs,
            # before the commit is visible, so a read in that window would have kept rows
            # without it for as long as nothing else wrote (a heartbeat seen seconds late).
            cur.execute("SELECT pg_current_snapshot()::text")
            seen = cur.fetchone()[0]
            if self._last is not None and self._last[0] == seen:
                _, mono, db_now, digests, counts, rows = self._last
                now = time.monotonic()
                return now, db_now + (now - mono), digests, counts, rows
            result = self._read_tables(cur)
        self._last = (seen, *result)
        return result

    def _read_tables(self, cur):
        tables = self._tables(cur)
        parts = [
            f"""SELECT '{t}', count(*), md5(coalesce(string_agg(md5(to_jsonb(t)::text), '' ORDER BY {self._key(pk)}), ''))
                FROM "{t}" t"""
            for t, pk in tables.items()
        ]
        cur.execute(" UNION ALL ".join(parts) + " UNION ALL SELECT '', 0, extract(epoch FROM now())::text")
        digests, counts, db_now = {}, {}, 0.0
        for t, n, d in cur.fetchall():
            if t == "":
                db_now = float(d)
            else:
                digests[t], counts[t] = d, n
        taken_at = time.monotonic()
        rows = {}
        for t, pk in tables.items():
            cached = self.cache.get(t)
            if cached is None or cached[0] != digests[t]:
                cur.execute(f'SELECT {self._key(pk)}, to_jsonb(t) FROM "{t}" t')
                cached = (digests[t], {k: r for k, r in cur.fetchall()})
                self.cache[t] = cached
            rows[t] = cached[1]
        return taken_at, db_now, digests, counts, rows


def _changed_columns(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    return {c for c in before.keys() | after.keys() if before.get(c) != after.get(c)}


def _epoch(ts: Any) -> float | None:
    """A timestamptz as to_jsonb renders it ("2026-11-30T10:00:00.123456+00:00")."""
    if not isinstance(ts, str):
        return None
    from datetime import datetime

    try:
        return datetime.fromisoformat(ts).timestamp()
    except ValueError:
        return None


def _show(table: str, row: dict[str, Any] | None, columns: set[str] | None = None) -> str:
    if row is None:
        return "(none)"
    shown = {c: ("<secret>" if c in SECRET_COLUMNS else v) for c, v in row.items() if columns is None or c in columns}
    text = json.dumps(shown, sort_keys=True, default=str)
    return text if len(text) < 600 else text[:600] + "..."


def diff(before: Snapshot, after: Snapshot, beats: dict[str, float] | None = None) -> list[str]:
    """What changed from `before` to `after` that no excuse covers, one line a change.
    `beats`: session_id -> time.monotonic() of the last accepted call that named the
    session (its heartbeat may land late, see above). By session id alone: the namespace
    an MCP call resolves to is the server's to say (argument, header or the caller's own).
    """
    beats = beats or {}
    out: list[str] = []
    reaped: set[str] = set()
    # namespace -> net change of its queued jobs by the excused reaper's changes, and the
    # queue count rows' own change (compared once every row has been seen).
    reaped_queued: dict[str, int] = {}
    counted: dict[str, list[tuple[str, int, str]]] = {}
    # Jobs first: their events and counts are excused only for the changes excused there.
    follow_jobs = ("runtime_job_events", "runtime_job_queue_counts")
    tables = sorted(before.digests.keys() | after.digests.keys(), key=lambda t: (t in follow_jobs, t))

    def reap(b: dict[str, Any], a: dict[str, Any]) -> None:
        reaped.add(str(b.get("id")))
        net = (a.get("state") == "queued") - (b.get("state") == "queued")
        ns = str(b.get("namespace"))
        reaped_queued[ns] = reaped_queued.get(ns, 0) + net
    for table in tables:
        if before.digests.get(table) == after.digests.get(table):
            continue
        b_rows, a_rows = before.rows.get(table, {}), after.rows.get(table, {})
        for key in sorted(b_rows.keys() | a_rows.keys()):
            b, a = b_rows.get(key), a_rows.get(key)
            if b == a:
                continue
            if table == "runtime_job_events" and b is None and str(a.get("job_id")) in reaped:
                continue
            if table == "runtime_job_queue_counts":
                # Per namespace, below: a shard is a hash of the job's address.
                row = a or b
                delta = int((a or {}).get("queued") or 0) - int((b or {}).get("queued") or 0)
                line = f"{table} {key}: queued: {_show(table, b, {'queued'})} -> {_show(table, a, {'queued'})}"
                counted.setdefault(str(row.get("namespace")), []).append((key, delta, line))
                continue
            if b is None or a is None:
                out.append(f"{table} {key}: {'inserted' if b is None else 'deleted'}: {_show(table, a or b)}")
                continue
            cols = _changed_columns(b, a)
            if table == "controller_registrations" and cols == {"last_heartbeat"}:
                # A coalesced heartbeat of an accepted call that named this session.
                named = beats.get(b.get("session_id"))
                forwards = (_epoch(a["last_heartbeat"]) or 0) > (_epoch(b["last_heartbeat"]) or 0)
                if named is not None and named >= before.taken_at - BEAT_WINDOW and forwards:
                    continue
            if table == "controller_registrations" and cols == {"resource_gone"}:
                # The reconciler records that a released registration's resource is gone
                # (its finalizer ran, or retention deleted it): released before, only then.
                if b.get("released_at") and not b.get("resource_gone") and a.get("resource_gone"):
                    continue
            if table == "runtime_jobs" and cols <= REAPER_COLUMNS:
                # The reaper: in flight, its visibility deadline passed by the second read.
                deadlines = [d for d in (_epoch(b.get("visible_at")), _epoch(b.get("deadline_at"))) if d is not None]
                if b.get("state") in ("claimed", "running") and deadlines and min(deadlines) <= after.db_now:
                    if a.get("state") in ("queued", "failed", "cancelled"):
                        reap(b, a)
                        continue
            if table == "runtime_jobs" and cols <= REAPER_COLUMNS | {"cancel_cause"}:
                # The reaper: in flight and asked to stop longer than the grace ago; the
                # cause it names is the grace.
                asked = _epoch(b.get("cancel_requested_at"))
                if b.get("state") in ("claimed", "running") and asked is not None and asked + CANCEL_GRACE <= after.db_now:
                    if a.get("state") == "cancelled" and ("cancel_cause" not in cols or a.get("cancel_cause") == "grace"):
                        reap(b, a)
                        continue
            out.append(f"{table} {key}: {', '.join(sorted(cols))}: {_show(table, b, cols)} -> {_show(table, a, cols)}")
    for ns, rows in sorted(counted.items()):
        if sum(delta for _, delta, _ in rows) != reaped_queued.get(ns, 0):
            out.extend(line for _, _, line in rows)
    for name in sorted(before.resources.keys() | after.resources.keys()):
        b, a = before.resources.get(name), after.resources.get(name)
        if b == a:
            continue
        if b is not None and b["metadata"].get("deletionTimestamp"):
            # Being deleted already: its finalizer finishes, then the object goes.
            if a is None:
                continue
            strip = lambda o: {**o, "metadata": {k: v for k, v in o["metadata"].items() if k != "finalizers"}}
            if strip(a) == strip(b):
                continue
        if b is None or a is None:
            obj = a or b
            out.append(f"{name}: {'created' if b is None else 'deleted'} (uid {obj['metadata'].get('uid')})")
            continue
        fields = sorted(
            f"{part}.{k}"
            for part in ("metadata", "spec")
            for k in (b.get(part, {}) or {}).keys() | (a.get(part, {}) or {}).keys()
            if (b.get(part) or {}).get(k) != (a.get(part) or {}).get(k)
        ) or sorted(k for k in b.keys() | a.keys() if b.get(k) != a.get(k))
        out.append(
            f"{name}: {', '.join(fields)}: "
            + "; ".join(f"{f}: {json.dumps(_dig(b, f))} -> {json.dumps(_dig(a, f))}" for f in fields)
        )
    return out


def _dig(obj: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def control_char_fields(args: Any, fields: tuple[str, ...] = ("project_id", "session_id")) -> list[str]:
    """Those of `fields` in `args` that hold a control character (Unicode category Cc:
    C0, DEL, C1). SPEC §3.1: a registration's projectId and sessionId are printable."""
    import unicodedata

    if not isinstance(args, dict):
        return []
    return [f for f in fields if isinstance(args.get(f), str) and any(unicodedata.category(c) == "Cc" for c in args[f])]


def session_strings(*values: Any) -> set[str]:
    """Every string value under a key `session_id` in these (decoded JSON) values: the
    sessions a request names, whose heartbeat it may be."""
    found: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "session_id" and isinstance(x, str):
                    found.add(x)
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for v in values:
        walk(v)
    return found


# --- command line: phase-level comparisons and the self-test of scripts/fuzz-api --------


def _save(snap: Snapshot, path: str) -> None:
    import pickle

    with open(path, "wb") as f:
        pickle.dump(snap, f)


def _load(path: str) -> Snapshot:
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)


def diff_selftest() -> list[str]:
    """The excuses are as narrow as they say: each is fed the change it excuses (must pass)
    and the same change one step wider (must be caught)."""
    def snap(rows: dict, resources: dict, taken_at: float = 100.0, db_now: float = 1000.0) -> Snapshot:
        return Snapshot(taken_at, db_now, {t: json.dumps(r, sort_keys=True) for t, r in rows.items()}, rows, resources)

    reg = {"id": "r1", "namespace": "ns", "session_id": "s1", "last_heartbeat": "2026-01-01T00:00:00+00:00"}
    beat = {**reg, "last_heartbeat": "2026-01-01T00:00:01+00:00"}
    job = {"id": "j1", "namespace": "ns", "state": "claimed", "visible_at": "1970-01-01T00:16:30+00:00", "payload": {}, "claimed_at": "x"}
    requeued = {**job, "state": "queued", "visible_at": None, "claimed_at": None}
    asked = {"id": "j2", "state": "running", "visible_at": "1970-01-01T00:20:00+00:00", "payload": {},
             "deadline_at": "1970-01-01T00:25:00+00:00", "cancel_requested_at": "1970-01-01T00:15:00+00:00"}
    graced = {**asked, "state": "cancelled", "visible_at": None, "deadline_at": None, "completed_at": "x"}
    count = {"namespace": "ns", "shard": 14, "queued": 3}
    other = {"namespace": "other", "shard": 14, "queued": 0}
    obj = {"metadata": {"name": "a", "uid": "u", "generation": 1, "finalizers": ["f"], "deletionTimestamp": "t"}}
    gone_finalizer = {"metadata": {**obj["metadata"], "finalizers": []}}
    cases = [  # (what, before, after, beats, caught?)
        ("a heartbeat nobody named", snap({"controller_registrations": {"r1": reg}}, {}),
         snap({"controller_registrations": {"r1": beat}}, {}, 101), {}, True),
        ("a heartbeat an accepted call named", snap({"controller_registrations": {"r1": reg}}, {}),
         snap({"controller_registrations": {"r1": beat}}, {}, 101), {"s1": 99.5}, False),
        ("a heartbeat named long ago", snap({"controller_registrations": {"r1": reg}}, {}),
         snap({"controller_registrations": {"r1": beat}}, {}, 101), {"s1": 90.0}, True),
        ("a heartbeat that moves another column too", snap({"controller_registrations": {"r1": reg}}, {}),
         snap({"controller_registrations": {"r1": {**beat, "released_at": "x"}}}, {}, 101), {"s1": 99.5}, True),
        ("the reaper's requeue past the deadline", snap({"runtime_jobs": {"j1": job}}, {}),
         snap({"runtime_jobs": {"j1": requeued}}, {}, 101, 1000.0), {}, False),
        ("a requeue before the deadline", snap({"runtime_jobs": {"j1": job}}, {}),
         snap({"runtime_jobs": {"j1": requeued}}, {}, 101, 900.0), {}, True),
        ("the reaper's cancel past the grace", snap({"runtime_jobs": {"j2": asked}}, {}),
         snap({"runtime_jobs": {"j2": graced}}, {}, 101, 1000.0), {}, False),
        ("a cancel within the grace", snap({"runtime_jobs": {"j2": {**asked, "cancel_requested_at": "1970-01-01T00:16:30+00:00"}}}, {}),
         snap({"runtime_jobs": {"j2": {**graced, "cancel_requested_at": "1970-01-01T00:16:30+00:00"}}}, {}, 101, 1000.0), {}, True),
        ("the reaper's cancel past the grace naming its cause",
         snap({"runtime_jobs": {"j2": {**asked, "cancel_cause": "requested"}}}, {}),
         snap({"runtime_jobs": {"j2": {**graced, "cancel_cause": "grace"}}}, {}, 101, 1000.0), {}, False),
        ("a cancel past the grace naming another cause",
         snap({"runtime_jobs": {"j2": {**asked, "cancel_cause": "requested"}}}, {}),
         snap({"runtime_jobs": {"j2": {**graced, "cancel_cause": "expired"}}}, {}, 101, 1000.0), {}, True),
        ("the reaper's requeue counted in its namespace",
         snap({"runtime_jobs": {"j1": job}, "runtime_job_queue_counts": {"q": count}}, {}),
         snap({"runtime_jobs": {"j1": requeued}, "runtime_job_queue_counts": {"q": {**count, "queued": 4}}}, {},
              101, 1000.0), {}, False),
        ("a count that moved more than the reaper's requeue",
         snap({"runtime_jobs": {"j1": job}, "runtime_job_queue_counts": {"q": count}}, {}),
         snap({"runtime_jobs": {"j1": requeued}, "runtime_job_queue_counts": {"q": {**count, "queued": 5}}}, {},
              101, 1000.0), {}, True),
        ("a count moved in another namespace than the reaper's requeue",
         snap({"runtime_jobs": {"j1": job}, "runtime_job_queue_counts": {"q": count, "r": other}}, {}),
         snap({"runtime_jobs": {"j1": requeued}, "runtime_job_queue_counts": {"q": count, "r": {**other, "queued": 1}}},
              {}, 101, 1000.0), {}, True),
        ("a requeue that changes the payload", snap({"runtime_jobs": {"j1": job}}, {}),
         snap({"runtime_jobs": {"j1": {**requeued, "payload": {"x": 1}}}}, {}, 101, 1000.0), {}, True),
        ("a deleted resource's finalizer going", snap({}, {"c/ns/a": obj}), snap({}, {"c/ns/a": gone_finalizer}), {}, False),
        ("a deleted resource going", snap({}, {"c/ns/a": obj}), snap({}, {}), {}, False),
        ("a label on a resource being deleted", snap({}, {"c/ns/a": obj}),
         snap({}, {"c/ns/a": {"metadata": {**obj["metadata"], "labels": {"x": "y"}}}}), {}, True),
        ("a resource created", snap({}, {}), snap({}, {"c/ns/a": obj}), {}, True),
    ]
    problems = []
    for what, before, after, beats, caught in cases:
        got = diff(before, after, beats)
        if bool(got) != caught:
            problems.append(f"diff {'missed' if caught else 'did not excuse'} {what}: {got}")
    return problems


def selftest(url: str, token: str, namespace: str, tag: str) -> list[str]:
    """Proves the write check can fail on a change of values alone: a granted release of
    a peer changes its row (released_at, release_reason) and no table's row count; a
    label on a resource changes its metadata alone; a heartbeat moves last_heartbeat,
    which only an accepted call naming the session excuses. Returns what went wrong."""
    verify: Any = os.environ.get("PRISM_CA_CERT") or True
    http = requests.Session()
    h = {"Authorization": f"Bearer {token}"}
    d = Durable()
    problems: list[str] = diff_selftest()

    def call(method: str, path: str, body: Any = None) -> dict:
        r = http.request(method, f"{url}/api/v1{path}", json=body, headers=h, timeout=30, verify=verify)
        if r.status_code != 200:
            raise SystemExit(f"[fuzz-api] self-test: {method} {path}: HTTP {r.status_code} {r.text[:300]}")
        return r.json()

    # The printable check (hooks.py, mcp.py) fails on what SPEC §3.1 forbids.
    for bad in ("a\x01b", "a\x7fb", "a\x85b"):
        if control_char_fields({"project_id": bad}) != ["project_id"]:
            problems.append(f"the printable check passes project_id {bad!r}")
    if control_char_fields({"project_id": "PID-1 é", "session_id": "7f6c"}):
        problems.append("the printable check fails a printable project_id")
    project = f"fuzz-selftest-{tag}"
    reg = lambda s: call("POST", "/controller/register", {"namespace": namespace, "project_id": project,
                                                          "session_id": s, "agent_surface": "other"})["registration"]
    a, b = reg(f"fuzz-selftest-a-{tag}"), reg(f"fuzz-selftest-b-{tag}")
    time.sleep(0.6)  # the registers' own heartbeats and reconciles settle
    s1 = d.snapshot()
    call("POST", f"/controller/{b['id']}/release?namespace={namespace}")
    for _ in range(50):  # the finalizer lets the resource go
        s2 = d.snapshot()
        if not any(k.endswith(f"/{b['name']}") for k in s2.resources):
            break
        time.sleep(0.1)
    changes = diff(s1, s2)
    if s1.counts != s2.counts:
        problems.append(f"a peer's release changed row counts {s1.counts} -> {s2.counts}: not a values-only case")
    if not any(c.startswith(f'controller_registrations ["{b["id"]}"]') and "released_at" in c for c in changes):
        problems.append(f"a peer's release (row counts unchanged) was not seen by value: {changes}")
    # Metadata alone: a label on the other registration's resource.
    path = f"{d.kube.server}/apis/prism.ntecdev.ai/v1alpha1/namespaces/{namespace}/controllerregistrations/{a['name']}"
    patch = lambda v: d.kube.session.patch(path, data=json.dumps({"metadata": {"labels": {"fuzz-selftest": v}}}),
                                           headers={"Content-Type": "application/merge-patch+json"},
                                           timeout=30, verify=d.kube.verify).raise_for_status()
    s3 = d.snapshot()
    patch("x")
    s4 = d.snapshot()
    if not any("metadata.labels" in c for c in diff(s3, s4)):
        problems.append(f"a label on a resource was not seen: {diff(s3, s4)}")
    patch(None)
    # A heartbeat: seen, unless an accepted call named the session.
    time.sleep(0.6)
    s5 = d.snapshot()
    call("POST", "/controller/heartbeat", {"namespace": namespace, "session_id": a["session_id"]})
    time.sleep(1.0)
    s6 = d.snapshot()
    if not any("last_heartbeat" in c for c in diff(s5, s6)):
        problems.append(f"a heartbeat was not seen: {diff(s5, s6)}")
    if diff(s5, s6, {a["session_id"]: time.monotonic()}):
        problems.append(f"a heartbeat of a session an accepted call named was not excused: {diff(s5, s6, {a['session_id']: time.monotonic()})}")
    call("POST", f"/controller/{a['id']}/release?namespace={namespace}")
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["snapshot"]:
        snap = Durable().snapshot()
        _save(snap, argv[1])
        print(snap.summary())
        return 0
    if argv[:1] == ["diff"]:
        changes = diff(_load(argv[1]), _load(argv[2]))
        for c in changes:
            print(c)
        return 1 if changes else 0
    if argv[:1] == ["settle"]:
        # Until two reads half a second apart agree (at most 15 s): the writes that an
        # accepted set-up step causes later (reconciles, finalizers, heartbeats) are done.
        d, deadline = Durable(), time.monotonic() + 15
        last = d.snapshot()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = d.snapshot()
            changes = diff(last, now)
            if not changes:
                return 0
            last = now
        print("[fuzz-api] the durable state kept changing for 15 s: " + " | ".join(changes[:5]), file=sys.stderr)
        return 1
    if argv[:1] == ["selftest"]:
        problems = selftest(*argv[1:5])
        for p in problems:
            print(f"[fuzz-api] self-test: {p}", file=sys.stderr)
        return 1 if problems else 0
    print("usage: state.py snapshot FILE | diff FILE FILE | settle | selftest URL TOKEN NAMESPACE TAG", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

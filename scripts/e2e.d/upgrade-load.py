#!/bin/sh
"""exec" "$("$(dirname "$0")/../mcp-sdk")" "$0" "$@"
(The line above: run directly, this file re-executes itself with the MCP SDK virtualenv's
python that scripts/mcp-sdk prints; to Python it is the start of this docstring.)

Continuous client load for the upgrade/rollback test (SPEC §15: "Upgrade N-1 → N and
rollback N → N-1 without disruption"): agents heartbeating over HTTP and MCP (both
protocol generations), watches and MCP listens open, a producer enqueueing jobs — while
another script runs `helm upgrade`, `helm rollback`, `helm upgrade` of the operator.

An independent client written from SPEC.md (§6 HTTP API, §9 MCP, §11 push): it imports
nothing of the project's Rust code, only the official MCP Python SDK helpers of
tests/mcp/scenarios.py. Run it with the SDK's virtualenv python:

    PY="$(scripts/mcp-sdk)"
    "$PY" scripts/e2e.d/upgrade-load.py --url https://127.0.0.1:PORT --ca CA_FILE \\
        --token-file FILE --namespace NS --projects 3 --http-agents 2 --mcp-agents 2 \\
        --watches 3 --servers SRV1,SRV2 --component-kind KIND --rate 2 \\
        --stop-file PATH --out SUMMARY.json [--seed N] [--job-kind lifecycle]

It prints `READY` on stdout once every session is registered and every watch and listen
is open; it runs until --stop-file exists, then stops within ~10 s, writes the summary
JSON to --out, prints a human summary on stderr and exits 0 (nonzero only for a usage
error or a crash). Sessions are left registered.

The retry rule (SPEC §15 "the documented client retry"), counted per kind of call: a
call that fails with a transport error (connection refused or reset, remote closed, read
error, TLS EOF, connect timeout) or is answered 503 *with* `Retry-After` is retried once,
on a new connection, after min(Retry-After, 2) s (0.5 s after a transport error). It is
`ok` when the first try succeeded, `retried_ok` when the retry did, `failed` otherwise
(any other 4xx/5xx, a read timeout, or a retry that failed too). Over MCP a tool result
with `isError` is a failure unless its code is of the "unavailable" class
(`*_unavailable`, `contended`), which is retried once the same way.

How the MCP SDK is driven: the retry lives in an httpx transport under the SDK's client
(RetryTransport), because the SDK ends its whole client when a POST raises a transport
error; so a session-based agent keeps its Mcp-Session-Id (sessions are verifiable by
every replica) through replica replacements. The SDK reconnects the session's GET stream
(which carries `resources/subscribe` notifications) by itself; the transport keeps that
reconnect going. A 2026-07-28 agent's `subscriptions/listen` is reopened by the agent
whenever it ends.

Summary (--out): the fields the caller asserts on (`calls`, `failed_total`, `failures`,
`master_changes`, `preempted`, `masters`, `watches`, `listens`, `jobs`), and to read a
failure by: `failure_kinds` (every failure, by kind/status/code), `retried_samples`,
`master_change_events`, `stream_errors` (refused reconnects), `crashes` (a bug of this
load: exit 3). --probe-streams adds `live_at_stop` to `watches` and `listens`.
Try it against the playground with scripts/e2e.d/upgrade-load-selftest.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import email.utils
import json
import os
import random
import secrets
import signal
import ssl
import sys
import time
import warnings
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "tests" / "mcp"))

import httpx2  # noqa: E402  (the httpx the SDK ships with)
from mcp import Client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402
from mcp_types import Implementation  # noqa: E402
from mcp_types.version import MODERN_PROTOCOL_VERSIONS  # noqa: E402
from scenarios import answer  # noqa: E402  (a tools/call result → {is_error, structured, text, error})

warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*resources/subscribe.*")

HEARTBEAT_EVERY = 2.0
STATUS_EVERY = 6.0
WATCH_READ_TIMEOUT = 40.0  # a comment arrives every 15 s (SPEC §11)
LEGACY_STREAM_READ_TIMEOUT = 40.0
MAX_SAMPLES = 10
# Retries and refused reconnects kept with their times (a run sees a few dozen).
MAX_RETRIED = 1000
NO_MASTER = "<none>"
SDK_CLIENT_NAME = "claude-code"


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def log(msg: str) -> None:
    sys.stderr.write(f"[upgrade-load] {msg}\n")
    sys.stderr.flush()


def describe(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = str(e) or repr(e)
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause) and str(cause) not in text:
        text = f"{text} ({type(cause).__name__}: {cause})"
    return f"{type(e).__name__}: {text}"[:300]


def retryable_exception(e: BaseException) -> bool:
    """A transport error the documented client retry covers: the connection was refused,
    reset or closed, a read or write broke, TLS ended early, or the connect timed out
    (nothing was sent). A read timeout (an answer that never came) is not."""
    if isinstance(e, httpx2.TimeoutException):
        return isinstance(e, httpx2.ConnectTimeout)
    return isinstance(e, (httpx2.TransportError, ssl.SSLError, ConnectionError, EOFError))


def retry_after_seconds(value: str) -> float:
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError):
        return 1.0


def error_code(body: bytes | str) -> str | None:
    try:
        parsed = json.loads(body)
    except (ValueError, TypeError):
        return None
    err = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        return str(code) if code is not None else None
    return None


def session_lost(detail: Any) -> bool:
    """A failed MCP request's detail says the server no longer knows the MCP session (the
    SDK reports a 404 on a session-based client as "Session terminated")."""
    rpc = detail.get("rpc_error") if isinstance(detail, dict) else None
    return bool(rpc) and "Session terminated" in str(rpc.get("message"))


def unavailable_class(code: str | None) -> bool:
    return bool(code) and (code.endswith("_unavailable") or code in {"unavailable", "contended"})


class Attempt:
    """What one logical request went through in the RetryTransport."""

    __slots__ = ("retried", "first", "error", "status", "retry_after")

    def __init__(self) -> None:
        self.retried = False
        self.first: str | None = None  # why the first try failed (when retried)
        self.error: str | None = None  # a transport error that ended it (no answer)
        self.status: int | None = None
        self.retry_after: str | None = None


class StreamState:
    """One long-lived stream (a watch, a listen, a legacy session's GET stream)."""

    def __init__(self, name: str, project: str) -> None:
        self.name = name
        self.project = project
        self.open = False
        self.ready = False  # open and (watch) its first event seen / (listen) acknowledged
        self.opened = 0
        self.ended = 0
        self.resumed = 0
        self.events = 0
        self.refused = 0
        self.last_id: str | None = None
        self.opened_at: float | None = None


class TrackedStream(httpx2.AsyncByteStream):
    """A legacy session's GET stream body: counts its end, and turns a broken read into a
    clean end, so the SDK reconnects (it gives up after two broken streams in a row)."""

    def __init__(self, inner: Any, on_end: Any) -> None:
        self.inner = inner
        self.on_end = on_end
        self.done = False

    def _end(self, reason: str) -> None:
        if not self.done:
            self.done = True
            self.on_end(reason)

    async def __aiter__(self):  # type: ignore[override]
        reason = "closed"
        try:
            async for chunk in self.inner:
                yield chunk
        except Exception as e:  # noqa: BLE001 - a broken stream ends; the SDK reconnects
            reason = describe(e)
        finally:
            self._end(reason)

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        except Exception:  # noqa: BLE001
            pass
        self._end("closed")


class RetryTransport(httpx2.AsyncBaseTransport):
    """The documented client retry for one client (an MCP SDK client or an HTTP agent),
    below the SDK: a call's POST is retried once, on a new connection, after a transport
    error or a 503 with Retry-After; what happened is kept in `last[rpc method]` for the
    caller to count. It never raises (an exception here would end the SDK's client): a
    request that cannot be answered gets a synthetic 503 (`x-upgrade-load: transport`)
    whose body is a JSON-RPC error. A legacy session's GET stream (`Mcp-Session-Id`) is
    reopened until it is answered (counted in `legacy_stream`); a listen's POST is sent
    once with no read timeout (the server sends no keep-alive on it) and reopened by the
    agent when it ends."""

    def __init__(self, load: "Load", legacy_stream: StreamState | None = None, mcp: bool = False) -> None:
        self.load = load
        self.mcp = mcp
        self.inner = load.new_inner_transport()
        self.retired: list[httpx2.AsyncBaseTransport] = []
        self.last: dict[str, Attempt] = {}
        self.legacy_stream = legacy_stream
        self.retries = 0

    def fresh(self) -> None:
        # A new connection pool; the old one may still carry a healthy stream, so it is
        # only closed at the end.
        self.retired.append(self.inner)
        self.inner = self.load.new_inner_transport()

    async def aclose(self) -> None:
        for t in [self.inner, *self.retired]:
            try:
                await asyncio.wait_for(t.aclose(), 2)
            except BaseException:  # noqa: BLE001
                pass

    @staticmethod
    def rpc_of(request: httpx2.Request) -> tuple[str | None, Any]:
        if request.method != "POST":
            return None, None
        try:
            body = json.loads(request.content or b"{}")
        except Exception:  # noqa: BLE001 - not JSON, or a streamed body: not a JSON-RPC call
            return None, None
        if isinstance(body, dict):
            return body.get("method"), body.get("id")
        return None, None

    @staticmethod
    def synthetic(request: httpx2.Request, rpc_id: Any, message: str) -> httpx2.Response:
        body = {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": -32000, "message": f"upgrade-load: {message}"}}
        return httpx2.Response(
            503,
            headers={"content-type": "application/json", "x-upgrade-load": "transport"},
            content=json.dumps(body).encode(),
            request=request,
        )

    @staticmethod
    async def buffered(response: httpx2.Response, request: httpx2.Request) -> httpx2.Response:
        """The whole body read here (so a broken read is seen, and retried, here)."""
        try:
            raw = b"".join([chunk async for chunk in response.aiter_raw()])
        except httpx2.StreamConsumed:  # already read (not the case of a real connection)
            return response
        finally:
            await response.aclose()
        buffered = httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=httpx2.ByteStream(raw),
            request=request,
            extensions=response.extensions,
        )
        await buffered.aread()
        return buffered

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        rpc, rpc_id = self.rpc_of(request)
        if self.mcp and request.method == "GET" and request.headers.get("mcp-session-id"):
            return await self.legacy_get(request)
        if self.mcp and (rpc == "subscriptions/listen" or request.method == "GET"):
            if rpc == "subscriptions/listen":
                request.extensions["timeout"] = {"connect": 5.0, "read": None, "write": 30.0, "pool": 30.0}
            try:
                return await self.inner.handle_async_request(request)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                return self.synthetic(request, rpc_id, describe(e))
        return await self.call(request, rpc or request.method, rpc_id)

    async def call(self, request: httpx2.Request, key: str, rpc_id: Any) -> httpx2.Response:
        attempt = Attempt()
        self.last[key] = attempt
        for n in (0, 1):
            try:
                response = await self.inner.handle_async_request(request)
                if "text/event-stream" in response.headers.get("content-type", ""):
                    attempt.status = response.status_code
                    return response
                response = await self.buffered(response, request)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                if n == 0 and retryable_exception(e):
                    attempt.retried, attempt.first = True, describe(e)
                    self.retries += 1
                    self.fresh()
                    await asyncio.sleep(0.5)
                    continue
                attempt.error = describe(e) if retryable_exception(e) else f"not retryable: {describe(e)}"
                return self.synthetic(request, rpc_id, attempt.error)
            retry_after = response.headers.get("retry-after")
            attempt.status, attempt.retry_after = response.status_code, retry_after
            if n == 0 and response.status_code == 503 and retry_after is not None:
                body = response.content[:200].decode("utf-8", "replace")
                attempt.retried, attempt.first = True, f"503 Retry-After: {retry_after} {body}"
                self.retries += 1
                self.fresh()
                await asyncio.sleep(min(retry_after_seconds(retry_after), 2.0))
                continue
            return response
        raise AssertionError("unreachable")

    async def legacy_get(self, request: httpx2.Request) -> httpx2.Response:
        """The session's GET stream: reopened (every 0.5 s, on a new connection) after a
        transport error or a 5xx until it is answered, so the SDK does not give up."""
        request.extensions["timeout"] = {
            "connect": 5.0,
            "read": LEGACY_STREAM_READ_TIMEOUT,
            "write": 30.0,
            "pool": 30.0,
        }
        st = self.legacy_stream
        while True:
            try:
                response = await self.inner.handle_async_request(request)
                if response.status_code == 200:
                    if st is not None:
                        self.load.stream_opened(st)
                        response.stream = TrackedStream(response.stream, lambda why, st=st: self.load.stream_ended(st, why))
                    return response
                response = await self.buffered(response, request)
                problem = f"GET stream answered {response.status_code}: {response.content[:200]!r}"
                if st is not None:
                    self.load.stream_refused(st, problem)
                if response.status_code < 500:
                    return response
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                if st is not None:
                    self.load.stream_refused(st, describe(e))
            if self.load.closing:
                return self.synthetic(request, None, "stopping")
            self.fresh()
            await asyncio.sleep(0.5)


class Counters:
    def __init__(self) -> None:
        self.calls: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"ok": 0, "retried_ok": 0, "failed": 0})
        self.failures: list[dict[str, Any]] = []
        # Every failure, by kind of call and what it was: "kind status code-or-error".
        self.failure_kinds: collections.Counter[str] = collections.Counter()
        self.retried: list[dict[str, Any]] = []
        self.failed_total = 0


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.started_at = now_iso()
        self.token = Path(args.token_file).read_text().strip()
        self.ssl = ssl.create_default_context(cafile=args.ca) if args.ca else ssl.create_default_context()
        self.ns = args.namespace
        self.projects = [f"PID-UPG-{p}" for p in range(args.projects)]
        self.servers = [s for s in args.servers.split(",") if s]
        self.c = Counters()
        self.stop_event = asyncio.Event()
        self.close_event = asyncio.Event()
        self.stopping = False
        self.closing = False
        self.ready = False
        self.ready_at: float | None = None
        # Masters: project -> {"session_id", "term"} as last seen; the baseline at READY.
        self.master: dict[str, dict[str, Any]] = {}
        self.master_changes = 0
        self.master_events: list[dict[str, Any]] = []
        self.preempted_answers = 0
        self.preempted_sessions: set[str] = set()
        self.our_sessions: set[str] = set()
        # Agents.
        tag = secrets.token_hex(4)
        self.http_sessions: list[dict[str, Any]] = []
        for p in self.projects:
            for i in range(1 + args.http_agents):
                sid = f"upg-{p}-{i}-{tag}"
                surface = "claude_desktop" if i == 0 else "claude_code"
                self.http_sessions.append({"project": p, "session_id": sid, "surface": surface, "registered": False})
                self.our_sessions.add(sid)
        self.desk_registered = {p: asyncio.Event() for p in self.projects}
        self.mcp_agents: list[dict[str, Any]] = []
        for i in range(args.mcp_agents):
            p = self.projects[i % len(self.projects)]
            mode = "legacy" if i % 2 == 0 else "modern"
            sid = f"upg-mcp-{i}-{mode}-{tag}"
            self.our_sessions.add(sid)
            self.mcp_agents.append(
                {
                    "i": i,
                    "mode": mode,
                    "project": p,
                    "session_id": sid,
                    "registered": False,
                    "protocol_version": None,
                    "listen": StreamState(f"mcp-{i}-{mode}", p),
                    "subscribed": False,
                }
            )
        self.watches = [StreamState(f"watch-{w}", self.projects[w % len(self.projects)]) for w in range(args.watches)]
        self.stream_errors: list[dict[str, Any]] = []
        self.jobs: list[str] = []
        self.job_ids: set[str] = set()
        self.jobs_created = 0
        self.jobs_existing = 0
        self.jobs_existing_first_try = 0
        self.open_at_stop: dict[str, int] = {"watches": 0, "listens": 0}
        self.clients: list[Any] = []
        self.live_at_stop: dict[str, int] | None = None  # --probe-streams
        self.crashes: list[str] = []  # load tasks that ended with an exception (a bug here)

    # ---- time and stopping -------------------------------------------------------

    def t(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    async def nap(self, seconds: float, until: asyncio.Event | None = None) -> None:
        ev = until or self.stop_event
        try:
            await asyncio.wait_for(ev.wait(), max(0.0, seconds))
        except asyncio.TimeoutError:
            pass

    # ---- connections ---------------------------------------------------------------

    def new_inner_transport(self) -> httpx2.AsyncHTTPTransport:
        return httpx2.AsyncHTTPTransport(verify=self.ssl)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def http_client(self) -> tuple[httpx2.AsyncClient, RetryTransport]:
        transport = RetryTransport(self)
        client = httpx2.AsyncClient(
            base_url=self.args.url,
            headers=self.headers(),
            transport=transport,
            timeout=httpx2.Timeout(30.0, connect=5.0),
        )
        return client, transport

    # ---- counting ------------------------------------------------------------------

    def count(self, kind: str, outcome: str, **detail: Any) -> None:
        self.c.calls[kind][outcome] += 1
        if outcome == "failed":
            self.c.failed_total += 1
            what = detail.get("code") or (detail.get("rpc_error") or {}).get("message") or detail.get("error") or ""
            self.c.failure_kinds[f"{kind} {detail.get('status')} {str(what)[:80]}"] += 1
            sample = {"kind": kind, "t": self.t(), "at": time.time(), "after_ready": self.ready, **detail}
            if len(self.c.failures) < MAX_SAMPLES:
                self.c.failures.append(sample)
            log(f"FAILED {kind} at {self.t()} s: {json.dumps(detail, default=str)[:400]}")
        elif outcome == "retried_ok":
            # Every retry, with its wall-clock time: scripts/e2e.d/upgrade-attribute checks
            # each fell while a replica of the previous release was stopping.
            if len(self.c.retried) < MAX_RETRIED:
                self.c.retried.append({"kind": kind, "t": self.t(), "at": time.time(), **detail})
            log(f"retried_ok {kind} at {self.t()} s: {json.dumps(detail, default=str)[:300]}")

    async def http_call(
        self,
        conn: tuple[httpx2.AsyncClient, RetryTransport],
        kind: str,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
    ) -> tuple[int | None, Any]:
        """One agent call under the retry rule (the RetryTransport does the retry).
        Answers (status, parsed body) on success, (None, None) when it failed."""
        client, transport = conn
        try:
            response = await client.request(method, path, json=body, params=params)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the transport answers everything; this is not expected
            self.count(kind, "failed", status=None, error=f"client: {describe(e)}")
            return None, None
        attempt = transport.last.get(method) or Attempt()
        synthetic = response.headers.get("x-upgrade-load") == "transport"
        if 200 <= response.status_code < 300 and not synthetic:
            try:
                data = response.json()
            except ValueError:
                data = None
            self.count(kind, "retried_ok" if attempt.retried else "ok", **({"first_try": attempt.first} if attempt.retried else {}))
            return response.status_code, data
        text = response.text[:300]
        detail: dict[str, Any] = {"first_try": attempt.first} if attempt.retried else {}
        if synthetic:
            detail.update(status=None, error=attempt.error)
        else:
            detail.update(status=response.status_code, code=error_code(text), body=text)
            if response.status_code == 503:
                detail["retry_after"] = response.headers.get("retry-after")
        self.count(kind, "failed", **detail)
        return None, None

    # ---- masters -------------------------------------------------------------------

    def observe(self, project: str, session_id: str | None, term: Any, source: str) -> None:
        """What one answer says of a project's master (session_id None: not said;
        NO_MASTER: no master). Counts a change after READY."""
        if isinstance(term, bool) or not isinstance(term, int):
            term = None
        cur = self.master.get(project)
        if cur is None:
            self.master[project] = {"session_id": session_id, "term": term}
            return
        if term is not None and cur["term"] is not None and term < cur["term"]:
            return  # an older answer than one already seen (terms only rise)
        new = {
            "session_id": session_id if session_id is not None else cur["session_id"],
            "term": term if term is not None else cur["term"],
        }
        changed_term = term is not None and cur["term"] is not None and term != cur["term"]
        # "<not X>": X said it is no longer master (counted then); who is, a later answer says.
        placeholder = isinstance(cur["session_id"], str) and cur["session_id"].startswith("<not ")
        changed_master = (
            session_id is not None
            and cur["session_id"] is not None
            and session_id != cur["session_id"]
            and not (placeholder and not changed_term)
        )
        if (changed_term or changed_master) and self.ready:
            self.master_changes += 1
            event = {"t": self.t(), "project": project, "from": dict(cur), "to": dict(new), "source": source}
            if len(self.master_events) < 50:
                self.master_events.append(event)
            log(f"MASTER CHANGE {json.dumps(event)}")
        self.master[project] = new

    def observe_role(self, project: str, session_id: str, answer_: dict[str, Any], source: str) -> None:
        """A heartbeat's (or register's) {is_master, term, you_were_preempted}."""
        if not isinstance(answer_, dict):
            return
        term = answer_.get("term")
        if answer_.get("you_were_preempted") is True:
            self.preempted_answers += 1
            if session_id not in self.preempted_sessions:
                self.preempted_sessions.add(session_id)
                log(f"PREEMPTED {session_id} ({project}) at {self.t()} s via {source}")
        if answer_.get("is_master") is True:
            self.observe(project, session_id, term, source)
        else:
            cur = self.master.get(project)
            if cur is not None and cur.get("session_id") == session_id and answer_.get("is_master") is False:
                # The master says it is not master any more: who is, the next read says.
                self.observe(project, f"<not {session_id}>", term, source)
            else:
                self.observe(project, None, term, source)

    def observe_table(self, project: str, table: Any, source: str) -> None:
        if not isinstance(table, dict):
            return
        master = table.get("master")
        sid = master.get("session_id") if isinstance(master, dict) else NO_MASTER
        self.observe(project, sid, table.get("term"), source)

    # ---- streams -------------------------------------------------------------------

    def stream_opened(self, st: StreamState) -> None:
        if st.opened > 0:
            st.resumed += 1
            log(f"{st.name} resumed at {self.t()} s")
        st.opened += 1
        st.open = True
        st.opened_at = time.monotonic()

    def stream_ended(self, st: StreamState, why: str) -> None:
        if not st.open:
            return
        st.open = False
        st.ready = False
        if not self.closing:
            st.ended += 1
            log(f"{st.name} ended at {self.t()} s ({why[:160]})")

    def stream_refused(self, st: StreamState, problem: str) -> None:
        st.refused += 1
        if len(self.stream_errors) < MAX_RETRIED:
            self.stream_errors.append({"stream": st.name, "t": self.t(), "at": time.time(), "error": problem[:300]})

    # ---- HTTP agents ---------------------------------------------------------------

    async def http_agent(self, s: dict[str, Any]) -> None:
        p, sid = s["project"], s["session_id"]
        if s["surface"] != "claude_desktop":
            await self.desk_registered[p].wait()
        conn = self.http_client()
        self.clients.append(conn)
        register = {"namespace": self.ns, "project_id": p, "session_id": sid, "agent_surface": s["surface"]}
        while not self.stopping and not s["registered"]:
            status, data = await self.http_call(conn, "http.register", "POST", "/api/v1/controller/register", body=register)
            if status is not None:
                s["registered"] = True
                self.observe_role(p, sid, data, "http.register")
                self.observe_table(p, (data or {}).get("routing"), "http.register")
                if s["surface"] == "claude_desktop":
                    self.desk_registered[p].set()
            else:
                await self.nap(1.0)
        await self.nap(random.uniform(0, HEARTBEAT_EVERY))
        next_beat = next_status = time.monotonic()
        while not self.stopping:
            if time.monotonic() >= next_beat:
                next_beat += HEARTBEAT_EVERY
                _, data = await self.http_call(
                    conn,
                    "http.heartbeat",
                    "POST",
                    "/api/v1/controller/heartbeat",
                    body={"namespace": self.ns, "session_id": sid},
                )
                if data is not None:
                    self.observe_role(p, sid, data, "http.heartbeat")
            if self.stopping:
                break
            if time.monotonic() >= next_status:
                next_status += STATUS_EVERY
                _, data = await self.http_call(
                    conn, "http.status", "GET", f"/api/v1/controller/{quote(p, safe='')}/status", params={"namespace": self.ns}
                )
                if data is not None:
                    self.observe_table(p, data, "http.status")
            now = time.monotonic()
            next_beat = max(next_beat, now - HEARTBEAT_EVERY)  # never a burst to catch up
            next_status = max(next_status, now - STATUS_EVERY)
            await self.nap(min(next_beat, next_status) - time.monotonic())

    # ---- MCP agents ----------------------------------------------------------------

    @asynccontextmanager
    async def mcp_client(self, a: dict[str, Any]):
        legacy = a["mode"] == "legacy"

        async def on_message(message: Any) -> None:
            if getattr(message, "method", None) == "notifications/resources/updated":
                a["listen"].events += 1

        transport = RetryTransport(self, legacy_stream=a["listen"] if legacy else None, mcp=True)
        http = httpx2.AsyncClient(headers=self.headers(), transport=transport, timeout=httpx2.Timeout(30.0, connect=5.0))
        try:
            async with http:
                client = Client(
                    # No DELETE of the MCP session at the end: the load leaves everything as it is.
                    streamable_http_client(self.args.url.rstrip("/") + "/mcp", http_client=http, terminate_on_close=False),
                    mode="legacy" if legacy else "auto",
                    client_info=Implementation(name=SDK_CLIENT_NAME, version="1.0.0"),
                    message_handler=on_message if legacy else None,
                    read_timeout_seconds=70,
                )
                async with client:
                    yield client, transport
        finally:
            await transport.aclose()

    async def mcp_request(
        self, kind: str, transport: RetryTransport, rpc: str, make: Any, tool_result: bool = False
    ) -> tuple[bool, Any]:
        """One MCP request under the retry rule: a transport error or a 503 with
        Retry-After is retried below (RetryTransport); a tool error of the unavailable
        class is retried here, once. Answers (ok, result)."""
        first: str | None = None
        for n in (0, 1):
            transport.last.pop(rpc, None)
            detail: dict[str, Any] = {}
            try:
                result = await make()
                if tool_result:
                    out = answer(result)
                    if not out["is_error"]:
                        attempt = transport.last.get(rpc)
                        retried = n == 1 or (attempt is not None and attempt.retried)
                        why = first or (attempt.first if attempt else None)
                        self.count(kind, "retried_ok" if retried else "ok", **({"first_try": why} if retried else {}))
                        return True, out
                    code = (out.get("error") or {}).get("code")
                    detail = {"status": 200, "code": code, "body": out["text"][:300]}
                    attempt = transport.last.get(rpc)
                    if n == 0 and unavailable_class(code) and not (attempt and attempt.retried):
                        first = f"tool error {code}"
                        await asyncio.sleep(1.0)
                        continue
                else:
                    attempt = transport.last.get(rpc)
                    retried = attempt is not None and attempt.retried
                    self.count(kind, "retried_ok" if retried else "ok", **({"first_try": attempt.first} if retried else {}))
                    return True, result
            except asyncio.CancelledError:
                raise
            except MCPError as e:
                detail = {"rpc_error": {"code": e.error.code, "message": e.error.message[:300]}}
            except Exception as e:  # noqa: BLE001
                detail = {"error": describe(e)}
            attempt = transport.last.get(rpc)
            if attempt is not None:
                if attempt.error:
                    detail["error"] = attempt.error
                if attempt.status is not None:
                    detail["status"] = attempt.status
                if attempt.retried:
                    detail["first_try"] = attempt.first
            if first:
                detail["first_try"] = first
            self.count(kind, "failed", **detail)
            return False, detail
        raise AssertionError("unreachable")

    async def mcp_agent(self, a: dict[str, Any]) -> None:
        """One MCP agent: one SDK client for its whole life (a legacy one keeps its
        Mcp-Session-Id across replicas); a new client only when the SDK's client ended or
        the server no longer knows the MCP session (each counted as a failure)."""
        await asyncio.gather(*(e.wait() for e in self.desk_registered.values()))
        while not self.stopping:
            connected = False
            try:
                async with self.mcp_client(a) as (client, transport):
                    connected = True
                    a["protocol_version"] = client.protocol_version
                    if a["mode"] == "modern" and client.protocol_version not in MODERN_PROTOCOL_VERSIONS:
                        # "auto" fell back to the initialize handshake (its discover failed).
                        self.count(
                            "mcp.connect",
                            "failed",
                            mode=a["mode"],
                            error=f"negotiated {client.protocol_version}, not the stateless generation",
                        )
                        await self.nap(1.0)
                        continue
                    self.count("mcp.connect", "retried_ok" if transport.retries else "ok", mode=a["mode"])
                    try:
                        await self.mcp_session(a, client, transport)
                        if self.stopping:
                            # The client and its stream stay until the streams are counted.
                            await self.close_event.wait()
                    finally:
                        listener = a.pop("listener", None)
                        if listener is not None:
                            listener.cancel()
                            await asyncio.gather(listener, return_exceptions=True)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the SDK's client ended: a new one
                if self.stopping:
                    break
                if not connected:
                    self.count("mcp.connect", "failed", mode=a["mode"], error=describe(e))
                else:
                    log(f"mcp agent {a['i']} ({a['mode']}): client ended: {describe(e)}")
                    self.stream_refused(a["listen"], f"client ended: {describe(e)}")
                await self.nap(1.0)

    async def mcp_session(self, a: dict[str, Any], client: Client, transport: RetryTransport) -> None:
        """Register (once per agent), follow the project, heartbeat; returns when stopping
        or when this client should be replaced."""
        p, sid = a["project"], a["session_id"]
        uri = f"prism://{self.ns}/projects/{quote(p, safe='')}"
        ns = {"namespace": self.ns}
        a["subscribed"] = False
        while not self.stopping and not a["registered"]:
            ok, out = await self.mcp_request(
                "mcp.register",
                transport,
                "tools/call",
                lambda: client.call_tool("prism_start", {"project_id": p, "session_id": sid, "agent_surface": "claude_code", **ns}),
                tool_result=True,
            )
            if ok:
                a["registered"] = True
                structured = out.get("structured") or {}
                self.observe_role(p, sid, structured, "mcp.register")
                self.observe_table(p, structured.get("routing"), "mcp.register")
            elif session_lost(out):
                return
            else:
                await self.nap(1.0)
        if self.stopping:
            return
        if a["mode"] == "modern":
            a["listener"] = asyncio.create_task(self.listen_loop(a, client, uri))
        await self.nap(random.uniform(0, HEARTBEAT_EVERY))
        next_beat = time.monotonic()
        while not self.stopping:
            if a["mode"] == "legacy" and not a["subscribed"]:
                ok, out = await self.mcp_request(
                    "mcp.subscribe", transport, "resources/subscribe", lambda: client.subscribe_resource(uri)
                )
                a["subscribed"] = ok
                if not ok and session_lost(out):
                    return
            next_beat += HEARTBEAT_EVERY
            ok, out = await self.mcp_request(
                "mcp.heartbeat",
                transport,
                "tools/call",
                lambda: client.call_tool("prism_heartbeat", {"session_id": sid, **ns}),
                tool_result=True,
            )
            if ok:
                self.observe_role(p, sid, out.get("structured") or {}, "mcp.heartbeat")
            else:
                # The same client (and, session-based, the same Mcp-Session-Id) carries on
                # through failures: only a session the server no longer knows needs another.
                if session_lost(out):
                    log(f"mcp agent {a['i']} ({a['mode']}): the server does not know the MCP session; a new client")
                    return
            next_beat = max(next_beat, time.monotonic() - HEARTBEAT_EVERY)
            await self.nap(next_beat - time.monotonic())

    async def listen_loop(self, a: dict[str, Any], client: Client, uri: str) -> None:
        """subscriptions/listen (2026-07-28), reopened whenever it ends."""
        st: StreamState = a["listen"]
        while not self.closing:
            try:
                async with client.listen(resource_subscriptions=[uri]) as sub:
                    self.stream_opened(st)
                    st.ready = True
                    why = "closed by the server"
                    try:
                        async for _event in sub:
                            st.events += 1
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:  # noqa: BLE001 - SubscriptionLost
                        why = describe(e)
                    self.stream_ended(st, why)
            except asyncio.CancelledError:
                st.open = False
                raise
            except Exception as e:  # noqa: BLE001 - refused or not acknowledged
                self.stream_refused(st, describe(e))
            await self.nap(0.5, self.close_event)

    # ---- watches -------------------------------------------------------------------

    async def watch(self, st: StreamState) -> None:
        path = f"/api/v1/controller/{quote(st.project, safe='')}/watch"
        while not self.closing:
            headers = {"Accept": "text/event-stream", **self.headers()}
            if st.last_id:
                headers["Last-Event-ID"] = st.last_id
            client = httpx2.AsyncClient(
                base_url=self.args.url,
                verify=self.ssl,
                timeout=httpx2.Timeout(connect=5.0, read=WATCH_READ_TIMEOUT, write=30.0, pool=30.0),
            )
            why = "closed by the server"
            try:
                async with client.stream("GET", path, params={"namespace": self.ns}, headers=headers) as r:
                    if r.status_code != 200:
                        body = (await r.aread())[:300].decode("utf-8", "replace")
                        self.stream_refused(st, f"{r.status_code} {body}")
                    else:
                        self.stream_opened(st)
                        try:
                            await self.read_watch(st, r)
                        except asyncio.CancelledError:
                            raise
                        except Exception as e:  # noqa: BLE001
                            why = describe(e)
                        self.stream_ended(st, why)
            except asyncio.CancelledError:
                st.open = False
                raise
            except Exception as e:  # noqa: BLE001
                if st.open:
                    self.stream_ended(st, describe(e))
                else:
                    self.stream_refused(st, describe(e))
            finally:
                try:
                    await asyncio.wait_for(client.aclose(), 2)
                except BaseException:  # noqa: BLE001
                    pass
            await self.nap(0.5, self.close_event)

    async def read_watch(self, st: StreamState, r: httpx2.Response) -> None:
        event, data, eid = "message", [], None
        async for line in r.aiter_lines():
            if line == "":
                if data or eid is not None:
                    self.watch_event(st, event, "\n".join(data), eid)
                event, data, eid = "message", [], None
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
            elif field == "id":
                eid = value

    def watch_event(self, st: StreamState, event: str, data: str, eid: str | None) -> None:
        st.events += 1
        if eid:
            st.last_id = eid
        if event == "routing":
            st.ready = True
            try:
                table = json.loads(data)
            except ValueError:
                return
            self.observe_table(st.project, table, f"watch {st.name}")
        elif event == "reset":
            st.last_id = None  # a fresh snapshot next time
        elif event == "error":
            self.stream_refused(st, f"error event: {data[:250]}")

    # ---- producer ------------------------------------------------------------------

    async def producer(self) -> None:
        if self.args.rate <= 0 or not self.servers:
            return
        conn = self.http_client()
        self.clients.append(conn)
        interval = 1.0 / self.args.rate
        k = 0
        next_at = time.monotonic()
        while not self.stopping:
            await self.nap(next_at - time.monotonic())
            if self.stopping:
                break
            body = {
                "server_instance_id": self.servers[k % len(self.servers)],
                "component_kind": self.args.component_kind,
                "kind": self.args.job_kind,
                "payload": {"n": k},
                "namespace": self.ns,
                "idempotency_key": f"upg-{self.args.seed}-{k}",
            }
            _, transport = conn
            status, data = await self.http_call(conn, "enqueue", "POST", "/api/v1/runtime/jobs", body=body)
            if status is not None and isinstance(data, dict) and data.get("id"):
                if status == 201:
                    self.jobs_created += 1
                else:
                    self.jobs_existing += 1
                    attempt = transport.last.get("POST")
                    if not (attempt and attempt.retried):
                        self.jobs_existing_first_try += 1
                if data["id"] not in self.job_ids:
                    self.job_ids.add(data["id"])
                    self.jobs.append(data["id"])
            k += 1
            next_at = max(next_at + interval, time.monotonic() - 5 * interval)

    # ---- readiness, progress, stop ------------------------------------------------

    def streams(self) -> tuple[list[StreamState], list[StreamState]]:
        return self.watches, [a["listen"] for a in self.mcp_agents]

    def listen_open(self, a: dict[str, Any]) -> bool:
        st = a["listen"]
        if a["mode"] == "legacy":
            return st.open and a["subscribed"]
        return st.open and st.ready

    def missing(self) -> list[str]:
        out = [f"http {s['session_id']}" for s in self.http_sessions if not s["registered"]]
        out += [f"mcp {a['session_id']}" for a in self.mcp_agents if not a["registered"]]
        out += [f"{w.name}" for w in self.watches if not (w.open and w.ready)]
        out += [f"listen {a['listen'].name}" for a in self.mcp_agents if not self.listen_open(a)]
        return out

    async def readiness(self) -> None:
        last_note = time.monotonic()
        while not self.stopping:
            missing = self.missing()
            if not missing:
                self.ready = True
                self.ready_at = self.t()
                self.baseline = {p: dict(m) for p, m in self.master.items()}
                foreign = [p for p, m in self.master.items() if m.get("session_id") not in self.our_sessions]
                if foreign:
                    log(f"note: at READY the master of {foreign} is not one of this load's sessions: {self.master}")
                log(f"READY at {self.ready_at} s: masters {json.dumps(self.master)}")
                sys.stdout.write("READY\n")
                sys.stdout.flush()
                return
            if time.monotonic() - last_note > 10:
                last_note = time.monotonic()
                log(f"not ready yet at {self.t()} s; waiting for: {', '.join(missing[:8])}")
            await self.nap(0.2)

    async def progress(self) -> None:
        while not self.stopping:
            await self.nap(15.0)
            if self.stopping:
                break
            totals = collections.Counter()
            for c in self.c.calls.values():
                totals.update(c)
            w, l_ = self.streams()
            log(
                f"t={self.t()} s calls ok={totals['ok']} retried_ok={totals['retried_ok']} failed={totals['failed']}"
                f" | watches open {sum(s.open for s in w)}/{len(w)} resumed {sum(s.resumed for s in w)}"
                f" | listens open {sum(self.listen_open(a) for a in self.mcp_agents)}/{len(l_)}"
                f" resumed {sum(s.resumed for s in l_)} | jobs {len(self.jobs)} | master changes {self.master_changes}"
            )

    async def probe_streams(self) -> None:
        """--probe-streams: are the (resumed) streams still delivering? One more
        claude_code peer registers on every project (a change of its routing table, no
        change of master); within 4 s every watch should get an event and every listen a
        notification. Counted as `live_at_stop`."""
        before = {id(st): st.events for st in self.watches + [a["listen"] for a in self.mcp_agents]}
        conn = self.http_client()
        tag = secrets.token_hex(4)
        for p in self.projects:
            body = {"namespace": self.ns, "project_id": p, "session_id": f"upg-probe-{p}-{tag}", "agent_surface": "claude_code"}
            await self.http_call(conn, "probe.register", "POST", "/api/v1/controller/register", body=body)
        listens = [a["listen"] for a in self.mcp_agents]
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            if all(st.events > before[id(st)] for st in self.watches + listens):
                break
            await asyncio.sleep(0.1)
        self.live_at_stop = {
            "watches": sum(1 for st in self.watches if st.events > before[id(st)]),
            "listens": sum(1 for st in listens if st.events > before[id(st)]),
        }
        log(f"probe: streams that delivered the probe's change: {self.live_at_stop}")

    async def wait_for_stop(self) -> None:
        stop_file = Path(self.args.stop_file)
        while not self.stop_event.is_set():
            if stop_file.exists():
                log(f"stop file {stop_file} seen at {self.t()} s")
                break
            await self.nap(0.5)
        self.stopping = True
        self.stop_event.set()

    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop_event.set)
            except (NotImplementedError, RuntimeError):
                pass
        log(
            f"{len(self.http_sessions)} HTTP sessions over {len(self.projects)} projects, {len(self.mcp_agents)} MCP agents,"
            f" {len(self.watches)} watches, {self.args.rate} jobs/s to {self.servers} in {self.ns}; seed {self.args.seed}"
        )
        callers = [asyncio.create_task(self.http_agent(s)) for s in self.http_sessions]
        callers += [asyncio.create_task(self.mcp_agent(a)) for a in self.mcp_agents]
        streams = [asyncio.create_task(self.watch(w)) for w in self.watches]
        aux = [asyncio.create_task(self.readiness()), asyncio.create_task(self.progress())]

        async def produce_when_ready() -> None:
            while not self.ready and not self.stopping:
                await self.nap(0.2)
            await self.producer()

        callers.append(asyncio.create_task(produce_when_ready()))
        await self.wait_for_stop()
        stopped_at = time.monotonic()
        # Streams that are reconnecting right now get up to 3 s to be open again.
        while time.monotonic() - stopped_at < 3.0:
            if all(w.open for w in self.watches) and all(self.listen_open(a) for a in self.mcp_agents):
                break
            await asyncio.sleep(0.1)
        self.open_at_stop = {
            "watches": sum(1 for w in self.watches if w.open),
            "listens": sum(1 for a in self.mcp_agents if self.listen_open(a)),
        }
        if self.args.probe_streams:
            await self.probe_streams()
        seconds = round(time.monotonic() - self.t0, 2)
        self.closing = True
        self.close_event.set()
        # Calls in flight finish (up to ~3 s), then everything is cancelled.
        for task in streams + aux:
            task.cancel()
        _, pending = await asyncio.wait(callers, timeout=3.0)
        for task in pending:
            task.cancel()
        await asyncio.wait(callers + streams + aux, timeout=2.0)
        for task in callers + streams + aux:
            if task.done() and not task.cancelled() and task.exception() is not None:
                self.crashes.append(describe(task.exception()))
                log(f"CRASH of a load task: {describe(task.exception())}")
        return self.summary(seconds)

    def summary(self, seconds: float) -> dict[str, Any]:
        w, listens = self.streams()

        def stream_totals(states: list[StreamState], open_at_stop: int, want: int, events_key: str) -> dict[str, Any]:
            return {
                "opened": sum(s.opened for s in states),
                "ended": sum(s.ended for s in states),
                "resumed": sum(s.resumed for s in states),
                "open_at_stop": open_at_stop,
                events_key: sum(s.events for s in states),
                "want": want,
                "refused": sum(s.refused for s in states),
                "each": [
                    {
                        "name": s.name,
                        "project": s.project,
                        "opened": s.opened,
                        "ended": s.ended,
                        "resumed": s.resumed,
                        events_key: s.events,
                        "refused": s.refused,
                    }
                    for s in states
                ],
            }

        listens_out = stream_totals(listens, self.open_at_stop["listens"], len(listens), "notifications")
        watches_out = stream_totals(w, self.open_at_stop["watches"], len(w), "events")
        if self.live_at_stop is not None:
            watches_out["live_at_stop"] = self.live_at_stop["watches"]
            listens_out["live_at_stop"] = self.live_at_stop["listens"]
        for entry, a in zip(listens_out["each"], self.mcp_agents):
            entry.update(mode=a["mode"], protocol_version=a["protocol_version"], session_id=a["session_id"])
        return {
            "seconds": seconds,
            "started_at": self.started_at,
            "ready": self.ready,
            "ready_at_seconds": self.ready_at,
            "namespace": self.ns,
            "seed": self.args.seed,
            "calls": {k: dict(v) for k, v in sorted(self.c.calls.items())},
            "failed_total": self.c.failed_total,
            "failures": self.c.failures,
            "failure_kinds": dict(self.c.failure_kinds.most_common()),
            "retried_samples": self.c.retried,
            "master_changes": self.master_changes,
            "master_change_events": self.master_events,
            "preempted": len(self.preempted_sessions),
            "preempted_answers": self.preempted_answers,
            "preempted_sessions": sorted(self.preempted_sessions),
            "masters": {p: self.master.get(p) for p in self.projects},
            "masters_at_ready": getattr(self, "baseline", None),
            "sessions": {
                "http": [{"project": s["project"], "session_id": s["session_id"], "agent_surface": s["surface"]} for s in self.http_sessions],
                "mcp": [{"project": a["project"], "session_id": a["session_id"], "mode": a["mode"]} for a in self.mcp_agents],
            },
            "watches": watches_out,
            "listens": listens_out,
            "stream_errors": self.stream_errors,
            "crashes": self.crashes,
            "jobs": {
                "enqueued": self.jobs,
                "count": len(self.jobs),
                "created": self.jobs_created,
                "existing": self.jobs_existing,
                "existing_on_first_try": self.jobs_existing_first_try,
            },
        }


def human(s: dict[str, Any]) -> str:
    lines = [f"upgrade-load: {s['seconds']} s, ready={s['ready']} (at {s['ready_at_seconds']} s)"]
    for kind, c in s["calls"].items():
        lines.append(f"  {kind:16} ok {c['ok']:6}  retried_ok {c['retried_ok']:4}  failed {c['failed']:4}")
    lines.append(f"  failed_total {s['failed_total']}  master_changes {s['master_changes']}  preempted {s['preempted']}")
    for f in s["failures"]:
        lines.append(f"    failure: {json.dumps(f, default=str)[:300]}")
    for name in ("watches", "listens"):
        x = s[name]
        extra = x.get("events", x.get("notifications"))
        lines.append(
            f"  {name:8} want {x['want']} open_at_stop {x['open_at_stop']} opened {x['opened']} ended {x['ended']}"
            f" resumed {x['resumed']} refused {x['refused']} {'events' if name == 'watches' else 'notifications'} {extra}"
            + (f" live_at_stop {x['live_at_stop']}" if "live_at_stop" in x else "")
        )
    lines.append(f"  jobs enqueued {s['jobs']['count']} (201: {s['jobs']['created']}, 200: {s['jobs']['existing']})")
    lines.append(f"  masters {json.dumps(s['masters'])}")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Continuous client load for the upgrade/rollback test (SPEC §15).")
    p.add_argument("--url", required=True, help="the API base URL (https://host:port), without /mcp")
    p.add_argument("--ca", default="", help="CA file the API's certificate is checked against")
    p.add_argument("--token-file", required=True, help="a ServiceAccount token (audience prism-operator)")
    p.add_argument("--namespace", required=True)
    p.add_argument("--projects", type=int, default=3)
    p.add_argument("--http-agents", type=int, default=2, help="claude_code peers per project (besides its desktop master)")
    p.add_argument("--mcp-agents", type=int, default=2, help="MCP agents in all (even: session-based, odd: 2026-07-28)")
    p.add_argument("--watches", type=int, default=3)
    p.add_argument("--servers", default="", help="server_instance_ids to enqueue jobs for, comma-separated")
    p.add_argument("--component-kind", default="run")
    p.add_argument("--job-kind", default="lifecycle", help="the jobs' kind (SPEC §8: lifecycle|config|file|log|protected_request)")
    p.add_argument("--rate", type=float, default=2.0, help="jobs per second")
    p.add_argument("--stop-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=None, help="in the jobs' idempotency keys (default: random)")
    p.add_argument(
        "--probe-streams",
        action="store_true",
        help="at the stop, register one more claude_code peer per project and count the watches and listens"
        " that deliver that change (live_at_stop)",
    )
    args = p.parse_args()
    if args.projects < 1 or args.http_agents < 0 or args.mcp_agents < 0 or args.watches < 0 or args.rate < 0:
        p.error("counts must be >= 0 (projects >= 1)")
    if args.rate > 0 and not [s for s in args.servers.split(",") if s]:
        p.error("--servers is required when --rate > 0")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 2**31)
    if not Path(args.token_file).is_file():
        p.error(f"--token-file {args.token_file}: no such file")
    if Path(args.stop_file).exists():
        p.error(f"--stop-file {args.stop_file} exists already: remove it first (the load would stop at once)")
    if args.ca and not Path(args.ca).is_file():
        p.error(f"--ca {args.ca}: no such file")
    return args


def main() -> None:
    args = parse_args()
    random.seed(args.seed)
    summary = asyncio.run(Load(args).run())
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    tmp.replace(out)
    sys.stderr.write(human(summary) + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    # Whatever the SDK still has running is not waited for. A task of the load that
    # crashed is a bug of the load, not of the operator: exit 3 (the summary is written).
    os._exit(3 if summary["crashes"] else 0)


if __name__ == "__main__":
    main()

"""The /mcp phase of scripts/fuzz-api: every tool the server lists, called with arguments
generated from its own inputSchema (valid ones, and invalid ones: wrong types, missing
required, extra properties, huge strings, control characters, NUL, arguments that are no
object), in both protocol generations (the session-based revisions 2025-03-26,
2025-06-18 and 2025-11-25 after `initialize`, and the stateless 2026-07-28 revision with
per-request `_meta` and the `MCP-Protocol-Version` / `Mcp-Method` / `Mcp-Name` headers),
as four identities: no token, a token without rights, a token that may only `get` and
`list` registrations (a reader), and the token allowed in namespace `agents` (a writer).
Then malformed JSON-RPC (not JSON, not an object, bad ids, methods, params), wrong HTTP
methods and headers, oversize bodies, forged session ids, bad `Host` and `Origin`.

Checks, on every answer:
  no_5xx             never an answer >= 500
  jsonrpc_shape      a JSON-RPC answer is one object, "jsonrpc": "2.0", the request's id,
                     exactly one of result/error, an error with an integer code and a text
  challenge          a 401 carries WWW-Authenticate: Bearer realm="prism"
  refused_writes_nothing
                     a refused call (HTTP 4xx, JSON-RPC error, or a tool result with
                     isError: true) changes no row of any table and no resource (by value:
                     state.py); and whatever the no-token, no-rights and reader identities
                     send changes nothing, accepted or not (a get/list identity never
                     refreshes a heartbeat, SPEC §4 rule 8)
  output_schema      the structuredContent of every successful tool result conforms to the
                     tool's outputSchema, when it declares one
  tool_error_shape   a tool error has no structuredContent and its text content is the JSON
                     {"error": {"code", "message"}} (SPEC §9: clients check structuredContent
                     against the outputSchema even on errors)
  invalid_refused    arguments that the tool's own inputSchema rejects are refused
  printable_ids      prism_start refuses a project_id or session_id with a control
                     character (SPEC §3.1: printable)
  d6_fields          a successful result of a call naming a session_id carries `role` and
                     `you_were_preempted` at the top of structuredContent (SPEC §9)
  schemas_valid      tools/list gives every tool a name and valid JSON Schemas
  host_before_token  a bad Host/Origin is 403, whatever the token (SPEC §9)
  foreign_session    another identity's Mcp-Session-Id is 404 (the MCP guide: never its facts)
  initialize         initialize gives a token the server takes an Mcp-Session-Id, and is
                     401 without a token
  tools_list         both generations list the same tools

A self-test first feeds every check a deliberately bad case and fails unless each check
fails on it (and the write check sees a real granted write).

    python mcp.py --url URL [--examples N] [--seed S] [--namespace agents]
tokens in $K8S_TOKEN (writer), $READER_TOKEN, $NORIGHTS_TOKEN; $PRISM_CA_CERT for https.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import hypothesis.strategies as st
import jsonschema
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from state import Durable, control_char_fields, diff, session_strings  # noqa: E402

LEGACY = ["2025-03-26", "2025-06-18", "2025-11-25"]
MODERN = "2026-07-28"
MAX_BODY = 64 * 1024  # crates/prism-api/src/lib.rs MAX_BODY_BYTES
CLIENT = {"name": "prism-fuzz", "version": "1.0.0"}
def tool_error_code(result: dict) -> Any:
    """The code of a tool error: its text content is the error JSON (SPEC §9)."""
    text = "".join(c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict))
    try:
        return ((json.loads(text) or {}).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string", "minLength": 1}, "message": {"type": "string"}},
        }
    },
}


def log(msg: str) -> None:
    print(f"[fuzz-api] mcp: {msg}", file=sys.stderr, flush=True)


# --- the wire -------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    json: Any = None

    @property
    def rpc_error(self) -> dict | None:
        if isinstance(self.json, dict) and "jsonrpc" in self.json:
            return self.json.get("error")
        return None

    @property
    def result(self) -> dict | None:
        r = self.json.get("result") if isinstance(self.json, dict) else None
        return r if isinstance(r, dict) else None


@dataclass
class Request:
    """One HTTP request to /mcp, as sent (for the report and the reproduction)."""

    method: str
    headers: dict[str, str]
    body: bytes | None
    path: str = "/mcp"

    def show(self, limit: int = 700) -> str:
        hdrs = {k: (v if k.lower() != "authorization" else v[:13] + "...") for k, v in self.headers.items()}
        body = (self.body or b"").decode("utf-8", "backslashreplace")
        if len(body) > limit:
            body = body[:limit] + f"... ({len(self.body or b'')} bytes)"
        return f"{self.method} {self.path} {json.dumps(hdrs)} {body}"


class Client:
    """One identity speaking one protocol version over one kept-alive connection."""

    def __init__(self, base: str, verify: Any, token: str | None, identity: str, version: str):
        self.base, self.identity, self.version = base.rstrip("/"), identity, version
        self.http = requests.Session()
        self.verify = verify  # per request: $REQUESTS_CA_BUNDLE would win over Session.verify
        self.token = token
        self.session_id: str | None = None
        self.next_id = 1

    @property
    def modern(self) -> bool:
        return self.version == MODERN

    def headers(self, method: str | None = None, name: str | None = None) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        if self.modern:
            h["MCP-Protocol-Version"] = MODERN
            if method:
                h["Mcp-Method"] = method
            if name is not None and method == "tools/call":
                h["Mcp-Name"] = name
        else:
            if self.version >= "2025-06-18" and self.session_id:
                h["MCP-Protocol-Version"] = self.version
            if self.session_id:
                h["Mcp-Session-Id"] = self.session_id
        return h

    def message(self, method: str, params: dict | None) -> dict:
        params = dict(params or {})
        if self.modern:
            meta = dict(params.get("_meta") or {})
            meta.setdefault("io.modelcontextprotocol/protocolVersion", MODERN)
            meta.setdefault("io.modelcontextprotocol/clientInfo", CLIENT)
            meta.setdefault("io.modelcontextprotocol/clientCapabilities", {})
            params["_meta"] = meta
        self.next_id += 1
        return {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}

    def send(self, req: Request) -> Answer:
        r = self.http.request(req.method, self.base + req.path, headers=req.headers, data=req.body, timeout=60,
                              verify=self.verify, stream=True)
        headers = {k.lower(): v for k, v in r.headers.items()}
        if req.method == "GET" and headers.get("content-type", "").startswith("text/event-stream"):
            # A session's GET stream (its resource notifications) stays open until the
            # client leaves: its status and headers are the answer.
            r.close()
            return Answer(r.status_code, headers, b"", None)
        try:
            parsed = r.json() if r.content else None
        except ValueError:
            parsed = None
        return Answer(r.status_code, headers, r.content, parsed)

    def rpc_request(self, method: str, params: dict | None, name: str | None = None) -> Request:
        body = json.dumps(self.message(method, params)).encode()
        return Request("POST", self.headers(method, name), body)

    def open(self) -> Answer | None:
        """The handshake of the session-based revisions (initialize + initialized)."""
        if self.modern:
            return None
        msg = {
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": self.version, "capabilities": {}, "clientInfo": CLIENT},
        }
        a = self.send(Request("POST", self.headers(), json.dumps(msg).encode()))
        if a.status == 200 and a.headers.get("mcp-session-id"):
            self.session_id = a.headers["mcp-session-id"]
            note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            self.send(Request("POST", self.headers("notifications/initialized"), json.dumps(note).encode()))
        return a


# --- checks ---------------------------------------------------------------------------


@dataclass
class Case:
    """What one exchange was: who, which version, what kind of input."""

    identity: str
    version: str
    kind: str  # "valid", an invalid mutation, or a protocol case
    tool: str | None = None
    arguments: Any = None
    schema_valid: bool | None = None  # do the arguments satisfy the tool's inputSchema?
    expect_refused: bool = False


class Checks:
    """The checks of one exchange; each failure is (check, message)."""

    def __init__(self, tools: dict[str, dict]):
        self.tools = tools

    def run(self, case: Case, req: Request, a: Answer) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if a.status >= 500:
            out.append(("no_5xx", f"HTTP {a.status}"))
        if a.status == 401 and a.headers.get("www-authenticate") != 'Bearer realm="prism"':
            out.append(("challenge", f"401 with WWW-Authenticate {a.headers.get('www-authenticate')!r}"))
        out += self.jsonrpc_shape(req, a)
        if case.kind.startswith("host") and a.status != 403:
            out.append(("host_before_token", f"a bad Host/Origin answered {a.status}, not 403"))
        if case.kind == "foreign_session" and case.identity != "none" and a.status != 404:
            out.append(("foreign_session", f"another identity's Mcp-Session-Id answered {a.status}, not 404"))
        result = a.result
        if case.tool and result is not None and "content" in result:
            out += self.tool_result(case, result)
        return out

    @staticmethod
    def jsonrpc_shape(req: Request, a: Answer) -> list[tuple[str, str]]:
        ctype = a.headers.get("content-type", "")
        if not a.body or not ctype.startswith("application/json"):
            return []
        msg = a.json
        if not isinstance(msg, dict):
            return [("jsonrpc_shape", f"a JSON answer that is no object: {a.body[:200]!r}")]
        if "jsonrpc" not in msg:
            # The HTTP API's error shape ({"error": {"code", "message"}}): the gate's 401 and
            # 403 before any JSON-RPC is read, and the router's 404 beside /mcp.
            if 400 <= a.status < 500 and isinstance(msg.get("error"), dict):
                return []
            return [("jsonrpc_shape", f"HTTP {a.status} answer is neither JSON-RPC nor an API error: {a.body[:200]!r}")]
        problems = []
        if msg.get("jsonrpc") != "2.0":
            problems.append(f"jsonrpc {msg.get('jsonrpc')!r}")
        if ("result" in msg) == ("error" in msg):
            problems.append("not exactly one of result and error")
        err = msg.get("error")
        if err is not None and not (
            isinstance(err, dict) and isinstance(err.get("code"), int) and isinstance(err.get("message"), str)
        ):
            problems.append(f"error {err!r}")
        try:
            sent = json.loads(req.body or b"")
        except (ValueError, RecursionError):
            sent = None
        if isinstance(sent, dict) and "id" in sent and isinstance(sent["id"], (str, int)) and not isinstance(
            sent["id"], bool
        ):
            if msg.get("id") != sent["id"] and not (err is not None and msg.get("id") is None):
                problems.append(f"id {msg.get('id')!r} for request id {sent['id']!r}")
        return [("jsonrpc_shape", "; ".join(problems))] if problems else []

    def tool_result(self, case: Case, result: dict) -> list[tuple[str, str]]:
        out = []
        tool = self.tools.get(case.tool or "")
        sc = result.get("structuredContent")
        if not isinstance(result.get("content"), list):
            out.append(("tool_result_shape", f"content is {type(result.get('content')).__name__}"))
        if result.get("isError") is True:
            text = "".join(c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict))
            try:
                body = json.loads(text)
            except ValueError:
                body = None
            problems = schema_errors(ERROR_SCHEMA, body)
            if sc is not None:
                problems = "; ".join(p for p in (problems, "structuredContent present on a tool error") if p)
            if problems:
                out.append(("tool_error_shape", f"text {text[:300]!r}, structuredContent {json.dumps(sc)[:200]}: {problems}"))
            return out
        if case.schema_valid is False:
            out.append(
                ("invalid_refused", f"{case.tool} accepted arguments its inputSchema rejects ({case.kind})")
            )
        if case.tool == "prism_start" and isinstance(case.arguments, dict):
            # SPEC §3.1: projectId and sessionId are printable, no control characters.
            bad = control_char_fields(case.arguments)
            if bad:
                out.append(("printable_ids", f"prism_start accepted a control character in {', '.join(bad)} (SPEC §3.1: printable)"))
        if tool and tool.get("outputSchema"):
            problems = schema_errors(tool["outputSchema"], sc)
            if problems:
                out.append(("output_schema", f"structuredContent does not conform to {case.tool}'s outputSchema: {problems}"))
        if isinstance(case.arguments, dict) and isinstance(case.arguments.get("session_id"), str):
            if not (isinstance(sc, dict) and "role" in sc and "you_were_preempted" in sc):
                out.append(("d6_fields", "a result of a call naming a session_id lacks role / you_were_preempted"))
        return out

    @staticmethod
    def tools_list(legacy: list[Any], modern: list[Any]) -> list[tuple[str, str]]:
        """Both generations list the same tools."""
        if sorted(map(str, legacy)) != sorted(map(str, modern)):
            return [("tools_list", f"{LEGACY[-1]} lists {sorted(map(str, legacy))}, {MODERN} lists {sorted(map(str, modern))}")]
        return []

    @staticmethod
    def initialize(identity: str, a: Answer) -> list[tuple[str, str]]:
        """initialize: a session id for a token the server takes, 401 without one."""
        out = []
        if a.status >= 500:
            out.append(("no_5xx", f"initialize answered {a.status}"))
        if identity == "none" and a.status != 401:
            out.append(("initialize", f"initialize without a token answered {a.status}, not 401"))
        if identity != "none" and not (a.status == 200 and a.headers.get("mcp-session-id")):
            out.append(("initialize", f"no Mcp-Session-Id after initialize (HTTP {a.status})"))
        return out

    @staticmethod
    def schemas(tools: list[Any]) -> list[tuple[str, str]]:
        out = []
        for t in tools:
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                out.append(("schemas_valid", f"a tool without a name: {t!r:.200}"))
                continue
            for key in ("inputSchema", "outputSchema"):
                schema = t.get(key)
                if schema is None and key == "outputSchema":
                    continue
                if not isinstance(schema, dict) or schema.get("type") != "object":
                    out.append(("schemas_valid", f"{t['name']}: {key} is not an object schema"))
                    continue
                try:
                    jsonschema.Draft202012Validator.check_schema(schema)
                except jsonschema.SchemaError as e:
                    out.append(("schemas_valid", f"{t['name']}: {key} is no valid JSON Schema: {e.message}"))
        return out


def schema_errors(schema: dict, value: Any) -> str:
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.path))
    return "; ".join(f"{'/'.join(map(str, e.path)) or '(top)'}: {e.message[:200]}" for e in errors[:3])


# --- argument generation ----------------------------------------------------------------
# Values from a JSON Schema, here rather than from hypothesis-jsonschema: its last release
# (0.23.1) draws through a Hypothesis internal (`many.more()`) that the Hypothesis
# schemathesis 4.32.5 brings (6.170) no longer has. The tools' schemas use a small part
# of JSON Schema, all of it covered below; whatever is drawn is then checked against the
# schema itself (jsonschema), so a keyword this misses makes a case fewer, never a wrong one.


def from_schema(schema: Any, root: dict | None = None, depth: int = 0) -> st.SearchStrategy:
    root = schema if root is None else root
    if schema is True or schema == {}:
        return ANY_JSON
    if schema is False:
        return st.nothing()
    if "$ref" in schema and schema["$ref"].startswith("#/"):
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        return from_schema(target, root, depth + 1)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema({**{k: v for k, v in schema.items() if k != key}, **s}, root, depth + 1)
                              for s in schema[key]])
    if "allOf" in schema:
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for s in schema["allOf"]:
            merged.update(s)
        return from_schema(merged, root, depth + 1)
    t = schema.get("type")
    if isinstance(t, list):
        return st.one_of([from_schema({**schema, "type": x}, root, depth + 1) for x in t])
    if t == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", max(schema.get("minLength", 0), 40))
        if "pattern" in schema:
            return st.from_regex(schema["pattern"]).filter(lambda v: lo <= len(v) <= hi)
        # Mostly printable text (what a model sends), sometimes any code point.
        return st.text(min_size=lo, max_size=min(hi, lo + 80)) | st.text(
            alphabet=st.characters(codec="utf-8", exclude_categories=["Cc", "Cs"]), min_size=lo, max_size=min(hi, lo + 40))
    if t in ("integer", "number"):
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if "exclusiveMinimum" in schema:
            lo = schema["exclusiveMinimum"] + (1 if t == "integer" else 1e-9)
        if "exclusiveMaximum" in schema:
            hi = schema["exclusiveMaximum"] - (1 if t == "integer" else 1e-9)
        if t == "integer":
            return st.integers(min_value=lo, max_value=hi)
        return st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False)
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        items = from_schema(schema.get("items", True), root, depth + 1) if depth < 6 else st.nothing()
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4))
    if t == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = [p for p in schema.get("required", []) if p in props]
        optional = [p for p in props if p not in required]
        extra = schema.get("additionalProperties", True)

        @st.composite
        def obj(draw: Callable) -> dict:
            out = {p: draw(from_schema(props[p], root, depth + 1)) for p in required}
            for p in optional:
                if draw(st.booleans()):
                    out[p] = draw(from_schema(props[p], root, depth + 1))
            if extra is not False and depth < 6 and draw(st.integers(0, 4)) == 0:
                k = draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in props))
                out[k] = draw(from_schema(extra if isinstance(extra, dict) else True, root, depth + 1))
            return out

        return obj()
    return ANY_JSON


JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
ANY_JSON = st.recursive(JSON_SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=6)
NASTY = ["\x00", "\x01", "\x07", "\x08", "\x1b", "\x7f", "\u0085", "\u2028", "\ufeff", "\ufffe", "\U0010ffff", "\n", "\t", "\u200b"]
TYPE_OF = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object", type(None): "null"}


def type_name(v: Any) -> str:
    return TYPE_OF.get(type(v), "?")


class Generator:
    """Arguments for one tool: its schema's own values, mixed with what this run knows
    exists (live sessions, projects, the namespace of the tokens), and mutations."""

    def __init__(self, namespace: str, known: dict[str, list]):
        self.namespace, self.known = namespace, known

    def valid(self, data: st.DataObject, schema: dict) -> dict:
        validator = jsonschema.Draft202012Validator(schema)
        args = data.draw(from_schema(schema).filter(validator.is_valid), label="schema")
        props = schema.get("properties", {})
        for name, pool in (("session_id", "sessions"), ("project_id", "projects"), ("term", "terms")):
            if name in props and self.known[pool] and data.draw(st.integers(0, 2), label=f"known {name}") > 0:
                # An index with fixed bounds: the pool grows during the run, and Hypothesis
                # wants the same draws to have the same constraints.
                recent = self.known[pool][-30:]
                args[name] = recent[data.draw(st.integers(0, 29), label=name) % len(recent)]
        if "namespace" in props:
            choice = data.draw(st.sampled_from(["omit", "omit", "ours", "generated"]), label="namespace")
            if choice == "omit":
                args.pop("namespace", None)
            elif choice == "ours":
                args["namespace"] = self.namespace
        return args

    def invalid(self, data: st.DataObject, schema: dict) -> tuple[str, Any]:
        args = self.valid(data, schema)
        props = schema.get("properties", {})
        required = schema.get("required", [])
        strings = [p for p, s in props.items() if s.get("type") == "string"]
        kinds = ["wrong_type", "extra_property", "not_an_object", "control_chars", "huge_string", "nul"]
        if required:
            kinds.append("missing_required")
        if any("enum" in s for s in props.values()):
            kinds.append("not_in_enum")
        if any(s.get("type") == "integer" for s in props.values()):
            kinds.append("integer_bounds")
        kind = data.draw(st.sampled_from(kinds), label="mutation")
        if kind == "wrong_type" and props:
            p = data.draw(st.sampled_from(sorted(props)), label="property")
            want = props[p].get("type")
            args[p] = data.draw(ANY_JSON.filter(lambda v: type_name(v) != want and not (want == "number" and type(v) is int)), label="value")
        elif kind == "missing_required":
            args.pop(data.draw(st.sampled_from(required), label="dropped"), None)
        elif kind == "extra_property":
            k = data.draw(st.text(min_size=1, max_size=20).filter(lambda k: k not in props), label="key")
            args[k] = data.draw(ANY_JSON, label="value")
        elif kind == "not_an_object":
            return kind, data.draw(st.one_of(st.lists(ANY_JSON, max_size=3), JSON_SCALARS), label="arguments")
        elif kind in ("control_chars", "nul") and strings:
            p = data.draw(st.sampled_from(strings), label="property")
            base = args.get(p) if isinstance(args.get(p), str) else "x"
            chars = ["\x00"] if kind == "nul" else NASTY
            c = data.draw(st.sampled_from(chars), label="char")
            at = data.draw(st.integers(0, len(base)), label="at")
            args[p] = base[:at] + c + base[at:]
        elif kind == "huge_string" and strings:
            p = data.draw(st.sampled_from(strings), label="property")
            n = data.draw(st.sampled_from([129, 257, 10_000, MAX_BODY + 1000]), label="length")
            args[p] = data.draw(st.sampled_from(["a", "é", "\U0001f600"]), label="char") * n
        elif kind == "not_in_enum":
            p = next(p for p, s in props.items() if "enum" in s)
            args[p] = data.draw(st.text(max_size=20).filter(lambda v: v not in props[p]["enum"]), label="value")
        elif kind == "integer_bounds":
            p = next(p for p, s in props.items() if s.get("type") == "integer")
            args[p] = data.draw(st.sampled_from([-1, -(2**63), 2**63 - 1, 2**63, 2**64, 10**30, 1.5, -0.0, 1e308]), label="value")
        return kind, args


# --- the run --------------------------------------------------------------------------


@dataclass
class Stats:
    cases: collections.Counter = field(default_factory=collections.Counter)  # by group
    classes: collections.Counter = field(default_factory=collections.Counter)  # 2xx/4xx/...
    outcomes: collections.Counter = field(default_factory=collections.Counter)  # result/tool error/...
    refusals_checked: int = 0
    reproduced: list[dict] = field(default_factory=list)  # candidates that wrote when replayed alone
    replays: int = 0
    resent: int = 0
    wrote: int = 0
    failures: list[dict] = field(default_factory=list)


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.verify: Any = os.environ.get("PRISM_CA_CERT") or True
        self.tokens = {
            "none": None,
            "norights": os.environ.get("NORIGHTS_TOKEN"),
            "reader": os.environ.get("READER_TOKEN"),
            "writer": os.environ["K8S_TOKEN"],
        }
        self.durable = Durable()
        self.stats = Stats()
        self.tools: dict[str, dict] = {}
        self.checks = Checks(self.tools)
        self.known: dict[str, list] = {"sessions": list(args.known_session), "projects": list(args.known_project),
                                       "terms": [0, 1]}
        self.gen = Generator(args.namespace, self.known)
        self.beats: dict[str, float] = {}  # session_id -> when an accepted writer call named it
        self.last_refused: tuple[Any, str] | None = None  # (snapshot after, what) of the last refusal
        # The last exchanges (when answered, what, the request): a write seen after a
        # refusal's answer is one of theirs (a coalesced heartbeat lands up to 250 ms late).
        self.recent: collections.deque = collections.deque(maxlen=8)
        self.replayed: set = set()  # kinds of exchange replayed alone already
        self.replay_deadline = time.monotonic() + 10**9  # set in main: replays get a budget
        self.log = open(args.log, "a") if args.log else None

    def client(self, identity: str, version: str) -> Client:
        c = Client(self.args.url, self.verify, self.tokens[identity], identity, version)
        return c

    # One exchange: snapshot, send, classify, check, snapshot again when it must not write.
    def exchange(self, c: Client, case: Case, req: Request, group: str) -> Answer:
        before = self.durable.snapshot()
        if self.last_refused is not None:
            # Nothing was in flight since the last refusal's answer: what changed since is
            # that refusal's late write (a coalesced heartbeat lands up to 250 ms after).
            after_prev, what = self.last_refused
            changes = diff(after_prev, before, self.beats)
            if changes:
                self.stats.wrote += 1
                self.late(changes, before, what)
            self.last_refused = None
        try:
            try:
                a = c.send(req)
            except requests.ConnectionError:
                # The server may close a kept-alive connection that sat idle (the replays
                # below pause a client for seconds): sent again once, on a new connection.
                self.stats.resent += 1
                a = c.send(req)
        except requests.ConnectionError as e:
            if len(req.body or b"") <= MAX_BODY:
                self.stats.cases[group] += 1
                self.fail("transport", f"{type(e).__name__}: {e}", case, req, None)
                return Answer(0, {}, b"")
            # A body over the limit: the server may answer 413 and close before reading it
            # all, and the client, still sending, may see only the close (through a TLS
            # proxy it does). A refusal all the same; its writes are checked below.
            a = Answer(0, {}, b"")
        except requests.RequestException as e:
            self.stats.cases[group] += 1
            self.fail("transport", f"{type(e).__name__}: {e}", case, req, None)
            return Answer(0, {}, b"")
        self.stats.cases[group] += 1
        self.stats.classes[f"{a.status // 100}xx" if a.status else "closed"] += 1
        refused = a.status == 0 or a.status >= 400 or a.rpc_error is not None or (a.result or {}).get("isError") is True
        outcome = (
            "closed connection" if a.status == 0
            else "tool error" if (a.result or {}).get("isError") is True
            else "JSON-RPC error" if a.rpc_error is not None
            else "HTTP error" if a.status >= 400
            else "result"
        )
        self.stats.outcomes[outcome] += 1
        for check, msg in self.checks.run(case, req, a):
            self.fail(check, msg, case, req, a)
        must_not_write = refused or case.identity != "writer"
        self.recent.append((time.monotonic(), case, req, a, must_not_write, c))
        if must_not_write:
            after = self.durable.snapshot()
            changes = diff(before, after, self.beats)
            self.stats.refusals_checked += 1
            if changes:
                self.stats.wrote += 1
                self.wrote(changes, after, "refused" if refused else f"accepted for the {case.identity} identity")
            self.last_refused = (after, f"{case.identity} {case.version} {case.kind} {case.tool or ''}".strip())
        else:
            self.learn(case, a)
        if self.log:
            self.log.write(f"{a.status} {outcome} {case.identity} {case.version} {group} {case.kind} {case.tool or ''}\n")
        return a

    def late(self, changes: list[str], after: Any, what: str) -> None:
        """A write that landed after a refusal was answered, before the next request."""
        self.wrote(changes, after, f"after the answer to a refusal ({what}), before the next request,")

    def wrote(self, changes: list[str], after: Any, why: str) -> None:
        """Reports a write where none may be. A heartbeat lands up to 250 ms after its
        call, maybe during a later one: so every exchange of the last 1.5 s that must write
        nothing is a candidate, and each (one of a kind) is replayed alone at once, while
        the state is as it was (`replay`), to tell which one wrote."""
        last = self.recent[-1] if self.recent else (0, Case("?", "?", "?"), Request("?", {}, b""), None, True, None)
        self.fail("refused_writes_nothing", f"{why} changed: " + " | ".join(changes[:8]), last[1], last[2], last[3])
        candidates = [x for x in self.recent if x[4] and time.monotonic() - x[0] < 1.5]
        self.recent.clear()
        for t, case, req, a, _, client in candidates:
            outcome = tool_error_code(a.result) if a and (a.result or {}).get("isError") else a.status if a else None
            args = sorted(case.arguments) if isinstance(case.arguments, dict) else type_name(case.arguments)
            sig = (case.identity, case.version == MODERN, case.tool, case.kind if not case.tool else "", outcome, str(args))
            if sig in self.replayed or time.monotonic() > self.replay_deadline:
                continue
            self.replayed.add(sig)
            self.replay(case, req, client)

    def replay(self, case: Case, req: Request, client: Client) -> None:
        """One candidate, sent again alone: the state quiet before it (two reads 0.4 s
        apart agree), read again 0.6 s after its answer (past the coalescing window), with
        no excuse."""
        quiet = self.durable.snapshot()
        for _ in range(10):
            time.sleep(0.4)
            now = self.durable.snapshot()
            if not diff(quiet, now):
                break
            quiet = now
        a = client.send(req)
        time.sleep(0.6)
        after = self.durable.snapshot()
        changes = diff(quiet, after)
        self.stats.replays += 1
        if changes:
            self.stats.reproduced.append({
                "identity": case.identity, "version": case.version, "kind": case.kind, "tool": case.tool,
                "request": req.show(2000), "answer": f"HTTP {a.status} {a.body[:700].decode('utf-8', 'backslashreplace')}",
                "changes": changes[:8],
            })
        self.last_refused = None

    def learn(self, case: Case, a: Answer) -> None:
        """What an accepted writer call says exists (and which heartbeats it caused)."""
        now = time.monotonic()
        for s in session_strings(case.arguments, (a.result or {}).get("structuredContent")):
            self.beats[s] = now
        sc = (a.result or {}).get("structuredContent")
        if isinstance(sc, dict) and not (a.result or {}).get("isError"):
            if isinstance(sc.get("session_id"), str) and sc["session_id"] not in self.known["sessions"]:
                self.known["sessions"].append(sc["session_id"])
            if isinstance(sc.get("project_id"), str) and sc["project_id"] not in self.known["projects"]:
                self.known["projects"].append(sc["project_id"])
            if isinstance(sc.get("term"), int) and sc["term"] not in self.known["terms"]:
                self.known["terms"].append(sc["term"])

    def fail(self, check: str, msg: str, case: Case, req: Request, a: Answer | None) -> None:
        self.stats.failures.append({
            "check": check, "message": msg, "identity": case.identity, "version": case.version,
            "kind": case.kind, "tool": case.tool, "request": req.show(),
            "answer": None if a is None else f"HTTP {a.status} {a.body[:700].decode('utf-8', 'backslashreplace')}",
        })

    # --- tools --------------------------------------------------------------------------

    def list_tools(self) -> None:
        c = self.client("writer", MODERN)
        req = c.rpc_request("tools/list", {})
        a = self.exchange(c, Case("writer", MODERN, "tools/list"), req, "tools/list")
        tools = (a.result or {}).get("tools")
        if not isinstance(tools, list) or not tools:
            raise SystemExit(f"[fuzz-api] mcp: tools/list gave no tools: HTTP {a.status} {a.body[:300]!r}")
        for check, msg in Checks.schemas(tools):
            self.fail(check, msg, Case("writer", MODERN, "tools/list"), req, a)
        for t in tools:
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("inputSchema"), dict):
                self.tools[t["name"]] = t
        # The same list in the session-based generation.
        legacy = self.client("writer", LEGACY[-1])
        legacy.open()
        req = legacy.rpc_request("tools/list", {})
        a = self.exchange(legacy, Case("writer", LEGACY[-1], "tools/list"), req, "tools/list")
        names = [t.get("name") for t in (a.result or {}).get("tools") or [] if isinstance(t, dict)]
        for check, msg in Checks.tools_list(names, list(self.tools)):
            self.fail(check, msg, Case("writer", LEGACY[-1], "tools/list"), req, a)
        declared = sum(1 for t in self.tools.values() if t.get("outputSchema"))
        log(f"tools/list: {len(self.tools)} tools ({', '.join(sorted(self.tools))}); {declared} declare an outputSchema")

    def fuzz_tool(self, c: Client, tool: str, examples: int, valid: bool) -> None:
        schema = self.tools[tool]["inputSchema"]
        validator = jsonschema.Draft202012Validator(schema)
        group = "tools/call"

        @hseed(self.args.seed + zlib.crc32(f"{tool} {c.identity} {c.version} {valid}".encode()))
        @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=False)
        @given(st.data())
        def body(data: st.DataObject) -> None:
            if valid:
                kind, arguments = "valid", self.gen.valid(data, schema)
            else:
                kind, arguments = self.gen.invalid(data, schema)
            params: dict[str, Any] = {"name": tool, "arguments": arguments}
            if not valid and kind == "not_an_object" and data.draw(st.booleans(), label="drop arguments"):
                params.pop("arguments")
                arguments = None
            ok = validator.is_valid(arguments if arguments is not None else {})
            case = Case(c.identity, c.version, kind, tool, arguments, ok)
            try:
                req = c.rpc_request("tools/call", params, tool)
            except (TypeError, ValueError):  # e.g. a lone surrogate hypothesis made
                return
            self.exchange(c, case, req, group)

        try:
            body()
        except Exception as e:  # a bug of this script, not of the server: say so
            traceback.print_exc()
            raise SystemExit(f"[fuzz-api] mcp: the generator failed on {tool}: {e}")

    # --- protocol-level cases ------------------------------------------------------------

    def protocol_cases(self, c: Client) -> list[tuple[str, Request]]:
        h = c.headers("tools/call", "prism_status")
        status_call = {"name": "prism_status", "arguments": {"project_id": "PID-FUZZ"}}
        good = c.message("tools/call", status_call)
        enc = lambda m: json.dumps(m).encode()
        cases: list[tuple[str, Request]] = []
        add = lambda kind, body, headers=None, method="POST", path="/mcp": cases.append(
            (kind, Request(method, dict(headers if headers is not None else h), body, path))
        )
        add("not_json", b"{not json")
        add("empty_body", b"")
        add("json_null", b"null")
        add("json_string", b'"tools/call"')
        add("json_number", b"42")
        add("json_array_empty", b"[]")
        add("batch", enc([good, good]))
        add("deep_nesting", b"[" * 5000 + b"]" * 5000)
        add("deep_object", b'{"a":' * 3000 + b"1" + b"}" * 3000)
        add("invalid_utf8", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"\xff\xfe"}}')
        add("lone_surrogate", b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"prism_status","arguments":{"project_id":"\\ud800"}}}')
        add("nul_in_json", enc(c.message("tools/call", {"name": "prism_status", "arguments": {"project_id": "a\x00b"}})))
        add("raw_nul_byte", b'{"jsonrpc":"2.0","id":1,\x00"method":"ping"}')
        add("trailing_garbage", enc(good) + b" xyz")
        add("duplicate_keys", b'{"jsonrpc":"2.0","id":1,"id":2,"method":"ping","method":"tools/list"}')
        add("oversize_body", enc({**good, "pad": "x" * (MAX_BODY + 10)}))
        add("oversize_body_1mb", enc({**good, "pad": "x" * (1 << 20)}))
        add("no_jsonrpc", enc({k: v for k, v in good.items() if k != "jsonrpc"}))
        add("jsonrpc_1", enc({**good, "jsonrpc": "1.0"}))
        for bad_id in [None, {"a": 1}, [1], 1.5, True, -1, 2**64, "x" * 5000, ""]:
            add(f"id_{type_name(bad_id)}", enc({**good, "id": bad_id}))
        add("no_id_request", enc({k: v for k, v in good.items() if k != "id"}))
        add("no_method", enc({k: v for k, v in good.items() if k != "method"}))
        for m in [5, None, "", "tools/nope", "resources/read", "resources/list", "prompts/list", "prompts/get",
                  "completion/complete", "logging/setLevel", "resources/subscribe", "subscriptions/listen",
                  "sampling/createMessage", "ping", "initialize", "server/discover", "notifications/initialized",
                  "notifications/cancelled", "tools/list/../call", "x" * 10_000, "tools/call\x00"]:
            hm = dict(h)
            if isinstance(m, str) and c.modern:
                hm["Mcp-Method"] = m if m.isprintable() and len(m) < 200 else "tools/call"
            add(f"method_{m!r:.20}", enc({**good, "method": m}), hm)
        for params in [None, [], "x", 5, {}, {"name": 5}, {"name": None}, {"name": "prism_nope"},
                       {"name": "x" * 10_000}, {"name": "prism_status", "arguments": "x"},
                       {"name": "prism_status", "arguments": [1]}, {"name": "prism_status", "_meta": 5},
                       {"name": "prism_status", "arguments": {"project_id": "p"}, "_meta": {"progressToken": {"x": 1}}}]:
            if isinstance(params, dict) and c.modern and "_meta" not in params:
                params = {**params, "_meta": good["params"]["_meta"]}
            add(f"params_{json.dumps(params)[:24]}", enc({**good, "params": params}))
        # Headers.
        for k, v in [("Content-Type", "text/plain"), ("Content-Type", "application/json; charset=latin1"),
                     ("Content-Type", ""), ("Accept", "text/html"), ("Accept", ""),
                     ("MCP-Protocol-Version", "1999-01-01"), ("MCP-Protocol-Version", "2025-11-25"),
                     ("MCP-Protocol-Version", "x" * 3000), ("Mcp-Method", "tools/list"), ("Mcp-Name", "prism_start"),
                     ("Mcp-Name", ""), ("X-Prism-Namespace", "Not_A_Namespace"), ("X-Prism-Namespace", "x" * 5000),
                     ("X-Prism-Namespace", "kube-system"), ("Mcp-Session-Id", "ms1.e30.AAAA"),
                     ("Mcp-Session-Id", "x" * 5000), ("Mcp-Session-Id", "")]:
            hh = dict(h)
            hh[k] = v
            add(f"header_{k}={v[:16]}", enc(good), hh)
        add("no_content_type", enc(good), {k: v for k, v in h.items() if k != "Content-Type"})
        add("no_accept", enc(good), {k: v for k, v in h.items() if k != "Accept"})
        if c.modern:
            add("no_meta", enc({**good, "params": status_call}))
            add("meta_version_mismatch", enc({**good, "params": {**status_call, "_meta": {
                **good["params"]["_meta"], "io.modelcontextprotocol/protocolVersion": "2025-06-18"}}}))
            add("meta_client_info_junk", enc({**good, "params": {**status_call, "_meta": {
                **good["params"]["_meta"], "io.modelcontextprotocol/clientInfo": {"name": "\x00" * 300}}}}))
        # Resources (SPEC §11): reads and subscriptions of good, foreign and bad URIs.
        ns = self.args.namespace
        for uri in [f"prism://{ns}/projects/PID-FUZZ", f"prism://{ns}/projects/PID%20FUZZ%2F1", "prism://kube-system/projects/p",
                    "prism://Not_A_NS/projects/p", f"prism://{ns}/projects/", f"prism://{ns}/projects/a/b",
                    f"prism://{ns}/projects/%FF", f"prism://{ns}/projects/%00", "file:///etc/passwd", "x" * 5000, ""]:
            for method in ["resources/read", "resources/subscribe", "resources/unsubscribe"]:
                add(f"{method}_{uri[:24]}", enc(c.message(method, {"uri": uri})), c.headers(method))
        for method in ["resources/list", "resources/templates/list"]:
            add(method, enc(c.message(method, {})), c.headers(method))
            add(f"{method}_bad_cursor", enc(c.message(method, {"cursor": "!!not-ours"})), c.headers(method))
        # HTTP methods and paths.
        for m in ["GET", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD"]:
            add(f"http_{m}", enc(good) if m in ("PUT", "PATCH") else None, h, m)
        add("path_slash", enc(good), h, "POST", "/mcp/")
        add("path_query", enc(good), h, "POST", "/mcp?x=%00")
        # Host and Origin (checked before the token, so for every identity).
        for k, v in [("Host", "evil.example"), ("Host", "evil.example:18080"), ("Host", "127.0.0.1.nip.io"),
                     ("Host", "localhost@evil.example"), ("Origin", "https://evil.example"), ("Origin", "null"),
                     ("Origin", "http://127.0.0.1.evil.example"), ("Origin", "file://"), ("Origin", "x" * 3000)]:
            hh = dict(h)
            hh[k] = v
            add(f"host_{k}={v[:24]}", enc(good), hh)
        return cases

    def fuzz_protocol(self, c: Client) -> None:
        for kind, req in self.protocol_cases(c):
            self.exchange(c, Case(c.identity, c.version, kind, None, None), req, "protocol")
        if not c.modern and c.session_id and c.identity != "writer":
            # The writer's session id under another identity: 404, never its facts.
            other = self.client("writer", c.version)
            other.open()
            h = c.headers("tools/call", "prism_status")
            h["Mcp-Session-Id"] = other.session_id or ""
            body = json.dumps(c.message("tools/call", {"name": "prism_status", "arguments": {"project_id": "p"}})).encode()
            self.exchange(c, Case(c.identity, c.version, "foreign_session"), Request("POST", h, body), "protocol")

    # --- the plan ----------------------------------------------------------------------

    def plan(self) -> list[tuple[str, str, int, bool]]:
        """(identity, version, examples per tool and validity, protocol cases too?). The
        identities that must write nothing at all go first, while the registration made
        with kubectl has no owner yet (the writer's prism_start on its session adopts it)."""
        n = self.args.examples
        few = max(2, n // 10)
        plan = [("none", MODERN, max(1, n // 25), True), ("none", LEGACY[-1], 1, False)]
        if self.tokens["norights"]:
            plan += [("norights", MODERN, few, True), ("norights", LEGACY[-1], few, False)]
        if self.tokens["reader"]:
            plan += [("reader", MODERN, max(2, n // 5), True), ("reader", LEGACY[-1], max(2, n // 5), True)]
        plan += [("writer", MODERN, max(2, n // 2), True), ("writer", LEGACY[-1], max(2, n // 2), True)]
        plan += [("writer", v, few, False) for v in LEGACY[:-1]]
        return plan

    def main(self) -> int:
        started = time.monotonic()
        # Replays of write candidates: at most 60 s in all (they come only with a defect).
        self.replay_deadline = started + 60
        self.list_tools()
        for identity, version, n, protocol in self.plan():
            c = self.client(identity, version)
            opened = c.open()
            if opened is not None:
                self.stats.cases["initialize"] += 1
                self.stats.classes[f"{opened.status // 100}xx"] += 1
                for check, msg in Checks.initialize(identity, opened):
                    self.fail(check, msg, Case(identity, version, "initialize"), Request("POST", {}, b"initialize"), opened)
            for tool in sorted(self.tools):
                self.fuzz_tool(c, tool, n, valid=True)
                self.fuzz_tool(c, tool, n, valid=False)
            if protocol:
                self.fuzz_protocol(c)
        # The last refusal's late writes: give the coalescer its window, then look.
        if self.last_refused is not None:
            time.sleep(1.0)
            after_prev, what = self.last_refused
            now = self.durable.snapshot()
            changes = diff(after_prev, now, self.beats)
            if changes:
                self.stats.wrote += 1
                self.late(changes, now, what)
        return self.report(time.monotonic() - started)

    def report(self, seconds: float) -> int:
        s = self.stats
        fails = collections.Counter(f["check"] for f in s.failures)
        cases = sum(s.cases.values())
        log(f"{cases} cases ({', '.join(f'{k} {v}' for k, v in sorted(s.cases.items()))}) in {seconds:.0f} s; "
            f"answers: {', '.join(f'{k} {v}' for k, v in sorted(s.classes.items()))}; "
            f"{', '.join(f'{k}s {v}' for k, v in sorted(s.outcomes.items()))}; 5xx: {s.classes.get('5xx', 0)}; "
            f"failed checks: {len(s.failures)}{' (' + ', '.join(f'{k}: {v}' for k, v in sorted(fails.items())) + ')' if fails else ''}; "
            f"refused (or read-only) calls checked for writes: {s.refusals_checked}, wrote: {s.wrote}"
            f"{f'; {s.resent} sent again after the server closed an idle connection' if s.resent else ''}")
        if s.wrote:
            log(f"writes: {s.wrote} seen; {s.replays} candidate exchanges (one of each kind) replayed alone, {len(s.reproduced)} of them wrote again")
        if self.args.failures:
            with open(self.args.failures, "w") as f:
                json.dump({"failures": s.failures, "reproduced": s.reproduced}, f, indent=1)
        shown: collections.Counter = collections.Counter()
        for f in s.failures:
            key = (f["check"], f.get("kind"), f.get("tool"))
            shown[key] += 1
            if shown[key] > 2:
                continue
            print(f"[fuzz-api] mcp: FAIL {f['check']}: {f['message']}", file=sys.stderr)
            if f.get("request"):
                print(f"    as {f['identity']} ({f['version']}), {f['kind']}: {f['request']}", file=sys.stderr)
                print(f"    answer: {f['answer']}", file=sys.stderr)

        for r in s.reproduced:
            print(f"[fuzz-api] mcp: WROTE when replayed alone, as {r['identity']} ({r['version']}), {r['kind']} {r['tool'] or ''}:\n"
                  f"    request: {r['request'][:900]}\n    answer: {r['answer'][:500]}\n    changed: {' | '.join(r['changes'])}",
                  file=sys.stderr)
        hidden = sum(max(0, n - 2) for n in shown.values())
        if hidden:
            print(f"[fuzz-api] mcp: ... and {hidden} more like those (all in {self.args.failures or 'the failures file'})", file=sys.stderr)
        return 1 if s.failures else 0


# --- self-test -----------------------------------------------------------------------------


def selftest(run: Run) -> int:
    """Every check, fed a deliberately bad case, must fail; a real granted write must be
    seen by the write check. Returns the number of checks proven."""
    tools = {"t": {"name": "t", "inputSchema": {"type": "object"},
                   "outputSchema": {"type": "object", "required": ["must"], "properties": {"must": {"type": "integer"}}}}}
    checks = Checks(tools)
    req = Request("POST", {}, b'{"jsonrpc":"2.0","id":7,"method":"tools/call"}')
    rpc = lambda result=None, error=None, id_=7, extra=None: {"jsonrpc": "2.0", "id": id_, **({"result": result} if result is not None else {}), **({"error": error} if error is not None else {}), **(extra or {})}
    j = {"content-type": "application/json"}
    ok_case = Case("writer", MODERN, "valid", "t", {"session_id": "s"}, True)
    bad = {
        "no_5xx": (ok_case, Answer(500, j, b"{}", {})),
        "challenge": (ok_case, Answer(401, j, b"{}", {"error": {"code": "x", "message": "y"}})),
        "jsonrpc_shape": (ok_case, Answer(200, j, b"{}", rpc(result={"content": []}, id_=8))),
        "output_schema": (ok_case, Answer(200, j, b"{}", rpc(result={"content": [], "structuredContent": {"must": "no", "role": None, "you_were_preempted": False}}))),
        "tool_error_shape": (ok_case, Answer(200, j, b"{}", rpc(result={"content": [{"type": "text", "text": '{"error": {"code": "x", "message": "y"}}'}], "isError": True, "structuredContent": {"error": {"code": "x", "message": "y"}}}))),
        "invalid_refused": (Case("writer", MODERN, "wrong_type", "t", {}, False), Answer(200, j, b"{}", rpc(result={"content": [], "structuredContent": {"must": 1}}))),
        "d6_fields": (ok_case, Answer(200, j, b"{}", rpc(result={"content": [], "structuredContent": {"must": 1}}))),
        "printable_ids": (Case("writer", MODERN, "control_chars", "prism_start", {"project_id": "a\x7fb"}, True),
                          Answer(200, j, b"{}", rpc(result={"content": [], "structuredContent": {}}))),
        "host_before_token": (Case("none", MODERN, "host_Host=evil"), Answer(401, {"www-authenticate": 'Bearer realm="prism"'}, b"", None)),
    }
    proven = 0
    for name, (case, answer) in bad.items():
        got = [c for c, _ in checks.run(case, req, answer)]
        if name not in got:
            log(f"self-test: the {name} check did not fail on its bad case (it reported {got})")
            return -1
        proven += 1
    bad.update({
        "foreign_session": (Case("reader", LEGACY[-1], "foreign_session"), Answer(200, j, b"{}", rpc(result={}))),
    })
    for name in ("foreign_session",):
        case, answer = bad[name]
        if name not in [c for c, _ in checks.run(case, req, answer)]:
            log(f"self-test: the {name} check did not fail on its bad case")
            return -1
        proven += 1
    for name, got in [
        ("schemas_valid", Checks.schemas([{"name": "x", "inputSchema": {"type": "object", "properties": 5}}])),
        ("tools_list", Checks.tools_list(["a", "b"], ["a"])),
        ("initialize", Checks.initialize("writer", Answer(200, j, b"{}", {}))),
        ("initialize", Checks.initialize("none", Answer(200, j, b"{}", {}))),
    ]:
        if name not in [c for c, _ in got]:
            log(f"self-test: the {name} check did not fail on its bad case")
            return -1
        proven += 1
    # A real write, through /mcp, as the writer: the write check must see it.
    c = run.client("writer", MODERN)
    project = f"PID-FUZZ-SELFTEST-{run.args.seed}"
    before = run.durable.snapshot()
    a = c.send(c.rpc_request("tools/call", {"name": "prism_start", "arguments": {"project_id": project}}, "prism_start"))
    sc = (a.result or {}).get("structuredContent") or {}
    if a.status != 200 or (a.result or {}).get("isError"):
        log(f"self-test: prism_start as the writer was not granted: HTTP {a.status} {a.body[:300]!r}")
        return -1
    changes = diff(before, run.durable.snapshot(), {})
    if not any(ch.startswith("controller_registrations") for ch in changes) or not any(ch.startswith("controllerregistrations/") for ch in changes):
        log(f"self-test: a granted prism_start changed {changes}: the write check would not see a refused one write")
        return -1
    proven += 1
    # The session's heartbeat: a write the check sees unless an accepted call named it.
    time.sleep(0.3)
    before = run.durable.snapshot()
    c.send(c.rpc_request("tools/call", {"name": "prism_heartbeat", "arguments": {"session_id": sc["session_id"]}}, "prism_heartbeat"))
    time.sleep(1.0)
    after = run.durable.snapshot()
    seen = diff(before, after, {})
    excused = diff(before, after, {sc["session_id"]: time.monotonic()})
    if not any("last_heartbeat" in ch for ch in seen) or excused:
        log(f"self-test: a heartbeat showed as {seen} (unexcused) and {excused} (excused): the heartbeat excuse is not as narrow as it must be")
        return -1
    proven += 1
    c.send(c.rpc_request("tools/call", {"name": "prism_wrap", "arguments": {"session_id": sc["session_id"]}}, "prism_wrap"))
    time.sleep(0.5)
    return proven


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True, help="the API, without /mcp")
    p.add_argument("--examples", type=int, default=50, help="generated calls per tool, identity, version and validity")
    p.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    p.add_argument("--namespace", default="agents", help="the namespace the writer and reader tokens may use")
    p.add_argument("--known-session", action="append", default=[], help="a session_id that exists (drawn often)")
    p.add_argument("--known-project", action="append", default=[], help="a project_id that exists (drawn often)")
    p.add_argument("--log", help="append one line per exchange here")
    p.add_argument("--failures", help="write every failure here (JSON)")
    args = p.parse_args()
    run = Run(args)
    proven = selftest(run)
    if proven < 0:
        return 1
    log(f"self-test: {proven} checks each failed on a deliberately bad case (a real prism_start and its heartbeat seen by the write check)")
    return run.main()


if __name__ == "__main__":
    sys.exit(main())

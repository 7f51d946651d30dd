"""The seed's smoke scenarios, driven over /mcp by the official MCP Python SDK.

tests/mcp.rs runs this with the virtualenv python of scripts/mcp-sdk, once per scenario
and protocol generation, and asserts on the JSON it prints (one object, last line of
stdout) and on Postgres and Kubernetes.

    python scenarios.py SCENARIO --mode legacy|modern --url URL[,URL2] --token T [--other-token T2]
                        [--namespace NS] [--session S] [--project P]

--mode legacy: the initialize handshake (session-based revisions, Mcp-Session-Id);
--mode modern: server/discover and the stateless 2026-07-28 revision.
Several URLs (two replicas): the client's requests go to them in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
import time
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import Implementation


class Alternating(httpx2.AsyncBaseTransport):
    """Sends each request to the next URL in turn (two replicas behind one client) and
    records who got what: (base, method, JSON-RPC method, Mcp-Session-Id)."""

    def __init__(self, bases: list[str], verify: ssl.SSLContext | bool = True) -> None:
        self.bases = [httpx2.URL(b) for b in bases]
        self.inner = httpx2.AsyncHTTPTransport(verify=verify)
        self.turn = 0
        self.log: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        base = self.bases[self.turn % len(self.bases)]
        self.turn += 1
        request.url = request.url.copy_with(host=base.host, port=base.port)
        rpc = None
        if request.method == "POST":
            try:
                rpc = json.loads(request.content or b"{}").get("method")
            except ValueError:
                rpc = None
        response = await self.inner.handle_async_request(request)
        self.log.append(
            {
                "port": base.port,
                "http": request.method,
                "rpc": rpc,
                "session": request.headers.get("mcp-session-id"),
                "status": response.status_code,
            }
        )
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@asynccontextmanager
async def connect(args: argparse.Namespace, client_name: str, token: str | None = None, **client_options: Any):
    """An MCP client of the given clientInfo.name, with the bearer token."""
    urls = args.url.split(",")
    token = args.token if token is None else token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if args.namespace_header:
        headers["X-Prism-Namespace"] = args.namespace_header
    # An https operator with a private CA: trust exactly that CA (args.ca_cert, when the
    # caller has the option), as a user's MCP client configured with it would.
    ca_cert = getattr(args, "ca_cert", "")
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_cert) if ca_cert else True
    transport = Alternating(urls, verify) if len(urls) > 1 else None
    http = httpx2.AsyncClient(headers=headers, timeout=30, transport=transport, verify=verify)
    mode = "legacy" if args.mode == "legacy" else "auto"
    async with http:
        client = Client(
            streamable_http_client(urls[0], http_client=http),
            mode=mode,
            client_info=Implementation(name=client_name, version="1.0.0"),
            **client_options,
        )
        async with client:
            client.http_log = transport.log if transport else []  # type: ignore[attr-defined]
            yield client


def answer(result: Any) -> dict[str, Any]:
    """What a tools/call answered: error flag, structured content, text, and for a tool
    error the `error` object its text carries (SPEC §9: the JSON is the text, and an
    error has no structured content)."""
    text = "".join(getattr(c, "text", "") for c in result.content)
    out = {"is_error": bool(result.is_error), "structured": result.structured_content, "text": text}
    if result.is_error:
        try:
            out["error"] = json.loads(text).get("error")
        except (ValueError, AttributeError):
            out["error"] = None
    return out


async def call(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    try:
        return answer(await client.call_tool(tool, arguments))
    except MCPError as e:
        return {"rpc_error": {"code": e.error.code, "message": e.error.message}}


async def smoke(args: argparse.Namespace) -> dict[str, Any]:
    """Scenarios 1-6 of the seed: fresh start, peer, desktop preemption (and the old
    master told so), status shape, wrap with immediate promotion, context switch, and a
    heartbeat by verb call."""
    out: dict[str, Any] = {}
    ns = {"namespace": args.namespace}
    async with connect(args, "claude-code") as code, connect(args, "codex-mcp-client") as codex, connect(
        args, "claude-ai"
    ) as desk:
        out["protocol_versions"] = [code.protocol_version, codex.protocol_version, desk.protocol_version]
        listed = (await code.list_tools()).tools
        out["tools"] = sorted(t.name for t in listed)
        # SPEC §9: annotations, and an outputSchema (the SDK checks every result against it).
        out["tool_hints"] = {
            t.name: {
                "read_only": t.annotations.read_only_hint if t.annotations else None,
                "destructive": t.annotations.destructive_hint if t.annotations else None,
                "idempotent": t.annotations.idempotent_hint if t.annotations else None,
                "output_schema": schema_type(t.output_schema),
            }
            for t in listed
        }
        # (1) Fresh start: master, a session_id minted, the surface from clientInfo.
        out["code_start"] = await call(code, "prism_start", {"project_id": args.project, **ns})
        s_code = out["code_start"]["structured"]["session_id"]
        # (2) A second non-desktop session is a peer.
        out["codex_start"] = await call(codex, "prism_start", {"project_id": args.project, **ns})
        s_codex = out["codex_start"]["structured"]["session_id"]
        # (3) A desktop preempts; the old master's next call says so.
        out["desk_start"] = await call(desk, "prism_start", {"project_id": args.project, **ns})
        s_desk = out["desk_start"]["structured"]["session_id"]
        out["code_after_preemption"] = await call(code, "prism_heartbeat", {"session_id": s_code, **ns})
        # Status shape, with the caller filled in.
        out["status"] = await call(codex, "prism_status", {"project_id": args.project, "session_id": s_codex, **ns})
        out["fence_current"] = await call(desk, "prism_fence", {"project_id": args.project, "term": 2, **ns})
        out["fence_stale"] = await call(code, "prism_fence", {"project_id": args.project, "term": 1, **ns})
        # (4) The desktop wraps: the best peer (the earliest non-desktop) is master at once.
        out["desk_wrap"] = await call(desk, "prism_wrap", {"session_id": s_desk, **ns})
        # (5) Context switch: codex starts on another project with its session.
        out["codex_switch"] = await call(
            codex, "prism_start", {"project_id": args.project + "-B", "session_id": s_codex, **ns}
        )
        # Heartbeat by verb call: the coalesced write lands after its window.
        await asyncio.sleep(1.2)
        out["code_status_beat"] = await call(code, "prism_status", {"project_id": args.project, "session_id": s_code, **ns})
        await asyncio.sleep(0.6)
        out["sessions"] = {"code": s_code, "codex": s_codex, "desk": s_desk}
    return out


async def after_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """After the stale sweep released --session: status lists it as stale, its
    heartbeat is refused."""
    ns = {"namespace": args.namespace}
    async with connect(args, "claude-code") as code:
        return {
            "status": await call(code, "prism_status", {"project_id": args.project, **ns}),
            "heartbeat": await call(code, "prism_heartbeat", {"session_id": args.session, **ns}),
        }


async def intruder(args: argparse.Namespace) -> dict[str, Any]:
    """Another identity using --session (someone else's): every verb is refused."""
    ns = {"namespace": args.namespace}
    async with connect(args, "claude-code") as other:
        return {
            "heartbeat": await call(other, "prism_heartbeat", {"session_id": args.session, **ns}),
            "wrap": await call(other, "prism_wrap", {"session_id": args.session, **ns}),
            "start": await call(other, "prism_start", {"project_id": args.project, "session_id": args.session, **ns}),
            "start_elsewhere": await call(
                other, "prism_start", {"project_id": args.project + "-elsewhere", "session_id": args.session, **ns}
            ),
            "status": await call(other, "prism_status", {"project_id": args.project, "session_id": args.session, **ns}),
        }


async def bad_input(args: argparse.Namespace) -> dict[str, Any]:
    """Bad input of every kind: each a tool error or a JSON-RPC error, with a code."""
    ns = {"namespace": args.namespace}
    async with connect(args, "claude-code") as c:
        return {
            "wrong_type": await call(c, "prism_start", {"project_id": 12345, **ns}),
            "unknown_surface": await call(c, "prism_start", {"project_id": args.project, "agent_surface": "emacs", **ns}),
            "missing_project": await call(c, "prism_start", {**ns}),
            "huge_project": await call(c, "prism_start", {"project_id": "x" * 10240, **ns}),
            "unknown_argument": await call(c, "prism_start", {"project_id": args.project, "colour": "red", **ns}),
            "bad_namespace": await call(c, "prism_start", {"project_id": args.project, "namespace": "Not_A_Namespace"}),
            "unknown_tool": await call(c, "prism_launch_missiles", {**ns}),
            "term_as_text": await call(c, "prism_fence", {"project_id": args.project, "term": "two", **ns}),
            "unknown_session": await call(c, "prism_heartbeat", {"session_id": "never-started", **ns}),
        }


async def forbidden(args: argparse.Namespace) -> dict[str, Any]:
    """A token whose identity may not act on registrations in the namespace."""
    ns = {"namespace": args.namespace}
    async with connect(args, "claude-code") as c:
        return {
            "start": await call(c, "prism_start", {"project_id": args.project, **ns}),
            "wrap": await call(c, "prism_wrap", {"session_id": args.session or "x", **ns}),
        }


async def person(args: argparse.Namespace) -> dict[str, Any]:
    """A person's token (not a ServiceAccount: no namespace of its own): without a
    namespace argument or header the call cannot be placed; with the X-Prism-Namespace
    header (--namespace-header) it can."""
    bare = argparse.Namespace(**{**vars(args), "namespace_header": ""})
    async with connect(bare, "claude-code") as c:
        unplaced = await call(c, "prism_start", {"project_id": args.project})
    async with connect(args, "claude-code") as c:
        placed = await call(c, "prism_start", {"project_id": args.project})
    return {"unplaced": unplaced, "placed": placed}


async def replicas(args: argparse.Namespace) -> dict[str, Any]:
    """One client, its requests alternating between two replicas."""
    async with connect(args, "cursor-vscode") as c:
        start = await call(c, "prism_start", {"project_id": args.project})
        session = start.get("structured", {}).get("session_id")
        calls = [await call(c, "prism_heartbeat", {"session_id": session}) for _ in range(4)]
        status = await call(c, "prism_status", {"project_id": args.project, "session_id": session})
        return {
            "protocol_version": c.protocol_version,
            "start": start,
            "heartbeats": calls,
            "status": status,
            "http_log": c.http_log,  # type: ignore[attr-defined]
        }


async def calls(args: argparse.Namespace) -> dict[str, Any]:
    """--calls: a JSON list of [tool, arguments], called in turn by one client named
    --client (what other test files need of the SDK, one call after another)."""
    plan = json.loads(args.calls)
    async with connect(args, args.client) as c:
        return {"protocol_version": c.protocol_version, "answers": [await call(c, t, a) for t, a in plan]}


async def rpc(call: Any) -> dict[str, Any]:
    """A request that answers a result, or the JSON-RPC error it got."""
    try:
        return {"result": await call}
    except MCPError as e:
        return {"rpc_error": {"code": e.error.code, "message": e.error.message, "data": e.error.data}}


async def resources(args: argparse.Namespace) -> dict[str, Any]:
    """SPEC §11 over MCP: the routing table as a resource (templates, list, read), and
    its change notified — `resources/subscribe` and the session's GET stream (legacy),
    `subscriptions/listen` (modern) — when a desktop session preempts the master. With
    two URLs the client's requests (and its GET stream) alternate between replicas.
    --outsider-token: an identity without rights in the namespace."""
    ns = args.namespace
    uri = f"prism://{ns}/projects/{quote(args.project, safe='')}"
    updates: list[tuple[str, float]] = []

    async def on_message(message: Any) -> None:
        if getattr(message, "method", None) == "notifications/resources/updated":
            updates.append((message.params.uri, time.monotonic()))

    def table(read: Any) -> dict[str, Any]:
        return json.loads(read.contents[0].text)

    out: dict[str, Any] = {}
    async with connect(args, "claude-code", message_handler=on_message) as code:
        out["start"] = await call(code, "prism_start", {"project_id": args.project, "namespace": ns})
        templates = (await code.list_resource_templates()).resource_templates
        out["templates"] = [{"uri_template": t.uri_template, "mime": t.mime_type} for t in templates]
        out["listed"] = [r.uri for r in (await code.list_resources()).resources]
        before = await code.read_resource(uri)
        out["mime"] = before.contents[0].mime_type
        out["before"] = table(before)
        out["bad_uri"] = await rpc(code.read_resource("prism://Not_A_NS/projects/x"))
        out.update(await preempt_followed(args, code, updates, uri, args.project, [uri, "file:///etc/passwd"]))
        out["after"] = table(await code.read_resource(uri))
        if args.mode == "legacy":
            out["unsubscribed"] = str(await code.unsubscribe_resource(uri))
            # A session follows at most 32 resources.
            many = [await rpc(code.subscribe_resource(f"prism://{ns}/projects/many-{i}")) for i in range(33)]
            out["many"] = ["ok" if "result" in r else r["rpc_error"]["data"]["error"]["code"] for r in many]
    # The same race again, on fresh projects and clients: the preemption is sent the
    # moment the subscribe (listen) is answered, and must still be notified.
    out["rounds"] = []
    for k in range(ROUNDS):
        project = f"{args.project}~{k}"
        project_uri = f"prism://{ns}/projects/{quote(project, safe='')}"
        got: list[tuple[str, float]] = []

        async def collect(message: Any, got: list[tuple[str, float]] = got) -> None:
            if getattr(message, "method", None) == "notifications/resources/updated":
                got.append((message.params.uri, time.monotonic()))

        async with connect(args, "claude-code", message_handler=collect) as code:
            await call(code, "prism_start", {"project_id": project, "namespace": ns})
            round_ = await preempt_followed(args, code, got, project_uri, project, [project_uri])
            out["rounds"].append({"uri": project_uri, "updates": round_["updates"], "ms": round_["latency_ms"]})
    if args.outsider_token:
        async with connect(args, "claude-code", token=args.outsider_token) as outsider:
            out["outsider_read"] = await rpc(outsider.read_resource(uri))
            out["outsider_list"] = await rpc(outsider.list_resources())
            if args.mode == "legacy":
                out["outsider_subscribe"] = await rpc(outsider.subscribe_resource(uri))
            else:
                try:
                    async with outsider.listen(resource_subscriptions=[uri]) as sub:
                        out["outsider_listen"] = {"events": [e.uri async for e in sub]}
                except Exception as e:  # noqa: BLE001 - the refusal is what is recorded
                    out["outsider_listen"] = {"refused": type(e).__name__, "message": str(e)}
    return out


ROUNDS = 5


async def preempt_followed(
    args: argparse.Namespace, code: Any, updates: list[tuple[str, float]], uri: str, project: str, follow: list[str]
) -> dict[str, Any]:
    """`code` follows `uri` (resources/subscribe, legacy; subscriptions/listen with
    `follow`, modern), and the moment it is answered a desktop session preempts the
    project. What was notified within 20 s (a bound, not a wait), and how soon; and the
    client's requests (which replica, which method), to read a failure by."""
    out: dict[str, Any] = {}
    start = {"project_id": project, "namespace": args.namespace}
    async with connect(args, "claude-ai") as desk:
        if args.mode == "legacy":
            out["subscribed"] = str(await code.subscribe_resource(uri))
            t0 = time.monotonic()
            out["desk_start"] = await call(desk, "prism_start", start)
            for _ in range(200):
                if updates:
                    break
                await asyncio.sleep(0.1)
            out["updates"] = [u for u, _ in updates]
            out["latency_ms"] = round((updates[0][1] - t0) * 1000) if updates else None
        else:
            async with code.listen(resource_subscriptions=follow) as sub:
                out["honored"] = sub.honored.resource_subscriptions
                t0 = time.monotonic()
                out["desk_start"] = await call(desk, "prism_start", start)
                try:
                    event = await asyncio.wait_for(sub.__anext__(), 20)
                    out["updates"] = [event.uri]
                    out["latency_ms"] = round((time.monotonic() - t0) * 1000)
                except TimeoutError:
                    out["updates"] = []
                    out["latency_ms"] = None
    if not out["updates"]:
        out["requests"] = code.http_log
    return out


SCENARIOS = {
    "resources": resources,
    "calls": calls,
    "smoke": smoke,
    "after_sweep": after_sweep,
    "intruder": intruder,
    "bad_input": bad_input,
    "forbidden": forbidden,
    "replicas": replicas,
    "person": person,
}


def schema_type(schema):
    """The `type` of a tool's outputSchema, whichever shape the SDK gives it."""
    if schema is None:
        return None
    if isinstance(schema, dict):
        return schema.get("type")
    return getattr(schema, "type", None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--mode", choices=["legacy", "modern"], required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", default="")
    parser.add_argument("--namespace", default="")
    parser.add_argument("--namespace-header", default="")
    parser.add_argument("--project", default="PID-MCP")
    parser.add_argument("--session", default="")
    parser.add_argument("--calls", default="[]")
    parser.add_argument("--client", default="claude-code")
    parser.add_argument("--outsider-token", default="")
    args = parser.parse_args()
    result = asyncio.run(SCENARIOS[args.scenario](args))
    sys.stdout.write(json.dumps(result, default=str) + "\n")


if __name__ == "__main__":
    main()

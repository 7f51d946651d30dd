"""What a person with an MCP client and a token sees, checked against a running operator
(the playground of `scripts/dev up`, or the chart on kind in `scripts/e2e`).

    python journey.py --url URL --token T --project P [--namespace NS]

For each protocol generation (the initialize handshake, and the stateless 2026-07-28
revision) the official SDK joins a project as Claude Code (master), as Codex (peer), as
Claude Desktop (preempts), calls again as Claude Code (told it was preempted), reads the
status, meets the tool errors a user meets (each a result with isError, no
structuredContent, and the text {"error": {"code", "message"}}, SPEC §9), wraps the
desktop (the best peer is master at once) and wraps the rest. One line per step; exit 1
at the first step that is not what the user was promised. tests/mcp/journey.mjs is the
same journey with the official TypeScript SDK.
scripts/mcp-journey sets up the token the way the MCP guide (docs/src/guides/mcp.md) tells a user to. An https URL is
checked against --ca-cert (default $PRISM_CA_CERT), as a user's client would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from typing import Any

from scenarios import call, connect


class Failed(Exception):
    pass


def expect(what: str, ok: bool, answer: Any) -> None:
    if not ok:
        raise Failed(f"{what}: {answer}")
    print(f"  ok  {what}", flush=True)


def structured(answer: dict[str, Any]) -> dict[str, Any]:
    if answer.get("is_error") is not False:
        raise Failed(f"a tool error or a JSON-RPC error where a result was due: {answer}")
    return answer["structured"]


def expect_tool_error(what: str, answer: dict[str, Any], code: str) -> None:
    """A refused call or bad argument, as SPEC §9 promises it: a tool result (no JSON-RPC
    error) with is_error, no structured content, and the text {"error": {"code", "message"}}."""
    if "rpc_error" in answer:
        raise Failed(f"{what}: a JSON-RPC error where a tool error was due: {answer}")
    if answer["is_error"] is not True:
        raise Failed(f"{what}: is_error is not true: {answer}")
    if answer["structured"] is not None:
        raise Failed(f"{what}: structured content on a tool error: {answer}")
    try:
        error = json.loads(answer["text"])["error"]
    except (ValueError, KeyError, TypeError) as e:
        raise Failed(f"{what}: the text is not {{\"error\": ...}} JSON ({e!r}): {answer}") from e
    expect(what, isinstance(error, dict) and error.get("code") == code and bool(error.get("message")), answer)


async def journey(args: argparse.Namespace, mode: str) -> None:
    args.mode = mode
    project = f"{args.project}-{mode}"
    # Without --namespace the call's namespace is the ServiceAccount's own (SPEC §9).
    ns = {"namespace": args.namespace} if args.namespace else {}
    async with connect(args, "claude-code") as code, connect(args, "codex-mcp-client") as codex, connect(
        args, "claude-ai"
    ) as desk:
        print(f"{mode}: protocol {code.protocol_version}, project {project}", flush=True)
        tools = sorted(t.name for t in (await code.list_tools()).tools)
        expect(
            "seven prism tools listed",
            tools == ["prism_enqueue", "prism_fence", "prism_heartbeat", "prism_job", "prism_start", "prism_status", "prism_wrap"],
            tools,
        )

        s = structured(await call(code, "prism_start", {"project_id": project, **ns}))
        expect(f"Claude Code joins: Master in namespace {s['namespace']}, session_id minted", s["role"] == "Master" and bool(s["session_id"]), s)
        s_code = s["session_id"]
        s = structured(await call(codex, "prism_start", {"project_id": project, **ns}))
        expect("Codex joins: Peer", s["role"] == "Peer" and s["registration"]["agent_surface"] == "codex", s)
        s_codex = s["session_id"]
        s = structured(await call(desk, "prism_start", {"project_id": project, **ns}))
        expect("Claude Desktop joins: preempts, Master in a new term", s["role"] == "Master" and s["term"] == 2, s)
        s_desk, desk_name = s["session_id"], s["registration"]["name"]

        told = await call(code, "prism_heartbeat", {"session_id": s_code, **ns})
        s = structured(told)
        expect(
            "Claude Code's next call: you_were_preempted, and the text says who",
            s["you_were_preempted"] is True and s["role"] == "Peer" and told["text"].startswith(f"You were preempted: {desk_name}"),
            told,
        )
        s = structured(await call(codex, "prism_status", {"project_id": project, "session_id": s_codex, **ns}))
        expect(
            "status: master is the desktop, two peers, the caller filled in",
            s["master"]["session_id"] == s_desk and len(s["peers"]) == 2 and s["caller"]["session_id"] == s_codex,
            s,
        )

        # Tool errors as a user meets them (SPEC §9): results, not exceptions.
        expect_tool_error(
            "a fence with the past term 1: tool error stale_term, no structured content",
            await call(code, "prism_fence", {"project_id": project, "term": 1, **ns}),
            "stale_term",
        )
        expect_tool_error(
            "prism_start with a number for project_id: tool error invalid_request, no structured content",
            await call(codex, "prism_start", {"project_id": 42, **ns}),
            "invalid_request",
        )
        expect_tool_error(
            "prism_wrap of a session never registered: tool error not_registered, no structured content",
            await call(desk, "prism_wrap", {"session_id": f"never-registered-{uuid.uuid4()}", **ns}),
            "not_registered",
        )

        s = structured(await call(desk, "prism_wrap", {"session_id": s_desk, **ns}))
        expect(
            "the desktop wraps: the best peer (Claude Code) is master at once",
            s["routing"]["master"]["session_id"] == s_code and s["routing"]["term"] == 3,
            s,
        )
        for session, client in ((s_code, code), (s_codex, codex)):
            structured(await call(client, "prism_wrap", {"session_id": session, **ns}))
        s = structured(await call(code, "prism_status", {"project_id": project, **ns}))
        expect("everyone wrapped: no master, no peers", s["master"] is None and not s["peers"], s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--namespace", default="", help="default: the token's ServiceAccount namespace")
    parser.add_argument("--project", required=True)
    parser.add_argument("--modes", default="legacy,modern")
    parser.add_argument(
        "--ca-cert",
        default=os.environ.get("PRISM_CA_CERT", ""),
        help="CA certificate (PEM) of an https URL (default: $PRISM_CA_CERT; else the system's trust, or SSL_CERT_FILE)",
    )
    args = parser.parse_args()
    args.namespace_header = ""
    try:
        for mode in args.modes.split(","):
            asyncio.run(journey(args, mode))
    except BaseException as e:
        # A step that fails inside the clients' `async with` reaches here wrapped in the
        # SDK's (anyio's) exception groups.
        failed = first_failed(e)
        if failed is None:
            raise
        print(f"FAIL {failed}", file=sys.stderr)
        sys.exit(1)


def first_failed(e: BaseException) -> Failed | None:
    if isinstance(e, Failed):
        return e
    for inner in getattr(e, "exceptions", ()):
        found = first_failed(inner)
        if found is not None:
            return found
    return None


if __name__ == "__main__":
    main()

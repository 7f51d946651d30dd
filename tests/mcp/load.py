"""MCP agents as load for the fault harness (tests/soak.rs): each agent is an official MCP
SDK client that starts sessions, heartbeats them, switches projects and wraps, over and
over, until the time is up, while the harness injects faults.

    python load.py --url URL --token T --namespace NS --agents N --seconds S --seed SEED
                   [--projects P] [--project-prefix PFX]

Agent i speaks the session-based generation (initialize, Mcp-Session-Id) when i is even
and the stateless 2026-07-28 one when i is odd. A call cut by a fault (the replica
killed, a reset connection) or refused as unavailable is expected: the agent opens a new
connection and carries on with the same session. Anything else is "unexpected": a tool
error whose code is not one of a dependency being unavailable, or a session the API
lost although its last call had been acknowledged.

Prints one JSON object (last line of stdout): calls per tool and outcome, the
(session_id, project_id) pairs whose start was acknowledged, the unexpected answers.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import time
from typing import Any

from scenarios import call, connect

# Codes a call may get while a dependency is being faulted (SPEC §6 503s).
UNAVAILABLE = {"database_unavailable", "contended", "kubernetes_unavailable"}
# Codes that say the session is not (or no longer) there: expected only when an earlier
# call of that session may or may not have been applied (cut, or refused as unavailable).
GONE = {"not_registered", "not_found"}
SURFACES = ["claude-code", "codex-mcp-client", "cursor-vscode", "claude-ai"]


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.deadline = time.monotonic() + args.seconds
        self.calls: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.acknowledged: list[list[str]] = []
        self.unexpected: list[dict[str, Any]] = []

    def left(self) -> bool:
        return time.monotonic() < self.deadline

    async def agent(self, i: int) -> None:
        rng = random.Random(self.args.seed * 7919 + i)
        args = argparse.Namespace(**vars(self.args))
        args.mode = "legacy" if i % 2 == 0 else "modern"
        args.namespace_header = ""
        client_name = SURFACES[rng.randrange(len(SURFACES))]
        ns = {"namespace": args.namespace}
        generation = 0
        session: str | None = None
        # True while the last call of `session` may or may not have been applied.
        uncertain = False
        while self.left():
            try:
                async with connect(args, client_name) as c:
                    while self.left():
                        if session is None:
                            project = f"{args.project_prefix}-{rng.randrange(args.projects)}"
                            outcome, answer = await self.call(c, "prism_start", {"project_id": project, **ns})
                            if outcome == "ok":
                                session = answer["structured"]["session_id"]
                                self.acknowledged.append([session, project])
                                uncertain = False
                            continue
                        step = rng.random()
                        if step < 0.6:
                            tool, arguments = "prism_heartbeat", {"session_id": session, **ns}
                        elif step < 0.75:
                            project = f"{args.project_prefix}-{rng.randrange(args.projects)}"
                            tool, arguments = "prism_start", {"project_id": project, "session_id": session, **ns}
                        elif step < 0.85:
                            tool, arguments = "prism_status", {"project_id": project, "session_id": session, **ns}
                        else:
                            tool, arguments = "prism_wrap", {"session_id": session, **ns}
                        outcome, answer = await self.call(c, tool, arguments)
                        if outcome == "ok":
                            # A status answers whether or not the session is live: only a
                            # start or a heartbeat says it is.
                            if tool != "prism_status":
                                uncertain = False
                            if tool == "prism_start":
                                self.acknowledged.append([session, project])
                            if tool == "prism_wrap":
                                generation += 1
                                session = None
                        elif outcome in GONE:
                            if not uncertain and tool != "prism_status":
                                self.unexpected.append({"tool": tool, "session": session, "answer": answer})
                            session, uncertain = None, False
                        elif outcome in UNAVAILABLE:
                            uncertain = True
                        else:
                            self.unexpected.append({"tool": tool, "session": session, "answer": answer})
                            session, uncertain = None, False
                        await asyncio.sleep(rng.uniform(0.2, 1.0))
            except Exception as e:  # a cut connection, a killed replica: reconnect
                self.calls["(transport)"][type(e).__name__] += 1
                uncertain = session is not None
                await asyncio.sleep(0.5)

    async def call(self, c: Any, tool: str, arguments: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        answer = await call(c, tool, arguments)
        if "rpc_error" in answer:
            outcome = f"rpc_error {answer['rpc_error']['code']}"
        elif answer["is_error"]:
            outcome = (answer.get("error") or {}).get("code", "tool_error")
        else:
            outcome = "ok"
        self.calls[tool][outcome] += 1
        return outcome, answer


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--agents", type=int, default=20)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--projects", type=int, default=10)
    p.add_argument("--project-prefix", default="PID-SOAK-MCP")
    args = p.parse_args()
    load = Load(args)
    await asyncio.gather(*(load.agent(i) for i in range(args.agents)))
    print(
        json.dumps(
            {
                "agents": args.agents,
                "calls": {tool: dict(c) for tool, c in sorted(load.calls.items())},
                "acknowledged": load.acknowledged,
                "unexpected": load.unexpected[:20],
                "unexpected_count": len(load.unexpected),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(main())

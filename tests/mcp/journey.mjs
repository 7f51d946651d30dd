// What a person with an MCP client and a token sees, checked against a running operator
// with the official TypeScript MCP SDK (@modelcontextprotocol/sdk): the journey of
// tests/mcp/journey.py, in the session-based protocol generation (initialize,
// Mcp-Session-Id) that this SDK speaks.
//
//   node journey.mjs --url URL --token T --project P [--namespace NS] [--ca-cert PEM]
//
// The SDK is loaded from the install dir of scripts/mcp-sdk-ts, given in
// $PRISM_MCP_SDK_TS_DIR (else from wherever Node.js resolves it). scripts/mcp-journey runs
// this after the Python journey. Claude Code joins a project (master), Codex joins (peer),
// Claude Desktop preempts, Claude Code's next call is told so, Codex reads the status, the
// tool errors a user meets are what SPEC §9 promises (isError, no structuredContent, the
// text is {"error": {"code", "message"}}, and the SDK does not throw), the desktop wraps
// (Claude Code is master at once) and the rest wrap. One line per step; exit 1 at the first
// step that is not what the user was promised.
//
// An https URL with a private CA: --ca-cert (default $PRISM_CA_CERT) is handed to Node.js
// as NODE_EXTRA_CA_CERTS (read only at start: when it is not already set so, this script
// runs itself again with it).

import { spawnSync } from "node:child_process";
import { randomUUID } from "node:crypto";
import { createRequire } from "node:module";
import { join } from "node:path";
import { parseArgs } from "node:util";

const { values: args } = parseArgs({
  options: {
    url: { type: "string" },
    token: { type: "string" },
    project: { type: "string" },
    namespace: { type: "string", default: "" },
    "ca-cert": { type: "string", default: process.env.PRISM_CA_CERT ?? "" },
  },
});
for (const required of ["url", "token", "project"]) {
  if (!args[required]) {
    console.error(`usage: node journey.mjs --url URL --token T --project P [--namespace NS] [--ca-cert PEM] (--${required} is missing)`);
    process.exit(2);
  }
}

const caCert = args["ca-cert"];
if (caCert && process.env.NODE_EXTRA_CA_CERTS !== caCert) {
  const again = spawnSync(process.execPath, process.argv.slice(1), {
    stdio: "inherit",
    env: { ...process.env, NODE_EXTRA_CA_CERTS: caCert },
  });
  process.exit(again.status ?? 1);
}

// The SDK: from scripts/mcp-sdk-ts's install dir (resolved through the package's exports
// map from there), else from wherever Node.js finds it.
const sdkDir = process.env.PRISM_MCP_SDK_TS_DIR;
let Client, StreamableHTTPClientTransport, sdkVersion = "?";
if (sdkDir) {
  const require = createRequire(join(sdkDir, "package.json"));
  ({ Client } = require("@modelcontextprotocol/sdk/client/index.js"));
  ({ StreamableHTTPClientTransport } = require("@modelcontextprotocol/sdk/client/streamableHttp.js"));
  sdkVersion = require(join(sdkDir, "node_modules/@modelcontextprotocol/sdk/package.json")).version;
} else {
  ({ Client } = await import("@modelcontextprotocol/sdk/client/index.js"));
  ({ StreamableHTTPClientTransport } = await import("@modelcontextprotocol/sdk/client/streamableHttp.js"));
}

class Failed extends Error {}

function show(what) {
  // fetch's errors say why (TLS, refused, …) in their cause.
  if (what instanceof Error) return `${what.constructor.name}: ${what.message}${what.cause ? ` (${show(what.cause)})` : ""}`;
  return JSON.stringify(what);
}

function expect(what, ok, answer) {
  if (!ok) throw new Failed(`${what}: ${show(answer)}`);
  console.log(`  ok  ${what}`);
}

/** An MCP client of the given clientInfo.name, with the bearer token, that has listed the
 * tools (as every MCP client does; the SDK then checks results against outputSchema). */
async function connect(name) {
  const client = new Client({ name, version: "1.0.0" });
  const transport = new StreamableHTTPClientTransport(new URL(args.url), {
    requestInit: { headers: { Authorization: `Bearer ${args.token}` } },
  });
  await client.connect(transport);
  const tools = (await client.listTools()).tools;
  return { client, transport, tools };
}

/** tools/call as a user's client makes it: the result, or what the SDK threw. */
async function call(who, name, toolArgs) {
  try {
    return { result: await who.client.callTool({ name, arguments: toolArgs }) };
  } catch (e) {
    return { thrown: e };
  }
}

function text(result) {
  return (result.content ?? []).filter((c) => c.type === "text").map((c) => c.text).join("");
}

function structured(what, answer) {
  if (answer.thrown) throw new Failed(`${what}: the SDK threw where a result was due: ${show(answer.thrown)}`);
  if (answer.result.isError) throw new Failed(`${what}: a tool error where a result was due: ${show(answer.result)}`);
  return answer.result.structuredContent;
}

/** A refused call or bad argument, as SPEC §9 promises it: a tool result (the SDK does not
 * throw) with isError, no structuredContent, and the text {"error": {"code", "message"}}. */
function expectToolError(what, answer, code) {
  if (answer.thrown) throw new Failed(`${what}: the SDK threw: ${show(answer.thrown)}`);
  const r = answer.result;
  if (r.isError !== true) throw new Failed(`${what}: isError is not true: ${show(r)}`);
  if (r.structuredContent !== undefined) throw new Failed(`${what}: structuredContent on a tool error: ${show(r)}`);
  let body;
  try {
    body = JSON.parse(text(r));
  } catch (e) {
    throw new Failed(`${what}: the text is not JSON (${e.message}): ${show(r)}`);
  }
  expect(what, body?.error?.code === code && typeof body.error.message === "string" && body.error.message !== "", r);
}

async function journey() {
  const project = args.project;
  // Without --namespace the call's namespace is the ServiceAccount's own (SPEC §9).
  const ns = args.namespace ? { namespace: args.namespace } : {};
  const code = await connect("claude-code");
  const codex = await connect("codex-mcp-client");
  const desk = await connect("claude-ai");
  try {
    console.log(`session-based, TypeScript SDK ${sdkVersion}: protocol ${code.transport.protocolVersion}, project ${project}`);
    const tools = code.tools.map((t) => t.name).sort();
    expect(
      "seven prism tools listed",
      JSON.stringify(tools) ===
        JSON.stringify(["prism_enqueue", "prism_fence", "prism_heartbeat", "prism_job", "prism_start", "prism_status", "prism_wrap"]),
      tools,
    );

    let s = structured("Claude Code joins", await call(code, "prism_start", { project_id: project, ...ns }));
    expect(`Claude Code joins: Master in namespace ${s.namespace}, session_id minted`, s.role === "Master" && !!s.session_id, s);
    const sCode = s.session_id;
    s = structured("Codex joins", await call(codex, "prism_start", { project_id: project, ...ns }));
    expect("Codex joins: Peer", s.role === "Peer" && s.registration.agent_surface === "codex", s);
    const sCodex = s.session_id;
    s = structured("Claude Desktop joins", await call(desk, "prism_start", { project_id: project, ...ns }));
    expect("Claude Desktop joins: preempts, Master in a new term", s.role === "Master" && s.term === 2, s);
    const sDesk = s.session_id;
    const deskName = s.registration.name;

    const told = await call(code, "prism_heartbeat", { session_id: sCode, ...ns });
    s = structured("Claude Code's next call", told);
    expect(
      "Claude Code's next call: you_were_preempted, and the text says who",
      s.you_were_preempted === true && s.role === "Peer" && text(told.result).startsWith(`You were preempted: ${deskName}`),
      told.result,
    );
    s = structured("status", await call(codex, "prism_status", { project_id: project, session_id: sCodex, ...ns }));
    expect(
      "status: master is the desktop, two peers, the caller filled in",
      s.master?.session_id === sDesk && s.peers.length === 2 && s.caller?.session_id === sCodex,
      s,
    );

    // Tool errors as a user meets them (SPEC §9): results, not exceptions.
    expectToolError(
      "a fence with the past term 1: tool error stale_term, no structuredContent",
      await call(code, "prism_fence", { project_id: project, term: 1, ...ns }),
      "stale_term",
    );
    expectToolError(
      "prism_start with a number for project_id: tool error invalid_request, no structuredContent",
      await call(codex, "prism_start", { project_id: 42, ...ns }),
      "invalid_request",
    );
    expectToolError(
      "prism_wrap of a session never registered: tool error not_registered, no structuredContent",
      await call(desk, "prism_wrap", { session_id: `never-registered-${randomUUID()}`, ...ns }),
      "not_registered",
    );

    s = structured("the desktop wraps", await call(desk, "prism_wrap", { session_id: sDesk, ...ns }));
    expect(
      "the desktop wraps: the best peer (Claude Code) is master at once",
      s.routing.master?.session_id === sCode && s.routing.term === 3,
      s,
    );
    for (const [session, who] of [[sCode, code], [sCodex, codex]]) {
      structured("wrap the rest", await call(who, "prism_wrap", { session_id: session, ...ns }));
    }
    s = structured("everyone wrapped", await call(code, "prism_status", { project_id: project, ...ns }));
    expect("everyone wrapped: no master, no peers", s.master === null && s.peers.length === 0, s);
  } finally {
    await Promise.allSettled([code.client.close(), codex.client.close(), desk.client.close()]);
  }
}

try {
  await journey();
} catch (e) {
  console.error(e instanceof Failed ? `FAIL ${e.message}` : `FAIL against ${args.url}: ${show(e)}`);
  process.exit(1);
}

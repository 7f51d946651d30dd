// Preloaded (`node --require`) into the official MCP conformance runner, which has no
// option to send a credential: every request it makes gets
// `Authorization: Bearer $PRISM_TOKEN`, as an MCP client configured with the header
// would send it (`claude mcp add --header ...`). Nothing else of a request is touched:
// the runner's own Host and Origin headers (its DNS-rebinding scenario) go as they are.
"use strict";
const token = process.env.PRISM_TOKEN;
if (!token) throw new Error("conformance-token.cjs: PRISM_TOKEN is not set");
const bearer = `Bearer ${token}`;

const fetch = globalThis.fetch;
globalThis.fetch = (input, init = {}) => {
  const headers = new Headers(init.headers ?? (input instanceof Request ? input.headers : undefined));
  if (!headers.has("authorization")) headers.set("authorization", bearer);
  return fetch(input, { ...init, headers });
};

// Its raw requests (the DNS-rebinding scenario sends chosen Host headers) use undici.
// Resolved from the runner, whose dependency it is.
const undici = require("module").createRequire(process.argv[1])("undici");
const request = undici.request;
undici.request = (url, options = {}) => {
  const headers = { ...(options.headers ?? {}) };
  if (!Object.keys(headers).some((k) => k.toLowerCase() === "authorization")) headers.authorization = bearer;
  return request(url, { ...options, headers });
};

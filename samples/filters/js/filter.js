// API-key check in JavaScript, the sample policy every language implements.
//
// The key in the configured header must be one of the configured keys; the client's
// name goes into `client_header` (replacing any forged value) and the key is removed
// before the request goes upstream; otherwise 401. Denials are counted.
//
// Build: `dpumesh filter build samples/filters/js` (ComponentizeJS); test:
// `dpumesh filter test samples/filters/js/build/js.wasm samples/filters/apikey.suite.yaml`.

import { counter, increment } from "dpumesh:filter/metrics@0.1.3";

// One instance serves one request at a time; its state lives in the module.
let header = "x-api-key";
let clientHeader = "x-api-client";
let clients = new Map();
let denied = 0;

function unauthorized(why) {
  return {
    tag: "deny",
    val: {
      status: 401,
      headers: [
        ["www-authenticate", "ApiKey"],
        ["content-type", "text/plain"],
      ],
      body: `${why}\n`,
    },
  };
}

// `result<_, string>`: returning is `ok`, throwing a string is `err`.
export function configure(config) {
  let parsed;
  try {
    parsed = config.trim() === "" ? {} : JSON.parse(config);
  } catch (e) {
    throw `configuration is not JSON: ${e.message}`;
  }
  if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
    throw "configuration must be a JSON object";
  }
  const unknown = Object.keys(parsed).filter(
    (k) => !["header", "client_header", "keys"].includes(k),
  );
  if (unknown.length > 0) {
    throw `unknown field(s): ${unknown.sort().join(", ")}`;
  }
  const keys = parsed.keys;
  if (keys === null || typeof keys !== "object" || Object.keys(keys).length === 0) {
    throw "keys must name at least one client";
  }
  const byKey = new Map();
  for (const [client, key] of Object.entries(keys)) {
    if (typeof key !== "string" || key === "") {
      throw `the key of ${client} is empty`;
    }
    if (byKey.has(key)) {
      throw `${client} and ${byKey.get(key)} share a key`;
    }
    byKey.set(key, client);
  }
  header = parsed.header ?? "x-api-key";
  clientHeader = parsed.client_header ?? "x-api-client";
  clients = byKey;
  denied = counter("apikey_denied_total", []);
}

export function onRequest(_line, head) {
  const key = head.header(header) ?? "";
  if (key === "") {
    increment(denied, 1n);
    return unauthorized("missing API key");
  }
  const client = clients.get(key);
  if (client === undefined) {
    increment(denied, 1n);
    return unauthorized("unknown API key");
  }
  head.setHeader(clientHeader, client);
  head.removeHeader(header);
  return { tag: "continue" };
}

export function onResponse(_head, _info) {}

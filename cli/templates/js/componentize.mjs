// Usage: node componentize.mjs TOOLS_DIR SOURCE WIT_DIR OUT
import { writeFile } from "node:fs/promises";
import { pathToFileURL } from "node:url";
import path from "node:path";

const [tools, sourcePath, witPath, out] = process.argv.slice(2);
const entry = path.join(tools, "node_modules/@bytecodealliance/componentize-js/src/componentize.js");
const { componentize } = await import(pathToFileURL(entry).href);
// Filters get no network: the proxy offers no wasi:http.
const { component } = await componentize({
  sourcePath,
  witPath,
  worldName: "filter",
  disableFeatures: ["http", "fetch-event"],
});
await writeFile(out, component);

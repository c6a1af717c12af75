// Bundles the widget front end into the Python package (vpipe_lab/jupyter/static/partition.js) and writes the
// editor's message contract (src/messages.ts) as the JSON schema Python validates against.
import { writeFileSync } from "node:fs";
import { build } from "esbuild";

await build({
  entryPoints: ["src/index.ts"],
  bundle: true,
  format: "esm",
  target: "es2020",
  outfile: "../vpipe_lab/jupyter/static/partition.js",
  legalComments: "none",
  banner: { js: "// Built from extension/src by esbuild (npm run build); do not edit by hand." },
});

const contract = await build({ entryPoints: ["src/messages.ts"], bundle: true, format: "esm", write: false });
const { EDITOR_MESSAGES } = await import(
  `data:text/javascript;base64,${Buffer.from(contract.outputFiles[0].text).toString("base64")}`);
writeFileSync("../vpipe_lab/jupyter/static/editor_messages.schema.json",
  JSON.stringify(EDITOR_MESSAGES, null, 2) + "\n");

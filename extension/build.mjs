// Bundles the widget front ends into the Python package (vpipe_lab/jupyter/static/): the partition editor
// (partition.js), the live dashboard (live.js) and the plotly.js it draws with (plotly.js.gz: an ES module, gzipped,
// which Python ships to the browser as bytes); and writes the editor's message contract (src/messages.ts) as the JSON
// schema Python validates against, and the widgets' traits (src/traits.ts) as the schema Python's tests check. Every output is a pure function of the sources, so CI can rebuild and compare.
import { writeFileSync } from "node:fs";
import { gzipSync } from "node:zlib";
import { build } from "esbuild";

const STATIC = "../vpipe_lab/jupyter/static";
const banner = { js: "// Built from extension/src by esbuild (npm run build); do not edit by hand." };
const common = { bundle: true, format: "esm", target: "es2020", legalComments: "none", banner };

await build({ ...common, entryPoints: ["src/index.ts"], outfile: `${STATIC}/partition.js` });
await build({ ...common, entryPoints: ["src/live/index.ts"], outfile: `${STATIC}/live.js` });

// plotly.js is bundled on its own and gzipped (1.2 MB -> about 0.4 MB on the wire); level 9 and Node's fixed gzip
// header (no file name, mtime 0) keep the bytes the same on every build.
const plotly = await build({ ...common, entryPoints: ["src/live/plotly.ts"], write: false, minify: true });
writeFileSync(`${STATIC}/plotly.js.gz`, gzipSync(Buffer.from(plotly.outputFiles[0].contents), { level: 9 }));

const contract = await build({ entryPoints: ["src/messages.ts"], bundle: true, format: "esm", write: false });
const { EDITOR_MESSAGES } = await import(
  `data:text/javascript;base64,${Buffer.from(contract.outputFiles[0].text).toString("base64")}`);
writeFileSync(`${STATIC}/editor_messages.schema.json`, JSON.stringify(EDITOR_MESSAGES, null, 2) + "\n");

// The widgets' traits (src/traits.ts), which Python's tests hold the widgets to.
const traits = await build({ entryPoints: ["src/traits.ts"], bundle: true, format: "esm", write: false });
const { WIDGET_TRAITS } = await import(
  `data:text/javascript;base64,${Buffer.from(traits.outputFiles[0].text).toString("base64")}`);
writeFileSync(`${STATIC}/widget_traits.schema.json`, JSON.stringify(WIDGET_TRAITS, null, 2) + "\n");

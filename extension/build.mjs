// Bundles the widget front end into the Python package (vpipe_lab/jupyter/static/partition.js).
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

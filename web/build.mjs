// Builds the playground into dist/ (ignored by git): the page, its stylesheet, its
// JavaScript bundled by esbuild (no CDN at run time: app.js, and draft-worker.js, the worker
// that runs the draft model on ONNX Runtime Web, started only to draft with the model) and
// ONNX Runtime Web's WebAssembly files, which the worker loads from beside itself.
// `spececd api` serves dist/ at / (the page asks its OpenAI API), `spececd serve` at / on its
// WebSocket port (the page drafts); any static host can serve it too.
import { build } from "esbuild";
import { copyFileSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "dist");
rmSync(out, { recursive: true, force: true });
mkdirSync(out);
await build({
  // The page, and the worker the draft model runs in (with ONNX Runtime Web), which the page
  // starts only when it drafts with the model.
  entryPoints: { app: join(here, "src", "main.js"),
    "draft-worker": join(here, "src", "draft-worker.js") },
  bundle: true,
  format: "esm",
  splitting: true,
  chunkNames: "chunk-[hash]",
  minify: true,
  sourcemap: false,
  target: "es2022",
  outdir: out,
  logLevel: "warning",
});
copyFileSync(join(here, "index.html"), join(out, "index.html"));
copyFileSync(join(here, "style.css"), join(out, "style.css"));
// The runtime's WebAssembly, the build with WebGPU (JSEP) that the default bundle loads.
const ort = join(here, "node_modules", "onnxruntime-web", "dist");
for (const name of readdirSync(ort)) {
  if (/^ort-wasm-simd-threaded\.jsep\.(wasm|mjs)$/.test(name)) {
    copyFileSync(join(ort, name), join(out, name));
  }
}
console.log(`built ${out}`);

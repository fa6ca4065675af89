// Builds the browser edge into dist/ (ignored by git): the page (with the playground's
// predicted-output box), its stylesheet (the playground's, and this page's own rules), its
// JavaScript bundled by esbuild (no CDN at run time: app.js, and draft-worker.js, the worker
// that runs the draft model on ONNX Runtime Web, started only to draft with the model) and
// ONNX Runtime Web's WebAssembly files, which the worker loads from beside itself.
// `spececd serve` serves dist/ at / on its WebSocket port; any static host can serve it too.
import { build } from "esbuild";
import { copyFileSync, mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
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
const playground = readFileSync(
  join(here, "..", "src", "spececd", "openai_api", "playground.html"), "utf8");
// One predicted-output box for both pages: the playground's, where the page marks it.
const box = playground.match(/ *<details id="prediction-box">[\s\S]*?<\/details>\n/);
const page = readFileSync(join(here, "index.html"), "utf8");
const mark = / *<!-- prediction-box:[^>]*-->\n/;
if (!box || !mark.test(page)) throw new Error("no predicted-output box in the playground's page or no place for it in index.html");
writeFileSync(join(out, "index.html"), page.replace(mark, box[0]));
// One look for both pages: the playground's stylesheet, then this page's own rules.
const shared = playground.slice(playground.indexOf("<style>") + 7, playground.indexOf("</style>"));
if (!shared.trim()) throw new Error("no <style> in the playground's page");
writeFileSync(join(out, "style.css"), shared + readFileSync(join(here, "style.css"), "utf8"));
// The runtime's WebAssembly, the build with WebGPU (JSEP) that the default bundle loads.
const ort = join(here, "node_modules", "onnxruntime-web", "dist");
for (const name of readdirSync(ort)) {
  if (/^ort-wasm-simd-threaded\.jsep\.(wasm|mjs)$/.test(name)) {
    copyFileSync(join(ort, name), join(out, name));
  }
}
console.log(`built ${out}`);

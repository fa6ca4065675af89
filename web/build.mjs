// Builds the browser edge into dist/ (ignored by git): the page, its stylesheet, one bundle
// of its JavaScript (esbuild, no CDN at run time) and ONNX Runtime Web's WebAssembly files,
// which the bundle loads from beside itself. `spececd serve` serves dist/ at / on its
// WebSocket port; any static host can serve it too.
import { build } from "esbuild";
import { copyFileSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "dist");
rmSync(out, { recursive: true, force: true });
mkdirSync(out);
await build({
  entryPoints: [join(here, "src", "main.js")],
  bundle: true,
  format: "esm",
  minify: true,
  sourcemap: false,
  target: "es2022",
  outfile: join(out, "app.js"),
  logLevel: "warning",
});
for (const name of ["index.html", "style.css"]) copyFileSync(join(here, name), join(out, name));
// The runtime's WebAssembly, the build with WebGPU (JSEP) that the default bundle loads.
const ort = join(here, "node_modules", "onnxruntime-web", "dist");
for (const name of readdirSync(ort)) {
  if (/^ort-wasm-simd-threaded\.jsep\.(wasm|mjs)$/.test(name)) {
    copyFileSync(join(ort, name), join(out, name));
  }
}
console.log(`built ${out}`);

// The draft model, in the page's draft worker (draft-worker.js): an ONNX Runtime GenAI folder
// (its genai_config.json names the inputs and outputs) on ONNX Runtime Web, WebGPU where the
// browser has it, else WebAssembly, on several threads where the page is cross-origin
// isolated.
// As src/spececd/edge/drafter.py drafts: one KV cache kept across rounds and cut lazily to
// the longest prefix it shares with the (authoritative) history, so a rejected block costs
// nothing extra; the last drafted token is never fed, the next call feeds it if the verifier
// kept it. In exact sampling mode it samples from the processed distribution cut to its
// `maxSupport` most likely tokens and reports exactly that; in match mode from the whole
// processed distribution; at temperature 0 it takes the argmax and reports nothing.

import * as ort from "onnxruntime-web";
import { sharedPrefix } from "./lookup.js";
import { argmax, positionRng, processLogits, sample, sparse } from "./sampling.js";

const DRAFTER_STREAM = 1; // the draws' stream, apart from any other the page may add
// The most tokens a warm feeds in one forward: a prompt's prefill stops within one such
// forward once nobody needs it (the run ended; the verdict left the history behind).
const WARM_CHUNK = 32;
// ONNX Runtime Web's WebAssembly, the build with WebGPU (JSEP) that web/build.mjs copies
// beside the page.
const WASM = "ort-wasm-simd-threaded.jsep.wasm";

/** Whether a WebGPU adapter is a software one (SwiftShader, or one the browser calls a
 * fallback): correct, and far slower than WebAssembly. */
export function softwareAdapter(adapter) {
  const info = adapter.info || {};
  return Boolean(adapter.isFallbackAdapter || info.isFallbackAdapter
    || /swiftshader/i.test(`${info.architecture} ${info.vendor} ${info.description}`));
}

/** The runtime the page drafts on: "webgpu" where asked and the browser has an adapter, or
 * for "auto" where it has a hardware one; else "wasm". */
export async function pickRuntime(asked) {
  if (asked === "wasm") return "wasm";
  const gpu = typeof navigator !== "undefined" ? navigator.gpu : undefined;
  let adapter = null;
  try {
    adapter = gpu ? await gpu.requestAdapter() : null;
  } catch { /* no adapter */ }
  if (asked === "webgpu") {
    if (!adapter) throw new Error("this browser has no WebGPU adapter: draft on wasm");
    return "webgpu";
  }
  return adapter && !softwareAdapter(adapter) ? "webgpu" : "wasm";
}

// The draft's files and the runtime's WebAssembly (43 MB in all for the default draft) are
// kept in Cache Storage across the page's loads, which the browser's HTTP cache does not do
// for files this large; each is revalidated by its ETag (a 304 reads the kept copy). A page
// of another origin than the server's, or one without Cache Storage (a plain-HTTP host
// name is no secure context), fetches them anew.
const CACHE = "spececd-drafts";

/** `url`'s bytes, and whether they came from Cache Storage; null for a 404 where
 * `optional`. */
async function fetchKept(url, optional = false) {
  const sameOrigin = new URL(url).origin === self.location.origin;
  const cache = sameOrigin && typeof caches !== "undefined"
    ? await caches.open(CACHE).catch(() => null) : null;
  const held = cache ? await cache.match(url) : undefined;
  const tag = held ? held.headers.get("ETag") : null;
  const reply = await fetch(url, tag ? { headers: { "If-None-Match": tag }, cache: "no-store" }
    : { cache: "no-store" });
  if (reply.status === 304 && held) return { bytes: new Uint8Array(await held.arrayBuffer()), kept: true };
  if (optional && reply.status === 404) return null;
  if (!reply.ok) throw new Error(`GET ${url}: HTTP ${reply.status}`);
  if (cache && reply.headers.get("ETag")) await cache.put(url, reply.clone()).catch(() => {});
  return { bytes: new Uint8Array(await reply.arrayBuffer()), kept: false };
}

export class ModelDrafter {
  /** Load the draft folder at `base` (its genai_config.json, model file and external data)
   * on `runtime` ("wasm" or "webgpu") with `threads` WebAssembly threads (undefined: ONNX
   * Runtime Web's own choice, half the cores and at most 4; one only where the page is not
   * cross-origin isolated). */
  static async load(base, runtime, wasmPaths, threads) {
    const kept = []; // the files read from Cache Storage
    const get = async (url, optional) => {
      const got = await fetchKept(url, optional);
      if (got && got.kept) kept.push(url.split("/").pop());
      return got && got.bytes;
    };
    if (wasmPaths) {
      ort.env.wasm.wasmPaths = wasmPaths;
      ort.env.wasm.wasmBinary = await get(new URL(WASM, wasmPaths).href);
    }
    ort.env.wasm.numThreads = threads;
    // Errors only: the runtime logs its warnings (nodes kept on the CPU under WebGPU, say)
    // as console errors.
    ort.env.logLevel = "error";
    const config = JSON.parse(new TextDecoder().decode(await get(`${base}/genai_config.json`)));
    const decoder = config.model.decoder;
    const file = decoder.filename;
    const model = await get(`${base}/${file}`);
    // The weights beside the graph, where the export put them there (a 404: none).
    const data = await get(`${base}/${file}.data`, true);
    const externalData = data ? [{ path: `${file}.data`, data }] : [];
    const session = await ort.InferenceSession.create(model, {
      executionProviders: [runtime], externalData, graphOptimizationLevel: "all",
      logSeverityLevel: 3 });
    // The threads it runs on: ONNX Runtime falls back to one where the page is not
    // cross-origin isolated.
    const drafter = new ModelDrafter(session, config, runtime, ort.env.wasm.numThreads);
    drafter.kept = kept;
    return drafter;
  }

  constructor(session, config, runtime, threads) {
    const decoder = config.model.decoder;
    this.session = session;
    this.runtime = runtime;
    this.threads = threads;
    this.vocabSize = config.model.vocab_size;
    this.layers = decoder.num_hidden_layers;
    this.kvHeads = decoder.num_key_value_heads;
    this.headSize = decoder.head_size;
    this.names = { ...decoder.inputs, ...decoder.outputs };
    this.tokens = []; // what the KV cache holds
    this.past = null; // {name: Tensor} of the cache, [1, heads, tokens, head]
  }

  /** Cut the cache to its first `n` tokens. */
  truncate(n) {
    if (n >= this.tokens.length) return;
    this.tokens.length = n;
    if (n === 0) {
      this.past = null;
      return;
    }
    const cut = {};
    for (const [name, tensor] of Object.entries(this.past)) {
      const [, heads, length, head] = tensor.dims;
      const data = tensor.data;
      const out = new Float32Array(heads * n * head);
      for (let h = 0; h < heads; h++) {
        out.set(data.subarray(h * length * head, (h * length + n) * head), h * n * head);
      }
      cut[name] = new ort.Tensor("float32", out, [1, heads, n, head]);
    }
    this.past = cut;
  }

  /** Run `ids` after the cache; the logits of the last position [vocab]. */
  async extend(ids) {
    const pastLen = this.tokens.length;
    const total = pastLen + ids.length;
    const feeds = {
      [this.names.input_ids]: new ort.Tensor("int64", BigInt64Array.from(ids, BigInt), [1, ids.length]),
      [this.names.attention_mask]: new ort.Tensor("int64", new BigInt64Array(total).fill(1n), [1, total]),
    };
    for (let l = 0; l < this.layers; l++) {
      for (const kind of ["key", "value"]) {
        const present = this.names[`present_${kind}_names`].replace("%d", l);
        feeds[this.names[`past_${kind}_names`].replace("%d", l)] = this.past ? this.past[present]
          : new ort.Tensor("float32", new Float32Array(0), [1, this.kvHeads, 0, this.headSize]);
      }
    }
    const out = await this.session.run(feeds);
    const past = {};
    for (let l = 0; l < this.layers; l++) {
      for (const kind of ["key", "value"]) {
        const name = this.names[`present_${kind}_names`].replace("%d", l);
        past[name] = out[name];
      }
    }
    this.past = past;
    this.tokens.push(...ids);
    const logits = out[this.names.logits];
    const vocab = logits.dims[2];
    const last = logits.data.subarray((ids.length - 1) * vocab, ids.length * vocab);
    return last.subarray(0, this.vocabSize);
  }

  /** Bring the cache up to `history` (what it shares with it kept), so that the next draft
   * after it feeds only what came since: run while a verdict travels on rounds that draft
   * without the model (a lookup, a prediction, a round while the model catches up), whose
   * tokens it would otherwise feed all at once at its next draft. Fed WARM_CHUNK tokens at
   * a time, each only where `await stop()` says not to stop; answers how many tokens the
   * cache holds. */
  async warm(history, stop = async () => false) {
    const kept = this.shared(history);
    if (kept === history.length) return this.tokens.length; // it holds it (and maybe more)
    this.truncate(kept);
    for (let at = kept; at < history.length; at += WARM_CHUNK) {
      if (await stop()) break;
      await this.extend(history.slice(at, at + WARM_CHUNK));
    }
    return this.tokens.length;
  }

  /** How many of `history`'s first tokens the cache holds. */
  shared(history) {
    return sharedPrefix(this.tokens, history);
  }

  /** Up to `k` tokens drafted after `history` and, in exact sampling mode, the distribution
   * each was drawn from (see the module's comment); fewer where `await stop(tokens)` says
   * so between steps (given the tokens drafted so far). */
  async draft(history, k, { mode, params, maxSupport }, stop = async () => false) {
    // At least one token to feed: the logits of the history's last position.
    const kept = Math.min(this.shared(history), history.length - 1);
    this.truncate(kept);
    let feed = history.slice(kept);
    const report = mode === "exact" && params.temperature > 0;
    const tokens = [], dists = [];
    for (let i = 0; i < k; i++) {
      if (i > 0 && (await stop(tokens))) break;
      const logits = await this.extend(feed);
      let token;
      if (params.temperature === 0) {
        token = argmax(logits);
      } else {
        const probs = processLogits(logits, params);
        const rng = positionRng(params.seed, DRAFTER_STREAM * 1_000_003 + history.length + i);
        if (report) {
          const dist = sparse(probs, maxSupport);
          token = dist.ids[sample(dist.probs, rng)];
          dists.push(dist);
        } else {
          token = sample(probs, rng);
        }
      }
      tokens.push(token);
      feed = [token];
    }
    return { tokens, dists: report ? dists : null, lookedUp: 0 };
  }
}

// The browser edge: this page drafts (lookup, the draft model in a worker, both, or a
// predicted output first) and verifies against `spececd serve` over its WebSocket, in
// SpecECD's own protocol. run(options) gives the text, the token ids and the statistics of
// one generation; the page (main.js) and tests (`window.spececd`) call it.

import { generate } from "./edge.js";
import { Link } from "./link.js";
import { HybridSource, LookupSource, ModelSource, PredictedSource } from "./sources.js";
import { TargetTokenizer } from "./tokenizer.js";
import { Alignment } from "./lookup.js";

const MAX_SUPPORT = 64; // exact mode: the draft distribution is cut to this many tokens

const SERVED = location.protocol === "http:" || location.protocol === "https:";
const LOCAL = "ws://127.0.0.1:8765"; // `spececd serve`'s default address

/**
 * What served this page: "edge" (`spececd serve`, on its WebSocket port), "api" (`spececd
 * api`), or "" (a static host, a file opened from disk): the header SpecECD's servers send
 * with the page's files says.
 */
export const servedBy = SERVED
  ? fetch(location.href).then((reply) => reply.headers.get("x-spececd-serves") || "", () => "")
  : Promise.resolve("");

/**
 * The server's WebSocket address: this page's own origin where `spececd serve` (or a static
 * host) served it, else the usual local port. ?server=... only where no SpecECD server
 * served the page (a static host, a file opened from disk), so that a crafted link to a
 * served page (`spececd serve`'s or `spececd api`'s) cannot send the token typed into it, or
 * the prompts, to another host.
 */
export async function defaultServer() {
  const serves = await servedBy;
  const asked = new URLSearchParams(location.search).get("server");
  if (asked && !serves) return asked;
  if (asked) console.warn(`?server=${asked} ignored: a SpecECD server served this page`);
  return SERVED && serves !== "api"
    ? `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}` : LOCAL;
}

/** The plain-HTTP address of a ws:// or wss:// server (its tokenizer and draft are there). */
function httpBase(server) {
  const url = new URL(server);
  if (url.protocol !== "ws:" && url.protocol !== "wss:") {
    throw new Error(`the server's address must start with ws:// or wss://, got ${server}`);
  }
  return `${url.protocol === "wss:" ? "https" : "http"}://${url.host}`;
}

// What the page has loaded for a server: its tokenizer, its draft model (where it offers
// one), and the link, each once.
export const loaded = { server: null, tokenizer: null, drafter: null, draftWanted: null, link: null };

export async function connect(server) {
  if (loaded.server !== server) {
    if (loaded.link) loaded.link.close();
    if (loaded.drafter) loaded.drafter.close();
    Object.assign(loaded, { server, tokenizer: null, drafter: null, draftWanted: null,
      link: new Link(server) });
  }
  if (!loaded.tokenizer) loaded.tokenizer = await TargetTokenizer.fetch(httpBase(server));
  return loaded;
}

async function drafter(server, runtimeAsked, threadsAsked) {
  // ONNX Runtime Web (most of the page's script) is loaded only by the draft worker of a
  // page that drafts with the model: lookup and cloud-only runs never fetch it.
  const { WorkerDrafter } = await import("./drafter.js");
  const wanted = `${runtimeAsked}/${threadsAsked || "auto"}`;
  if (!loaded.drafter || loaded.draftWanted !== wanted) {
    const base = `${httpBase(server)}/draft`;
    const probe = await fetch(`${base}/genai_config.json`);
    if (!probe.ok) {
      throw new Error("this server offers no draft model to browsers: start it with " +
        "`spececd serve --web-draft models/draft`, or draft by lookup");
    }
    if (loaded.drafter) loaded.drafter.close();
    loaded.drafter = null;
    // The runtime's own files (WebAssembly) come from where this page came from.
    loaded.drafter = await WorkerDrafter.load(base, runtimeAsked,
      new URL(".", import.meta.url).href, threadsAsked);
    loaded.draftWanted = wanted;
  }
  return loaded.drafter;
}

/**
 * One generation. `options`: {server, token, prompt, maxTokens, temperature, topK, topP,
 * seed, mode ("exact"|"match"), source ("lookup"|"model"|"hybrid"|"cloud"), k, runtime,
 * threads (the draft's WebAssembly threads; default: ONNX Runtime Web's choice), ahead
 * (false: plain rounds; default: blocks drafted ahead, edge.js),
 * prediction (optional: the text the output is expected to be, mostly, drafted first;
 * `predictionIds`: its ids), signal (an AbortSignal: Stop; the run then throws an
 * AbortError, and its link is dropped)}, `onPiece` as edge.generate's. Returns {text, promptIds,
 * tokens, stats, runtime, threads, prediction}: `prediction` (null without one) counts the
 * prediction's tokens that appeared in the output (`accepted`, aligned as a diff would,
 * as the OpenAI API's accepted_prediction_tokens) and the others (`rejected`).
 */
export async function run(options, onPiece = () => {}) {
  const server = options.server || (await defaultServer());
  const { tokenizer, link } = await connect(server);
  let source = null, runtime = "none (lookup)", threads = 0;
  if (options.source === "lookup") {
    source = new LookupSource();
  } else if (options.source === "model" || options.source === "hybrid") {
    const model = await drafter(server, options.runtime || "auto", options.threads);
    source = options.source === "model" ? new ModelSource(model) : new HybridSource(model);
    runtime = model.runtime;
    threads = model.threads;
  } else if (options.source !== "cloud") {
    throw new Error(`unknown draft source ${options.source}`);
  }
  // A text prompt is healed as the Python edge heals it (its last token dropped, the first
  // generated token masked to those that spell it); ids (`promptIds`) run as given.
  const healing = options.promptIds ? null : tokenizer.heal(tokenizer.encode(options.prompt));
  // A prediction of the output is text inside a sequence (no special tokens), after what
  // healing dropped, which the output's first token spells again. Cloud-only runs draft
  // nothing, so they use none.
  const predictionIds = options.predictionIds || (options.prediction
    ? tokenizer.encode((healing ? healing.dropped : "") + options.prediction, false) : []);
  if (source !== null && predictionIds.length) source = new PredictedSource(predictionIds, source);
  const promptIds = options.promptIds || (healing ? healing.promptIds
    : tokenizer.encode(options.prompt));
  const temperature = options.temperature ?? 0;
  const reconnects = link.reconnects;
  // Stopped while the tokenizer or the draft loaded: no session is opened.
  if (options.signal) options.signal.throwIfAborted();
  let result;
  try {
    result = await generate(link, promptIds, {
      fingerprint: tokenizer.fingerprint, authToken: options.token || "",
      params: { maxTokens: options.maxTokens ?? 96, temperature, topK: options.topK ?? 0,
        topP: options.topP ?? 1, seed: options.seed ?? 0, stopIds: tokenizer.eosIds },
      mode: options.mode || "exact", k: options.k ?? "auto", maxSupport: MAX_SUPPORT, source,
      ahead: options.ahead ?? true,
      healIds: healing ? healing.allowed : null, signal: options.signal,
    }, onPiece);
  } catch (exc) {
    // A run that failed may leave frames of its own on the socket (the rest of a stream, a
    // verdict not read): the next run starts on a new one.
    link.drop();
    throw exc;
  }
  const text = tokenizer.decode(result.tokens);
  const dropped = healing ? healing.dropped : "";
  let prediction = null;
  if (predictionIds.length) {
    const alignment = new Alignment(predictionIds);
    alignment.sync(result.tokens);
    const hits = Math.min(alignment.hits, predictionIds.length);
    prediction = { accepted: hits, rejected: predictionIds.length - hits };
  }
  return { text: text.startsWith(dropped) ? text.slice(dropped.length) : text, promptIds,
    healIds: healing ? healing.allowed : [], tokens: result.tokens, stats: result.stats,
    reconnects: link.reconnects - reconnects, runtime: source ? runtime : "cloud", threads,
    prediction };
}

/**
 * Shows a run's pieces as they come in `panel`: each token a span of its source's colour;
 * `dropped`: the text healing dropped from the prompt, which the first token's text starts
 * with and which is not shown again.
 */
export function renderer(panel, dropped) {
  const ids = [];
  let shown = dropped;
  return ({ tokens, fromDraft, lookedUp, predicted }) => {
    tokens.forEach((token, i) => {
      ids.push(token);
      const text = loaded.tokenizer.decode(ids);
      panel.token(panel.output, i >= fromDraft ? "target" : i < predicted ? "prediction"
        : i < lookedUp ? "lookup" : "draft", text.startsWith(shown) ? text.slice(shown.length) : "");
      shown = text;
    });
  };
}

/** The text healing drops from a prompt ("" when it is not healed). */
export async function droppedText(options) {
  const { tokenizer } = await connect(options.server || (await defaultServer()));
  return tokenizer.heal(tokenizer.encode(options.prompt))?.dropped ?? "";
}

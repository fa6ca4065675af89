// The page: reads the form, runs the browser edge (and, to compare, the target alone)
// against the server, and shows each token coloured by where it came from. `window.spececd`
// is the same machinery for scripts and tests: run(options) gives the text, the token ids
// and the statistics of one generation.

import { DraftLength, generate } from "./edge.js";
import { Link } from "./link.js";
import { HybridSource, LookupSource, ModelSource, PredictedSource } from "./sources.js";
import { TargetTokenizer } from "./tokenizer.js";
import { Alignment, NgramLookup } from "./lookup.js";
import { EdgeSession, ProtocolError, decodeFrame } from "./protocol.js";

const $ = (id) => document.getElementById(id);
const MAX_SUPPORT = 64; // exact mode: the draft distribution is cut to this many tokens

const SERVED = location.protocol === "http:" || location.protocol === "https:";

// Whether a SpecECD server served this page: its own origin answers the tokenizer's
// fingerprint (a static host does not).
const servedByServer = SERVED
  ? fetch("/v1/tokenizer/fingerprint").then((reply) => reply.ok, () => false)
  : Promise.resolve(false);

/**
 * The server's WebSocket address: the server that served this page; ?server=... only where
 * no SpecECD server served it (a static host, a file opened from disk), so that a crafted
 * link to a served page cannot send the token typed into it to another host.
 */
async function defaultServer() {
  const own = SERVED ? `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}` : null;
  const asked = new URLSearchParams(location.search).get("server");
  if (asked && own && (await servedByServer)) {
    console.warn(`?server=${asked} ignored: this page talks to the server that served it`);
    return own;
  }
  return asked || own || "ws://127.0.0.1:8765";
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
const loaded = { server: null, tokenizer: null, drafter: null, draftWanted: null, link: null };

async function connect(server) {
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
 * `predictionIds`: its ids)}, `onPiece` as edge.generate's. Returns {text, promptIds,
 * tokens, stats, runtime, threads, prediction}: `prediction` (null without one) counts the
 * prediction's tokens that appeared in the output (`accepted`, aligned as a diff would,
 * as the OpenAI API's accepted_prediction_tokens) and the others (`rejected`).
 */
async function run(options, onPiece = () => {}) {
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
  let result;
  try {
    result = await generate(link, promptIds, {
      fingerprint: tokenizer.fingerprint, authToken: options.token || "",
      params: { maxTokens: options.maxTokens ?? 96, temperature, topK: options.topK ?? 0,
        topP: options.topP ?? 1, seed: options.seed ?? 0, stopIds: tokenizer.eosIds },
      mode: options.mode || "exact", k: options.k ?? "auto", maxSupport: MAX_SUPPORT, source,
      ahead: options.ahead ?? true,
      healIds: healing ? healing.allowed : null,
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

/** Shows pieces as they come: each token a span of its source's colour; `dropped`: the
 * text healing dropped from the prompt, which the first token's text starts with and which
 * is not shown again. */
function renderer(element, dropped) {
  element.textContent = "";
  const ids = [];
  let shown = dropped;
  return ({ tokens, fromDraft, lookedUp, predicted }) => {
    tokens.forEach((token, i) => {
      ids.push(token);
      const text = loaded.tokenizer.decode(ids);
      const span = document.createElement("span");
      span.className = `tok ${i >= fromDraft ? "target" : i < predicted ? "prediction"
        : i < lookedUp ? "lookup" : "draft"}`;
      span.textContent = text.startsWith(shown) ? text.slice(shown.length) : "";
      shown = text;
      element.appendChild(span);
    });
  };
}

/** The text healing drops from the form's prompt ("" when it is not healed). */
async function droppedText(options) {
  const { tokenizer } = await connect(options.server || (await defaultServer()));
  return tokenizer.heal(tokenizer.encode(options.prompt))?.dropped ?? "";
}

/** The form's k: "auto" or a whole number of at least 1 (anything else says so). */
function draftLength(text) {
  const value = text.trim().toLowerCase();
  if (value === "auto") return "auto";
  if (!/^[0-9]+$/.test(value) || Number(value) < 1) {
    throw new Error(`k must be auto or a whole number of at least 1, got "${text}"`);
  }
  return Number(value);
}

function form() {
  return {
    server: $("server").value.trim(), token: $("token").value,
    prompt: $("prompt").value, maxTokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value), seed: Number($("seed").value),
    k: draftLength($("k").value), runtime: $("runtime-choice").value,
    source: document.querySelector("input[name=source]:checked").value,
    prediction: $("prediction").value,
  };
}

const fixed = (x, digits) => (Number.isFinite(x) ? x.toFixed(digits) : "–");

async function onGenerate(event) {
  event.preventDefault();
  document.body.dataset.state = "running";
  $("error").hidden = true;
  $("generate").disabled = true;
  try {
    const options = form();
    const dropped = await droppedText(options);
    const spec = await run(options, renderer($("out-spec"), dropped));
    const s = spec.stats;
    $("stat-tps").textContent = fixed(s.tokensPerSecond, 1);
    $("stat-acceptance").textContent = fixed(100 * s.acceptance, 1);
    $("stat-mal").textContent = fixed(s.meanAcceptedLength, 2);
    $("stat-tokens").textContent = String(s.generated);
    $("runtime").textContent = spec.runtime === "wasm" && spec.threads > 1
      ? `wasm, ${spec.threads} threads` : spec.runtime;
    $("details").textContent = `${s.rounds} rounds, ${s.drafted} drafted, ${s.accepted} ` +
      `accepted (${s.lookedUpAccepted} looked-up drafts accepted); drafting ` +
      `${fixed(1000 * s.draftSeconds / Math.max(1, s.rounds), 2)} ms a round, server ` +
      `${fixed(1000 * s.verifySeconds / Math.max(1, s.rounds), 2)} ms a pass` +
      (spec.reconnects ? `; ${spec.reconnects} reconnects` : "");
    $("stat-prediction").hidden = !spec.prediction;
    if (spec.prediction) {
      $("stat-predicted").textContent = String(spec.prediction.accepted);
      $("stat-unpredicted").textContent = String(spec.prediction.rejected);
      $("details").textContent += `; prediction: ${spec.prediction.accepted} tokens in the ` +
        `reply, ${spec.prediction.rejected} not (${s.predictedAccepted} drafted from it and ` +
        "accepted)";
    }
    $("panel-cloud").hidden = !$("compare").checked;
    if ($("compare").checked) {
      const cloud = await run({ ...options, source: "cloud" }, renderer($("out-cloud"), dropped));
      $("stat-tps-cloud").textContent = fixed(cloud.stats.tokensPerSecond, 1);
      $("stat-tokens-cloud").textContent = String(cloud.stats.generated);
      $("speedup").textContent = fixed(s.tokensPerSecond / cloud.stats.tokensPerSecond, 2);
    }
    document.body.dataset.state = "done";
  } catch (exc) {
    $("error").textContent = exc.code ? `${exc.code}: ${exc.message}` : String(exc.message || exc);
    $("error").hidden = false;
    document.body.dataset.state = "error";
  } finally {
    $("generate").disabled = false;
  }
}

defaultServer().then((server) => { if (!$("server").value) $("server").value = server; });
$("form").addEventListener("submit", onGenerate);
$("compare").addEventListener("change", () => { $("panel-cloud").hidden = !$("compare").checked; });
$("server-info").textContent = "";
window.spececd = { run, connect, loaded, defaultServer, NgramLookup, Alignment, DraftLength,
  decodeFrame, LookupSource, PredictedSource, EdgeSession, Link, ProtocolError };

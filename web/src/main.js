// The playground: reads the form and runs it one of two ways, shown the same way (view.js):
//   api   the server's OpenAI API (`spececd api`, api.js): completions or a chat, streamed;
//   edge  the browser edge (`spececd serve`, browser-edge.js): this page drafts.
// The page starts in the mode of the server that served it; a static host's page is an
// edge. `window.spececd` is the browser edge's machinery for scripts and tests: run(options)
// gives the text, the token ids and the statistics of one generation.

import { DraftLength } from "./edge.js";
import { Link } from "./link.js";
import { LookupSource, PredictedSource } from "./sources.js";
import { Alignment, NgramLookup } from "./lookup.js";
import { EdgeSession, ProtocolError, decodeFrame } from "./protocol.js";
import { $, Panel, element, fixed } from "./view.js";
import * as api from "./api.js";
import { connect, defaultServer, droppedText, loaded, renderer, run, servedBy }
  from "./browser-edge.js";

const KEY_STORE = "spececd.apiKey";
const state = { model: null, messages: [], controller: null };

const spec = new Panel({ output: "out-spec", details: "details", tps: "stat-tps",
  acceptance: "stat-acceptance", mal: "stat-mal", tokens: "stat-tokens",
  prediction: "stat-prediction", predicted: "stat-predicted", unpredicted: "stat-unpredicted" });
const cloud = new Panel({ output: "out-cloud", details: "details-cloud", tps: "stat-tps-cloud",
  tokens: "stat-tokens-cloud" });

const checked = (name) => document.querySelector(`input[name=${name}]:checked`).value;
const chatMode = () => checked("mode") === "chat";

/** The form's k: "auto" or a whole number of at least 1. */
function draftLength(text) {
  const value = text.trim().toLowerCase();
  if (value === "auto") return "auto";
  if (!/^[0-9]+$/.test(value) || Number(value) < 1) {
    throw new Error(`k must be auto or a whole number of at least 1, got "${text}"`);
  }
  return Number(value);
}

/** The fields both modes read; an empty max tokens, seed or k is undefined (the API: the
 * server's choice; the browser edge: 96 tokens, a random seed, k auto). */
function fields() {
  const seed = $("seed").value.trim();
  const maxTokens = $("max-tokens").value.trim();
  return {
    prompt: $("prompt").value, maxTokens: maxTokens === "" ? undefined : Number(maxTokens),
    temperature: Number($("temperature").value), seed: seed === "" ? undefined : Number(seed),
    k: $("k").value.trim() === "" ? undefined : draftLength($("k").value),
    prediction: $("prediction").value,
  };
}

function setError(message) {
  $("error").textContent = message || "";
  $("error").hidden = !message;
}

// data-state on <body>: idle, running, then done, stopped or error.
function setState(name) {
  const running = name === "running";
  document.body.dataset.state = name;
  $("generate").disabled = running;
  $("stop").disabled = !running;
  $("clear").disabled = running;
  // A run keeps its mode to its end, or to Stop.
  for (const radio of document.querySelectorAll("input[name=where], input[name=mode]")) {
    radio.disabled = running;
  }
}

async function loadModel() {
  state.model = await api.modelName($("api-key").value.trim());
  $("model").textContent = state.model;
}

// The conversation so far; earlier replies lose their colours (only their text is kept).
function conversation(output) {
  output.replaceChildren(...state.messages.map(
    (m) => element("div", `turn ${m.role}`, m.content)));
}

/** One request of the API, streamed into `panel` (into `into`: the output or a turn). */
function streamed(path, body, panel, into, signal, predicted) {
  return api.stream(path, body, { apiKey: $("api-key").value.trim(), signal },
    (piece, info) => {
      if (piece) {
        panel.token(into, info ? info.source : "target", piece,
          info ? `${info.source}: ${info.token_ids.join(" ")}` : "");
      }
      if (info) {
        panel.show({ tokens: info.generated, acceptance: info.acceptance_rate,
          mal: info.mean_acceptance_length,
          ...(info.elapsed_s > 0 ? { tps: info.generated / info.elapsed_s } : {}) });
      }
    },
    (usage, speculative, finish) => {
      const shown = api.summary(usage, speculative, finish, predicted);
      panel.show(shown);
      panel.tps = shown.tps;
    });
}

async function generateApi(form, compare, signal) {
  const chat = chatMode();
  if (!state.model) await loadModel();
  const body = api.requestBody({ ...form, model: state.model, schema: $("json-schema").value });
  const predicted = Boolean(body.prediction);
  let path, into, cloudInto;
  if (chat) {
    path = "/v1/chat/completions";
    state.messages.push({ role: "user", content: form.prompt });
    body.messages = state.messages.slice();
    $("prompt").value = "";
    conversation(spec.output);
    into = spec.output.appendChild(element("div", "turn assistant"));
    cloudInto = cloud.output.appendChild(element("div", "turn assistant"));
  } else {
    path = "/v1/completions";
    body.prompt = form.prompt;
    // The playground heals a prompt cut inside a token (the API's default is off).
    body.token_healing = true;
    spec.output.append(element("span", "prompt", form.prompt));
    cloud.output.append(element("span", "prompt", form.prompt));
    into = spec.output;
    cloudInto = cloud.output;
  }
  try {
    const text = await streamed(path, body, spec, into, signal, predicted);
    if (chat) state.messages.push({ role: "assistant", content: text });
  } catch (exc) {
    if (chat && state.messages.at(-1)?.role === "user") {
      $("prompt").value = state.messages.pop().content;  // unanswered: give it back
    }
    throw exc;
  }
  if (compare) {
    await streamed(path, { ...body, cloud_only: true }, cloud, cloudInto, signal, predicted);
  }
}

async function generateEdge(form, compare, signal) {
  const options = { ...form, server: $("server").value.trim(), token: $("token").value,
    runtime: $("runtime-choice").value, source: checked("source"),
    seed: form.seed ?? Math.floor(Math.random() * 2 ** 31), signal };
  const dropped = await droppedText(options);
  const result = await run(options, renderer(spec, dropped));
  const s = result.stats;
  spec.tps = s.tokensPerSecond;
  $("runtime").textContent = result.runtime === "wasm" && result.threads > 1
    ? `wasm, ${result.threads} threads` : result.runtime;
  let details = `${s.rounds} rounds, ${s.drafted} drafted, ${s.accepted} accepted ` +
    `(${s.lookedUpAccepted} looked-up drafts accepted); drafting ` +
    `${fixed(1000 * s.draftSeconds / Math.max(1, s.rounds), 2)} ms a round, server ` +
    `${fixed(1000 * s.verifySeconds / Math.max(1, s.rounds), 2)} ms a pass` +
    (result.reconnects ? `; ${result.reconnects} reconnects` : "");
  if (result.prediction) {
    details += `; prediction: ${result.prediction.accepted} tokens in the reply, ` +
      `${result.prediction.rejected} not (${s.predictedAccepted} drafted from it and accepted)`;
  }
  spec.show({ tps: s.tokensPerSecond, acceptance: s.acceptance, mal: s.meanAcceptedLength,
    tokens: s.generated, prediction: result.prediction, details });
  if (compare) {
    signal.throwIfAborted(); // stopped in the drafting run's last round: no cloud-only run
    const alone = await run({ ...options, source: "cloud" }, renderer(cloud, dropped));
    cloud.tps = alone.stats.tokensPerSecond;
    cloud.show({ tps: cloud.tps, tokens: alone.stats.generated,
      details: `verify ${fixed(alone.stats.verifySeconds, 2)} s` });
  }
}

async function generate() {
  if (state.controller) return;
  const edge = document.body.dataset.mode === "edge";
  setError("");
  let form;
  try {
    form = fields();
  } catch (exc) {
    setError(exc.message);
    setState("error");
    return;
  }
  if (!form.prompt.trim()) {
    setError(chatMode() && !edge ? "Write a message first." : "Write a prompt first.");
    return;
  }
  setState("running");
  const controller = new AbortController();
  state.controller = controller;
  const compare = $("compare").checked;
  spec.reset();
  cloud.reset();
  $("speedup").textContent = "–";
  let outcome = "done";
  try {
    if (edge) await generateEdge(form, compare, controller.signal);
    else await generateApi(form, compare, controller.signal);
    if (compare) $("speedup").textContent = fixed(spec.tps / cloud.tps, 2);
  } catch (exc) {
    if (exc.name === "AbortError") {
      outcome = "stopped";
    } else {
      outcome = "error";
      setError(exc instanceof api.ApiError ? exc.message
        : exc.code ? `${exc.code}: ${exc.message}` : `Request failed: ${exc.message || exc}`);
    }
  } finally {
    state.controller = null;
    setState(outcome);
  }
}

function clear() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  spec.reset();
  cloud.reset();
  setError("");
  setState("idle");
}

/** Shows the controls of `mode` ("api" or "edge"), and the API's model where it is one. */
function switchTo(mode) {
  document.body.dataset.mode = mode;
  document.querySelector(`input[name=where][value=${mode}]`).checked = true;
  $("spec-what").textContent = mode === "edge" ? "drafted in this page, verified by the server"
    : "edge draft + cloud verify";
  clear();
  if (mode === "api" && !state.model) loadModel().catch((exc) => setError(exc.message));
}

function switchApiMode() {
  const chat = chatMode();
  $("endpoint").textContent = chat ? "POST /v1/chat/completions" : "POST /v1/completions";
  $("prompt").placeholder = chat ? "Your message" : "A prompt to continue";
  spec.output.dataset.empty = chat ? "The conversation appears here."
    : "The completion streams here.";
  clear();
}

function showCompare() {
  $("panel-cloud").hidden = !$("compare").checked;
  $("panels").classList.toggle("compare", $("compare").checked);
}

$("form").addEventListener("submit", (event) => { event.preventDefault(); generate(); });
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", clear);
$("compare").addEventListener("change", showCompare);
for (const radio of document.querySelectorAll("input[name=mode]")) {
  radio.addEventListener("change", switchApiMode);
}
for (const radio of document.querySelectorAll("input[name=where]")) {
  radio.addEventListener("change", () => switchTo(radio.value));
}
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
    event.preventDefault();
    generate();
  }
});
$("api-key").value = localStorage.getItem(KEY_STORE) || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem(KEY_STORE, $("api-key").value.trim());
  state.model = null;
  loadModel().then(() => setError(""), (exc) => setError(exc.message));
});
showCompare();
servedBy.then((serves) => switchTo(serves === "api" ? "api" : "edge"));
defaultServer().then((server) => { if (!$("server").value) $("server").value = server; });
window.spececd = { run, connect, loaded, defaultServer, NgramLookup, Alignment, DraftLength,
  decodeFrame, LookupSource, PredictedSource, EdgeSession, Link, ProtocolError };

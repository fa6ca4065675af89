// The page's draft worker: the draft model (model.js, with ONNX Runtime Web) runs here, off
// the page's main thread, so the page never freezes while it drafts, and the page's socket
// is read while a block is drafted ahead. Messages:
// - {id, op: "load", base, runtime, wasmPaths, threads} loads the draft and answers
//   {runtime, threads (those it runs on), isolated, kept: the files read from Cache Storage};
// - {id, op: "draft", history, k, settings} answers the model's block (model.js's draft);
// - {op: "cancel", of: id} stops that draft after its current step (a warm after its
//   current forward; either, still waiting its turn, does nothing), and {op: "expect", of:
//   id, token} a draft after its first unless that is `token`;
// - {id, op: "warm", history} brings the model's cache up to the history (model.js's warm)
//   and answers how many tokens the cache holds.
// Each answer is {id, ok, result} or {id, ok: false, error}.

import { ModelDrafter, pickRuntime } from "./model.js";

let drafter = null;

async function answer({ id, op, ...args }) {
  if (op === "load") {
    const runtime = await pickRuntime(args.runtime);
    drafter = await ModelDrafter.load(args.base, runtime, args.wasmPaths, args.threads);
    return { runtime, threads: drafter.threads, isolated: self.crossOriginIsolated,
      kept: drafter.kept };
  }
  if (op === "draft") {
    if (!drafter) throw new Error("the draft worker has no model loaded");
    try {
      await nextTask(); // a cancel sent while it waited its turn is taken first
      if (cancelled.has(id)) {
        const { mode, params } = args.settings;
        return { tokens: [], dists: mode === "exact" && params.temperature > 0 ? [] : null };
      }
      return await drafter.draft(args.history, args.k, args.settings, async (tokens) => {
        await nextTask(); // a cancel or an expect waiting is taken first
        return cancelled.has(id) || (expected.has(id) && tokens[0] !== expected.get(id));
      });
    } finally {
      cancelled.delete(id);
      expected.delete(id);
    }
  }
  if (op === "warm") {
    if (!drafter) throw new Error("the draft worker has no model loaded");
    try {
      return await drafter.warm(args.history, async () => {
        await nextTask(); // a cancel waiting is taken first
        return cancelled.has(id);
      });
    } finally {
      cancelled.delete(id);
    }
  }
  throw new Error(`the draft worker has no operation ${op}`);
}

/** A promise settled after the messages already queued for this worker are taken (a task,
 * not a microtask: the steps of a draft never yield to messages by themselves). */
const channel = new MessageChannel();
const settled = [];
channel.port1.onmessage = () => settled.shift()();
function nextTask() {
  return new Promise((resolve) => {
    settled.push(resolve);
    channel.port2.postMessage(null);
  });
}

// Drafts asked to stop after their current step ({op: "cancel", of: id}), and those whose
// first token must be a given one ({op: "expect", of: id, token}: else they stop after it),
// taken at once, between the steps of the draft in flight.
const cancelled = new Set();
const expected = new Map();
const running = new Set(); // the drafts and warms asked for and not yet answered

// One message at a time, in order: a draft is answered after the one before it.
let queue = Promise.resolve();
self.onmessage = ({ data }) => {
  if (data.op === "cancel" || data.op === "expect") {
    if (!running.has(data.of)) return; // answered already
    if (data.op === "cancel") cancelled.add(data.of);
    else expected.set(data.of, data.token);
    return;
  }
  if (data.op === "draft" || data.op === "warm") running.add(data.id);
  queue = queue.then(() => answer(data)).then(
    (result) => self.postMessage({ id: data.id, ok: true, result }),
    (exc) => self.postMessage({ id: data.id, ok: false, error: String(exc?.message || exc) }))
    .finally(() => running.delete(data.id));
};

// The page's draft worker: the draft model (model.js, with ONNX Runtime Web) runs here, off
// the page's main thread, so the page never freezes while it drafts, and the page's socket
// is read while a block is drafted ahead. Messages: {id, op: "load", base, runtime,
// wasmPaths, threads} loads the draft and answers {runtime, threads, kept: the files read
// from Cache Storage}; {id, op: "draft",
// history, k, settings} answers the model's block (model.js's draft) and the seconds it
// took; {op: "cancel", of: id} stops that draft after its current step; {id, op: "warm",
// history} brings the model's cache up to the history (model.js's warm). Each answer is {id, ok, result} or {id, ok: false, error}.

import { ModelDrafter, pickRuntime } from "./model.js";

let drafter = null;

async function answer({ id, op, ...args }) {
  if (op === "load") {
    const runtime = await pickRuntime(args.runtime);
    drafter = await ModelDrafter.load(args.base, runtime, args.wasmPaths, args.threads);
    return { runtime, threads: args.threads, kept: drafter.kept };
  }
  if (op === "draft") {
    if (!drafter) throw new Error("the draft worker has no model loaded");
    const t0 = performance.now();
    const block = await drafter.draft(args.history, args.k, args.settings, async () => {
      await nextTask(); // a cancel message waiting is taken first
      return cancelled.has(id);
    });
    cancelled.delete(id);
    return { ...block, seconds: (performance.now() - t0) / 1000 };
  }
  if (op === "warm") {
    if (!drafter) throw new Error("the draft worker has no model loaded");
    return drafter.warm(args.history);
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

// Drafts asked to stop after their current step ({op: "cancel", of: id}: taken at once,
// between the steps of the draft in flight).
const cancelled = new Set();

// One message at a time, in order: a draft is answered after the one before it.
let queue = Promise.resolve();
self.onmessage = ({ data }) => {
  if (data.op === "cancel") {
    cancelled.add(data.of);
    return;
  }
  queue = queue.then(() => answer(data)).then(
    (result) => self.postMessage({ id: data.id, ok: true, result }),
    (exc) => self.postMessage({ id: data.id, ok: false, error: String(exc?.message || exc) }));
};
